// The one place the CUDA kernels' parameter blocks and launch shapes are
// built from row pointers. Plain host C++: the CUDA host code
// (depth_attention_cuda.cu) and the CPU emulation of the kernels
// (tests/cuda_emulation) both call it, so the emulation runs the real host
// set-up, not a copy of it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "launch.h"
#include "plan.h"

namespace attnres {
namespace cuda {

// Kernel parameters travel in the 4 KiB parameter space every supported
// architecture and toolkit accepts.
constexpr size_t kMaxKernelParamBytes = 4096;
static_assert(sizeof(ForwardParams<double>) <= kMaxKernelParamBytes,
              "forward kernel parameters exceed 4 KiB: shrink kTableCapacity");
static_assert(sizeof(BackwardParams<double>) <= kMaxKernelParamBytes,
              "backward kernel parameters exceed 4 KiB: shrink kTableCapacity");

// The sources as the kernels see them: the first kTableCapacity entries in
// the parameter block, the rest in `overflow` (to be placed in device
// memory by the caller), and whether every source's rows can be read in
// 16-byte packs.
struct SourceTableLayout {
  SourceTable table{};
  std::vector<SourceEntry> overflow;
  bool vector_aligned = true;
};

inline SourceTableLayout layout_sources(const std::vector<SourceEntry>& entries, int64_t T,
                                        int natural, size_t elem_size) {
  SourceTableLayout layout;
  const size_t in_table = std::min<size_t>(entries.size(), kTableCapacity);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i < in_table) {
      layout.table.first[i] = entries[i];
    } else {
      layout.overflow.push_back(entries[i]);
    }
    layout.vector_aligned = layout.vector_aligned &&
                            rows_aligned(entries[i].src, entries[i].row_stride, T, natural,
                                         elem_size);
  }
  return layout;
}

template <typename Params>
struct KernelLaunch {
  Params params;
  LaunchConfig config;
};

// Fields common to both kernels' parameter blocks.
template <typename Params>
void fill_common(Params& params, const SourceTableLayout& sources,
                 const SourceEntry* overflow_on_device, const void* u, int64_t T, int64_t N,
                 int64_t D, const TileConfig& tile) {
  using acc_t = typename Params::acc_t;
  params.table = sources.table;
  params.overflow = overflow_on_device;
  params.u = static_cast<const acc_t*>(u);
  params.T = T;
  params.token_blocks = ceil_div(T, tile.tokens_per_cta);
  params.N = static_cast<int>(N);
  params.D = static_cast<int>(D);
  params.group = tile.group;
  params.tokens_per_cta = tile.tokens_per_cta;
}

// Forward plan (tile, cp.async ring or register pipeline): with the ring,
// the caller asks the device how many CTAs of the ring kernel are resident
// (forward_ring_grid_cap) before building the launch.
// allow_ring = false: the register pipeline (ATTNRES_CUDA_RING unset or 0, or a ring
// kernel that cannot be resident).
template <typename scalar_t>
ForwardPlan forward_plan(const SourceTableLayout& sources, int64_t N, int64_t D,
                         int64_t smem_optin_bytes, bool allow_ring = true) {
  return plan_forward(N, D, sources.vector_aligned, natural_vec<scalar_t>(), smem_optin_bytes,
                      allow_ring);
}

// Forward: out [T, D] contiguous, rstd and weights [N, T]. grid_cap bounds
// the grid (the ring's waves on a GPU; the emulation lowers it to exercise
// the token loop).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
KernelLaunch<ForwardParams<scalar_t>> forward_launch(
    const ForwardPlan& plan, const SourceTableLayout& sources,
    const SourceEntry* overflow_on_device, const acc_t* u, scalar_t* out, acc_t* rstd,
    acc_t* weights, int64_t T, int64_t N, int64_t D, acc_t eps, int64_t grid_cap = kMaxGrid) {
  KernelLaunch<ForwardParams<scalar_t>> launch{};
  const TileConfig& tile = plan.tile;
  fill_common(launch.params, sources, overflow_on_device, u, T, N, D, tile);
  launch.params.out = out;
  launch.params.rstd = rstd;
  launch.params.weights = weights;
  launch.params.eps = eps;
  launch.params.ring_stages = plan.ring_stages;
  launch.config.tile = tile;
  launch.config.grid = std::min({launch.params.token_blocks, grid_cap, kMaxGrid});
  launch.config.smem_bytes = plan.smem_bytes;
  return launch;
}

// The few-token path (plan_few_tokens) of a forward launch: one CTA of
// plan.threads threads per slice of each token (grid splits * T), scratch
// ([few_tokens_scratch_elems]) and the finish kernel's shared memory (the
// token's N scores and N weights).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void set_few_tokens(KernelLaunch<ForwardParams<scalar_t>>& launch, const FewTokensPlan& plan,
                    acc_t* scratch) {
  ForwardParams<scalar_t>& params = launch.params;
  launch.config.tile = TileConfig{plan.vec, 1, plan.threads, 1};
  launch.config.grid = params.T * plan.splits;
  launch.config.smem_bytes = static_cast<size_t>(2 * params.N) * sizeof(acc_t);
  params.group = plan.threads;
  params.tokens_per_cta = 1;
  params.token_blocks = params.T;
  params.ring_stages = 0;
  params.few_splits = plan.splits;
  params.few_slice = plan.slice;
  params.few_partial = scratch;
}

// The fused output norm's forward: out gets (h r) * weight, r goes to
// rstd ([T]), h to h ([T, D] contiguous) when not null. weight ([D]) must
// be aligned for VEC-element packs of the accumulation dtype (16 bytes).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void set_forward_norm(ForwardParams<scalar_t>& params, const acc_t* weight, acc_t* rstd,
                      scalar_t* h, acc_t eps) {
  params.norm_weight = weight;
  params.norm_rstd = rstd;
  params.norm_h = h;
  params.norm_eps = eps;
}

