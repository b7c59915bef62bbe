// Two-phase Block reads (docs/design.md §10): argument checks, the host
// sequence of every device (attnres/block_read_sequence.h) and the CPU's
// backward, the CPU registrations (the CUDA ones: cuda/block_reads_cuda.cu),
// the C++ autograd and the C++ API of block_reads.h.
// The schemas are in the one TORCH_LIBRARY block (ops.cpp).
#include "attnres/block_reads.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <string>

#include "attnres/arguments.h"
#include "attnres/block_read_sequence.h"
#include "attnres/gradient_cache.h"
#include "attnres/op_sequence.h"
#include "autograd_helpers.h"
#include "cpu/block_reads_cpu.h"

namespace attnres {
namespace {

bool is_defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Python's name of a dtype ("torch.float32"), as the fake kernels print it.
std::string py_dtype(at::ScalarType dtype) { return "torch." + c10::getDtypeNames(dtype).first; }

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// lse and its gradient are float64 for every source dtype: the gradient the
// merge sends to phase 1, -a_P (1 - a_P) <dh, P - y>, can exceed float32's
// range where the read's own gradients do not (docs/design.md §10, "Range").
constexpr at::ScalarType kLseDtype = at::kDouble;

// A statistic [lead...] / [k, lead...] in the given dtype on the sources'
// device.
void check_stat(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType acc,
                const at::Tensor& src0) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor");
  check_dense(t, name);
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == acc, name, " must have dtype ", py_dtype(acc), ", got ",
                   py_dtype(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == src0.device(), name, " must be on the sources' device");
}

// A tensor with the shape, dtype and device of `like` (owner: "block_sum's",
// "the sources'").
void check_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                const char* like_name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor");
  check_dense(t, name);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have ", like_name, " shape ",
                    like.sizes(), ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have ", like_name,
                   " dtype ", py_dtype(like.scalar_type()), ", got ", py_dtype(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on ", like_name, " device");
}

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

// The in-place merges write their result (`what`: h or y) over partial_out
// while they read block_sum: partial_out contiguous, block_sum apart from it.
void check_merge_in_place(const at::Tensor& partial_out, const at::Tensor& block_sum,
                          const char* op, const char* what) {
  TORCH_CHECK_VALUE(partial_out.is_contiguous(), "partial_out must be contiguous for ", op, " (",
                    what, " is written into it)");
  TORCH_CHECK_VALUE(!partial_out.is_same(block_sum),
                    "partial_out and block_sum must be different tensors");
  at::assert_no_overlap(partial_out, block_sum);
}

void check_mask(const c10::List<bool>& mask, size_t expected, const char* what) {
  TORCH_CHECK_VALUE(mask.size() == expected, "output_mask must have ", expected, " entries (",
                    what, "), got ", mask.size());
}

// kernels built with AVX2 (ATTNRES_CPU_ARCH=avx2): refuse a CPU without it
// before any AVX2 instruction runs (this file is built without the flags).
void check_cpu_capability() {
#if defined(ATTNRES_CPU_KERNELS_AVX2)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  TORCH_CHECK(ok,
              "attnres was built with AVX2 CPU kernels (ATTNRES_CPU_ARCH=avx2) but this CPU "
              "lacks AVX2/FMA; rebuild with ATTNRES_CPU_ARCH=default");
#endif
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

}  // namespace

