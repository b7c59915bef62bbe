// Autograd of the two-phase Block reads (docs/design.md §10), in C++ like
// autograd/depth_attention.cpp: phase 1 (block_reads_fwd) and phase 2
// (block_read_merge_fwd) record a node whose backward calls the fused
// backward op; the backward ops record a BackwardNode that refuses second
// derivatives; the in-place merge refuses to run when a gradient is wanted.
#include <torch/autograd.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <vector>

#include "attnres/arguments.h"
#include "helpers.h"

namespace attnres {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using namespace autograd_helpers;

// Phase 1, with or without reader 0's output norm. With out_weight and
// autograd recording (`record`), h_0 is kept for the backward whatever
// keep_h says.
class BlockReadsFunction : public torch::autograd::Function<BlockReadsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList sources,
                               const at::Tensor& queries,
                               const std::optional<at::Tensor>& norm_weights, double eps,
                               double scale, const std::optional<at::Tensor>& out_weight,
                               std::optional<double> out_eps, bool keep_h, bool record) {
    const bool normed = is_defined(out_weight);
    auto [partial_outs, lse, rstd, weights, h, out_rstd] = call_below_autograd<BlockReadsFwdOp>(
        sources, queries, norm_weights, eps, scale, out_weight, out_eps,
        keep_h || (normed && record));
    variable_list saved(sources.begin(), sources.end());
    for (const auto& t : {queries, norm_weights.value_or(at::Tensor()),
                          out_weight.value_or(at::Tensor()), h, rstd, weights, out_rstd}) {
      saved.push_back(t);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = is_defined(norm_weights);
    const at::Tensor h_out = normed && !keep_h ? at::empty({0}, h.options()) : h;
    ctx->mark_non_differentiable({rstd, weights, h_out, out_rstd});
    ctx->set_materialize_grads(false);
    variable_list out(partial_outs.begin(), partial_outs.end());
    for (const auto& t : {lse, rstd, weights, h_out, out_rstd}) out.push_back(t);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 7;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + n);
    const at::Tensor& queries = saved[n];
    const at::Tensor& out_weight = saved[n + 2];
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    const bool normed = out_weight.defined();
    const size_t S = static_cast<size_t>(queries.size(0));
    // needs_input_grad counts the tensor inputs given: sources, queries,
    // the gains (when given), out_weight (when given).
    c10::List<bool> mask;
    for (size_t i = 0; i < n + 1; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(has_gain && ctx->needs_input_grad(n + 1));
    if (normed) mask.push_back(ctx->needs_input_grad(has_gain ? n + 2 : n + 1));
    // sources..., queries, norm_weights, eps, scale, out_weight, out_eps, keep_h, record
    variable_list result(n + 8);
    // The partial outputs' gradients: all S, zeros for the unused ones, or
    // none at all.
    bool any_partial = false;
    for (size_t s = 0; s < S; ++s) any_partial = any_partial || grads[s].defined();
    const at::Tensor& grad_lse = grads[S];
    if (!any_partial && !grad_lse.defined()) return result;
    std::vector<at::Tensor> grad_partials;
    if (any_partial) {
      for (size_t s = 0; s < S; ++s) {
        grad_partials.push_back(grads[s].defined() ? grads[s] : at::zeros_like(sources[0]));
      }
    }
    const variable_list computed = expand_masked(
        BackwardNode<BlockReadsBwdOp>::run(
            at::TensorList(grad_partials), defined_or_none(grad_lse), at::TensorList(sources),
            queries, defined_or_none(saved[n + 1]), saved[n + 4], saved[n + 5],
            ctx->saved_data["scale"].toDouble(), mask, defined_or_none(out_weight),
            defined_or_none(saved[n + 3]), defined_or_none(saved[n + 6])),
        mask);
    for (size_t i = 0; i < n + 2; ++i) result[i] = computed[i];
    if (normed) result[n + 4] = computed[n + 2];
    return result;
  }
};

