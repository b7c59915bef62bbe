// CPU kernels of attnres::depth_attention_{fwd,bwd} (registered, behind the
// CPU capability check, in register_cpu.cpp; the host sequence around them
// is attnres/op_sequence.h). The only file built with vector ISA flags.
//
// One token at a time, fused: each source row is read once from memory (the
// second touch of a row hits L1/L2), keys are never materialized and the
// sources are never stacked. Rows are vectorized with at::vec, tokens run in
// parallel with at::parallel_for, and all accumulation is in fp32 (fp64 for
// fp64). The per-source scalar math comes from attnres/depth_math.h, shared
// with the CUDA kernels.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "attnres/depth_math.h"
#include "attnres/row_layout.h"
#include "kernels_cpu.h"
#include "out_norm_rows.h"  // OutNormStore, OutNormGradRows
#include "vec_rows.h"  // Lanes, hsum, kPrefetchBytes, RowsOf (and <immintrin.h> with AVX2)

namespace attnres {
namespace cpu {
namespace {

// Total bytes of source gradients from which the backward writes them with
// store_stream: far beyond the caches the written lines are only evicted
// again, and a normal store first reads each line (RFO) — fp32 N=16
// [4096, 1024]: backward 0.64x the time of normal stores, bf16 0.81x (design §6).
// Below, the gradients may still be in cache for their consumer.
constexpr int64_t kStreamMinBytes = 32 << 20;

// Whether rows of D elements from base can take store_stream.
template <typename scalar_t>
bool can_stream(const scalar_t* base, int64_t D) {
#if defined(CPU_CAPABILITY_AVX2)
  return reinterpret_cast<uintptr_t>(base) % 32 == 0 &&
         (D * int64_t(sizeof(scalar_t))) % 32 == 0;
#else
  return false;
#endif
}

// Whether the backward writes the wanted source gradients with store_stream.
template <typename scalar_t>
bool stream_grads(const std::vector<scalar_t*>& dv_p, int64_t T, int64_t D) {
  int64_t bytes = 0;
  for (scalar_t* dv : dv_p) {
    if (!dv) continue;
    if (!can_stream(dv, D)) return false;
    bytes += T * D * int64_t(sizeof(scalar_t));
  }
  return bytes >= kStreamMinBytes;
}

// Orders the streamed stores before the parallel region's end.
void store_fence() {
#if defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}


// Independent accumulators per reduction: one FMA chain would make the sweep
// latency-bound (4 cycles a step) instead of load-bound.
constexpr int kChains = 4;

template <typename acc_t>
acc_t hsum_chains(const Vectorized<acc_t> (&c)[kChains]) {
  return hsum((c[0] + c[1]) + (c[2] + c[3]));
}

// Row steps: elementwise work on one row, as a functor with step(jj) (the
// kStep elements from jj, vectorized) and tail(j) (element j). for_each_step
// runs one over a row on its own; row_two_dots can carry one along in its
// sweep of *another* row (a companion), so an L1-bound update (the
// forward's accumulator, the backward's gradient row) runs interleaved with
// the memory-bound loads of the next row instead of in a loop of its own.
// The same functor either way: the same bits either way.
struct NoStep {
  void step(int64_t) const {}
  void tail(int64_t) const {}
};

// acc = v (converted to the accumulation type): the first source of a token.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
struct InitStep {
  using L = Lanes<scalar_t>;
  acc_t* acc;
  const scalar_t* v;
  void step(int64_t jj) const {
    typename L::AVec ov[L::kParts];
    L::load(v + jj, ov);
    for (int k = 0; k < L::kParts; ++k) ov[k].store(acc + jj + k * L::AVec::size());
  }
  void tail(int64_t j) const { acc[j] = static_cast<acc_t>(v[j]); }
};

// acc = acc * keep + take * v: the normalized online weighted sum (§8).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
struct AccumulateStep {
  using L = Lanes<scalar_t>;
  acc_t* acc;
  const scalar_t* v;
  acc_t keep, take;
  void step(int64_t jj) const {
    using AVec = typename L::AVec;
    AVec ov[L::kParts];
    L::load(v + jj, ov);
    for (int k = 0; k < L::kParts; ++k) {
      acc_t* a = acc + jj + k * AVec::size();
      math::online_accumulate(AVec::loadu(a), AVec(keep), AVec(take), ov[k]).store(a);
    }
  }
  void tail(int64_t j) const {
    acc[j] = math::online_accumulate(acc[j], keep, take, static_cast<acc_t>(v[j]));
  }
};

// dv = a*dh + alpha*u + beta*v (written as scalar_t, when kWriteGrad; with
// non-temporal stores when `stream`) and z += alpha*v (when kAccumulateZ):
// the gradients that were asked for.
template <bool kWriteGrad, bool kAccumulateZ, typename scalar_t,
          typename acc_t = at::opmath_type<scalar_t>>
struct SourceGradStep {
  using L = Lanes<scalar_t>;
  scalar_t* dv;
  const scalar_t* v;
  const acc_t* dh;
  const acc_t* u;
  math::SourceGrad<acc_t> g;
  acc_t* z;
  bool stream;
  void step(int64_t jj) const {
    using AVec = typename L::AVec;
    const AVec a(g.a), alpha(g.alpha), beta(g.beta);
    AVec vv[L::kParts], out[L::kParts];
    L::load(v + jj, vv);
    for (int k = 0; k < L::kParts; ++k) {
      const int64_t o = jj + k * AVec::size();
      if constexpr (kWriteGrad) {
        out[k] = math::source_grad(a, AVec::loadu(dh + o), alpha, AVec::loadu(u + o), beta,
                                   vv[k]);
      }
      if constexpr (kAccumulateZ) {
        at::vec::fmadd(alpha, vv[k], AVec::loadu(z + o)).store(z + o);
      }
    }
    if constexpr (kWriteGrad) {
      if (stream) {
        L::store_stream(dv + jj, out);
      } else {
        L::store(dv + jj, out);
      }
    }
  }
  void tail(int64_t j) const {
    const acc_t vj = static_cast<acc_t>(v[j]);
    if constexpr (kWriteGrad) {
      dv[j] = static_cast<scalar_t>(math::source_grad(g.a, dh[j], g.alpha, u[j], g.beta, vj));
    }
    if constexpr (kAccumulateZ) z[j] += g.alpha * vj;
  }
};

// Steps are taken by value: a copy's fields are locals that the stores
// through acc/dv/z cannot alias, so they stay in registers.
template <typename scalar_t, typename Step>
void for_each_step(const Step s, int64_t D) {
  using L = Lanes<scalar_t>;
  int64_t j = 0;
  for (; j + L::kStep <= D; j += L::kStep) s.step(j);
  for (; j < D; ++j) s.tail(j);
}

// Two dot products of one row in one sweep: <x, v> (or, with kSquares, the
// sum of squares <v, v>; x is then unused) and <y, v>; plus a companion
// step on another row (the dot products' bits do not depend on it).
template <bool kSquares, typename scalar_t, typename acc_t = at::opmath_type<scalar_t>,
          typename Companion = NoStep>
void row_two_dots(const scalar_t* v, const acc_t* x, const acc_t* y, int64_t D,
                  acc_t& dot_x, acc_t& dot_y, const Companion other = {}) {
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  AVec dx[kChains], dy[kChains];
  for (int c = 0; c < kChains; ++c) dx[c] = dy[c] = AVec(acc_t(0));
  // One step: kParts (1 or 2) vectors into chains first .. first+kParts-1.
  // The chain index must be a compile-time constant after unrolling: an
  // index computed from j keeps the chains in memory (a store and a reload
  // per FMA).
  auto step = [&](int64_t jj, int first) {
    AVec vv[L::kParts];
    L::load(v + jj, vv);
    for (int k = 0; k < L::kParts; ++k) {
      const int64_t o = jj + k * AVec::size();
      const AVec xv = kSquares ? vv[k] : AVec::loadu(x + o);
      dx[first + k] = at::vec::fmadd(xv, vv[k], dx[first + k]);
      dy[first + k] = at::vec::fmadd(AVec::loadu(y + o), vv[k], dy[first + k]);
    }
    other.step(jj);
  };
  constexpr int kStepsPerRound = kChains / L::kParts;
  constexpr int kRoundBytes = kStepsPerRound * L::kStep * sizeof(scalar_t);
  int64_t j = 0;
  for (; j + kStepsPerRound * L::kStep <= D; j += kStepsPerRound * L::kStep) {
    for (int b = 0; b < kRoundBytes; b += 64) {  // one prefetch per line
      __builtin_prefetch(reinterpret_cast<const char*>(v + j) + kPrefetchBytes + b, 0, 3);
    }
#pragma GCC unroll 4
    for (int r = 0; r < kStepsPerRound; ++r) step(j + r * L::kStep, r * L::kParts);
  }
  for (; j + L::kStep <= D; j += L::kStep) step(j, 0);
  acc_t a = hsum_chains(dx), b = hsum_chains(dy);
  for (; j < D; ++j) {
    const acc_t vj = static_cast<acc_t>(v[j]);
    a += (kSquares ? vj : x[j]) * vj;
    b += y[j] * vj;
    other.tail(j);
  }
  dot_x = a;
  dot_y = b;
}

// The rescued sums of a row whose plain sums are out of range
// (math::row_needs_rescale): sum((c v)^2) and <u, c v>, c a power of two.
// Rare, so scalar.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_scaled_sums(const scalar_t* v, const acc_t* u, acc_t c, int64_t D,
                     acc_t& sumsq_c, acc_t& dot_c) {
  acc_t a = 0, b = 0;
  for (int64_t j = 0; j < D; ++j) {
    const acc_t vj = static_cast<acc_t>(v[j]) * c;
    a += vj * vj;
    b += u[j] * vj;
  }
  sumsq_c = a;
  dot_c = b;
}

// rstd and score of one row: the plain sums, rescued when out of range.
// Returns whether the row took the rescue.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>,
          typename Companion = NoStep>
bool row_stats(const scalar_t* v, const acc_t* u, int64_t D, acc_t eps,
               acc_t& r, acc_t& s, const Companion other = {}) {
  acc_t sumsq, dot_uv;
  row_two_dots</*kSquares=*/true>(v, u, u, D, sumsq, dot_uv, other);
  if (!math::row_needs_rescale(sumsq, dot_uv, eps)) {
    r = math::rstd_from_sumsq(sumsq, D, eps);
    s = math::score(r, dot_uv);
    return false;
  }
  const acc_t c = math::rescale_factor(sumsq);
  acc_t sumsq_c, dot_c;
  row_scaled_sums(v, u, c, D, sumsq_c, dot_c);
  math::rescaled_stats(sumsq_c, dot_c, c, D, eps, r, s);
  return true;
}

// dst = src (converted to the accumulation type).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_load(acc_t* dst, const scalar_t* src, int64_t D) {
  for_each_step<scalar_t>(InitStep<scalar_t>{dst, src}, D);
}

// acc = acc * keep + take * v (the normalized online weighted sum).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_accumulate(acc_t* acc, acc_t keep, acc_t take, const scalar_t* v, int64_t D) {
  for_each_step<scalar_t>(AccumulateStep<scalar_t>{acc, v, keep, take}, D);
}

// out = acc * factor, converted to scalar_t.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_scale_store(scalar_t* out, const acc_t* acc, acc_t factor,
                     int64_t D) {
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  const AVec f(factor);
  int64_t j = 0;
  for (; j + L::kStep <= D; j += L::kStep) {
    AVec o[L::kParts];
    for (int k = 0; k < L::kParts; ++k) {
      o[k] = AVec::loadu(acc + j + k * AVec::size()) * f;
    }
    L::store(out + j, o);
  }
  for (; j < D; ++j) out[j] = static_cast<scalar_t>(acc[j] * factor);
}

