// See include/attnres/op_sequence.h.
#include "attnres/op_sequence.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

namespace attnres {
namespace {

// u = scale * query * gain in the accumulation dtype: the only form of query
// and gain the kernels use.
at::Tensor effective_query(const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight,
                           double scale, at::ScalarType acc) {
  at::Tensor u = query.to(acc).mul(scale);
  if (norm_weight.has_value() && norm_weight->defined()) {
    u.mul_(norm_weight->to(acc));
  }
  return u.contiguous();
}

// dquery = scale * gain * Z and dgain = scale * query * Z (docs/design.md
// §2), in the parameters' dtypes (the gain gradient of an absent gain, the
// gradient of an implicit all-ones gain, has the query's dtype).
std::pair<at::Tensor, at::Tensor> parameter_grads(
    const at::Tensor& z, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double scale) {
  const bool has_gain = norm_weight.has_value() && norm_weight->defined();
  const at::Tensor zs = z.mul(scale);
  at::Tensor grad_query =
      (has_gain ? zs.mul(norm_weight->to(z.scalar_type())) : zs)
          .to(query.scalar_type());
  at::Tensor grad_gain =
      zs.mul(query.to(z.scalar_type()))
          .to(has_gain ? norm_weight->scalar_type() : query.scalar_type());
  return {grad_query, grad_gain};
}

}  // namespace

ForwardResult run_forward(const DeviceKernels& kernels, at::TensorList sources,
                          const at::Tensor& query,
                          const std::optional<at::Tensor>& norm_weight,
                          double eps, double scale) {
  const DepthProblem p =
      check_forward_args(sources, query, norm_weight, eps, scale);
  if (kernels.check_supported) kernels.check_supported(p);
  const at::Tensor& src0 = sources[0];
  const c10::DeviceGuard guard(src0.device());
  const auto acc = acc_dtype_for(src0.scalar_type());
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  at::Tensor out = at::empty(
      src0.sizes(), src0.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor rstd = at::empty(p.stat_shape(), src0.options().dtype(acc));
  at::Tensor weights = at::empty(p.stat_shape(), src0.options().dtype(acc));
  if (p.T > 0) kernels.forward({p, sources, u, eps, out, rstd, weights});
  return {out, rstd, weights};
}

BackwardResult run_backward(const DeviceKernels& kernels,
                            const at::Tensor& grad_out, at::TensorList sources,
                            const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight,
                            const at::Tensor& rstd, const at::Tensor& weights,
                            double scale) {
  const DepthProblem p = check_backward_args(grad_out, sources, query,
                                             norm_weight, rstd, weights, scale);
  if (kernels.check_supported) kernels.check_supported(p);
  const at::Tensor& src0 = sources[0];
  const c10::DeviceGuard guard(src0.device());
  const auto acc = acc_dtype_for(src0.scalar_type());
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  std::vector<at::Tensor> grads;
  grads.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    grads.push_back(at::empty(
        src0.sizes(), src0.options().memory_format(at::MemoryFormat::Contiguous)));
  }
  at::Tensor z = at::empty({p.D}, query.options().dtype(acc));
  if (p.T == 0) {
    z.zero_();
  } else {
    const at::Tensor rstd_c = rstd.contiguous();
    const at::Tensor weights_c = weights.contiguous();
    kernels.backward({p, grad_out, sources, u, rstd_c, weights_c, grads, z});
  }
  auto [grad_query, grad_gain] = parameter_grads(z, query, norm_weight, scale);
  return {grads, grad_query, grad_gain};
}

}  // namespace attnres
