// Two-phase Block reads (docs/design.md §10): argument checks, the host
// sequence of every device (attnres/block_read_sequence.h) and the C++ API
// of block_reads.h. The schemas are in the one TORCH_LIBRARY block
// (ops.cpp), the autograd in autograd/block_reads.cpp, the kernels in
// cpu/ and cuda/.
#include "attnres/block_reads.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

#include "attnres/arguments.h"
#include "attnres/block_read_sequence.h"
#include "attnres/gradient_cache.h"
#include "attnres/op_sequence.h"
#include "autograd/helpers.h"

namespace attnres {
namespace {

bool is_defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// lse and its gradient are float64 for every source dtype: the gradient the
// merge sends to phase 1, -a_P (1 - a_P) <dh, P - y>, can exceed float32's
// range where the read's own gradients do not (docs/design.md §10, "Range").
constexpr at::ScalarType kLseDtype = at::kDouble;

std::vector<int64_t> with_front(std::vector<int64_t> front, const std::vector<int64_t>& lead) {
  front.insert(front.end(), lead.begin(), lead.end());
  return front;
}

// queries [S, D] and norm_weights (the queries' shape), then the sources
// and the first reader's parameters with depth_attention's checks.
DepthProblem check_block_reads_args(at::TensorList sources, const at::Tensor& queries,
                                    const std::optional<at::Tensor>& norm_weights, double eps,
                                    double scale) {
  TORCH_CHECK_VALUE(queries.defined(), "queries must be a tensor [S, D]");
  check_dense(queries, "queries");
  TORCH_CHECK_VALUE(queries.dim() == 2 && queries.size(0) >= 1,
                    "queries must have shape [S, D] (one query per reader, S >= 1), got ",
                    queries.sizes());
  if (!sources.empty() && sources[0].defined() && sources[0].dim() >= 1) {
    TORCH_CHECK_VALUE(queries.size(1) == sources[0].size(-1), "queries must have shape [S, D] = [",
                      queries.size(0), ", ", sources[0].size(-1), "], got ", queries.sizes());
  }
  std::optional<at::Tensor> gain0;
  if (is_defined(norm_weights)) {
    check_dense(*norm_weights, "norm_weights");
    TORCH_CHECK_VALUE(norm_weights->sizes() == queries.sizes(),
                      "norm_weights must have the queries' shape ", queries.sizes(), ", got ",
                      norm_weights->sizes());
    gain0 = norm_weights->select(0, 0);
  }
  return check_forward_args(sources, queries.select(0, 0), gain0, eps, scale);
}

DepthProblem check_merge_args(const at::Tensor& partial_out, const at::Tensor& lse,
                              const at::Tensor& block_sum, const at::Tensor& query,
                              const std::optional<at::Tensor>& norm_weight, double eps,
                              double scale) {
  TORCH_CHECK_VALUE(block_sum.defined(), "block_sum must be a tensor [..., D]");
  const DepthProblem p = check_forward_args({block_sum}, query, norm_weight, eps, scale);
  check_like(partial_out, "partial_out", block_sum, "block_sum's");
  check_stat(lse, "lse", p.lead_shape, kLseDtype, block_sum);
  return p;
}

// The in-place merge writes its read over partial_out while it reads every
// other input: partial_out contiguous, and no input sharing memory with it.
void check_merge_in_place(const at::Tensor& partial_out,
                          std::initializer_list<std::pair<const at::Tensor*, const char*>> inputs) {
  TORCH_CHECK_VALUE(partial_out.is_contiguous(),
                    "partial_out must be contiguous for block_read_merge_inplace (the read is "
                    "written into it)");
  for (const auto& [t, name] : inputs) {
    if (t == nullptr || !t->defined()) continue;
    TORCH_CHECK_VALUE(!partial_out.is_same(*t), "partial_out and ", name,
                      " must be different tensors");
    TORCH_CHECK(!shares_memory(partial_out, *t), name,
                " shares memory with partial_out (some of their elements refer to a "
                "single memory location), which block_read_merge_inplace overwrites while it "
                "reads ", name, ": pass a tensor apart from it");
  }
}

// What both phase-1 backwards check first (the incoming gradients and the
// forward's statistics); the normed one checks its own arguments after.
DepthProblem check_reads_bwd_args(at::TensorList grad_partial_outs,
                                  const std::optional<at::Tensor>& grad_lse,
                                  at::TensorList sources, const at::Tensor& queries,
                                  const std::optional<at::Tensor>& norm_weights,
                                  const at::Tensor& rstd, const at::Tensor& weights, double scale) {
  const DepthProblem p = check_block_reads_args(sources, queries, norm_weights, 0.0, scale);
  const int64_t S = queries.size(0);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  TORCH_CHECK_VALUE(grad_partial_outs.empty() || static_cast<int64_t>(grad_partial_outs.size()) == S,
                    "grad_partial_outs must hold S = ", S, " tensors (or none), got ",
                    grad_partial_outs.size());
  for (const auto& g : grad_partial_outs) check_like(g, "grad_partial_outs", src0, "the sources'");
  if (is_defined(grad_lse)) {
    check_stat(*grad_lse, "grad_lse", with_front({S}, p.lead_shape), kLseDtype, src0);
  }
  check_stat(rstd, "rstd", p.stat_shape(), acc, src0);
  check_stat(weights, "weights", with_front({S, p.N}, p.lead_shape), acc, src0);
  return p;
}

// The source gradients output_mask asks for (its first N entries), from the
// CPU gradient cache where it applies.
std::vector<at::Tensor> wanted_source_grads(const DepthProblem& p, const at::Tensor& src0,
                                            const c10::List<bool>& output_mask) {
  std::vector<at::Tensor> grads(p.N);
  for (int64_t i = 0; i < p.N; ++i) {
    if (output_mask.get(i)) grads[i] = detail::empty_cached(src0.sizes(), src0.options());
  }
  return grads;
}

// The output norm's checks of a backward: out_weight, the forward's h and
// out_rstd ([lead...], accumulation dtype), all like `like`.
void check_out_norm_bwd_args(const at::Tensor& out_weight, const std::optional<at::Tensor>& h,
                             const std::optional<at::Tensor>& out_rstd, const at::Tensor& like,
                             const char* like_name, const DepthProblem& p) {
  check_out_norm_args(out_weight, 0.0, {like}, p);
  check_like(h.value_or(at::Tensor()), "h (the forward's read before the output norm)", like,
             like_name);
  check_stat(out_rstd.value_or(at::Tensor()), "out_rstd", p.lead_shape,
             acc_dtype_for(like.scalar_type()), like);
}

}  // namespace

// ---- the host sequence of every device (block_read_sequence.h) ----------------

BlockReadsForward run_block_reads_fwd(const BlockReadKernels& k, at::TensorList sources,
                                      const at::Tensor& queries,
                                      const std::optional<at::Tensor>& norm_weights, double eps,
                                      double scale, const std::optional<at::Tensor>& out_weight,
                                      std::optional<double> out_eps, bool keep_h) {
  const DepthProblem p = check_block_reads_args(sources, queries, norm_weights, eps, scale);
  const double norm_eps = resolve_out_eps(out_eps, eps);
  if (is_defined(out_weight)) check_out_norm_args(*out_weight, norm_eps, sources, p);
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(sources[0].device());
  const int64_t S = queries.size(0);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  const auto rows = src0.options().memory_format(at::MemoryFormat::Contiguous);
  OutNormOutputs norm(out_weight, norm_eps, keep_h, src0, p);
  std::vector<at::Tensor> partial_outs;
  for (int64_t s = 0; s < S; ++s) partial_outs.push_back(detail::empty_cached(src0.sizes(), rows));
  at::Tensor lse = at::empty(with_front({S}, p.lead_shape), src0.options().dtype(kLseDtype));
  at::Tensor rstd = at::empty(p.stat_shape(), src0.options().dtype(acc));
  at::Tensor weights = at::empty(with_front({S, p.N}, p.lead_shape), src0.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(queries, norm_weights, scale, acc);
    k.reads_forward({p.N, S, p.D, p.T, sources, u, eps, partial_outs, lse, rstd, weights,
                     norm.kernel()});
  }
  return {partial_outs, lse, rstd, weights, norm.h, norm.rstd};
}

namespace {

// The fused prefix add's delta (docs/design.md §12): block_sum's shape,
// dtype and device.
void check_delta(const std::optional<at::Tensor>& delta, const at::Tensor& block_sum) {
  if (delta.has_value()) check_like(*delta, "delta", block_sum, "block_sum's");
}

// Phase 2's forward into `out` (a new tensor, or partial_out in place);
// with delta, P' = block_sum + delta into a new `sum` that the read uses.
void merge_forward(const BlockReadKernels& k, const DepthProblem& p, const at::Tensor& partial_out,
                   const at::Tensor& lse, const at::Tensor& block_sum, const at::Tensor& query,
                   const std::optional<at::Tensor>& norm_weight, double eps, double scale,
                   const OutNormOutputs& norm, const std::optional<at::Tensor>& delta,
                   at::Tensor& out, at::Tensor& rstd, at::Tensor& weight, at::Tensor& sum) {
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  rstd = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  weight = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  sum = delta ? at::empty(block_sum.sizes(),
                          block_sum.options().memory_format(at::MemoryFormat::Contiguous))
              : at::empty({0}, block_sum.options());
  if (p.T == 0) return;
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  const at::Tensor lse_c = lse.contiguous();
  const PrefixAdd prefix{delta ? *delta : sum, sum};
  k.merge_forward({p.D, p.T, partial_out, lse_c, block_sum, u, eps, out, rstd, weight,
                   norm.kernel(), delta ? &prefix : nullptr});
}

}  // namespace

MergeForward run_block_read_merge_fwd(const BlockReadKernels& k, const at::Tensor& partial_out,
                                      const at::Tensor& lse, const at::Tensor& block_sum,
                                      const at::Tensor& query,
                                      const std::optional<at::Tensor>& norm_weight, double eps,
                                      double scale, const std::optional<at::Tensor>& out_weight,
                                      std::optional<double> out_eps, bool keep_h,
                                      const std::optional<at::Tensor>& delta) {
  const DepthProblem p = check_merge_args(partial_out, lse, block_sum, query, norm_weight, eps, scale);
  const double norm_eps = resolve_out_eps(out_eps, eps);
  if (is_defined(out_weight)) check_out_norm_args(*out_weight, norm_eps, {block_sum}, p);
  check_delta(delta, block_sum);
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(block_sum.device());
  const auto rows = block_sum.options().memory_format(at::MemoryFormat::Contiguous);
  OutNormOutputs norm(out_weight, norm_eps, keep_h, block_sum, p);
  at::Tensor out = detail::empty_cached(block_sum.sizes(), rows);
  at::Tensor rstd, weight, sum;
  merge_forward(k, p, partial_out, lse, block_sum, query, norm_weight, eps, scale, norm, delta,
                out, rstd, weight, sum);
  return {out, rstd, weight, norm.h, norm.rstd, sum};
}

at::Tensor run_block_read_merge_inplace(const BlockReadKernels& k, const at::Tensor& partial_out,
                                        const at::Tensor& lse, const at::Tensor& block_sum,
                                        const at::Tensor& query,
                                        const std::optional<at::Tensor>& norm_weight, double eps,
                                        double scale, const std::optional<at::Tensor>& out_weight,
                                        std::optional<double> out_eps,
                                        const std::optional<at::Tensor>& delta) {
  const DepthProblem p = check_merge_args(partial_out, lse, block_sum, query, norm_weight, eps, scale);
  const double norm_eps = resolve_out_eps(out_eps, eps);
  if (is_defined(out_weight)) check_out_norm_args(*out_weight, norm_eps, {block_sum}, p);
  check_delta(delta, block_sum);
  check_merge_in_place(partial_out,
                       {{&block_sum, "block_sum"}, {&lse, "lse"}, {&query, "query"},
                        {norm_weight ? &*norm_weight : nullptr, "norm_weight"},
                        {out_weight ? &*out_weight : nullptr, "out_weight"},
                        {delta ? &*delta : nullptr, "delta"}});
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(block_sum.device());
  OutNormOutputs norm(out_weight, norm_eps, /*keep_h=*/false, block_sum, p);
  // Each step of the kernels reads a token's elements of the partial output
  // (and of h, written first) before it stores the read over them, so the
  // read may overwrite the partial output.
  at::Tensor out = partial_out;
  at::Tensor rstd, weight, sum;
  merge_forward(k, p, partial_out, lse, block_sum, query, norm_weight, eps, scale, norm, delta,
                out, rstd, weight, sum);
  return sum;
}

BlockReadsBackward run_block_reads_bwd(
    const BlockReadKernels& k, at::TensorList grad_partial_outs,
    const std::optional<at::Tensor>& grad_lse, at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight, const std::optional<at::Tensor>& h,
    const std::optional<at::Tensor>& out_rstd) {
  const DepthProblem p = check_reads_bwd_args(grad_partial_outs, grad_lse, sources, queries,
                                              norm_weights, rstd, weights, scale);
  const int64_t S = queries.size(0);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  const bool normed = is_defined(out_weight);
  if (normed) check_out_norm_bwd_args(*out_weight, h, out_rstd, src0, "the sources'", p);
  check_reads_mask(output_mask, p.N, normed);
  if (k.check_device) k.check_device();
  const c10::DeviceGuard guard(src0.device());
  std::vector<at::Tensor> grads = wanted_source_grads(p, src0, output_mask);
  const bool want_query = output_mask.get(p.N), want_gain = output_mask.get(p.N + 1);
  const OutNormGrads norm(out_weight, out_rstd, normed && output_mask.get(p.N + 2), p.D);
  at::Tensor z;
  if (want_query || want_gain) z = at::zeros({S, p.D}, queries.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(queries, norm_weights, scale, acc);
    const at::Tensor dlse = is_defined(grad_lse) ? grad_lse->contiguous() : at::Tensor();
    k.reads_backward({p.N, S, p.D, p.T, grad_partial_outs, dlse, sources, u, rstd.contiguous(),
                      weights.contiguous(), grads, z, norm.kernel(), normed ? &*h : nullptr});
  }
  auto [wanted, grad_queries, grad_gains] =
      finish_backward(grads, z, queries, norm_weights, scale, want_query, want_gain);
  return {std::move(wanted), grad_queries, grad_gains, norm.grad()};
}

MergeBackward run_block_read_merge_bwd(
    const BlockReadKernels& k, const at::Tensor& grad_out, const at::Tensor& partial_out,
    const at::Tensor& block_sum, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& rstd,
    const at::Tensor& weight, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight, const std::optional<at::Tensor>& h,
    const std::optional<at::Tensor>& out_rstd,
    const std::optional<at::Tensor>& grad_block_sum_out) {
  TORCH_CHECK_VALUE(block_sum.defined(), "block_sum must be a tensor [..., D]");
  const DepthProblem p = check_forward_args({block_sum}, query, norm_weight, 0.0, scale);
  check_like(grad_out, "grad_out", block_sum, "block_sum's");
  check_like(partial_out, "partial_out", block_sum, "block_sum's");
  const bool with_sum_grad = is_defined(grad_block_sum_out);
  if (with_sum_grad) check_like(*grad_block_sum_out, "grad_block_sum_out", block_sum, "block_sum's");
  const bool normed = is_defined(out_weight);
  if (normed) check_out_norm_bwd_args(*out_weight, h, out_rstd, block_sum, "block_sum's", p);
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  check_stat(rstd, "rstd", p.lead_shape, acc, block_sum);
  check_stat(weight, "weight", p.lead_shape, acc, block_sum);
  check_merge_mask(output_mask, normed);
  if (k.check_device) k.check_device();
  const c10::DeviceGuard guard(block_sum.device());
  const auto rows = block_sum.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor d_partial, d_lse, d_block, z;
  if (output_mask.get(0)) d_partial = detail::empty_cached(block_sum.sizes(), rows);
  if (output_mask.get(1)) d_lse = at::empty(p.lead_shape, block_sum.options().dtype(kLseDtype));
  if (output_mask.get(2)) d_block = detail::empty_cached(block_sum.sizes(), rows);
  if (output_mask.get(3) || output_mask.get(4)) z = at::zeros({p.D}, query.options().dtype(acc));
  const OutNormGrads norm(out_weight, out_rstd, normed && output_mask.get(5), p.D);
  if (p.T > 0) {
    const at::Tensor u = effective_query(query, norm_weight, scale, acc);
    k.merge_backward({p.D, p.T, grad_out, partial_out, block_sum, u, rstd.contiguous(),
                      weight.contiguous(), d_partial, d_lse, d_block, z, norm.kernel(),
                      normed ? &*h : nullptr,
                      with_sum_grad && d_block.defined() ? &*grad_block_sum_out : nullptr});
  }
  at::Tensor grad_query, grad_gain;
  if (z.defined()) std::tie(grad_query, grad_gain) = parameter_grads(z, query, norm_weight, scale);
  if (!output_mask.get(3)) grad_query = at::Tensor();
  if (!output_mask.get(4)) grad_gain = at::Tensor();
  return {d_partial, d_lse, d_block, grad_query, grad_gain, norm.grad()};
}

// ---- C++ API ---------------------------------------------------------------------

BlockReadsForward block_reads_fwd(at::TensorList sources, const at::Tensor& queries,
                                  const std::optional<at::Tensor>& norm_weights, double eps,
                                  double scale, const std::optional<at::Tensor>& out_weight,
                                  std::optional<double> out_eps, bool keep_h) {
  return call_op<BlockReadsFwdOp>(sources, queries, norm_weights, eps, scale, out_weight, out_eps,
                                  keep_h);
}

BlockReadsBackward block_reads_bwd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask,
    const std::optional<at::Tensor>& out_weight, const std::optional<at::Tensor>& h,
    const std::optional<at::Tensor>& out_rstd) {
  return call_op<BlockReadsBwdOp>(grad_partial_outs, grad_lse, sources, queries, norm_weights,
                                  rstd, weights, scale, output_mask, out_weight, h, out_rstd);
}

