// See include/attnres/op_sequence.h.
#include "attnres/op_sequence.h"

#include "attnres/gradient_cache.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

namespace attnres {

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
  const auto acc = z.scalar_type();
  // scale multiplies the parameter first: z * scale alone can overflow where
  // the gradient itself does not (rows near the dtype's maximum), and a zero
  // factor then gives exactly 0 instead of 0 * inf. scale = 0: the scores
  // do not depend on query or gain, their gradients are exactly 0.
  at::Tensor grad_query, grad_gain;
  if (scale == 0.0) {
    grad_query = at::zeros_like(z);
    grad_gain = at::zeros_like(z);
  } else {
    grad_query = has_gain ? z.mul(norm_weight->to(acc).mul(scale)) : z.mul(scale);
    grad_gain = z.mul(query.to(acc).mul(scale));
  }
  grad_query = grad_query.to(query.scalar_type());
  grad_gain = grad_gain.to(has_gain ? norm_weight->scalar_type() : query.scalar_type());
  return {grad_query, grad_gain};
}

bool is_defined(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined();
}


namespace {

// The forward's sequence, with or without the output norm: the outputs
// allocated, then the device's kernel.
struct ForwardOutputs {
  at::Tensor out, rstd, weights;
};

ForwardOutputs forward_sequence(const DeviceKernels& kernels, const DepthProblem& p,
                                at::TensorList sources, const at::Tensor& query,
                                const std::optional<at::Tensor>& norm_weight, double eps,
                                double scale, const OutNormForward* out_norm) {
  if (kernels.check_supported) kernels.check_supported(p);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  ForwardOutputs o;
  o.out = detail::empty_cached(src0.sizes(), src0.options());
  o.rstd = at::empty(p.stat_shape(), src0.options().dtype(acc));
  o.weights = at::empty(p.stat_shape(), src0.options().dtype(acc));
  if (p.T > 0) {
    ForwardCall call{p, sources, u, eps, o.out, o.rstd, o.weights};
    call.out_norm = out_norm;
    kernels.forward(call);
  }
  return o;
}

// The backward's sequence, with or without the output norm: the gradients
// allocated, then the device's kernel, then finish_backward.
BackwardResult backward_sequence(const DeviceKernels& kernels, const DepthProblem& p,
                                 const std::optional<at::Tensor>& grad_out,
                                 const std::optional<at::Tensor>& grad_weights,
                                 at::TensorList sources, const at::Tensor& query,
                                 const std::optional<at::Tensor>& norm_weight,
                                 const at::Tensor& out, const at::Tensor& rstd,
                                 const at::Tensor& weights, double scale,
                                 const c10::List<bool>& output_mask,
                                 const OutNormBackward* out_norm) {
  if (kernels.check_supported) kernels.check_supported(p);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  std::vector<at::Tensor> grads(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    if (output_mask.get(i)) grads[i] = detail::empty_cached(src0.sizes(), src0.options());
  }
  const bool want_query = output_mask.get(p.N);
  const bool want_gain = output_mask.get(p.N + 1);
  at::Tensor z;
  if (want_query || want_gain) z = at::empty({p.D}, query.options().dtype(acc));
  if (p.T == 0) {
    if (z.defined()) z.zero_();
    if (out_norm && out_norm->grad_weight.defined()) out_norm->grad_weight.zero_();
  } else {
    const at::Tensor u = effective_query(query, norm_weight, scale, acc);
    // An absent gradient of h contributes nothing: zeros keep the kernels
    // to one form (this path is rare: a loss on the weights alone).
    const at::Tensor dh = is_defined(grad_out) ? *grad_out : at::zeros_like(src0);
    const at::Tensor gw = is_defined(grad_weights) ? grad_weights->contiguous() : at::Tensor();
    const at::Tensor rstd_c = rstd.contiguous();
    const at::Tensor weights_c = weights.contiguous();
    BackwardCall call{p, dh, gw, sources, u, out, rstd_c, weights_c, grads, z};
    call.out_norm = out_norm;
    kernels.backward(call);
  }
  return finish_backward(grads, z, query, norm_weight, scale, want_query, want_gain);
}

}  // namespace

ForwardResult run_forward(const DeviceKernels& kernels, at::TensorList sources,
                          const at::Tensor& query,
                          const std::optional<at::Tensor>& norm_weight,
                          double eps, double scale) {
  const DepthProblem p = check_forward_args(sources, query, norm_weight, eps, scale);
  const c10::DeviceGuard guard(sources[0].device());
  ForwardOutputs o =
      forward_sequence(kernels, p, sources, query, norm_weight, eps, scale, nullptr);
  return {o.out, o.rstd, o.weights};
}

