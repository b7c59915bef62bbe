// Per-token math of depth attention, shared by the CPU and CUDA kernels.
//
// Everything here is scalar (or elementwise on any type with + - *), so the
// same code runs on the host, on the device, and on at::vec::Vectorized lanes.
// The CPU tests therefore exercise exactly the formulas the GPU kernels use.
//
// Notation (one token; derivation in docs/design.md §1-§2):
//   v_i   source i (width D), r_i = 1/sqrt(mean(v_i^2) + eps)
//   u     = scale * query * gain          (so s_i = r_i * dot(u, v_i))
//   a     = softmax(s), h = sum_i a_i v_i
// Backward, with dh the incoming gradient and dp_i = dot(dh, v_i):
//   ds_i  = a_i (dp_i - sum_j a_j dp_j)
//   dv_i  = a_i dh + alpha_i u + beta_i v_i,
//           alpha_i = ds_i r_i,  beta_i = -ds_i r_i^2 s_i / D
//   Z    += alpha_i v_i   (sum over tokens and sources; dquery = scale*gain*Z,
//                          dgain = scale*query*Z)
//
// Range (docs/design.md §8). The kernels' fast path computes sum(v^2) and
// <u, v> of the raw row. Rows whose sum of squares overflows (|v| beyond
// ~1.8e19/sqrt(D) in fp32/bf16) or underflows (eps tiny) take a rescued path
// in which the row is first multiplied by a power of two (exact):
// row_needs_rescale / rescale_factor / rescaled_stats below. The backward
// checks its per-row coefficients (backward_row_is_rare) and recomputes the
// rare tokens in a wider type (WideType). The checks are a few compares on
// per-row scalars, so the common case costs nothing.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ATTNRES_HD __host__ __device__ __forceinline__
#else
#define ATTNRES_HD inline
#endif

namespace attnres {
namespace math {

// exp and sqrt in the accumulation type itself: on the host ::exp(float)
// would resolve to the double-precision function, so the CPU would compute
// different bits from the GPU. These overloads pick expf/sqrtf for float on
// both sides.
ATTNRES_HD float exp_acc(float x) { return ::expf(x); }
ATTNRES_HD double exp_acc(double x) { return ::exp(x); }
ATTNRES_HD float sqrt_acc(float x) { return ::sqrtf(x); }
ATTNRES_HD double sqrt_acc(double x) { return ::sqrt(x); }
ATTNRES_HD float log_acc(float x) { return ::logf(x); }
ATTNRES_HD double log_acc(double x) { return ::log(x); }

// Reciprocal RMS of a row from its sum of squares. Accumulated in acc_t
// (fp32 for fp32/bf16/fp16 inputs, fp64 for fp64), as apex/Liger do.
template <typename acc_t>
ATTNRES_HD acc_t rstd_from_sumsq(acc_t sumsq, int64_t D, acc_t eps) {
  return acc_t(1) / sqrt_acc(sumsq / acc_t(D) + eps);
}

// Score of one source from its rstd and dot(u, v).
template <typename acc_t>
ATTNRES_HD acc_t score(acc_t rstd, acc_t dot_uv) {
  return rstd * dot_uv;
}

// NaN-propagating max: a NaN score must poison the token as softmax would.
template <typename acc_t>
ATTNRES_HD acc_t nan_max(acc_t a, acc_t b) {
  return (a != a || b != b) ? (a + b) : (a > b ? a : b);
}

// Online softmax over the sources of one token (running max m, running sum
// l of exp(s - m)). The weighted sum of values is rescaled alongside:
//   acc <- acc * rescale + p * v.
template <typename acc_t>
struct OnlineSoftmax {
  acc_t m;  // running max of scores
  acc_t l;  // running sum of exp(s_j - m)

  // The first score. l = exp(s - s): 1, or NaN for a NaN or infinite score
  // (softmax of one NaN/Inf score is NaN, also when N = 1).
  ATTNRES_HD void init(acc_t s) {
    m = s;
    l = (s - s) + acc_t(1);
  }

  // Adds score s. Returns through the out-arguments the factors of the
  // *normalized* online weighted sum: acc <- acc * keep + take * v keeps acc
  // the weighted average of the values pushed so far (keep + take = 1), so
  // it never exceeds the largest |v| (a running sum of p * v would overflow
  // for values near the dtype's maximum).
  ATTNRES_HD void push(acc_t s, acc_t& keep, acc_t& take) {
    const acc_t m_new = nan_max(m, s);
    const acc_t rescale = exp_acc(m - m_new);
    const acc_t p = exp_acc(s - m_new);
    const acc_t l_old = l * rescale;
    l = l_old + p;
    m = m_new;
    const acc_t inv = acc_t(1) / l;
    keep = l_old * inv;
    take = p * inv;
  }