// The pass-2 sweep of one source row for what is wanted of it, or (with a
// row `next` to take the dot products of) that sweep as the companion of
// next's: then <dh_next, next> and <u, next> come back in dot_dh / dot_u.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_wanted_grads(scalar_t* dv, const scalar_t* v, const acc_t* dh,
                      const acc_t* u, const math::SourceGrad<acc_t>& g,
                      acc_t* z, int64_t D, bool stream = false,
                      const scalar_t* next = nullptr, const acc_t* dh_next = nullptr,
                      acc_t* dot_dh = nullptr, acc_t* dot_u = nullptr) {
  auto run = [&](const auto& grads) {
    if (next) {
      row_two_dots<false>(next, dh_next, u, D, *dot_dh, *dot_u, grads);
    } else {
      for_each_step<scalar_t>(grads, D);
    }
  };
  if (dv && z) {
    run(SourceGradStep<true, true, scalar_t>{dv, v, dh, u, g, z, stream});
  } else if (dv) {
    run(SourceGradStep<true, false, scalar_t>{dv, v, dh, u, g, z, stream});
  } else if (z) {
    run(SourceGradStep<false, true, scalar_t>{dv, v, dh, u, g, z, false});
  } else if (next) {
    row_two_dots<false>(next, dh_next, u, D, *dot_dh, *dot_u);
  }
}

