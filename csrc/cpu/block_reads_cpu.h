// CPU kernels of the two-phase Block read ops (docs/design.md §10), built
// with the vector ISA flags like kernels_cpu.cpp; reached only through
// csrc/block_reads.cpp, which checks the arguments, allocates the outputs
// and checks the CPU's capability first. Never called with T == 0. The
// forward and merge backward calls are device-neutral
// (attnres/block_read_sequence.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "attnres/block_read_sequence.h"  // the forward calls, MergeBackwardCall
#include "attnres/op_sequence.h"  // OutNormBackward

namespace attnres {
namespace cpu {

struct BlockReadsBackwardCall {
  int64_t N, S, D, T;
  // S gradients of the partial outputs (any strides), or empty: none.
  at::TensorList grad_partial_outs;
  const at::Tensor& grad_lse;  // [S, ...] contiguous, or undefined
  at::TensorList sources;
  const at::Tensor& u;        // [S, D]
  const at::Tensor& rstd;     // [N, ...] contiguous
  const at::Tensor& weights;  // [S, N, ...] contiguous
  std::vector<at::Tensor>& grad_sources;  // N: contiguous to fill, or undefined
  at::Tensor& z;  // [S, D] sum of alpha_{s,i} v_i, or undefined (not wanted)
  // With reader 0's fused output norm grad_partial_outs[0] is dy_0 and h
  // the forward's h_0 (any strides); out_norm->grad_weight (when defined)
  // is set to the out_weight gradient.
  const OutNormBackward* out_norm = nullptr;
  const at::Tensor* h = nullptr;
};

void block_reads_forward(const BlockReadsForwardCall& call);
void block_reads_backward(const BlockReadsBackwardCall& call);
void block_read_merge_forward(const MergeForwardCall& call);
void block_read_merge_backward(const MergeBackwardCall& call);

}  // namespace cpu
}  // namespace attnres