// ---- the forward ops' host sequence of every device (block_read_sequence.h) ---

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> run_block_reads_fwd(
    const BlockReadKernels& k, at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, double eps, double scale) {
  const DepthProblem p = check_block_reads_args(sources, queries, norm_weights, eps, scale);
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(sources[0].device());
  const int64_t S = queries.size(0);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  const at::Tensor u = effective_query(queries, norm_weights, scale, acc);
  std::vector<at::Tensor> partial_outs;
  for (int64_t s = 0; s < S; ++s) {
    partial_outs.push_back(detail::empty_cached(src0.sizes(), src0.options()));
  }
  at::Tensor lse = at::empty(with_front({S}, p.lead_shape), src0.options().dtype(kLseDtype));
  at::Tensor rstd = at::empty(p.stat_shape(), src0.options().dtype(acc));
  at::Tensor weights = at::empty(with_front({S, p.N}, p.lead_shape), src0.options().dtype(acc));
  if (p.T > 0) {
    k.reads_forward({p.N, S, p.D, p.T, sources, u, eps, partial_outs, lse, rstd, weights});
  }
  return {partial_outs, lse, rstd, weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_block_read_merge_fwd(
    const BlockReadKernels& k, const at::Tensor& partial_out, const at::Tensor& lse,
    const at::Tensor& block_sum, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale) {
  const DepthProblem p = check_merge_args(partial_out, lse, block_sum, query, norm_weight, eps, scale);
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(block_sum.device());
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  at::Tensor out = detail::empty_cached(block_sum.sizes(), block_sum.options());
  at::Tensor rstd = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  at::Tensor weight = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor lse_c = lse.contiguous();
    k.merge_forward({p.D, p.T, partial_out, lse_c, block_sum, u, eps, out, rstd, weight});
  }
  return {out, rstd, weight};
}


void run_block_read_merge_inplace(const BlockReadKernels& k, const at::Tensor& partial_out,
                                  const at::Tensor& lse, const at::Tensor& block_sum,
                                  const at::Tensor& query,
                                  const std::optional<at::Tensor>& norm_weight, double eps,
                                  double scale) {
  const DepthProblem p = check_merge_args(partial_out, lse, block_sum, query, norm_weight, eps, scale);
  check_merge_in_place(partial_out, block_sum, "block_read_merge_inplace", "h");
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(block_sum.device());
  if (p.T == 0) return;
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  at::Tensor rstd = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  at::Tensor weight = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  const at::Tensor lse_c = lse.contiguous();
  // Each step of the kernel reads y's and P's elements before it stores h's
  // at the same place, so h may overwrite y.
  at::Tensor out = partial_out;
  k.merge_forward({p.D, p.T, partial_out, lse_c, block_sum, u, eps, out, rstd, weight});
}

BlockReadsNormedForward run_block_reads_normed_fwd(const BlockReadKernels& k,
                                                   at::TensorList sources,
                                                   const at::Tensor& queries,
                                                   const std::optional<at::Tensor>& norm_weights,
                                                   const at::Tensor& out_weight, double eps,
                                                   double scale, double out_eps, bool keep_h) {
  const DepthProblem p = check_block_reads_args(sources, queries, norm_weights, eps, scale);
  check_out_norm_args(out_weight, out_eps, sources, p);
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(sources[0].device());
  const int64_t S = queries.size(0);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  const auto rows = src0.options().memory_format(at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> partial_outs;
  for (int64_t s = 0; s < S; ++s) partial_outs.push_back(detail::empty_cached(src0.sizes(), rows));
  at::Tensor lse = at::empty(with_front({S}, p.lead_shape), src0.options().dtype(kLseDtype));
  at::Tensor rstd = at::empty(p.stat_shape(), src0.options().dtype(acc));
  at::Tensor weights = at::empty(with_front({S, p.N}, p.lead_shape), src0.options().dtype(acc));
  at::Tensor h = keep_h ? detail::empty_cached(src0.sizes(), rows) : at::empty({0}, src0.options());
  at::Tensor out_rstd = at::empty(p.lead_shape, src0.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(queries, norm_weights, scale, acc);
    const at::Tensor w = out_weight.to(acc).contiguous();
    at::Tensor no_h;
    const OutNormForward norm{w, out_eps, out_rstd, keep_h ? h : no_h};
    k.reads_forward(
        {p.N, S, p.D, p.T, sources, u, eps, partial_outs, lse, rstd, weights, &norm});
  }
  return {partial_outs, lse, rstd, weights, h, out_rstd};
}

MergeNormedForward run_block_read_merge_normed_fwd(
    const BlockReadKernels& k, const at::Tensor& partial_out, const at::Tensor& lse,
    const at::Tensor& block_sum, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, double eps, double scale, double out_eps, bool keep_h) {
  const DepthProblem p = check_merge_args(partial_out, lse, block_sum, query, norm_weight, eps, scale);
  check_out_norm_args(out_weight, out_eps, {block_sum}, p);
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(block_sum.device());
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  const auto rows = block_sum.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor out = detail::empty_cached(block_sum.sizes(), rows);
  at::Tensor h =
      keep_h ? detail::empty_cached(block_sum.sizes(), rows) : at::empty({0}, block_sum.options());
  at::Tensor rstd = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  at::Tensor weight = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  at::Tensor out_rstd = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(query, norm_weight, scale, acc);
    const at::Tensor w = out_weight.to(acc).contiguous();
    at::Tensor no_h;
    const OutNormForward norm{w, out_eps, out_rstd, keep_h ? h : no_h};
    const at::Tensor lse_c = lse.contiguous();
    k.merge_forward(
        {p.D, p.T, partial_out, lse_c, block_sum, u, eps, out, rstd, weight, &norm});
  }
  return {out, h, rstd, weight, out_rstd};
}


void run_block_read_merge_normed_inplace(const BlockReadKernels& k,
                                         const at::Tensor& partial_out, const at::Tensor& lse,
                                         const at::Tensor& block_sum, const at::Tensor& query,
                                         const std::optional<at::Tensor>& norm_weight,
                                         const at::Tensor& out_weight, double eps, double scale,
                                         double out_eps) {
  const DepthProblem p = check_merge_args(partial_out, lse, block_sum, query, norm_weight, eps, scale);
  check_out_norm_args(out_weight, out_eps, {block_sum}, p);
  check_merge_in_place(partial_out, block_sum, "block_read_merge_normed_inplace", "y");
  if (k.check_device) k.check_device();
  // The kernels run on the current device and its stream: the sources'.
  const c10::DeviceGuard guard(block_sum.device());
  if (p.T == 0) return;
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  const at::Tensor w = out_weight.to(acc).contiguous();
  at::Tensor rstd = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  at::Tensor weight = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  at::Tensor out_rstd = at::empty(p.lead_shape, block_sum.options().dtype(acc));
  at::Tensor no_h;
  const OutNormForward norm{w, out_eps, out_rstd, no_h};
  const at::Tensor lse_c = lse.contiguous();
  // The kernels read a token's packs of y (and of h, written first) before
  // they store y over them, so y may overwrite the partial output.
  at::Tensor out = partial_out;
  k.merge_forward(
      {p.D, p.T, partial_out, lse_c, block_sum, u, eps, out, rstd, weight, &norm});
}

// ---- the backward ops' host sequence of every device (block_read_sequence.h) ----

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> run_block_reads_bwd(
    const BlockReadKernels& k, at::TensorList grad_partial_outs,
    const std::optional<at::Tensor>& grad_lse, at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask) {
  const DepthProblem p = check_reads_bwd_args(grad_partial_outs, grad_lse, sources, queries,
                                              norm_weights, rstd, weights, scale);
  const int64_t S = queries.size(0);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  check_mask(output_mask, p.N + 2, "each source, queries, norm_weights");
  if (k.check_device) k.check_device();
  const c10::DeviceGuard guard(src0.device());
  std::vector<at::Tensor> grads = wanted_source_grads(p, src0, output_mask);
  const bool want_query = output_mask.get(p.N), want_gain = output_mask.get(p.N + 1);
  at::Tensor z;
  if (want_query || want_gain) z = at::zeros({S, p.D}, queries.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(queries, norm_weights, scale, acc);
    const at::Tensor dlse = is_defined(grad_lse) ? grad_lse->contiguous() : at::Tensor();
    k.reads_backward({p.N, S, p.D, p.T, grad_partial_outs, dlse, sources, u,
                               rstd.contiguous(), weights.contiguous(), grads, z});
  }
  return finish_backward(grads, z, queries, norm_weights, scale, want_query, want_gain);
}


// Phase 1 with reader 0's output norm (docs/design.md §11).
BlockReadsNormedBackward run_block_reads_normed_bwd(
    const BlockReadKernels& k, at::TensorList grad_partial_outs,
    const std::optional<at::Tensor>& grad_lse, at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weights,
    const at::Tensor& out_rstd, double scale, const c10::List<bool>& output_mask) {
  const DepthProblem p = check_reads_bwd_args(grad_partial_outs, grad_lse, sources, queries,
                                              norm_weights, rstd, weights, scale);
  const int64_t S = queries.size(0);
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  check_out_norm_args(out_weight, 0.0, sources, p);
  check_like(h, "h (the forward's read before the output norm)", src0, "the sources'");
  check_stat(out_rstd, "out_rstd", p.lead_shape, acc, src0);
  check_mask(output_mask, p.N + 3, "each source, queries, norm_weights, out_weight");
  if (k.check_device) k.check_device();
  const c10::DeviceGuard guard(src0.device());
  std::vector<at::Tensor> grads = wanted_source_grads(p, src0, output_mask);
  const bool want_query = output_mask.get(p.N), want_gain = output_mask.get(p.N + 1);
  at::Tensor z, d_out_weight;
  if (want_query || want_gain) z = at::zeros({S, p.D}, queries.options().dtype(acc));
  if (output_mask.get(p.N + 2)) d_out_weight = at::zeros({p.D}, out_weight.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(queries, norm_weights, scale, acc);
    const at::Tensor dlse = is_defined(grad_lse) ? grad_lse->contiguous() : at::Tensor();
    const at::Tensor w = out_weight.to(acc).contiguous();
    const at::Tensor out_rstd_c = out_rstd.contiguous();
    const OutNormBackward norm{w, out_rstd_c, d_out_weight};
    k.reads_backward({p.N, S, p.D, p.T, grad_partial_outs, dlse, sources, u,
                               rstd.contiguous(), weights.contiguous(), grads, z, &norm, &h});
  }
  auto [wanted, grad_queries, grad_gains] =
      finish_backward(grads, z, queries, norm_weights, scale, want_query, want_gain);
  if (d_out_weight.defined()) d_out_weight = d_out_weight.to(out_weight.scalar_type());
  return {wanted, grad_queries, grad_gains, d_out_weight};
}

// Phase 2.

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_block_read_merge_bwd(
    const BlockReadKernels& k, const at::Tensor& grad_out, const at::Tensor& partial_out,
    const at::Tensor& block_sum, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& rstd,
    const at::Tensor& weight, double scale, const c10::List<bool>& output_mask) {
  TORCH_CHECK_VALUE(block_sum.defined(), "block_sum must be a tensor [..., D]");
  const DepthProblem p = check_forward_args({block_sum}, query, norm_weight, 0.0, scale);
  check_like(grad_out, "grad_out", block_sum, "block_sum's");
  check_like(partial_out, "partial_out", block_sum, "block_sum's");
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  check_stat(rstd, "rstd", p.lead_shape, acc, block_sum);
  check_stat(weight, "weight", p.lead_shape, acc, block_sum);
  check_mask(output_mask, 5, "partial_out, lse, block_sum, query, norm_weight");
  if (k.check_device) k.check_device();
  const c10::DeviceGuard guard(block_sum.device());
  const auto rows = block_sum.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor d_partial, d_lse, d_block, z;
  if (output_mask.get(0)) d_partial = detail::empty_cached(block_sum.sizes(), rows);
  if (output_mask.get(1)) d_lse = at::empty(p.lead_shape, block_sum.options().dtype(kLseDtype));
  if (output_mask.get(2)) d_block = detail::empty_cached(block_sum.sizes(), rows);
  if (output_mask.get(3) || output_mask.get(4)) z = at::zeros({p.D}, query.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(query, norm_weight, scale, acc);
    k.merge_backward({p.D, p.T, grad_out, partial_out, block_sum, u, rstd.contiguous(),
                      weight.contiguous(), d_partial, d_lse, d_block, z});
  }
  at::Tensor grad_query, grad_gain;
  if (z.defined()) std::tie(grad_query, grad_gain) = parameter_grads(z, query, norm_weight, scale);
  if (!output_mask.get(3)) grad_query = at::Tensor();
  if (!output_mask.get(4)) grad_gain = at::Tensor();
  return {d_partial, d_lse, d_block, grad_query, grad_gain};
}

MergeNormedBackward run_block_read_merge_normed_bwd(
    const BlockReadKernels& k, const at::Tensor& grad_out, const at::Tensor& partial_out,
    const at::Tensor& block_sum, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& out_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weight,
    const at::Tensor& out_rstd, double scale, const c10::List<bool>& output_mask) {
  TORCH_CHECK_VALUE(block_sum.defined(), "block_sum must be a tensor [..., D]");
  const DepthProblem p = check_forward_args({block_sum}, query, norm_weight, 0.0, scale);
  check_like(grad_out, "grad_out", block_sum, "block_sum's");
  check_like(partial_out, "partial_out", block_sum, "block_sum's");
  check_out_norm_args(out_weight, 0.0, {block_sum}, p);
  check_like(h, "h (the forward's read before the output norm)", block_sum, "block_sum's");
  const auto acc = acc_dtype_for(block_sum.scalar_type());
  check_stat(rstd, "rstd", p.lead_shape, acc, block_sum);
  check_stat(weight, "weight", p.lead_shape, acc, block_sum);
  check_stat(out_rstd, "out_rstd", p.lead_shape, acc, block_sum);
  check_mask(output_mask, 6, "partial_out, lse, block_sum, query, norm_weight, out_weight");
  if (k.check_device) k.check_device();
  const c10::DeviceGuard guard(block_sum.device());
  const auto rows = block_sum.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor d_partial, d_lse, d_block, z, d_out_weight;
  if (output_mask.get(0)) d_partial = detail::empty_cached(block_sum.sizes(), rows);
  if (output_mask.get(1)) d_lse = at::empty(p.lead_shape, block_sum.options().dtype(kLseDtype));
  if (output_mask.get(2)) d_block = detail::empty_cached(block_sum.sizes(), rows);
  if (output_mask.get(3) || output_mask.get(4)) z = at::zeros({p.D}, query.options().dtype(acc));
  if (output_mask.get(5)) d_out_weight = at::zeros({p.D}, out_weight.options().dtype(acc));
  if (p.T > 0) {
    const at::Tensor u = effective_query(query, norm_weight, scale, acc);
    const at::Tensor w = out_weight.to(acc).contiguous();
    const at::Tensor out_rstd_c = out_rstd.contiguous();
    const OutNormBackward norm{w, out_rstd_c, d_out_weight};
    k.merge_backward({p.D, p.T, grad_out, partial_out, block_sum, u, rstd.contiguous(),
                      weight.contiguous(), d_partial, d_lse, d_block, z, &norm, &h});
  }
  at::Tensor grad_query, grad_gain;
  if (z.defined()) std::tie(grad_query, grad_gain) = parameter_grads(z, query, norm_weight, scale);
  if (!output_mask.get(3)) grad_query = at::Tensor();
  if (!output_mask.get(4)) grad_gain = at::Tensor();
  if (d_out_weight.defined()) d_out_weight = d_out_weight.to(out_weight.scalar_type());
  return {d_partial, d_lse, d_block, grad_query, grad_gain, d_out_weight};
}

namespace {

// ---- autograd ------------------------------------------------------------------

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using autograd_helpers::call_below_autograd;
using autograd_helpers::expand_masked;
using autograd_helpers::no_double_backward;

using BlockReadsFwdSig = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor>(
    at::TensorList, const at::Tensor&, const std::optional<at::Tensor>&, double, double);
using BlockReadsBwdSig = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>(
    at::TensorList, const std::optional<at::Tensor>&, at::TensorList, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, double,
    const c10::List<bool>&);
using MergeFwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, double, double);
using MergeBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, double,
    const c10::List<bool>&);