  // Merges another partial state (used when sources are split across
  // threads or chunks). Returns the factors for this and the other
  // accumulator.
  ATTNRES_HD void merge(acc_t m_other, acc_t l_other, acc_t& self_scale,
                        acc_t& other_scale) {
    const acc_t m_new = nan_max(m, m_other);
    self_scale = exp_acc(m - m_new);
    other_scale = exp_acc(m_other - m_new);
    l = l * self_scale + l_other * other_scale;
    m = m_new;
  }

  // Final softmax weight of a source with score s.
  ATTNRES_HD acc_t weight(acc_t s) const { return exp_acc(s - m) / l; }
  // The factor the normalized accumulator is multiplied by at the end: 1,
  // or NaN when the softmax is NaN (so h is NaN too, also when N = 1).
  ATTNRES_HD acc_t out_factor() const { return (l - l) + acc_t(1); }
  // The state as one number, log sum_j exp(s_j) = m + log l (FlashAttention's
  // log-sum-exp): a later init(lse) + push(s) merges one more score exactly
  // (two-phase Block reads, docs/design.md §10).
  ATTNRES_HD acc_t log_sum_exp() const { return m + log_acc(l); }
};

// Elementwise step of the online weighted sum (works on Vectorized too).
template <typename T>
ATTNRES_HD T online_accumulate(T acc, T keep, T take, T v) {
  return acc * keep + take * v;
}

// ---- range: rescued rows --------------------------------------------------
// Powers of two a row is multiplied by when its plain sums are unusable:
//   big:   sum(v^2) overflowed. Then max|v| >= sqrt(max/D); after the scale
//          the squares are <= 2^96 * D (fp32) and the largest ones normal.
//   small: sum(v^2) < tiny (squares lost to underflow) while eps does not
//          dominate. Then |v| < sqrt(tiny); after the scale |v| < 2^50
//          (fp32) and even the smallest subnormal squares become normal.
template <typename acc_t>
struct RangeConstants;
template <>
struct RangeConstants<float> {
  static constexpr float kBigScale = 0x1p-80f;
  static constexpr float kSmallScale = 0x1p100f;
  static constexpr float kTiny = 0x1p-100f;
  static constexpr float kMax = 3.40282346638528859812e+38f;
};
template <>
struct RangeConstants<double> {
  static constexpr double kBigScale = 0x1p-560;
  static constexpr double kSmallScale = 0x1p600;
  static constexpr double kTiny = 0x1p-1000;
  static constexpr double kMax = 1.79769313486231570815e+308;
};

// A read's h is a weighted average of its rows, so |h| <= max|v|, within
// the dtype's range; but the weights sum to 1 only up to rounding, and at
// the maximum an ulp of excess weight is inf. Tokens whose rows took the
// range rescue (the only ones with values that large) keep h finite with
// this; NaN stays NaN (docs/design.md §8). T: acc_t or a wider type.
template <typename acc_t, typename T>
ATTNRES_HD T keep_finite(T x) {
  const T m = static_cast<T>(RangeConstants<acc_t>::kMax);
  return x > m ? m : (x < -m ? -m : x);
}

ATTNRES_HD float abs_acc(float x) { return ::fabsf(x); }
ATTNRES_HD double abs_acc(double x) { return ::fabs(x); }

// Whether a row's plain sums (sumsq = sum v^2, dot = <u, v>) cannot give its
// rstd and score: a sum overflowed (or is NaN: the rescued path then gives
// NaN too), or the squares underflowed while eps does not dominate.
template <typename acc_t>
ATTNRES_HD bool row_needs_rescale(acc_t sumsq, acc_t dot, acc_t eps) {
  using C = RangeConstants<acc_t>;
  return !(sumsq <= C::kMax) || !(abs_acc(dot) <= C::kMax) ||
         (sumsq < C::kTiny && eps < C::kTiny);
}

// The power of two a row needing a rescue is multiplied by (1 when only
// <u, v> overflowed: the query itself is out of range, and the score stays
// non-finite, as in any fp32 evaluation).
template <typename acc_t>
ATTNRES_HD acc_t rescale_factor(acc_t sumsq) {
  using C = RangeConstants<acc_t>;
  if (sumsq < C::kTiny) return C::kSmallScale;
  if (!(sumsq <= C::kMax)) return C::kBigScale;
  return acc_t(1);
}

// rstd and score from the sums of the scaled row c*v:
//   r = 1/sqrt(sum(v^2)/D + eps) = c / sqrt(sum((cv)^2)/D + eps c^2)
//   s = r <u, v>                 = <u, cv> / sqrt(sum((cv)^2)/D + eps c^2)
// (eps * c * c left to right: eps * c^2 alone could overflow or underflow).
template <typename acc_t>
ATTNRES_HD void rescaled_stats(acc_t sumsq_c, acc_t dot_c, acc_t c, int64_t D,
                               acc_t eps, acc_t& r, acc_t& s) {
  const acc_t root = sqrt_acc(sumsq_c / acc_t(D) + eps * c * c);
  r = c / root;
  s = dot_c / root;
}

// ---- range: rare backward tokens ------------------------------------------
// A wider type for the backward's rare tokens: the products <dh, v>,
// <u, v> and r^2 of rows near the dtype's limits fit in it.
template <typename acc_t>
struct WideType;
template <>
struct WideType<float> {
  using type = double;
};
template <>
struct WideType<double> {
#if defined(__CUDACC__) || defined(__HIPCC__)
  using type = double;  // no wider type on the device: docs/design.md §8
#else
  using type = long double;  // x87 extended: exponent range to 1e4932
#endif
};

// Backward coefficients of source i, given a_i, r_i, s_i, dp_i and
// sum_j a_j dp_j (computed in a first pass over the sources).
//
// Pivoted form (what the kernels pass): with p the source of the largest
// weight and sum_j a_j = 1,
//   dp_i - sum_j a_j dp_j = (dp_i - dp_p) - sum_{j != p} a_j (dp_j - dp_p),
// so the kernels pass dp = dp_i - dp_p and sum_a_dp = that sum. The plain
// form cancels |dp| down to ulp(|dp|) when one weight is near 1 and the
// dp_j share a large part (e.g. a huge <dh, v> common to all sources): the
// pivoted one subtracts only small-weighted differences (dp_p - dp_p is 0).
template <typename acc_t>
struct SourceGrad {
  acc_t a;      // value-path weight: dv += a * dh
  acc_t alpha;  // key path, along u:  dv += alpha * u
  acc_t beta;   // key path, along v:  dv += beta * v
};

template <typename acc_t>
ATTNRES_HD SourceGrad<acc_t> source_grad_coefficients(acc_t a, acc_t r,
                                                      acc_t s, acc_t dp,
                                                      acc_t sum_a_dp,
                                                      int64_t D) {
  const acc_t ds = a * (dp - sum_a_dp);
  const acc_t alpha = ds * r;
  SourceGrad<acc_t> g;
  g.a = a;
  g.alpha = alpha;
  g.beta = -alpha * r * s / acc_t(D);
  return g;
}

// Tracks the pivot of the pivoted form above over the sources of a token:
// the first source of the largest weight (NaN weights never win).
// The pivot is used only when its weight dominates (> 1/2): that is where
// the plain form cancels; elsewhere the plain form is as accurate and the
// kernels keep it (dp_p = 0, no source excluded).
template <typename acc_t>
struct Pivot {
  int64_t index = 0;
  acc_t weight = acc_t(-1);
  // The sum of the other weights, sum_{j != p} a_j (not 1 - weight, which
  // cancels when a_p is near 1).
  acc_t rest = acc_t(0);
  ATTNRES_HD void see(int64_t i, acc_t a) {
    if (a > weight) {
      if (weight >= acc_t(0)) rest += weight;
      weight = a;
      index = i;
    } else {
      rest += a;
    }
  }
  ATTNRES_HD bool pivoted() const { return weight > acc_t(0.5); }
  // The single-pass backward's <dh, h - v_p> = sum_{j != p} a_j (dp_j - dp_p)
  // is formed from the forward's rounded h: its error, ~ulp(h) against a
  // value ~(1 - a_p) |v|, grows as 1 / (1 - a_p). Above 1 - 1/16 the
  // single-pass backwards (CPU and CUDA) form it from the dp_j instead (one
  // more dot product per row, docs/design.md §8).
  ATTNRES_HD bool saturated() const { return weight > acc_t(1) - acc_t(1) / acc_t(16); }
};

// The sum of a token's weighted dp_j in the pivoted form: with p the pivot
// of the weights a_j = weight(j) (Pivot, in the weights' own type: the
// accumulation dtype) where one dominates, rel = sum_{j != p} a_j (dp_j -
// dp_p); elsewhere the plain sum and dp_p = 0. In sum_t: the accumulation
// dtype, or WideType for the rare tokens. The loops count in the caller's
// Index type (int in the CUDA warp code, where int64_t took stack space).
template <typename sum_t>
struct PivotedSum {
  sum_t dp_pivot, rel;
};
template <typename sum_t, typename Index, typename Weight, typename Dp>
ATTNRES_HD PivotedSum<sum_t> pivoted_sum(Index N, const Weight& weight, const Dp& dp) {
  Pivot<std::decay_t<decltype(weight(Index(0)))>> pivot;
  for (Index i = 0; i < N; ++i) pivot.see(i, weight(i));
  const Index piv = pivot.pivoted() ? static_cast<Index>(pivot.index) : Index(-1);
  const sum_t dp_piv = piv >= 0 ? dp(piv) : sum_t(0);
  sum_t rel = sum_t(0);
  for (Index j = 0; j < N; ++j) {
    if (j != piv) rel += static_cast<sum_t>(weight(j)) * (dp(j) - dp_piv);
  }
  return {dp_piv, rel};
}

// Elementwise source gradient (works on Vectorized too).
template <typename T>
ATTNRES_HD T source_grad(T a, T dh, T alpha, T u, T beta, T v) {
  return a * dh + alpha * u + beta * v;
}

// Whether source i's backward, evaluated in acc_t from the token's sums
// (dot_u = <u, v_i> or the score, dp = dp_i, sum_a_dp) and coefficients g,
// may be wrong: a sum or coefficient overflowed, or alpha = ds r or
// beta = -alpha r s / D underflowed (lost bits) although ds, r and s are
// not zero (rows near the dtype's limits: r^2 underflows). Such tokens are
// recomputed in WideType. A token whose weights are NaN (NaN or Inf in its
// sources) is poisoned and is not rare: its gradients are NaN either way.
template <typename acc_t>
ATTNRES_HD bool backward_row_is_rare(acc_t a, acc_t r, acc_t s, acc_t dp,
                                     acc_t sum_a_dp,
                                     const SourceGrad<acc_t>& g) {
  using C = RangeConstants<acc_t>;
  if (a != a) return false;
  const bool finite = abs_acc(s) <= C::kMax && abs_acc(dp) <= C::kMax &&
                      abs_acc(sum_a_dp) <= C::kMax &&
                      abs_acc(g.alpha) <= C::kMax && abs_acc(g.beta) <= C::kMax;
  if (!finite) return true;
  const bool ds_nonzero = dp != sum_a_dp && a != acc_t(0) && r != acc_t(0);
  return ds_nonzero && (abs_acc(g.alpha) < C::kTiny ||
                        (s != acc_t(0) && abs_acc(g.beta) < C::kTiny));
}

// ---- fused output norm (docs/design.md §11) -------------------------------
// The normed read returns y = (r h) * w, r = 1/sqrt(mean(h^2) + eps) of the
// read h (in the accumulation type, before h is rounded). Its rstd comes
// from sum(h^2) like a key row's: rstd_from_sumsq, or — when
// row_needs_rescale(sumsq, 0, eps) — from the sum of the scaled row c h,
// c = rescale_factor(sumsq):
template <typename acc_t>
ATTNRES_HD acc_t out_norm_rstd_rescaled(acc_t sumsq_c, acc_t c, int64_t D, acc_t eps) {
  acc_t r, unused;
  rescaled_stats(sumsq_c, acc_t(0), c, D, eps, r, unused);
  return r;
}

// Backward of one token from dy, with n = r h and g = dy * w:
//   dh = r (g - c n),  c = <g, n> / D;   dw += dy * n (summed over tokens).
// n is formed elementwise (r * h), so <g, n> stays in range where <g, h>
// would not (h near the dtype's limits). Elementwise (works on Vectorized).
template <typename T>
ATTNRES_HD T out_norm_grad(T r, T g, T c, T n) {
  return r * (g - c * n);
}

}  // namespace math
}  // namespace attnres
