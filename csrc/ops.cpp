// The attnres operator library: every schema in one TORCH_LIBRARY block
// (the per-device kernels register under TORCH_LIBRARY_IMPL in cpu/ and
// cuda/, autograd in autograd.cpp), plus the C++ API of
// include/attnres/ops.h.
#include "attnres/ops.h"

#include "attnres/gradient_cache.h"

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
  // Backward, from the gradients of h and of the weights (either may be
  // absent): gradients of the sources, the query and the gain (for an
  // absent gain, the gradient of an implicit all-ones gain). `out` is the
  // forward's h: sum_j a_j <dh, v_j> = <dh, h>, so the backward reads each
  // source row once (docs/design.md §2). output_mask
  // has N + 2 entries (each source, query, norm_weight), as ATen's native
  // backward ops take: a gradient that is not asked for is not computed.
  // grad_sources holds the wanted source gradients only, in source order;
  // an unwanted query or gain gradient comes back undefined (None).
  m.def(
      "depth_attention_bwd(Tensor? grad_out, Tensor? grad_weights, "
      "Tensor[] sources, Tensor query, Tensor? norm_weight, Tensor out, "
      "Tensor rstd, "
      "Tensor weights, float scale, bool[] output_mask) -> "
      "(Tensor[] grad_sources, Tensor grad_query, Tensor grad_norm_weight)");
  // The read with its output normalized (docs/design.md §11):
  // out = RMSNorm(h) * out_weight (eps out_eps), fused into the read, so the
  // sublayer needs no pre-norm of its own. h (the backward needs it) is
  // written only with keep_h, else an empty tensor comes back; out_rstd
  // [...] is the norm's per-token rstd. The autograd kernel keeps h
  // whenever it records, whatever keep_h says.
  m.def(
      "depth_attention_normed_fwd(Tensor[] sources, Tensor query, Tensor? norm_weight, "
      "Tensor out_weight, float eps, float scale, float out_eps, bool keep_h) -> "
      "(Tensor out, Tensor h, Tensor rstd, Tensor weights, Tensor out_rstd)");
  // Backward from the gradients of out and of the weights; output_mask has
  // N + 3 entries (each source, query, norm_weight, out_weight).
  m.def(
      "depth_attention_normed_bwd(Tensor? grad_out, Tensor? grad_weights, "
      "Tensor[] sources, Tensor query, Tensor? norm_weight, Tensor out_weight, "
      "Tensor h, Tensor rstd, Tensor weights, Tensor out_rstd, float scale, "
      "bool[] output_mask) -> (Tensor[] grad_sources, Tensor grad_query, "
      "Tensor grad_norm_weight, Tensor grad_out_weight)");
  // Two-phase Block reads (docs/design.md §10; kernels and autograd in
  // block_reads.cpp). Phase 1: the N completed sources read once for the S
  // readers of a block (queries [S, D]): each reader's softmax-weighted
  // average over them (S tensors [..., D]) and the log-sum-exp of its
  // scores lse [S, ...]; rstd [N, ...] and weights [S, N, ...] are the
  // backward's statistics.
  m.def(
      "block_reads_fwd(Tensor[] sources, Tensor queries, Tensor? norm_weights, "
      "float eps, float scale) -> (Tensor[] partial_outs, Tensor lse, "
      "Tensor rstd, Tensor weights)");
  // grad_partial_outs: all S gradients, or none; output_mask: N + 2 flags
  // (each source, queries, norm_weights).
  m.def(
      "block_reads_bwd(Tensor[] grad_partial_outs, Tensor? grad_lse, "
      "Tensor[] sources, Tensor queries, Tensor? norm_weights, Tensor rstd, "
      "Tensor weights, float scale, bool[] output_mask) -> "
      "(Tensor[] grad_sources, Tensor grad_queries, Tensor grad_norm_weights)");
  // Phase 1 with reader 0's output norm fused (docs/design.md §10, §11):
  // partial_outs[0] is y_0 = RMSNorm(h_0) * out_weight, reader 0's final
  // read (a block's first read has no partial sum to merge); the others are
  // as block_reads_fwd's. h is h_0 (empty unless keep_h; the autograd
  // kernel keeps it whenever it records), out_rstd [...] the norm's rstd.
  m.def(
      "block_reads_normed_fwd(Tensor[] sources, Tensor queries, Tensor? norm_weights, "
      "Tensor out_weight, float eps, float scale, float out_eps, bool keep_h) -> "
      "(Tensor[] partial_outs, Tensor lse, Tensor rstd, Tensor weights, Tensor h, "
      "Tensor out_rstd)");
  // grad_partial_outs[0] is the gradient of y_0; output_mask: N + 3 flags
  // (each source, queries, norm_weights, out_weight).
  m.def(
      "block_reads_normed_bwd(Tensor[] grad_partial_outs, Tensor? grad_lse, "
      "Tensor[] sources, Tensor queries, Tensor? norm_weights, Tensor out_weight, Tensor h, "
      "Tensor rstd, Tensor weights, Tensor out_rstd, float scale, bool[] output_mask) -> "
      "(Tensor[] grad_sources, Tensor grad_queries, Tensor grad_norm_weights, "
      "Tensor grad_out_weight)");
  // Phase 2: one reader's phase-1 state (partial_out, lse) merged exactly
  // with the partial block sum: h, and the block sum's rstd and weight.
  m.def(
      "block_read_merge_fwd(Tensor partial_out, Tensor lse, Tensor block_sum, "
      "Tensor query, Tensor? norm_weight, float eps, float scale) -> "
      "(Tensor out, Tensor rstd, Tensor weight)");
  // output_mask: 5 flags (partial_out, lse, block_sum, query, norm_weight).
  m.def(
      "block_read_merge_bwd(Tensor grad_out, Tensor partial_out, "
      "Tensor block_sum, Tensor query, Tensor? norm_weight, Tensor rstd, "
      "Tensor weight, float scale, bool[] output_mask) -> "
      "(Tensor grad_partial_out, Tensor grad_lse, Tensor grad_block_sum, "
      "Tensor grad_query, Tensor grad_norm_weight)");
  // Phase 2 without autograd (inference): h overwrites partial_out, the
  // reader's phase-1 output that this read consumes, so the read allocates
  // no new output (docs/design.md §10). Raises when a gradient is wanted.
  m.def(
      "block_read_merge_inplace(Tensor(a!) partial_out, Tensor lse, "
      "Tensor block_sum, Tensor query, Tensor? norm_weight, float eps, "
      "float scale) -> ()");
  // Phase 2 with the fused output norm (docs/design.md §10, §11): out is
  // y = RMSNorm(h) * out_weight, h written only with keep_h (empty
  // otherwise; the autograd kernel keeps it whenever it records), out_rstd
  // [...] the norm's rstd; as depth_attention_normed_* extend
  // depth_attention_*.
  m.def(
      "block_read_merge_normed_fwd(Tensor partial_out, Tensor lse, Tensor block_sum, "
      "Tensor query, Tensor? norm_weight, Tensor out_weight, float eps, float scale, "
      "float out_eps, bool keep_h) -> (Tensor out, Tensor h, Tensor rstd, Tensor weight, "
      "Tensor out_rstd)");
  // grad_out is the gradient of y; output_mask: 6 flags (partial_out, lse,
  // block_sum, query, norm_weight, out_weight).
  m.def(
      "block_read_merge_normed_bwd(Tensor grad_out, Tensor partial_out, Tensor block_sum, "
      "Tensor query, Tensor? norm_weight, Tensor out_weight, Tensor h, Tensor rstd, "
      "Tensor weight, Tensor out_rstd, float scale, bool[] output_mask) -> "
      "(Tensor grad_partial_out, Tensor grad_lse, Tensor grad_block_sum, "
      "Tensor grad_query, Tensor grad_norm_weight, Tensor grad_out_weight)");
  // Inference: y overwrites partial_out, as block_read_merge_inplace.
  m.def(
      "block_read_merge_normed_inplace(Tensor(a!) partial_out, Tensor lse, "
      "Tensor block_sum, Tensor query, Tensor? norm_weight, Tensor out_weight, "
      "float eps, float scale, float out_eps) -> ()");

  // The CPU gradient cache (attnres/gradient_cache.h): no tensor arguments,
  // one kernel for every device. Stats: [limit_bytes, cached_bytes,
  // cached_blocks, in_use_bytes, hits, misses].
  m.def("cpu_gradient_cache_stats() -> int[]", [] {
    const attnres::GradientCacheStats s = attnres::cpu_gradient_cache_stats();
    return std::vector<int64_t>{s.limit_bytes, s.cached_bytes, s.cached_blocks,
                                s.in_use_bytes, s.hits, s.misses};
  });
  m.def("set_cpu_gradient_cache_limit(int limit_bytes) -> ()",
        [](int64_t bytes) { attnres::set_cpu_gradient_cache_limit(bytes); });
  m.def("empty_cpu_gradient_cache() -> ()", [] { attnres::empty_cpu_gradient_cache(); });
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
depth_attention_bwd(const std::optional<at::Tensor>& grad_out,
                    const std::optional<at::Tensor>& grad_weights,
                    at::TensorList sources, const at::Tensor& query,
                    const std::optional<at::Tensor>& norm_weight,
                    const at::Tensor& out, const at::Tensor& rstd,
                    const at::Tensor& weights, double scale,
                    const c10::List<bool>& output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnres::depth_attention_bwd", "")
          .typed<std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>(
              const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, at::TensorList,
              const at::Tensor&, const std::optional<at::Tensor>&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
              const c10::List<bool>&)>();
  return op.call(grad_out, grad_weights, sources, query, norm_weight, out,
                 rstd, weights, scale, output_mask);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>
depth_attention_bwd(const at::Tensor& grad_out, at::TensorList sources,
                    const at::Tensor& query,
                    const std::optional<at::Tensor>& norm_weight,
                    const at::Tensor& out, const at::Tensor& rstd,
                    const at::Tensor& weights, double scale) {
  c10::List<bool> every_gradient;
  for (size_t i = 0; i < sources.size() + 2; ++i) every_gradient.push_back(true);
  return depth_attention_bwd(grad_out, std::nullopt, sources, query,
                             norm_weight, out, rstd, weights, scale,
                             every_gradient);
}

at::Tensor depth_attention(at::TensorList sources, const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight,
                           double eps, double scale) {
  return std::get<0>(depth_attention_fwd(sources, query, norm_weight, eps, scale));
}

std::tuple<at::Tensor, at::Tensor> depth_attention_with_weights(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale) {
  auto [h, rstd, weights] =
      depth_attention_fwd(sources, query, norm_weight, eps, scale);
  return {h, weights};
}

NormedForward depth_attention_normed_fwd(at::TensorList sources, const at::Tensor& query,
                                         const std::optional<at::Tensor>& norm_weight,
                                         const at::Tensor& out_weight, double eps,
                                         double scale, double out_eps, bool keep_h) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnres::depth_attention_normed_fwd", "")
                       .typed<NormedForward(at::TensorList, const at::Tensor&,
                                            const std::optional<at::Tensor>&, const at::Tensor&,
                                            double, double, double, bool)>();
  return op.call(sources, query, norm_weight, out_weight, eps, scale, out_eps, keep_h);
}