// The backward ops' nodes: first derivatives only.
class BlockReadsBackwardFunction : public torch::autograd::Function<BlockReadsBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, at::TensorList grad_partial_outs,
                               const std::optional<at::Tensor>& grad_lse, at::TensorList sources,
                               const at::Tensor& queries,
                               const std::optional<at::Tensor>& norm_weights,
                               const at::Tensor& rstd, const at::Tensor& weights, double scale,
                               const c10::List<bool>& output_mask) {
    auto [wanted, grad_queries, grad_gains] = call_below_autograd<BlockReadsBwdSig>(
        "attnres::block_reads_bwd", grad_partial_outs, grad_lse, sources, queries, norm_weights,
        rstd, weights, scale, output_mask);
    const size_t n = sources.size();
    if (output_mask.get(n)) wanted.push_back(grad_queries);
    if (output_mask.get(n + 1)) wanted.push_back(grad_gains);
    return wanted;
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("block_reads");
  }
};

class MergeBackwardFunction : public torch::autograd::Function<MergeBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& grad_out,
                               const at::Tensor& partial_out, const at::Tensor& block_sum,
                               const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                               const at::Tensor& rstd, const at::Tensor& weight, double scale,
                               const c10::List<bool>& output_mask) {
    auto [a, b, c, d, e] = call_below_autograd<MergeBwdSig>(
        "attnres::block_read_merge_bwd", grad_out, partial_out, block_sum, query, norm_weight,
        rstd, weight, scale, output_mask);
    variable_list wanted;
    for (const auto& t : {a, b, c, d, e}) {
      if (t.defined()) wanted.push_back(t);
    }
    return wanted;
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("block_read_merge");
  }
};

