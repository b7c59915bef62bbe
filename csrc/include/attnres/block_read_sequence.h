// The host sequence of the two-phase Block reads' forward ops (docs/design.md
// §10), shared by every device, as op_sequence.h is for depth_attention:
//   check the arguments -> u (accumulation dtype) -> allocate the outputs
//   -> the device's kernel.
// A device supplies its two forward kernels (BlockReadKernels) and registers
// them with register_block_read_kernels (csrc/block_reads.cpp for the CPU,
// csrc/cuda/block_reads_cuda.cu for CUDA). The backward ops have CPU kernels
// only; CUDA registers them as NotImplementedError (block_read_no_cuda_kernel).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "attnres/block_reads.h"
#include "attnres/op_sequence.h"  // OutNormForward

namespace attnres {

// Phase 1: N completed sources, S readers, T tokens of width D (T > 0).
struct BlockReadsForwardCall {
  int64_t N, S, D, T;
  at::TensorList sources;  // [..., D] any strides
  const at::Tensor& u;     // [S, D] scale * query * gain, accumulation dtype, contiguous
  double eps;
  std::vector<at::Tensor>& partial_outs;  // S contiguous [..., D], sources' dtype
  at::Tensor& lse;                        // [S, ...] accumulation dtype
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
  const at::Tensor& lse;          // [...] contiguous
  const at::Tensor& block_sum;    // [..., D] any strides
  const at::Tensor& u;            // [D]
  double eps;
  at::Tensor& out;     // contiguous (y with out_norm, else h); may be partial_out itself
  at::Tensor& rstd;    // [...]
  at::Tensor& weight;  // [...]
  // The fused output norm (docs/design.md §11): out is y = RMSNorm(h) * w,
  // h written to out_norm->h where that is defined. Null: out is h.
  const OutNormForward* out_norm = nullptr;
};

struct BlockReadKernels {
  void (*check_device)();  // before any kernel runs (the CPU's ISA), or null
  void (*reads_forward)(const BlockReadsForwardCall&);
  void (*merge_forward)(const MergeForwardCall&);
};

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> run_block_reads_fwd(
    const BlockReadKernels& k, at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, double eps, double scale);

BlockReadsNormedForward run_block_reads_normed_fwd(const BlockReadKernels& k,
                                                   at::TensorList sources,
                                                   const at::Tensor& queries,
                                                   const std::optional<at::Tensor>& norm_weights,
                                                   const at::Tensor& out_weight, double eps,
                                                   double scale, double out_eps, bool keep_h);

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_block_read_merge_fwd(
    const BlockReadKernels& k, const at::Tensor& partial_out, const at::Tensor& lse,
    const at::Tensor& block_sum, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale);

void run_block_read_merge_inplace(const BlockReadKernels& k, const at::Tensor& partial_out,
                                  const at::Tensor& lse, const at::Tensor& block_sum,
                                  const at::Tensor& query,
                                  const std::optional<at::Tensor>& norm_weight, double eps,
                                  double scale);

MergeNormedForward run_block_read_merge_normed_fwd(
    const BlockReadKernels& k, const at::Tensor& partial_out, const at::Tensor& lse,
    const at::Tensor& block_sum, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& out_weight, double eps,
    double scale, double out_eps, bool keep_h);

void run_block_read_merge_normed_inplace(const BlockReadKernels& k,
                                         const at::Tensor& partial_out, const at::Tensor& lse,
                                         const at::Tensor& block_sum, const at::Tensor& query,
                                         const std::optional<at::Tensor>& norm_weight,
                                         const at::Tensor& out_weight, double eps, double scale,
                                         double out_eps);

// Registers a device's kernels for the six forward ops (phase 1 and phase 2,
// plain and normed, the in-place forms included) under its dispatch key.
template <const BlockReadKernels& k>
void register_block_read_kernels(torch::Library& m) {
  m.impl("block_reads_fwd", [](at::TensorList sources, const at::Tensor& queries,
                               const std::optional<at::Tensor>& norm_weights, double eps,
                               double scale) {
    return run_block_reads_fwd(k, sources, queries, norm_weights, eps, scale);
  });
  m.impl("block_reads_normed_fwd",
         [](at::TensorList sources, const at::Tensor& queries,
            const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight,
            double eps, double scale, double out_eps, bool keep_h) {
           return run_block_reads_normed_fwd(k, sources, queries, norm_weights, out_weight, eps,
                                             scale, out_eps, keep_h);
         });
  m.impl("block_read_merge_fwd",
         [](const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
            const at::Tensor& query, const std::optional<at::Tensor>& norm_weight, double eps,
            double scale) {
           return run_block_read_merge_fwd(k, partial_out, lse, block_sum, query, norm_weight,
                                           eps, scale);
         });
  m.impl("block_read_merge_inplace",
         [](const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
            const at::Tensor& query, const std::optional<at::Tensor>& norm_weight, double eps,
            double scale) {
           run_block_read_merge_inplace(k, partial_out, lse, block_sum, query, norm_weight, eps,
                                        scale);
         });
  m.impl("block_read_merge_normed_fwd",
         [](const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
            const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
            const at::Tensor& out_weight, double eps, double scale, double out_eps,
            bool keep_h) {
           return run_block_read_merge_normed_fwd(k, partial_out, lse, block_sum, query,
                                                  norm_weight, out_weight, eps, scale, out_eps,
                                                  keep_h);
         });
  m.impl("block_read_merge_normed_inplace",
         [](const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
            const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
            const at::Tensor& out_weight, double eps, double scale, double out_eps) {
           run_block_read_merge_normed_inplace(k, partial_out, lse, block_sum, query,
                                               norm_weight, out_weight, eps, scale, out_eps);
         });
}

// The backward ops on a device without their kernels: NotImplementedError
// naming the op (attnres.DepthStream reads two-phase there only where no
// gradient is needed).
[[noreturn]] void block_read_no_kernel(const char* op, const char* device);
void register_block_read_backward_missing_cuda(torch::Library& m);

}  // namespace attnres
