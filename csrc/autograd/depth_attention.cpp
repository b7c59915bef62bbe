// Autograd of depth_attention, in C++ (TORCH_LIBRARY_IMPL(attnres,
// Autograd)), so Python, C++ and torch.compile share one derivative: the
// forward op records a DepthAttentionFunction whose backward calls the fused
// backward op with only the gradients autograd needs. The backward op
// records a BackwardNode whose own backward raises: second derivatives are
// not implemented, and must not silently come out as zero.
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "attnres/arguments.h"
#include "helpers.h"

namespace attnres {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using namespace autograd_helpers;

// The read, with or without its fused output norm (docs/design.md §11) and
// prefix add (§12: P' saved in place of the last source; its gradient
// reaches both P and delta). With out_weight and autograd recording
// (`record`), h is kept for the backward whatever keep_h says; the h output
// is empty unless keep_h.
class DepthAttentionFunction : public torch::autograd::Function<DepthAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList sources,
                               const at::Tensor& query,
                               const std::optional<at::Tensor>& norm_weight, double eps,
                               double scale, const std::optional<at::Tensor>& out_weight,
                               std::optional<double> out_eps, bool keep_h,
                               const std::optional<at::Tensor>& delta, bool record) {
    const bool normed = is_defined(out_weight);
    const bool prefix = is_defined(delta);
    auto [out, rstd, weights, h, out_rstd, sum] = call_below_autograd<DepthAttentionFwdOp>(
        sources, query, norm_weight, eps, scale, out_weight, out_eps,
        keep_h || (normed && record), delta);
    variable_list saved(sources.begin(), sources.end());
    if (prefix) saved.back() = sum;
    saved.push_back(query);
    saved.push_back(norm_weight.value_or(at::Tensor()));
    saved.push_back(out_weight.value_or(at::Tensor()));
    // The backward's h. Without the norm it is the output out: saved as one
    // (autograd's SavedVariable records is_output), so an in-place change of
    // it before the backward is caught by its version counter.
    saved.push_back(normed ? h : out);
    saved.push_back(rstd);
    saved.push_back(weights);
    saved.push_back(out_rstd);
    ctx->save_for_backward(saved);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = is_defined(norm_weight);
    ctx->saved_data["prefix"] = prefix;
    const at::Tensor h_out = normed && !keep_h ? at::empty({0}, h.options()) : h;
    // P' has a gradient only when P or delta can take one. (One call: each
    // mark_non_differentiable replaces the set.)
    if (!prefix || !(sources.back().requires_grad() || delta->requires_grad())) {
      ctx->mark_non_differentiable({rstd, h_out, out_rstd, sum});
    } else {
      ctx->mark_non_differentiable({rstd, h_out, out_rstd});
    }
    // Unused outputs (the weights, usually) get no zero-filled gradient.
    ctx->set_materialize_grads(false);
    return {out, rstd, weights, h_out, out_rstd, sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 7;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + n);
    const at::Tensor& out_weight = saved[n + 2];
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    const bool prefix = ctx->saved_data["prefix"].toBool();
    const bool normed = out_weight.defined();
    // needs_input_grad counts the tensor inputs that were given: sources,
    // query, the gain (when there is one), out_weight (when there is one),
    // delta (when there is one).
    const size_t delta_input = n + 1 + (has_gain ? 1 : 0) + (normed ? 1 : 0);
    const bool want_delta = prefix && ctx->needs_input_grad(delta_input);
    const bool want_last = ctx->needs_input_grad(n - 1);
    c10::List<bool> mask;
    for (size_t i = 0; i < n + 1; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.set(n - 1, want_last || want_delta);
    mask.push_back(has_gain && ctx->needs_input_grad(n + 1));
    if (normed) mask.push_back(ctx->needs_input_grad(has_gain ? n + 2 : n + 1));

    // sources..., query, norm_weight, eps, scale, out_weight, out_eps, keep_h, delta, record
    variable_list result(n + 9);
    const at::Tensor& grad_out = grads[0];
    const at::Tensor& grad_weights = grads[2];
    const at::Tensor& grad_sum = grads[5];  // P''s own gradient (prefix add)
    if (!grad_out.defined() && !grad_weights.defined()) {
      // Only P' has a gradient: it is that of P and of delta.
      if (want_last) result[n - 1] = grad_sum;
      if (want_delta) result[n + 7] = grad_sum;
      return result;
    }
    const variable_list computed = expand_masked(
        BackwardNode<DepthAttentionBwdOp>::run(
            defined_or_none(grad_out), defined_or_none(grad_weights), at::TensorList(sources),
            saved[n], defined_or_none(saved[n + 1]), saved[n + 3], saved[n + 4], saved[n + 5],
            ctx->saved_data["scale"].toDouble(), mask, defined_or_none(out_weight),
            defined_or_none(saved[n + 6]), defined_or_none(grad_sum)),
        mask);
    for (size_t i = 0; i < n + 2; ++i) result[i] = computed[i];
    if (!want_last) result[n - 1] = at::Tensor();
    if (want_delta) result[n + 7] = computed[n - 1];
    if (normed) result[n + 4] = computed[n + 2];
    return result;
  }
};