class BlockReadsFunction : public torch::autograd::Function<BlockReadsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList sources,
                               const at::Tensor& queries,
                               const std::optional<at::Tensor>& norm_weights, double eps,
                               double scale) {
    auto [partial_outs, lse, rstd, weights] = call_below_autograd<BlockReadsFwdSig>(
        "attnres::block_reads_fwd", sources, queries, norm_weights, eps, scale);
    variable_list saved(sources.begin(), sources.end());
    saved.push_back(queries);
    saved.push_back(norm_weights.value_or(at::Tensor()));
    saved.push_back(rstd);
    saved.push_back(weights);
    ctx->save_for_backward(saved);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = is_defined(norm_weights);
    ctx->mark_non_differentiable({rstd, weights});
    ctx->set_materialize_grads(false);
    variable_list out(partial_outs.begin(), partial_outs.end());
    out.push_back(lse);
    out.push_back(rstd);
    out.push_back(weights);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 4;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + n);
    const at::Tensor& queries = saved[n];
    const at::Tensor& norm_weights = saved[n + 1];
    const at::Tensor& rstd = saved[n + 2];
    const at::Tensor& weights = saved[n + 3];
    const size_t S = static_cast<size_t>(queries.size(0));
    c10::List<bool> mask;
    for (size_t i = 0; i < n + 1; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(ctx->saved_data["has_gain"].toBool() && ctx->needs_input_grad(n + 1));
    variable_list result(n + 4);  // sources..., queries, norm_weights, eps, scale
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
        BlockReadsBackwardFunction::apply(at::TensorList(grad_partials), defined_or_none(grad_lse),
                                          at::TensorList(sources), queries,
                                          defined_or_none(norm_weights), rstd, weights,
                                          ctx->saved_data["scale"].toDouble(), mask),
        mask);
    for (size_t i = 0; i < n + 2; ++i) result[i] = computed[i];
    return result;
  }
};

