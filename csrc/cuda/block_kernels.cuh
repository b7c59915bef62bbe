// Device side of the two-phase Block reads (docs/design.md §10): phase 1
// (block_reads_fwd_kernel: S readers over the N completed sources, read once
// from memory), phase 2 (block_read_merge_kernel: one reader's exact merge
// with the partial block sum), phase 2's backward (block_read_merge_bwd_kernel)
// and phase 1's (block_reads_bwd_kernel). The per-token formulas are those
// of attnres/depth_math.h and of the CPU kernels (cpu/block_reads_cpu.cpp),
// in the same order: sums of the raw row (the range rescue of rows near the
// dtype's limits by the same power-of-two factors, §8), per-reader online
// softmax, y_s = sum_i a_{s,i} v_i (kept finite in WideType on rescued
// tokens), and the fused output norm of the rounded h (§11).
//
// Layout (block_read_params.h): one warp a token, lane l owning the packs
// [(k*32 + l)*VEC, +VEC) of every row, so a lane re-reads only what it
// wrote itself (h before its norm) and needs no barrier for it. Rows the
// kernel writes are read back with plain loads (never the read-only path).
#pragma once

#include "block_read_params.h"
#include "kernels.cuh"

namespace attnres {
namespace cuda {

// A pack this kernel may have written (coherent load, not __ldg).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_written(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

// Sums of one row over the warp: sums[r] = <u_{s0+r}, c v> for the readers
// s0 + r < S (0 past S) and sums[R] = sum (c v)^2. c = 1 on the fast path,
// the rescue factor on a rescued row (exact: a power of two).
// `written`: v is a row this kernel wrote (the prefix add's P').
template <int R, typename scalar_t, int VEC, typename acc_t>
__device__ __forceinline__ void warp_row_sums(const scalar_t* v, const acc_t* u, int s0, int S,
                                              int D, acc_t c, acc_t (&sums)[R + 1],
                                              bool written = false) {
  const int lane = static_cast<int>(threadIdx.x & 31);
#pragma unroll
  for (int r = 0; r <= R; ++r) sums[r] = acc_t(0);
  for (int j = lane * VEC; j < D; j += 32 * VEC) {
    const Pack<scalar_t, VEC> x =
        written ? load_written<scalar_t, VEC>(v + j) : load_global<scalar_t, VEC>(v + j);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const acc_t xv = static_cast<acc_t>(x.x[e]) * c;
      sums[R] += xv * xv;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (s0 + r < S) sums[r] += u[static_cast<int64_t>(s0 + r) * D + j + e] * xv;
      }
    }
  }
  warp_allreduce<32>(sums, 32);
}

// Sum of squares over the warp of a row this warp wrote (h before its
// output norm), scaled by c.
template <typename scalar_t, int VEC, typename acc_t>
__device__ __forceinline__ acc_t warp_written_sumsq(const scalar_t* h, int D, acc_t c) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  acc_t sq[1] = {acc_t(0)};
  for (int j = lane * VEC; j < D; j += 32 * VEC) {
    const Pack<scalar_t, VEC> x = load_written<scalar_t, VEC>(h + j);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const acc_t hv = static_cast<acc_t>(x.x[e]) * c;
      sq[0] += hv * hv;
    }
  }
  warp_allreduce<32>(sq, 32);
  return sq[0];
}

// The fused output norm of one token (docs/design.md §11): h (rounded,
// written by this warp at `h`, its sum of squares `sumsq`) -> y = (r h) * w
// into `y` (which may be `h`); returns r. As cpu::row_normed_store.
template <typename scalar_t, int VEC, typename acc_t>
__device__ __forceinline__ acc_t warp_normed_store(scalar_t* y, const scalar_t* h, acc_t sumsq,
                                                   const acc_t* w, acc_t eps, int D) {
  acc_t r;
  if (!math::row_needs_rescale(sumsq, acc_t(0), eps)) {
    r = math::rstd_from_sumsq(sumsq, D, eps);
  } else {
    const acc_t c = math::rescale_factor(sumsq);
    r = math::out_norm_rstd_rescaled(warp_written_sumsq<scalar_t, VEC>(h, D, c), c, D, eps);
  }
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int j = lane * VEC; j < D; j += 32 * VEC) {
    const Pack<scalar_t, VEC> x = load_written<scalar_t, VEC>(h + j);
    Pack<scalar_t, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      o.x[e] = static_cast<scalar_t>((static_cast<acc_t>(x.x[e]) * r) * w[j + e]);
    }
    store_global<scalar_t, VEC>(y + j, o);
  }
  return r;
}

