// The few-token forward (plan_few_tokens; docs/design.md §7): token t's row
// split across p.few_splits CTAs, CTA t * few_splits + s owning columns
// [s * few_slice, +few_slice). The partials kernel sums <v, v> and <u, v> of
// each source over its slice; the finish kernel's CTAs each sum those in
// slice order (all derive the same rstd, scores and weights) and write their
// slice of h; the norm kernel (§11) writes y. Sums pass through global
// memory: no cross-CTA waits, no atomics.
#pragma once

#include "kernels.cuh"
#include "plan.h"

namespace attnres {
namespace cuda {

// Rows whose loads a thread issues together (a decode read of K3's N = 10 is
// one round trip); the partials kernel reduces their 32 sums at once.
constexpr int kFewTokensRows = 16;
constexpr int kFewTokensWarps = kFewTokensMaxThreads / 32;

// The calling CTA's token t, slice s and columns [begin, end).
struct FewTokensSlice {
  int64_t t;
  int s;
  int begin;
  int end;
  template <typename Params>
  __device__ __forceinline__ explicit FewTokensSlice(const Params& p)
      : t(blockIdx.x / p.few_splits), s(static_cast<int>(blockIdx.x % p.few_splits)) {
    begin = s * p.few_slice;
    end = begin + p.few_slice < p.D ? begin + p.few_slice : p.D;
  }
};

// One step of a halving butterfly: lanes kOffset apart swap halves of
// v[0, 2 kOffset), each keeping the sum of the half its lane bit selects.
template <int kOffset, typename acc_t, int NV>
__device__ __forceinline__ void halving_step(acc_t (&v)[NV], int lane) {
  const bool upper = (lane & kOffset) != 0;
#pragma unroll
  for (int j = 0; j < kOffset; ++j) {
    const acc_t keep = upper ? v[j + kOffset] : v[j];
    const acc_t send = upper ? v[j] : v[j + kOffset];
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, kOffset);
  }
}

// Sums each of NV per-thread values over the CTA (whole warps) in a fixed
// order: within each warp a butterfly (for NV = 32 one that halves the
// values at each step, 31 shuffles: lane l keeps sum l), then the warps in
// order; thread j < count writes sum j to out[j * stride]. buf:
// kFewTokensWarps * NV values of shared memory, its use bracketed by the
// barriers.
template <int NV, typename acc_t>
__device__ __forceinline__ void cta_sum(acc_t (&v)[NV], acc_t* buf, acc_t* out, int64_t stride,
                                        int count) {
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  if constexpr (NV == 32) {
    halving_step<16>(v, lane);
    halving_step<8>(v, lane);
    halving_step<4>(v, lane);
    halving_step<2>(v, lane);
    halving_step<1>(v, lane);
    buf[warp * NV + lane] = v[0];
  } else {
    warp_allreduce<32>(v, 32);
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) buf[warp * NV + j] = v[j];
    }
  }
  __syncthreads();
  const int j = static_cast<int>(threadIdx.x);
  if (j < count) {
    acc_t sum = buf[j];
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) sum += buf[w * NV + j];
    out[j * stride] = sum;
  }
  __syncthreads();
}

// Pack c of source i of token t as the read sees it: with the prefix add the
// last source is P', formed from P and delta (kFormPrefix: the partials
// kernel) or read back from its store (the later kernels).
template <bool kFormPrefix, typename scalar_t, int VEC>
__device__ __forceinline__ Pack<scalar_t, VEC> few_tokens_pack(const ForwardParams<scalar_t>& p,
                                                               int i, int64_t t, int c) {
  if (!kFormPrefix && p.prefix_delta != nullptr && i == p.N - 1) {
    return load_global<scalar_t, VEC>(p.prefix_sum + t * static_cast<int64_t>(p.D) + c);
  }
  return forward_source_pack<scalar_t, VEC>(p, i, t, c);
}

