// Stand-in for <cuda_runtime.h> used only by the CPU emulation test of the
// CUDA kernels (see emulate_kernels.cpp). Device code compiles as host C++:
// each CUDA thread of a block is a std::thread, blocks run one after another,
// `__shared__` variables are statics (shared by the threads of the running
// block), __syncthreads is a block barrier and warp shuffles exchange values
// through a buffer between two warp barriers. Slow, but it executes the real
// kernel source with real thread/lane indices, reductions and barriers.
// cp.async (ATTNRES_EMULATED_CP_ASYNC) is queued per thread and commit group
// and performed only at the wait_group that retires its group, so a read of
// a stage before its wait finds the stage's old bytes; with
// emu::cp_async_at_issue set, each copy is performed when it is issued (as
// early as a GPU may land it), so a read of a stage after its refill was
// issued finds the new bytes. Each mode catches one of the two races.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
using cudaStream_t = struct CUstream_st*;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
// The CTA's dynamic shared memory: a buffer that emu::launch sizes.
#define ATTNRES_DYNAMIC_SMEM(name) unsigned char* name = emu::dynamic_smem()

namespace emu {

struct BlockState {
  std::unique_ptr<std::barrier<>> block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<double> exchange;  // one slot per thread, for shuffles
};

inline BlockState* block_state = nullptr;
inline std::vector<unsigned char> dynamic_smem_buffer;

inline unsigned char* dynamic_smem() { return dynamic_smem_buffer.data(); }

// cp.async: this thread's copies not yet committed, and its committed groups
// (oldest first), each performed when a wait_group retires it.
struct AsyncCopy {
  void* dst;
  const void* src;
};
struct AsyncCopies {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> committed;
};
inline thread_local AsyncCopies async_copies;
// Set when a thread ends with copies never waited for (on a GPU they would
// land in shared memory after the reader, or after the CTA ended).
inline std::atomic<bool> async_copies_left{false};

// Copies performed at issue instead of at their wait (see the top).
inline std::atomic<bool> cp_async_at_issue{false};

inline void cp_async_16(void* smem, const void* gmem) {
  if (cp_async_at_issue.load(std::memory_order_relaxed)) {
    std::memcpy(smem, gmem, 16);
    return;
  }
  async_copies.open.push_back({smem, gmem});
}

inline void cp_async_commit() {
  async_copies.committed.push_back(std::move(async_copies.open));
  async_copies.open.clear();
}

// cp.async.wait_group pending: performs the oldest groups until at most
// `pending` remain.
inline void cp_async_wait(int pending) {
  auto& q = async_copies.committed;
  while (q.size() > static_cast<size_t>(pending)) {
    for (const AsyncCopy& c : q.front()) std::memcpy(c.dst, c.src, 16);
    q.pop_front();
  }
}

inline bool cp_async_pending() {
  if (!async_copies.open.empty()) return true;
  for (const auto& g : async_copies.committed) {
    if (!g.empty()) return true;
  }
  return false;
}

}  // namespace emu

#define ATTNRES_EMULATED_CP_ASYNC 1

inline thread_local dim3 threadIdx;
inline dim3 blockIdx, blockDim, gridDim;

inline void __syncthreads() { emu::block_state->block_barrier->arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned /*mask: the kernels always use the full warp*/, T value, int lane_mask) {
  emu::BlockState& b = *emu::block_state;
  const unsigned tid = threadIdx.x;
  b.exchange[tid] = static_cast<double>(value);  // exact for float and double
  b.warp_barriers[tid / 32]->arrive_and_wait();
  const T other = static_cast<T>(b.exchange[tid ^ static_cast<unsigned>(lane_mask)]);
  b.warp_barriers[tid / 32]->arrive_and_wait();
  return other;
}

// Warp barrier (the kernels use it with the full warp).
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
  emu::block_state->warp_barriers[threadIdx.x / 32]->arrive_and_wait();
}

// Warp vote: every lane of the warp gets whether any lane's predicate is
// true (the kernels always vote with the full warp).
inline bool __any_sync(unsigned /*mask*/, bool pred) {
  emu::BlockState& b = *emu::block_state;
  const unsigned tid = threadIdx.x;
  b.exchange[tid] = pred ? 1.0 : 0.0;
  b.warp_barriers[tid / 32]->arrive_and_wait();
  bool any = false;
  for (unsigned l = tid / 32 * 32; l < tid / 32 * 32 + 32; ++l) any = any || b.exchange[l] != 0.0;
  b.warp_barriers[tid / 32]->arrive_and_wait();
  return any;
}

// Block barrier that also returns whether any thread's predicate is non-zero.
inline int __syncthreads_or(int pred) {
  emu::BlockState& b = *emu::block_state;
  const unsigned tid = threadIdx.x;
  b.exchange[tid] = pred != 0 ? 1.0 : 0.0;
  b.block_barrier->arrive_and_wait();
  bool any = false;
  for (double x : b.exchange) any = any || x != 0.0;
  b.block_barrier->arrive_and_wait();
  return any ? 1 : 0;
}

namespace emu {

// Runs kernel_body() as grid x threads CUDA threads, one block at a time.
inline void launch(unsigned grid, unsigned threads, size_t smem_bytes,
                   const std::function<void()>& kernel_body) {
  if (threads % 32 != 0) throw std::runtime_error("emulated launch: block size must be whole warps");
  // Garbage (as on a GPU) refilled for every block, so a block cannot find
  // what the previous one left (on a GPU blocks run concurrently, each with
  // its own shared memory), then a canary right after the requested size:
  // an overrun of the dynamic shared memory fails the launch.
  constexpr size_t kCanary = 64;
  gridDim.x = grid;
  blockDim.x = threads;
  for (unsigned b = 0; b < grid; ++b) {
    dynamic_smem_buffer.assign(smem_bytes + kCanary, 0xCD);
    std::fill(dynamic_smem_buffer.begin() + static_cast<std::ptrdiff_t>(smem_bytes),
              dynamic_smem_buffer.end(), static_cast<unsigned char>(0xAB));
    blockIdx.x = b;
    BlockState state;
    state.block_barrier = std::make_unique<std::barrier<>>(threads);
    for (unsigned w = 0; w < threads / 32; ++w) {
      state.warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    }
    state.exchange.assign(threads, 0.0);
    block_state = &state;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([t, &kernel_body] {
        threadIdx.x = t;
        kernel_body();
        if (cp_async_pending()) async_copies_left = true;
      });
    }
    for (auto& th : pool) th.join();
    block_state = nullptr;
    if (async_copies_left.exchange(false)) {
      throw std::runtime_error("emulated launch: a thread ended with cp.async copies not waited for");
    }
    for (size_t i = smem_bytes; i < dynamic_smem_buffer.size(); ++i) {
      if (dynamic_smem_buffer[i] != 0xAB) {
        throw std::runtime_error("emulated launch: a block wrote past its dynamic shared memory");
      }
    }
  }
}

}  // namespace emu