MergeForward block_read_merge_fwd(const at::Tensor& partial_out, const at::Tensor& lse,
                                  const at::Tensor& block_sum, const at::Tensor& query,
                                  const std::optional<at::Tensor>& norm_weight, double eps,
                                  double scale, const std::optional<at::Tensor>& out_weight,
                                  std::optional<double> out_eps, bool keep_h,
                                  const std::optional<at::Tensor>& delta) {
  return call_op<MergeFwdOp>(partial_out, lse, block_sum, query, norm_weight, eps, scale,
                             out_weight, out_eps, keep_h, delta);
}

MergeBackward block_read_merge_bwd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& rstd, const at::Tensor& weight, double scale,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& out_weight,
    const std::optional<at::Tensor>& h, const std::optional<at::Tensor>& out_rstd,
    const std::optional<at::Tensor>& grad_block_sum_out) {
  return call_op<MergeBwdOp>(grad_out, partial_out, block_sum, query, norm_weight, rstd, weight,
                             scale, output_mask, out_weight, h, out_rstd, grad_block_sum_out);
}

at::Tensor block_read_merge_inplace(const at::Tensor& partial_out, const at::Tensor& lse,
                                    const at::Tensor& block_sum, const at::Tensor& query,
                                    const std::optional<at::Tensor>& norm_weight, double eps,
                                    double scale, const std::optional<at::Tensor>& out_weight,
                                    std::optional<double> out_eps,
                                    const std::optional<at::Tensor>& delta) {
  return call_op<MergeInplaceOp>(partial_out, lse, block_sum, query, norm_weight, eps, scale,
                                 out_weight, out_eps, delta);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> block_reads(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, double eps, double scale,
    const std::optional<at::Tensor>& out_weight, std::optional<double> out_eps) {
  auto result = block_reads_fwd(sources, queries, norm_weights, eps, scale, out_weight, out_eps);
  return {std::get<0>(result), std::get<1>(result)};
}

at::Tensor block_read_merge(const at::Tensor& partial_out, const at::Tensor& lse,
                            const at::Tensor& block_sum, const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight, double eps,
                            double scale, const std::optional<at::Tensor>& out_weight,
                            std::optional<double> out_eps) {
  return std::get<0>(block_read_merge_fwd(partial_out, lse, block_sum, query, norm_weight, eps,
                                          scale, out_weight, out_eps));
}

}  // namespace attnres
