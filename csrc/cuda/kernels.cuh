// Device side of the CUDA depth-attention kernels (included by forward.cu and
// backward.cu). The per-token formulas come from attnres/depth_math.h, the
// same header the CPU kernels use.
//
// Work layout. One token is handled by a *group* of G threads. Each thread
// owns VPT chunks of VEC contiguous elements of the row: chunk k of lane l
// covers elements [(k*G + l)*VEC, +VEC). The same element->thread map is used
// for every source of the token, so the softmax accumulator, dh and the
// query-gradient accumulator live in registers. G <= 32 (a power of two):
// several tokens per warp/CTA, reductions by warp shuffles. G > 32 (a
// multiple of 32): one token per G threads, reductions through shared memory.
// Sources are read SU rows at a time so several rows' loads are in flight.
#pragma once

#include <cuda_runtime.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "attnres/depth_math.h"
#include "launch.h"

// The dynamic shared memory of a CTA. The CPU emulation of these kernels
// (tests/cuda_emulation/cuda_runtime.h) defines its own version first.
// Rare paths are kept out of line so that their registers do not join the
// fast path's allocation.
#if defined(__CUDACC__)
#define ATTNRES_NOINLINE __noinline__
#else
#define ATTNRES_NOINLINE __attribute__((noinline))
#endif

#ifndef ATTNRES_DYNAMIC_SMEM
#define ATTNRES_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace attnres {
namespace cuda {

// The minimum of resident CTAs per SM the kernels are compiled for (the
// second argument of __launch_bounds__): one, i.e. up to 65536 / kMaxThreads
// = 128 registers a thread, as the maximum block size alone allows, but
// stated: without it ptxas may choose 64 registers and spill.
constexpr int kKernelMinCtas = 1;

// Compile-time shape of one thread's slice of a row.
template <typename scalar_t, int VEC_, int VPT_>
struct Tile {
  static constexpr int VEC = VEC_;
  static constexpr int VPT = VPT_;
  // Registers one row of the slice takes as loaded (a 2-byte scalar still
  // takes a whole register).
  static constexpr int kRegsPerRow =
      VPT * ((VEC * static_cast<int>(sizeof(scalar_t)) + 3) / 4);
  // Rows per batch: about 16 registers of packed rows (the kernels keep two
  // batches: the one being used and the next one in flight).
  static constexpr int SU =
      kRegsPerRow >= 16 ? 1 : (16 / kRegsPerRow > 4 ? 4 : 16 / kRegsPerRow);
  // Whether the next batch is loaded while this one is reduced: only when
  // the accumulator and two batches of rows fit in about 64 registers
  // (otherwise the extra batch spills).
  static constexpr int kAccRegs =
      VPT * VEC * static_cast<int>(sizeof(at::opmath_type<scalar_t>)) / 4;
  static constexpr bool kPrefetch = kAccRegs + 2 * SU * kRegsPerRow <= 64;
  // The backward also keeps dh (one row) and the query-gradient partial z.
  static constexpr bool kPrefetchBackward =
      kAccRegs + kRegsPerRow + 2 * SU * kRegsPerRow <= 64;
  static_assert(2 * SU <= kMaxReduce, "reduction buffer too small");
};

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T x[VEC];
};

// Packs in global memory, through explicit global-space instructions
// (LDG, STG). Pointers read from the source table are not known to the
// compiler as global and would otherwise get generic LD/ST. Sources, dh, h
// and u are read-only while a kernel runs.
//
// Cache hints (docs/design.md §7):
//  - kKeep: the plain read-only load (__ldg), for what is read again (u;
//    the two-pass backward's first read of a row, which its second pass
//    takes from L2; the rare paths' re-reads).
//  - kStream: a row this kernel reads once: ld.global.cs.nc, evict-first
//    in L1 and L2 (the per-instruction .L2::evict_first qualifier needs
//    256-bit loads; see ld_stream).
//  - Stores of h and dv use st.global.cs (streaming: written once, not read
//    by this kernel).
// The host build of the emulation (no __CUDA_ARCH__) uses plain accesses.
enum class LoadHint { kKeep, kStream };

#if defined(__CUDA_ARCH__)
// ld.global.cs.nc of one 16/8/4/2-byte word: read-only (non-coherent) path,
// cache-streaming (evict-first in L1 and L2). Not volatile, no memory
// clobber: the data is read-only during the kernel (the contract of __ldg).
// (.L1::no_allocate with an L2::evict_first createpolicy would do too, at
// the price of a 64-bit policy operand; .cs needs none.)
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 w;
  asm("ld.global.cs.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
      : "l"(p));
  return w;
}
__device__ __forceinline__ uint2 ld_stream(const uint2* p) {
  uint2 w;
  asm("ld.global.cs.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(w.x), "=r"(w.y) : "l"(p));
  return w;
}
__device__ __forceinline__ unsigned int ld_stream(const unsigned int* p) {
  unsigned int w;
  asm("ld.global.cs.nc.u32 %0, [%1];\n" : "=r"(w) : "l"(p));
  return w;
}
__device__ __forceinline__ unsigned short ld_stream(const unsigned short* p) {
  unsigned short w;
  asm("ld.global.cs.nc.u16 %0, [%1];\n" : "=h"(w) : "l"(p));
  return w;
}

template <LoadHint kHint, typename W>
__device__ __forceinline__ W ld_word(const W* p) {
  if constexpr (kHint == LoadHint::kStream) {
    return ld_stream(p);
  } else {
    return __ldg(p);
  }
}
#endif

template <typename T, int VEC, LoadHint kHint = LoadHint::kKeep>
__device__ __forceinline__ Pack<T, VEC> load_global(const T* p) {
  using P = Pack<T, VEC>;
#if defined(__CUDA_ARCH__)
  constexpr int kBytes = static_cast<int>(sizeof(P));
  P out;
  if constexpr (kBytes % 16 == 0) {
    uint4 words[kBytes / 16];
#pragma unroll
    for (int w = 0; w < kBytes / 16; ++w) {
      words[w] = ld_word<kHint>(reinterpret_cast<const uint4*>(p) + w);
    }
    __builtin_memcpy(&out, words, kBytes);
  } else if constexpr (kBytes == 8) {
    const uint2 word = ld_word<kHint>(reinterpret_cast<const uint2*>(p));
    __builtin_memcpy(&out, &word, kBytes);
  } else if constexpr (kBytes == 4) {
    const unsigned int word = ld_word<kHint>(reinterpret_cast<const unsigned int*>(p));
    __builtin_memcpy(&out, &word, kBytes);
  } else {
    static_assert(kBytes == 2, "unexpected pack size");
    const unsigned short word = ld_word<kHint>(reinterpret_cast<const unsigned short*>(p));
    __builtin_memcpy(&out, &word, kBytes);
  }
  return out;
#else
  return *reinterpret_cast<const P*>(p);
#endif
}

// st.global (kStreamStore: st.global.cs) of one pack.
template <typename T, int VEC, bool kStreamStore = false>
__device__ __forceinline__ void store_global(T* p, const Pack<T, VEC>& v) {
  using P = Pack<T, VEC>;
#if defined(__CUDA_ARCH__)
  constexpr int kBytes = static_cast<int>(sizeof(P));
  if constexpr (kBytes == 16) {
    uint4 w;
    __builtin_memcpy(&w, &v, kBytes);
    if constexpr (kStreamStore) {
      asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(w.x), "r"(w.y),
                   "r"(w.z), "r"(w.w)
                   : "memory");
    } else {
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(w.x), "r"(w.y),
                   "r"(w.z), "r"(w.w)
                   : "memory");
    }
  } else if constexpr (kBytes == 8) {
    uint2 w;
    __builtin_memcpy(&w, &v, kBytes);
    if constexpr (kStreamStore) {
      asm volatile("st.global.cs.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(w.x), "r"(w.y)
                   : "memory");
    } else {
      asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(w.x), "r"(w.y) : "memory");
    }
  } else if constexpr (kBytes == 4) {
    unsigned int w;
    __builtin_memcpy(&w, &v, kBytes);
    if constexpr (kStreamStore) {
      asm volatile("st.global.cs.b32 [%0], %1;\n" ::"l"(p), "r"(w) : "memory");
    } else {
      asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(w) : "memory");
    }
  } else {
    static_assert(kBytes == 2, "unexpected pack size");
    unsigned short w;
    __builtin_memcpy(&w, &v, kBytes);
    if constexpr (kStreamStore) {
      asm volatile("st.global.cs.b16 [%0], %1;\n" ::"l"(p), "h"(w) : "memory");
    } else {
      asm volatile("st.global.b16 [%0], %1;\n" ::"l"(p), "h"(w) : "memory");
    }
  }
#else
  *reinterpret_cast<P*>(p) = v;
#endif
}

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> zero_pack() {
  Pack<T, VEC> z;
#pragma unroll
  for (int e = 0; e < VEC; ++e) z.x[e] = T(0);
  return z;
}

template <typename scalar_t>
__device__ __forceinline__ const scalar_t* source_row(
    const SourceTable& table, const SourceEntry* overflow, int i, int64_t t) {
  const void* base;
  int64_t stride;
  if (i < kTableCapacity) {
    base = table.first[i].src;
    stride = table.first[i].row_stride;
  } else {
    const SourceEntry& e = overflow[i - kTableCapacity];
    base = e.src;
    stride = e.row_stride;
  }
  return static_cast<const scalar_t*>(base) + t * stride;
}

// Row t of source i's gradient, or null when that gradient is not wanted.
template <typename scalar_t>
__device__ __forceinline__ scalar_t* grad_row(const SourceTable& table,
                                              const SourceEntry* overflow,
                                              int i, int64_t t, int D) {
  void* base = i < kTableCapacity ? table.first[i].grad
                                  : overflow[i - kTableCapacity].grad;
  return base ? static_cast<scalar_t*>(base) + t * static_cast<int64_t>(D) : nullptr;
}

// The gradient reaching weight idx = i * T + t directly (a loss on the
// returned weights); it adds to dp_i (docs/design.md §2).
template <typename Params>
__device__ __forceinline__ typename Params::acc_t weight_grad(const Params& p, int64_t idx) {
  return p.grad_weights ? p.grad_weights[idx] : typename Params::acc_t(0);
}

