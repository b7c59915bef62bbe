// Autograd of the attnres ops, in C++ (TORCH_LIBRARY_IMPL(attnres, Autograd)),
// so Python, C++ and torch.compile share one derivative: the forward op
// records a DepthAttentionFunction whose backward calls the fused backward
// op with only the gradients autograd needs. The backward op records a node
// whose own backward raises: second derivatives are not implemented, and
// must not silently come out as zero.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "attnres/arguments.h"
#include "attnres/ops.h"
#include "autograd_helpers.h"

namespace attnres {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using autograd_helpers::call_below_autograd;
using autograd_helpers::expand_masked;
using autograd_helpers::no_double_backward;

using ForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    at::TensorList, const at::Tensor&, const std::optional<at::Tensor>&, double, double);
using BackwardSignature = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>(
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, at::TensorList,
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, const c10::List<bool>&);

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The backward op's node: first derivatives only. Its forward returns the
// gradients that output_mask asks for, in order (sources, query, gain), and
// nothing for the others (autograd cannot attach history to an undefined
// tensor); expand_masked puts them back in place.
class DepthAttentionBackwardFunction
    : public torch::autograd::Function<DepthAttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/,
                               const std::optional<at::Tensor>& grad_out,
                               const std::optional<at::Tensor>& grad_weights,
                               at::TensorList sources, const at::Tensor& query,
                               const std::optional<at::Tensor>& norm_weight,
                               const at::Tensor& out, const at::Tensor& rstd,
                               const at::Tensor& weights, double scale,
                               const c10::List<bool>& output_mask) {
    auto [wanted, grad_query, grad_gain] = call_below_autograd<BackwardSignature>(
        "attnres::depth_attention_bwd", grad_out, grad_weights, sources, query, norm_weight,
        out, rstd, weights, scale, output_mask);
    const size_t n = sources.size();
    if (output_mask.get(n)) wanted.push_back(grad_query);
    if (output_mask.get(n + 1)) wanted.push_back(grad_gain);
    return wanted;
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    no_double_backward("depth_attention");
  }
};

class DepthAttentionFunction : public torch::autograd::Function<DepthAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList sources,
                               const at::Tensor& query,
                               const std::optional<at::Tensor>& norm_weight, double eps,
                               double scale) {
    auto [out, rstd, weights] = call_below_autograd<ForwardSignature>(
        "attnres::depth_attention_fwd", sources, query, norm_weight, eps, scale);
    variable_list saved(sources.begin(), sources.end());
    saved.push_back(query);
    saved.push_back(norm_weight.value_or(at::Tensor()));
    // h is an output of this node: saved as one (autograd's SavedVariable
    // records is_output), so an in-place change of h before the backward
    // is caught by its version counter instead of giving wrong gradients.
    saved.push_back(out);
    saved.push_back(rstd);
    saved.push_back(weights);
    ctx->save_for_backward(saved);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = norm_weight.has_value() && norm_weight->defined();
    ctx->mark_non_differentiable({rstd});
    // Unused outputs (the weights, usually) get no zero-filled gradient.
    ctx->set_materialize_grads(false);
    return {out, rstd, weights};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 5;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + n);
    const at::Tensor& query = saved[n];
    const at::Tensor& norm_weight = saved[n + 1];
    const at::Tensor& out = saved[n + 2];
    const at::Tensor& rstd = saved[n + 3];
    const at::Tensor& weights = saved[n + 4];
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    // needs_input_grad counts the tensor inputs: sources, query, gain.
    c10::List<bool> mask;
    for (size_t i = 0; i < n + 1; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(has_gain && ctx->needs_input_grad(n + 1));

    variable_list result(n + 4);  // sources..., query, norm_weight, eps, scale
    const at::Tensor& grad_out = grads[0];
    const at::Tensor& grad_weights = grads[2];
    if (!grad_out.defined() && !grad_weights.defined()) return result;
    const variable_list computed = expand_masked(
        DepthAttentionBackwardFunction::apply(defined_or_none(grad_out),
                                              defined_or_none(grad_weights),
                                              at::TensorList(sources), query,
                                              defined_or_none(norm_weight), out, rstd, weights,
                                              ctx->saved_data["scale"].toDouble(), mask),
        mask);
    for (size_t i = 0; i < n + 2; ++i) result[i] = computed[i];
    return result;
  }
};

using NormedForwardSignature = NormedForward(at::TensorList, const at::Tensor&,
                                              const std::optional<at::Tensor>&,
                                              const at::Tensor&, double, double, double, bool);