// Phase 2, with or without the output norm (h kept as BlockReadsFunction
// keeps h_0) and the prefix add (P' saved in place of the block sum; its
// gradient reaches both the block sum and delta).
class MergeFunction : public torch::autograd::Function<MergeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& partial_out,
                               const at::Tensor& lse, const at::Tensor& block_sum,
                               const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                               double eps, double scale, const std::optional<at::Tensor>& out_weight,
                               std::optional<double> out_eps, bool keep_h,
                               const std::optional<at::Tensor>& delta, bool record) {
    const bool normed = is_defined(out_weight);
    auto [out, rstd, weight, h, out_rstd, sum] = call_below_autograd<MergeFwdOp>(
        partial_out, lse, block_sum, query, norm_weight, eps, scale, out_weight, out_eps,
        keep_h || (normed && record), delta);
    const bool prefix = is_defined(delta);
    ctx->save_for_backward({partial_out, prefix ? sum : block_sum, query,
                            norm_weight.value_or(at::Tensor()), out_weight.value_or(at::Tensor()),
                            h, rstd, weight, out_rstd});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = is_defined(norm_weight);
    ctx->saved_data["prefix"] = prefix;
    const at::Tensor h_out = normed && !keep_h ? at::empty({0}, h.options()) : h;
    // P' has a gradient only when the block sum or delta can take one. (One
    // call: each mark_non_differentiable replaces the set.)
    if (!prefix || !(block_sum.requires_grad() || delta->requires_grad())) {
      ctx->mark_non_differentiable({rstd, weight, h_out, out_rstd, sum});
    } else {
      ctx->mark_non_differentiable({rstd, weight, h_out, out_rstd});
    }
    ctx->set_materialize_grads(false);
    return {out, rstd, weight, h_out, out_rstd, sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    const bool prefix = ctx->saved_data["prefix"].toBool();
    const bool normed = saved[4].defined();
    // needs_input_grad counts the tensor inputs given: partial_out, lse,
    // block_sum, query, the gain (when given), out_weight (when given),
    // delta (when given).
    const size_t delta_input = 4 + (has_gain ? 1 : 0) + (normed ? 1 : 0);
    const bool want_sum = ctx->needs_input_grad(2);
    const bool want_delta = prefix && ctx->needs_input_grad(delta_input);
    c10::List<bool> mask;
    for (size_t i = 0; i < 4; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.set(2, want_sum || want_delta);
    mask.push_back(has_gain && ctx->needs_input_grad(4));
    if (normed) mask.push_back(ctx->needs_input_grad(has_gain ? 5 : 4));
    // partial_out, lse, block_sum, query, norm_weight, eps, scale, out_weight,
    // out_eps, keep_h, delta, record
    variable_list result(12);
    const at::Tensor& grad_sum = grads[5];  // P''s own gradient (prefix add)
    if (!grads[0].defined()) {
      // Only P' has a gradient: it is that of the block sum and of delta.
      if (want_sum) result[2] = grad_sum;
      if (want_delta) result[10] = grad_sum;
      return result;
    }
    const variable_list computed = expand_masked(
        BackwardNode<MergeBwdOp>::run(grads[0], saved[0], saved[1], saved[2],
                                      defined_or_none(saved[3]), saved[6], saved[7],
                                      ctx->saved_data["scale"].toDouble(), mask,
                                      defined_or_none(saved[4]), defined_or_none(saved[5]),
                                      defined_or_none(saved[8]), defined_or_none(grad_sum)),
        mask);
    for (size_t i = 0; i < 5; ++i) result[i] = computed[i];
    if (!want_sum) result[2] = at::Tensor();
    if (want_delta) result[10] = computed[2];
    if (normed) result[7] = computed[5];
    return result;
  }
};

BlockReadsForward block_reads_fwd_autograd(at::TensorList sources, const at::Tensor& queries,
                                           const std::optional<at::Tensor>& norm_weights,
                                           double eps, double scale,
                                           const std::optional<at::Tensor>& out_weight,
                                           std::optional<double> out_eps, bool keep_h) {
  check_dense_inputs(sources, "sources");
  check_dense(queries, "queries");
  check_dense_optional(norm_weights, "norm_weights");
  check_dense_optional(out_weight, "out_weight");
  const bool record = records({&queries, ptr(norm_weights), ptr(out_weight)}, sources);
  if (kernel_alone(record, {&queries, ptr(norm_weights), ptr(out_weight)}, sources)) {
    return call_below_autograd<BlockReadsFwdOp>(sources, queries, norm_weights, eps, scale,
                                                out_weight, out_eps, keep_h);
  }
  variable_list out = BlockReadsFunction::apply(sources, queries, norm_weights, eps, scale,
                                                out_weight, out_eps, keep_h, record);
  const size_t S = out.size() - 5;
  std::vector<at::Tensor> partials(out.begin(), out.begin() + S);
  return {partials, out[S], out[S + 1], out[S + 2], out[S + 3], out[S + 4]};
}

BlockReadsBackward block_reads_bwd_autograd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight, const std::optional<at::Tensor>& h,
    const std::optional<at::Tensor>& out_rstd) {
  check_dense_inputs(sources, "sources");
  check_dense_inputs(grad_partial_outs, "grad_partial_outs");
  check_dense(queries, "queries");
  const size_t n = sources.size();
  const bool normed = is_defined(out_weight);
  check_reads_mask(output_mask, n, normed);
  const variable_list all = expand_masked(
      BackwardNode<BlockReadsBwdOp>::apply(grad_partial_outs, grad_lse, sources, queries,
                                           norm_weights, rstd, weights, scale, output_mask,
                                           out_weight, h, out_rstd),
      output_mask);
  return {take_front(all, n), all[n], all[n + 1], normed ? all[n + 2] : at::Tensor()};
}