// Rows i0 .. i0+SU-1 of token t (zeros past N and past D) from global memory.
template <typename scalar_t, int VEC, int VPT, int SU, LoadHint kHint = LoadHint::kKeep>
__device__ __forceinline__ void load_rows(const SourceTable& table,
                                          const SourceEntry* overflow, int i0,
                                          int N, int64_t t, int lane, int G,
                                          int D, Pack<scalar_t, VEC> (&rows)[SU][VPT]) {
#pragma unroll
  for (int j = 0; j < SU; ++j) {
    if (i0 + j < N) {
      const scalar_t* row = source_row<scalar_t>(table, overflow, i0 + j, t);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * G + lane) * VEC;
        rows[j][k] = c < D ? load_global<scalar_t, VEC, kHint>(row + c)
                           : zero_pack<scalar_t, VEC>();
      }
    } else {
#pragma unroll
      for (int k = 0; k < VPT; ++k) rows[j][k] = zero_pack<scalar_t, VEC>();
    }
  }
}

// The calling thread's place — its group (token slot in the CTA) and its
// lane among the G threads of the group — and the problem shape, copied
// from the kernel parameters into registers once (reading them from the
// parameter space at each use costs registers and spills in the wider
// tiles). kGroup is the group class (launch.h): G is a constant for the
// class 32 (lane and group by shifts, every `k * G + lane` folded), read
// from the parameters otherwise.
template <int kGroup>
struct GroupSize {
  int G;
  __device__ __forceinline__ explicit GroupSize(int g) : G(g) {}
};
template <>
struct GroupSize<32> {
  static constexpr int G = 32;
  __device__ __forceinline__ explicit GroupSize(int) {}
};

template <int kGroup_>
struct ThreadPlace : GroupSize<kGroup_> {
  static constexpr int kGroup = kGroup_;
  using GroupSize<kGroup_>::G;
  int group;
  int lane;
  int N;
  int D;
  int64_t T;
  template <typename Params>
  __device__ __forceinline__ explicit ThreadPlace(const Params& p)
      : GroupSize<kGroup_>(p.group), N(p.N), D(p.D), T(p.T) {
    if constexpr (kGroup == 32) {
      group = static_cast<int>(threadIdx.x >> 5);
      lane = static_cast<int>(threadIdx.x & 31u);
    } else {
      group = static_cast<int>(threadIdx.x) / this->G;
      lane = static_cast<int>(threadIdx.x) - group * this->G;
    }
  }
  // Whether a group spans several warps (G > 32: reductions go through
  // shared memory and synchronize the CTA); a constant but for kAnyGroup.
  __device__ __forceinline__ bool multi_warp() const {
    if constexpr (kGroup == 32) {
      return false;
    } else if constexpr (kGroup == kWarpsGroup) {
      return true;
    } else {
      return this->G > 32;
    }
  }
};

// The within-warp part of a group reduction: butterfly shuffles over
// min(G, 32) lanes (group_allreduce and group_allreduce_wide). Classes 32
// and kWarpsGroup: the whole warp, the five steps unrolled; kAnyGroup: a
// run-time loop (the same offsets, in the same order, for G >= 32).
template <int kGroup, typename T, int NV>
__device__ __forceinline__ void warp_allreduce(T (&v)[NV], int G) {
  if constexpr (kGroup == kAnyGroup) {
    const int width = G < 32 ? G : 32;
    for (int offset = width >> 1; offset > 0; offset >>= 1) {
#pragma unroll
      for (int j = 0; j < NV; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], offset);
    }
  } else {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
      for (int j = 0; j < NV; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], offset);
    }
  }
}

// The cross-warp step of a group reduction (G > 32): lane 0 of each warp
// writes its NV partials to `buf` (kStride values a warp), a CTA barrier,
// and every thread adds its group's warps in warp order. Every thread of the
// CTA calls it; the caller keeps `buf` free of earlier readers (a parity
// buffer, or a barrier before).
template <int kStride, typename T, int NV, int kGroup>
__device__ __forceinline__ void cross_warp_sum(T (&v)[NV], const ThreadPlace<kGroup>& pos,
                                               T* buf) {
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int j = 0; j < NV; ++j) buf[warp * kStride + j] = v[j];
  }
  __syncthreads();
  const int warps_per_group = pos.G >> 5;
  const int first = pos.group * warps_per_group;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    T s = buf[first * kStride + j];
    for (int w = 1; w < warps_per_group; ++w) s += buf[(first + w) * kStride + j];
    v[j] = s;
  }
}

// Sums NV values over the G threads of a group; every thread of the group
// gets bitwise the same sums (xor butterflies add commutative pairs, the
// cross-warp step adds the warps' partials in a fixed order). Block mode
// (G > 32) needs every thread of the CTA to call it; `red` is double
// buffered by `parity` so one barrier per call suffices.
template <int NV, typename acc_t, int kGroup>
__device__ __forceinline__ void group_allreduce(acc_t (&v)[NV], const ThreadPlace<kGroup>& pos,
                                                acc_t* red, int& parity) {
  warp_allreduce<kGroup>(v, pos.G);
  if (pos.multi_warp()) {
    cross_warp_sum<kMaxReduce>(v, pos, red + parity * (kMaxWarps * kMaxReduce));
    parity ^= 1;
  }
}

// group_allreduce for the backward's rare tokens in double (WideType), with
// the reduction buffer `red` (any type, 16-byte aligned, at least
// kMaxWarps * NV doubles) used as doubles. Rare path: it brackets its use of
// `red` with barriers instead of relying on the parity trick.
template <int NV, int kGroup>
__device__ __forceinline__ void group_allreduce_wide(double (&v)[NV],
                                                     const ThreadPlace<kGroup>& pos, void* red) {
  static_assert(NV * kMaxWarps * sizeof(double) <=
                    2 * kMaxWarps * kMaxReduce * sizeof(float),
                "reduction buffer too small for the wide reduction");
  warp_allreduce<kGroup>(v, pos.G);
  if (pos.multi_warp()) {
    __syncthreads();  // earlier readers of red are done
    cross_warp_sum<NV>(v, pos, static_cast<double*>(red));
    __syncthreads();  // before red is reused
  }
}

// Whether any group that shares reductions with this thread has `flag` set:
// its warp (G <= 32: the reductions are shuffles within the warp) or its CTA
// (G > 32: they synchronize the CTA). The rare paths below run when it is
// true, so every thread that takes part in their reductions is there. One
// vote per token; with one group per CTA the flag is already uniform.
template <int kGroup>
__device__ __forceinline__ bool reduction_peers_any(bool flag, const ThreadPlace<kGroup>& pos,
                                                    int tokens_per_cta) {
  if (!pos.multi_warp()) return __any_sync(0xffffffffu, flag);
  if (tokens_per_cta == 1) return flag;
  return __syncthreads_or(flag ? 1 : 0) != 0;
}

// 16-byte asynchronous global->shared copy (sm_80+). The CPU emulation
// (tests/cuda_emulation/cuda_runtime.h, ATTNRES_EMULATED_CP_ASYNC) queues
// it per commit group and performs it at the wait that retires the group;
// elsewhere (a host pass) a plain copy.
__device__ __forceinline__ void copy_async_16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s),
               "l"(gmem)
               : "memory");
#elif defined(ATTNRES_EMULATED_CP_ASYNC)
  emu::cp_async_16(smem, gmem);
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

// Closes this thread's current group of copies (cp.async.commit_group).
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(ATTNRES_EMULATED_CP_ASYNC)
  emu::cp_async_commit();
#endif
}

// Waits until at most kPending of this thread's committed groups are still
// in flight (cp.async.wait_group): the older groups' copies are then
// visible to this thread.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#elif defined(ATTNRES_EMULATED_CP_ASYNC)
  emu::cp_async_wait(kPending);
#endif
}

__device__ __forceinline__ void copy_async_commit_and_wait() {
  copy_async_commit();
  copy_async_wait<0>();
}

// The dot products the kernels take of each of SU rows held in registers,
// over this thread's slice (the group all-reduce completes them):
//   sums[2j]     = <v_j, v_j>  (kSquares)  or  <dh, v_j>
//   sums[2j + 1] = <u, v_j>                (unless kDhOnly)
enum class RowDots { kSquaresAndU, kDhAndU, kDhOnly };

// VEC elements of u at u + c: from shared memory (kShared: the backward's
// copy of u) or global memory (the forward).
template <bool kShared, typename acc_t, int VEC>
__device__ __forceinline__ Pack<acc_t, VEC> load_u(const acc_t* u) {
  if constexpr (kShared) {
    // In 16-byte words (a pack of 8 floats is 32-byte aligned as a type,
    // the shared copy only 16-byte aligned).
    Pack<acc_t, VEC> out;
    constexpr int kBytes = static_cast<int>(sizeof(out));
    if constexpr (kBytes % 16 == 0) {
      uint4 words[kBytes / 16];
#pragma unroll
      for (int w = 0; w < kBytes / 16; ++w) words[w] = reinterpret_cast<const uint4*>(u)[w];
      __builtin_memcpy(&out, words, kBytes);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) out.x[e] = u[e];
    }
    return out;
  } else {
    return load_global<acc_t, VEC>(u);
  }
}

template <RowDots kDots, bool kUShared = false, typename scalar_t, int VEC, int VPT, int SU,
          typename acc_t>
__device__ __forceinline__ void row_dots(const Pack<scalar_t, VEC> (&rows)[SU][VPT],
                                         const Pack<scalar_t, VEC> (&dh)[VPT], const acc_t* u,
                                         int lane, int G, int D, acc_t (&sums)[2 * SU]) {
#pragma unroll
  for (int j = 0; j < 2 * SU; ++j) sums[j] = acc_t(0);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = (k * G + lane) * VEC;
    // Rows and dh are zero past D; u is not, and is not read there.
    if (kDots == RowDots::kDhOnly || c < D) {
      Pack<acc_t, VEC> uk;
      if constexpr (kDots != RowDots::kDhOnly) uk = load_u<kUShared, acc_t, VEC>(u + c);
#pragma unroll
      for (int j = 0; j < SU; ++j) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const acc_t v = static_cast<acc_t>(rows[j][k].x[e]);
          const acc_t x =
              kDots == RowDots::kSquaresAndU ? v : static_cast<acc_t>(dh[k].x[e]);
          sums[2 * j] += x * v;
          if constexpr (kDots != RowDots::kDhOnly) sums[2 * j + 1] += uk.x[e] * v;
        }
      }
    }
  }
}