class MergeFunction : public torch::autograd::Function<MergeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& partial_out,
                               const at::Tensor& lse, const at::Tensor& block_sum,
                               const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                               double eps, double scale) {
    auto [out, rstd, weight] = call_below_autograd<MergeFwdSig>(
        "attnres::block_read_merge_fwd", partial_out, lse, block_sum, query, norm_weight, eps,
        scale);
    ctx->save_for_backward({partial_out, block_sum, query, norm_weight.value_or(at::Tensor()),
                            rstd, weight});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = is_defined(norm_weight);
    ctx->mark_non_differentiable({rstd, weight});
    ctx->set_materialize_grads(false);
    return {out, rstd, weight};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    c10::List<bool> mask;
    for (size_t i = 0; i < 4; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(ctx->saved_data["has_gain"].toBool() && ctx->needs_input_grad(4));
    variable_list result(7);  // partial_out, lse, block_sum, query, norm_weight, eps, scale
    if (!grads[0].defined()) return result;
    const variable_list computed = expand_masked(
        MergeBackwardFunction::apply(grads[0], saved[0], saved[1], saved[2],
                                     defined_or_none(saved[3]), saved[4], saved[5],
                                     ctx->saved_data["scale"].toDouble(), mask),
        mask);
    for (size_t i = 0; i < 5; ++i) result[i] = computed[i];
    return result;
  }
};

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> block_reads_fwd_autograd(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, double eps, double scale) {
  check_dense_inputs(sources, "sources");
  check_dense(queries, "queries");
  if (is_defined(norm_weights)) check_dense(*norm_weights, "norm_weights");
  variable_list out = BlockReadsFunction::apply(sources, queries, norm_weights, eps, scale);
  const size_t S = out.size() - 3;
  std::vector<at::Tensor> partials(out.begin(), out.begin() + S);
  return {partials, out[S], out[S + 1], out[S + 2]};
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> block_reads_bwd_autograd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask) {
  check_dense_inputs(sources, "sources");
  check_dense_inputs(grad_partial_outs, "grad_partial_outs");
  check_dense(queries, "queries");
  check_mask(output_mask, sources.size() + 2, "each source, queries, norm_weights");
  variable_list grads = BlockReadsBackwardFunction::apply(
      grad_partial_outs, grad_lse, sources, queries, norm_weights, rstd, weights, scale,
      output_mask);
  const size_t n = sources.size();
  at::Tensor grad_gains, grad_queries;
  if (output_mask.get(n + 1)) {
    grad_gains = grads.back();
    grads.pop_back();
  }
  if (output_mask.get(n)) {
    grad_queries = grads.back();
    grads.pop_back();
  }
  return {std::vector<at::Tensor>(grads.begin(), grads.end()), grad_queries, grad_gains};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_read_merge_fwd_autograd(
    const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight, double eps,
    double scale) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&partial_out, "partial_out"},
                                {&lse, "lse"}, {&block_sum, "block_sum"}, {&query, "query"}}) {
    if (t->defined()) check_dense(*t, name);
  }
  if (is_defined(norm_weight)) check_dense(*norm_weight, "norm_weight");
  const variable_list out =
      MergeFunction::apply(partial_out, lse, block_sum, query, norm_weight, eps, scale);
  return {out[0], out[1], out[2]};
}

void block_read_merge_inplace_autograd(const at::Tensor& partial_out, const at::Tensor& lse,
                                       const at::Tensor& block_sum, const at::Tensor& query,
                                       const std::optional<at::Tensor>& norm_weight, double eps,
                                       double scale) {
  const bool wants_grad =
      at::GradMode::is_enabled() &&
      (partial_out.requires_grad() || lse.requires_grad() || block_sum.requires_grad() ||
       query.requires_grad() || (is_defined(norm_weight) && norm_weight->requires_grad()));
  TORCH_CHECK(!wants_grad,
              "attnres::block_read_merge_inplace has no derivative (it overwrites the partial "
              "output its backward would need); use block_read_merge_fwd when gradients are "
              "wanted");
  call_below_autograd<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const std::optional<at::Tensor>&, double, double)>(
      "attnres::block_read_merge_inplace", partial_out, lse, block_sum, query, norm_weight, eps,
      scale);
  torch::autograd::increment_version(partial_out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_read_merge_bwd_autograd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& rstd, const at::Tensor& weight, double scale,
    const c10::List<bool>& output_mask) {
  check_mask(output_mask, 5, "partial_out, lse, block_sum, query, norm_weight");
  const variable_list wanted = MergeBackwardFunction::apply(
      grad_out, partial_out, block_sum, query, norm_weight, rstd, weight, scale, output_mask);
  const variable_list all = expand_masked(wanted, output_mask);
  return {all[0], all[1], all[2], all[3], all[4]};
}

using BlockReadsNormedFwdSig = BlockReadsNormedForward(at::TensorList, const at::Tensor&,
                                                       const std::optional<at::Tensor>&,
                                                       const at::Tensor&, double, double, double,
                                                       bool);
using BlockReadsNormedBwdSig = BlockReadsNormedBackward(
    at::TensorList, const std::optional<at::Tensor>&, at::TensorList, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, double, const c10::List<bool>&);

class BlockReadsNormedBackwardFunction
    : public torch::autograd::Function<BlockReadsNormedBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, at::TensorList grad_partial_outs,
                               const std::optional<at::Tensor>& grad_lse, at::TensorList sources,
                               const at::Tensor& queries,
                               const std::optional<at::Tensor>& norm_weights,
                               const at::Tensor& out_weight, const at::Tensor& h,
                               const at::Tensor& rstd, const at::Tensor& weights,
                               const at::Tensor& out_rstd, double scale,
                               const c10::List<bool>& output_mask) {
    auto [wanted, grad_queries, grad_gains, grad_out_weight] =
        call_below_autograd<BlockReadsNormedBwdSig>(
            "attnres::block_reads_normed_bwd", grad_partial_outs, grad_lse, sources, queries,
            norm_weights, out_weight, h, rstd, weights, out_rstd, scale, output_mask);
    const size_t n = sources.size();
    if (output_mask.get(n)) wanted.push_back(grad_queries);
    if (output_mask.get(n + 1)) wanted.push_back(grad_gains);
    if (output_mask.get(n + 2)) wanted.push_back(grad_out_weight);
    return wanted;
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("block_reads_normed");
  }
};