NormedBackward depth_attention_normed_bwd(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_weights,
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& out_weight, const at::Tensor& h, const at::Tensor& rstd,
    const at::Tensor& weights, const at::Tensor& out_rstd, double scale,
    const c10::List<bool>& output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnres::depth_attention_normed_bwd", "")
          .typed<NormedBackward(const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, at::TensorList,
                                const at::Tensor&, const std::optional<at::Tensor>&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double,
                                const c10::List<bool>&)>();
  return op.call(grad_out, grad_weights, sources, query, norm_weight, out_weight, h, rstd,
                 weights, out_rstd, scale, output_mask);
}

at::Tensor depth_attention_normed(at::TensorList sources, const at::Tensor& query,
                                  const std::optional<at::Tensor>& norm_weight,
                                  const at::Tensor& out_weight, double eps, double scale,
                                  double out_eps) {
  return std::get<0>(depth_attention_normed_fwd(sources, query, norm_weight, out_weight, eps,
                                                scale, out_eps, /*keep_h=*/false));
}

std::tuple<at::Tensor, at::Tensor> depth_attention_normed_with_weights(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, const at::Tensor& out_weight, double eps,
    double scale, double out_eps) {
  auto result = depth_attention_normed_fwd(sources, query, norm_weight, out_weight, eps, scale,
                                           out_eps, /*keep_h=*/false);
  return {std::get<0>(result), std::get<3>(result)};
}

}  // namespace attnres
