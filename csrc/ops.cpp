// The attnres operator library: every schema in one TORCH_LIBRARY block.
// Per op family a host file holds the C++ API and the host sequence
// (depth_attention.cpp, block_reads.cpp), autograd/ its C++ autograd, and
// cpu/ and cuda/ its kernels, each registering itself under
// TORCH_LIBRARY_IMPL.
#include "attnres/gradient_cache.h"

#include <torch/library.h>


TORCH_LIBRARY(attnres, m) {
  // Every read takes its optional parts as trailing optional arguments and
  // always returns their statistics (empty tensors when a part is absent),
  // as native_layer_norm does. The one optional part today is the fused
  // output norm (docs/design.md §11): with out_weight a read returns
  // y = RMSNorm(h) * out_weight (eps out_eps, which follows eps when None)
  // instead of h, so the sublayer needs no pre-norm of its own; h (the
  // backward's input) is written only with keep_h, and out_rstd [...] is
  // the norm's per-token rstd. The autograd kernels keep h whenever they
  // record, whatever keep_h says.
  //
  // Forward: h = sum_i softmax_i(scale * <query, RMSNorm(v_i) * gain>) v_i.
  // Returns out (h, or y) and the per-token statistics the backward needs:
  // rstd [N, ...] and the softmax weights [N, ...] (fp32, fp64 for fp64).
  // The second optional part, delta, fuses the prefix add (docs/design.md
  // §12): the last source is then the partial block sum P and the read is
  // over P' = P + delta instead, returned as prefix_out (empty without).
  m.def(
      "depth_attention_fwd(Tensor[] sources, Tensor query, Tensor? norm_weight, float eps, "
      "float scale, Tensor? out_weight=None, float? out_eps=None, bool keep_h=False, "
      "Tensor? delta=None) -> (Tensor out, Tensor rstd, Tensor weights, Tensor h, "
      "Tensor out_rstd, Tensor prefix_out)");
  // Backward, from the gradients of out and of the weights (either may be
  // absent): gradients of the sources, the query, the gain (for an absent
  // gain, the gradient of an implicit all-ones gain) and out_weight. h is
  // the forward's read (its out without out_weight): sum_j a_j <dh, v_j> =
  // <dh, h>, so the backward reads each source row once (docs/design.md
  // §2). output_mask has N + 2 entries (each source, query, norm_weight),
  // N + 3 with out_weight, as ATen's native backward ops take: a gradient
  // that is not asked for is not computed. grad_sources holds the wanted
  // source gradients only, in source order; an unwanted parameter gradient
  // comes back undefined (None). With the prefix add the last source is
  // the forward's P' (prefix_out) and grad_prefix_out, P''s own gradient,
  // is added to its gradient (then the gradient of both P and delta).
  m.def(
      "depth_attention_bwd(Tensor? grad_out, Tensor? grad_weights, Tensor[] sources, "
      "Tensor query, Tensor? norm_weight, Tensor h, Tensor rstd, Tensor weights, float scale, "
      "bool[] output_mask, Tensor? out_weight=None, Tensor? out_rstd=None, "
      "Tensor? grad_prefix_out=None) -> (Tensor[] grad_sources, Tensor grad_query, "
      "Tensor grad_norm_weight, Tensor grad_out_weight)");
  // Two-phase Block reads (docs/design.md §10). Phase 1: the N completed
  // sources read once for the S readers of a block (queries [S, D]): each
  // reader's softmax-weighted average over them (S tensors [..., D]) and
  // the log-sum-exp of its scores lse [S, ...] (float64); rstd [N, ...] and
  // weights [S, N, ...] are the backward's statistics. out_weight fuses
  // reader 0's output norm: a block's first read has no partial sum to
  // merge, so partial_outs[0] is then its final read y_0, and h is h_0.
  m.def(
      "block_reads_fwd(Tensor[] sources, Tensor queries, Tensor? norm_weights, float eps, "
      "float scale, Tensor? out_weight=None, float? out_eps=None, bool keep_h=False) -> "
      "(Tensor[] partial_outs, Tensor lse, Tensor rstd, Tensor weights, Tensor h, "
      "Tensor out_rstd)");
  // grad_partial_outs: all S gradients (with out_weight the first is y_0's),
  // or none; output_mask: N + 2 flags (each source, queries, norm_weights),
  // N + 3 with out_weight (which needs the forward's h and out_rstd).
  m.def(
      "block_reads_bwd(Tensor[] grad_partial_outs, Tensor? grad_lse, Tensor[] sources, "
      "Tensor queries, Tensor? norm_weights, Tensor rstd, Tensor weights, float scale, "
      "bool[] output_mask, Tensor? out_weight=None, Tensor? h=None, Tensor? out_rstd=None) -> "
      "(Tensor[] grad_sources, Tensor grad_queries, Tensor grad_norm_weights, "
      "Tensor grad_out_weight)");
  // Phase 2: one reader's phase-1 state (partial_out, lse) merged exactly
  // with the partial block sum: out (h, or y), and the block sum's rstd and
  // weight. The second optional part, delta, fuses the prefix add
  // (docs/design.md §12): the read's block sum is then P' = block_sum +
  // delta, formed per token and returned as block_sum_out (empty without
  // delta), so a sublayer's output is added and read in one pass.
  m.def(
      "block_read_merge_fwd(Tensor partial_out, Tensor lse, Tensor block_sum, Tensor query, "
      "Tensor? norm_weight, float eps, float scale, Tensor? out_weight=None, "
      "float? out_eps=None, bool keep_h=False, Tensor? delta=None) -> (Tensor out, "
      "Tensor rstd, Tensor weight, Tensor h, Tensor out_rstd, Tensor block_sum_out)");
  // output_mask: 5 flags (partial_out, lse, block_sum, query, norm_weight),
  // 6 with out_weight. With the prefix add block_sum is the forward's P'
  // (block_sum_out) and grad_block_sum_out, P''s own gradient, is added to
  // grad_block_sum (then the gradient of both block_sum and delta).
  m.def(
      "block_read_merge_bwd(Tensor grad_out, Tensor partial_out, Tensor block_sum, "
      "Tensor query, Tensor? norm_weight, Tensor rstd, Tensor weight, float scale, "
      "bool[] output_mask, Tensor? out_weight=None, Tensor? h=None, Tensor? out_rstd=None, "
      "Tensor? grad_block_sum_out=None) -> (Tensor grad_partial_out, Tensor grad_lse, "
      "Tensor grad_block_sum, Tensor grad_query, Tensor grad_norm_weight, "
      "Tensor grad_out_weight)");
  // Phase 2 without autograd (inference): the read overwrites partial_out,
  // the reader's phase-1 output that this read consumes, so the read
  // allocates no new output (docs/design.md §10); with delta it returns P'
  // (empty without). Raises when a gradient is wanted.
  m.def(
      "block_read_merge_inplace(Tensor(a!) partial_out, Tensor lse, Tensor block_sum, "
      "Tensor query, Tensor? norm_weight, float eps, float scale, Tensor? out_weight=None, "
      "float? out_eps=None, Tensor? delta=None) -> Tensor block_sum_out");

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