// Phase 1 with reader 0's output norm. When autograd records (`record`),
// h_0 is kept for the backward whatever keep_h says.
class BlockReadsNormedFunction : public torch::autograd::Function<BlockReadsNormedFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList sources,
                               const at::Tensor& queries,
                               const std::optional<at::Tensor>& norm_weights,
                               const at::Tensor& out_weight, double eps, double scale,
                               double out_eps, bool keep_h, bool record) {
    auto [partial_outs, lse, rstd, weights, h, out_rstd] =
        call_below_autograd<BlockReadsNormedFwdSig>("attnres::block_reads_normed_fwd", sources,
                                                    queries, norm_weights, out_weight, eps, scale,
                                                    out_eps, keep_h || record);
    variable_list saved(sources.begin(), sources.end());
    for (const auto& t : {queries, norm_weights.value_or(at::Tensor()), out_weight, h, rstd,
                          weights, out_rstd}) {
      saved.push_back(t);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = is_defined(norm_weights);
    const at::Tensor h_out = keep_h ? h : at::empty({0}, h.options());
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
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    const size_t S = static_cast<size_t>(queries.size(0));
    // needs_input_grad counts the tensor inputs given: sources, queries,
    // the gains (when given), out_weight.
    c10::List<bool> mask;
    for (size_t i = 0; i < n + 1; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(has_gain && ctx->needs_input_grad(n + 1));
    mask.push_back(ctx->needs_input_grad(has_gain ? n + 2 : n + 1));
    // sources..., queries, norm_weights, out_weight, eps, scale, out_eps, keep_h, record
    variable_list result(n + 8);
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
        BlockReadsNormedBackwardFunction::apply(
            at::TensorList(grad_partials), defined_or_none(grad_lse), at::TensorList(sources),
            queries, defined_or_none(saved[n + 1]), saved[n + 2], saved[n + 3], saved[n + 4],
            saved[n + 5], saved[n + 6], ctx->saved_data["scale"].toDouble(), mask),
        mask);
    for (size_t i = 0; i < n + 3; ++i) result[i] = computed[i];
    return result;
  }
};

BlockReadsNormedForward block_reads_normed_fwd_autograd(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight, double eps,
    double scale, double out_eps, bool keep_h) {
  check_dense_inputs(sources, "sources");
  check_dense(queries, "queries");
  if (is_defined(norm_weights)) check_dense(*norm_weights, "norm_weights");
  if (out_weight.defined()) check_dense(out_weight, "out_weight");
  bool record = at::GradMode::is_enabled() &&
                (queries.requires_grad() || (out_weight.defined() && out_weight.requires_grad()) ||
                 (is_defined(norm_weights) && norm_weights->requires_grad()));
  for (const auto& s : sources) record = record || (at::GradMode::is_enabled() && s.requires_grad());
  variable_list out = BlockReadsNormedFunction::apply(sources, queries, norm_weights, out_weight,
                                                      eps, scale, out_eps, keep_h, record);
  const size_t S = out.size() - 5;
  std::vector<at::Tensor> partials(out.begin(), out.begin() + S);
  return {partials, out[S], out[S + 1], out[S + 2], out[S + 3], out[S + 4]};
}

BlockReadsNormedBackward block_reads_normed_bwd_autograd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weights,
    const at::Tensor& out_rstd, double scale, const c10::List<bool>& output_mask) {
  check_dense_inputs(sources, "sources");
  check_dense_inputs(grad_partial_outs, "grad_partial_outs");
  check_dense(queries, "queries");
  check_mask(output_mask, sources.size() + 3, "each source, queries, norm_weights, out_weight");
  variable_list grads = BlockReadsNormedBackwardFunction::apply(
      grad_partial_outs, grad_lse, sources, queries, norm_weights, out_weight, h, rstd, weights,
      out_rstd, scale, output_mask);
  const size_t n = sources.size();
  at::Tensor grad_out_weight, grad_gains, grad_queries;
  if (output_mask.get(n + 2)) {
    grad_out_weight = grads.back();
    grads.pop_back();
  }
  if (output_mask.get(n + 1)) {
    grad_gains = grads.back();
    grads.pop_back();
  }
  if (output_mask.get(n)) {
    grad_queries = grads.back();
    grads.pop_back();
  }
  return {std::vector<at::Tensor>(grads.begin(), grads.end()), grad_queries, grad_gains,
          grad_out_weight};
}

using MergeNormedFwdSig = MergeNormedForward(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&,
                                             const std::optional<at::Tensor>&, const at::Tensor&,
                                             double, double, double, bool);
using MergeNormedBwdSig = MergeNormedBackward(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, double, const c10::List<bool>&);
using MergeNormedInplaceSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const std::optional<at::Tensor>&,
                                   const at::Tensor&, double, double, double);

class MergeNormedBackwardFunction : public torch::autograd::Function<MergeNormedBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& grad_out,
                               const at::Tensor& partial_out, const at::Tensor& block_sum,
                               const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                               const at::Tensor& out_weight, const at::Tensor& h,
                               const at::Tensor& rstd, const at::Tensor& weight,
                               const at::Tensor& out_rstd, double scale,
                               const c10::List<bool>& output_mask) {
    auto [a, b, c, d, e, f] = call_below_autograd<MergeNormedBwdSig>(
        "attnres::block_read_merge_normed_bwd", grad_out, partial_out, block_sum, query,
        norm_weight, out_weight, h, rstd, weight, out_rstd, scale, output_mask);
    variable_list wanted;
    for (const auto& t : {a, b, c, d, e, f}) {
      if (t.defined()) wanted.push_back(t);
    }
    return wanted;
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("block_read_merge_normed");
  }
};

