// Stand-in for <cuda_runtime.h> used only by the CPU emulation test of the
// CUDA kernels (see emulate_kernels.cpp). Device code compiles as host C++:
// each CUDA thread of a block is a fiber (its own stack, ucontext switches)
// on the calling OS thread, blocks run one after another, `__shared__`
// variables are statics (shared by the threads of the running block),
// __syncthreads is a block barrier and warp shuffles exchange values through
// a buffer between two warp barriers. A thread runs until it waits at a
// barrier, then the next thread runs: switching in user space, rather than
// waking hundreds of OS threads at every barrier, is what makes the
// emulation fast enough for make test. The threads of even blocks take turns
// in ascending order and those of odd blocks in descending order, so a read
// of another thread's data without the barrier that orders it finds stale
// data in one of the two orders. Threads left waiting at a barrier that can
// no longer complete (a barrier in divergent code, a thread that returned
// early) fail the launch instead of hanging it. Slow, but it executes the
// real kernel source with real thread/lane indices, reductions and barriers.
// Limits: static `__shared__` arrays keep the previous block's contents
// (only the dynamic shared memory is refilled with garbage per block), so a
// missing barrier before a read of static shared data that every block
// writes identically goes unseen; the kernels keep such data (u) in dynamic
// shared memory and use static arrays only for per-block reductions. A
// one-block launch runs in ascending order only.
// cp.async (ATTNRES_EMULATED_CP_ASYNC) is queued per thread and commit group
// and performed only at the wait_group that retires its group, so a read of
// a stage before its wait finds the stage's old bytes; with
// emu::cp_async_at_issue set, each copy is performed when it is issued (as
// early as a GPU may land it), so a read of a stage after its refill was
// issued finds the new bytes. Each mode catches one of the two races.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define ATTNRES_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTNRES_EMU_ASAN 1
#endif
#endif
#ifdef ATTNRES_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

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

// The running thread's index: set by the scheduler each time it switches to
// a thread (all threads run on one OS thread).
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

// cp.async: a thread's copies not yet committed, and its committed groups
// (oldest first), each performed when a wait_group retires it.
struct AsyncCopy {
  void* dst;
  const void* src;
};
struct AsyncCopies {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> committed;
};

// A barrier of `expected` threads; `phase` counts its completions.
struct Barrier {
  unsigned expected = 0;
  unsigned arrived = 0;
  unsigned long long phase = 0;
};

// One CUDA thread: its context and stack (reused by the next block).
struct Fiber {
  ucontext_t context{};
  void* stack = nullptr;
  bool done = false;
  AsyncCopies copies;
};

// Bytes of each fiber's stack: reserved, not committed (MAP_NORESERVE), so
// only the pages a kernel touches cost memory. A guard page below each
// stack turns an overflow into a fault.
inline constexpr size_t kFiberStack = size_t{8} << 20;
inline constexpr size_t kGuard = 4096;