MergeForward block_read_merge_fwd_autograd(const at::Tensor& partial_out, const at::Tensor& lse,
                                           const at::Tensor& block_sum, const at::Tensor& query,
                                           const std::optional<at::Tensor>& norm_weight,
                                           double eps, double scale,
                                           const std::optional<at::Tensor>& out_weight,
                                           std::optional<double> out_eps, bool keep_h,
                                           const std::optional<at::Tensor>& delta) {
  for (const auto& [t, name] :
       {std::pair<const at::Tensor*, const char*>{&partial_out, "partial_out"}, {&lse, "lse"},
        {&block_sum, "block_sum"}, {&query, "query"}}) {
    if (t->defined()) check_dense(*t, name);
  }
  check_dense_optional(norm_weight, "norm_weight");
  check_dense_optional(out_weight, "out_weight");
  check_dense_optional(delta, "delta");
  const bool record = records(
      {&partial_out, &lse, &block_sum, &query, ptr(norm_weight), ptr(out_weight), ptr(delta)});
  if (kernel_alone(record, {&partial_out, &lse, &block_sum, &query, ptr(norm_weight),
                           ptr(out_weight), ptr(delta)})) {
    return call_below_autograd<MergeFwdOp>(partial_out, lse, block_sum, query, norm_weight, eps,
                                           scale, out_weight, out_eps, keep_h, delta);
  }
  const variable_list out =
      MergeFunction::apply(partial_out, lse, block_sum, query, norm_weight, eps, scale,
                           out_weight, out_eps, keep_h, delta, record);
  return {out[0], out[1], out[2], out[3], out[4], out[5]};
}

at::Tensor block_read_merge_inplace_autograd(const at::Tensor& partial_out, const at::Tensor& lse,
                                             const at::Tensor& block_sum, const at::Tensor& query,
                                             const std::optional<at::Tensor>& norm_weight,
                                             double eps, double scale,
                                             const std::optional<at::Tensor>& out_weight,
                                             std::optional<double> out_eps,
                                             const std::optional<at::Tensor>& delta) {
  TORCH_CHECK(!records({&partial_out, &lse, &block_sum, &query, ptr(norm_weight),
                        ptr(out_weight), ptr(delta)}),
              "attnres::block_read_merge_inplace has no derivative (it overwrites the partial "
              "output its backward would need); use block_read_merge_fwd when gradients are "
              "wanted");
  at::Tensor sum = call_below_autograd<MergeInplaceOp>(partial_out, lse, block_sum, query,
                                                       norm_weight, eps, scale, out_weight,
                                                       out_eps, delta);
  torch::autograd::increment_version(partial_out);
  return sum;
}

MergeBackward block_read_merge_bwd_autograd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& rstd, const at::Tensor& weight, double scale,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& out_weight,
    const std::optional<at::Tensor>& h, const std::optional<at::Tensor>& out_rstd,
    const std::optional<at::Tensor>& grad_block_sum_out) {
  const bool normed = is_defined(out_weight);
  check_merge_mask(output_mask, normed);
  const variable_list all = expand_masked(
      BackwardNode<MergeBwdOp>::apply(grad_out, partial_out, block_sum, query, norm_weight, rstd,
                                      weight, scale, output_mask, out_weight, h, out_rstd,
                                      grad_block_sum_out),
      output_mask);
  return {all[0], all[1], all[2], all[3], all[4], normed ? all[5] : at::Tensor()};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) {
  m.impl("block_reads_fwd", &block_reads_fwd_autograd);
  m.impl("block_reads_bwd", &block_reads_bwd_autograd);
  m.impl("block_read_merge_fwd", &block_read_merge_fwd_autograd);
  m.impl("block_read_merge_bwd", &block_read_merge_bwd_autograd);
  m.impl("block_read_merge_inplace", &block_read_merge_inplace_autograd);
}

}  // namespace attnres
