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

// The read, with or without its fused output norm (docs/design.md §11).
// With out_weight and autograd recording (`record`), h is kept for the
// backward whatever keep_h says; the h output is empty unless keep_h.
class DepthAttentionFunction : public torch::autograd::Function<DepthAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList sources,
                               const at::Tensor& query,
                               const std::optional<at::Tensor>& norm_weight, double eps,
                               double scale, const std::optional<at::Tensor>& out_weight,
                               std::optional<double> out_eps, bool keep_h, bool record) {
    const bool normed = is_defined(out_weight);
    auto [out, rstd, weights, h, out_rstd] = call_below_autograd<DepthAttentionFwdOp>(
        sources, query, norm_weight, eps, scale, out_weight, out_eps,
        keep_h || (normed && record));
    variable_list saved(sources.begin(), sources.end());
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
    const at::Tensor h_out = normed && !keep_h ? at::empty({0}, h.options()) : h;
    ctx->mark_non_differentiable({rstd, h_out, out_rstd});
    // Unused outputs (the weights, usually) get no zero-filled gradient.
    ctx->set_materialize_grads(false);
    return {out, rstd, weights, h_out, out_rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 7;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + n);
    const at::Tensor& out_weight = saved[n + 2];
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    const bool normed = out_weight.defined();
    // needs_input_grad counts the tensor inputs that were given: sources,
    // query, the gain (when there is one), out_weight (when there is one).
    c10::List<bool> mask;
    for (size_t i = 0; i < n + 1; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(has_gain && ctx->needs_input_grad(n + 1));
    if (normed) mask.push_back(ctx->needs_input_grad(has_gain ? n + 2 : n + 1));

    // sources..., query, norm_weight, eps, scale, out_weight, out_eps, keep_h, record
    variable_list result(n + 8);
    const at::Tensor& grad_out = grads[0];
    const at::Tensor& grad_weights = grads[2];
    if (!grad_out.defined() && !grad_weights.defined()) return result;
    const variable_list computed = expand_masked(
        BackwardNode<DepthAttentionBwdOp>::apply(
            defined_or_none(grad_out), defined_or_none(grad_weights), at::TensorList(sources),
            saved[n], defined_or_none(saved[n + 1]), saved[n + 3], saved[n + 4], saved[n + 5],
            ctx->saved_data["scale"].toDouble(), mask, defined_or_none(out_weight),
            defined_or_none(saved[n + 6])),
        mask);
    for (size_t i = 0; i < n + 2; ++i) result[i] = computed[i];
    if (normed) result[n + 4] = computed[n + 2];
    return result;
  }
};

DepthAttentionForward depth_attention_fwd_autograd(
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    double eps, double scale, const std::optional<at::Tensor>& out_weight,
    std::optional<double> out_eps, bool keep_h) {
  // Before autograd reads the inputs' sizes (a nested tensor has none).
  check_dense_inputs(sources, "sources");
  check_dense(query, "query");
  check_dense_optional(norm_weight, "norm_weight");
  check_dense_optional(out_weight, "out_weight");
  const bool record = records({&query, ptr(norm_weight), ptr(out_weight)}, sources);
  // Nothing to record (inference, decode): the kernel alone, without a
  // node to build and drop (a T = 1 read is host-bound).
  if (kernel_alone(record, {&query, ptr(norm_weight), ptr(out_weight)}, sources)) {
    return call_below_autograd<DepthAttentionFwdOp>(sources, query, norm_weight, eps, scale,
                                                    out_weight, out_eps, keep_h);
  }
  const variable_list out = DepthAttentionFunction::apply(
      sources, query, norm_weight, eps, scale, out_weight, out_eps, keep_h, record);
  return {out[0], out[1], out[2], out[3], out[4]};
}

DepthAttentionBackward depth_attention_bwd_autograd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weights, double scale,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& out_weight,
    const std::optional<at::Tensor>& out_rstd) {
  check_dense_inputs(sources, "sources");
  for (const auto& [t, name] :
       {std::pair<const std::optional<at::Tensor>*, const char*>{&grad_out, "grad_out"},
        {&grad_weights, "grad_weights"}, {&norm_weight, "norm_weight"},
        {&out_weight, "out_weight"}, {&out_rstd, "out_rstd"}}) {
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
                                               output_mask, out_weight, out_rstd),
      output_mask);
  return {take_front(all, n), all[n], all[n + 1], flags > n + 2 ? all[n + 2] : at::Tensor()};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) {
  m.impl("depth_attention_fwd", &depth_attention_fwd_autograd);
  m.impl("depth_attention_bwd", &depth_attention_bwd_autograd);
}

}  // namespace attnres
