// CPU kernels of the two-phase Block reads (docs/design.md §10): phase 1
// reads each completed source row from memory once per token for all S
// readers of a block (a score sweep, then a weighted-sum sweep of the
// token's rows from L2); phase 2 merges one reader's partial state with the
// partial block sum. Built with the vector ISA flags (CMakeLists.txt); the per-token math
// (OnlineSoftmax, scores, gradient coefficients, range rescue, the rare
// backward rows recomputed in math::WideType) is attnres/depth_math.h, the
// same as the one-call kernels'. Tokens run in
// parallel with at::parallel_for; all accumulation is in fp32 (fp64 for
// fp64 sources).
#include "block_reads_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <optional>
#include <type_traits>

#include "attnres/depth_math.h"
#include "attnres/row_layout.h"
#include "out_norm_rows.h"
#include "vec_rows.h"

namespace attnres {
namespace cpu {
namespace {

using at::vec::Vectorized;

// Readers whose dot products one sweep forms (registers: 2 chains each).
constexpr int kGroup = 4;

// Independent FMA chains of each reduction in the block-read sweeps: the
// vectors of a Round (vec_rows.h).
constexpr int kDotChains = 2;
static_assert(kDotChains == Round<float>::kVecs && kDotChains == Round<c10::BFloat16>::kVecs,
              "the sweeps below add and initialize exactly two chains");

// G dot products <y_g, v> (and, with kSquares, <v, v>) of one row in one
// sweep; kDotChains FMA chains per reduction.
template <int G, bool kSquares, typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_dots(const scalar_t* v, const acc_t* const* y, int64_t D, acc_t& sumsq, acc_t* dots) {
  using R = Round<scalar_t>;
  using AVec = typename R::AVec;
  AVec sq[kDotChains], d[G][kDotChains];
#pragma GCC unroll 2
  for (int c = 0; c < kDotChains; ++c) {
    sq[c] = AVec(acc_t(0));
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) d[g][c] = AVec(acc_t(0));
  }
  int64_t j = 0;
  for (; j + R::kSize <= D; j += R::kSize) {
    for (int b = 0; b < int(R::kSize * sizeof(scalar_t)); b += 64) {  // a line each
      __builtin_prefetch(reinterpret_cast<const char*>(v + j) + kPrefetchBytes + b, 0, 3);
    }
    AVec vv[kDotChains];
    R::load(v + j, vv);
#pragma GCC unroll 2
    for (int c = 0; c < kDotChains; ++c) {
      const int64_t o = j + c * AVec::size();
      if constexpr (kSquares) sq[c] = at::vec::fmadd(vv[c], vv[c], sq[c]);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) d[g][c] = at::vec::fmadd(AVec::loadu(y[g] + o), vv[c], d[g][c]);
    }
  }
  acc_t s2 = hsum(sq[0] + sq[1]);
  for (int g = 0; g < G; ++g) dots[g] = hsum(d[g][0] + d[g][1]);
  for (; j < D; ++j) {
    const acc_t vj = static_cast<acc_t>(v[j]);
    if constexpr (kSquares) s2 += vj * vj;
    for (int g = 0; g < G; ++g) dots[g] += y[g][j] * vj;
  }
  if constexpr (kSquares) sumsq = s2;
}

// dots[g] = <y_g, v> for count >= 1 vectors, kGroup per sweep (the first
// sweep reads the row from memory, the others from L1); sumsq = <v, v> from
// the first sweep when kSquares.
template <bool kSquares, typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_many_dots(const scalar_t* v, const acc_t* const* y, int64_t count, int64_t D,
                   acc_t& sumsq, acc_t* dots) {
  acc_t unused;
  for (int64_t g0 = 0; g0 < count; g0 += kGroup) {
    const int64_t n = std::min<int64_t>(kGroup, count - g0);
    acc_t& sq = g0 == 0 ? sumsq : unused;
    const bool squares = kSquares && g0 == 0;
    switch (n) {
#define ATTNRES_DOTS_CASE(G)                                                       \
  case G:                                                                          \
    if (squares) row_dots<G, true>(v, y + g0, D, sq, dots + g0);                   \
    else row_dots<G, false>(v, y + g0, D, sq, dots + g0);                          \
    break;
      ATTNRES_DOTS_CASE(1)
      ATTNRES_DOTS_CASE(2)
      ATTNRES_DOTS_CASE(3)
      ATTNRES_DOTS_CASE(4)
#undef ATTNRES_DOTS_CASE
      default:
        TORCH_INTERNAL_ASSERT(false, "row_many_dots: no vector to dot with");
    }
  }
}

// out_g = sum_i w[g * N + i] * v_i for G readers in one sweep over the N
// rows of a token (from L2: the score sweep has just read them), the G
// accumulators in registers and each output row written once. The weights
// are the final softmax weights (sum 1), so no accumulator exceeds the
// largest |v| (the point of the normalized online form, docs/design.md §8)
// and no per-source rescaling is needed.
template <int G, typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void rows_weighted_sum(scalar_t* const* out, const scalar_t* const* rows, const acc_t* w,
                       int64_t N, int64_t D) {
  using R = Round<scalar_t>;
  using AVec = typename R::AVec;
  // A round a reader: G x kDotChains independent chains, N FMAs long.
  int64_t j = 0;
  for (; j + R::kSize <= D; j += R::kSize) {
    AVec acc[G][kDotChains];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 2
      for (int c = 0; c < kDotChains; ++c) acc[g][c] = AVec(acc_t(0));
    }
    for (int64_t i = 0; i < N; ++i) {
      AVec vv[kDotChains];
      R::load(rows[i] + j, vv);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const AVec wv(w[g * N + i]);
#pragma GCC unroll 2
        for (int c = 0; c < kDotChains; ++c) acc[g][c] = at::vec::fmadd(wv, vv[c], acc[g][c]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) R::store(out[g] + j, acc[g]);
  }
  for (; j < D; ++j) {
    for (int g = 0; g < G; ++g) {
      acc_t a = 0;
      for (int64_t i = 0; i < N; ++i) a += w[g * N + i] * static_cast<acc_t>(rows[i][j]);
      out[g][j] = static_cast<scalar_t>(a);
    }
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void rows_weighted_sum_many(scalar_t* const* out, const scalar_t* const* rows, const acc_t* w,
                            int64_t count, int64_t N, int64_t D) {
  for (int64_t g0 = 0; g0 < count; g0 += kGroup) {
    const acc_t* wg = w + g0 * N;
    switch (std::min<int64_t>(kGroup, count - g0)) {
      case 1: rows_weighted_sum<1>(out + g0, rows, wg, N, D); break;
      case 2: rows_weighted_sum<2>(out + g0, rows, wg, N, D); break;
      case 3: rows_weighted_sum<3>(out + g0, rows, wg, N, D); break;
      default: rows_weighted_sum<4>(out + g0, rows, wg, N, D); break;
    }
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_load(acc_t* dst, const scalar_t* src, int64_t D) {
  for (int64_t j = 0; j < D; ++j) dst[j] = static_cast<acc_t>(src[j]);
}

// rstd and the scores of one row for `count` effective queries, rescued
// (depth_math.h: a power-of-two multiple of the row) when the plain sums are
// out of range. Rare, so the rescue is scalar. Returns whether the row took
// the rescue.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
bool row_stats_many(const scalar_t* v, const acc_t* const* u, int64_t count, int64_t D,
                    acc_t eps, acc_t& r, acc_t* scores) {
  acc_t sumsq = 0;
  row_many_dots<true>(v, u, count, D, sumsq, scores);
  bool rescue = math::row_needs_rescale(sumsq, acc_t(0), eps);
  for (int64_t g = 0; g < count; ++g) {
    rescue = rescue || math::row_needs_rescale(sumsq, scores[g], eps);
  }
  if (!rescue) {
    r = math::rstd_from_sumsq(sumsq, D, eps);
    for (int64_t g = 0; g < count; ++g) scores[g] = math::score(r, scores[g]);
    return false;
  }
  const acc_t c = math::rescale_factor(sumsq);
  acc_t sumsq_c = 0;
  for (int64_t j = 0; j < D; ++j) {
    const acc_t vj = static_cast<acc_t>(v[j]) * c;
    sumsq_c += vj * vj;
  }
  for (int64_t g = 0; g < count; ++g) {
    acc_t dot_c = 0;
    for (int64_t j = 0; j < D; ++j) dot_c += u[g][j] * (static_cast<acc_t>(v[j]) * c);
    math::rescaled_stats(sumsq_c, dot_c, c, D, eps, r, scores[g]);
  }
  return true;
}

// Token chunks of the parameter-gradient partial sums: fixed by the shape
// only (never by the thread count), so the fixed-order sum of the chunks'
// rows is bitwise reproducible. At most ~16 MiB of partial rows.
struct Chunks {
  int64_t size, count;
};
Chunks z_chunks(int64_t T, int64_t row_values, int64_t acc_size) {
  constexpr int64_t kMinTokens = 64;
  const int64_t most = std::max<int64_t>(1, (16 << 20) / (row_values * acc_size));
  const int64_t count = std::clamp<int64_t>((T + kMinTokens - 1) / kMinTokens, 1, most);
  const int64_t size = (T + count - 1) / count;
  return {size, (T + size - 1) / size};
}

// z = sum of the chunks' rows, in chunk order.
template <typename acc_t>
void sum_chunks(const std::vector<acc_t>& partial, int64_t count, int64_t row_values, acc_t* z) {
  for (int64_t j = 0; j < row_values; ++j) z[j] = acc_t(0);
  for (int64_t c = 0; c < count; ++c) {
    const acc_t* p = partial.data() + c * row_values;
    for (int64_t j = 0; j < row_values; ++j) z[j] += p[j];
  }
}

// ---- phase 1 ----------------------------------------------------------------

// Tokens per tile of the phase-1 forward: about 256 KiB of source rows, which
// the weighted-sum sweeps re-read from L2 after the score sweep.
template <typename scalar_t>
int64_t phase1_tile(int64_t N, int64_t D) {
  return std::clamp<int64_t>((256 * 1024) / (N * D * int64_t(sizeof(scalar_t))), 1, 16);
}

template <typename scalar_t>
void block_reads_forward_impl(const BlockReadsForwardCall& call) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = call.N, S = call.S, D = call.D, T = call.T;
  const acc_t eps = static_cast<acc_t>(call.eps);
  std::vector<RowsOf<scalar_t>> src;
  src.reserve(N);
  for (const auto& s : call.sources) src.emplace_back(s);
  const acc_t* u = call.u.const_data_ptr<acc_t>();
  std::vector<const acc_t*> u_rows(S);
  for (int64_t s = 0; s < S; ++s) u_rows[s] = u + s * D;
  std::vector<scalar_t*> out_p(S);
  for (int64_t s = 0; s < S; ++s) out_p[s] = call.partial_outs[s].data_ptr<scalar_t>();
  double* lse_p = call.lse.data_ptr<double>();  // float64 for every dtype (§10)
  acc_t* rstd_p = call.rstd.data_ptr<acc_t>();
  acc_t* w_p = call.weights.data_ptr<acc_t>();

  // Reader 0's fused output norm: h_0 is written (to the kept h, else to
  // y_0's row) and normalized from L1 into y_0 (row_normed_store, as the
  // one-call read; h_0 is already rounded, so the factor is 1).
  const OutNormStore<scalar_t> norm(call.out_norm);
  const int64_t tile = std::min(phase1_tile<scalar_t>(N, D), T);  // as one call's forward
  at::parallel_for(0, T, parallel_grain((N + S) * D, tile), [&](int64_t t_begin, int64_t t_end) {
    std::vector<acc_t> hbuf(norm ? D : 0);
    std::vector<acc_t> scores(tile * S * N), sc(S), w(S * N), rescue_row;
    std::vector<const scalar_t*> rows(N);
    std::vector<scalar_t*> out_rows(S);
    std::vector<char> rescued(tile);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += tile) {
      const int64_t n_tok = std::min(tile, t_end - t0);
      std::fill(rescued.begin(), rescued.end(), 0);
      // Sweep 1, from memory, source-major over the tile (its rows of one
      // source are adjacent: one long stream): rstd_i and every reader's
      // score s_{s,i}.
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t k = 0; k < n_tok; ++k) {
          const int64_t t = t0 + k;
          acc_t r;
          rescued[k] |= row_stats_many(src[i].row(t), u_rows.data(), S, D, eps, r, sc.data());
          rstd_p[i * T + t] = r;
          for (int64_t s = 0; s < S; ++s) scores[(k * S + s) * N + i] = sc[s];
        }
      }
      for (int64_t k = 0; k < n_tok; ++k) {
        const int64_t t = t0 + k;
        const acc_t* score = scores.data() + k * S * N;
        // Per reader: the OnlineSoftmax state over the N scores, its lse
        // and weights (a NaN score poisons them all, as in the one-call
        // read).
        for (int64_t s = 0; s < S; ++s) {
          math::OnlineSoftmax<acc_t> st;
          st.init(score[s * N]);
          acc_t keep, take;
          for (int64_t i = 1; i < N; ++i) st.push(score[s * N + i], keep, take);
          lse_p[s * T + t] = st.log_sum_exp();
          const acc_t nan_if_poisoned = st.out_factor();
          for (int64_t i = 0; i < N; ++i) {
            w[s * N + i] = st.weight(score[s * N + i]) * nan_if_poisoned;
            w_p[(s * N + i) * T + t] = w[s * N + i];
          }
          out_rows[s] = out_p[s] + t * D;
        }
        // Sweep 2, from L2: y_s = sum_i a_{s,i} v_i, kGroup readers a sweep.
        for (int64_t i = 0; i < N; ++i) rows[i] = src[i].row(t);
        if (norm.h) out_rows[0] = norm.h_row(t, D);
        rows_weighted_sum_many(out_rows.data(), rows.data(), w.data(), S, N, D);
        if (rescued[k]) {
          // Rows near the dtype's limits: each y_s again, kept finite (an
          // ulp of excess weight at the maximum is inf; §8).
          rescue_row.resize(D);
          for (int64_t s = 0; s < S; ++s) {
            row_average_kept_finite(rescue_row.data(), rows.data(), w.data() + s * N, N, D);
            for (int64_t j = 0; j < D; ++j) out_rows[s][j] = static_cast<scalar_t>(rescue_row[j]);
          }
        }
        if (norm) {
          row_load(hbuf.data(), out_rows[0], D);
          norm.store(t, out_p[0] + t * D, nullptr, hbuf.data(), acc_t(1), D);
        }
      }
    }
  });
}

// dv_i = B v + sum_s (a_s dy_s + alpha_s u_s) (written when dv), and
// z_s += alpha_s v (when z): the phase-1 gradient of one source row, all
// readers at once.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_block_source_grad(scalar_t* dv, const scalar_t* v, const acc_t* const* dy,
                           const acc_t* const* u, const acc_t* a, const acc_t* alpha, acc_t B,
                           int64_t S, acc_t* z, int64_t D) {
  using R = Round<scalar_t>;
  using AVec = typename R::AVec;
  // A round at a time, each vector with two chains (the dy terms and the u
  // terms): 2 S FMAs in one chain made the sweep latency-bound.
  constexpr int64_t kW = AVec::size();
  int64_t j = 0;
  for (; j + R::kSize <= D; j += R::kSize) {
    AVec vv[kDotChains], gd[kDotChains], gu[kDotChains];
    R::load(v + j, vv);
#pragma GCC unroll 2
    for (int c = 0; c < kDotChains; ++c) {
      gd[c] = AVec(B) * vv[c];
      gu[c] = AVec(acc_t(0));
    }
    for (int64_t s = 0; s < S; ++s) {
      const AVec as(a[s]), al(alpha[s]);
      const acc_t* us = u[s] + j;
      if (dy) {
        const acc_t* dys = dy[s] + j;
#pragma GCC unroll 2
        for (int c = 0; c < kDotChains; ++c) gd[c] = at::vec::fmadd(as, AVec::loadu(dys + c * kW), gd[c]);
      }
#pragma GCC unroll 2
      for (int c = 0; c < kDotChains; ++c) gu[c] = at::vec::fmadd(al, AVec::loadu(us + c * kW), gu[c]);
      if (z) {
        acc_t* zs = z + s * D + j;
#pragma GCC unroll 2
        for (int c = 0; c < kDotChains; ++c) {
          at::vec::fmadd(al, vv[c], AVec::loadu(zs + c * kW)).store(zs + c * kW);
        }
      }
    }
    if (dv) {
      AVec sum[kDotChains];
#pragma GCC unroll 2
      for (int c = 0; c < kDotChains; ++c) sum[c] = gd[c] + gu[c];
      R::store(dv + j, sum);
    }
  }
  for (; j < D; ++j) {
    const acc_t vj = static_cast<acc_t>(v[j]);
    acc_t gdj = B * vj, guj = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (dy) gdj += a[s] * dy[s][j];
      guj += alpha[s] * u[s][j];
      if (z) z[s * D + j] += alpha[s] * vj;
    }
    if (dv) dv[j] = static_cast<scalar_t>(gdj + guj);
  }
}

