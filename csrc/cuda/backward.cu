// Launcher of the backward kernel for every compiled tile and dtype.
#include <c10/cuda/CUDAException.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "kernels.cuh"

namespace attnres {
namespace cuda {
namespace {

// Shared memory a CTA may use without opting in.
constexpr size_t kDefaultSmemLimit = 48 * 1024;

// Kernel attributes and occupancy are asked once per kernel, device and
// size, so a CUDA-graph capture that follows a warm-up makes no such calls.
std::mutex attribute_mutex;
std::map<std::pair<const void*, int>, size_t> smem_allowed;
std::map<std::tuple<const void*, int, int, size_t>, int> blocks_per_sm_cache;

int current_device() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t smem_bytes) {
  if (smem_bytes <= kDefaultSmemLimit) return;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), current_device());
  std::lock_guard<std::mutex> lock(attribute_mutex);
  size_t& allowed = smem_allowed[key];
  if (allowed >= smem_bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem_bytes)));
  allowed = smem_bytes;
}

template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem_bytes) {
  allow_dynamic_smem(kernel, smem_bytes);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), current_device(),
                                   threads, smem_bytes);
  std::lock_guard<std::mutex> lock(attribute_mutex);
  auto it = blocks_per_sm_cache.find(key);
  if (it != blocks_per_sm_cache.end()) return it->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads,
                                                               smem_bytes));
  blocks_per_sm_cache.emplace(key, blocks);
  return blocks;
}

}  // namespace

template <typename scalar_t>
void launch_backward(const BackwardParams<scalar_t>& params,
                     const LaunchConfig& config, cudaStream_t stream) {
  with_tile<scalar_t>(config.tile.vec, config.tile.vpt, [&](auto vec, auto vpt) {
    constexpr int VEC = decltype(vec)::value;
    constexpr int VPT = decltype(vpt)::value;
    auto* kernel = depth_attention_bwd_kernel<scalar_t, VEC, VPT>;
    allow_dynamic_smem(kernel, config.smem_bytes);
    const int threads = config.tile.group * config.tile.tokens_per_cta;
    kernel<<<static_cast<unsigned>(config.grid), threads, config.smem_bytes, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t>
int backward_blocks_per_sm(const TileConfig& tile, size_t smem_bytes) {
  int blocks = 0;
  with_tile<scalar_t>(tile.vec, tile.vpt, [&](auto vec, auto vpt) {
    constexpr int VEC = decltype(vec)::value;
    constexpr int VPT = decltype(vpt)::value;
    blocks = blocks_per_sm(depth_attention_bwd_kernel<scalar_t, VEC, VPT>,
                           tile.group * tile.tokens_per_cta, smem_bytes);
  });
  return blocks;
}

template <typename acc_t>
void launch_sum_partial_rows(const acc_t* partial, int64_t rows, int D, acc_t* z,
                             cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((D + kSumColumns - 1) / kSumColumns);
  sum_partial_rows_kernel<acc_t><<<blocks, kSumColumns * kSumSlices, 0, stream>>>(partial, rows, D, z);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_sum_partial_rows<float>(const float*, int64_t, int, float*, cudaStream_t);
template void launch_sum_partial_rows<double>(const double*, int64_t, int, double*, cudaStream_t);

#define ATTNRES_INSTANTIATE_BACKWARD(T)                                        \
  template void launch_backward<T>(const BackwardParams<T>&,                   \
                                   const LaunchConfig&, cudaStream_t);         \
  template int backward_blocks_per_sm<T>(const TileConfig&, size_t);

ATTNRES_INSTANTIATE_BACKWARD(double)
ATTNRES_INSTANTIATE_BACKWARD(float)
ATTNRES_INSTANTIATE_BACKWARD(c10::Half)
ATTNRES_INSTANTIATE_BACKWARD(c10::BFloat16)
#undef ATTNRES_INSTANTIATE_BACKWARD

}  // namespace cuda
}  // namespace attnres