struct BlockState {
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  // One slot per thread, for shuffles: long double holds float, double and
  // the host's WideType<double> (long double) exactly.
  std::vector<long double> exchange;
  std::vector<Fiber>* fibers = nullptr;
  const std::function<void()>* body = nullptr;
  unsigned current = 0;
  ucontext_t scheduler{};
  unsigned long long progress = 0;  // barriers completed + threads finished
  std::exception_ptr error;
#ifdef ATTNRES_EMU_ASAN
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

inline BlockState* block_state = nullptr;
// Set when a launch failed with threads left mid-kernel: their stacks may
// hold AddressSanitizer's poisoned redzones, cleared before the next launch.
inline bool fiber_stacks_abandoned = false;
inline std::vector<unsigned char> dynamic_smem_buffer;

inline unsigned char* dynamic_smem() { return dynamic_smem_buffer.data(); }

// Set when a thread ends with copies never waited for (on a GPU they would
// land in shared memory after the reader, or after the CTA ended).
inline std::atomic<bool> async_copies_left{false};

// Copies performed at issue instead of at their wait (see the top).
inline std::atomic<bool> cp_async_at_issue{false};

inline AsyncCopies& async_copies() { return (*block_state->fibers)[block_state->current].copies; }

inline void cp_async_16(void* smem, const void* gmem) {
  if (cp_async_at_issue.load(std::memory_order_relaxed)) {
    std::memcpy(smem, gmem, 16);
    return;
  }
  async_copies().open.push_back({smem, gmem});
}

inline void cp_async_commit() {
  AsyncCopies& c = async_copies();
  c.committed.push_back(std::move(c.open));
  c.open.clear();
}

// cp.async.wait_group pending: performs the oldest groups until at most
// `pending` remain.
inline void cp_async_wait(int pending) {
  auto& q = async_copies().committed;
  while (q.size() > static_cast<size_t>(pending)) {
    for (const AsyncCopy& c : q.front()) std::memcpy(c.dst, c.src, 16);
    q.pop_front();
  }
}

inline bool cp_async_pending() {
  const AsyncCopies& c = async_copies();
  if (!c.open.empty()) return true;
  for (const auto& g : c.committed) {
    if (!g.empty()) return true;
  }
  return false;
}

// Switches from the running thread back to the scheduler; returns when the
// scheduler switches to this thread again. `finished`: the thread's last
// switch (AddressSanitizer then drops its fake stack).
inline void yield_to_scheduler(bool finished = false) {
  BlockState& b = *block_state;
  Fiber& self = (*b.fibers)[b.current];
#ifdef ATTNRES_EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake_stack, b.scheduler_stack,
                                 b.scheduler_stack_size);
  swapcontext(&self.context, &b.scheduler);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)finished;
  swapcontext(&self.context, &b.scheduler);
#endif
}

inline void arrive_and_wait(Barrier& barrier) {
  const unsigned long long phase = barrier.phase;
  if (++barrier.arrived == barrier.expected) {
    barrier.arrived = 0;
    ++barrier.phase;
    ++block_state->progress;
    return;  // the last to arrive goes on; the others resume in their turn
  }
  while (barrier.phase == phase) yield_to_scheduler();
}

inline void fiber_entry() {
  BlockState& b = *block_state;
#ifdef ATTNRES_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack, &b.scheduler_stack_size);
#endif
  try {
    (*b.body)();
    if (cp_async_pending()) async_copies_left = true;
  } catch (...) {
    if (!b.error) b.error = std::current_exception();
  }
  (*b.fibers)[b.current].done = true;
  ++b.progress;
  yield_to_scheduler(/*finished=*/true);  // never resumed
}

}  // namespace emu

#define ATTNRES_EMULATED_CP_ASYNC 1

inline void __syncthreads() { emu::arrive_and_wait(emu::block_state->block_barrier); }

template <typename T>
T __shfl_xor_sync(unsigned /*mask: the kernels always use the full warp*/, T value, int lane_mask) {
  emu::BlockState& b = *emu::block_state;
  const unsigned tid = threadIdx.x;
  b.exchange[tid] = static_cast<long double>(value);
  emu::arrive_and_wait(b.warp_barriers[tid / 32]);
  const T other = static_cast<T>(b.exchange[tid ^ static_cast<unsigned>(lane_mask)]);
  emu::arrive_and_wait(b.warp_barriers[tid / 32]);
  return other;
}

// Warp barrier (the kernels use it with the full warp).
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
  emu::arrive_and_wait(emu::block_state->warp_barriers[threadIdx.x / 32]);
}

// Warp vote: every lane of the warp gets whether any lane's predicate is
// true (the kernels always vote with the full warp).
inline bool __any_sync(unsigned /*mask*/, bool pred) {
  emu::BlockState& b = *emu::block_state;
  const unsigned tid = threadIdx.x;
  b.exchange[tid] = pred ? 1.0L : 0.0L;
  emu::arrive_and_wait(b.warp_barriers[tid / 32]);
  bool any = false;
  for (unsigned l = tid / 32 * 32; l < tid / 32 * 32 + 32; ++l) any = any || b.exchange[l] != 0.0L;
  emu::arrive_and_wait(b.warp_barriers[tid / 32]);
  return any;
}