// Issues the copies of this thread's packs of token t's N rows into a
// staging area (entry (i, k) of lane l at [(i*VPT+k)*G+l]: the packs the
// register path would load, zero-filled past D by the reader), without
// committing them. Each thread later reads back only the bytes it copied
// itself, so only its own wait_group is needed, no barrier. Used by the
// backward's staging and both rings (ring_fill).
template <typename scalar_t, int VEC, int VPT, int kGroup, typename Params>
__device__ __forceinline__ void copy_token_rows_async(const Params& p,
                                                      const ThreadPlace<kGroup>& pos, int64_t t,
                                                      Pack<scalar_t, VEC>* stage) {
  static_assert(sizeof(Pack<scalar_t, VEC>) == 16, "cp.async stages 16-byte packs");
  for (int i = 0; i < pos.N; ++i) {
    const scalar_t* row = source_row<scalar_t>(p.table, p.overflow, i, t);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = (k * pos.G + pos.lane) * VEC;
      if (c < pos.D) copy_async_16(&stage[(i * VPT + k) * pos.G + pos.lane], row + c);
    }
  }
}

// The rings (forward and backward kRing kernels): issues the copies of this
// group's token of token block tb into `stage` (nothing past the last token
// block; surplus groups of the last block copy a valid token, like the
// register path) and commits them as one group, so every thread commits one
// group per token block and wait_group counts alike in every thread.
template <typename scalar_t, int VEC, int VPT, int kGroup, typename Params>
__device__ __forceinline__ void ring_fill(const Params& p, const ThreadPlace<kGroup>& pos,
                                          int64_t tb, Pack<scalar_t, VEC>* stage) {
  if (tb < p.token_blocks) {
    const int64_t t_wanted = tb * p.tokens_per_cta + pos.group;
    const int64_t t = t_wanted < pos.T ? t_wanted : pos.T - 1;
    copy_token_rows_async<scalar_t, VEC, VPT>(p, pos, t, stage);
  }
  copy_async_commit();
}

// The ring's wait before a token block (kRing kernels): its stage's copies
// are done; the stages - 1 younger groups may still be in flight.
__device__ __forceinline__ void ring_wait(int stages) {
  if (stages == 3) {
    copy_async_wait<2>();
  } else {
    copy_async_wait<1>();
  }
}

// Rows i0 .. i0+SU-1 (zeros past N and past D) of the token staged in
// `stage` by copy_token_rows_async (this thread's own packs).
template <int SU, typename scalar_t, int VEC, int VPT, int kGroup>
__device__ __forceinline__ void read_staged_rows(const Pack<scalar_t, VEC>* stage,
                                                 const ThreadPlace<kGroup>& pos, int i0,
                                                 Pack<scalar_t, VEC> (&rows)[SU][VPT]) {
#pragma unroll
  for (int j = 0; j < SU; ++j) {
    const int i = i0 + j;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = (k * pos.G + pos.lane) * VEC;
      rows[j][k] = i < pos.N && c < pos.D ? stage[(i * VPT + k) * pos.G + pos.lane]
                                          : zero_pack<scalar_t, VEC>();
    }
  }
}

// ---------------------------------------------------------------------------
// Forward pieces shared by the kernel's fast path and its rare rescue.

// The fused prefix add (docs/design.md §12): pack c of the last source of
// token t holds P's values v, read as P' = v + delta rounded to the source
// dtype from the accumulation dtype, as torch.add rounds. The fast path
// stores P' (forward_prefix_add); the rescue forms it again, the same bits,
// instead of reading that store back.
template <typename scalar_t, int VEC, LoadHint kHint = LoadHint::kKeep>
__device__ __forceinline__ Pack<scalar_t, VEC> prefix_added(const ForwardParams<scalar_t>& p,
                                                            int64_t t, int c,
                                                            const Pack<scalar_t, VEC>& v) {
  using acc_t = at::opmath_type<scalar_t>;
  const Pack<scalar_t, VEC> d =
      load_global<scalar_t, VEC, kHint>(p.prefix_delta + t * p.prefix_delta_stride + c);
  Pack<scalar_t, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    o.x[e] = static_cast<scalar_t>(static_cast<acc_t>(v.x[e]) + static_cast<acc_t>(d.x[e]));
  }
  return o;
}

// Pack c of source i of token t as the read sees it (the rescue's loads).
template <typename scalar_t, int VEC>
__device__ __forceinline__ Pack<scalar_t, VEC> forward_source_pack(
    const ForwardParams<scalar_t>& p, int i, int64_t t, int c) {
  const Pack<scalar_t, VEC> v =
      load_global<scalar_t, VEC>(source_row<scalar_t>(p.table, p.overflow, i, t) + c);
  return p.prefix_delta != nullptr && i == p.N - 1 ? prefix_added<scalar_t, VEC>(p, t, c, v)
                                                   : v;
}

// The fast path's prefix add: the last source's row in registers becomes P',
// stored once by the group of an active token (a surplus group computes on a
// token another group stores).
template <typename scalar_t, int VEC, int VPT, int kGroup>
__device__ __forceinline__ void forward_prefix_add(const ForwardParams<scalar_t>& p,
                                                   const ThreadPlace<kGroup>& pos, int64_t t,
                                                   bool active,
                                                   Pack<scalar_t, VEC> (&row)[VPT]) {
  scalar_t* sum = p.prefix_sum + t * static_cast<int64_t>(pos.D);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = (k * pos.G + pos.lane) * VEC;
    if (c < pos.D) {
      row[k] = prefix_added<scalar_t, VEC, LoadHint::kStream>(p, t, c, row[k]);
      if (active) store_global<scalar_t, VEC>(sum + c, row[k]);
    }
  }
}

// Turns the parked scores of token t into weights (the lanes that parked
// them).
template <typename scalar_t, int kGroup>
__device__ __forceinline__ void forward_finish_weights(
    const ForwardParams<scalar_t>& p, const ThreadPlace<kGroup>& pos, int64_t t,
    const math::OnlineSoftmax<at::opmath_type<scalar_t>>& sm) {
  for (int i = pos.lane; i < pos.N; i += pos.G) {
    const int64_t idx = static_cast<int64_t>(i) * pos.T + t;
    p.weights[idx] = sm.weight(p.weights[idx]);
  }
}

// Stores h and turns the parked scores into weights (token t).
template <typename scalar_t, int VEC, int VPT, int kGroup>
__device__ __forceinline__ void forward_store_token(
    const ForwardParams<scalar_t>& p, const ThreadPlace<kGroup>& pos, int64_t t,
    const at::opmath_type<scalar_t> (&acc)[VPT][VEC],
    const math::OnlineSoftmax<at::opmath_type<scalar_t>>& sm) {
  using acc_t = at::opmath_type<scalar_t>;
  using Row = Pack<scalar_t, VEC>;
  const acc_t f = sm.out_factor();
  scalar_t* out_row = p.out + t * static_cast<int64_t>(pos.D);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = (k * pos.G + pos.lane) * VEC;
    if (c < pos.D) {
      Row o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o.x[e] = static_cast<scalar_t>(acc[k][e] * f);
      store_global<scalar_t, VEC, true>(out_row + c, o);
    }
  }
  forward_finish_weights(p, pos, t, sm);
}

// h as the fused output norm sees it: rounded to the source dtype (the h
// the backward is given, so its n = r h and r agree; also what an unfused
// read + RMSNorm normalizes; docs/design.md §11), held in the accumulation
// dtype.
template <typename scalar_t>
__device__ __forceinline__ at::opmath_type<scalar_t> norm_input(at::opmath_type<scalar_t> h) {
  return static_cast<at::opmath_type<scalar_t>>(static_cast<scalar_t>(h));
}

// One pack of the fused output norm's result, (h r) * w, and of h (already
// rounded: norm_input), in the source dtype.
template <typename scalar_t, int VEC>
__device__ __forceinline__ void forward_store_normed_pack(const ForwardParams<scalar_t>& p,
                                                          int64_t t, int D, int c,
                                                          const at::opmath_type<scalar_t> (&h)[VEC],
                                                          at::opmath_type<scalar_t> r) {
  using acc_t = at::opmath_type<scalar_t>;
  using Row = Pack<scalar_t, VEC>;
  const Pack<acc_t, VEC> w = load_global<acc_t, VEC>(p.norm_weight + c);
  Row y, hr;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    y.x[e] = static_cast<scalar_t>((h[e] * r) * w.x[e]);
    hr.x[e] = static_cast<scalar_t>(h[e]);
  }
  const int64_t at = t * static_cast<int64_t>(D) + c;
  store_global<scalar_t, VEC, true>(p.out + at, y);
  if (p.norm_h) store_global<scalar_t, VEC, true>(p.norm_h + at, hr);
}

// The fused output norm's epilogue (token t, every thread of the reduction
// peers calls it): r from sum(h^2) of the accumulator in registers (h
// rounded as norm_input; one
// group reduction; a second one, with the row scaled by a power of two, only
// when some peer's sum is out of range, math::row_needs_rescale), then, when
// `store`, (h r) * w and h stored once from the registers and the weights
// finished. Returns the parity.
template <typename scalar_t, int VEC, int VPT, int kGroup>
__device__ __forceinline__ int forward_store_token_normed(
    const ForwardParams<scalar_t>& p, const ThreadPlace<kGroup>& pos, int64_t t,
    const at::opmath_type<scalar_t> (&acc)[VPT][VEC],
    const math::OnlineSoftmax<at::opmath_type<scalar_t>>& sm, bool store,
    at::opmath_type<scalar_t>* red, int parity) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t f = sm.out_factor();
  auto h_at = [&](int k, int e) { return norm_input<scalar_t>(acc[k][e] * f); };
  // sum((h scale)^2) over the group (scale 1: x * 1 is x, folded away).
  auto sum_squares = [&](acc_t scale) {
    acc_t ss[1] = {acc_t(0)};
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if ((k * pos.G + pos.lane) * VEC >= pos.D) continue;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const acc_t x = h_at(k, e) * scale;
        ss[0] += x * x;
      }
    }
    group_allreduce<1>(ss, pos, red, parity);
    return ss[0];
  };
  const acc_t ss = sum_squares(acc_t(1));
  acc_t r = math::rstd_from_sumsq(ss, pos.D, p.norm_eps);
  const bool rescale = math::row_needs_rescale(ss, acc_t(0), p.norm_eps);
  if (reduction_peers_any(rescale, pos, p.tokens_per_cta)) {
    const acc_t scale = rescale ? math::rescale_factor(ss) : acc_t(1);
    const acc_t sc = sum_squares(scale);
    if (rescale) {
      r = math::out_norm_rstd_rescaled(sc, scale, static_cast<int64_t>(pos.D), p.norm_eps);
    }
  }
  if (store) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = (k * pos.G + pos.lane) * VEC;
      if (c < pos.D) {
        acc_t h[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) h[e] = h_at(k, e);
        forward_store_normed_pack<scalar_t, VEC>(p, t, pos.D, c, h, r);
      }
    }
    if (pos.lane == 0) p.norm_rstd[t] = r;
    forward_finish_weights(p, pos, t, sm);
  }
  return parity;
}