using NormedBackwardSignature = NormedBackward(
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, at::TensorList,
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const c10::List<bool>&);

// The normed backward op's node: as DepthAttentionBackwardFunction, with
// the out_weight gradient last.
class DepthAttentionNormedBackwardFunction
    : public torch::autograd::Function<DepthAttentionNormedBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/,
                               const std::optional<at::Tensor>& grad_out,
                               const std::optional<at::Tensor>& grad_weights,
                               at::TensorList sources, const at::Tensor& query,
                               const std::optional<at::Tensor>& norm_weight,
                               const at::Tensor& out_weight, const at::Tensor& h,
                               const at::Tensor& rstd, const at::Tensor& weights,
                               const at::Tensor& out_rstd, double scale,
                               const c10::List<bool>& output_mask) {
    auto [wanted, grad_query, grad_gain, grad_out_weight] =
        call_below_autograd<NormedBackwardSignature>(
            "attnres::depth_attention_normed_bwd", grad_out, grad_weights, sources, query,
            norm_weight, out_weight, h, rstd, weights, out_rstd, scale, output_mask);
    const size_t n = sources.size();
    if (output_mask.get(n)) wanted.push_back(grad_query);
    if (output_mask.get(n + 1)) wanted.push_back(grad_gain);
    if (output_mask.get(n + 2)) wanted.push_back(grad_out_weight);
    return wanted;
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    no_double_backward("depth_attention_normed");
  }
};

// The normed read (docs/design.md §11). When autograd records (`record`),
// h is kept for the backward whatever keep_h says; the h output is empty
// unless keep_h.
class DepthAttentionNormedFunction
    : public torch::autograd::Function<DepthAttentionNormedFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList sources,
                               const at::Tensor& query,
                               const std::optional<at::Tensor>& norm_weight,
                               const at::Tensor& out_weight, double eps, double scale,
                               double out_eps, bool keep_h, bool record) {
    auto [out, h, rstd, weights, out_rstd] = call_below_autograd<NormedForwardSignature>(
        "attnres::depth_attention_normed_fwd", sources, query, norm_weight, out_weight, eps,
        scale, out_eps, keep_h || record);
    variable_list saved(sources.begin(), sources.end());
    saved.push_back(query);
    saved.push_back(norm_weight.value_or(at::Tensor()));
    saved.push_back(out_weight);
    saved.push_back(h);
    saved.push_back(rstd);
    saved.push_back(weights);
    saved.push_back(out_rstd);
    ctx->save_for_backward(saved);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = norm_weight.has_value() && norm_weight->defined();
    const at::Tensor h_out = keep_h ? h : at::empty({0}, h.options());
    ctx->mark_non_differentiable({h_out, rstd, out_rstd});
    ctx->set_materialize_grads(false);
    return {out, h_out, rstd, weights, out_rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 7;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + n);
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    // needs_input_grad counts the tensor inputs that were given: sources,
    // query, the gain (when there is one), out_weight.
    c10::List<bool> mask;
    for (size_t i = 0; i < n + 1; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(has_gain && ctx->needs_input_grad(n + 1));
    mask.push_back(ctx->needs_input_grad(has_gain ? n + 2 : n + 1));

    // sources..., query, norm_weight, out_weight, eps, scale, out_eps, keep_h, record
    variable_list result(n + 8);
    const at::Tensor& grad_out = grads[0];
    const at::Tensor& grad_weights = grads[3];
    if (!grad_out.defined() && !grad_weights.defined()) return result;
    const at::Tensor& h = saved[n + 3];  // kept by the forward whenever it recorded
    const variable_list computed = expand_masked(
        DepthAttentionNormedBackwardFunction::apply(
            defined_or_none(grad_out), defined_or_none(grad_weights), at::TensorList(sources),
            saved[n], defined_or_none(saved[n + 1]), saved[n + 2], h, saved[n + 4],
            saved[n + 5], saved[n + 6], ctx->saved_data["scale"].toDouble(), mask),
        mask);
    for (size_t i = 0; i < n + 3; ++i) result[i] = computed[i];
    return result;
  }
};

// Whether autograd records a call with these inputs.
bool records(at::TensorList sources, const at::Tensor& query,
             const std::optional<at::Tensor>& norm_weight, const at::Tensor& out_weight) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& s : sources) {
    if (s.requires_grad()) return true;
  }
  return query.requires_grad() || out_weight.requires_grad() ||
         (norm_weight.has_value() && norm_weight->defined() && norm_weight->requires_grad());
}