// Block barrier that also returns whether any thread's predicate is non-zero.
inline int __syncthreads_or(int pred) {
  emu::BlockState& b = *emu::block_state;
  const unsigned tid = threadIdx.x;
  b.exchange[tid] = pred != 0 ? 1.0L : 0.0L;
  emu::arrive_and_wait(b.block_barrier);
  bool any = false;
  for (long double x : b.exchange) any = any || x != 0.0L;
  emu::arrive_and_wait(b.block_barrier);
  return any ? 1 : 0;
}

namespace emu {

// Fiber stacks, kept from one launch to the next.
inline std::vector<Fiber>& fiber_pool(unsigned threads) {
  static std::vector<Fiber> pool;
  while (pool.size() < threads) {
    void* mem = mmap(nullptr, kFiberStack + kGuard, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) throw std::runtime_error("emulated launch: cannot map a thread stack");
    mprotect(mem, kGuard, PROT_NONE);  // stacks grow down: the guard sits below
    pool.emplace_back();
    pool.back().stack = static_cast<unsigned char*>(mem) + kGuard;
  }
  return pool;
}

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
  std::vector<Fiber>& fibers = fiber_pool(threads);
#ifdef ATTNRES_EMU_ASAN
  if (fiber_stacks_abandoned) {
    for (Fiber& f : fibers) __asan_unpoison_memory_region(f.stack, kFiberStack);
  }
#endif
  fiber_stacks_abandoned = false;
  for (unsigned b = 0; b < grid; ++b) {
    dynamic_smem_buffer.assign(smem_bytes + kCanary, 0xCD);
    std::fill(dynamic_smem_buffer.begin() + static_cast<std::ptrdiff_t>(smem_bytes),
              dynamic_smem_buffer.end(), static_cast<unsigned char>(0xAB));
    blockIdx.x = b;
    BlockState state;
    state.block_barrier.expected = threads;
    state.warp_barriers.assign(threads / 32, Barrier{32, 0, 0});
    state.exchange.assign(threads, 0.0L);
    state.fibers = &fibers;
    state.body = &kernel_body;
    block_state = &state;
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = fibers[t];
      f.done = false;
      f.copies = AsyncCopies{};
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kFiberStack;
      f.context.uc_link = nullptr;
      makecontext(&f.context, fiber_entry, 0);
    }
    const bool descending = b % 2 == 1;
    unsigned left = threads;
    while (left > 0) {
      const unsigned long long progress_before = state.progress;
      for (unsigned i = 0; i < threads; ++i) {
        const unsigned t = descending ? threads - 1 - i : i;
        if (fibers[t].done) continue;
        state.current = t;
        threadIdx.x = t;
#ifdef ATTNRES_EMU_ASAN
        void* fake_stack = nullptr;
        __sanitizer_start_switch_fiber(&fake_stack, fibers[t].stack, kFiberStack);
        swapcontext(&state.scheduler, &fibers[t].context);
        __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
        swapcontext(&state.scheduler, &fibers[t].context);
#endif
        if (state.error) {
          block_state = nullptr;
          fiber_stacks_abandoned = true;
          async_copies_left = false;
          std::rethrow_exception(state.error);
        }
        if (fibers[t].done) --left;
      }
      // A whole round in which no barrier completed and no thread finished:
      // every thread left waits at a barrier that cannot complete.
      if (left > 0 && state.progress == progress_before) {
        block_state = nullptr;
        fiber_stacks_abandoned = true;
        async_copies_left = false;
        throw std::runtime_error("emulated launch: block " + std::to_string(b) + " deadlocked: " +
                                 std::to_string(left) +
                                 " thread(s) wait at barriers the other threads never reach");
      }
    }
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