// Folds source i (score s, row in registers) into the token's softmax and
// normalized weighted sum.
template <typename scalar_t, int VEC, int VPT>
__device__ __forceinline__ void forward_fold_row(
    int i, at::opmath_type<scalar_t> s, const Pack<scalar_t, VEC> (&row)[VPT],
    at::opmath_type<scalar_t> (&acc)[VPT][VEC],
    math::OnlineSoftmax<at::opmath_type<scalar_t>>& sm) {
  using acc_t = at::opmath_type<scalar_t>;
  if (i == 0) {
    sm.init(s);  // acc starts as a copy of v_0, as on the CPU
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[k][e] = static_cast<acc_t>(row[k].x[e]);
    }
  } else {
    acc_t keep, take;
    sm.push(s, keep, take);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        acc[k][e] = math::online_accumulate(acc[k][e], keep, take,
                                            static_cast<acc_t>(row[k].x[e]));
      }
    }
  }
}

// Synchronizes the threads that voted together (reduction_peers_any): the
// warp (G <= 32) or the CTA. Orders their global memory accesses too.
template <int kGroup>
__device__ __forceinline__ void sync_reduction_peers(const ThreadPlace<kGroup>& pos) {
  if (!pos.multi_warp()) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}

// The rescue's pack of h at column c of token t: sum_i w_i v_i from the
// final weights (the scores parked in p.weights), kept finite
// (math::keep_finite: the weights sum to 1 only up to rounding, and rows at
// the dtype's maximum would give inf). No per-element bounds: the rescue is
// inlined, and the registers it holds count for the fast path too.
template <typename scalar_t, int VEC>
__device__ __forceinline__ void forward_rescued_pack(
    const ForwardParams<scalar_t>& p, int N, int64_t T, int64_t t, int c,
    const math::OnlineSoftmax<at::opmath_type<scalar_t>>& sm,
    at::opmath_type<scalar_t> (&h)[VEC]) {
  using acc_t = at::opmath_type<scalar_t>;
  using Row = Pack<scalar_t, VEC>;
#pragma unroll
  for (int e = 0; e < VEC; ++e) h[e] = acc_t(0);
  for (int i = 0; i < N; ++i) {
    const acc_t w = sm.weight(p.weights[static_cast<int64_t>(i) * T + t]);
    const Row v = forward_source_pack<scalar_t, VEC>(p, i, t, c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) h[e] += w * static_cast<acc_t>(v.x[e]);
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) h[e] = math::keep_finite<acc_t>(h[e]);
}

// The rare rescue of token t (docs/design.md §8), called by every thread
// that voted with this one: the rows' rstd and scores again, with the
// rescued sums (row scaled by a power of two) where the plain sums are out
// of range; then, when `store`, h from the weights, one pack at a time.
// Rows are streamed from memory and nothing but one pack is accumulated,
// so it adds no register pressure to the fast path. kNorm: h is formed
// again, for its sum of squares (the output norm's r, rescued in turn when
// out of range), and stored as (h r) * w (and h). Returns the parity.
template <typename scalar_t, int VEC, int VPT, bool kNorm, int kGroup>
__device__ __forceinline__ int forward_token_rescue(const ForwardParams<scalar_t>& p,
                                                    const ThreadPlace<kGroup>& pos, int64_t t, bool store,
                                                    at::opmath_type<scalar_t>* red, int parity) {
  using acc_t = at::opmath_type<scalar_t>;
  using Row = Pack<scalar_t, VEC>;
  math::OnlineSoftmax<acc_t> sm;
  sm.m = acc_t(0);
  sm.l = acc_t(1);
  for (int i = 0; i < pos.N; ++i) {
    // <x, x> and <u, x> over the group for x = v_i * scale. With scale 1
    // (x * 1 is x): the plain sums in row_dots' order, the same bits as the
    // fast path; then the rescued ones.
    auto sums_of = [&](acc_t scale, acc_t (&sums)[2]) {
      sums[0] = sums[1] = acc_t(0);
#pragma unroll 1
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        if (c >= pos.D) continue;
        const Row v = forward_source_pack<scalar_t, VEC>(p, i, t, c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const acc_t x = static_cast<acc_t>(v.x[e]) * scale;
          sums[0] += x * x;
          sums[1] += p.u[c + e] * x;
        }
      }
      group_allreduce<2>(sums, pos, red, parity);
    };
    acc_t sums[2], scaled[2];
    sums_of(acc_t(1), sums);
    const bool need = math::row_needs_rescale(sums[0], sums[1], p.eps);
    const acc_t scale = need ? math::rescale_factor(sums[0]) : acc_t(1);
    sums_of(scale, scaled);
    acc_t r, sc;
    if (need) {
      math::rescaled_stats(scaled[0], scaled[1], scale, static_cast<int64_t>(pos.D), p.eps, r, sc);
    } else {
      r = math::rstd_from_sumsq(sums[0], pos.D, p.eps);
      sc = math::score(r, sums[1]);
    }
    if (store && pos.lane == i % pos.G) {
      const int64_t idx = static_cast<int64_t>(i) * pos.T + t;
      p.rstd[idx] = r;
      p.weights[idx] = sc;  // parked: read back below
    }
    if (i == 0) {
      sm.init(sc);
    } else {
      acc_t keep, take;
      sm.push(sc, keep, take);
    }
  }
  sync_reduction_peers(pos);  // the parked scores are visible
  if constexpr (kNorm) {
    // This thread's pack of h at column c, from the weights (the same bits
    // each time).
    const acc_t f = sm.out_factor();
    auto h_pack = [&](int c, acc_t (&h)[VEC]) {
      forward_rescued_pack<scalar_t, VEC>(p, pos.N, pos.T, t, c, sm, h);
#pragma unroll
      for (int e = 0; e < VEC; ++e) h[e] = norm_input<scalar_t>(h[e] * f);
    };
    // <x, x> over the group for x = h * scale (the packs summed where
    // `sum`; every thread takes part in the reduction).
    auto sum_squares = [&](bool sum, acc_t scale) {
      acc_t ss[1] = {acc_t(0)};
#pragma unroll 1
      for (int k = 0; sum && k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        if (c >= pos.D) continue;
        acc_t h[VEC];
        h_pack(c, h);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const acc_t x = h[e] * scale;
          ss[0] += x * x;
        }
      }
      group_allreduce<1>(ss, pos, red, parity);
      return ss[0];
    };
    const acc_t ss = sum_squares(store, acc_t(1));
    const bool rescale = store && math::row_needs_rescale(ss, acc_t(0), p.norm_eps);
    const acc_t scale = rescale ? math::rescale_factor(ss) : acc_t(1);
    const acc_t sc = sum_squares(rescale, scale);
    const acc_t r = rescale ? math::out_norm_rstd_rescaled(sc, scale,
                                                           static_cast<int64_t>(pos.D), p.norm_eps)
                            : math::rstd_from_sumsq(ss, pos.D, p.norm_eps);
    if (store) {
#pragma unroll 1
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        if (c >= pos.D) continue;
        acc_t h[VEC];
        h_pack(c, h);
        forward_store_normed_pack<scalar_t, VEC>(p, t, pos.D, c, h, r);
      }
      if (pos.lane == 0) p.norm_rstd[t] = r;
    }
  } else if (store) {
    const acc_t f = sm.out_factor();
    scalar_t* out_row = p.out + t * static_cast<int64_t>(pos.D);
#pragma unroll 1
    for (int k = 0; k < VPT; ++k) {
      const int c = (k * pos.G + pos.lane) * VEC;
      if (c >= pos.D) continue;
      acc_t acc[VEC];
      forward_rescued_pack<scalar_t, VEC>(p, pos.N, pos.T, t, c, sm, acc);
      Row o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o.x[e] = static_cast<scalar_t>(acc[e] * f);
      store_global<scalar_t, VEC>(out_row + c, o);
    }
  }
  sync_reduction_peers(pos);  // every read of the parked scores is done
  if (store) forward_finish_weights(p, pos, t, sm);
  return parity;
}