// Packs c of rows i0 .. i0 + kFewTokensRows - 1 (zeros past N), loads issued
// together.
template <bool kFormPrefix, typename scalar_t, int VEC>
__device__ __forceinline__ void few_tokens_rows(const ForwardParams<scalar_t>& p, int i0,
                                                int64_t t, int c,
                                                Pack<scalar_t, VEC> (&rows)[kFewTokensRows]) {
#pragma unroll
  for (int j = 0; j < kFewTokensRows; ++j) {
    rows[j] = i0 + j < p.N ? few_tokens_pack<kFormPrefix, scalar_t, VEC>(p, i0 + j, t, c)
                           : zero_pack<scalar_t, VEC>();
  }
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kFewTokensMaxThreads, kKernelMinCtas)
    few_tokens_partials_kernel(const __grid_constant__ ForwardParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int R = kFewTokensRows;
  __shared__ __align__(16) acc_t buf[kFewTokensWarps * 2 * R];
  const FewTokensSlice slice(p);
  const int step = static_cast<int>(blockDim.x) * VEC;
  for (int i0 = 0; i0 < p.N; i0 += R) {
    acc_t sums[2 * R];
#pragma unroll
    for (int j = 0; j < 2 * R; ++j) sums[j] = acc_t(0);
    for (int c = slice.begin + static_cast<int>(threadIdx.x) * VEC; c < slice.end; c += step) {
      Pack<scalar_t, VEC> rows[R];
      few_tokens_rows<true>(p, i0, slice.t, c, rows);
      const Pack<acc_t, VEC> uk = load_global<acc_t, VEC>(p.u + c);
#pragma unroll
      for (int j = 0; j < R; ++j) {
        if (p.prefix_delta != nullptr && i0 + j == p.N - 1) {
          store_global<scalar_t, VEC>(p.prefix_sum + slice.t * static_cast<int64_t>(p.D) + c,
                                      rows[j]);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const acc_t v = static_cast<acc_t>(rows[j].x[e]);
          sums[2 * j] += v * v;
          sums[2 * j + 1] += uk.x[e] * v;
        }
      }
    }
    // Row i's sum k of slice s at ((t N + i) 2 + k) S + s.
    const int64_t first = (slice.t * p.N + i0) * 2 * p.few_splits + slice.s;
    const int rows_here = p.N - i0 < R ? p.N - i0 : R;
    cta_sum(sums, buf, p.few_partial + first, p.few_splits, 2 * rows_here);
  }
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kFewTokensMaxThreads, kKernelMinCtas)
    few_tokens_finish_kernel(const __grid_constant__ ForwardParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  using C = math::RangeConstants<acc_t>;
  constexpr int R = kFewTokensRows;
  __shared__ __align__(16) acc_t buf[kFewTokensWarps * 3];
  __shared__ acc_t rescued[2];
  ATTNRES_DYNAMIC_SMEM(dynamic_smem);
  acc_t* scores = reinterpret_cast<acc_t*>(dynamic_smem);
  acc_t* weights = scores + p.N;
  const FewTokensSlice slice(p);
  const int64_t t = slice.t, T = p.T;
  const int S = p.few_splits;
  const bool writes_stats = slice.s == 0;
  // Sum k of source i over the slices, in slice order.
  auto row_sum = [&](int i, int k) {
    const acc_t* part = p.few_partial + ((t * p.N + i) * 2 + k) * S;
    acc_t sum = part[0];
    for (int s = 1; s < S; ++s) sum += part[s];
    return sum;
  };
  bool rescue = false;
  for (int i = static_cast<int>(threadIdx.x); i < p.N; i += static_cast<int>(blockDim.x)) {
    const acc_t ss = row_sum(i, 0), uv = row_sum(i, 1);
    const acc_t r = math::rstd_from_sumsq(ss, p.D, p.eps);
    scores[i] = math::score(r, uv);
    rescue = rescue || math::row_needs_rescale(ss, uv, p.eps);
    if (writes_stats) p.rstd[i * T + t] = r;
  }
  // Rare (§8): a row whose sums are out of range is summed again by the CTA
  // over all its columns (from L2), scaled by a power of two.
  if (__syncthreads_or(rescue ? 1 : 0) != 0) {
    for (int i = 0; i < p.N; ++i) {
      const acc_t ss = row_sum(i, 0), uv = row_sum(i, 1);
      if (!math::row_needs_rescale(ss, uv, p.eps)) continue;
      const acc_t scale = math::rescale_factor(ss);
      acc_t sums[2] = {acc_t(0), acc_t(0)};
      for (int c = static_cast<int>(threadIdx.x) * VEC; c < p.D;
           c += static_cast<int>(blockDim.x) * VEC) {
        const Pack<scalar_t, VEC> v = few_tokens_pack<false, scalar_t, VEC>(p, i, t, c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const acc_t x = static_cast<acc_t>(v.x[e]) * scale;
          sums[0] += x * x;
          sums[1] += p.u[c + e] * x;
        }
      }
      cta_sum(sums, buf, rescued, 1, 2);
      if (threadIdx.x == 0) {
        acc_t r, sc;
        math::rescaled_stats(rescued[0], rescued[1], scale, static_cast<int64_t>(p.D), p.eps, r,
                             sc);
        scores[i] = sc;
        if (writes_stats) p.rstd[i * T + t] = r;
      }
    }
  }
  __syncthreads();
  math::OnlineSoftmax<acc_t> sm;
  sm.init(scores[0]);
  for (int i = 1; i < p.N; ++i) {
    acc_t keep, take;
    sm.push(scores[i], keep, take);
  }
  for (int i = static_cast<int>(threadIdx.x); i < p.N; i += static_cast<int>(blockDim.x)) {
    weights[i] = sm.weight(scores[i]);
    if (writes_stats) p.weights[i * T + t] = weights[i];
  }
  __syncthreads();
  // h = sum_i a_i v_i from the final weights, kept finite (the weights sum to
  // 1 only up to rounding, §8); with the norm, the slice's sum of the rounded
  // h^2, plain and scaled by the range factors, for the norm kernel.
  acc_t hh[3] = {acc_t(0), acc_t(0), acc_t(0)};
  scalar_t* out_row = p.out + t * static_cast<int64_t>(p.D);
  for (int c = slice.begin + static_cast<int>(threadIdx.x) * VEC; c < slice.end;
       c += static_cast<int>(blockDim.x) * VEC) {
    acc_t h[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) h[e] = acc_t(0);
    for (int i0 = 0; i0 < p.N; i0 += R) {
      Pack<scalar_t, VEC> rows[R];
      few_tokens_rows<false>(p, i0, t, c, rows);
#pragma unroll
      for (int j = 0; j < R; ++j) {
        if (i0 + j < p.N) {
          const acc_t w = weights[i0 + j];
#pragma unroll
          for (int e = 0; e < VEC; ++e) h[e] += w * static_cast<acc_t>(rows[j].x[e]);
        }
      }
    }
    Pack<scalar_t, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.x[e] = static_cast<scalar_t>(math::keep_finite<acc_t>(h[e]));
    store_global<scalar_t, VEC>(out_row + c, o);
    if (p.norm_weight != nullptr) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const acc_t x = static_cast<acc_t>(o.x[e]);
        const acc_t big = x * C::kBigScale, small = x * C::kSmallScale;
        hh[0] += x * x;
        hh[1] += big * big;
        hh[2] += small * small;
      }
    }
  }
  if (p.norm_weight != nullptr) {
    cta_sum(hh, buf, p.few_partial + (T * p.N * 2 + t * 3) * S + slice.s, S, 3);
  }
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kFewTokensMaxThreads, kKernelMinCtas)
    few_tokens_norm_kernel(const __grid_constant__ ForwardParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  using C = math::RangeConstants<acc_t>;
  const FewTokensSlice slice(p);
  const int S = p.few_splits;
  const acc_t* part = p.few_partial + (p.T * p.N * 2 + slice.t * 3) * S;
  auto total = [&](int k) {
    acc_t sum = part[k * S];
    for (int s = 1; s < S; ++s) sum += part[k * S + s];
    return sum;
  };
  const acc_t ss = total(0);
  acc_t r = math::rstd_from_sumsq(ss, p.D, p.norm_eps);
  if (math::row_needs_rescale(ss, acc_t(0), p.norm_eps)) {
    const acc_t scale = math::rescale_factor(ss);
    r = math::out_norm_rstd_rescaled(total(scale == C::kBigScale ? 1 : 2), scale,
                                     static_cast<int64_t>(p.D), p.norm_eps);
  }
  if (slice.s == 0 && threadIdx.x == 0) p.norm_rstd[slice.t] = r;
  const scalar_t* h_row = p.out + slice.t * static_cast<int64_t>(p.D);
  for (int c = slice.begin + static_cast<int>(threadIdx.x) * VEC; c < slice.end;
       c += static_cast<int>(blockDim.x) * VEC) {
    // A plain load: this kernel overwrites h with y (not a read-only load).
    const Pack<scalar_t, VEC> hv = *reinterpret_cast<const Pack<scalar_t, VEC>*>(h_row + c);
    acc_t h[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) h[e] = static_cast<acc_t>(hv.x[e]);
    forward_store_normed_pack<scalar_t, VEC>(p, slice.t, p.D, c, h, r);
  }
}

}  // namespace cuda
}  // namespace attnres