// The sources as row pointers (no stacking; strided rows used in place).
template <typename scalar_t>
struct SourceRows {
  std::vector<at::Tensor> keep;  // copies for layouts that don't collapse
  std::vector<const scalar_t*> ptr;
  std::vector<int64_t> stride;

  explicit SourceRows(at::TensorList sources) {
    keep.reserve(sources.size());
    for (const auto& s : sources) {
      Rows r = as_rows(s);
      keep.push_back(r.tensor);
      ptr.push_back(r.tensor.template const_data_ptr<scalar_t>());
      stride.push_back(r.row_stride);
    }
  }
  const scalar_t* row(int64_t i, int64_t t) const {
    return ptr[i] + t * stride[i];
  }
};

// Tokens are processed in tiles, source-major inside a tile: the tile's rows
// of one source are adjacent in memory, so the reads are a few long streams
// the hardware prefetcher follows, rather than N short rows per token.
// Forward tile: the fp32 accumulators of the tile (tile x D) stay in L1/L2.
template <typename acc_t>
int64_t forward_tile(int64_t D) {
  const int64_t bytes = 32 * 1024;
  return std::clamp<int64_t>(bytes / (D * int64_t(sizeof(acc_t))), 1, 64);
}

// Backward tile, about 1 MiB of source rows: the two-pass form
// (bf16/fp16) re-reads them from L2; the single pass sweeps each row twice
// in a row (dp_i, then dv_i from L1), so for it the tile only makes the
// reads of one source a stream and bounds the per-token buffers.
template <typename scalar_t>
int64_t backward_tile(int64_t N, int64_t D) {
  const int64_t bytes = 1024 * 1024;
  return std::clamp<int64_t>(bytes / (N * D * int64_t(sizeof(scalar_t))), 1,
                             64);
}

// The pivot's sweep of the single-pass backward (docs/design.md §2): from
// its row v and the forward's output row h, <dh, v>, <u, v> and
// <dh, h - v> = sum_{j != p} a_j (dp_j - dp_p) (sum_j a_j = 1), formed
// from the difference h - v elementwise, so nothing cancels beyond it.
// Once per pivoted token: two chains a reduction are enough.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void pivot_row_dots(const scalar_t* v, const scalar_t* h, const acc_t* dh,
                    const acc_t* u, int64_t D, acc_t& dot_dh, acc_t& dot_u,
                    acc_t& dot_dh_rest) {
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  // A Round (vec_rows.h) at a time: two chains, each fixed after unrolling.
  using R = Round<scalar_t>;
  AVec a[2], b[2], c[2];
  for (int k = 0; k < 2; ++k) a[k] = b[k] = c[k] = AVec(acc_t(0));
  int64_t j = 0;
  for (; j + R::kSize <= D; j += R::kSize) {
    for (int o = 0; o < int(R::kSize * sizeof(scalar_t)); o += 64) {  // a line each
      __builtin_prefetch(reinterpret_cast<const char*>(v + j) + kPrefetchBytes + o, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(h + j) + kPrefetchBytes + o, 0, 3);
    }
    AVec vv[R::kVecs], hv[R::kVecs];
    R::load(v + j, vv);
    R::load(h + j, hv);
#pragma GCC unroll 2
    for (int ch = 0; ch < R::kVecs; ++ch) {
      const int64_t o = j + ch * AVec::size();
      const AVec d = AVec::loadu(dh + o);
      a[ch] = at::vec::fmadd(d, vv[ch], a[ch]);
      b[ch] = at::vec::fmadd(AVec::loadu(u + o), vv[ch], b[ch]);
      c[ch] = at::vec::fmadd(d, hv[ch] - vv[ch], c[ch]);
    }
  }
  acc_t sa = hsum(a[0] + a[1]), sb = hsum(b[0] + b[1]), sc = hsum(c[0] + c[1]);
  for (; j < D; ++j) {
    const acc_t vj = static_cast<acc_t>(v[j]);
    sa += dh[j] * vj;
    sb += u[j] * vj;
    sc += dh[j] * (static_cast<acc_t>(h[j]) - vj);
  }
  dot_dh = sa;
  dot_u = sb;
  dot_dh_rest = sc;
}

