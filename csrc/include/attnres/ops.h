// C++ API of attnres: the same torch ops Python uses, called through the
// dispatcher (so CPU and CUDA tensors both work, and autograd — registered
// in C++ — records them). Link the op library: CMake target
// `attnres::attnres` (find_package(attnres)).
//
//   at::Tensor h = attnres::depth_attention(sources, query, gain);
//   h.sum().backward();  // gradients reach sources, query and gain
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
// sources, the query and the gain. h has the sources' shape and dtype.
at::Tensor depth_attention(at::TensorList sources, const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight = std::nullopt,
                           double eps = 1e-6, double scale = 1.0);

// h and the softmax weights [N, ...] (accumulation dtype: fp32, or fp64 for
// fp64 sources); both are differentiable.
std::tuple<at::Tensor, at::Tensor> depth_attention_with_weights(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight = std::nullopt,
    double eps = 1e-6, double scale = 1.0);

// The raw ops. Forward: h [..., D] in the sources' dtype; rstd and weights
// [N, ...] in the accumulation dtype (rstd is not differentiable).
std::tuple<at::Tensor, at::Tensor, at::Tensor> depth_attention_fwd(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale);

// Backward from the gradients of h and of the weights (either may be
// absent), given the forward's three outputs out (h), rstd and weights. output_mask: N + 2 flags (each source, query, norm_weight); a
// gradient not asked for is not computed. The first result holds the wanted
// source gradients only, in source order; an unwanted query or gain
// gradient is undefined. The gain gradient can be asked for even when
// norm_weight is absent: it is then the gradient of an implicit all-ones
// gain.
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>
depth_attention_bwd(const std::optional<at::Tensor>& grad_out,
                    const std::optional<at::Tensor>& grad_weights,
                    at::TensorList sources, const at::Tensor& query,
                    const std::optional<at::Tensor>& norm_weight,
                    const at::Tensor& out, const at::Tensor& rstd,
                    const at::Tensor& weights, double scale,
                    const c10::List<bool>& output_mask);

// Every gradient, from the gradient of h alone.
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>
depth_attention_bwd(const at::Tensor& grad_out, at::TensorList sources,
                    const at::Tensor& query,
                    const std::optional<at::Tensor>& norm_weight,
                    const at::Tensor& out, const at::Tensor& rstd,
                    const at::Tensor& weights, double scale);

// The read with a fused output norm (docs/design.md §11):
// y = RMSNorm(h) * out_weight (eps out_eps), differentiable with respect to
// the sources, query, norm_weight and out_weight (out_weight: [D], like the
// query). Use it in place of a read followed by the sublayer's own RMSNorm.
at::Tensor depth_attention_normed(at::TensorList sources, const at::Tensor& query,
                                  const std::optional<at::Tensor>& norm_weight,
                                  const at::Tensor& out_weight, double eps = 1e-6,
                                  double scale = 1.0, double out_eps = 1e-6);

// y and the depth softmax weights [N, ...] (both differentiable).
std::tuple<at::Tensor, at::Tensor> depth_attention_normed_with_weights(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& out_weight,
    double eps = 1e-6, double scale = 1.0, double out_eps = 1e-6);

// The raw normed ops. Forward: (y, h, rstd, weights, out_rstd); h is the
// read before the norm when keep_h (the backward's input), else empty;
// out_rstd [...] (accumulation dtype) is the norm's rstd per token.
using NormedForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
NormedForward depth_attention_normed_fwd(at::TensorList sources, const at::Tensor& query,
                                         const std::optional<at::Tensor>& norm_weight,
                                         const at::Tensor& out_weight, double eps,
                                         double scale, double out_eps, bool keep_h);

// Backward from the gradients of y and of the weights; output_mask: N + 3
// flags (each source, query, norm_weight, out_weight). Results as
// depth_attention_bwd's, plus the gradient of out_weight (undefined when
// not wanted).
using NormedBackward = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor>;
NormedBackward depth_attention_normed_bwd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weights, const at::Tensor& out_rstd, double scale,
    const c10::List<bool>& output_mask);

}  // namespace attnres