// Phase 1's weighted sums for readers s0 .. s0+R-1 of one token: y_s =
// sum_i a_{s,i} v_i, summed in sum_t (acc_t; WideType and kept finite on a
// rescued token, as cpu row_average_kept_finite). The rounded row of reader
// 0 goes to h0 (when s0 == 0) and its sum of squares is returned (for the
// output norm).
template <int R, bool kWide, typename scalar_t, int VEC>
__device__ __forceinline__ at::opmath_type<scalar_t> phase1_weighted_sums(
    const BlockReadsParams<scalar_t>& p, int64_t t, int s0, scalar_t* h0) {
  using acc_t = at::opmath_type<scalar_t>;
  using sum_t = std::conditional_t<kWide, typename math::WideType<acc_t>::type, acc_t>;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t T = p.T;
  acc_t sq0 = acc_t(0);
  for (int j = lane * VEC; j < p.D; j += 32 * VEC) {
    sum_t acc[R][VEC];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][e] = sum_t(0);
    }
    for (int i = 0; i < p.N; ++i) {
      const scalar_t* v = source_row<scalar_t>(p.table, p.overflow, i, t);
      const Pack<scalar_t, VEC> x = load_global<scalar_t, VEC>(v + j);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (s0 + r < p.S) {
          const sum_t w =
              static_cast<sum_t>(p.weights[(static_cast<int64_t>(s0 + r) * p.N + i) * T + t]);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            acc[r][e] += w * static_cast<sum_t>(static_cast<acc_t>(x.x[e]));
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int s = s0 + r;
      if (s >= p.S) continue;
      Pack<scalar_t, VEC> o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        acc_t value;
        if constexpr (kWide) {
          value = static_cast<acc_t>(math::keep_finite<acc_t>(acc[r][e]));
        } else {
          value = acc[r][e];
        }
        o.x[e] = static_cast<scalar_t>(value);
        if (s == 0) {
          const acc_t rounded = static_cast<acc_t>(o.x[e]);
          sq0 += rounded * rounded;
        }
      }
      scalar_t* dst = s == 0 && h0 ? h0 : p.out[s] + t * p.D;
      store_global<scalar_t, VEC>(dst + j, o);
    }
  }
  return sq0;
}

// The rescued tokens' sums (wide, kept finite): out of line, so that their
// registers do not join the common path's allocation (as kernels.cuh's rare
// paths).
template <int R, typename scalar_t, int VEC>
__device__ ATTNRES_NOINLINE at::opmath_type<scalar_t> phase1_weighted_sums_wide(
    const BlockReadsParams<scalar_t>& p, int64_t t, int s0, scalar_t* h0) {
  return phase1_weighted_sums<R, true, scalar_t, VEC>(p, t, s0, h0);
}

// Phase 1 (one launch: readers s of this launch's S, block_read_params.h).
// A row takes the rescue when its sums over this launch's readers need it
// (the CPU looks at all S readers at once: with more than kReadersPerLaunch
// readers a row whose <u, v> overflows for one reader only, i.e. a query
// out of range, can take it in one launch and not another; its rstd is the
// same either way).
template <typename scalar_t, int VEC, bool kNorm>
__global__ void __launch_bounds__(kBlockReadThreads)
    block_reads_fwd_kernel(const __grid_constant__ BlockReadsParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int R = kReadersPerSweep;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t T = p.T;
  const int N = p.N, S = p.S, D = p.D;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBlockReadWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kBlockReadWarps + (threadIdx.x >> 5);
       t < T; t += warps) {
    // Sweep 1: rstd_i and the raw <u_s, v_i> of every reader (lane 0 keeps
    // them in weights until they become scores, then weights).
    bool rescued = false;
    for (int i = 0; i < N; ++i) {
      const scalar_t* v = source_row<scalar_t>(p.table, p.overflow, i, t);
      acc_t sumsq = acc_t(0);
      bool need = false;
      for (int s0 = 0; s0 < S; s0 += R) {
        acc_t sums[R + 1];
        warp_row_sums<R, scalar_t, VEC>(v, p.u, s0, S, D, acc_t(1), sums);
        if (s0 == 0) {
          sumsq = sums[R];
          need = math::row_needs_rescale(sumsq, acc_t(0), p.eps);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (s0 + r >= S) continue;
          need = need || math::row_needs_rescale(sumsq, sums[r], p.eps);
          if (lane == 0) p.weights[(static_cast<int64_t>(s0 + r) * N + i) * T + t] = sums[r];
        }
      }
      acc_t r_i;
      if (!need) {
        r_i = math::rstd_from_sumsq(sumsq, D, p.eps);
        if (lane == 0) {
          for (int s = 0; s < S; ++s) {
            acc_t& w = p.weights[(static_cast<int64_t>(s) * N + i) * T + t];
            w = math::score(r_i, w);
          }
        }
      } else {
        // Rare: the sums again of the row scaled by a power of two (§8).
        rescued = true;
        const acc_t c = math::rescale_factor(sumsq);
        acc_t sumsq_c = acc_t(0);
        for (int s0 = 0; s0 < S; s0 += R) {
          acc_t sums[R + 1];
          warp_row_sums<R, scalar_t, VEC>(v, p.u, s0, S, D, c, sums);
          if (s0 == 0) sumsq_c = sums[R];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (s0 + r >= S) continue;
            acc_t score;
            math::rescaled_stats(sumsq_c, sums[r], c, D, p.eps, r_i, score);
            if (lane == 0) p.weights[(static_cast<int64_t>(s0 + r) * N + i) * T + t] = score;
          }
        }
      }
      if (lane == 0) p.rstd[static_cast<int64_t>(i) * T + t] = r_i;
    }
    __syncwarp();
    // Per reader (a lane each): the online softmax over its N scores, its
    // lse and weights (a NaN score poisons them all).
    for (int s = lane; s < S; s += 32) {
      acc_t* w = p.weights + static_cast<int64_t>(s) * N * T + t;
      math::OnlineSoftmax<acc_t> st;
      st.init(w[0]);
      acc_t keep, take;
      for (int i = 1; i < N; ++i) st.push(w[static_cast<int64_t>(i) * T], keep, take);
      p.lse[static_cast<int64_t>(s) * T + t] = st.log_sum_exp();
      const acc_t nan_if_poisoned = st.out_factor();
      for (int i = 0; i < N; ++i) {
        acc_t& wi = w[static_cast<int64_t>(i) * T];
        wi = st.weight(wi) * nan_if_poisoned;
      }
    }
    __syncwarp();
    // Sweep 2 (from L1/L2): the weighted sums, kReadersPerSweep readers a
    // sweep; reader 0's h goes to h_keep (or its own row) for the norm.
    scalar_t* h0 = nullptr;
    if constexpr (kNorm) h0 = p.h_keep ? p.h_keep + t * D : p.out[0] + t * D;
    acc_t sq0 = acc_t(0);
    for (int s0 = 0; s0 < S; s0 += R) {
      const acc_t sq = rescued ? phase1_weighted_sums_wide<R, scalar_t, VEC>(p, t, s0, h0)
                               : phase1_weighted_sums<R, false, scalar_t, VEC>(p, t, s0, h0);
      if (s0 == 0) sq0 = sq;
    }
    if constexpr (kNorm) {
      acc_t sq[1] = {sq0};
      warp_allreduce<32>(sq, 32);
      const acc_t r = warp_normed_store<scalar_t, VEC>(p.out[0] + t * D, h0, sq[0],
                                                       p.norm_weight, p.norm_eps, D);
      if (lane == 0) p.norm_rstd[t] = r;
    }
  }
}

