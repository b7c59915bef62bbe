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
#pragma once

#include <cmath>
#include <cstdint>

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

  ATTNRES_HD void init(acc_t s) {
    m = s;
    l = acc_t(1);
  }

  // Adds score s. Returns through the out-arguments the factor for the
  // existing accumulator and the weight of the new value.
  ATTNRES_HD void push(acc_t s, acc_t& rescale, acc_t& p) {
    const acc_t m_new = nan_max(m, s);
    rescale = exp_acc(m - m_new);
    p = exp_acc(s - m_new);
    l = l * rescale + p;
    m = m_new;
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
  ATTNRES_HD acc_t inv_sum() const { return acc_t(1) / l; }
};

// Elementwise step of the online weighted sum (works on Vectorized too).
template <typename T>
ATTNRES_HD T online_accumulate(T acc, T rescale, T p, T v) {
  return acc * rescale + p * v;
}

// Backward coefficients of source i, given a_i, r_i, s_i, dp_i and
// sum_j a_j dp_j (computed in a first pass over the sources).
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

// Elementwise source gradient (works on Vectorized too).
template <typename T>
ATTNRES_HD T source_grad(T a, T dh, T alpha, T u, T beta, T v) {
  return a * dh + alpha * u + beta * v;
}

}  // namespace math
}  // namespace attnres