NormedForwardResult run_normed_forward(const DeviceKernels& kernels, at::TensorList sources,
                                       const at::Tensor& query,
                                       const std::optional<at::Tensor>& norm_weight,
                                       const at::Tensor& out_weight, double eps, double scale,
                                       double out_eps, bool keep_h) {
  const DepthProblem p = check_forward_args(sources, query, norm_weight, eps, scale);
  check_out_norm_args(out_weight, out_eps, sources, p);
  const at::Tensor& src0 = sources[0];
  const c10::DeviceGuard guard(src0.device());
  const auto acc = acc_dtype_for(src0.scalar_type());
  const at::Tensor weight = out_weight.to(acc).contiguous();
  at::Tensor out_rstd = at::empty(p.lead_shape, src0.options().dtype(acc));
  // Not kept (inference): an empty h, and the kernel writes y alone.
  at::Tensor h = keep_h ? detail::empty_cached(src0.sizes(), src0.options())
                        : at::empty({0}, src0.options());
  at::Tensor no_h;
  const OutNormForward norm{weight, out_eps, out_rstd, keep_h ? h : no_h};
  ForwardOutputs o = forward_sequence(kernels, p, sources, query, norm_weight, eps, scale, &norm);
  return {o.out, h, o.rstd, o.weights, out_rstd};
}

BackwardResult run_backward(const DeviceKernels& kernels,
                            const std::optional<at::Tensor>& grad_out,
                            const std::optional<at::Tensor>& grad_weights,
                            at::TensorList sources, const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight,
                            const at::Tensor& out, const at::Tensor& rstd,
                            const at::Tensor& weights, double scale,
                            const c10::List<bool>& output_mask) {
  const DepthProblem p = check_backward_args(grad_out, grad_weights, sources, query, norm_weight,
                                             out, rstd, weights, scale, output_mask);
  const c10::DeviceGuard guard(sources[0].device());
  return backward_sequence(kernels, p, grad_out, grad_weights, sources, query, norm_weight, out,
                           rstd, weights, scale, output_mask, nullptr);
}

NormedBackwardResult run_normed_backward(
    const DeviceKernels& kernels, const std::optional<at::Tensor>& grad_out,
    const std::optional<at::Tensor>& grad_weights, at::TensorList sources,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weights, const at::Tensor& out_rstd, double scale,
    const c10::List<bool>& output_mask) {
  const DepthProblem p =
      check_normed_backward_args(grad_out, grad_weights, sources, query, norm_weight, out_weight,
                                 h, rstd, weights, out_rstd, scale, output_mask);
  const at::Tensor& src0 = sources[0];
  const c10::DeviceGuard guard(src0.device());
  const auto acc = acc_dtype_for(src0.scalar_type());
  const at::Tensor weight = out_weight.to(acc).contiguous();
  const at::Tensor out_rstd_c = out_rstd.contiguous();
  const bool want_out_weight = output_mask.get(p.N + 2);
  at::Tensor grad_weight;
  if (want_out_weight) grad_weight = at::empty({p.D}, out_weight.options().dtype(acc));
  const OutNormBackward norm{weight, out_rstd_c, grad_weight};
  c10::List<bool> mask;
  for (int64_t i = 0; i < p.N + 2; ++i) mask.push_back(output_mask.get(i));
  auto [grad_sources, grad_query, grad_gain] =
      backward_sequence(kernels, p, grad_out, grad_weights, sources, query, norm_weight, h, rstd,
                        weights, scale, mask, &norm);
  if (grad_weight.defined()) grad_weight = grad_weight.to(out_weight.scalar_type());
  return {std::move(grad_sources), grad_query, grad_gain, grad_weight};
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> finish_backward(
    std::vector<at::Tensor>& grads, const at::Tensor& z, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double scale, bool want_query, bool want_gain) {
  at::Tensor grad_query, grad_gain;
  if (z.defined()) {
    std::tie(grad_query, grad_gain) = parameter_grads(z, query, norm_weight, scale);
  }
  if (!want_query) grad_query = at::Tensor();
  if (!want_gain) grad_gain = at::Tensor();
  std::vector<at::Tensor> wanted;
  for (auto& g : grads) {
    if (g.defined()) wanted.push_back(std::move(g));
  }
  return {wanted, grad_query, grad_gain};
}

}  // namespace attnres