// ---------------------------------------------------------------------------
// Forward: one pass over the sources with an online softmax; each source row
// is read from global memory exactly once. kNorm (the fused output norm):
// the epilogue normalizes h in registers before its one store
// (forward_store_token_normed). kRing (plan_forward; 16-byte packs): the
// rows come through a ring of p.ring_stages shared-memory stages per group
// instead of registers — stage s holds the N rows of the group's token in
// the CTA's (s + S j)-th token block of its grid-stride loop, copied with
// cp.async one commit group per token block; before a token the thread
// waits for its oldest group (wait_group S-1), reads its rows there, and
// refills the stage with the token S blocks ahead. Each thread reads back
// only the packs it copied (copy_token_rows_async): no barrier. The same
// arithmetic in the same order as the register pipeline: the same bits.
// kGroup: the class of G (group_class, launch.h). __launch_bounds__ states
// one CTA per SM as the minimum (kKernelMinCtas): without it ptxas picks 64
// registers and spills for some kernels (the small ring tiles fp16 <8, 1>,
// fp32 <4, 1>, <4, 2>; the fp32 normed forward of the group class 32; the
// fp64 32-element tiles) where 128 are allowed.
template <typename scalar_t, int VEC, int VPT, bool kNorm, int kGroup, bool kRing = false>
__global__ void __launch_bounds__(kMaxThreads, kKernelMinCtas)
    depth_attention_fwd_kernel(const __grid_constant__ ForwardParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  using Row = Pack<scalar_t, VEC>;
  constexpr int SU = Tile<scalar_t, VEC, VPT>::SU;
  static_assert(!kRing || sizeof(Row) == 16, "the ring copies 16-byte packs");
  __shared__ __align__(16) acc_t red[2 * kMaxWarps * kMaxReduce];

  const ThreadPlace<kGroup> pos(p);
  int parity = 0;

  // kRing: this group's stages (stage s at ring + s * stage_packs), the
  // first S token blocks in flight before the loop; `slot` is the stage of
  // the current token block.
  Row* ring = nullptr;
  int64_t stage_packs = 0;
  int slot = 0;
  if constexpr (kRing) {
    ATTNRES_DYNAMIC_SMEM(dynamic_smem);
    stage_packs = static_cast<int64_t>(pos.N) * VPT * pos.G;
    ring = reinterpret_cast<Row*>(dynamic_smem) + pos.group * p.ring_stages * stage_packs;
    for (int s = 0; s < p.ring_stages; ++s) {
      ring_fill<scalar_t, VEC, VPT>(
          p, pos, static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(s) * gridDim.x,
          ring + s * stage_packs);
    }
  }

  for (int64_t tb = blockIdx.x; tb < p.token_blocks; tb += gridDim.x) {
    // Surplus groups of the last block compute on a valid token (so every
    // thread reaches the barriers) and store nothing.
    const int64_t t_wanted = tb * p.tokens_per_cta + pos.group;
    const bool active = t_wanted < pos.T;
    const int64_t t = active ? t_wanted : pos.T - 1;

    acc_t acc[VPT][VEC];
    math::OnlineSoftmax<acc_t> sm;
    sm.m = acc_t(0);
    sm.l = acc_t(1);
    bool rescue = false;  // a row's plain sums are out of range (group-uniform)

    // Software pipeline (when registers allow): the next batch's loads are
    // issued before this batch's reduction, so they are in flight while it
    // runs. The ring reads its rows from shared memory instead.
    constexpr bool kPrefetch = !kRing && Tile<scalar_t, VEC, VPT>::kPrefetch;
    const Row* stage = nullptr;
    if constexpr (kRing) {
      // This token block's copies are done (the S - 1 younger ones may be
      // in flight).
      ring_wait(p.ring_stages);
      stage = ring + slot * stage_packs;
    }
    Row next[SU][VPT];
    if constexpr (kPrefetch) {
      load_rows<scalar_t, VEC, VPT, SU, LoadHint::kStream>(p.table, p.overflow, 0, pos.N, t,
                                                            pos.lane, pos.G, pos.D, next);
    }
    for (int i0 = 0; i0 < pos.N; i0 += SU) {
      Row rows[SU][VPT];
      if constexpr (kRing) {
        read_staged_rows<SU>(stage, pos, i0, rows);
      } else if constexpr (kPrefetch) {
#pragma unroll
        for (int j = 0; j < SU; ++j) {
#pragma unroll
          for (int k = 0; k < VPT; ++k) rows[j][k] = next[j][k];
        }
        if (i0 + SU < pos.N) {
          load_rows<scalar_t, VEC, VPT, SU, LoadHint::kStream>(
              p.table, p.overflow, i0 + SU, pos.N, t, pos.lane, pos.G, pos.D, next);
        }
      } else {
        load_rows<scalar_t, VEC, VPT, SU, LoadHint::kStream>(p.table, p.overflow, i0, pos.N, t,
                                                             pos.lane, pos.G, pos.D, rows);
      }
      // The fused prefix add (§12): the last source's row becomes P'.
      if (p.prefix_delta != nullptr) {
#pragma unroll
        for (int j = 0; j < SU; ++j) {
          if (i0 + j == pos.N - 1) {
            forward_prefix_add<scalar_t, VEC, VPT>(p, pos, t, active, rows[j]);
          }
        }
      }
      // Per row: sum(v^2) and dot(u, v).
      acc_t sums[2 * SU];
      row_dots<RowDots::kSquaresAndU>(rows, rows[0], p.u, pos.lane, pos.G, pos.D, sums);
      group_allreduce<2 * SU>(sums, pos, red, parity);

#pragma unroll
      for (int j = 0; j < SU; ++j) {
        const int i = i0 + j;
        if (i < pos.N) {
          const acc_t r = math::rstd_from_sumsq(sums[2 * j], pos.D, p.eps);
          const acc_t s = math::score(r, sums[2 * j + 1]);
          rescue = rescue || math::row_needs_rescale(sums[2 * j], sums[2 * j + 1], p.eps);
          // The score is parked in `weights` by the lane that will turn it
          // into a weight once the softmax is complete (same thread: no
          // synchronization needed).
          if (active && pos.lane == i % pos.G) {
            const int64_t idx = static_cast<int64_t>(i) * pos.T + t;
            p.rstd[idx] = r;
            p.weights[idx] = s;
          }
          forward_fold_row<scalar_t, VEC, VPT>(i, s, rows[j], acc, sm);
        }
      }
    }

    if constexpr (kRing) {
      // The stage is read (into registers, all used above): refill it with
      // the token S blocks ahead, in flight during the S - 1 token blocks
      // in between.
      ring_fill<scalar_t, VEC, VPT>(
          p, pos, tb + static_cast<int64_t>(p.ring_stages) * gridDim.x, ring + slot * stage_packs);
      slot = slot + 1 == p.ring_stages ? 0 : slot + 1;
    }

    if constexpr (kNorm) {
      parity = forward_store_token_normed<scalar_t, VEC, VPT>(p, pos, t, acc, sm,
                                                              active && !rescue, red, parity);
    } else {
      if (active && !rescue) forward_store_token<scalar_t, VEC, VPT>(p, pos, t, acc, sm);
    }

    // Rare: a row of some token of this warp/CTA is out of range
    // (math::row_needs_rescale): that token is computed again.
    if (reduction_peers_any(rescue, pos, p.tokens_per_cta)) {
      parity = forward_token_rescue<scalar_t, VEC, VPT, kNorm>(p, pos, t, rescue && active, red,
                                                               parity);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward rare path (docs/design.md §8): it reads the rows (staged or
// global) and dh from memory one pack at a time and adds its query/gain
// gradient terms to the CTA's partial row in global memory, so it holds no
// registers across the fast path's (the row batches, dh and z stay where
// they are).

// This thread's element (k, e) of row i of token t, or 0 past D.
template <typename scalar_t, int VEC, int VPT, int kGroup>
__device__ __forceinline__ Pack<scalar_t, VEC> rare_fetch(const BackwardParams<scalar_t>& p,
                                                          const ThreadPlace<kGroup>& pos, int i,
                                                          int64_t t, int k) {
  using Row = Pack<scalar_t, VEC>;
  const int c = (k * pos.G + pos.lane) * VEC;
  if (c >= pos.D) return zero_pack<scalar_t, VEC>();
  if (!backward_single_pass<scalar_t>() && p.stage) {
    ATTNRES_DYNAMIC_SMEM(dynamic_smem);
    const Row* stage = reinterpret_cast<const Row*>(
                           dynamic_smem + u_smem_bytes(pos.D, sizeof(at::opmath_type<scalar_t>))) +
                       static_cast<int64_t>(pos.group) * pos.N * VPT * pos.G;
    return stage[(i * VPT + k) * pos.G + pos.lane];
  }
  return load_global<scalar_t, VEC>(source_row<scalar_t>(p.table, p.overflow, i, t) + c);
}

// The fused output norm's dh of one element from dy and h (token rstd r,
// c = <g, n>/D): r (g - c n) with g = dy w, n = r h, rounded to the source
// dtype like the plain op's incoming dh. The fast path and the rare path
// both form it here (the same bits).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ scalar_t norm_dh(acc_t r, acc_t c, acc_t w, scalar_t dy, scalar_t h) {
  return static_cast<scalar_t>(
      math::out_norm_grad(r, static_cast<acc_t>(dy) * w, c, r * static_cast<acc_t>(h)));
}

// Adds one pack's terms of <g, n> = sum (dy w)(r h) to gn, in element
// order (the fast path and the rare path sum in the same order: the same
// bits).
template <typename scalar_t, int VEC>
__device__ __forceinline__ void norm_gn_add(at::opmath_type<scalar_t>& gn,
                                            const Pack<scalar_t, VEC>& dy,
                                            const Pack<scalar_t, VEC>& h,
                                            const Pack<at::opmath_type<scalar_t>, VEC>& w,
                                            at::opmath_type<scalar_t> r) {
  using acc_t = at::opmath_type<scalar_t>;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    gn += (static_cast<acc_t>(dy.x[e]) * w.x[e]) * (r * static_cast<acc_t>(h.x[e]));
  }
}

// c = <g, n> / D of token t again, for the rare path (every thread of the
// CTA calls it), from memory one pack at a time: the fast path's r and c
// are not kept in registers across the sweep.
template <typename scalar_t, int VEC, int VPT, int kGroup>
__device__ __forceinline__ at::opmath_type<scalar_t> norm_token_c(
    const BackwardParams<scalar_t>& p, const ThreadPlace<kGroup>& pos, int64_t t,
    at::opmath_type<scalar_t> r, at::opmath_type<scalar_t>* red, int& parity) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t gn[1] = {acc_t(0)};
#pragma unroll 1
  for (int k = 0; k < VPT; ++k) {
    const int c = (k * pos.G + pos.lane) * VEC;
    if (c < pos.D) {
      norm_gn_add<scalar_t, VEC>(
          gn[0], load_global<scalar_t, VEC>(p.grad_out + t * p.grad_out_stride + c),
          load_global<scalar_t, VEC>(p.out + t * p.out_stride + c),
          load_global<acc_t, VEC>(p.norm_weight + c), r);
    }
  }
  group_allreduce<1>(gn, pos, red, parity);
  return gn[0] / static_cast<acc_t>(pos.D);
}

// kNorm: this thread's accumulators of the weight gradient (element j at
// [j * blockDim.x + threadIdx.x], bank-conflict free): in global memory
// (p.norm_dw_slots, a block of them per CTA) or shared memory. Formed at
// each use rather than kept in a register across the sweep.
template <typename scalar_t, int VEC, int VPT>
__device__ __forceinline__ at::opmath_type<scalar_t>* norm_dw_slots(
    const BackwardParams<scalar_t>& p, unsigned char* dynamic_smem) {
  using acc_t = at::opmath_type<scalar_t>;
  return p.norm_dw_slots
             ? p.norm_dw_slots + static_cast<int64_t>(blockIdx.x) * blockDim.x * VPT * VEC
             : reinterpret_cast<acc_t*>(dynamic_smem + p.norm_slots_offset);
}

// This thread's pack k of dh for token t: read (the plain op), or formed
// again from dy and h (kNorm; norm_r, norm_c: the token's r and <g, n>/D).
template <bool kNorm, typename scalar_t, int VEC, int kGroup>
__device__ __forceinline__ Pack<scalar_t, VEC> rare_fetch_dh(
    const BackwardParams<scalar_t>& p, const ThreadPlace<kGroup>& pos, int64_t t, int k,
    at::opmath_type<scalar_t> norm_r, at::opmath_type<scalar_t> norm_c) {
  const int c = (k * pos.G + pos.lane) * VEC;
  if (c >= pos.D) return zero_pack<scalar_t, VEC>();
  Pack<scalar_t, VEC> g = load_global<scalar_t, VEC>(p.grad_out + t * p.grad_out_stride + c);
  if constexpr (kNorm) {
    const Pack<scalar_t, VEC> h = load_global<scalar_t, VEC>(p.out + t * p.out_stride + c);
    const auto w = load_global<at::opmath_type<scalar_t>, VEC>(p.norm_weight + c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) g.x[e] = norm_dh(norm_r, norm_c, w.x[e], g.x[e], h.x[e]);
  }
  return g;
}

// Backward: rows i0 .. i0+SU-1 of token t (zeros past N and past D), from
// this group's staging area (two-pass, staged) or from global memory.
template <LoadHint kHint, int SU, typename scalar_t, int VEC, int VPT, int kGroup>
__device__ __forceinline__ void backward_fetch_rows(const BackwardParams<scalar_t>& p,
                                                    const ThreadPlace<kGroup>& pos,
                                                    const Pack<scalar_t, VEC>* stage, bool staged,
                                                    int i0, int64_t t,
                                                    Pack<scalar_t, VEC> (&rows)[SU][VPT]) {
#pragma unroll
  for (int j = 0; j < SU; ++j) {
    const int i = i0 + j;
    if (i < pos.N) {
      const scalar_t* row = staged ? nullptr : source_row<scalar_t>(p.table, p.overflow, i, t);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        if (c < pos.D) {
          rows[j][k] = staged ? stage[(i * VPT + k) * pos.G + pos.lane]
                              : load_global<scalar_t, VEC, kHint>(row + c);
        } else {
          rows[j][k] = zero_pack<scalar_t, VEC>();
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < VPT; ++k) rows[j][k] = zero_pack<scalar_t, VEC>();
    }
  }
}

// ---------------------------------------------------------------------------
// Backward. Per token, sum_a_dp = sum_j a_j dp_j (dp_j = <dh, v_j> + gw_j):
//  - single-pass (float32/float64, backward_single_pass): sum_a_dp =
//    <dh, h> + sum_j a_j gw_j from the forward's h (docs/design.md §2), one
//    reduction, before any source row is read; then
//  - per source: dp_i = <dh, v_i>, s_i = r_i <u, v_i> (reduced), then
//    dv_i = a_i dh + alpha_i u + beta_i v_i, written once from the row in
//    registers, and z += alpha_i v_i in registers.
// Each source row is read from global memory once (twice for a saturated
// token, below).
//  - two-pass (bfloat16/float16: their rounded h loses too many bits, §8):
//    a first pass over the rows gives sum_a_dp from the saved weights, then
//    the sweep above. v_i is needed in both passes. When the token's N rows
//    fit the staging budget they are copied once into shared memory
//    (cp.async) and both passes read them there; otherwise the sweep reads
//    them again from global memory, in reverse order so the most recently
//    read rows (likeliest in L2) go first.
// A token whose largest weight a_p exceeds 1/2 takes the pivoted form
// (depth_math.h) from pass 1's lane partials: sum_{j != p} a_j dp_j and dp_p
// reduced together, then dp_i - dp_p in the sweep. The single pass does so
// only for a saturated token (a_p > 15/16), with a pass 1 of its own; else
// it keeps the plain form from <dh, h>.
// z: per-CTA partial rows, summed in a fixed order by a second kernel.
// kNorm (the fused output norm): grad_out is dy; the prologue reads dy and
// h once, forms dh = r (g - c n) in registers (one group reduction for
// <g, n>) and adds dy n to this thread's weight-gradient accumulators
// (shared or global memory, not registers: they live across the sweep);
// the rest is the plain backward from dh. The accumulators become one
// partial row per CTA (groups in a fixed order), summed like z's.
// kRing (plan_backward; 16-byte packs, either backward): the rows come
// through a ring of p.ring_stages shared-memory stages per group after u, as
// in the forward: stage s holds the N rows of the group's token in the CTA's
// (s + S j)-th token block, copied with cp.async one commit group per token
// block (ring_fill); before a token block the thread waits for its oldest
// group (ring_wait), both passes (two-pass) or the one sweep (single pass)
// read the rows there, and after the sweep the stage is refilled with the
// token S blocks ahead. Each thread reads back only the packs it copied: no
// barrier. The rare path reads the rows from global memory (the stage is
// being refilled by then). The same arithmetic in the same order as the
// kernel without the ring: the same bits.
template <typename scalar_t, int VEC, int VPT, bool kNorm, int kGroup, bool kRing = false>
__global__ void __launch_bounds__(kMaxThreads, kKernelMinCtas)
    depth_attention_bwd_kernel(const __grid_constant__ BackwardParams<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  using Row = Pack<scalar_t, VEC>;
  using Acc = Pack<acc_t, VEC>;
  using Wide = typename math::WideType<acc_t>::type;
  // fp64 sources have no wider type on the device: no rare path there
  // (docs/design.md §8 states the limit).
  constexpr bool kHasRarePath = !std::is_same<Wide, acc_t>::value;
  constexpr bool kSinglePass = backward_single_pass<scalar_t>();
  constexpr int SU = Tile<scalar_t, VEC, VPT>::SU;
  static_assert(!kRing || sizeof(Row) == 16, "the ring copies 16-byte packs");
  __shared__ __align__(16) acc_t red[2 * kMaxWarps * kMaxReduce];
  ATTNRES_DYNAMIC_SMEM(dynamic_smem);

  const ThreadPlace<kGroup> pos(p);
  int parity = 0;
  // The ring, the staging area or the z sum follow u.
  unsigned char* const after_u = dynamic_smem + u_smem_bytes(pos.D, sizeof(acc_t));
  // kRing: this group's stages (stage s at packs ring_first + s *
  // stage_packs after u; 32-bit offsets: a CTA's stages take <= 64 KiB),
  // the first S token blocks in flight from here on (before u is copied);
  // `slot_at` is the first pack of the current token block's stage,
  // ring_end the end of the group's stages.
  int stage_packs = 0, ring_end = 0, slot_at = 0;
  if constexpr (kRing) {
    stage_packs = pos.N * VPT * pos.G;
    slot_at = pos.group * p.ring_stages * stage_packs;
    ring_end = slot_at + p.ring_stages * stage_packs;
    for (int s = 0; s < p.ring_stages; ++s) {
      ring_fill<scalar_t, VEC, VPT>(
          p, pos, static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(s) * gridDim.x,
          reinterpret_cast<Row*>(after_u) + slot_at + s * stage_packs);
    }
  }
  // u, copied once per CTA into the front of the dynamic shared memory
  // (float accumulation, u_in_shared): it is read for every row of every
  // token (twice per row in the single pass: <u, v_i> and dv_i). fp64 reads
  // it from global memory.
  constexpr bool kUShared = u_in_shared(sizeof(acc_t));
  const acc_t* u_s = p.u;
  if constexpr (kUShared) {
    acc_t* copy = reinterpret_cast<acc_t*>(dynamic_smem);
    for (int d = static_cast<int>(threadIdx.x); d < pos.D; d += static_cast<int>(blockDim.x)) {
      copy[d] = p.u[d];
    }
    __syncthreads();
    u_s = copy;
  }
  // Two-pass only: this group's staging area, entry (i, k) of this lane at
  // [(i*VPT+k)*pos.G+lane]; kRing: the current token block's stage.
  Row* stage = reinterpret_cast<Row*>(after_u) +
               static_cast<int64_t>(pos.group) * pos.N * VPT * pos.G;
  const bool staged = kRing || (!kSinglePass && p.stage);

  // kNorm with the weight gradient wanted: this thread's accumulators of
  // sum(dy n) (norm_dw_slots), zeroed here.
  if constexpr (kNorm) {
    if (p.norm_dw_partial) {
      acc_t* slots = norm_dw_slots<scalar_t, VEC, VPT>(p, dynamic_smem);
#pragma unroll
      for (int j = 0; j < VPT * VEC; ++j) slots[j * blockDim.x + threadIdx.x] = acc_t(0);
    }
  }

  acc_t z[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) z[k][e] = acc_t(0);
  }

  // The register prefetch of the next batch (the ring reads its rows from
  // shared memory instead, as the forward's does).
  constexpr bool kPrefetch = !kRing && Tile<scalar_t, VEC, VPT>::kPrefetchBackward;
  // Whether rare terms were added to this CTA's z partial row in global
  // memory (CTA-uniform); the registers are then added to it at the end.
  bool z_row_started = false;
  auto copy_rows = [](Row (&dst)[SU][VPT], const Row (&src)[SU][VPT]) {
#pragma unroll
    for (int j = 0; j < SU; ++j) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) dst[j][k] = src[j][k];
    }
  };
  // Rows i0 .. i0+SU-1 of token t, from shared memory or global memory.
  // kStream on the kernel's last read of these rows (single pass: the only
  // one; two-pass: the sweep), kKeep on the two-pass kernel's first read
  // (the sweep takes them from L2).
  constexpr LoadHint kFirst = LoadHint::kKeep;
  constexpr LoadHint kLast = LoadHint::kStream;

  for (int64_t tb = blockIdx.x; tb < p.token_blocks; tb += gridDim.x) {
    const int64_t t_wanted = tb * p.tokens_per_cta + pos.group;
    const bool active = t_wanted < pos.T;
    const int64_t t = active ? t_wanted : pos.T - 1;

    if constexpr (kRing) {
      ring_wait(p.ring_stages);
      stage = reinterpret_cast<Row*>(after_u) + slot_at;
    } else if constexpr (!kSinglePass) {
      // Only 16-byte packs are staged (the host enables staging only then).
      if constexpr (sizeof(Row) == 16) {
        if (staged) copy_token_rows_async<scalar_t, VEC, VPT>(p, pos, t, stage);
      }
    }
    Row dh[VPT];
    // [0]: sum_j a_j dp_j, or pivoted sum_{j != p} a_j dp_j (then the sum
    // relative to dp_p below); [1]: dp_p (pivoted).
    acc_t sum_a_dp[2] = {acc_t(0), acc_t(0)};
    Row next[SU][VPT];
    if constexpr (kNorm) {
      if constexpr (kSinglePass && kPrefetch) {  // in flight meanwhile
        backward_fetch_rows<kLast, SU>(p, pos, stage, staged, 0, t, next);
      }
      // dy and h read once into registers (the rare path re-reads them).
      const acc_t norm_r = p.norm_rstd[t];
      const scalar_t* dy_row = p.grad_out + t * p.grad_out_stride;
      const scalar_t* h_row = p.out + t * p.out_stride;
      Row hk[VPT];
      acc_t gn[1] = {acc_t(0)};
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        if (c < pos.D) {
          dh[k] = load_global<scalar_t, VEC, LoadHint::kStream>(dy_row + c);
          hk[k] = load_global<scalar_t, VEC, LoadHint::kStream>(h_row + c);
          norm_gn_add<scalar_t, VEC>(gn[0], dh[k], hk[k],
                                     load_global<acc_t, VEC>(p.norm_weight + c), norm_r);
        } else {
          dh[k] = zero_pack<scalar_t, VEC>();
          hk[k] = zero_pack<scalar_t, VEC>();
        }
      }
      group_allreduce<1>(gn, pos, red, parity);
      const acc_t norm_c = gn[0] / static_cast<acc_t>(pos.D);
      acc_t* const slots = p.norm_dw_partial && active
                               ? norm_dw_slots<scalar_t, VEC, VPT>(p, dynamic_smem)
                               : nullptr;
      // dh in place of dy; dy n to the accumulators; single pass: this
      // lane's part of <dh, h>.
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        if (c < pos.D) {
          const Acc w = load_global<acc_t, VEC>(p.norm_weight + c);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const scalar_t d = norm_dh(norm_r, norm_c, w.x[e], dh[k].x[e], hk[k].x[e]);
            if (slots) {
              slots[(k * VEC + e) * blockDim.x + threadIdx.x] +=
                  static_cast<acc_t>(dh[k].x[e]) * (norm_r * static_cast<acc_t>(hk[k].x[e]));
            }
            dh[k].x[e] = d;
            if constexpr (kSinglePass) {
              sum_a_dp[0] += static_cast<acc_t>(d) * static_cast<acc_t>(hk[k].x[e]);
            }
          }
        }
      }
    } else {
      // dh is read once into registers (the rare path re-reads it).
      const scalar_t* row = p.grad_out + t * p.grad_out_stride;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        dh[k] = c < pos.D ? load_global<scalar_t, VEC, LoadHint::kStream>(row + c)
                          : zero_pack<scalar_t, VEC>();
      }
    }

    if constexpr (kSinglePass) {
      // sum_j a_j dp_j = <dh, h> + sum_j a_j gw_j: this lane's part of
      // <dh, h> (kNorm: formed above), and of the weight-gradient sum
      // (sources lane, lane+G, ...).
      if constexpr (!kNorm) {
        const scalar_t* h_row = p.out + t * p.out_stride;
        if constexpr (kPrefetch) {  // in flight meanwhile
          backward_fetch_rows<kLast, SU>(p, pos, stage, staged, 0, t, next);
        }
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          const int c = (k * pos.G + pos.lane) * VEC;
          if (c < pos.D) {
            const Row hk = load_global<scalar_t, VEC, LoadHint::kStream>(h_row + c);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              sum_a_dp[0] += static_cast<acc_t>(dh[k].x[e]) * static_cast<acc_t>(hk.x[e]);
            }
          }
        }
      }
      if (p.grad_weights) {
        for (int j = pos.lane; j < pos.N; j += pos.G) {
          const int64_t idx = static_cast<int64_t>(j) * pos.T + t;
          sum_a_dp[0] += p.weights[idx] * p.grad_weights[idx];
        }
      }
    }
    // The pivot (math::Pivot), after dh, h and the first rows are in flight:
    // a token whose largest weight a_p dominates takes sum_j a_j dp_j
    // relative to dp_p (the pivoted form, depth_math.h), from a pass 1 over
    // the rows: the two-pass backward's own pass 1 (its lane partials, no
    // extra read); the single pass only for a saturated token
    // (Pivot::saturated: its <dh, h> from the rounded h is too inexact
    // there), whose rows it then reads twice.
    math::Pivot<acc_t> pivot;
    for (int i = 0; i < pos.N; ++i) pivot.see(i, p.weights[static_cast<int64_t>(i) * pos.T + t]);
    const bool pass1 = !kSinglePass || pivot.saturated();
    const int piv = pass1 && pivot.pivoted() ? static_cast<int>(pivot.index) : -1;
    // Pass 1's term of source i from this lane's part of <dh, v_i> (the
    // all-reduce below sums the lanes: the weight gradient joins on lane 0).
    auto add_pass1 = [&](int i, acc_t dot) {
      const int64_t idx = static_cast<int64_t>(i) * pos.T + t;
      const acc_t dp = dot + (pos.lane == 0 ? weight_grad(p, idx) : acc_t(0));
      if (i == piv) {
        sum_a_dp[1] += dp;
      } else {
        sum_a_dp[0] += p.weights[idx] * dp;
      }
    };
    if (kSinglePass && pass1) {
      // A saturated token: its rows one pack at a time (`next` holds the
      // sweep's first batch; a whole row in registers would spill the
      // widest tiles); <dh, h> and the weight-gradient sum above are not
      // used.
      sum_a_dp[0] = acc_t(0);
#pragma unroll 1
      for (int i = 0; i < pos.N; ++i) {
        const scalar_t* row = staged ? nullptr : source_row<scalar_t>(p.table, p.overflow, i, t);
        acc_t dot = acc_t(0);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          const int c = (k * pos.G + pos.lane) * VEC;
          if (c < pos.D) {
            const Row v = staged ? stage[(i * VPT + k) * pos.G + pos.lane]
                                 : load_global<scalar_t, VEC, kFirst>(row + c);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              dot += static_cast<acc_t>(dh[k].x[e]) * static_cast<acc_t>(v.x[e]);
            }
          }
        }
        add_pass1(i, dot);
      }
    }
    if constexpr (!kSinglePass) {
      if constexpr (!kRing) {
        if (staged) copy_async_commit_and_wait();
      }
      // Pass 1. Both passes load the next batch while the current one is
      // used when registers allow (kPrefetch).
      if constexpr (kPrefetch) backward_fetch_rows<kFirst, SU>(p, pos, stage, staged, 0, t, next);
      for (int i0 = 0; i0 < pos.N; i0 += SU) {
        Row rows[SU][VPT];
        if constexpr (kPrefetch) {
          copy_rows(rows, next);
          if (i0 + SU < pos.N) {
            backward_fetch_rows<kFirst, SU>(p, pos, stage, staged, i0 + SU, t, next);
          }
        } else {
          backward_fetch_rows<kFirst, SU>(p, pos, stage, staged, i0, t, rows);
        }
        acc_t dots[2 * SU];
        row_dots<RowDots::kDhOnly, kUShared>(rows, dh, u_s, pos.lane, pos.G, pos.D, dots);
#pragma unroll
        for (int j = 0; j < SU; ++j) {
          if (i0 + j < pos.N) add_pass1(i0 + j, dots[2 * j]);
        }
      }
    }
    group_allreduce<2>(sum_a_dp, pos, red, parity);
    // Pivoted: sum_{j != p} a_j (dp_j - dp_p), and each source's dp_i - dp_p
    // (0 for the pivot itself: its ds is then -a_p times that sum).
    const acc_t dp_p = sum_a_dp[1];
    if (piv >= 0) sum_a_dp[0] -= pivot.rest * dp_p;
    auto relative_dp = [&](int i, acc_t dp) {
      return piv < 0 ? dp : (i == piv ? acc_t(0) : dp - dp_p);
    };

    // The sweep: batch b = step (single pass) or n_batches - 1 - step
    // (two-pass: last batch first).
    bool rare = false;  // a row of this token is near the dtype's limits
    const int n_batches = (pos.N + SU - 1) / SU;
    const int first_batch = kSinglePass ? 0 : n_batches - 1;
    const int batch_step = kSinglePass ? 1 : -1;
    if constexpr (kPrefetch && !kSinglePass) {
      backward_fetch_rows<kLast, SU>(p, pos, stage, staged, first_batch * SU, t, next);
    }
    for (int step = 0; step < n_batches; ++step) {
      const int i0 = (first_batch + step * batch_step) * SU;
      Row rows[SU][VPT];
      if constexpr (kPrefetch) {
        copy_rows(rows, next);
        if (step + 1 < n_batches) {
          backward_fetch_rows<kLast, SU>(p, pos, stage, staged, i0 + batch_step * SU, t, next);
        }
      } else {
        backward_fetch_rows<kLast, SU>(p, pos, stage, staged, i0, t, rows);
      }
      acc_t sums[2 * SU];  // dp_i, <u, v_i>
      row_dots<RowDots::kDhAndU, kUShared>(rows, dh, u_s, pos.lane, pos.G, pos.D, sums);
      group_allreduce<2 * SU>(sums, pos, red, parity);

#pragma unroll
      for (int j = 0; j < SU; ++j) {
        const int i = i0 + j;
        if (i < pos.N && active) {
          const int64_t idx = static_cast<int64_t>(i) * pos.T + t;
          const acc_t a = p.weights[idx];
          const acc_t r = p.rstd[idx];
          const acc_t s = math::score(r, sums[2 * j + 1]);
          const acc_t dp = relative_dp(i, sums[2 * j] + weight_grad(p, idx));
          const math::SourceGrad<acc_t> g = math::source_grad_coefficients(
              a, r, s, dp, sum_a_dp[0], static_cast<int64_t>(pos.D));
          if (kHasRarePath && math::backward_row_is_rare(a, r, s, dp, sum_a_dp[0], g)) {
            rare = true;  // done by the rare path below
            continue;
          }
          scalar_t* out_row = grad_row<scalar_t>(p.table, p.overflow, i, t, pos.D);
#pragma unroll
          for (int k = 0; k < VPT; ++k) {
            const int c = (k * pos.G + pos.lane) * VEC;
            if (c < pos.D) {
              const Acc u = load_u<kUShared, acc_t, VEC>(u_s + c);
              Row o;
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                const acc_t v = static_cast<acc_t>(rows[j][k].x[e]);
                o.x[e] = static_cast<scalar_t>(math::source_grad(
                    g.a, static_cast<acc_t>(dh[k].x[e]), g.alpha, u.x[e],
                    g.beta, v));
                z[k][e] += g.alpha * v;
              }
              if (out_row) store_global<scalar_t, VEC, true>(out_row + c, o);
            }
          }
        }
      }
    }

    if constexpr (kRing) {
      // The stage is read (into registers, all used above): refill it with
      // the token S blocks ahead, in flight during the S - 1 token blocks
      // in between.
      ring_fill<scalar_t, VEC, VPT>(p, pos, tb + static_cast<int64_t>(p.ring_stages) * gridDim.x,
                                    stage);
      slot_at += stage_packs;
      if (slot_at == ring_end) slot_at = ring_end - p.ring_stages * stage_packs;
    }

    // Rare: some row of a token of this CTA is near the dtype's limits
    // (math::backward_row_is_rare: <dh, v>, <u, v> or sum_j a_j dp_j
    // overflowed, or alpha / beta lost bits to underflow). The rows the
    // fast path skipped are done again with their sums, coefficients and
    // elementwise products in double. CTA-wide vote: the rare terms of z go
    // to this CTA's partial row in global memory, one group after another
    // (a fixed order: deterministic), and the fast path's registers are
    // added to them at the end.
    if constexpr (kHasRarePath) {
      if (__syncthreads_or(rare ? 1 : 0)) {
        // kNorm: the token's r and c again (dh is formed from them).
        acc_t norm_r = acc_t(0), norm_c = acc_t(0);
        if constexpr (kNorm) {
          norm_r = p.norm_rstd[t];
          norm_c = norm_token_c<scalar_t, VEC, VPT>(p, pos, t, norm_r, red, parity);
        }
        double wide_sum[1] = {0.0};  // sum_j a_j dp_j in double
        for (int i = 0; i < pos.N; ++i) {
          double dp = 0.0;
#pragma unroll 1
          for (int k = 0; k < VPT; ++k) {
            const Row v = rare_fetch<scalar_t, VEC, VPT>(p, pos, i, t, k);
            const Row g = rare_fetch_dh<kNorm, scalar_t, VEC>(p, pos, t, k, norm_r, norm_c);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              dp += static_cast<double>(static_cast<acc_t>(g.x[e])) *
                    static_cast<double>(static_cast<acc_t>(v.x[e]));
            }
          }
          const int64_t idx = static_cast<int64_t>(i) * pos.T + t;
          if (pos.lane == 0) dp += static_cast<double>(weight_grad(p, idx));
          wide_sum[0] += static_cast<double>(p.weights[idx]) * dp;
        }
        group_allreduce_wide<1>(wide_sum, pos, red);
        acc_t* z_row = p.z_partial ? p.z_partial + static_cast<int64_t>(blockIdx.x) * pos.D : nullptr;
        if (z_row && !z_row_started) {
          for (int d = threadIdx.x; d < pos.D; d += blockDim.x) z_row[d] = acc_t(0);
          z_row_started = true;
          __syncthreads();  // zeroed before any group adds to it
        }
        for (int i = 0; i < pos.N; ++i) {
          // The fast path's sums in row_dots' order (the same bits: whether
          // it skipped this row), and the same sums in double.
          acc_t sums[2] = {acc_t(0), acc_t(0)};
          double wide[2] = {0.0, 0.0};
#pragma unroll 1
          for (int k = 0; k < VPT; ++k) {
            const int c = (k * pos.G + pos.lane) * VEC;
            if (c < pos.D) {
              const Row v = rare_fetch<scalar_t, VEC, VPT>(p, pos, i, t, k);
              const Row g = rare_fetch_dh<kNorm, scalar_t, VEC>(p, pos, t, k, norm_r, norm_c);
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                const acc_t x = static_cast<acc_t>(v.x[e]);
                const acc_t gx = static_cast<acc_t>(g.x[e]);
                sums[0] += gx * x;
                sums[1] += p.u[c + e] * x;
                wide[0] += static_cast<double>(gx) * static_cast<double>(x);
                wide[1] += static_cast<double>(p.u[c + e]) * static_cast<double>(x);
              }
            }
          }
          group_allreduce<2>(sums, pos, red, parity);
          group_allreduce_wide<2>(wide, pos, red);
          const int64_t idx = static_cast<int64_t>(i) * pos.T + t;
          bool apply = false;
          math::SourceGrad<double> gw{0.0, 0.0, 0.0};
          if (rare && active) {
            const acc_t a = p.weights[idx];
            const acc_t r = p.rstd[idx];
            const acc_t dp = relative_dp(i, sums[0] + weight_grad(p, idx));
            const acc_t s = math::score(r, sums[1]);
            const math::SourceGrad<acc_t> g = math::source_grad_coefficients(
                a, r, s, dp, sum_a_dp[0], static_cast<int64_t>(pos.D));
            apply = math::backward_row_is_rare(a, r, s, dp, sum_a_dp[0], g);
            if (apply) {
              gw = math::source_grad_coefficients<double>(
                  a, r, math::score<double>(r, wide[1]),
                  wide[0] + static_cast<double>(weight_grad(p, idx)), wide_sum[0],
                  static_cast<int64_t>(pos.D));
            }
          }
          scalar_t* out_row = grad_row<scalar_t>(p.table, p.overflow, i, t, pos.D);
          // One group after another: they add to the same z_row columns.
          for (int grp = 0; grp < p.tokens_per_cta; ++grp) {
            if (apply && pos.group == grp) {
#pragma unroll 1
              for (int k = 0; k < VPT; ++k) {
                const int c = (k * pos.G + pos.lane) * VEC;
                if (c >= pos.D) continue;
                const Row v = rare_fetch<scalar_t, VEC, VPT>(p, pos, i, t, k);
                const Row g = rare_fetch_dh<kNorm, scalar_t, VEC>(p, pos, t, k, norm_r, norm_c);
                Row o;
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                  const double x = static_cast<acc_t>(v.x[e]);
                  o.x[e] = static_cast<scalar_t>(static_cast<acc_t>(math::source_grad<double>(
                      gw.a, static_cast<acc_t>(g.x[e]), gw.alpha, p.u[c + e], gw.beta, x)));
                  if (z_row) z_row[c + e] += static_cast<acc_t>(gw.alpha * x);
                }
                if (out_row) store_global<scalar_t, VEC>(out_row + c, o);
              }
            }
            __syncthreads();
          }
        }
      }
    }
  }

  // kNorm: this CTA's partial row of the weight gradient, the groups'
  // accumulators summed in group order.
  if constexpr (kNorm) {
    if (p.norm_dw_partial) {
      const acc_t* dw_slots = norm_dw_slots<scalar_t, VEC, VPT>(p, dynamic_smem);
      __syncthreads();  // every thread's accumulators are in place
      acc_t* row = p.norm_dw_partial + static_cast<int64_t>(blockIdx.x) * pos.D;
      const int threads = static_cast<int>(blockDim.x);
      const int span = pos.G * VEC;  // columns of one pack index k
      for (int d = static_cast<int>(threadIdx.x); d < pos.D; d += threads) {
        const int k = d / span;
        const int lane = (d - k * span) / VEC;
        const int e = d - k * span - lane * VEC;
        const acc_t* slot = dw_slots + (k * VEC + e) * threads + lane;
        acc_t sum = slot[0];
        for (int g = 1; g < p.tokens_per_cta; ++g) sum += slot[g * pos.G];
        row[d] = sum;
      }
    }
  }

  // This CTA's partial of z: the groups' registers summed in group order.
  if (p.z_partial == nullptr) return;  // no query/gain gradient wanted
  acc_t* z_row = p.z_partial + static_cast<int64_t>(blockIdx.x) * pos.D;
  if (p.tokens_per_cta == 1) {
    // (rare terms, when any, were written by this CTA's threads before a
    // barrier: z_row_started is CTA-uniform)
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = (k * pos.G + pos.lane) * VEC;
      if (c < pos.D) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          z_row[c + e] = z_row_started ? z_row[c + e] + z[k][e] : z[k][e];
        }
      }
    }
    return;
  }
  __syncthreads();  // the staging area is reused for the sum
  acc_t* z_sum = reinterpret_cast<acc_t*>(after_u);
  for (int g = 0; g < p.tokens_per_cta; ++g) {
    if (pos.group == g) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = (k * pos.G + pos.lane) * VEC;
        if (c < pos.D) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            z_sum[c + e] = g == 0 ? z[k][e] : z_sum[c + e] + z[k][e];
          }
        }
      }
    }
    __syncthreads();
  }
  for (int d = threadIdx.x; d < pos.D; d += blockDim.x) {
    z_row[d] = z_row_started ? z_row[d] + z_sum[d] : z_sum[d];
  }
}