// Phase 2: h = (keep y + take P) f with (keep, take) from init(lse) +
// push(score of P), as cpu merge_forward_impl; y = RMSNorm(h) w with kNorm.
template <typename scalar_t, int VEC, bool kNorm>
__global__ void __launch_bounds__(kBlockReadThreads)
    block_read_merge_kernel(const __grid_constant__ MergeParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  using wide_t = typename math::WideType<acc_t>::type;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int D = p.D;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBlockReadWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kBlockReadWarps + (threadIdx.x >> 5);
       t < p.T; t += warps) {
    const scalar_t* y = p.partial + t * p.partial_stride;
    const scalar_t* P = p.block_sum + t * p.block_stride;
    scalar_t* out = p.out + t * D;
    // The fused prefix add: P' = P + delta into sum_out (rounded as
    // torch.add), then read from there: each lane re-reads only its packs.
    const bool prefix = p.delta != nullptr;
    if (prefix) {
      const scalar_t* d = p.delta + t * p.delta_stride;
      scalar_t* sum = p.sum_out + t * D;
      for (int j = lane * VEC; j < D; j += 32 * VEC) {
        const Pack<scalar_t, VEC> a = load_global<scalar_t, VEC>(P + j);
        const Pack<scalar_t, VEC> b = load_global<scalar_t, VEC>(d + j);
        Pack<scalar_t, VEC> o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          o.x[e] = static_cast<scalar_t>(static_cast<acc_t>(a.x[e]) + static_cast<acc_t>(b.x[e]));
        }
        store_global<scalar_t, VEC>(sum + j, o);
      }
      P = sum;
    }
    acc_t sums[2];
    warp_row_sums<1, scalar_t, VEC>(P, p.u, 0, 1, D, acc_t(1), sums, prefix);
    const bool rescued = math::row_needs_rescale(sums[1], acc_t(0), p.eps) ||
                         math::row_needs_rescale(sums[1], sums[0], p.eps);
    acc_t r, s;
    if (!rescued) {
      r = math::rstd_from_sumsq(sums[1], D, p.eps);
      s = math::score(r, sums[0]);
    } else {
      const acc_t c = math::rescale_factor(sums[1]);
      warp_row_sums<1, scalar_t, VEC>(P, p.u, 0, 1, D, c, sums, prefix);
      math::rescaled_stats(sums[1], sums[0], c, D, p.eps, r, s);
    }
    math::OnlineSoftmax<acc_t> st;
    st.init(static_cast<acc_t>(p.lse[t]));
    acc_t keep, take;
    st.push(s, keep, take);
    const acc_t f = st.out_factor();
    if (lane == 0) {
      p.rstd[t] = r;
      p.weight[t] = take;
    }
    // h (rounded) goes to out, or to h_keep with the norm; y's pack is
    // read before the store that may overwrite it (in place).
    scalar_t* h_dst = kNorm && p.h_keep ? p.h_keep + t * D : out;
    acc_t sq[1] = {acc_t(0)};
    for (int j = lane * VEC; j < D; j += 32 * VEC) {
      const Pack<scalar_t, VEC> yv = load_written<scalar_t, VEC>(y + j);
      const Pack<scalar_t, VEC> pv =
          prefix ? load_written<scalar_t, VEC>(P + j) : load_global<scalar_t, VEC>(P + j);
      Pack<scalar_t, VEC> o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        acc_t h;
        if (!rescued) {
          h = math::online_accumulate(static_cast<acc_t>(yv.x[e]), keep, take,
                                      static_cast<acc_t>(pv.x[e]));
        } else {
          wide_t sum = wide_t(0);
          sum += static_cast<wide_t>(keep) * static_cast<wide_t>(static_cast<acc_t>(yv.x[e]));
          sum += static_cast<wide_t>(take) * static_cast<wide_t>(static_cast<acc_t>(pv.x[e]));
          h = static_cast<acc_t>(math::keep_finite<acc_t>(sum));
        }
        o.x[e] = static_cast<scalar_t>(h * f);
        if constexpr (kNorm) {
          const acc_t rounded = static_cast<acc_t>(o.x[e]);
          sq[0] += rounded * rounded;
        }
      }
      store_global<scalar_t, VEC>(h_dst + j, o);
    }
    if constexpr (kNorm) {
      warp_allreduce<32>(sq, 32);
      const acc_t nr =
          warp_normed_store<scalar_t, VEC>(out, h_dst, sq[0], p.norm_weight, p.norm_eps, D);
      if (lane == 0) p.norm_rstd[t] = nr;
    }
  }
}