// The normed merge. When autograd records (`record`), h is kept for the
// backward whatever keep_h says, as DepthAttentionNormedFunction.
class MergeNormedFunction : public torch::autograd::Function<MergeNormedFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& partial_out,
                               const at::Tensor& lse, const at::Tensor& block_sum,
                               const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                               const at::Tensor& out_weight, double eps, double scale,
                               double out_eps, bool keep_h, bool record) {
    auto [out, h, rstd, weight, out_rstd] = call_below_autograd<MergeNormedFwdSig>(
        "attnres::block_read_merge_normed_fwd", partial_out, lse, block_sum, query, norm_weight,
        out_weight, eps, scale, out_eps, keep_h || record);
    ctx->save_for_backward({partial_out, block_sum, query, norm_weight.value_or(at::Tensor()),
                            out_weight, h, rstd, weight, out_rstd});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_gain"] = is_defined(norm_weight);
    const at::Tensor h_out = keep_h ? h : at::empty({0}, h.options());
    ctx->mark_non_differentiable({h_out, rstd, weight, out_rstd});
    ctx->set_materialize_grads(false);
    return {out, h_out, rstd, weight, out_rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_gain = ctx->saved_data["has_gain"].toBool();
    // needs_input_grad counts the tensor inputs given: partial_out, lse,
    // block_sum, query, the gain (when there is one), out_weight.
    c10::List<bool> mask;
    for (size_t i = 0; i < 4; ++i) mask.push_back(ctx->needs_input_grad(i));
    mask.push_back(has_gain && ctx->needs_input_grad(4));
    mask.push_back(ctx->needs_input_grad(has_gain ? 5 : 4));
    // partial_out, lse, block_sum, query, norm_weight, out_weight, eps, scale, out_eps,
    // keep_h, record
    variable_list result(11);
    if (!grads[0].defined()) return result;
    const variable_list computed = expand_masked(
        MergeNormedBackwardFunction::apply(grads[0], saved[0], saved[1], saved[2],
                                           defined_or_none(saved[3]), saved[4], saved[5],
                                           saved[6], saved[7], saved[8],
                                           ctx->saved_data["scale"].toDouble(), mask),
        mask);
    for (size_t i = 0; i < 6; ++i) result[i] = computed[i];
    return result;
  }
};

MergeNormedForward block_read_merge_normed_fwd_autograd(
    const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, double eps, double scale, double out_eps, bool keep_h) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&partial_out, "partial_out"},
                                {&lse, "lse"}, {&block_sum, "block_sum"}, {&query, "query"},
                                {&out_weight, "out_weight"}}) {
    if (t->defined()) check_dense(*t, name);
  }
  if (is_defined(norm_weight)) check_dense(*norm_weight, "norm_weight");
  const bool record =
      at::GradMode::is_enabled() &&
      (partial_out.requires_grad() || lse.requires_grad() || block_sum.requires_grad() ||
       query.requires_grad() || (is_defined(norm_weight) && norm_weight->requires_grad()) ||
       (out_weight.defined() && out_weight.requires_grad()));
  const variable_list out = MergeNormedFunction::apply(
      partial_out, lse, block_sum, query, norm_weight, out_weight, eps, scale, out_eps, keep_h,
      record);
  return {out[0], out[1], out[2], out[3], out[4]};
}

void block_read_merge_normed_inplace_autograd(const at::Tensor& partial_out, const at::Tensor& lse,
                                              const at::Tensor& block_sum, const at::Tensor& query,
                                              const std::optional<at::Tensor>& norm_weight,
                                              const at::Tensor& out_weight, double eps,
                                              double scale, double out_eps) {
  const bool wants_grad =
      at::GradMode::is_enabled() &&
      (partial_out.requires_grad() || lse.requires_grad() || block_sum.requires_grad() ||
       query.requires_grad() || (is_defined(norm_weight) && norm_weight->requires_grad()) ||
       (out_weight.defined() && out_weight.requires_grad()));
  TORCH_CHECK(!wants_grad,
              "attnres::block_read_merge_normed_inplace has no derivative (it overwrites the "
              "partial output its backward would need); use block_read_merge_normed_fwd when "
              "gradients are wanted");
  call_below_autograd<MergeNormedInplaceSig>("attnres::block_read_merge_normed_inplace",
                                             partial_out, lse, block_sum, query, norm_weight,
                                             out_weight, eps, scale, out_eps);
  torch::autograd::increment_version(partial_out);
}

MergeNormedBackward block_read_merge_normed_bwd_autograd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weight, const at::Tensor& out_rstd, double scale,
    const c10::List<bool>& output_mask) {
  check_mask(output_mask, 6, "partial_out, lse, block_sum, query, norm_weight, out_weight");
  const variable_list wanted = MergeNormedBackwardFunction::apply(
      grad_out, partial_out, block_sum, query, norm_weight, out_weight, h, rstd, weight,
      out_rstd, scale, output_mask);
  const variable_list all = expand_masked(wanted, output_mask);
  return {all[0], all[1], all[2], all[3], all[4], all[5]};
}

constexpr BlockReadKernels kCpuBlockReadKernels{&check_cpu_capability, &cpu::block_reads_forward,
                                                &cpu::block_read_merge_forward,
                                                &cpu::block_read_merge_backward,
                                                &cpu::block_reads_backward};

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CPU, m) {
  register_block_read_kernels<kCpuBlockReadKernels>(m);
}

TORCH_LIBRARY_IMPL(attnres, Autograd, m) {
  m.impl("block_reads_fwd", &block_reads_fwd_autograd);
  m.impl("block_reads_bwd", &block_reads_bwd_autograd);
  m.impl("block_read_merge_fwd", &block_read_merge_fwd_autograd);
  m.impl("block_read_merge_bwd", &block_read_merge_bwd_autograd);
  m.impl("block_read_merge_inplace", &block_read_merge_inplace_autograd);
  m.impl("block_reads_normed_fwd", &block_reads_normed_fwd_autograd);
  m.impl("block_reads_normed_bwd", &block_reads_normed_bwd_autograd);
  m.impl("block_read_merge_normed_fwd", &block_read_merge_normed_fwd_autograd);
  m.impl("block_read_merge_normed_bwd", &block_read_merge_normed_bwd_autograd);
  m.impl("block_read_merge_normed_inplace", &block_read_merge_normed_inplace_autograd);
}

