// Launching a tiled kernel (forward.cu, backward.cu): the kernel compiled
// for the launch's tile, its dynamic shared memory allowance and its
// occupancy, asked once per kernel, device and size so that a CUDA-graph
// capture after a warm-up makes no such calls.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "launch.h"

namespace attnres {
namespace cuda {

// Shared memory a CTA may use without opting in.
constexpr size_t kDefaultSmemLimit = 48 * 1024;

inline std::mutex& attribute_mutex() {
  static std::mutex m;
  return m;
}

inline int current_device() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t smem_bytes) {
  if (smem_bytes <= kDefaultSmemLimit) return;
  static std::map<std::pair<const void*, int>, size_t> allowed_bytes;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), current_device());
  std::lock_guard<std::mutex> lock(attribute_mutex());
  size_t& allowed = allowed_bytes[key];
  if (allowed >= smem_bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem_bytes)));
  allowed = smem_bytes;
}

// Resident CTAs per SM of `kernel` with this many threads and bytes.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem_bytes) {
  allow_dynamic_smem(kernel, smem_bytes);
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), current_device(),
                                   threads, smem_bytes);
  std::lock_guard<std::mutex> lock(attribute_mutex());
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads,
                                                               smem_bytes));
  cache.emplace(key, blocks);
  return blocks;
}

// Launches kernel_for(VEC, VPT, kGroup) — the kernel template instantiated
// for the config's tile and the class of its G (with_tile: a kernel whose
// tiles prefer at most kPreferredElems elements per thread) — on params.
template <typename scalar_t, int kPreferredElems, typename KernelFor, typename Params>
void launch_tiled(KernelFor kernel_for, const Params& params, const LaunchConfig& config,
                  cudaStream_t stream) {
  with_tile<scalar_t, kPreferredElems>(config.tile, [&](auto vec, auto vpt, auto group) {
    auto* kernel = kernel_for(vec, vpt, group);
    allow_dynamic_smem(kernel, config.smem_bytes);
    const int threads = config.tile.group * config.tile.tokens_per_cta;
    kernel<<<static_cast<unsigned>(config.grid), threads, config.smem_bytes, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace attnres