// ---- phase 2's backward ------------------------------------------------------
// One token of block_read_merge_bwd_kernel (as cpu merge_token_grad): with h
// = keep y + a P (keep = 1 - a), a the block sum's weight, r its rstd,
// s = r <u, P>:
//   dy = keep dh,  ds = a keep <dh, P - y>,  dlse = -ds,
//   dP = a dh + alpha u + beta P  (alpha = ds r, beta = -alpha r s / D),
//   z += alpha P  (the query's gradient before its scale and gain).
// With the fused output norm dh = r_o (g - c n) of g = dy w, n = h r_o,
// c = <g, n> / D, formed per element from dy and the forward's h in every
// sweep, and dw += dy n.

// Whether the backward kernels recompute rare tokens in a wider type: not
// fp64, which has none on the device (as the one-call backward, docs/
// design.md §8). Decided by acc_t, not by WideType, which is long double in
// the emulation's host build: the emulation then runs the device's paths.
template <typename acc_t>
__host__ __device__ constexpr bool backward_has_rare_path() {
  return !std::is_same<acc_t, double>::value;
}

// dh at one element: grad_out's value, or the fused norm's dh from dy, h.
template <bool kNorm, typename acc_t>
__device__ __forceinline__ acc_t merge_dh(acc_t g, acc_t h, acc_t w, acc_t nr, acc_t nc) {
  if constexpr (kNorm) {
    return math::out_norm_grad(nr, g * w, nc, h * nr);
  } else {
    return g;
  }
}

// The writes of one token's sweep 2 at pack j: dy, dP, this warp's partial
// rows (z: alpha P; dw: dy n), the first token of the warp storing, the
// later ones adding.
template <typename scalar_t, int VEC, bool kNorm, typename coef_t>
__device__ __forceinline__ void merge_bwd_sweep(const MergeBackwardParams<scalar_t>& p,
                                                int64_t t, coef_t keep, coef_t ga,
                                                coef_t galpha, coef_t gbeta,
                                                at::opmath_type<scalar_t> nr,
                                                at::opmath_type<scalar_t> nc,
                                                at::opmath_type<scalar_t>* z_row,
                                                at::opmath_type<scalar_t>* dw_row, bool started) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int D = p.D;
  const scalar_t* g = p.grad_out + t * p.grad_stride;
  const scalar_t* P = p.block_sum + t * p.block_stride;
  const scalar_t* h = kNorm ? p.h + t * p.h_stride : nullptr;
  for (int j = lane * VEC; j < D; j += 32 * VEC) {
    const Pack<scalar_t, VEC> gv = load_global<scalar_t, VEC>(g + j);
    const Pack<scalar_t, VEC> pv = load_global<scalar_t, VEC>(P + j);
    Pack<scalar_t, VEC> hv{};
    if constexpr (kNorm) hv = load_global<scalar_t, VEC>(h + j);
    Pack<scalar_t, VEC> dy, dP;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const acc_t ge = static_cast<acc_t>(gv.x[e]);
      const acc_t he = kNorm ? static_cast<acc_t>(hv.x[e]) : acc_t(0);
      const acc_t w = kNorm ? p.norm_weight[j + e] : acc_t(0);
      const coef_t dh = static_cast<coef_t>(merge_dh<kNorm>(ge, he, w, nr, nc));
      const coef_t pe = static_cast<coef_t>(static_cast<acc_t>(pv.x[e]));
      dy.x[e] = static_cast<scalar_t>(static_cast<acc_t>(keep * dh));
      dP.x[e] = static_cast<scalar_t>(static_cast<acc_t>(
          math::source_grad(ga, dh, galpha, static_cast<coef_t>(p.u[j + e]), gbeta, pe)));
      if (z_row) {
        const acc_t zv = static_cast<acc_t>(galpha * pe);
        z_row[j + e] = started ? z_row[j + e] + zv : zv;
      }
      if constexpr (kNorm) {
        if (dw_row) {
          const acc_t dwv = ge * (he * nr);
          dw_row[j + e] = started ? dw_row[j + e] + dwv : dwv;
        }
      }
    }
    if (p.grad_partial) store_global<scalar_t, VEC>(p.grad_partial + t * D + j, dy);
    if (p.grad_sum) {
      // The prefix add: P''s own gradient joins dP (rounded as autograd's sum).
      const Pack<scalar_t, VEC> gs = load_global<scalar_t, VEC>(p.grad_sum + t * p.grad_sum_stride + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        dP.x[e] = static_cast<scalar_t>(static_cast<acc_t>(dP.x[e]) + static_cast<acc_t>(gs.x[e]));
      }
    }
    if (p.grad_block) store_global<scalar_t, VEC>(p.grad_block + t * D + j, dP);
  }
}