// The fused prefix add (docs/design.md §12): P (the last source as given)
// and delta as rows, and P' to fill, which the read then takes as its last
// source.
template <typename scalar_t>
struct PrefixRows {
  RowsOf<scalar_t> p, delta;
  scalar_t* sum;
  PrefixRows(const at::Tensor& p_, const PrefixAdd& add)
      : p(p_), delta(add.delta), sum(add.sum.data_ptr<scalar_t>()) {}
};

template <typename scalar_t>
void forward_impl(const SourceRows<scalar_t>& src, const ForwardCall& call,
                  const PrefixRows<scalar_t>* prefix) {
  using acc_t = at::opmath_type<scalar_t>;
  const DepthProblem& p = call.problem;
  const int64_t N = p.N, D = p.D, T = p.T;
  const acc_t eps = static_cast<acc_t>(call.eps);
  const acc_t* u = call.u.const_data_ptr<acc_t>();
  scalar_t* out_p = call.out.data_ptr<scalar_t>();
  acc_t* rstd_p = call.rstd.data_ptr<acc_t>();
  acc_t* w_p = call.weights.data_ptr<acc_t>();
  // The fused output norm (docs/design.md §11): y instead of h, h kept
  // where asked.
  const OutNormStore<scalar_t> norm(call.out_norm);
  // (At most T tokens: a decode-sized call allocates and clears no more
  // scratch than it uses; the loops below run as with the full tile.)
  const int64_t tile = std::min(forward_tile<acc_t>(D), T);
  at::parallel_for(0, T, parallel_grain(N * D, tile), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(tile * D);
    std::vector<acc_t> scores(N * tile);
    std::vector<math::OnlineSoftmax<acc_t>> sm(tile);
    std::vector<char> rescued(tile);
    std::vector<const scalar_t*> rows(N);
    std::vector<acc_t> w(N);
    for (int64_t t0 = begin; t0 < end; t0 += tile) {
      const int64_t n_tok = std::min(tile, end - t0);
      std::fill(rescued.begin(), rescued.end(), 0);
      // The tile's P' rows first: the source sweeps then read them from L2.
      for (int64_t k = 0; prefix && k < n_tok; ++k) {
        const int64_t t = t0 + k;
        row_add(prefix->sum + t * D, prefix->p.row(t), prefix->delta.row(t), D);
      }
      for (int64_t i = 0; i < N; ++i) {
        // Token k's step of the weighted sum is done in the sweep of token
        // k+1's row (row_two_dots' companion), the last one on its own.
        AccumulateStep<scalar_t> pending{};
        for (int64_t k = 0; k < n_tok; ++k) {
          const int64_t t = t0 + k;
          const scalar_t* v = src.row(i, t);
          acc_t r, sc;
          bool rescue;
          if (k == 0) {
            rescue = row_stats(v, u, D, eps, r, sc);
          } else if (i == 0) {
            rescue = row_stats(v, u, D, eps, r, sc, InitStep<scalar_t>{pending.acc, pending.v});
          } else {
            rescue = row_stats(v, u, D, eps, r, sc, pending);
          }
          rescued[k] |= rescue;
          rstd_p[i * T + t] = r;
          scores[i * tile + k] = sc;
          pending.acc = acc.data() + k * D;
          pending.v = v;
          if (i == 0) {
            sm[k].init(sc);  // acc starts as a copy of v: stale NaNs must not leak in
          } else {
            sm[k].push(sc, pending.keep, pending.take);
          }
        }
        if (i == 0) {
          row_load(pending.acc, pending.v, D);
        } else {
          row_accumulate(pending.acc, pending.keep, pending.take, pending.v, D);
        }
      }
      for (int64_t k = 0; k < n_tok; ++k) {
        const int64_t t = t0 + k;
        if (rescued[k]) {
          // Rows near the dtype's limits: h again from the final weights,
          // kept finite (an ulp of excess weight at the maximum is inf;
          // docs/design.md §8).
          for (int64_t i = 0; i < N; ++i) {
            rows[i] = src.row(i, t);
            w[i] = sm[k].weight(scores[i * tile + k]);
          }
          row_average_kept_finite(acc.data() + k * D, rows.data(), w.data(), N, D);
        }
        if (norm) {
          norm.store(t, out_p + t * D, norm.h_row(t, D), acc.data() + k * D,
                     sm[k].out_factor(), D);
        } else {
          row_scale_store(out_p + t * D, acc.data() + k * D, sm[k].out_factor(), D);
        }
        for (int64_t i = 0; i < N; ++i) {
          w_p[i * T + t] = sm[k].weight(scores[i * tile + k]);
        }
      }
    }
  });
}

