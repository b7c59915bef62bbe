// C++ API of the two-phase Block read ops (docs/design.md §10), called
// through the dispatcher like ops.h (autograd is registered in C++). CPU
// and CUDA kernels for every op (attnres::DepthStream reads two-phase on
// CUDA only under BlockReads::kTwoPhase: on an H200 two-phase reads were
// slower than one-call at S = 2, docs/design.md §10).
//
//   // phase 1, once per block: the completed sources C, the block's S readers
//   auto [partials, lse] = attnres::block_reads(completed, queries, gains);
//   // read 0 of the block: h_0 = partials[0]; read j >= 1 (partial block sum P):
//   at::Tensor h = attnres::block_read_merge(partials[j], lse[j], P, query_j, gain_j);
//
// out_weight (with out_eps, which follows eps unless given) fuses the read's
// output norm (docs/design.md §11): phase 1 applies it to reader 0's read,
// partials[0] = RMSNorm(h_0) * out_weight; a merge returns RMSNorm(h) *
// out_weight.
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
    double scale = 1.0, const std::optional<at::Tensor>& out_weight = std::nullopt,
    std::optional<double> out_eps = std::nullopt);

// Phase 2, differentiable: one reader's h (or y, with out_weight) from its
// phase-1 partial output and lse and the partial block sum, equal to
// depth_attention over the completed sources and block_sum.
at::Tensor block_read_merge(const at::Tensor& partial_out, const at::Tensor& lse,
                            const at::Tensor& block_sum, const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight = std::nullopt,
                            double eps = 1e-6, double scale = 1.0,
                            const std::optional<at::Tensor>& out_weight = std::nullopt,
                            std::optional<double> out_eps = std::nullopt);

// Phase 2 without autograd (inference): the read is written into
// partial_out (a contiguous phase-1 output this read consumes); raises when
// grad mode is on and an input requires grad. With delta the read's block
// sum is P' = block_sum + delta, returned (an empty tensor without delta).
at::Tensor block_read_merge_inplace(const at::Tensor& partial_out, const at::Tensor& lse,
                                    const at::Tensor& block_sum, const at::Tensor& query,
                                    const std::optional<at::Tensor>& norm_weight = std::nullopt,
                                    double eps = 1e-6, double scale = 1.0,
                                    const std::optional<at::Tensor>& out_weight = std::nullopt,
                                    std::optional<double> out_eps = std::nullopt,
                                    const std::optional<at::Tensor>& delta = std::nullopt);

// The raw ops (schemas in csrc/ops.cpp). Phase 1's forward:
// (partial_outs, lse, rstd [N, ...], weights [S, N, ...], h_0, out_rstd);
// h_0 (written only with keep_h) and out_rstd are the output norm's, empty
// without out_weight.
using BlockReadsForward = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor,
                                     at::Tensor, at::Tensor, at::Tensor>;
BlockReadsForward block_reads_fwd(at::TensorList sources, const at::Tensor& queries,
                                  const std::optional<at::Tensor>& norm_weights, double eps,
                                  double scale,
                                  const std::optional<at::Tensor>& out_weight = std::nullopt,
                                  std::optional<double> out_eps = std::nullopt,
                                  bool keep_h = false);

// (grad_sources (the wanted ones), grad_queries, grad_norm_weights,
// grad_out_weight); output_mask: N + 2 flags (each source, queries,
// norm_weights), N + 3 with out_weight (then h is h_0 and out_rstd the
// forward's).
using BlockReadsBackward = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor>;
BlockReadsBackward block_reads_bwd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight = std::nullopt,
    const std::optional<at::Tensor>& h = std::nullopt,
    const std::optional<at::Tensor>& out_rstd = std::nullopt);

// Phase 2's forward: (out (h, or y with out_weight), rstd, weight, h,
// out_rstd, block_sum_out). delta fuses the prefix add (docs/design.md
// §12): the read's block sum is P' = block_sum + delta, returned as
// block_sum_out (empty without delta).
using MergeForward =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
MergeForward block_read_merge_fwd(const at::Tensor& partial_out, const at::Tensor& lse,
                                  const at::Tensor& block_sum, const at::Tensor& query,
                                  const std::optional<at::Tensor>& norm_weight, double eps,
                                  double scale,
                                  const std::optional<at::Tensor>& out_weight = std::nullopt,
                                  std::optional<double> out_eps = std::nullopt,
                                  bool keep_h = false,
                                  const std::optional<at::Tensor>& delta = std::nullopt);

// (grad_partial_out, grad_lse, grad_block_sum, grad_query, grad_norm_weight,
// grad_out_weight); output_mask: 5 flags (partial_out, lse, block_sum,
// query, norm_weight), 6 with out_weight. With the prefix add block_sum is
// the forward's block_sum_out and grad_block_sum_out (its gradient, or
// nullopt) is added to grad_block_sum.
using MergeBackward =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
MergeBackward block_read_merge_bwd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& rstd, const at::Tensor& weight, double scale,
    const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight = std::nullopt,
    const std::optional<at::Tensor>& h = std::nullopt,
    const std::optional<at::Tensor>& out_rstd = std::nullopt,
    const std::optional<at::Tensor>& grad_block_sum_out = std::nullopt);

}  // namespace attnres