NormedForward depth_attention_normed_fwd_autograd(at::TensorList sources, const at::Tensor& query,
                                                  const std::optional<at::Tensor>& norm_weight,
                                                  const at::Tensor& out_weight, double eps,
                                                  double scale, double out_eps, bool keep_h) {
  check_dense_inputs(sources, "sources");
  check_dense(query, "query");
  if (norm_weight.has_value() && norm_weight->defined()) check_dense(*norm_weight, "norm_weight");
  if (out_weight.defined()) check_dense(out_weight, "out_weight");
  const bool record = records(sources, query, norm_weight, out_weight);
  const variable_list out = DepthAttentionNormedFunction::apply(
      sources, query, norm_weight, out_weight, eps, scale, out_eps, keep_h, record);
  return {out[0], out[1], out[2], out[3], out[4]};
}

NormedBackward depth_attention_normed_bwd_autograd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weights, const at::Tensor& out_rstd, double scale,
    const c10::List<bool>& output_mask) {
  check_dense_inputs(sources, "sources");
  for (const auto& [t, name] : {std::pair<const std::optional<at::Tensor>*, const char*>{
                                    &grad_out, "grad_out"},
                                {&grad_weights, "grad_weights"}, {&norm_weight, "norm_weight"}}) {
    if (t->has_value() && (*t)->defined()) check_dense(**t, name);
  }
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&query, "query"},
                                {&out_weight, "out_weight"}, {&h, "h"}, {&rstd, "rstd"},
                                {&weights, "weights"}, {&out_rstd, "out_rstd"}}) {
    if (t->defined()) check_dense(*t, name);
  }
  variable_list grads = DepthAttentionNormedBackwardFunction::apply(
      grad_out, grad_weights, sources, query, norm_weight, out_weight, h, rstd, weights,
      out_rstd, scale, output_mask);
  const size_t n = sources.size();
  at::Tensor grad_query, grad_gain, grad_out_weight;
  if (output_mask.size() == n + 3 && output_mask.get(n + 2)) {
    grad_out_weight = grads.back();
    grads.pop_back();
  }
  if (output_mask.size() == n + 3 && output_mask.get(n + 1)) {
    grad_gain = grads.back();
    grads.pop_back();
  }
  if (output_mask.size() == n + 3 && output_mask.get(n)) {
    grad_query = grads.back();
    grads.pop_back();
  }
  return {std::vector<at::Tensor>(grads.begin(), grads.end()), grad_query, grad_gain,
          grad_out_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> depth_attention_fwd_autograd(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale) {
  // Before autograd reads the inputs' sizes (a nested tensor has none).
  check_dense_inputs(sources, "sources");
  check_dense(query, "query");
  if (norm_weight.has_value() && norm_weight->defined()) check_dense(*norm_weight, "norm_weight");
  const variable_list out = DepthAttentionFunction::apply(sources, query, norm_weight, eps, scale);
  return {out[0], out[1], out[2]};
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> depth_attention_bwd_autograd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& out, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask) {
  check_dense_inputs(sources, "sources");
  for (const auto& [t, name] : {std::pair<const std::optional<at::Tensor>*, const char*>{
                                    &grad_out, "grad_out"},
                                {&grad_weights, "grad_weights"}, {&norm_weight, "norm_weight"}}) {
    if (t->has_value() && (*t)->defined()) check_dense(**t, name);
  }
  check_dense(query, "query");
  check_dense(out, "out");
  check_dense(rstd, "rstd");
  check_dense(weights, "weights");
  variable_list grads = DepthAttentionBackwardFunction::apply(
      grad_out, grad_weights, sources, query, norm_weight, out, rstd, weights, scale, output_mask);
  const size_t n = sources.size();
  at::Tensor grad_gain, grad_query;
  if (output_mask.get(n + 1)) {
    grad_gain = grads.back();
    grads.pop_back();
  }
  if (output_mask.get(n)) {
    grad_query = grads.back();
    grads.pop_back();
  }
  return {std::vector<at::Tensor>(grads.begin(), grads.end()), grad_query, grad_gain};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) {
  m.impl("depth_attention_fwd", &depth_attention_fwd_autograd);
  m.impl("depth_attention_bwd", &depth_attention_bwd_autograd);
  m.impl("depth_attention_normed_fwd", &depth_attention_normed_fwd_autograd);
  m.impl("depth_attention_normed_bwd", &depth_attention_normed_bwd_autograd);
}

}  // namespace attnres