DepthAttentionForward depth_attention_fwd_autograd(
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    double eps, double scale, const std::optional<at::Tensor>& out_weight,
    std::optional<double> out_eps, bool keep_h, const std::optional<at::Tensor>& delta) {
  // Before autograd reads the inputs' sizes (a nested tensor has none).
  check_dense_inputs(sources, "sources");
  check_dense(query, "query");
  check_dense_optional(norm_weight, "norm_weight");
  check_dense_optional(out_weight, "out_weight");
  check_dense_optional(delta, "delta");
  const std::initializer_list<const at::Tensor*> params = {&query, ptr(norm_weight),
                                                           ptr(out_weight), ptr(delta)};
  const bool record = records(params, sources);
  // Nothing to record (inference, decode): the kernel alone, without a
  // node to build and drop (a T = 1 read is host-bound).
  if (kernel_alone(record, params, sources)) {
    return call_below_autograd<DepthAttentionFwdOp>(sources, query, norm_weight, eps, scale,
                                                    out_weight, out_eps, keep_h, delta);
  }
  const variable_list out = DepthAttentionFunction::apply(
      sources, query, norm_weight, eps, scale, out_weight, out_eps, keep_h, delta, record);
  return {out[0], out[1], out[2], out[3], out[4], out[5]};
}

DepthAttentionBackward depth_attention_bwd_autograd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weights, double scale,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& out_weight,
    const std::optional<at::Tensor>& out_rstd, const std::optional<at::Tensor>& grad_prefix_out) {
  check_dense_inputs(sources, "sources");
  for (const auto& [t, name] :
       {std::pair<const std::optional<at::Tensor>*, const char*>{&grad_out, "grad_out"},
        {&grad_weights, "grad_weights"}, {&norm_weight, "norm_weight"},
        {&out_weight, "out_weight"}, {&out_rstd, "out_rstd"},
        {&grad_prefix_out, "grad_prefix_out"}}) {
    if (is_defined(*t)) check_dense(**t, name);
  }
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&query, "query"},
                                {&h, "h"}, {&rstd, "rstd"}, {&weights, "weights"}}) {
    if (t->defined()) check_dense(*t, name);
  }
  // The host checks the mask's length; a short one must not be read past.
  const size_t n = sources.size();
  const size_t flags = n + (is_defined(out_weight) ? 3 : 2);
  TORCH_CHECK_VALUE(output_mask.size() == flags, "output_mask must have N + ", flags - n, " = ",
                    flags, " entries (each source, query, norm_weight",
                    is_defined(out_weight) ? ", out_weight" : "", "), got ",
                    output_mask.size());
  const variable_list all = expand_masked(
      BackwardNode<DepthAttentionBwdOp>::apply(grad_out, grad_weights, sources, query,
                                               norm_weight, h, rstd, weights, scale,
                                               output_mask, out_weight, out_rstd,
                                               grad_prefix_out),
      output_mask);
  return {take_front(all, n), all[n], all[n + 1], flags > n + 2 ? all[n + 2] : at::Tensor()};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) {
  m.impl("depth_attention_fwd", &depth_attention_fwd_autograd);
  m.impl("depth_attention_bwd", &depth_attention_bwd_autograd);
}

}  // namespace attnres