// The fused prefix add of the forward (docs/design.md §12): the last
// source's entry holds the block sum P, the kernel reads delta's row (rows
// delta_stride apart) with it and writes P' to sum ([T, D] contiguous).
// Both are accessed in the sources' packs: the layout is vector-aligned
// only if they are too (before forward_plan picks the tile).
template <typename scalar_t>
void align_forward_prefix(SourceTableLayout& sources, const scalar_t* delta,
                          int64_t delta_stride, const scalar_t* sum, int64_t T, int64_t D) {
  constexpr int natural = natural_vec<scalar_t>();
  sources.vector_aligned = sources.vector_aligned &&
                           rows_aligned(delta, delta_stride, T, natural, sizeof(scalar_t)) &&
                           rows_aligned(sum, D, T, natural, sizeof(scalar_t));
}

template <typename scalar_t>
void set_forward_prefix(ForwardParams<scalar_t>& params, const scalar_t* delta,
                        int64_t delta_stride, scalar_t* sum) {
  params.prefix_delta = delta;
  params.prefix_delta_stride = delta_stride;
  params.prefix_sum = sum;
}

// Backward plan (tile, cp.async ring or staging, dynamic shared memory): the
// caller asks the device how many CTAs of it are resident before building
// the launch (allow_ring = false: no ring, as for the forward).
// out (the forward's h) is read by the single-pass backward and by the
// normed one (normed: dh is formed from dy and h); the plain two-pass one
// ignores it. norm_grad_weight: the normed op's weight gradient is wanted
// (its accumulators need room, BackwardPlan).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
BackwardPlan backward_plan(const SourceTableLayout& sources, const scalar_t* grad_out,
                           int64_t grad_out_stride, const scalar_t* out, int64_t out_stride,
                           int64_t T, int64_t N, int64_t D, int64_t smem_optin_bytes,
                           bool normed = false, bool norm_grad_weight = false,
                           bool allow_ring = true) {
  constexpr int natural = natural_vec<scalar_t>();
  constexpr bool single_pass = backward_single_pass<scalar_t>();
  const bool vector_ok =
      sources.vector_aligned &&
      rows_aligned(grad_out, grad_out_stride, T, natural, sizeof(scalar_t)) &&
      (!(single_pass || normed) || rows_aligned(out, out_stride, T, natural, sizeof(scalar_t)));
  return plan_backward(choose_backward_tile(D, vector_ok, natural), N, D, natural,
                       sizeof(acc_t), smem_optin_bytes, single_pass,
                       normed && norm_grad_weight, allow_ring);
}

// Backward: the grid is at most grid_cap CTAs (on a GPU a few waves of the
// resident CTAs, backward_grid_cap, so each CTA keeps its query-gradient
// partial in registers across many tokens). params.z_partial ([config.grid, D]) is left for the caller to set
// (or to leave null when no query/gain gradient is wanted).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
KernelLaunch<BackwardParams<scalar_t>> backward_launch(
    const BackwardPlan& plan, const SourceTableLayout& sources,
    const SourceEntry* overflow_on_device, const acc_t* u, const scalar_t* grad_out,
    int64_t grad_out_stride, const scalar_t* out, int64_t out_stride, const acc_t* rstd,
    const acc_t* weights, const acc_t* grad_weights, int64_t T, int64_t N, int64_t D,
    int64_t grid_cap, bool normed = false) {
  KernelLaunch<BackwardParams<scalar_t>> launch{};
  fill_common(launch.params, sources, overflow_on_device, u, T, N, D, plan.tile);
  launch.params.grad_out = grad_out;
  launch.params.grad_out_stride = grad_out_stride;
  const bool reads_h = backward_single_pass<scalar_t>() || normed;
  TORCH_CHECK(!reads_h || out != nullptr,
              "attnres: the single-pass or normed CUDA backward needs the forward's h");
  launch.params.out = reads_h ? out : nullptr;
  launch.params.out_stride = reads_h ? out_stride : 0;
  launch.params.rstd = rstd;
  launch.params.weights = weights;
  launch.params.grad_weights = grad_weights;
  launch.params.z_partial = nullptr;
  launch.params.stage = plan.stage;
  launch.params.ring_stages = plan.ring_stages;
  launch.config.tile = plan.tile;
  launch.config.grid = std::min({launch.params.token_blocks, grid_cap, kMaxGrid});
  launch.config.smem_bytes = plan.smem_bytes;
  launch.params.norm_slots_offset = plan.norm_slots_offset;
  return launch;
}

// The fused output norm's backward: weight and rstd ([D], [T]); dw_partial
// ([config.grid, D], or null: the weight gradient is not wanted) and, when
// the plan put the accumulators in global memory (norm_slots_offset < 0),
// dw_slots ([config.grid, plan.norm_slots_per_cta]).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void set_backward_norm(BackwardParams<scalar_t>& params, const acc_t* weight, const acc_t* rstd,
                       acc_t* dw_partial, acc_t* dw_slots) {
  params.norm_weight = weight;
  params.norm_rstd = rstd;
  params.norm_dw_partial = dw_partial;
  params.norm_dw_slots = dw_partial ? dw_slots : nullptr;
  TORCH_CHECK(dw_partial == nullptr || dw_slots != nullptr || params.norm_slots_offset >= 0,
              "attnres: the normed CUDA backward's weight-gradient accumulators have no room");
}

}  // namespace cuda
}  // namespace attnres
