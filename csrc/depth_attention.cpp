// depth_attention_fwd/bwd: the host sequence of every device
// (attnres/op_sequence.h) and the C++ API (attnres/ops.h).
#include "attnres/op_sequence.h"
#include "attnres/ops.h"
#include "autograd/helpers.h"

#include "attnres/gradient_cache.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>

namespace attnres {

namespace {

// A CPU parameter already in the accumulation dtype (the common case): the
// per-call parameter math runs as one loop, with the same roundings, without
// an elementwise op's host cost (a decode-sized read is host-bound).
bool plain_cpu(const at::Tensor& t, at::ScalarType acc) {
  return t.is_cpu() && t.scalar_type() == acc && t.is_contiguous() && !t.is_neg();
}

}  // namespace

// u = scale * query * gain in the accumulation dtype: the only form of query
// and gain the kernels use.
at::Tensor effective_query(const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight,
                           double scale, at::ScalarType acc) {
  // (query * scale) * gain, the eager composite's rounding order (the tests
  // bound our error by eager's), in one op in the common case (a gain,
  // scale 1) and none without a gain: a decode-sized read is host-bound.
  const bool has_gain = norm_weight.has_value() && norm_weight->defined();
  if (plain_cpu(query, acc) && (!has_gain || plain_cpu(*norm_weight, acc))) {
    at::Tensor u = at::empty(query.sizes(), query.options());
    AT_DISPATCH_FLOATING_TYPES(acc, "attnres_effective_query", [&] {
      const scalar_t* q = query.const_data_ptr<scalar_t>();
      const scalar_t* g = has_gain ? norm_weight->const_data_ptr<scalar_t>() : nullptr;
      const scalar_t s = static_cast<scalar_t>(scale);
      scalar_t* out = u.data_ptr<scalar_t>();
      for (int64_t i = 0, n = query.numel(); i < n; ++i) {
        const scalar_t qs = scale != 1.0 ? q[i] * s : q[i];
        out[i] = g ? qs * g[i] : qs;
      }
    });
    return u;
  }
  at::Tensor u = query.to(acc);
  if (scale != 1.0) {
    u = u.mul(scale);
    if (has_gain) u.mul_(norm_weight->to(acc));
  } else if (has_gain) {
    u = at::mul(u, norm_weight->to(acc));
  }
  u = u.contiguous();
  // Without a gain at scale 1, u may be the query itself: the CUDA kernels
  // load u in 16-byte packs, so a query view off that alignment is copied.
  if (reinterpret_cast<uintptr_t>(u.const_data_ptr()) % 16 != 0) u = u.clone();
  return u;
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
  } else if (plain_cpu(z, acc) && plain_cpu(query, acc) && query.sizes() == z.sizes() &&
             (!has_gain || (plain_cpu(*norm_weight, acc) && norm_weight->sizes() == z.sizes()))) {
    // The ops' roundings below, z * (gain * scale) and z * (query * scale).
    grad_query = at::empty_like(z);
    grad_gain = at::empty_like(z);
    AT_DISPATCH_FLOATING_TYPES(acc, "attnres_parameter_grads", [&] {
      const scalar_t* zs = z.const_data_ptr<scalar_t>();
      const scalar_t* q = query.const_data_ptr<scalar_t>();
      const scalar_t* g = has_gain ? norm_weight->const_data_ptr<scalar_t>() : nullptr;
      const scalar_t s = static_cast<scalar_t>(scale);
      scalar_t* dq = grad_query.data_ptr<scalar_t>();
      scalar_t* dg = grad_gain.data_ptr<scalar_t>();
      for (int64_t i = 0, n = z.numel(); i < n; ++i) {
        dq[i] = zs[i] * (g ? g[i] * s : s);
        dg[i] = zs[i] * (q[i] * s);
      }
    });
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


OutNormOutputs::OutNormOutputs(const std::optional<at::Tensor>& out_weight, double out_eps,
                               bool keep_h, const at::Tensor& like, const DepthProblem& p) {
  if (!is_defined(out_weight)) {
    h = at::empty({0}, like.options());
    rstd = at::empty({0}, like.options().dtype(acc_dtype_for(like.scalar_type())));
    return;
  }
  const auto acc = acc_dtype_for(like.scalar_type());
  weight_ = out_weight->to(acc).contiguous();
  rstd = at::empty(p.lead_shape, like.options().dtype(acc));
  // Not kept (inference): an empty h, and the kernel writes y alone.
  const auto rows = like.options().memory_format(at::MemoryFormat::Contiguous);
  h = keep_h ? detail::empty_cached(like.sizes(), rows) : at::empty({0}, like.options());
  if (keep_h) kernel_h_ = h;
  view_.emplace(OutNormForward{weight_, out_eps, rstd, kernel_h_});
}

OutNormGrads::OutNormGrads(const std::optional<at::Tensor>& out_weight,
                           const std::optional<at::Tensor>& out_rstd, bool want_grad,
                           int64_t D) {
  if (!is_defined(out_weight)) return;
  const auto acc = out_rstd->scalar_type();
  dtype_ = out_weight->scalar_type();
  weight_ = out_weight->to(acc).contiguous();
  rstd_ = out_rstd->contiguous();
  if (want_grad) grad_ = at::zeros({D}, out_weight->options().dtype(acc));
  view_.emplace(OutNormBackward{weight_, rstd_, grad_});
}

at::Tensor OutNormGrads::grad() const {
  return grad_.defined() ? grad_.to(dtype_) : at::Tensor();
}

ForwardResult run_forward(const DeviceKernels& kernels, at::TensorList sources,
                          const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                          double eps, double scale, const std::optional<at::Tensor>& out_weight,
                          std::optional<double> out_eps, bool keep_h,
                          const std::optional<at::Tensor>& delta) {
  const DepthProblem p = check_forward_args(sources, query, norm_weight, eps, scale);
  const double norm_eps = resolve_out_eps(out_eps, eps);
  if (is_defined(out_weight)) check_out_norm_args(*out_weight, norm_eps, sources, p);
  if (delta) check_like(*delta, "delta", sources.back(), "the last source's");
  if (kernels.check_supported) kernels.check_supported(p);
  const at::Tensor& src0 = sources[0];
  const c10::DeviceGuard guard(src0.device());
  const auto acc = acc_dtype_for(src0.scalar_type());
  OutNormOutputs norm(out_weight, norm_eps, keep_h, src0, p);
  at::Tensor out = detail::empty_cached(src0.sizes(), src0.options());
  at::Tensor rstd = at::empty(p.stat_shape(), src0.options().dtype(acc));
  at::Tensor weights = at::empty(p.stat_shape(), src0.options().dtype(acc));
  // The prefix add's P' (§12): the last source's rows, contiguous.
  at::Tensor sum = delta ? at::empty(src0.sizes(),
                                     src0.options().memory_format(at::MemoryFormat::Contiguous))
                         : at::empty({0}, src0.options());
  if (p.T > 0) {
    const at::Tensor u = effective_query(query, norm_weight, scale, acc);
    const PrefixAdd prefix{delta ? *delta : sum, sum};
    ForwardCall call{p, sources, u, eps, out, rstd, weights};
    call.out_norm = norm.kernel();
    if (delta) call.prefix = &prefix;
    kernels.forward(call);
  }
  return {out, rstd, weights, norm.h, norm.rstd, sum};
}

BackwardResult run_backward(const DeviceKernels& kernels,
                            const std::optional<at::Tensor>& grad_out,
                            const std::optional<at::Tensor>& grad_weights,
                            at::TensorList sources, const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight, const at::Tensor& h,
                            const at::Tensor& rstd, const at::Tensor& weights, double scale,
                            const c10::List<bool>& output_mask,
                            const std::optional<at::Tensor>& out_weight,
                            const std::optional<at::Tensor>& out_rstd,
                            const std::optional<at::Tensor>& grad_prefix_out) {
  const DepthProblem p = check_backward_args(grad_out, grad_weights, sources, query, norm_weight,
                                             h, rstd, weights, scale, output_mask, out_weight,
                                             out_rstd);
  if (is_defined(grad_prefix_out)) {
    check_like(*grad_prefix_out, "grad_prefix_out", sources.back(), "the last source's");
  }
  if (kernels.check_supported) kernels.check_supported(p);
  const at::Tensor& src0 = sources[0];
  const c10::DeviceGuard guard(src0.device());
  const auto acc = acc_dtype_for(src0.scalar_type());
  std::vector<at::Tensor> grads(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    if (output_mask.get(i)) grads[i] = detail::empty_cached(src0.sizes(), src0.options());
  }
  const bool want_query = output_mask.get(p.N);
  const bool want_gain = output_mask.get(p.N + 1);
  const bool want_out_weight = is_defined(out_weight) && output_mask.get(p.N + 2);
  const OutNormGrads norm(out_weight, out_rstd, want_out_weight, p.D);
  at::Tensor z;
  if (want_query || want_gain) z = at::empty({p.D}, query.options().dtype(acc));
  if (p.T == 0) {
    if (z.defined()) z.zero_();
  } else {
    const at::Tensor u = effective_query(query, norm_weight, scale, acc);
    // An absent gradient of the read contributes nothing: zeros keep the
    // kernels to one form (this path is rare: a loss on the weights alone).
    const at::Tensor dh = is_defined(grad_out) ? *grad_out : at::zeros_like(src0);
    const at::Tensor gw = is_defined(grad_weights) ? grad_weights->contiguous() : at::Tensor();
    const at::Tensor rstd_c = rstd.contiguous();
    const at::Tensor weights_c = weights.contiguous();
    BackwardCall call{p, dh, gw, sources, u, h, rstd_c, weights_c, grads, z};
    call.out_norm = norm.kernel();
    kernels.backward(call);
    // P''s own gradient (the prefix add, §12) joins the read's: one add,
    // as autograd would sum the two (the same rounding).
    if (is_defined(grad_prefix_out) && grads.back().defined()) grads.back().add_(*grad_prefix_out);
  }
  auto [wanted, grad_query, grad_gain] =
      finish_backward(grads, z, query, norm_weight, scale, want_query, want_gain);
  return {std::move(wanted), grad_query, grad_gain, norm.grad()};
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

namespace attnres {

DepthAttentionForward depth_attention_fwd(at::TensorList sources, const at::Tensor& query,
                                          const std::optional<at::Tensor>& norm_weight,
                                          double eps, double scale,
                                          const std::optional<at::Tensor>& out_weight,
                                          std::optional<double> out_eps, bool keep_h,
                                          const std::optional<at::Tensor>& delta) {
  return call_op<DepthAttentionFwdOp>(sources, query, norm_weight, eps, scale, out_weight,
                                      out_eps, keep_h, delta);
}

DepthAttentionBackward depth_attention_bwd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weights, double scale,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& out_weight,
    const std::optional<at::Tensor>& out_rstd, const std::optional<at::Tensor>& grad_prefix_out) {
  return call_op<DepthAttentionBwdOp>(grad_out, grad_weights, sources, query, norm_weight, h,
                                      rstd, weights, scale, output_mask, out_weight, out_rstd,
                                      grad_prefix_out);
}

at::Tensor depth_attention(at::TensorList sources, const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight, double eps,
                           double scale, const std::optional<at::Tensor>& out_weight,
                           std::optional<double> out_eps) {
  return std::get<0>(
      depth_attention_fwd(sources, query, norm_weight, eps, scale, out_weight, out_eps));
}

std::tuple<at::Tensor, at::Tensor> depth_attention_with_weights(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale,
    const std::optional<at::Tensor>& out_weight, std::optional<double> out_eps) {
  auto result = depth_attention_fwd(sources, query, norm_weight, eps, scale, out_weight, out_eps);
  return {std::get<0>(result), std::get<2>(result)};
}

}  // namespace attnres
