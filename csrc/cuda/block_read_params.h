// Parameter blocks and launch shape of the two-phase Block read kernels
// (block_kernels.cuh; docs/design.md §10). Plain host C++, like
// kernel_params.h: the CUDA host code (block_reads_cuda.cu) and the CPU
// emulation (tests/cuda_emulation/emulate_block_kernels.cpp) both use it.
//
// One warp reads one token (grid-stride over tokens), each lane a strided
// share of the row in packs of VEC elements; the sums of a row are warp
// shuffles. Nothing is staged: a row's second sweep comes from L1/L2.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernel_params.h"  // SourceTableLayout
#include "launch.h"
#include "plan.h"

namespace attnres {
namespace cuda {

constexpr int kBlockReadWarps = 4;  // tokens a CTA of 128 threads
constexpr int kBlockReadThreads = 32 * kBlockReadWarps;
// Readers whose sums one sweep of a row keeps in registers (phase 1 sweeps
// a row ceil(S / kReadersPerSweep) times; the later sweeps hit L1/L2).
constexpr int kReadersPerSweep = 4;
// Readers one phase-1 launch writes (their output pointers travel in the
// parameters); more readers take more launches, each re-reading the sources.
constexpr int kReadersPerLaunch = 16;

// Phase 1 for readers [s_begin, s_begin + S) of the block's S_total.
template <typename scalar_t>
struct BlockReadsParams {
  using acc_t = at::opmath_type<scalar_t>;
  SourceTable table;
  const SourceEntry* overflow;    // sources kTableCapacity.. (device memory)
  const acc_t* u;                 // [S, D]: this launch's readers' rows
  scalar_t* out[kReadersPerLaunch];  // [T, D] contiguous each
  double* lse;                    // [S, T] (this launch's rows); float64 for every dtype
  acc_t* rstd;                    // [N, T]
  acc_t* weights;                 // [S, N, T]: scores first, then weights
  // Reader 0's fused output norm (docs/design.md §11), in the launch that
  // holds reader 0: out[0] gets y_0 and h_keep (when set) h_0.
  const acc_t* norm_weight;  // [D], or null: no output norm
  acc_t* norm_rstd;          // [T]
  scalar_t* h_keep;          // [T, D], or null
  int64_t T;
  int N, S, D;
  acc_t eps, norm_eps;
};

// Phase 2: one reader's merge of its phase-1 state with the block sum.
template <typename scalar_t>
struct MergeParams {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* partial;  // rows partial_stride apart
  const scalar_t* block_sum;
  int64_t partial_stride, block_stride;
  const double* lse;  // [T] (float64 for every dtype)
  const acc_t* u;    // [D]
  scalar_t* out;     // [T, D] contiguous; may be partial itself (in place)
  acc_t* rstd;       // [T]
  acc_t* weight;     // [T]: the block sum's weight
  const acc_t* norm_weight;  // [D], or null: no output norm
  acc_t* norm_rstd;          // [T]
  scalar_t* h_keep;          // [T, D], or null
  // The fused prefix add (docs/design.md §12): block_sum holds P, the read
  // takes P' = P + delta, written to sum_out [T, D] first. Null: none.
  const scalar_t* delta;  // rows delta_stride apart
  int64_t delta_stride;
  scalar_t* sum_out;
  int64_t T;
  int D;
  acc_t eps, norm_eps;
};

// Phase 2's backward (one reader): dy, dlse and dP per token, and the
// query's (and the fused norm's weight's) gradient as one partial row per
// warp, summed in a fixed order afterwards (sum_partial_rows_kernel).
template <typename scalar_t>
struct MergeBackwardParams {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* grad_out;  // dh, or dy of the fused norm; rows grad_stride apart
  const scalar_t* partial;
  const scalar_t* block_sum;
  const scalar_t* h;  // the forward's h (the fused norm only)
  int64_t grad_stride, partial_stride, block_stride, h_stride;
  const acc_t* u;       // [D]
  const acc_t* rstd;    // [T]: the block sum's rstd
  const acc_t* weight;  // [T]: the block sum's weight
  const acc_t* norm_weight;  // [D] (the fused norm only)
  const acc_t* norm_rstd;    // [T]
  scalar_t* grad_partial;  // [T, D] contiguous, or null
  double* grad_lse;        // [T], or null (float64: may exceed acc_t's range)
  scalar_t* grad_block;    // [T, D] contiguous, or null
  acc_t* z_rows;           // [warps, D]: sum over a warp's tokens of alpha P, or null
  acc_t* dw_rows;          // [warps, D]: sum of dy n (the fused norm), or null
  // The prefix add's P' gradient, added to grad_block (rows grad_sum_stride
  // apart), or null.
  const scalar_t* grad_sum;
  int64_t grad_sum_stride;
  int64_t T;
  int D;
};

// Phase 1's backward (S readers at once): each source's gradient written
// once (every reader's term summed per element), and the queries' gradient
// z [S, D] (and reader 0's norm weight's) as one partial row block a warp.
// A warp's scratch (its tokens one after another): the sums <dy_s, v_i>
// and scores, then the coefficients.
template <typename scalar_t>
struct BlockReadsBackwardParams {
  using acc_t = at::opmath_type<scalar_t>;
  SourceTable table;               // the sources; entry.grad: dv_i [T, D] contiguous, or null
  const SourceEntry* overflow;     // sources kTableCapacity.. (device memory)
  SourceTable dy_table;            // the S gradients of the partial outputs (no grad)
  const SourceEntry* dy_overflow;  // readers kTableCapacity..
  bool has_dy;                     // false: no partial output has a gradient
  const acc_t* u;                  // [S, D]
  const acc_t* rstd;               // [N, T]
  const acc_t* weights;            // [S, N, T]
  const double* grad_lse;          // [S, T], or null (float64)
  acc_t* dot_scratch;              // [warps, S, N]: <dy_s, v_i>, then beta_{s,i}
  acc_t* coef_scratch;             // [warps, S, N]: scores, then alpha_{s,i}
  acc_t* beta;                     // [warps, N]: sum_s beta_{s,i}
  double* wide_dot;                // [warps, S, N] the rare tokens' (float accumulation only)
  double* wide_coef;               // [warps, S, N]
  double* wide_beta;               // [warps, N]
  acc_t* z_rows;                   // [warps, S, D], or null
  acc_t* dw_rows;                  // [warps, D] (reader 0's norm weight), or null
  // Reader 0's fused output norm (its dy is that of y_0; h_0 saved).
  const scalar_t* h;               // rows h_stride apart, or null: no norm
  int64_t h_stride;
  const acc_t* norm_weight;        // [D]
  const acc_t* norm_rstd;          // [T]
  int64_t T;
  int N, S, D;
};

static_assert(sizeof(BlockReadsBackwardParams<double>) <= kMaxKernelParamBytes,
              "phase-1 backward parameters exceed 4 KiB");

static_assert(sizeof(BlockReadsParams<double>) <= 4096 && sizeof(MergeParams<double>) <= 4096,
              "block read kernel parameters exceed 4 KiB");

// 16-byte packs when D is a whole number of them and every row start is
// 16-byte aligned (rows_aligned of each row tensor), else one element.
inline int block_read_vec(bool rows_vector_aligned, int64_t D, int natural) {
  return rows_vector_aligned && D % natural == 0 ? natural : 1;
}

// A warp a token; a grid of a few waves of resident CTAs (resident_ctas <=
// 0: unknown) looping over the tokens.
inline int64_t block_read_grid(int64_t T, int64_t resident_ctas) {
  const int64_t needed = (T + kBlockReadWarps - 1) / kBlockReadWarps;
  const int64_t cap = resident_ctas > 0 ? 4 * resident_ctas : needed;
  return std::max<int64_t>(1, std::min(needed, cap));
}

// Phase 1's parameters for readers [s_begin, s_begin + kReadersPerLaunch)
// of S_total (fewer in the last launch): outs[s] is reader s's output (S_total
// of them), u [S_total, D], lse [S_total, T], weights [S_total, N, T].
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
BlockReadsParams<scalar_t> block_reads_params(const SourceTableLayout& layout,
                                              const SourceEntry* overflow, const acc_t* u,
                                              scalar_t* const* outs, double* lse, acc_t* rstd,
                                              acc_t* weights, int64_t T, int N, int S_total,
                                              int D, acc_t eps, int s_begin) {
  BlockReadsParams<scalar_t> p{};
  p.table = layout.table;
  p.overflow = overflow;
  const int S = std::min(kReadersPerLaunch, S_total - s_begin);
  p.u = u + static_cast<int64_t>(s_begin) * D;
  for (int s = 0; s < S; ++s) p.out[s] = outs[s_begin + s];
  p.lse = lse + static_cast<int64_t>(s_begin) * T;
  p.rstd = rstd;
  p.weights = weights + static_cast<int64_t>(s_begin) * N * T;
  p.T = T;
  p.N = N;
  p.S = S;
  p.D = D;
  p.eps = eps;
  return p;
}

// Reader 0's output norm (only in the launch with s_begin == 0).
template <typename Params, typename scalar_t, typename acc_t>
void set_block_read_norm(Params& p, const acc_t* weight, acc_t* rstd, scalar_t* h_keep,
                         acc_t eps) {
  p.norm_weight = weight;
  p.norm_rstd = rstd;
  p.h_keep = h_keep;
  p.norm_eps = eps;
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
MergeParams<scalar_t> merge_params(const scalar_t* partial, int64_t partial_stride,
                                   const scalar_t* block_sum, int64_t block_stride,
                                   const double* lse, const acc_t* u, scalar_t* out, acc_t* rstd,
                                   acc_t* weight, int64_t T, int D, acc_t eps) {
  MergeParams<scalar_t> p{};
  p.partial = partial;
  p.partial_stride = partial_stride;
  p.block_sum = block_sum;
  p.block_stride = block_stride;
  p.lse = lse;
  p.u = u;
  p.out = out;
  p.rstd = rstd;
  p.weight = weight;
  p.T = T;
  p.D = D;
  p.eps = eps;
  return p;
}

// Phase 1's launches, one a kReadersPerLaunch readers, reader 0's output
// norm (when norm_weight is set) in the first: launch(params, with_norm)
// runs one (block_reads_cuda.cu on the GPU, the emulation on the CPU).
template <typename scalar_t, typename Launch, typename acc_t = at::opmath_type<scalar_t>>
void for_each_block_reads_launch(const SourceTableLayout& layout, const SourceEntry* overflow,
                                 const acc_t* u, scalar_t* const* outs, double* lse, acc_t* rstd,
                                 acc_t* weights, int64_t T, int N, int S, int D, acc_t eps,
                                 const acc_t* norm_weight, acc_t* norm_rstd, scalar_t* h_keep,
                                 acc_t norm_eps, Launch&& launch) {
  for (int s_begin = 0; s_begin < S; s_begin += kReadersPerLaunch) {
    BlockReadsParams<scalar_t> p = block_reads_params<scalar_t>(
        layout, overflow, u, outs, lse, rstd, weights, T, N, S, D, eps, s_begin);
    const bool with_norm = norm_weight != nullptr && s_begin == 0;
    if (with_norm) set_block_read_norm(p, norm_weight, norm_rstd, h_keep, norm_eps);
    launch(p, with_norm);
  }
}

// Whether phase 1 can take 16-byte packs: the sources (layout) and every
// row it writes.
template <typename scalar_t>
bool block_reads_rows_aligned(const SourceTableLayout& layout, scalar_t* const* outs, int S,
                              const scalar_t* h_keep, int64_t T, int D, int natural) {
  const size_t es = sizeof(scalar_t);
  bool aligned = layout.vector_aligned && (!h_keep || rows_aligned(h_keep, D, T, natural, es));
  for (int s = 0; s < S; ++s) aligned = aligned && rows_aligned(outs[s], D, T, natural, es);
  return aligned;
}

// Rows of a merge backward's partial sums: one a warp of the grid.
inline int64_t merge_backward_rows(int64_t grid) { return grid * kBlockReadWarps; }

// Phase 2's backward grid: block_read_grid's, fewer CTAs when a buffer of
// partial rows (merge_backward_rows x D in the accumulation dtype) would
// exceed kPartialRowBytes (plan.h, as the one-call backward), but never
// fewer than one CTA an SM (sm_count <= 0: unknown). A function of the
// shape and the device only: the same rows, the same bits, every run.
inline int64_t merge_backward_grid(int64_t T, int64_t resident_ctas, int64_t sm_count, int64_t D,
                                   int64_t acc_size) {
  const int64_t cta_bytes = std::max<int64_t>(1, kBlockReadWarps * D * acc_size);
  const int64_t cap = std::max<int64_t>(std::max<int64_t>(1, sm_count), kPartialRowBytes / cta_bytes);
  return std::min(block_read_grid(T, resident_ctas), cap);
}

// Phase 1's backward grid: as merge_backward_grid, for partial row blocks of
// S rows (z, when wanted: rows_per_warp = S, else 1) a warp.
inline int64_t reads_backward_grid(int64_t T, int64_t resident_ctas, int64_t sm_count,
                                   int64_t rows_per_warp, int64_t D, int64_t acc_size) {
  return merge_backward_grid(T, resident_ctas, sm_count, rows_per_warp * D, acc_size);
}

// Whether a merge backward can take 16-byte packs: every row it reads or
// writes (the outputs are contiguous).
template <typename scalar_t>
bool merge_backward_rows_aligned(const MergeBackwardParams<scalar_t>& p, int natural) {
  const size_t es = sizeof(scalar_t);
  return rows_aligned(p.grad_out, p.grad_stride, p.T, natural, es) &&
         rows_aligned(p.partial, p.partial_stride, p.T, natural, es) &&
         rows_aligned(p.block_sum, p.block_stride, p.T, natural, es) &&
         (!p.h || rows_aligned(p.h, p.h_stride, p.T, natural, es)) &&
         (!p.grad_partial || rows_aligned(p.grad_partial, p.D, p.T, natural, es)) &&
         (!p.grad_block || rows_aligned(p.grad_block, p.D, p.T, natural, es)) &&
         (!p.grad_sum || rows_aligned(p.grad_sum, p.grad_sum_stride, p.T, natural, es));
}

// Whether phase 1's backward can take 16-byte packs: the sources, the
// partial outputs' gradients (dys, or null), h and the source gradients.
// grads: each source's gradient [T, D] contiguous, or null.
template <typename scalar_t>
bool reads_backward_rows_aligned(const BlockReadsBackwardParams<scalar_t>& p,
                                 const SourceTableLayout& sources, const SourceTableLayout* dys,
                                 const std::vector<const void*>& grads, int natural) {
  const size_t es = sizeof(scalar_t);
  bool aligned = sources.vector_aligned && (!dys || dys->vector_aligned) &&
                 (!p.h || rows_aligned(p.h, p.h_stride, p.T, natural, es));
  for (const void* g : grads) {
    if (g) aligned = aligned && rows_aligned(g, p.D, p.T, natural, es);
  }
  return aligned;
}

// Whether a merge can take 16-byte packs: every row it reads or writes.
template <typename scalar_t>
bool merge_rows_aligned(const MergeParams<scalar_t>& p, int natural) {
  const size_t es = sizeof(scalar_t);
  return rows_aligned(p.partial, p.partial_stride, p.T, natural, es) &&
         rows_aligned(p.block_sum, p.block_stride, p.T, natural, es) &&
         rows_aligned(p.out, p.D, p.T, natural, es) &&
         (!p.h_keep || rows_aligned(p.h_keep, p.D, p.T, natural, es)) &&
         (!p.delta || (rows_aligned(p.delta, p.delta_stride, p.T, natural, es) &&
                       rows_aligned(p.sum_out, p.D, p.T, natural, es)));
}

}  // namespace cuda
}  // namespace attnres
