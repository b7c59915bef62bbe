// C++ API of attnres: the same torch ops Python uses, called through the
// dispatcher (so CPU and CUDA tensors both work). Link against the attnres
// op library (CMake target `attnres_ops`) or load the Python extension.
//
//   auto [h, rstd, weights] = attnres::depth_attention_fwd(sources, query,
//                                                          gain, 1e-6, 1.0);
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <tuple>
#include <vector>

namespace attnres {

// h [..., D] in the sources' dtype; rstd and weights [N, ...] in the
// accumulation dtype (fp32, or fp64 for fp64 sources).
std::tuple<at::Tensor, at::Tensor, at::Tensor> depth_attention_fwd(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale);

// Gradients of every source, the query and the gain (the gain gradient is
// returned even when norm_weight is None: it is then the gradient of an
// implicit all-ones gain).
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>
depth_attention_bwd(const at::Tensor& grad_out, at::TensorList sources,
                    const at::Tensor& query,
                    const std::optional<at::Tensor>& norm_weight,
                    const at::Tensor& rstd, const at::Tensor& weights,
                    double scale);

}  // namespace attnres