// Token chunking of the parameter-gradient partials: one partial row of z
// per chunk, summed in a fixed order afterwards. It depends on T and D only,
// so the reduction order (and the bits) do not depend on the number of
// threads. Chunks of at least kMinChunkTokens tokens, as many as the
// partial rows' budget allows, so large machines get enough parallel work.
constexpr int64_t kMinChunkTokens = 32;
constexpr int64_t kPartialRowsBytes = 8 << 20;
constexpr int64_t kMinChunks = 64;

struct TokenChunks {
  int64_t size;   // tokens per chunk
  int64_t count;  // chunks, one partial row of z each
};

TokenChunks parameter_grad_chunks(int64_t T, int64_t D, int64_t acc_size) {
  const int64_t most = std::max(kMinChunks, kPartialRowsBytes / (D * acc_size));
  const int64_t max_chunks =
      std::clamp<int64_t>((T + kMinChunkTokens - 1) / kMinChunkTokens, 1, most);
  const int64_t size = (T + max_chunks - 1) / max_chunks;
  return {size, (T + size - 1) / size};
}

// Second pass of the parameter gradient: the chunks' partial rows summed in
// a fixed order into z.
template <typename acc_t>
void sum_chunk_partials(const std::vector<acc_t>& partial, int64_t n_chunks,
                        int64_t D, acc_t* z) {
  at::parallel_for(0, D, 1024, [&](int64_t d0, int64_t d1) {
    for (int64_t d = d0; d < d1; ++d) {
      acc_t sum = 0;
      for (int64_t c = 0; c < n_chunks; ++c) sum += partial[c * D + d];
      z[d] = sum;
    }
  });
}

// The source-gradient rows each backward writes: null where the gradient
// is not wanted.
template <typename scalar_t>
std::vector<scalar_t*> wanted_grad_rows(const BackwardCall& call, int64_t N) {
  std::vector<scalar_t*> dv_p(N, nullptr);
  for (int64_t i = 0; i < N; ++i) {
    if (call.grad_sources[i].defined()) {
      dv_p[i] = call.grad_sources[i].data_ptr<scalar_t>();
    }
  }
  return dv_p;
}

// Where a backward's dh rows come from: grad_out itself, or — with the
// fused output norm — formed per token from dy, the saved h and the norm's
// rstd (row_normed_grad), which also adds the token's dy * n to a chunk's
// partial row of the norm weight's gradient.
template <typename scalar_t>
struct IncomingGrad {
  using acc_t = at::opmath_type<scalar_t>;
  RowsOf<scalar_t> dy;
  OutNormGradRows<scalar_t> norm;  // h is the call's out
  int64_t D;

  explicit IncomingGrad(const BackwardCall& call)
      : dy(call.grad_out), norm(call.out_norm, &call.out), D(call.problem.D) {}
  void load(acc_t* dh, int64_t t, acc_t* dw) const {
    if (norm) {
      norm.grad(dh, t, dy.row(t), dw, D);
    } else {
      row_load(dh, dy.row(t), D);
    }
  }
};

// A backward call as both backwards take it: its sizes and saved tensors,
// the incoming gradient, the source-gradient rows to write, and the token
// chunks with their partial rows of z and of the norm weight's gradient.
// run() takes the dtype's pass, single_pass or two_pass (below).
template <typename scalar_t>
struct Backward {
  using acc_t = at::opmath_type<scalar_t>;
  const BackwardCall& call;
  const SourceRows<scalar_t>& src;
  const int64_t N = call.problem.N, D = call.problem.D, T = call.problem.T;
  const acc_t* u = call.u.const_data_ptr<acc_t>();
  const acc_t* rstd_p = call.rstd.const_data_ptr<acc_t>();
  const acc_t* w_p = call.weights.const_data_ptr<acc_t>();
  // The weights' own gradient enters as dp_i += grad_weights_i
  // (docs/design.md §2).
  const acc_t* gw_p = call.grad_weights.defined()
                          ? call.grad_weights.const_data_ptr<acc_t>()
                          : nullptr;
  const IncomingGrad<scalar_t> incoming{call};
  const std::vector<scalar_t*> dv_p = wanted_grad_rows<scalar_t>(call, N);
  const bool want_z = call.z.defined();
  const bool stream = stream_grads(dv_p, T, D);

  const TokenChunks chunks = parameter_grad_chunks(T, D, sizeof(acc_t));
  const int64_t chunk = chunks.size, n_chunks = chunks.count;
  const int64_t tile = std::min(backward_tile<scalar_t>(N, D), T);  // as the forward's
  std::vector<acc_t> partial = std::vector<acc_t>(
      want_z ? static_cast<size_t>(n_chunks * D) : 0, acc_t(0));
  std::vector<acc_t> partial_dw = std::vector<acc_t>(
      incoming.norm.want_dw ? static_cast<size_t>(n_chunks * D) : 0, acc_t(0));

  Backward(const BackwardCall& call_, const SourceRows<scalar_t>& src_)
      : call(call_), src(src_) {}
  // The dtype's pass, then the chunks' partial rows summed in a fixed order.
  void run() {
    if constexpr (Lanes<scalar_t>::kReduced) {
      two_pass();
    } else {
      single_pass();
    }
    if (want_z) sum_chunk_partials(partial, n_chunks, D, call.z.data_ptr<acc_t>());
    if (incoming.norm.want_dw) {
      sum_chunk_partials(partial_dw, n_chunks, D, call.out_norm->grad_weight.data_ptr<acc_t>());
    }
  }
  void single_pass();
  void two_pass();
  void backward_token_wide(int64_t t, const acc_t* dh, acc_t* z) const;
};