// Sweep 1 of a merge backward token, summed over the warp in sum_t (acc_t,
// or WideType on the rare tokens): <dh, P - y> (the elementwise difference
// first: nothing cancels beyond it) and <u, P>.
template <typename scalar_t, int VEC, bool kNorm, typename sum_t>
__device__ __forceinline__ void merge_bwd_dots(const MergeBackwardParams<scalar_t>& p, int64_t t,
                                               at::opmath_type<scalar_t> nr,
                                               at::opmath_type<scalar_t> nc, sum_t (&sums)[2]) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const scalar_t* g = p.grad_out + t * p.grad_stride;
  const scalar_t* y = p.partial + t * p.partial_stride;
  const scalar_t* P = p.block_sum + t * p.block_stride;
  const scalar_t* h = kNorm ? p.h + t * p.h_stride : nullptr;
  sums[0] = sums[1] = sum_t(0);
  for (int j = lane * VEC; j < p.D; j += 32 * VEC) {
    const Pack<scalar_t, VEC> gv = load_global<scalar_t, VEC>(g + j);
    const Pack<scalar_t, VEC> yv = load_global<scalar_t, VEC>(y + j);
    const Pack<scalar_t, VEC> pv = load_global<scalar_t, VEC>(P + j);
    Pack<scalar_t, VEC> hv{};
    if constexpr (kNorm) hv = load_global<scalar_t, VEC>(h + j);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const acc_t he = kNorm ? static_cast<acc_t>(hv.x[e]) : acc_t(0);
      const acc_t w = kNorm ? p.norm_weight[j + e] : acc_t(0);
      const sum_t dh =
          static_cast<sum_t>(merge_dh<kNorm>(static_cast<acc_t>(gv.x[e]), he, w, nr, nc));
      const sum_t pe = static_cast<sum_t>(static_cast<acc_t>(pv.x[e]));
      sums[0] += dh * (pe - static_cast<sum_t>(static_cast<acc_t>(yv.x[e])));
      sums[1] += static_cast<sum_t>(p.u[j + e]) * pe;
    }
  }
  warp_allreduce<32>(sums, 32);
}

// The rare tokens (math::backward_row_is_rare): the sums and coefficients
// again in WideType, as cpu merge_token_wide; out of line.
template <typename scalar_t, int VEC, bool kNorm>
__device__ ATTNRES_NOINLINE void merge_bwd_token_wide(const MergeBackwardParams<scalar_t>& p,
                                                      int64_t t, at::opmath_type<scalar_t> nr,
                                                      at::opmath_type<scalar_t> nc,
                                                      at::opmath_type<scalar_t>* z_row,
                                                      at::opmath_type<scalar_t>* dw_row, bool started) {
  using acc_t = at::opmath_type<scalar_t>;
  using W = typename math::WideType<acc_t>::type;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int D = p.D;
  W sums[2];
  merge_bwd_dots<scalar_t, VEC, kNorm>(p, t, nr, nc, sums);
  const W a = p.weight[t], r = p.rstd[t], keep = W(1) - a;
  const auto c = math::source_grad_coefficients<W>(a, r, math::score(r, sums[1]),
                                                   keep * sums[0], W(0), D);
  if (lane == 0 && p.grad_lse) p.grad_lse[t] = static_cast<double>(-(a * (keep * sums[0])));
  merge_bwd_sweep<scalar_t, VEC, kNorm, W>(p, t, keep, c.a, c.alpha, c.beta, nr, nc, z_row,
                                           dw_row, started);
}

// The fused output norm's c = <dy w, h r_o> / D of one token, a warp's
// lanes striding over D (every lane gets the sum). kDw (the reads backward):
// also dw_row += dy n, n = h r_o (a warp's first token writing the row);
// the merge backward adds its dw in its sweep instead.
template <typename scalar_t, int VEC, bool kDw>
__device__ __forceinline__ at::opmath_type<scalar_t> fused_norm_c(
    const scalar_t* g, const scalar_t* h, at::opmath_type<scalar_t> nr,
    const at::opmath_type<scalar_t>* norm_weight, int D, int lane,
    at::opmath_type<scalar_t>* dw_row, bool started) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t c[1] = {acc_t(0)};
  for (int j = lane * VEC; j < D; j += 32 * VEC) {
    const Pack<scalar_t, VEC> gv = load_global<scalar_t, VEC>(g + j);
    const Pack<scalar_t, VEC> hv = load_global<scalar_t, VEC>(h + j);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const acc_t ge = static_cast<acc_t>(gv.x[e]);
      const acc_t n = static_cast<acc_t>(hv.x[e]) * nr;
      c[0] += (ge * norm_weight[j + e]) * n;
      if constexpr (kDw) {
        if (dw_row) dw_row[j + e] = started ? dw_row[j + e] + ge * n : ge * n;
      }
    }
  }
  warp_allreduce<32>(c, 32);
  return c[0] / static_cast<acc_t>(D);
}

