// C++ API of the two-phase Block read ops (docs/design.md §10), called
// through the dispatcher like ops.h (autograd is registered in C++). CPU
// and CUDA kernels for every op (attnres::DepthStream reads two-phase on
// CUDA only under BlockReads::kTwoPhase: the CUDA kernels have not run on a
// GPU yet).
//
//   // phase 1, once per block: the completed sources C, the block's S readers
//   auto [partials, lse] = attnres::block_reads(completed, queries, gains);
//   // read 0 of the block: h_0 = partials[0]; read j >= 1 (partial block sum P):
//   at::Tensor h = attnres::block_read_merge(partials[j], lse[j], P, query_j, gain_j);
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <tuple>
#include <vector>

namespace attnres {

// Phase 1, differentiable: for each of the S readers (queries [S, D],
// norm_weights [S, D] or nullopt) its softmax-weighted average over the N
// completed sources (S tensors [..., D], the sources' dtype) and the
// log-sum-exp of its scores ([S, ...], float64 for every dtype: its gradient
// can exceed float32's range, docs/design.md §10).
std::tuple<std::vector<at::Tensor>, at::Tensor> block_reads(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights = std::nullopt, double eps = 1e-6,
    double scale = 1.0);

// Phase 1 with reader 0's output norm fused (docs/design.md §11):
// partials[0] is RMSNorm(h_0) * out_weight (eps out_eps), reader 0's read;
// the others as block_reads'. Differentiable (out_weight included).
std::tuple<std::vector<at::Tensor>, at::Tensor> block_reads_normed(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight,
    double eps = 1e-6, double scale = 1.0, double out_eps = 1e-6);

// Phase 2, differentiable: one reader's h from its phase-1 partial output
// and lse and the partial block sum, equal to depth_attention over the
// completed sources and block_sum.
at::Tensor block_read_merge(const at::Tensor& partial_out, const at::Tensor& lse,
                            const at::Tensor& block_sum, const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight = std::nullopt,
                            double eps = 1e-6, double scale = 1.0);

// Phase 2 without autograd (inference): h is written into partial_out (a
// contiguous phase-1 output this read consumes); raises when grad mode is
// on and an input requires grad.
void block_read_merge_inplace(const at::Tensor& partial_out, const at::Tensor& lse,
                              const at::Tensor& block_sum, const at::Tensor& query,
                              const std::optional<at::Tensor>& norm_weight = std::nullopt,
                              double eps = 1e-6, double scale = 1.0);

// Phase 2 with the fused output norm (docs/design.md §11): y = RMSNorm(h)
// * out_weight (eps out_eps) for the h block_read_merge returns.
// Differentiable (out_weight included).
at::Tensor block_read_merge_normed(const at::Tensor& partial_out, const at::Tensor& lse,
                                   const at::Tensor& block_sum, const at::Tensor& query,
                                   const std::optional<at::Tensor>& norm_weight,
                                   const at::Tensor& out_weight, double eps = 1e-6,
                                   double scale = 1.0, double out_eps = 1e-6);

// Its inference form: y written into partial_out, as block_read_merge_inplace.
void block_read_merge_normed_inplace(const at::Tensor& partial_out, const at::Tensor& lse,
                                     const at::Tensor& block_sum, const at::Tensor& query,
                                     const std::optional<at::Tensor>& norm_weight,
                                     const at::Tensor& out_weight, double eps = 1e-6,
                                     double scale = 1.0, double out_eps = 1e-6);

// The raw ops (schemas in csrc/ops.cpp).
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> block_reads_fwd(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, double eps, double scale);

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> block_reads_bwd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask);

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_read_merge_fwd(
    const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight, double eps,
    double scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_read_merge_bwd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& rstd, const at::Tensor& weight, double scale,
    const c10::List<bool>& output_mask);

// (partial_outs, lse, rstd, weights, h_0 (empty unless keep_h), out_rstd)
using BlockReadsNormedForward = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor,
                                           at::Tensor, at::Tensor, at::Tensor>;
BlockReadsNormedForward block_reads_normed_fwd(at::TensorList sources, const at::Tensor& queries,
                                               const std::optional<at::Tensor>& norm_weights,
                                               const at::Tensor& out_weight, double eps,
                                               double scale, double out_eps, bool keep_h);

// (grad_sources (the wanted ones), grad_queries, grad_norm_weights, grad_out_weight)
using BlockReadsNormedBackward =
    std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor>;
BlockReadsNormedBackward block_reads_normed_bwd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weights,
    const at::Tensor& out_rstd, double scale, const c10::List<bool>& output_mask);

// (out = y, h (empty unless keep_h), rstd, weight, out_rstd)
using MergeNormedForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
MergeNormedForward block_read_merge_normed_fwd(
    const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, double eps, double scale, double out_eps, bool keep_h);

// (grad_partial_out, grad_lse, grad_block_sum, grad_query, grad_norm_weight, grad_out_weight)
using MergeNormedBackward =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
MergeNormedBackward block_read_merge_normed_bwd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weight, const at::Tensor& out_rstd, double scale,
    const c10::List<bool>& output_mask);

}  // namespace attnres