// ---- C++ API ---------------------------------------------------------------------

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> block_reads_fwd(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, double eps, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_reads_fwd", "")
                       .typed<BlockReadsFwdSig>();
  return op.call(sources, queries, norm_weights, eps, scale);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> block_reads_bwd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& rstd,
    const at::Tensor& weights, double scale, const c10::List<bool>& output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_reads_bwd", "")
                       .typed<BlockReadsBwdSig>();
  return op.call(grad_partial_outs, grad_lse, sources, queries, norm_weights, rstd, weights,
                 scale, output_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_read_merge_fwd(
    const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight, double eps,
    double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_read_merge_fwd", "")
                       .typed<MergeFwdSig>();
  return op.call(partial_out, lse, block_sum, query, norm_weight, eps, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_read_merge_bwd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& rstd, const at::Tensor& weight, double scale,
    const c10::List<bool>& output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_read_merge_bwd", "")
                       .typed<MergeBwdSig>();
  return op.call(grad_out, partial_out, block_sum, query, norm_weight, rstd, weight, scale,
                 output_mask);
}

void block_read_merge_inplace(const at::Tensor& partial_out, const at::Tensor& lse,
                              const at::Tensor& block_sum, const at::Tensor& query,
                              const std::optional<at::Tensor>& norm_weight, double eps,
                              double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_read_merge_inplace", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const std::optional<at::Tensor>&, double,
                                   double)>();
  op.call(partial_out, lse, block_sum, query, norm_weight, eps, scale);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> block_reads(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, double eps, double scale) {
  auto [partials, lse, rstd, weights] = block_reads_fwd(sources, queries, norm_weights, eps, scale);
  return {partials, lse};
}

at::Tensor block_read_merge(const at::Tensor& partial_out, const at::Tensor& lse,
                            const at::Tensor& block_sum, const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight, double eps,
                            double scale) {
  return std::get<0>(block_read_merge_fwd(partial_out, lse, block_sum, query, norm_weight, eps, scale));
}

BlockReadsNormedForward block_reads_normed_fwd(at::TensorList sources, const at::Tensor& queries,
                                               const std::optional<at::Tensor>& norm_weights,
                                               const at::Tensor& out_weight, double eps,
                                               double scale, double out_eps, bool keep_h) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_reads_normed_fwd", "")
                       .typed<BlockReadsNormedFwdSig>();
  return op.call(sources, queries, norm_weights, out_weight, eps, scale, out_eps, keep_h);
}

BlockReadsNormedBackward block_reads_normed_bwd(
    at::TensorList grad_partial_outs, const std::optional<at::Tensor>& grad_lse,
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight,
    const at::Tensor& h, const at::Tensor& rstd, const at::Tensor& weights,
    const at::Tensor& out_rstd, double scale, const c10::List<bool>& output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_reads_normed_bwd", "")
                       .typed<BlockReadsNormedBwdSig>();
  return op.call(grad_partial_outs, grad_lse, sources, queries, norm_weights, out_weight, h, rstd,
                 weights, out_rstd, scale, output_mask);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> block_reads_normed(
    at::TensorList sources, const at::Tensor& queries,
    const std::optional<at::Tensor>& norm_weights, const at::Tensor& out_weight, double eps,
    double scale, double out_eps) {
  // h_0 is kept for the backward by the op's autograd when it records.
  auto result = block_reads_normed_fwd(sources, queries, norm_weights, out_weight, eps, scale,
                                       out_eps, /*keep_h=*/false);
  return {std::get<0>(result), std::get<1>(result)};
}

MergeNormedForward block_read_merge_normed_fwd(
    const at::Tensor& partial_out, const at::Tensor& lse, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, double eps, double scale, double out_eps, bool keep_h) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_read_merge_normed_fwd", "")
                       .typed<MergeNormedFwdSig>();
  return op.call(partial_out, lse, block_sum, query, norm_weight, out_weight, eps, scale, out_eps,
                 keep_h);
}

MergeNormedBackward block_read_merge_normed_bwd(
    const at::Tensor& grad_out, const at::Tensor& partial_out, const at::Tensor& block_sum,
    const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weight, const at::Tensor& out_rstd, double scale,
    const c10::List<bool>& output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_read_merge_normed_bwd", "")
                       .typed<MergeNormedBwdSig>();
  return op.call(grad_out, partial_out, block_sum, query, norm_weight, out_weight, h, rstd,
                 weight, out_rstd, scale, output_mask);
}

at::Tensor block_read_merge_normed(const at::Tensor& partial_out, const at::Tensor& lse,
                                   const at::Tensor& block_sum, const at::Tensor& query,
                                   const std::optional<at::Tensor>& norm_weight,
                                   const at::Tensor& out_weight, double eps, double scale,
                                   double out_eps) {
  // h is kept for the backward by the op's autograd when it records.
  return std::get<0>(block_read_merge_normed_fwd(partial_out, lse, block_sum, query, norm_weight,
                                                 out_weight, eps, scale, out_eps,
                                                 /*keep_h=*/false));
}

void block_read_merge_normed_inplace(const at::Tensor& partial_out, const at::Tensor& lse,
                                     const at::Tensor& block_sum, const at::Tensor& query,
                                     const std::optional<at::Tensor>& norm_weight,
                                     const at::Tensor& out_weight, double eps, double scale,
                                     double out_eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::block_read_merge_normed_inplace", "")
                       .typed<MergeNormedInplaceSig>();
  op.call(partial_out, lse, block_sum, query, norm_weight, out_weight, eps, scale, out_eps);
}

}  // namespace attnres
