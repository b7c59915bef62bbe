// The attnres operator library: every schema in one TORCH_LIBRARY block
// (the per-device kernels register under TORCH_LIBRARY_IMPL in cpu/ and
// cuda/), plus the C++ API of include/attnres/ops.h.
#include "attnres/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

TORCH_LIBRARY(attnres, m) {
  // Forward: h = sum_i softmax_i(scale * <query, RMSNorm(v_i) * gain>) v_i.
  // Returns h and the per-token statistics the backward needs:
  // rstd [N, ...] and the softmax weights [N, ...] (fp32, fp64 for fp64).
  m.def(
      "depth_attention_fwd(Tensor[] sources, Tensor query, Tensor? "
      "norm_weight, float eps, float scale) -> (Tensor out, Tensor rstd, "
      "Tensor weights)");
  // Backward: gradients of every source, the query and the gain (for an
  // absent gain, the gradient of an implicit all-ones gain).
  m.def(
      "depth_attention_bwd(Tensor grad_out, Tensor[] sources, Tensor query, "
      "Tensor? norm_weight, Tensor rstd, Tensor weights, float scale) -> "
      "(Tensor[] grad_sources, Tensor grad_query, Tensor grad_norm_weight)");
}

namespace attnres {

std::tuple<at::Tensor, at::Tensor, at::Tensor> depth_attention_fwd(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnres::depth_attention_fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              at::TensorList, const at::Tensor&,
              const std::optional<at::Tensor>&, double, double)>();
  return op.call(sources, query, norm_weight, eps, scale);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>
depth_attention_bwd(const at::Tensor& grad_out, at::TensorList sources,
                    const at::Tensor& query,
                    const std::optional<at::Tensor>& norm_weight,
                    const at::Tensor& rstd, const at::Tensor& weights,
                    double scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnres::depth_attention_bwd", "")
          .typed<std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>(
              const at::Tensor&, at::TensorList, const at::Tensor&,
              const std::optional<at::Tensor>&, const at::Tensor&,
              const at::Tensor&, double)>();
  return op.call(grad_out, sources, query, norm_weight, rstd, weights, scale);
}

}  // namespace attnres
