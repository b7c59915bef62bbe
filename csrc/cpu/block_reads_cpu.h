// CPU kernels of the two-phase Block read ops (docs/design.md §10), built
// with the vector ISA flags like kernels_cpu.cpp; reached only through
// csrc/block_reads.cpp, which checks the arguments, allocates the outputs
// and checks the CPU's capability first. Never called with T == 0.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace attnres {
namespace cpu {

// Phase 1: N completed sources, S readers, T tokens of width D.
struct BlockReadsForwardCall {
  int64_t N, S, D, T;
  at::TensorList sources;
  const at::Tensor& u;  // [S, D] scale * query * gain, accumulation dtype, contiguous
  double eps;
  std::vector<at::Tensor>& partial_outs;  // S contiguous [..., D], sources' dtype
  at::Tensor& lse;                        // [S, ...] accumulation dtype
  at::Tensor& rstd;                       // [N, ...]
  at::Tensor& weights;                    // [S, N, ...]
};

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
};

// Phase 2: one reader, one more source (the partial block sum).
struct MergeForwardCall {
  int64_t D, T;
  const at::Tensor& partial_out;  // [..., D] any strides
  const at::Tensor& lse;          // [...] contiguous
  const at::Tensor& block_sum;    // [..., D] any strides
  const at::Tensor& u;            // [D]
  double eps;
  at::Tensor& out;     // contiguous
  at::Tensor& rstd;    // [...]
  at::Tensor& weight;  // [...]
};

struct MergeBackwardCall {
  int64_t D, T;
  const at::Tensor& grad_out;  // [..., D] any strides
  const at::Tensor& partial_out;
  const at::Tensor& block_sum;
  const at::Tensor& u;
  const at::Tensor& rstd;    // contiguous
  const at::Tensor& weight;  // contiguous
  at::Tensor& grad_partial_out;  // contiguous, or undefined (not wanted)
  at::Tensor& grad_lse;          // contiguous, or undefined
  at::Tensor& grad_block_sum;    // contiguous, or undefined
  at::Tensor& z;                 // [D], or undefined
};

void block_reads_forward(const BlockReadsForwardCall& call);
void block_reads_backward(const BlockReadsBackwardCall& call);
void block_read_merge_forward(const MergeForwardCall& call);
void block_read_merge_backward(const MergeBackwardCall& call);

}  // namespace cpu
}  // namespace attnres
