// C++ API of the two-phase Block read ops (docs/design.md §10), called
// through the dispatcher like ops.h (autograd is registered in C++). CPU
// kernels only: on CUDA tensors the ops raise NotImplementedError naming the
// missing kernel (attnres::DepthStream keeps one-call reads there).
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
// log-sum-exp of its scores ([S, ...], accumulation dtype).
std::tuple<std::vector<at::Tensor>, at::Tensor> block_reads(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights = std::nullopt, double eps = 1e-6,
    double scale = 1.0);

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

}  // namespace attnres