// The backward of one token in math::WideType (double for fp32
// accumulation, long double for fp64): the rare tokens whose rows are near
// the dtype's limits (math::backward_row_is_rare). Scalar and slow, but the
// products <dh, v>, <u, v> and r^2 of any finite inputs fit in it.
template <typename scalar_t>
void Backward<scalar_t>::backward_token_wide(int64_t t, const acc_t* dh, acc_t* z) const {
  using W = typename math::WideType<acc_t>::type;
  std::vector<W> dp(N), sc(N);
  for (int64_t i = 0; i < N; ++i) {
    const scalar_t* v = src.row(i, t);
    W dot_dh = 0, dot_u = 0;
    for (int64_t d = 0; d < D; ++d) {
      const W vd = static_cast<W>(static_cast<acc_t>(v[d]));
      dot_dh += static_cast<W>(dh[d]) * vd;
      dot_u += static_cast<W>(u[d]) * vd;
    }
    if (gw_p) dot_dh += static_cast<W>(gw_p[i * T + t]);
    dp[i] = dot_dh;
    sc[i] = math::score(static_cast<W>(rstd_p[i * T + t]), dot_u);
  }
  // The pivoted form when a weight dominates (depth_math.h).
  const auto [dp_pivot, sum_rel] = math::pivoted_sum<W>(
      N, [&](int64_t j) { return w_p[j * T + t]; }, [&](int64_t j) { return dp[j]; });
  for (int64_t i = 0; i < N; ++i) {
    if (!dv_p[i] && !z) continue;
    const scalar_t* v = src.row(i, t);
    const auto g = math::source_grad_coefficients<W>(
        static_cast<W>(w_p[i * T + t]), static_cast<W>(rstd_p[i * T + t]), sc[i],
        dp[i] - dp_pivot, sum_rel, D);
    scalar_t* dv = dv_p[i] ? dv_p[i] + t * D : nullptr;
    for (int64_t d = 0; d < D; ++d) {
      const W vd = static_cast<W>(static_cast<acc_t>(v[d]));
      if (dv) {
        dv[d] = static_cast<scalar_t>(static_cast<acc_t>(math::source_grad(
            g.a, static_cast<W>(dh[d]), g.alpha, static_cast<W>(u[d]), g.beta, vd)));
      }
      if (z) z[d] += static_cast<acc_t>(g.alpha * vd);
    }
  }
}