// Phase 2's backward: one warp a token (grid-stride), each warp summing its
// tokens' alpha P (and dy n) into its own partial row, so the rows' fixed-
// order sum gives the same bits every run.
template <typename scalar_t, int VEC, bool kNorm>
__global__ void __launch_bounds__(kBlockReadThreads)
    block_read_merge_bwd_kernel(const __grid_constant__ MergeBackwardParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kHasRarePath = backward_has_rare_path<acc_t>();
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int D = p.D;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kBlockReadWarps + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBlockReadWarps;
  acc_t* z_row = p.z_rows ? p.z_rows + warp * D : nullptr;
  acc_t* dw_row = kNorm && p.dw_rows ? p.dw_rows + warp * D : nullptr;
  bool started = false;
  for (int64_t t = warp; t < p.T; t += warps) {
    const scalar_t* g = p.grad_out + t * p.grad_stride;
    const scalar_t* h = kNorm ? p.h + t * p.h_stride : nullptr;
    // The fused norm's c = <dy w, h r_o> / D.
    acc_t nr = acc_t(0), nc = acc_t(0);
    if constexpr (kNorm) {
      nr = p.norm_rstd[t];
      nc = fused_norm_c<scalar_t, VEC, false>(g, h, nr, p.norm_weight, D, lane, nullptr, false);
    }
    acc_t sums[2];
    merge_bwd_dots<scalar_t, VEC, kNorm>(p, t, nr, nc, sums);
    const acc_t a = p.weight[t], r = p.rstd[t];
    const acc_t s = math::score(r, sums[1]), dp_rel = (acc_t(1) - a) * sums[0];
    const auto c = math::source_grad_coefficients(a, r, s, dp_rel, acc_t(0), D);
    if (kHasRarePath && math::backward_row_is_rare(a, r, s, dp_rel, acc_t(0), c)) {
      merge_bwd_token_wide<scalar_t, VEC, kNorm>(p, t, nr, nc, z_row, dw_row, started);
    } else {
      if (lane == 0 && p.grad_lse) p.grad_lse[t] = static_cast<double>(-(a * dp_rel));
      merge_bwd_sweep<scalar_t, VEC, kNorm, acc_t>(p, t, acc_t(1) - a, c.a, c.alpha, c.beta, nr,
                                                   nc, z_row, dw_row, started);
    }
    started = true;
  }
  if (!started) {  // a warp past the last token: its rows are zero
    for (int d = lane; d < D; d += 32) {
      if (z_row) z_row[d] = acc_t(0);
      if (dw_row) dw_row[d] = acc_t(0);
    }
  }
}

// ---- phase 1's backward -------------------------------------------------------
// One warp a token (as cpu block_reads_backward_impl): for the S readers at
// once, with dh_s = dy_s (reader 0's from dy_0 and h_0 with the fused norm),
//   dp_{s,i} = <dh_s, v_i>, ds_{s,i} = a_{s,i} (dp_{s,i} - sum_j a_{s,j} dp_{s,j}
//   + dlse_s) (pivoted, depth_math.h), alpha = ds r_i, beta = -alpha r_i s / D,
//   dv_i = sum_s (a_{s,i} dh_s + alpha_{s,i} u_s) + (sum_s beta_{s,i}) v_i,
//   z_s += sum_i alpha_{s,i} v_i,
// each source's gradient written once. Sweep 1 reads each row once from
// memory for its 2 x kReadersPerSweep dots a sweep; lane s then forms reader
// s's coefficients, lane i the sum of the readers' betas; sweep 2 reads the
// rows again (L1/L2).

// Reader s's dh at pack j of token t: dy_s, or reader 0's dh_0 = r_o (g w -
// c n) of the fused norm (nr = r_o, nc = c).
template <typename scalar_t, int VEC>
__device__ __forceinline__ void reader_grad(const BlockReadsBackwardParams<scalar_t>& p, int s,
                                            int64_t t, int j, at::opmath_type<scalar_t> nr,
                                            at::opmath_type<scalar_t> nc,
                                            at::opmath_type<scalar_t> (&out)[VEC]) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* g = source_row<scalar_t>(p.dy_table, p.dy_overflow, s, t);
  const Pack<scalar_t, VEC> gv = load_global<scalar_t, VEC>(g + j);
  if (s == 0 && p.h) {
    const Pack<scalar_t, VEC> hv = load_global<scalar_t, VEC>(p.h + t * p.h_stride + j);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      out[e] = math::out_norm_grad(nr, static_cast<acc_t>(gv.x[e]) * p.norm_weight[j + e], nc,
                                   static_cast<acc_t>(hv.x[e]) * nr);
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = static_cast<acc_t>(gv.x[e]);
  }
}

