// The host sequence of the two-phase Block read ops (docs/design.md §10),
// shared by every device, as op_sequence.h is for depth_attention:
//   check the arguments -> u (accumulation dtype) -> allocate the outputs
//   -> the device's kernel.
// A device supplies its four kernels (BlockReadKernels: phase 1 and phase 2,
// forward and backward) and registers them with register_block_read_kernels
// (csrc/cpu/register_cpu.cpp for the CPU, csrc/cuda/block_reads_cuda.cu for CUDA).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "attnres/block_reads.h"
#include "attnres/op_sequence.h"  // OutNormForward, OutNormBackward, BindKernels

namespace attnres {

// Phase 1: N completed sources, S readers, T tokens of width D (T > 0).
struct BlockReadsForwardCall {
  int64_t N, S, D, T;
  at::TensorList sources;  // [..., D] any strides
  const at::Tensor& u;     // [S, D] scale * query * gain, accumulation dtype, contiguous
  double eps;
  std::vector<at::Tensor>& partial_outs;  // S contiguous [..., D], sources' dtype
  at::Tensor& lse;                        // [S, ...] float64 (every dtype, §10)
  at::Tensor& rstd;                       // [N, ...]
  at::Tensor& weights;                    // [S, N, ...]
  // The fused output norm of reader 0 (docs/design.md §11): partial_outs[0]
  // is y_0 = RMSNorm(h_0) * w (reader 0's read is final at phase 1), h_0
  // written to out_norm->h where that is defined. Null: partial_outs[0] is h_0.
  const OutNormForward* out_norm = nullptr;
};

// Phase 2: one reader, one more source (the partial block sum), T > 0.
struct MergeForwardCall {
  int64_t D, T;
  const at::Tensor& partial_out;  // [..., D] any strides
  const at::Tensor& lse;          // [...] contiguous, float64
  const at::Tensor& block_sum;    // [..., D] any strides
  const at::Tensor& u;            // [D]
  double eps;
  at::Tensor& out;     // contiguous (y with out_norm, else h); may be partial_out itself
  at::Tensor& rstd;    // [...]
  at::Tensor& weight;  // [...]
  // The fused output norm (docs/design.md §11): out is y = RMSNorm(h) * w,
  // h written to out_norm->h where that is defined. Null: out is h.
  const OutNormForward* out_norm = nullptr;
  // The fused prefix add (docs/design.md §12): block_sum is P and the read's
  // block sum is P' = P + delta (in the sources' dtype, rounded as
  // torch.add), formed per token into prefix->sum and read from there.
  const PrefixAdd* prefix = nullptr;
};

// Phase 1's backward (T > 0): the S readers' gradients at once.
struct BlockReadsBackwardCall {
  int64_t N, S, D, T;
  // S gradients of the partial outputs (any strides), or empty: none.
  at::TensorList grad_partial_outs;
  const at::Tensor& grad_lse;  // [S, ...] contiguous float64, or undefined
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

// Phase 2's backward (T > 0): the gradients of one reader's merge.
struct MergeBackwardCall {
  int64_t D, T;
  const at::Tensor& grad_out;  // [..., D] any strides
  const at::Tensor& partial_out;
  const at::Tensor& block_sum;
  const at::Tensor& u;
  const at::Tensor& rstd;    // contiguous
  const at::Tensor& weight;  // contiguous
  at::Tensor& grad_partial_out;  // contiguous, or undefined (not wanted)
  at::Tensor& grad_lse;          // contiguous float64, or undefined
  at::Tensor& grad_block_sum;    // contiguous, or undefined
  at::Tensor& z;                 // [D], or undefined: set to sum_t alpha_t P_t
  // With the fused output norm grad_out is dy (the gradient of y) and h
  // the forward's h (any strides): dh is formed per token from them;
  // out_norm->grad_weight (when defined) is set to the out_weight gradient.
  const OutNormBackward* out_norm = nullptr;
  const at::Tensor* h = nullptr;
  // The gradient of the fused prefix add's P' output (any strides), added
  // per element to grad_block_sum (which is then also delta's); or null.
  const at::Tensor* grad_sum = nullptr;
};

struct BlockReadKernels {
  void (*check_device)();  // before any kernel runs (the CPU's ISA), or null
  void (*reads_forward)(const BlockReadsForwardCall&);
  void (*merge_forward)(const MergeForwardCall&);
  void (*merge_backward)(const MergeBackwardCall&);
  void (*reads_backward)(const BlockReadsBackwardCall&);
};

// The ops' host functions: the schemas' arguments after the device's kernels.
BlockReadsForward run_block_reads_fwd(const BlockReadKernels& k, at::TensorList sources,
                                      const at::Tensor& queries,
                                      const std::optional<at::Tensor>& norm_weights, double eps,
                                      double scale, const std::optional<at::Tensor>& out_weight,
                                      std::optional<double> out_eps, bool keep_h);

BlockReadsBackward run_block_reads_bwd(
    const BlockReadKernels& k, at::TensorList grad_partial_outs,
    const std::optional<at::Tensor>& grad_lse, at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight, const std::optional<at::Tensor>& h,
    const std::optional<at::Tensor>& out_rstd);

MergeForward run_block_read_merge_fwd(const BlockReadKernels& k, const at::Tensor& partial_out,
                                      const at::Tensor& lse, const at::Tensor& block_sum,
                                      const at::Tensor& query,
                                      const std::optional<at::Tensor>& norm_weight, double eps,
                                      double scale, const std::optional<at::Tensor>& out_weight,
                                      std::optional<double> out_eps, bool keep_h,
                                      const std::optional<at::Tensor>& delta);

at::Tensor run_block_read_merge_inplace(const BlockReadKernels& k, const at::Tensor& partial_out,
                                        const at::Tensor& lse, const at::Tensor& block_sum,
                                        const at::Tensor& query,
                                        const std::optional<at::Tensor>& norm_weight, double eps,
                                        double scale, const std::optional<at::Tensor>& out_weight,
                                        std::optional<double> out_eps,
                                        const std::optional<at::Tensor>& delta);

MergeBackward run_block_read_merge_bwd(
    const BlockReadKernels& k, const at::Tensor& grad_out, const at::Tensor& partial_out,
    const at::Tensor& block_sum, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& rstd,
    const at::Tensor& weight, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight, const std::optional<at::Tensor>& h,
    const std::optional<at::Tensor>& out_rstd, const std::optional<at::Tensor>& grad_block_sum_out);

// Registers a device's kernels for the five ops under its dispatch key.
template <const BlockReadKernels& k>
void register_block_read_kernels(torch::Library& m) {
  m.impl("block_reads_fwd", &BindKernels<&run_block_reads_fwd, k>::call);
  m.impl("block_reads_bwd", &BindKernels<&run_block_reads_bwd, k>::call);
  m.impl("block_read_merge_fwd", &BindKernels<&run_block_read_merge_fwd, k>::call);
  m.impl("block_read_merge_bwd", &BindKernels<&run_block_read_merge_bwd, k>::call);
  m.impl("block_read_merge_inplace", &BindKernels<&run_block_read_merge_inplace, k>::call);
}

}  // namespace attnres