// The single-pass backward of float32/float64 sources (docs/design.md §2,
// §6, §8; bfloat16/float16 take two_pass below): per token,
// sum_j a_j dp_j = <dh, h> comes from the forward's output h, so each
// source row is read from memory once: one sweep forms dp_i and <u, v_i>,
// and the next sweep, from L1, writes dv_i and adds alpha_i v_i to the
// token's z. A token whose largest weight exceeds 1/2 (the pivot p) takes
// the pivoted form: source p first, with <dh, h - v_p> from the same sweep
// (pivot_row_dots). Rare tokens (rows near the dtype's limits) are found
// per source and recomputed afterwards in the wide type; their partial z
// is dropped, so nothing is counted twice.
template <typename scalar_t>
void Backward<scalar_t>::single_pass() {
  Rows h_rows = as_rows(call.out);
  const scalar_t* h_p = h_rows.tensor.const_data_ptr<scalar_t>();
  at::parallel_for(0, n_chunks, parallel_grain(chunk * N * D), [&](int64_t c_begin, int64_t c_end) {
    std::vector<acc_t> dh(tile * D);
    // z accumulates alpha_i v_i straight into the chunk's row (in L1); the
    // row at the tile's start and each row's alpha are kept, to redo the
    // tile without its rare tokens should one turn up.
    std::vector<acc_t> z_saved(want_z ? D : 0);
    std::vector<acc_t> alpha(want_z ? N * tile : 0);
    bool tile_rare = false;
    acc_t* z = nullptr;
    std::vector<acc_t> sum_rel(tile), dp_pivot(tile);
    std::vector<int64_t> pivot_of(tile);
    std::vector<char> rare(tile);
    // One source row of one token: its coefficients, or false (and the
    // token marked rare) when they are near the dtype's limits.
    auto row_coefficients = [&](int64_t i, int64_t k, int64_t t, acc_t dp, acc_t s,
                                math::SourceGrad<acc_t>& g) {
      const acc_t a = w_p[i * T + t], r = rstd_p[i * T + t];
      const acc_t dp_rel = dp - dp_pivot[k];
      g = math::source_grad_coefficients(a, r, s, dp_rel, sum_rel[k], D);
      if (math::backward_row_is_rare(a, r, s, dp_rel, sum_rel[k], g)) {
        rare[k] = 1;
        tile_rare = true;
        return false;
      }
      if (want_z) alpha[i * tile + k] = g.alpha;
      return true;
    };
    // The gradient sweep (from L1) of a row whose coefficients are known:
    // alone, or as the companion of the dot products of the row `next`.
    struct Pending {
      bool active = false;
      int64_t i = 0, k = 0, t = 0;
      math::SourceGrad<acc_t> g{};
    };
    auto gradient_sweep = [&](const Pending& row, const scalar_t* next = nullptr,
                              const acc_t* dh_next = nullptr, acc_t* dot_dh = nullptr,
                              acc_t* dot_u = nullptr) {
      row_wanted_grads(dv_p[row.i] ? dv_p[row.i] + row.t * D : nullptr, src.row(row.i, row.t),
                       dh.data() + row.k * D, u, row.g, z, D, stream, next, dh_next, dot_dh,
                       dot_u);
    };
    for (int64_t c = c_begin; c < c_end; ++c) {
      z = want_z ? partial.data() + c * D : nullptr;
      acc_t* dw = incoming.norm.want_dw ? partial_dw.data() + c * D : nullptr;
      const int64_t c_end_tok = std::min(T, (c + 1) * chunk);
      for (int64_t t0 = c * chunk; t0 < c_end_tok; t0 += tile) {
        const int64_t n_tok = std::min(tile, c_end_tok - t0);
        tile_rare = false;
        if (want_z) std::copy(z, z + D, z_saved.data());
        // Per token: dh, the pivot, and sum_j a_j dp_j from h (pivoted:
        // relative to dp_p, with source p done here, first).
        for (int64_t k = 0; k < n_tok; ++k) {
          const int64_t t = t0 + k;
          acc_t* dh_k = dh.data() + k * D;
          incoming.load(dh_k, t, dw);
          rare[k] = 0;
          math::Pivot<acc_t> pivot;
          for (int64_t i = 0; i < N; ++i) pivot.see(i, w_p[i * T + t]);
          const scalar_t* h = h_p + t * h_rows.row_stride;
          if (!pivot.pivoted()) {
            acc_t dot_dh_h, unused;
            row_two_dots<false>(h, dh_k, u, D, dot_dh_h, unused);
            acc_t sum_gw = 0;
            if (gw_p) {
              for (int64_t j = 0; j < N; ++j) sum_gw += w_p[j * T + t] * gw_p[j * T + t];
            }
            pivot_of[k] = -1;
            dp_pivot[k] = 0;
            sum_rel[k] = dot_dh_h + sum_gw;
            continue;
          }
          const int64_t piv = pivot.index;
          acc_t dot_dh, dot_u, dot_dh_rest;
          pivot_row_dots(src.row(piv, t), h, dh_k, u, D, dot_dh, dot_u, dot_dh_rest);
          if (pivot.saturated()) {
            // sum_{j != p} a_j (dp_j - dp_p) from the rows themselves
            // (Pivot::saturated): <dh, h - v_p> would carry h's rounding
            // divided by 1 - a_p.
            dot_dh_rest = 0;
            for (int64_t j = 0; j < N; ++j) {
              if (j == piv) continue;
              acc_t dp_j, unused;
              row_two_dots<false>(src.row(j, t), dh_k, u, D, dp_j, unused);
              dot_dh_rest += w_p[j * T + t] * (dp_j - dot_dh);
            }
          }
          // sum_{j != p} a_j (gw_j - gw_p): the weights' gradient, pivoted too.
          acc_t rest_gw = 0;
          if (gw_p) {
            const acc_t gw_piv = gw_p[piv * T + t];
            for (int64_t j = 0; j < N; ++j) {
              if (j != piv) rest_gw += w_p[j * T + t] * (gw_p[j * T + t] - gw_piv);
            }
            dot_dh += gw_piv;
          }
          pivot_of[k] = piv;
          dp_pivot[k] = dot_dh;
          sum_rel[k] = dot_dh_rest + rest_gw;
          Pending row{true, piv, k, t, {}};
          if ((dv_p[piv] || want_z) &&
              row_coefficients(piv, k, t, dot_dh, math::score(rstd_p[piv * T + t], dot_u), row.g)) {
            gradient_sweep(row);
          }
        }
        // The other sources, source-major: one read of each row from memory,
        // in a sweep that also writes the previous row's gradient (from L1).
        for (int64_t i = 0; i < N; ++i) {
          if (!dv_p[i] && !want_z) continue;
          Pending pending;
          for (int64_t k = 0; k < n_tok; ++k) {
            if (rare[k] || pivot_of[k] == i) continue;
            const int64_t t = t0 + k;
            const scalar_t* v = src.row(i, t);
            const acc_t* dh_k = dh.data() + k * D;
            acc_t dot_dh, dot_u;
            if (pending.active) {
              gradient_sweep(pending, v, dh_k, &dot_dh, &dot_u);
            } else {
              row_two_dots<false>(v, dh_k, u, D, dot_dh, dot_u);
            }
            if (gw_p) dot_dh += gw_p[i * T + t];
            pending = {true, i, k, t, {}};
            pending.active =
                row_coefficients(i, k, t, dot_dh, math::score(rstd_p[i * T + t], dot_u), pending.g);
          }
          if (pending.active) gradient_sweep(pending);
        }
        if (want_z && tile_rare) {
          // A rare token's first rows are already in z: restore the tile's
          // start and add the other tokens' alpha_i v_i again, in the order
          // of the sweeps above.
          std::copy(z_saved.begin(), z_saved.end(), z);
          math::SourceGrad<acc_t> g{};
          for (int64_t k = 0; k < n_tok; ++k) {
            if (rare[k] || pivot_of[k] < 0) continue;
            g.alpha = alpha[pivot_of[k] * tile + k];
            row_wanted_grads<scalar_t>(nullptr, src.row(pivot_of[k], t0 + k), u, u, g, z, D);
          }
          for (int64_t i = 0; i < N; ++i) {
            for (int64_t k = 0; k < n_tok; ++k) {
              if (rare[k] || pivot_of[k] == i) continue;
              g.alpha = alpha[i * tile + k];
              row_wanted_grads<scalar_t>(nullptr, src.row(i, t0 + k), u, u, g, z, D);
            }
          }
        }
        for (int64_t k = 0; k < n_tok; ++k) {
          if (rare[k]) {
            backward_token_wide(t0 + k, dh.data() + k * D, z);
          }
        }
      }
    }
    if (stream) store_fence();
  });
}

