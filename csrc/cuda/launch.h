// What the host side and the kernels of the CUDA backend share: kernel
// parameter blocks, the tile shapes that are compiled, and the launchers.
// Plain C++ (no device code), so the host translation unit stays light.
#pragma once

#include <cuda_runtime.h>

#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace attnres {
namespace cuda {

// Sources whose pointers travel in the kernel parameters; the rest are read
// from a device table filled by small kernels (see depth_attention_cuda.cu).
constexpr int kTableCapacity = 64;
// Largest CTA: G <= 512 threads per token (block mode), 256 otherwise.
constexpr int kMaxThreads = 512;
constexpr int kMaxWarps = kMaxThreads / 32;
// Most values reduced together (2 per row, up to 4 rows per batch).
constexpr int kMaxReduce = 8;

struct SourceEntry {
  const void* src;     // row 0 of the source
  int64_t row_stride;  // elements between rows (tokens)
  void* grad;          // backward only: contiguous gradient [T, D], or null
                       // when this source's gradient is not wanted
};

struct SourceTable {
  SourceEntry first[kTableCapacity];
};

template <typename scalar_t>
struct ForwardParams {
  using acc_t = at::opmath_type<scalar_t>;
  SourceTable table;
  const SourceEntry* overflow;  // sources kTableCapacity.. (device memory)
  const acc_t* u;               // scale * query * gain, [D]
  scalar_t* out;                // [T, D] contiguous
  acc_t* rstd;                  // [N, T]
  acc_t* weights;               // [N, T]
  int64_t T;
  int64_t token_blocks;  // ceil(T / tokens_per_cta)
  int N;
  int D;
  int group;  // G
  int tokens_per_cta;
  acc_t eps;
  // The fused output norm (depth_attention_fwd with out_weight); norm_weight null:
  // the plain op (out gets h). Otherwise out gets (h r) * norm_weight with
  // r = 1/sqrt(mean(h^2) + norm_eps) from the accumulation-dtype h.
  const acc_t* norm_weight;  // [D]
  acc_t* norm_rstd;          // [T]: r per token
  scalar_t* norm_h;          // [T, D] contiguous: h itself, or null (not kept)
  acc_t norm_eps;
  // The cp.async ring (plan_forward; the kRing kernel only): each group
  // keeps the N rows of its next ring_stages tokens in shared memory; 0 for
  // the register pipeline.
  int ring_stages;
  // The fused prefix add (docs/design.md §12; set_forward_prefix): the last
  // source is the block sum P, read as P' = P + prefix_delta (rounded as
  // torch.add) and written to prefix_sum ([T, D] contiguous). Null: none.
  const scalar_t* prefix_delta;  // rows prefix_delta_stride apart
  int64_t prefix_delta_stride;
  scalar_t* prefix_sum;
  // The few-token kernels (set_few_tokens): CTA t * few_splits + s owns
  // token t's columns [s * few_slice, +few_slice); few_partial: scratch.
  int few_splits;
  int few_slice;
  acc_t* few_partial;
};

template <typename scalar_t>
struct BackwardParams {
  using acc_t = at::opmath_type<scalar_t>;
  SourceTable table;
  const SourceEntry* overflow;
  const acc_t* u;
  const scalar_t* grad_out;
  int64_t grad_out_stride;
  // The forward's h (single-pass backward only: sum_j a_j dp_j = <dh, h> +
  // sum_j a_j gw_j); null for the two-pass backward.
  const scalar_t* out;
  int64_t out_stride;
  const acc_t* rstd;          // [N, T]
  const acc_t* weights;       // [N, T]
  const acc_t* grad_weights;  // [N, T], or null: the weights had no gradient
  acc_t* z_partial;  // [gridDim.x, D]: one row of sum(alpha_i v_i) per CTA;
                     // null when no query/gain gradient is wanted
  int64_t T;
  int64_t token_blocks;
  int N;
  int D;
  int group;
  int tokens_per_cta;
  bool stage;  // two-pass only: keep the token's rows in shared memory
               // between the passes
  // The fused output norm (depth_attention_bwd with out_weight); norm_weight null:
  // the plain op. Otherwise grad_out is dy (the gradient of (h r) * w), out
  // is the saved h (read by both the single- and the two-pass backward) and
  // dh is formed per token in registers.
  const acc_t* norm_weight;  // [D]
  const acc_t* norm_rstd;    // [T]
  // [gridDim.x, D]: one row of sum(dy * r h) per CTA (the weight gradient's
  // partials, summed like z's); null when that gradient is not wanted.
  acc_t* norm_dw_partial;
  // The per-thread accumulators of that sum (blockDim.x * VPT * VEC per
  // CTA, element j of thread x at [j * blockDim.x + x]): in global memory
  // here ([gridDim.x, ...]) when they do not fit in shared memory, else
  // null and they sit at norm_slots_offset bytes into the dynamic shared
  // memory.
  acc_t* norm_dw_slots;
  int64_t norm_slots_offset;
  // The cp.async ring (plan_backward; the kRing kernel only): each group
  // keeps the N rows of its next ring_stages tokens in shared memory after
  // u (stage stays false); 0 without it.
  int ring_stages;
};

// The backward's dynamic shared memory starts with a copy of u ([D] in
// the accumulation dtype, loaded once per CTA: each CTA loops over tokens
// (a grid of a few waves) and u is read for every row of every token),
// rounded up to 16 bytes; the
// staging area and the z sum follow it. Only for float accumulation (at
// most 64 KiB at D = 16384, within every sm_80+ GPU's opt-in shared
// memory): fp64 sources (a gradcheck dtype) read u from global memory, as
// 128 KiB would not fit the 99 KiB of sm_86/sm_89 and fail to launch.
constexpr bool u_in_shared(int64_t acc_size) { return acc_size == 4; }

constexpr int64_t u_smem_bytes(int64_t D, int64_t acc_size) {
  return u_in_shared(acc_size) ? (D * acc_size + 15) / 16 * 16 : 0;
}

// Whether the backward of this source dtype is single-pass (sum_j a_j dp_j
// from the forward's h, each source row read once) or two-pass (from the
// saved weights: bf16/fp16, whose rounded h loses too many bits,
// docs/design.md §8). A property of the dtype, so it adds no kernel
// instantiations.
template <typename scalar_t>
constexpr bool backward_single_pass() {
  return sizeof(scalar_t) >= 4;
}

// The tile shapes (VEC elements per pack, VPT packs per thread) that are
// compiled. VEC is 16 bytes' worth of elements (the vector path) or 1 (the
// scalar path for unaligned rows or D not a multiple of the pack). A thread
// holds at most 32 elements of a row.
template <typename scalar_t>
constexpr int natural_vec() {
  return 16 / static_cast<int>(sizeof(scalar_t));
}
constexpr int kCandidateVpts[] = {1, 2, 4, 8, 16, 32};
constexpr int kMaxElemsPerThread = 32;

constexpr bool tile_is_compiled(int vec, int vpt, int natural) {
  if (vec == 1) return vpt == 1 || vpt == 4 || vpt == 16 || vpt == 32;
  return vec == natural && (vpt == 1 || vpt == 2 || vpt == 4 || vpt == 8) &&
         vec * vpt <= kMaxElemsPerThread;
}

// The tiles that have a forward ring kernel (kRing): the 16-byte path (the
// ring copies 16-byte packs with cp.async), except fp64's <2, 8> (its ring
// kernel spilled; fp64 is a gradcheck dtype).
constexpr bool ring_tile_compiled(int vec, int vpt, int natural) {
  return vec == natural && tile_is_compiled(vec, vpt, natural) && !(natural == 2 && vpt == 8);
}

struct TileConfig {
  int vec = 1;
  int vpt = 1;
  int group = 1;           // G threads per token
  int tokens_per_cta = 1;  // CTA size = group * tokens_per_cta
};

struct LaunchConfig {
  TileConfig tile;
  int64_t grid = 1;
  size_t smem_bytes = 0;  // dynamic shared memory
};

// Group classes: the kernels take the group size G as a compile-time class
// (docs/design.md §7), so that its reductions and lane arithmetic unroll
// where the class fixes them:
//  - 32: exactly a warp per token (G = 32): the 5-step butterfly unrolled,
//    lane and group by constant shifts.
//  - kWarpsGroup: G = 32 w with w > 1 known at run time: the warp stage
//    unrolled, the cross-warp stage (w partials) at run time.
//  - kAnyGroup: G at run time (sub-warp G, and every G on the scalar path,
//    which is not a fast path).
constexpr int kAnyGroup = 0;
constexpr int kWarpsGroup = -1;

constexpr int group_class(int vec, int G) {
  return vec == 1 || G < 32 ? kAnyGroup : G == 32 ? 32 : kWarpsGroup;
}

// The backward keeps dh and the query-gradient partial in registers besides
// the rows: it prefers at most 16 elements per thread (choose_backward_tile,
// plan.h); the forward takes up to kMaxElemsPerThread.
constexpr int kBackwardPreferredElems = 16;

// The tiles that have a backward ring kernel (kRing): the forward's ring
// tiles within the backward's preferred elements per thread (wider tiles
// come only above D = 8192, where a token's rows exceed a stage for N > 1).
constexpr bool backward_ring_tile_compiled(int vec, int vpt, int natural) {
  return ring_tile_compiled(vec, vpt, natural) && vec * vpt <= kBackwardPreferredElems;
}

// Whether the kernel whose tiles prefer at most preferred_elems elements per
// thread (the forward: kMaxElemsPerThread; the backward:
// kBackwardPreferredElems) is compiled for tile (vec, vpt) and group class
// cls: exactly the (tile, class) pairs choose_tile can produce for D = 1 ..
// 16384 (the emulation test sweeps D to check both ways: every pair chosen
// is compiled, every compiled pair is chosen for some D).
//  - the scalar path: kAnyGroup only;
//  - kAnyGroup (sub-warp G): only with one pack per thread (the first tile
//    that fits a warp is taken, vpt = 1 for up to 32 packs);
//  - 32: every 16-byte tile within the preferred elements (wider tiles are
//    taken only when a token needs more than 256 threads of preferred ones);
//  - kWarpsGroup: every 16-byte tile with vpt > 1; with vpt = 1 when the
//    widest preferred tile has fewer than 8 packs per thread (then rows of
//    more than 32 such tiles' packs but at most 256 packs take vpt = 1).
constexpr bool group_class_is_compiled(int vec, int vpt, int natural, int preferred_elems,
                                       int cls) {
  if (!tile_is_compiled(vec, vpt, natural)) return false;
  if (vec == 1) return cls == kAnyGroup;
  if (cls == kAnyGroup) return vpt == 1;
  if (cls == 32) return vec * vpt <= preferred_elems;
  if (cls != kWarpsGroup) return false;
  const int widest_preferred = preferred_elems / vec < 8 ? preferred_elems / vec : 8;
  return vpt > 1 || widest_preferred < 8;
}

// Calls f(std::integral_constant<int, VEC>, std::integral_constant<int, VPT>,
// std::integral_constant<int, kGroup>) for the compiled kernel of the tile
// (its vec, vpt and the class of its G) of a kernel that prefers at most
// kPreferredElems elements per thread (group_class_is_compiled). Any other
// tile or G is refused: no kernel is compiled for it.
template <typename scalar_t, int kPreferredElems, typename F>
void with_tile(const TileConfig& tile, F&& f) {
  constexpr int NV = natural_vec<scalar_t>();
  using std::integral_constant;
  const int cls = group_class(tile.vec, tile.group);
  bool called = false;
  auto with_class = [&](auto vec, auto vpt) {
    constexpr int VEC = decltype(vec)::value, VPT = decltype(vpt)::value;
    auto call = [&](auto group) {
      if constexpr (group_class_is_compiled(VEC, VPT, NV, kPreferredElems,
                                            decltype(group)::value)) {
        called = true;
        f(vec, vpt, group);
      }
    };
    switch (cls) {
      case kAnyGroup: return call(integral_constant<int, kAnyGroup>{});
      case 32: return call(integral_constant<int, 32>{});
      case kWarpsGroup: return call(integral_constant<int, kWarpsGroup>{});
      default: return;
    }
  };
  if (tile.vec == NV) {
    switch (tile.vpt) {
      case 1: with_class(integral_constant<int, NV>{}, integral_constant<int, 1>{}); break;
      case 2: with_class(integral_constant<int, NV>{}, integral_constant<int, 2>{}); break;
      case 4: with_class(integral_constant<int, NV>{}, integral_constant<int, 4>{}); break;
      case 8:
        if constexpr (tile_is_compiled(NV, 8, NV)) {
          with_class(integral_constant<int, NV>{}, integral_constant<int, 8>{});
        }
        break;
      default: break;
    }
  } else if (tile.vec == 1) {
    switch (tile.vpt) {
      case 1: with_class(integral_constant<int, 1>{}, integral_constant<int, 1>{}); break;
      case 4: with_class(integral_constant<int, 1>{}, integral_constant<int, 4>{}); break;
      case 16: with_class(integral_constant<int, 1>{}, integral_constant<int, 16>{}); break;
      case 32: with_class(integral_constant<int, 1>{}, integral_constant<int, 32>{}); break;
      default: break;
    }
  }
  TORCH_CHECK(called, "attnres: no CUDA kernel compiled for a tile of vec=", tile.vec,
              ", vpt=", tile.vpt, " with G=", tile.group, " (group class ", cls,
              ") in a kernel preferring <= ", kPreferredElems, " elements per thread");
}

// Defined in forward.cu / backward.cu for float, double, Half, BFloat16.
template <typename scalar_t>
void launch_forward(const ForwardParams<scalar_t>& params,
                    const LaunchConfig& config, cudaStream_t stream);

// The few-token path (forward.cu): the partials kernel, the finish kernel
// and, with the output norm, the norm kernel, on config.grid CTAs of
// config.tile.group threads.
template <typename scalar_t>
void launch_few_tokens(const ForwardParams<scalar_t>& params, const LaunchConfig& config,
                       cudaStream_t stream);

template <typename scalar_t>
void launch_backward(const BackwardParams<scalar_t>& params,
                     const LaunchConfig& config, cudaStream_t stream);

// z[d] = sum of the backward's partial rows [rows, D], in a fixed order.
template <typename acc_t>
void launch_sum_partial_rows(const acc_t* partial, int64_t rows, int D, acc_t* z,
                             cudaStream_t stream);

// Resident CTAs per SM of the backward kernel for a tile (sizes its grid):
// the ring kernel (ring) or the other one.
template <typename scalar_t>
int backward_blocks_per_sm(const TileConfig& tile, size_t smem_bytes, bool normed, bool ring);

// Resident CTAs per SM of the forward's ring kernel for a tile (sizes its
// grid; the register pipeline's grid is one CTA per token block).
template <typename scalar_t>
int forward_ring_blocks_per_sm(const TileConfig& tile, size_t smem_bytes, bool normed);

}  // namespace cuda
}  // namespace attnres
