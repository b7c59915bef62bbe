// Launch planning of the CUDA kernels (tile shape, tokens per CTA, backward
// staging): plain host C++, shared by the CUDA host code and the CPU
// emulation test of the kernels (tests/cuda_emulation), so both run the same
// configurations.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "launch.h"

namespace attnres {
namespace cuda {

// Each thread holds at most 32 elements of a row and a token has at most
// 512 threads.
constexpr int64_t kMaxD = kMaxElemsPerThread * kMaxThreads;  // 16384
// CTA size aimed at when a token needs fewer threads.
constexpr int kCtaThreads = 256;
// Backward staging: a token's rows are kept in shared memory when they take
// at most this much, and a CTA stages at most kStageBytesPerCta.
constexpr int64_t kStageBytesPerToken = 32 * 1024;
constexpr int64_t kStageBytesPerCta = 64 * 1024;
constexpr int64_t kMaxGrid = 0x7fffffff;
// Forward cp.async ring (plan_forward): a stage holds one token's N rows
// (of one group) and takes at most kRingStageBytes; 3 stages when it takes
// at most kRingSmallStageBytes, else 2; a CTA's stages take at most
// kRingBytesPerCta. The ring kernel's grid is kForwardRingWaves times the
// CTAs resident at once (grid-stride over the token blocks).
constexpr int64_t kRingStageBytes = 32 * 1024;
constexpr int64_t kRingSmallStageBytes = 16 * 1024;
constexpr int64_t kRingBytesPerCta = 64 * 1024;
constexpr int64_t kForwardRingWaves = 4;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Threads per token: a power of two <= 32 (several tokens per warp) when a
// warp's worth of threads can hold the row, else a multiple of 32 (<= 256
// when possible, so a token keeps few warps busy on reductions).
inline std::optional<TileConfig> choose_tile_for_vec(int64_t D, int vec, int natural,
                                                     int max_elems) {
  const int64_t packs = ceil_div(D, vec);
  for (int vpt : kCandidateVpts) {
    if (!tile_is_compiled(vec, vpt, natural) || vec * vpt > max_elems) continue;
    const int64_t g = ceil_div(packs, vpt);
    if (g <= 32) {
      TileConfig t;
      t.vec = vec;
      t.vpt = vpt;
      t.group = next_pow2(static_cast<int>(g));
      t.tokens_per_cta = kCtaThreads / t.group;
      return t;
    }
  }
  for (int64_t limit : {int64_t(kCtaThreads), int64_t(kMaxThreads)}) {
    for (int vpt : kCandidateVpts) {
      if (!tile_is_compiled(vec, vpt, natural) || vec * vpt > max_elems) continue;
      const int64_t g = ceil_div(packs, vpt);
      if (g <= limit) {
        TileConfig t;
        t.vec = vec;
        t.vpt = vpt;
        t.group = static_cast<int>(ceil_div(g, 32) * 32);
        t.tokens_per_cta = std::max(1, kCtaThreads / t.group);
        return t;
      }
    }
  }
  return std::nullopt;
}

// The 16-byte path when the rows allow it, else the scalar one; tiles of at
// most preferred_elems elements per thread first, up to 32 when D needs it.
inline TileConfig choose_tile(int64_t D, bool vector_ok, int natural,
                              int preferred_elems = kMaxElemsPerThread) {
  for (int vec : {natural, 1}) {
    if (vec == natural && !(vector_ok && D % natural == 0)) continue;
    for (int max_elems : {preferred_elems, kMaxElemsPerThread}) {
      if (auto t = choose_tile_for_vec(D, vec, natural, max_elems)) return *t;
    }
  }
  TORCH_CHECK(false, "attnres: no CUDA tile for D = ", D);
}

// The backward prefers at most kBackwardPreferredElems (launch.h) elements
// per thread.
inline TileConfig choose_backward_tile(int64_t D, bool vector_ok, int natural) {
  return choose_tile(D, vector_ok, natural, kBackwardPreferredElems);
}

// Whether rows starting at ptr, row_stride elements apart, can be read in
// packs of vec elements.
inline bool rows_aligned(const void* ptr, int64_t row_stride, int64_t T, int vec,
                  size_t elem_size) {
  const auto pack_bytes = static_cast<uintptr_t>(vec) * elem_size;
  if (reinterpret_cast<uintptr_t>(ptr) % pack_bytes != 0) return false;
  return T <= 1 || row_stride % vec == 0;
}

// Backward grid: kBackwardWaves times the CTAs the device holds at once, so
// that when another stream's kernel (NCCL in DDP/FSDP) holds some SMs, the
// CTAs that wait for them carry 1/kBackwardWaves of a resident CTA's share
// of the tokens instead of all of it (a one-wave grid stretches the tail by
// a whole CTA's work). Fewer waves when the z partial rows ([grid, D] in
// the accumulation dtype, summed by a second kernel) would exceed
// kPartialRowBytes; never under one wave. Depends only on the shape, the
// device and the tile (chosen by the rows' alignment): the same partial
// rows, the same bits, every run.
constexpr int64_t kBackwardWaves = 4;
constexpr int64_t kPartialRowBytes = 32 << 20;

inline int64_t backward_grid_cap(int64_t resident_ctas, int64_t D, int64_t acc_size) {
  const int64_t wave_bytes = std::max<int64_t>(1, resident_ctas * D * acc_size);
  const int64_t waves = std::clamp<int64_t>(kPartialRowBytes / wave_bytes, 1, kBackwardWaves);
  return std::max<int64_t>(1, resident_ctas) * waves;
}

// Forward: the tile, and whether it runs the cp.async ring (ring_stages
// stages per group in smem_bytes of dynamic shared memory) or the register
// pipeline (ring_stages = 0, no dynamic shared memory). A function of the
// shape, the dtype (natural: 16 bytes of elements), the rows' alignment
// (vector_ok) and the device's opt-in shared memory per block.
struct ForwardPlan {
  TileConfig tile;
  int ring_stages = 0;
  size_t smem_bytes = 0;
};

// Shared memory that holds `stages` copies of a token's N rows of one group
// (N * vpt * G 16-byte packs each) for as many of the tile's tokens as fit:
// a copy takes at most stage_cap bytes; the CTA's copies take at most
// min(cta_cap, budget) bytes, with tokens per CTA lowered (from the tile's)
// to fit; sub-warp groups must fill whole warps (the rare paths vote per
// warp). stages = 0: none fits. The backward's staging is one copy of this
// shape, the cp.async rings two or three (ring_shape).
struct RingShape {
  int stages = 0;
  int tokens_per_cta = 0;
  int64_t bytes = 0;
};

inline RingShape staged_rows_shape(const TileConfig& tile, int64_t N, int stages,
                                   int64_t stage_cap, int64_t cta_cap, int64_t budget) {
  RingShape shape;
  const int64_t per_token = N * tile.vpt * tile.group * 16;
  const int64_t min_tokens = tile.group < 32 ? 32 / tile.group : 1;
  budget = std::min<int64_t>(cta_cap, budget);
  int64_t tokens = std::min<int64_t>(tile.tokens_per_cta, std::max<int64_t>(0, budget) /
                                                              (stages * per_token));
  tokens -= tokens % min_tokens;
  if (per_token <= stage_cap && tokens >= min_tokens) {
    shape.stages = stages;
    shape.tokens_per_cta = static_cast<int>(tokens);
    shape.bytes = per_token * stages * tokens;
  }
  return shape;
}

// The ring's shape for a tile (both kernels): a stage takes at most
// kRingStageBytes; 3 stages when it takes at most kRingSmallStageBytes,
// else 2; the CTA's stages take at most min(kRingBytesPerCta, budget).
inline RingShape ring_shape(const TileConfig& tile, int64_t N, int64_t budget) {
  const int64_t per_token = N * tile.vpt * tile.group * 16;
  const int stages = per_token <= kRingSmallStageBytes ? 3 : 2;
  return staged_rows_shape(tile, N, stages, kRingStageBytes, kRingBytesPerCta, budget);
}

// allow_ring = false (ATTNRES_CUDA_RING unset or 0): never the ring.
inline ForwardPlan plan_forward(int64_t N, int64_t D, bool vector_ok, int natural,
                                int64_t smem_optin_bytes, bool allow_ring = true) {
  ForwardPlan plan;
  TileConfig tile = choose_tile(D, vector_ok, natural);
  // The ring copies 16-byte packs; the static reduction buffer takes the
  // 4096 bytes kept back.
  if (allow_ring && ring_tile_compiled(tile.vec, tile.vpt, natural)) {
    const RingShape ring = ring_shape(tile, N, smem_optin_bytes - 4096);
    if (ring.stages > 0) {
      plan.ring_stages = ring.stages;
      tile.tokens_per_cta = ring.tokens_per_cta;
      plan.smem_bytes = static_cast<size_t>(ring.bytes);
    }
  }
  plan.tile = tile;
  return plan;
}

// The ring kernel's grid: kForwardRingWaves waves of the CTAs resident at
// once, so that a CTA walks several token blocks (its ring prefetches
// across them) and CTAs waiting for SMs held by another stream's kernel
// carry a quarter of a resident CTA's share.
inline int64_t forward_ring_grid_cap(int64_t resident_ctas) {
  return std::max<int64_t>(1, resident_ctas) * kForwardRingWaves;
}

// Backward: whether a token's rows are staged in shared memory, how many
// tokens a CTA then takes, and the dynamic shared memory of the CTA.
struct BackwardPlan {
  TileConfig tile;
  bool stage = false;
  // The cp.async ring (the kRing kernel): ring_stages stages per group after
  // u (ring_shape, the forward's rule); 0: none (then stage may be set).
  int ring_stages = 0;
  size_t smem_bytes = 0;
  // The fused output norm's weight-gradient accumulators (one per element a
  // thread owns: CTA threads * VPT * VEC), when wanted: at
  // norm_slots_offset bytes into the dynamic shared memory, or (-1) in
  // global memory when they do not fit beside the rest.
  int64_t norm_slots_per_cta = 0;
  int64_t norm_slots_offset = -1;
};

inline BackwardPlan plan_backward(TileConfig tile, int64_t N, int64_t D,
                                  int natural, size_t acc_size,
                                  int64_t smem_optin_bytes, bool single_pass,
                                  bool norm_slots = false, bool allow_ring = true) {
  BackwardPlan plan;
  // The output norm's accumulators go to shared memory when they fit with u
  // and the z sum (then staging gets what is left); else to global memory
  // (large D on GPUs with 99 KiB of opt-in shared memory).
  const auto slot_bytes = [&](int tokens) {
    return norm_slots ? int64_t(tile.group) * tokens * tile.vpt * tile.vec *
                            static_cast<int64_t>(acc_size)
                      : int64_t(0);
  };
  const int64_t u_bytes = u_smem_bytes(D, static_cast<int64_t>(acc_size));
  const int64_t z_sum_bytes =
      tile.tokens_per_cta > 1 ? D * static_cast<int64_t>(acc_size) : int64_t(0);
  const bool slots_in_smem =
      norm_slots && u_bytes + (z_sum_bytes + 15) / 16 * 16 + slot_bytes(tile.tokens_per_cta) +
                            4096 <= smem_optin_bytes;
  const int64_t smem_left = smem_optin_bytes - 4096 - u_bytes -
                            (slots_in_smem ? slot_bytes(tile.tokens_per_cta) : 0);
  // The cp.async ring (both backwards: the single-pass one's rows arrive
  // ahead of their one read, the two-pass one's are read twice from it)
  // where the tile has a ring kernel and the stages fit (ring_shape).
  if (allow_ring && backward_ring_tile_compiled(tile.vec, tile.vpt, natural)) {
    const RingShape ring = ring_shape(tile, N, smem_left);
    if (ring.stages > 0) {
      plan.ring_stages = ring.stages;
      tile.tokens_per_cta = ring.tokens_per_cta;
      plan.smem_bytes = static_cast<size_t>(ring.bytes);
    }
  }
  // Else staging (two-pass: a token's rows copied with cp.async and waited
  // for at once, read by both passes); it copies 16-byte packs; sub-warp
  // groups must fill whole warps. The single-pass backward reads each row
  // once: nothing to stage.
  if (plan.ring_stages == 0 && tile.vec == natural && !single_pass) {
    const RingShape staged =
        staged_rows_shape(tile, N, 1, kStageBytesPerToken, kStageBytesPerCta, smem_left);
    if (staged.stages > 0) {
      plan.stage = true;
      tile.tokens_per_cta = staged.tokens_per_cta;
      plan.smem_bytes = static_cast<size_t>(staged.bytes);
    }
  }
  // Several groups per CTA sum their query-gradient partials there.
  if (tile.tokens_per_cta > 1) {
    plan.smem_bytes = std::max(plan.smem_bytes, static_cast<size_t>(D) * acc_size);
  }
  // u comes first (u_smem_bytes).
  plan.smem_bytes += static_cast<size_t>(u_bytes);
  if (norm_slots) {
    plan.norm_slots_per_cta = slot_bytes(tile.tokens_per_cta) / static_cast<int64_t>(acc_size);
    if (slots_in_smem) {
      plan.norm_slots_offset = static_cast<int64_t>((plan.smem_bytes + 15) / 16 * 16);
      plan.smem_bytes = static_cast<size_t>(plan.norm_slots_offset +
                                            slot_bytes(tile.tokens_per_cta));
    }
  }
  // Every sm_80+ GPU has at least 99 KiB of opt-in shared memory, enough for
  // any D the kernels take; older GPUs (built with an older
  // TORCH_CUDA_ARCH_LIST) may not: say so instead of failing the launch.
  // The static reduction buffer (kernels.cuh) takes the 4096 bytes kept back.
  TORCH_CHECK(static_cast<int64_t>(plan.smem_bytes) + 4096 <= smem_optin_bytes,
              "attnres: the CUDA backward at D = ", D, " needs ", plan.smem_bytes + 4096,
              " bytes of shared memory per block, more than this GPU's opt-in limit of ",
              smem_optin_bytes, " bytes; the CUDA kernels are designed for sm_80 or newer");
  plan.tile = tile;
  return plan;
}

// Few tokens (decode; the bounds' reasons in docs/design.md §7): a token's
// read split across `splits` CTAs of `threads` threads, each owning `slice`
// contiguous columns (a multiple of vec). splits = 0: the tiled forward.
// Taken for T <= 16 (beyond, the tiled grid fills the SMs), D >= 1024, N <=
// 1024 (the finish keeps N scores and weights in shared memory), with
// splits = min(SMs / T, D / 256) >= 2 (K3, D = 7168, one token: 28).
constexpr int64_t kFewTokensMaxT = 16;
constexpr int64_t kFewTokensMinD = 1024;
constexpr int64_t kFewTokensMinSlice = 256;
constexpr int64_t kFewTokensMaxN = 1024;
constexpr int kFewTokensMaxThreads = 256;

struct FewTokensPlan {
  int splits = 0;
  int vec = 1;
  int slice = 0;
  int threads = 0;
};

// The split of a row into at most `splits` slices of whole packs (none
// empty), one thread per pack up to kFewTokensMaxThreads, in whole warps.
inline FewTokensPlan few_tokens_shape(int64_t D, int vec, int64_t splits) {
  FewTokensPlan plan;
  const int64_t packs = ceil_div(D, vec);
  const int64_t slice_packs = ceil_div(packs, std::max<int64_t>(1, splits));
  plan.splits = static_cast<int>(ceil_div(packs, slice_packs));
  plan.vec = vec;
  plan.slice = static_cast<int>(slice_packs * vec);
  plan.threads =
      static_cast<int>(std::min<int64_t>(kFewTokensMaxThreads, ceil_div(slice_packs, 32) * 32));
  return plan;
}

inline FewTokensPlan plan_few_tokens(int64_t T, int64_t N, int64_t D, bool vector_ok, int natural,
                                     int64_t sm_count) {
  if (T < 1 || T > kFewTokensMaxT || D < kFewTokensMinD || N > kFewTokensMaxN) return {};
  const int64_t splits = std::min(sm_count / T, D / kFewTokensMinSlice);
  if (splits < 2) return {};
  return few_tokens_shape(D, vector_ok && D % natural == 0 ? natural : 1, splits);
}

// Scratch of the few-token kernels, in the accumulation dtype: per token,
// source and slice <v, v> and <u, v> ([T, N, 2, splits]); with the output
// norm then per token and slice sum(h^2) plain and scaled by the two range
// factors ([T, 3, splits], docs/design.md §8).
inline int64_t few_tokens_scratch_elems(const FewTokensPlan& plan, int64_t T, int64_t N,
                                        bool normed) {
  return T * (N * 2 + (normed ? 3 : 0)) * plan.splits;
}


// A run-time on/off switch, the environment variable `name` (value: its text,
// or null when unset): "1" on, "0" off, unset `when_unset`; any other value is
// refused.
//  - ATTNRES_CUDA_RING (unset: off): the forward and backward cp.async rings
//    where their plans take them (off by default: on an H200 the rings made
//    fp32 N = 16, D = 512 three times slower, benchmarks/results/NOTES.md).
//  - ATTNRES_CUDA_FEW_TOKENS (unset: on): the few-token kernels where
//    plan_few_tokens takes them; "0" lets a test compare both paths on one
//    shape.
inline bool parse_switch(const char* name, const char* value, bool when_unset) {
  if (value == nullptr) return when_unset;
  const std::string text(value);
  TORCH_CHECK(text == "0" || text == "1", "attnres: ", name, " must be unset (",
              when_unset ? "on" : "off", ", the default), \"0\" (off) or \"1\" (on), not \"",
              value, "\"");
  return text == "1";
}

}  // namespace cuda
}  // namespace attnres