// The two-pass backward, kept for bfloat16/float16 sources: their h is
// rounded to 8 (11) bits, and <dh, h> from it put the source and query
// gradients at ~5x the eager reference's error (docs/design.md §8), so
// sum_j a_j dp_j comes from the weights and the dp_j instead. Pass 1:
// dp_i, s_i; pass 2 (rows re-read, from L2 within a tile): dv_i, z.
template <typename scalar_t>
void Backward<scalar_t>::two_pass() {
  at::parallel_for(0, n_chunks, parallel_grain(chunk * N * D), [&](int64_t c_begin, int64_t c_end) {
    std::vector<acc_t> dh(tile * D);
    std::vector<acc_t> dp(N * tile), sc(N * tile), sum_rel(tile), dp_pivot(tile);
    std::vector<math::SourceGrad<acc_t>> coef(N * tile);
    std::vector<char> rare(tile);
    for (int64_t c = c_begin; c < c_end; ++c) {
      acc_t* z = want_z ? partial.data() + c * D : nullptr;
      acc_t* dw = incoming.norm.want_dw ? partial_dw.data() + c * D : nullptr;
      const int64_t c_end_tok = std::min(T, (c + 1) * chunk);
      for (int64_t t0 = c * chunk; t0 < c_end_tok; t0 += tile) {
        const int64_t n_tok = std::min(tile, c_end_tok - t0);
        for (int64_t k = 0; k < n_tok; ++k) {
          incoming.load(dh.data() + k * D, t0 + k, dw);
        }
        // Pass 1: dp_i = <dh, v_i> (+ grad_weights_i), s_i = r_i <u, v_i>.
        for (int64_t i = 0; i < N; ++i) {
          for (int64_t k = 0; k < n_tok; ++k) {
            const int64_t t = t0 + k;
            acc_t dot_dh, dot_u;
            row_two_dots<false>(src.row(i, t), dh.data() + k * D, u, D,
                                dot_dh, dot_u);
            if (gw_p) dot_dh += gw_p[i * T + t];
            dp[i * tile + k] = dot_dh;
            sc[i * tile + k] = math::score(rstd_p[i * T + t], dot_u);
          }
        }
        // sum_j a_j dp_j, in the pivoted form when a weight dominates
        // (depth_math.h; otherwise the plain sum, pivot dp 0).
        for (int64_t k = 0; k < n_tok; ++k) {
          const int64_t t = t0 + k;
          const auto sum = math::pivoted_sum<acc_t>(N, [&](int64_t j) { return w_p[j * T + t]; },
                                                    [&](int64_t j) { return dp[j * tile + k]; });
          dp_pivot[k] = sum.dp_pivot;
          sum_rel[k] = sum.rel;
          rare[k] = 0;
        }
        // The coefficients, and the rare tokens (rows near the dtype's
        // limits), which are recomputed in a wider type below.
        for (int64_t i = 0; i < N; ++i) {
          for (int64_t k = 0; k < n_tok; ++k) {
            const int64_t t = t0 + k;
            const acc_t a = w_p[i * T + t], r = rstd_p[i * T + t];
            const acc_t dp_rel = dp[i * tile + k] - dp_pivot[k];
            auto& g = coef[i * tile + k];
            g = math::source_grad_coefficients(a, r, sc[i * tile + k], dp_rel, sum_rel[k], D);
            rare[k] |= math::backward_row_is_rare(a, r, sc[i * tile + k], dp_rel, sum_rel[k], g);
          }
        }
        // Pass 2: the wanted source gradients, each written once (rows
        // re-read from L2), and z.
        for (int64_t i = 0; i < N; ++i) {
          if (!dv_p[i] && !want_z) continue;
          for (int64_t k = 0; k < n_tok; ++k) {
            if (rare[k]) continue;
            const int64_t t = t0 + k;
            row_wanted_grads(dv_p[i] ? dv_p[i] + t * D : nullptr, src.row(i, t),
                             dh.data() + k * D, u, coef[i * tile + k], z, D, stream);
          }
        }
        for (int64_t k = 0; k < n_tok; ++k) {
          if (!rare[k]) continue;
          backward_token_wide(t0 + k, dh.data() + k * D, z);
        }
      }
    }
    if (stream) store_fence();
  });
}

}  // namespace

void forward(const ForwardCall& call) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.sources[0].scalar_type(), "attnres_forward_cpu", [&] {
        SourceRows<scalar_t> src(call.sources);
        std::optional<PrefixRows<scalar_t>> prefix;
        if (call.prefix) {
          // The read's last source is P', formed tile by tile.
          prefix.emplace(call.sources.back(), *call.prefix);
          src.ptr.back() = prefix->sum;
          src.stride.back() = call.problem.D;
        }
        forward_impl<scalar_t>(src, call, prefix ? &*prefix : nullptr);
      });
}

void backward(const BackwardCall& call) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.sources[0].scalar_type(), "attnres_backward_cpu", [&] {
        SourceRows<scalar_t> src(call.sources);
        Backward<scalar_t>(call, src).run();
      });
}

}  // namespace cpu
}  // namespace attnres