// Sweep 1 of one token in sum_t (acc_t, or double on the rare tokens):
// dot[s * N + i] = <dh_s, v_i> (0 without dy) and coef[s * N + i] = the
// score r_i <u_s, v_i>, written by lane 0 into the warp's scratch.
template <typename scalar_t, int VEC, typename sum_t>
__device__ __forceinline__ void reads_bwd_dots(const BlockReadsBackwardParams<scalar_t>& p,
                                               int64_t t, at::opmath_type<scalar_t> nr,
                                               at::opmath_type<scalar_t> nc, sum_t* dot,
                                               sum_t* coef) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int R = kReadersPerSweep;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t T = p.T;
  const int N = p.N, S = p.S, D = p.D;
  for (int i = 0; i < N; ++i) {
    const scalar_t* v = source_row<scalar_t>(p.table, p.overflow, i, t);
    const sum_t r_i = static_cast<sum_t>(p.rstd[static_cast<int64_t>(i) * T + t]);
    for (int s0 = 0; s0 < S; s0 += R) {
      sum_t sums[2 * R];  // <dh_{s0+r}, v> at r, <u_{s0+r}, v> at R + r
#pragma unroll
      for (int r = 0; r < 2 * R; ++r) sums[r] = sum_t(0);
      for (int j = lane * VEC; j < D; j += 32 * VEC) {
        const Pack<scalar_t, VEC> x = load_global<scalar_t, VEC>(v + j);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int s = s0 + r;
          if (s >= S) continue;
          acc_t gd[VEC];
          if (p.has_dy) reader_grad<scalar_t, VEC>(p, s, t, j, nr, nc, gd);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const sum_t xv = static_cast<sum_t>(static_cast<acc_t>(x.x[e]));
            if (p.has_dy) sums[r] += static_cast<sum_t>(gd[e]) * xv;
            sums[R + r] += static_cast<sum_t>(p.u[static_cast<int64_t>(s) * D + j + e]) * xv;
          }
        }
      }
      warp_allreduce<32>(sums, 32);
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int s = s0 + r;
          if (s >= S) continue;
          const int64_t at_si = static_cast<int64_t>(s) * N + i;
          dot[at_si] = p.has_dy ? sums[r] : sum_t(0);
          coef[at_si] = math::score(r_i, sums[R + r]);
        }
      }
    }
  }
  __syncwarp();
}

// The coefficients of one token in sum_t: lane s for reader s turns dot
// into beta_{s,i} and coef into alpha_{s,i}; then lane i sums the readers'
// betas into beta[i] (reader order, as the CPU). Returns whether a sum or
// coefficient left acc_t's range (math::backward_row_is_rare; the same on
// every lane). The caller orders the lanes' writes with __syncwarp before
// reading them (a vote does not order memory).
template <typename scalar_t, typename sum_t>
__device__ __forceinline__ bool reads_bwd_coefficients(const BlockReadsBackwardParams<scalar_t>& p,
                                                       int64_t t, sum_t* dot, sum_t* coef,
                                                       sum_t* beta) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t T = p.T;
  const int N = p.N, S = p.S, D = p.D;
  bool rare = false;
  for (int s = lane; s < S; s += 32) {
    const acc_t* w = p.weights + static_cast<int64_t>(s) * N * T + t;  // w[i * T]: a_{s,i}
    const int64_t row = static_cast<int64_t>(s) * N;                   // reader s in the scratch
    auto [dp_piv, sum_rel] = math::pivoted_sum<sum_t>(  // on the acc_t weights, as the CPU
        N, [&](int64_t i) { return w[i * T]; }, [&](int64_t j) { return dot[row + j]; });
    if (p.grad_lse) sum_rel -= static_cast<sum_t>(p.grad_lse[static_cast<int64_t>(s) * T + t]);
    for (int i = 0; i < N; ++i) {
      const int64_t at_si = row + i;
      const sum_t a = static_cast<sum_t>(w[static_cast<int64_t>(i) * T]);
      const sum_t r = static_cast<sum_t>(p.rstd[static_cast<int64_t>(i) * T + t]);
      const sum_t su = coef[at_si], dp_rel = dot[at_si] - dp_piv;
      const auto g = math::source_grad_coefficients<sum_t>(a, r, su, dp_rel, sum_rel, D);
      if constexpr (std::is_same<sum_t, acc_t>::value) {
        rare = rare || math::backward_row_is_rare(a, r, su, dp_rel, sum_rel, g);
      }
      coef[at_si] = g.alpha;
      dot[at_si] = g.beta;
    }
  }
  __syncwarp();
  for (int i = lane; i < N; i += 32) {
    sum_t b = sum_t(0);
    for (int s = 0; s < S; ++s) b += dot[static_cast<int64_t>(s) * N + i];
    beta[i] = b;
    if constexpr (std::is_same<sum_t, acc_t>::value) {
      // The readers' betas summed past the range (each one in it).
      rare = rare || math::abs_acc(b) > math::RangeConstants<acc_t>::kMax;
    }
  }
  return __any_sync(0xffffffffu, rare);
}