// ---------------------------------------------------------------------------
// Second pass of the query/gain gradient: z[d] = sum over the backward CTAs'
// partial rows. Thread (slice, column) of a CTA sums rows slice, slice +
// kSumSlices, ... of one column, then the slices are added in slice order:
// a fixed order, so the same bits every run, with kSumSlices loads in flight
// per column instead of one long dependent chain.
constexpr int kSumColumns = 32;
constexpr int kSumSlices = 8;

template <typename acc_t>
__global__ void __launch_bounds__(kSumColumns * kSumSlices)
    sum_partial_rows_kernel(const acc_t* partial, int64_t rows, int D, acc_t* z) {
  __shared__ acc_t slice_sums[kSumSlices][kSumColumns];
  const int column = static_cast<int>(threadIdx.x) % kSumColumns;
  const int slice = static_cast<int>(threadIdx.x) / kSumColumns;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kSumColumns + column;
  acc_t sum = acc_t(0);
  if (d < D) {
#pragma unroll 4
    for (int64_t r = slice; r < rows; r += kSumSlices) sum += partial[r * D + d];
  }
  slice_sums[slice][column] = sum;
  __syncthreads();
  if (slice == 0 && d < D) {
    acc_t total = slice_sums[0][column];
#pragma unroll
    for (int k = 1; k < kSumSlices; ++k) total += slice_sums[k][column];
    z[d] = total;
  }
}

}  // namespace cuda
}  // namespace attnres
