// Checks the emulated CUDA runtime itself (cuda_runtime.h here): the
// emulation test of the kernels is only as good as its barriers, shuffles
// and thread order. Each case prints "ok <what>" or "FAIL <what>"; the last
// line is "<n> failure(s)".
//   1. a block-wide reduction through shared memory with __syncthreads, and
//      a warp reduction with __shfl_xor_sync, give the exact sums;
//   2. the same shared-memory exchange without its __syncthreads reads stale
//      data in at least one of the two thread orders (even and odd blocks);
//   3. a __syncthreads in divergent code fails the launch (no hang);
//   4. a thread returning early while the others wait at a barrier fails
//      the launch (no hang);
//   5. a launch after a failed one runs normally, also when the failed one
//      left threads deep in instrumented frames and the next one passes a
//      stack buffer to uninstrumented code (under AddressSanitizer the
//      abandoned stacks' redzones must not be seen again).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

constexpr unsigned kThreads = 128;

// Each thread writes its index + 1, then sums its right neighbour's slot.
// With the barrier every thread sees its neighbour's value.
std::vector<int> neighbour_exchange(bool with_barrier, unsigned grid) {
  std::vector<int> out(static_cast<size_t>(grid) * kThreads, -1);
  emu::launch(grid, kThreads, 0, [&] {
    __shared__ int slots[kThreads];
    const unsigned t = threadIdx.x;
    slots[t] = static_cast<int>(blockIdx.x * 1000 + t + 1);
    if (with_barrier) __syncthreads();
    out[blockIdx.x * kThreads + t] = slots[(t + 1) % kThreads];
    __syncthreads();  // no thread rewrites slots before all have read
  });
  return out;
}

bool exchange_correct(const std::vector<int>& out, unsigned block) {
  for (unsigned t = 0; t < kThreads; ++t) {
    if (out[block * kThreads + t] != static_cast<int>(block * 1000 + (t + 1) % kThreads + 1)) return false;
  }
  return true;
}

// Instrumented frames with stack redzones, then a barrier only some
// threads reach: the launch fails with these frames live.
__attribute__((noinline)) void deep_then_diverge(int depth) {
  volatile char frame[8];
  volatile char* volatile p = frame;
  p[0] = 1;
  if (depth > 0) {
    deep_then_diverge(depth - 1);
    return;
  }
  if (threadIdx.x < 32) __syncthreads();
}

void* (*volatile memset_fn)(void*, int, size_t) = &std::memset;

// A stack buffer handed to an intercepted libc call from a frame the
// sanitizer does not instrument (as library code).
#if defined(__SANITIZE_ADDRESS__)
__attribute__((no_sanitize_address))
#endif
__attribute__((noinline)) int uninstrumented_stack_use() {
  char buffer[2048];
  memset_fn(buffer, 1, sizeof buffer);
  asm volatile("" ::"r"(buffer) : "memory");
  return buffer[17];
}

bool launch_fails(const std::function<void()>& body, const std::string& expect) {
  try {
    emu::launch(2, kThreads, 0, body);
  } catch (const std::runtime_error& e) {
    return std::string(e.what()).find(expect) != std::string::npos;
  }
  return false;
}

}  // namespace

int main() {
  // 1. Reductions.
  {
    std::vector<long> block_sums(3, 0), warp_sums(3 * kThreads / 32, 0);
    emu::launch(3, kThreads, 0, [&] {
      __shared__ long partial[kThreads];
      const unsigned t = threadIdx.x;
      const long mine = static_cast<long>(blockIdx.x) * 7919 + t * t;
      partial[t] = mine;
      __syncthreads();
      for (unsigned stride = kThreads / 2; stride > 0; stride /= 2) {
        if (t < stride) partial[t] += partial[t + stride];
        __syncthreads();
      }
      if (t == 0) block_sums[blockIdx.x] = partial[0];
      double w = static_cast<double>(mine);
      for (int m = 16; m > 0; m /= 2) w += __shfl_xor_sync(0xffffffffu, w, m);
      if (t % 32 == 0) warp_sums[blockIdx.x * (kThreads / 32) + t / 32] = static_cast<long>(w);
    });
    bool ok = true;
    for (unsigned b = 0; b < 3; ++b) {
      long expect = 0;
      for (unsigned t = 0; t < kThreads; ++t) {
        const long v = static_cast<long>(b) * 7919 + t * t;
        expect += v;
      }
      ok = ok && block_sums[b] == expect;
      for (unsigned w = 0; w < kThreads / 32; ++w) {
        long we = 0;
        for (unsigned t = w * 32; t < w * 32 + 32; ++t) we += static_cast<long>(b) * 7919 + t * t;
        ok = ok && warp_sums[b * (kThreads / 32) + w] == we;
      }
    }
    check(ok, "block reduction through shared memory and warp shuffle reduction are exact");
  }
  // 2. A missing barrier is seen.
  {
    const std::vector<int> with = neighbour_exchange(true, 2);
    check(exchange_correct(with, 0) && exchange_correct(with, 1),
          "neighbour exchange with __syncthreads: every thread reads the new value");
    const std::vector<int> without = neighbour_exchange(false, 2);
    check(!exchange_correct(without, 0) || !exchange_correct(without, 1),
          "neighbour exchange without __syncthreads: stale reads in one of the two thread orders");
  }
  // 3. A barrier only some threads reach.
  check(launch_fails(
            [] {
              if (threadIdx.x < 64) __syncthreads();
            },
            "deadlocked"),
        "__syncthreads in divergent code fails the launch");
  // 4. A thread that returns early.
  check(launch_fails(
            [] {
              if (threadIdx.x == 5) return;
              __syncthreads();
            },
            "deadlocked"),
        "a thread returning before a __syncthreads fails the launch");
  // 5. The runtime recovers.
  {
    const std::vector<int> again = neighbour_exchange(true, 3);
    check(exchange_correct(again, 0) && exchange_correct(again, 1) && exchange_correct(again, 2),
          "a launch after a failed launch runs normally");
    const bool failed = launch_fails([] { deep_then_diverge(20); }, "deadlocked");
    std::vector<int> seen(kThreads, 0);
    emu::launch(1, kThreads, 0, [&] { seen[threadIdx.x] = uninstrumented_stack_use(); });
    bool all = true;
    for (int v : seen) all = all && v == 1;
    check(failed && all, "stacks abandoned deep in a failed launch are reused cleanly");
  }
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