// The phase-1 backward of one token in math::WideType (double for fp32
// accumulation, long double for fp64), all readers at once: the rare tokens
// whose rows are near the dtype's limits (math::backward_row_is_rare), as
// the one-call backward's backward_token_wide. Scalar and slow, but the
// products <dy, v>, <u, v> and r^2 of any finite inputs fit in it. dv and
// the token's z terms are written as in the fast path (dv rounded once to
// the accumulation type, then to scalar_t).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void block_reads_token_wide(const std::vector<RowsOf<scalar_t>>& src, int64_t t, int64_t T,
                            int64_t N, int64_t S, int64_t D, const acc_t* const* dy,
                            const acc_t* const* u, const acc_t* rstd_p, const acc_t* w_p,
                            const double* dlse_p, const std::vector<scalar_t*>& dv_p, acc_t* z) {
  using W = typename math::WideType<acc_t>::type;
  std::vector<W> dp(S * N), su(S * N), a(N * S), alpha(N * S), beta(N, W(0));
  for (int64_t i = 0; i < N; ++i) {
    const scalar_t* v = src[i].row(t);
    const W r = static_cast<W>(rstd_p[i * T + t]);
    for (int64_t s = 0; s < S; ++s) {
      W dot_dy = 0, dot_u = 0;
      for (int64_t d = 0; d < D; ++d) {
        const W vd = static_cast<W>(static_cast<acc_t>(v[d]));
        if (dy) dot_dy += static_cast<W>(dy[s][d]) * vd;
        dot_u += static_cast<W>(u[s][d]) * vd;
      }
      dp[s * N + i] = dot_dy;
      su[s * N + i] = math::score(r, dot_u);
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    auto weight = [&](int64_t i) { return w_p[(s * N + i) * T + t]; };
    // The pivot is taken on the acc_t weights, as in the fast path.
    auto [dp_piv, sum_rel] =
        math::pivoted_sum<W>(N, weight, [&](int64_t j) { return dp[s * N + j]; });
    if (dlse_p) sum_rel -= static_cast<W>(dlse_p[s * T + t]);
    for (int64_t i = 0; i < N; ++i) {
      const auto g = math::source_grad_coefficients<W>(
          static_cast<W>(weight(i)), static_cast<W>(rstd_p[i * T + t]), su[s * N + i],
          dp[s * N + i] - dp_piv, sum_rel, D);
      a[i * S + s] = g.a;
      alpha[i * S + s] = g.alpha;
      beta[i] += g.beta;
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    scalar_t* dv = dv_p[i] ? dv_p[i] + t * D : nullptr;
    if (!dv && !z) continue;
    const scalar_t* v = src[i].row(t);
    for (int64_t d = 0; d < D; ++d) {
      const W vd = static_cast<W>(static_cast<acc_t>(v[d]));
      W g = beta[i] * vd;
      for (int64_t s = 0; s < S; ++s) {
        if (dy) g += a[i * S + s] * static_cast<W>(dy[s][d]);
        g += alpha[i * S + s] * static_cast<W>(u[s][d]);
        if (z) z[s * D + d] += static_cast<acc_t>(alpha[i * S + s] * vd);
      }
      if (dv) dv[d] = static_cast<scalar_t>(static_cast<acc_t>(g));
    }
  }
}

template <typename scalar_t>
void block_reads_backward_impl(const BlockReadsBackwardCall& call) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = call.N, S = call.S, D = call.D, T = call.T;
  std::vector<RowsOf<scalar_t>> src;
  src.reserve(N);
  for (const auto& s : call.sources) src.emplace_back(s);
  std::vector<RowsOf<scalar_t>> dy_src;
  for (const auto& g : call.grad_partial_outs) dy_src.emplace_back(g);
  const bool has_dy = !dy_src.empty();
  const acc_t* u = call.u.const_data_ptr<acc_t>();
  const acc_t* rstd_p = call.rstd.const_data_ptr<acc_t>();
  const acc_t* w_p = call.weights.const_data_ptr<acc_t>();
  const double* dlse_p = call.grad_lse.defined() ? call.grad_lse.const_data_ptr<double>() : nullptr;
  std::vector<scalar_t*> dv_p(N, nullptr);
  for (int64_t i = 0; i < N; ++i) {
    if (call.grad_sources[i].defined()) dv_p[i] = call.grad_sources[i].data_ptr<scalar_t>();
  }
  const bool want_z = call.z.defined();
  const Chunks chunks = z_chunks(T, S * D, sizeof(acc_t));
  std::vector<acc_t> partial(want_z ? chunks.count * S * D : 0, acc_t(0));
  // Reader 0's fused output norm: its dh is formed from dy_0, h_0 and the
  // norm's rstd (row_normed_grad); dy_0 * n goes to the chunk's partial row
  // of the out_weight gradient (fixed-order sum, as z).
  const OutNormBackward* norm = has_dy ? call.out_norm : nullptr;
  const OutNormGradRows<scalar_t> norm_grad(norm, call.h);
  const bool want_dw = norm_grad.want_dw;
  std::vector<acc_t> dw_partial(want_dw ? chunks.count * D : 0, acc_t(0));

  // Each token reads N completed rows and S gradient rows.
  const int64_t grain = parallel_grain(chunks.size * (N + S) * D);
  at::parallel_for(0, chunks.count, grain, [&](int64_t c_begin, int64_t c_end) {
    std::vector<acc_t> dy(has_dy ? S * D : 0), dots(2 * S), dp(S * N), su(S * N);
    std::vector<acc_t> coef_a(N * S), coef_alpha(N * S), coef_beta(N);
    // The vectors each sweep dots the row with: (dy_s, u_s) per reader, or
    // u_s alone without dy.
    std::vector<const acc_t*> with(2 * S), dy_rows(S), u_rows(S);
    for (int64_t s = 0; s < S; ++s) {
      u_rows[s] = u + s * D;
      dy_rows[s] = has_dy ? dy.data() + s * D : nullptr;
      if (has_dy) {
        with[2 * s] = dy_rows[s];
        with[2 * s + 1] = u_rows[s];
      } else {
        with[s] = u_rows[s];
      }
    }
    const int64_t n_with = has_dy ? 2 * S : S;
    for (int64_t c = c_begin; c < c_end; ++c) {
      acc_t* z = want_z ? partial.data() + c * S * D : nullptr;
      acc_t* dw = want_dw ? dw_partial.data() + c * D : nullptr;
      const int64_t t_end = std::min(T, (c + 1) * chunks.size);
      for (int64_t t = c * chunks.size; t < t_end; ++t) {
        for (int64_t s = 0; s < S && has_dy; ++s) {
          if (s == 0 && norm_grad) {
            norm_grad.grad(dy.data(), t, dy_src[0].row(t), dw, D);
          } else {
            row_load(dy.data() + s * D, dy_src[s].row(t), D);
          }
        }
        // Sweep 1 (from memory): dp_{s,i} = <dy_s, v_i>, <u_s, v_i>.
        for (int64_t i = 0; i < N; ++i) {
          acc_t unused;
          row_many_dots<false>(src[i].row(t), with.data(), n_with, D, unused, dots.data());
          const acc_t r = rstd_p[i * T + t];
          for (int64_t s = 0; s < S; ++s) {
            dp[s * N + i] = has_dy ? dots[2 * s] : acc_t(0);
            su[s * N + i] = math::score(r, has_dy ? dots[2 * s + 1] : dots[s]);
          }
        }
        // Per reader: ds_{s,i} = a (dp_i - sum_j a_j dp_j + dlse), the sum
        // pivoted when one weight dominates (depth_math.h). A token with a
        // rare row (sums or coefficients out of the accumulation dtype's
        // range) is recomputed in the wide type instead of sweep 2.
        std::fill(coef_beta.begin(), coef_beta.end(), acc_t(0));
        bool rare = false;
        for (int64_t s = 0; s < S; ++s) {
          auto weight = [&](int64_t i) { return w_p[(s * N + i) * T + t]; };
          auto [dp_piv, sum_rel] =
              math::pivoted_sum<acc_t>(N, weight, [&](int64_t j) { return dp[s * N + j]; });
          if (dlse_p) sum_rel -= static_cast<acc_t>(dlse_p[s * T + t]);  // inf: a rare token
          for (int64_t i = 0; i < N; ++i) {
            const acc_t a = weight(i), r = rstd_p[i * T + t], dp_rel = dp[s * N + i] - dp_piv;
            const auto g = math::source_grad_coefficients(a, r, su[s * N + i], dp_rel, sum_rel, D);
            rare = rare || math::backward_row_is_rare(a, r, su[s * N + i], dp_rel, sum_rel, g);
            coef_a[i * S + s] = g.a;
            coef_alpha[i * S + s] = g.alpha;
            coef_beta[i] += g.beta;
          }
        }
        // The readers' betas summed past the range (each one in it).
        for (int64_t i = 0; i < N && !rare; ++i) {
          rare = math::abs_acc(coef_beta[i]) > math::RangeConstants<acc_t>::kMax;
        }
        if (rare) {
          block_reads_token_wide(src, t, T, N, S, D, has_dy ? dy_rows.data() : nullptr,
                                 u_rows.data(), rstd_p, w_p, dlse_p, dv_p, z);
          continue;
        }
        // Sweep 2 (from cache): each wanted source gradient written once,
        // every reader's term summed in registers; z_s.
        for (int64_t i = 0; i < N; ++i) {
          if (!dv_p[i] && !z) continue;
          row_block_source_grad(dv_p[i] ? dv_p[i] + t * D : nullptr, src[i].row(t),
                                has_dy ? dy_rows.data() : nullptr, u_rows.data(),
                                coef_a.data() + i * S, coef_alpha.data() + i * S, coef_beta[i],
                                S, z, D);
        }
      }
    }
  });
  if (want_z) sum_chunks(partial, chunks.count, S * D, call.z.data_ptr<acc_t>());
  if (want_dw) sum_chunks(dw_partial, chunks.count, D, norm->grad_weight.data_ptr<acc_t>());
}

// ---- phase 2 ----------------------------------------------------------------

template <typename scalar_t>
void merge_forward_impl(const MergeForwardCall& call) {
  using acc_t = at::opmath_type<scalar_t>;
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  const int64_t D = call.D, T = call.T;
  const acc_t eps = static_cast<acc_t>(call.eps);
  const RowsOf<scalar_t> y_rows(call.partial_out), p_rows(call.block_sum);
  const acc_t* u = call.u.const_data_ptr<acc_t>();
  const double* lse_p = call.lse.const_data_ptr<double>();
  scalar_t* out_p = call.out.data_ptr<scalar_t>();
  acc_t* rstd_p = call.rstd.data_ptr<acc_t>();
  acc_t* w_p = call.weight.data_ptr<acc_t>();
  // The fused output norm: h lands in an L1 row first (rounded to scalar_t
  // by row_normed_store, as in the one-call read), then y (and h if kept).
  const OutNormStore<scalar_t> norm(call.out_norm);
  // The fused prefix add: the token's P' row formed first, then read from L1.
  std::optional<RowsOf<scalar_t>> delta_rows;
  if (call.prefix) delta_rows.emplace(call.prefix->delta);
  scalar_t* sum_p = call.prefix ? call.prefix->sum.data_ptr<scalar_t>() : nullptr;
  at::parallel_for(0, T, parallel_grain(3 * D, 16), [&](int64_t t_begin, int64_t t_end) {
    std::vector<acc_t> hbuf(norm ? D : 0), rescue_row;
    for (int64_t t = t_begin; t < t_end; ++t) {
      const scalar_t* y = y_rows.row(t);
      const scalar_t* P = p_rows.row(t);
      if (sum_p) {
        row_add(sum_p + t * D, P, delta_rows->row(t), D);
        P = sum_p + t * D;
      }
      acc_t r, s;
      const bool rescued = row_stats_many(P, &u, 1, D, eps, r, &s);
      // The exact merge: phase 1's state (m, l) = (lse, 1), plus score s.
      math::OnlineSoftmax<acc_t> st;
      st.init(static_cast<acc_t>(lse_p[t]));
      acc_t keep, take;
      st.push(s, keep, take);
      const acc_t f = st.out_factor();
      rstd_p[t] = r;
      w_p[t] = take;
      scalar_t* out = out_p + t * D;
      const AVec vk(keep), vt(take), vf(f);
      int64_t j = 0;
      if (rescued) {
        // The block sum is near the dtype's limits: h kept finite (an ulp
        // of excess weight at the maximum is inf; §8).
        rescue_row.resize(D);
        const scalar_t* rows[2] = {y, P};
        const acc_t w[2] = {keep, take};
        row_average_kept_finite(rescue_row.data(), rows, w, 2, D);
        if (norm) {
          norm.store(t, out, norm.h_row(t, D), rescue_row.data(), f, D);
        } else {
          for (int64_t c = 0; c < D; ++c) out[c] = static_cast<scalar_t>(rescue_row[c] * f);
        }
        continue;
      }
      if (norm) {
        acc_t* hb = hbuf.data();
        for (; j + L::kStep <= D; j += L::kStep) {
          AVec yv[L::kParts], pv[L::kParts];
          L::load(y + j, yv);
          L::load(P + j, pv);
          for (int k = 0; k < L::kParts; ++k) {
            math::online_accumulate(yv[k], vk, vt, pv[k]).store(hb + j + k * AVec::size());
          }
        }
        for (; j < D; ++j) {
          hb[j] = math::online_accumulate(static_cast<acc_t>(y[j]), keep, take,
                                          static_cast<acc_t>(P[j]));
        }
        // y may be the consumed partial_out (in place): its row is in hb now.
        norm.store(t, out, norm.h_row(t, D), hb, f, D);
        continue;
      }
      for (; j + L::kStep <= D; j += L::kStep) {
        AVec yv[L::kParts], pv[L::kParts], o[L::kParts];
        L::load(y + j, yv);
        L::load(P + j, pv);
        for (int k = 0; k < L::kParts; ++k) o[k] = math::online_accumulate(yv[k], vk, vt, pv[k]) * vf;
        L::store(out + j, o);
      }
      for (; j < D; ++j) {
        out[j] = static_cast<scalar_t>(
            math::online_accumulate(static_cast<acc_t>(y[j]), keep, take, static_cast<acc_t>(P[j])) * f);
      }
    }
  });
}

// The phase-2 backward of one token in math::WideType: the rare tokens
// (math::backward_row_is_rare), as block_reads_token_wide.
template <typename scalar_t, typename dh_t, typename acc_t = at::opmath_type<scalar_t>>
void merge_token_wide(const dh_t* dh, const scalar_t* y, const scalar_t* P, const acc_t* u,
                      acc_t a_acc, acc_t r_acc, int64_t D, scalar_t* dy, double* dlse,
                      scalar_t* dP, acc_t* z) {
  using W = typename math::WideType<acc_t>::type;
  auto wide = [](auto x) { return static_cast<W>(static_cast<acc_t>(x)); };
  W cdot = 0, udot = 0;
  for (int64_t d = 0; d < D; ++d) {
    cdot += wide(dh[d]) * (wide(P[d]) - wide(y[d]));
    udot += static_cast<W>(u[d]) * wide(P[d]);
  }
  const W a = a_acc, r = r_acc, keep = W(1) - a;
  const auto g = math::source_grad_coefficients<W>(a, r, math::score(r, udot), keep * cdot, W(0), D);
  if (dlse) *dlse = static_cast<double>(-(a * (keep * cdot)));  // not rounded to acc_t
  for (int64_t d = 0; d < D; ++d) {
    const W hd = wide(dh[d]), pd = wide(P[d]);
    if (dy) dy[d] = static_cast<scalar_t>(static_cast<acc_t>(keep * hd));
    if (dP) {
      dP[d] = static_cast<scalar_t>(
          static_cast<acc_t>(math::source_grad(g.a, hd, g.alpha, static_cast<W>(u[d]), g.beta, pd)));
    }
    if (z) z[d] += static_cast<acc_t>(g.alpha * pd);
  }
}

// One step of a dh row as accumulation-dtype vectors: grad_out's row
// (scalar_t), or the fused output norm's dh row (acc_t, from
// row_normed_grad).
template <typename scalar_t, typename dh_t>
void load_dh(const dh_t* p, typename Lanes<scalar_t>::AVec (&v)[Lanes<scalar_t>::kParts]) {
  using L = Lanes<scalar_t>;
  if constexpr (std::is_same_v<dh_t, scalar_t>) {
    L::load(p, v);
  } else {
    for (int k = 0; k < L::kParts; ++k) v[k] = L::AVec::loadu(p + k * L::AVec::size());
  }
}

// The phase-2 backward of one token from its dh row (scalar_t or acc_t).
template <typename scalar_t, typename dh_t, typename acc_t = at::opmath_type<scalar_t>>
void merge_token_grad(const dh_t* dh, const scalar_t* y, const scalar_t* P, const acc_t* u,
                      acc_t a, acc_t r, int64_t D, scalar_t* dy, double* dlse, scalar_t* dP,
                      acc_t* z) {
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  // Sweep 1: c = <dh, P - y> (elementwise difference: nothing cancels
  // beyond it) and <u, P>.
  constexpr int kRound = Round<scalar_t>::kSteps;  // dh may be acc_t: loaded a step at a time
  AVec cd[kDotChains] = {AVec(acc_t(0)), AVec(acc_t(0))};
  AVec ud[kDotChains] = {AVec(acc_t(0)), AVec(acc_t(0))};
  int64_t j = 0;
  for (; j + kRound * L::kStep <= D; j += kRound * L::kStep) {
#pragma GCC unroll 2
    for (int r = 0; r < kRound; ++r) {
      const int64_t jr = j + r * L::kStep;
      AVec hv[L::kParts], yv[L::kParts], pv[L::kParts];
      load_dh<scalar_t>(dh + jr, hv);
      L::load(y + jr, yv);
      L::load(P + jr, pv);
#pragma GCC unroll 2
      for (int k = 0; k < L::kParts; ++k) {
        const int ch = r * L::kParts + k;
        cd[ch] = at::vec::fmadd(hv[k], pv[k] - yv[k], cd[ch]);
        ud[ch] = at::vec::fmadd(AVec::loadu(u + jr + k * AVec::size()), pv[k], ud[ch]);
      }
    }
  }
  acc_t cdot = hsum(cd[0] + cd[1]), udot = hsum(ud[0] + ud[1]);
  for (; j < D; ++j) {
    const acc_t pj = static_cast<acc_t>(P[j]);
    cdot += static_cast<acc_t>(dh[j]) * (pj - static_cast<acc_t>(y[j]));
    udot += u[j] * pj;
  }
  // ds = a (1 - a) c = a (dp_P - <dh, h>) (docs/design.md §10).
  const acc_t s = math::score(r, udot), dp_rel = (acc_t(1) - a) * cdot;
  const auto g = math::source_grad_coefficients(a, r, s, dp_rel, acc_t(0), D);
  if (math::backward_row_is_rare(a, r, s, dp_rel, acc_t(0), g)) {
    merge_token_wide(dh, y, P, u, a, r, D, dy, dlse, dP, z);
    return;
  }
  if (dlse) *dlse = -(a * dp_rel);
  if (!dy && !dP && !z) return;
  // Sweep 2 (from L1): dy = (1 - a) dh, dP = a dh + alpha u + beta P, z.
  const AVec keep(acc_t(1) - a), va(g.a), valpha(g.alpha), vbeta(g.beta);
  j = 0;
  for (; j + L::kStep <= D; j += L::kStep) {
    AVec hv[L::kParts], pv[L::kParts], o1[L::kParts], o2[L::kParts];
    load_dh<scalar_t>(dh + j, hv);
    L::load(P + j, pv);
    for (int k = 0; k < L::kParts; ++k) {
      const int64_t o = j + k * AVec::size();
      o1[k] = keep * hv[k];
      o2[k] = math::source_grad(va, hv[k], valpha, AVec::loadu(u + o), vbeta, pv[k]);
      if (z) at::vec::fmadd(valpha, pv[k], AVec::loadu(z + o)).store(z + o);
    }
    if (dy) L::store(dy + j, o1);
    if (dP) L::store(dP + j, o2);
  }
  for (; j < D; ++j) {
    const acc_t hj = static_cast<acc_t>(dh[j]), pj = static_cast<acc_t>(P[j]);
    if (dy) dy[j] = static_cast<scalar_t>((acc_t(1) - a) * hj);
    if (dP) dP[j] = static_cast<scalar_t>(math::source_grad(g.a, hj, g.alpha, u[j], g.beta, pj));
    if (z) z[j] += g.alpha * pj;
  }
}

template <typename scalar_t>
void merge_backward_impl(const MergeBackwardCall& call) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = call.D, T = call.T;
  const RowsOf<scalar_t> dh_rows(call.grad_out), y_rows(call.partial_out), p_rows(call.block_sum);
  const acc_t* u = call.u.const_data_ptr<acc_t>();
  const acc_t* rstd_p = call.rstd.const_data_ptr<acc_t>();
  const acc_t* w_p = call.weight.const_data_ptr<acc_t>();
  scalar_t* dy_p = call.grad_partial_out.defined() ? call.grad_partial_out.data_ptr<scalar_t>() : nullptr;
  double* dlse_p = call.grad_lse.defined() ? call.grad_lse.data_ptr<double>() : nullptr;
  scalar_t* dP_p = call.grad_block_sum.defined() ? call.grad_block_sum.data_ptr<scalar_t>() : nullptr;
  const bool want_z = call.z.defined();
  const Chunks chunks = z_chunks(T, D, sizeof(acc_t));
  std::vector<acc_t> partial(want_z ? chunks.count * D : 0, acc_t(0));
  // The fused output norm: grad_out is dy; dh is formed per token from dy,
  // h and the norm's rstd (row_normed_grad, as the one-call backward), and
  // dy * n goes to the chunk's partial row of the out_weight gradient, so
  // that gradient is summed in a fixed order too.
  const OutNormBackward* norm = call.out_norm;
  const OutNormGradRows<scalar_t> norm_grad(norm, call.h);
  const bool want_dw = norm_grad.want_dw;
  std::vector<acc_t> dw_partial(want_dw ? chunks.count * D : 0, acc_t(0));
  // The prefix add's P' gradient, added to the token's dP row while in L1.
  std::optional<RowsOf<scalar_t>> sum_grad_rows;
  if (call.grad_sum && dP_p) sum_grad_rows.emplace(*call.grad_sum);

  // Each token reads dh, y and P.
  const int64_t grain = parallel_grain(chunks.size * 3 * D);
  at::parallel_for(0, chunks.count, grain, [&](int64_t c_begin, int64_t c_end) {
    std::vector<acc_t> dh_buf(norm_grad ? D : 0);
    for (int64_t c = c_begin; c < c_end; ++c) {
      acc_t* z = want_z ? partial.data() + c * D : nullptr;
      acc_t* dw = want_dw ? dw_partial.data() + c * D : nullptr;
      const int64_t t_end = std::min(T, (c + 1) * chunks.size);
      for (int64_t t = c * chunks.size; t < t_end; ++t) {
        scalar_t* dy = dy_p ? dy_p + t * D : nullptr;
        scalar_t* dP = dP_p ? dP_p + t * D : nullptr;
        double* dlse = dlse_p ? dlse_p + t : nullptr;
        if (norm_grad) {
          norm_grad.grad(dh_buf.data(), t, dh_rows.row(t), dw, D);
          merge_token_grad(static_cast<const acc_t*>(dh_buf.data()), y_rows.row(t),
                           p_rows.row(t), u, w_p[t], rstd_p[t], D, dy, dlse, dP, z);
        } else {
          merge_token_grad(dh_rows.row(t), y_rows.row(t), p_rows.row(t), u, w_p[t], rstd_p[t], D,
                           dy, dlse, dP, z);
        }
        if (sum_grad_rows) row_add(dP, static_cast<const scalar_t*>(dP), sum_grad_rows->row(t), D);
      }
    }
  });
  if (want_z) sum_chunks(partial, chunks.count, D, call.z.data_ptr<acc_t>());
  if (want_dw) sum_chunks(dw_partial, chunks.count, D, norm->grad_weight.data_ptr<acc_t>());
}

}  // namespace

#define ATTNRES_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, name, __VA_ARGS__)

void block_reads_forward(const BlockReadsForwardCall& call) {
  ATTNRES_DISPATCH(call.sources[0].scalar_type(), "attnres_block_reads_forward_cpu",
                   [&] { block_reads_forward_impl<scalar_t>(call); });
}

void block_reads_backward(const BlockReadsBackwardCall& call) {
  ATTNRES_DISPATCH(call.sources[0].scalar_type(), "attnres_block_reads_backward_cpu",
                   [&] { block_reads_backward_impl<scalar_t>(call); });
}

void block_read_merge_forward(const MergeForwardCall& call) {
  ATTNRES_DISPATCH(call.block_sum.scalar_type(), "attnres_block_read_merge_forward_cpu",
                   [&] { merge_forward_impl<scalar_t>(call); });
}

void block_read_merge_backward(const MergeBackwardCall& call) {
  ATTNRES_DISPATCH(call.block_sum.scalar_type(), "attnres_block_read_merge_backward_cpu",
                   [&] { merge_backward_impl<scalar_t>(call); });
}

}  // namespace cpu
}  // namespace attnres