// Sweep 2 of one token in sum_t: dv_i (written once, rounded to acc_t then
// scalar_t) and the warp's z rows (z_first: the warp's first token stores).
template <typename scalar_t, int VEC, typename sum_t>
__device__ __forceinline__ void reads_bwd_sweep(const BlockReadsBackwardParams<scalar_t>& p,
                                                int64_t t, at::opmath_type<scalar_t> nr,
                                                at::opmath_type<scalar_t> nc, const sum_t* coef,
                                                const sum_t* beta,
                                                at::opmath_type<scalar_t>* z_rows, bool started) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t T = p.T;
  const int N = p.N, S = p.S, D = p.D;
  for (int i = 0; i < N; ++i) {
    scalar_t* dv = grad_row<scalar_t>(p.table, p.overflow, i, t, D);
    if (!dv && !z_rows) continue;
    const scalar_t* v = source_row<scalar_t>(p.table, p.overflow, i, t);
    const sum_t B = beta[i];
    const bool z_first = !started && i == 0;
    for (int j = lane * VEC; j < D; j += 32 * VEC) {
      const Pack<scalar_t, VEC> x = load_global<scalar_t, VEC>(v + j);
      sum_t g[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) g[e] = B * static_cast<sum_t>(static_cast<acc_t>(x.x[e]));
      for (int s = 0; s < S; ++s) {
        const sum_t a = static_cast<sum_t>(p.weights[(static_cast<int64_t>(s) * N + i) * T + t]);
        const sum_t alpha = coef[static_cast<int64_t>(s) * N + i];
        if (p.has_dy) {
          acc_t gd[VEC];
          reader_grad<scalar_t, VEC>(p, s, t, j, nr, nc, gd);
#pragma unroll
          for (int e = 0; e < VEC; ++e) g[e] += a * static_cast<sum_t>(gd[e]);
        }
        const acc_t* u = p.u + static_cast<int64_t>(s) * D + j;
#pragma unroll
        for (int e = 0; e < VEC; ++e) g[e] += alpha * static_cast<sum_t>(u[e]);
        if (z_rows) {
          acc_t* z = z_rows + static_cast<int64_t>(s) * D + j;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const acc_t zv =
                static_cast<acc_t>(alpha * static_cast<sum_t>(static_cast<acc_t>(x.x[e])));
            z[e] = z_first ? zv : z[e] + zv;
          }
        }
      }
      if (dv) {
        Pack<scalar_t, VEC> o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.x[e] = static_cast<scalar_t>(static_cast<acc_t>(g[e]));
        store_global<scalar_t, VEC>(dv + j, o);
      }
    }
  }
}

// The rare tokens: sweeps and coefficients again in double (float
// accumulation only), in the warp's wide scratch; out of line.
template <typename scalar_t, int VEC>
__device__ ATTNRES_NOINLINE void reads_bwd_token_wide(const BlockReadsBackwardParams<scalar_t>& p,
                                                      int64_t t, int64_t warp,
                                                      at::opmath_type<scalar_t> nr,
                                                      at::opmath_type<scalar_t> nc,
                                                      at::opmath_type<scalar_t>* z_rows,
                                                      bool started) {
  const int64_t SN = static_cast<int64_t>(p.S) * p.N;
  double* dot = p.wide_dot + warp * SN;
  double* coef = p.wide_coef + warp * SN;
  double* beta = p.wide_beta + warp * p.N;
  reads_bwd_dots<scalar_t, VEC, double>(p, t, nr, nc, dot, coef);
  reads_bwd_coefficients<scalar_t, double>(p, t, dot, coef, beta);
  __syncwarp();
  reads_bwd_sweep<scalar_t, VEC, double>(p, t, nr, nc, coef, beta, z_rows, started);
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kBlockReadThreads)
    block_reads_bwd_kernel(const __grid_constant__ BlockReadsBackwardParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kHasRarePath = backward_has_rare_path<acc_t>();
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int D = p.D;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kBlockReadWarps + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBlockReadWarps;
  const int64_t SD = static_cast<int64_t>(p.S) * D, SN = static_cast<int64_t>(p.S) * p.N;
  acc_t* z_rows = p.z_rows ? p.z_rows + warp * SD : nullptr;
  acc_t* dw_row = p.dw_rows ? p.dw_rows + warp * D : nullptr;
  // This warp's scratch: its tokens take turns (one token at a time).
  acc_t* dot = p.dot_scratch + warp * SN;
  acc_t* coef = p.coef_scratch + warp * SN;
  acc_t* beta = p.beta + warp * p.N;
  bool started = false;
  for (int64_t t = warp; t < p.T; t += warps) {
    // Reader 0's fused norm: c = <dy_0 w, h_0 r_o> / D, and dw += dy_0 n.
    acc_t nr = acc_t(0), nc = acc_t(0);
    if (p.h && p.has_dy) {
      nr = p.norm_rstd[t];
      nc = fused_norm_c<scalar_t, VEC, true>(source_row<scalar_t>(p.dy_table, p.dy_overflow, 0, t),
                                             p.h + t * p.h_stride, nr, p.norm_weight, D, lane,
                                             dw_row, started);
    }
    reads_bwd_dots<scalar_t, VEC, acc_t>(p, t, nr, nc, dot, coef);
    const bool rare = reads_bwd_coefficients<scalar_t, acc_t>(p, t, dot, coef, beta);
    __syncwarp();  // the coefficients and betas of every lane, for all
    if (kHasRarePath && rare) {
      if constexpr (kHasRarePath) {
        reads_bwd_token_wide<scalar_t, VEC>(p, t, warp, nr, nc, z_rows, started);
      }
    } else {
      reads_bwd_sweep<scalar_t, VEC, acc_t>(p, t, nr, nc, coef, beta, z_rows, started);
    }
    __syncwarp();  // every lane done with this token's scratch before the next's
    started = true;
  }
  if (!started) {  // a warp past the last token: its rows are zero
    for (int64_t d = lane; d < SD; d += 32) {
      if (z_rows) z_rows[d] = acc_t(0);
    }
    for (int d = lane; d < D; d += 32) {
      if (dw_row) dw_row[d] = acc_t(0);
    }
  }
}

}  // namespace cuda
}  // namespace attnres
