// C++ API of attnres: the same torch ops Python uses, called through the
// dispatcher (so CPU and CUDA tensors both work, and autograd — registered
// in C++ — records them). Link the op library: CMake target
// `attnres::attnres` (find_package(attnres)).
//
//   at::Tensor h = attnres::depth_attention(sources, query, gain);
//   h.sum().backward();  // gradients reach sources, query and gain
//
// Optional parts are optional arguments: with out_weight the read returns
// y = RMSNorm(h) * out_weight (the fused output norm, docs/design.md §11;
// out_eps follows eps unless given).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <tuple>
#include <vector>

namespace attnres {

// h = sum_i softmax_i(scale * <query, RMSNorm(v_i) * norm_weight>) v_i over
// the N sources (docs/design.md §1), differentiable with respect to the
// sources, the query, the gain and out_weight. The result has the sources'
// shape and dtype: h, or y = RMSNorm(h) * out_weight with out_weight ([D],
// like the query).
at::Tensor depth_attention(at::TensorList sources, const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight = std::nullopt,
                           double eps = 1e-6, double scale = 1.0,
                           const std::optional<at::Tensor>& out_weight = std::nullopt,
                           std::optional<double> out_eps = std::nullopt);

// The read and the softmax weights [N, ...] (accumulation dtype: fp32, or
// fp64 for fp64 sources); both are differentiable.
std::tuple<at::Tensor, at::Tensor> depth_attention_with_weights(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight = std::nullopt, double eps = 1e-6,
    double scale = 1.0, const std::optional<at::Tensor>& out_weight = std::nullopt,
    std::optional<double> out_eps = std::nullopt);

// The raw forward op: (out, rstd, weights, h, out_rstd). out is h, or y with
// out_weight; rstd and weights [N, ...] in the accumulation dtype (rstd is
// not differentiable). The output norm's statistics, as native_layer_norm
// returns its own: h (the read before the norm, written only with keep_h)
// and out_rstd [...] (the norm's rstd per token); both are empty tensors
// without out_weight. With delta (the fused prefix add, docs/design.md §12)
// the last source is the partial block sum P, the read is over P' = P +
// delta (rounded as at::add), and P' is the sixth result (empty without
// delta); its gradient reaches P and delta.
using DepthAttentionForward =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
DepthAttentionForward depth_attention_fwd(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale,
    const std::optional<at::Tensor>& out_weight = std::nullopt,
    std::optional<double> out_eps = std::nullopt, bool keep_h = false,
    const std::optional<at::Tensor>& delta = std::nullopt);

// The raw backward op, from the gradients of out and of the weights (either
// may be absent), given the forward's h (its out without out_weight), rstd
// and weights, and with out_weight its out_rstd. output_mask: N + 2 flags
// (each source, query, norm_weight), N + 3 with out_weight; a gradient not
// asked for is not computed. The first result holds the wanted source
// gradients only, in source order; an unwanted query, gain or out_weight
// gradient is undefined. The gain gradient can be asked for even when
// norm_weight is absent: it is then the gradient of an implicit all-ones
// gain. With the prefix add the last source is the forward's P', and
// grad_prefix_out (P''s own gradient) is added to its gradient.
using DepthAttentionBackward =
    std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor>;
DepthAttentionBackward depth_attention_bwd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight = std::nullopt,
    const std::optional<at::Tensor>& out_rstd = std::nullopt,
    const std::optional<at::Tensor>& grad_prefix_out = std::nullopt);

}  // namespace attnres
