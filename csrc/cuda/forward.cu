// Launcher of the forward kernel for every compiled tile, group class and
// dtype (the register pipeline, and the cp.async ring where the tile has one),
// and of the few-token kernels.
#include "few_tokens.cuh"
#include "kernels.cuh"
#include "launch_kernel.cuh"

namespace attnres {
namespace cuda {

namespace {

// The plain kernel or the fused output norm's instantiation (its own, so the
// plain kernel's registers do not change), with the register pipeline or
// the cp.async ring (kRing: compiled only for ring_tile_compiled tiles), for
// the tile's (vec, vpt) and the class of its G (with_tile).
template <typename scalar_t>
auto forward_kernel_for(bool normed, bool ring) {
  return [normed, ring](auto vec, auto vpt, auto group) {
    constexpr int VEC = decltype(vec)::value, VPT = decltype(vpt)::value;
    constexpr int kGroup = decltype(group)::value;
    if constexpr (ring_tile_compiled(VEC, VPT, natural_vec<scalar_t>())) {
      if (ring) {
        return normed ? depth_attention_fwd_kernel<scalar_t, VEC, VPT, true, kGroup, true>
                      : depth_attention_fwd_kernel<scalar_t, VEC, VPT, false, kGroup, true>;
      }
    }
    TORCH_CHECK(!ring, "attnres: no forward ring kernel compiled for a tile of vec=", VEC,
                ", vpt=", VPT);
    return normed ? depth_attention_fwd_kernel<scalar_t, VEC, VPT, true, kGroup>
                  : depth_attention_fwd_kernel<scalar_t, VEC, VPT, false, kGroup>;
  };
}

}  // namespace

template <typename scalar_t>
void launch_forward(const ForwardParams<scalar_t>& params, const LaunchConfig& config,
                    cudaStream_t stream) {
  launch_tiled<scalar_t, kMaxElemsPerThread>(
      forward_kernel_for<scalar_t>(params.norm_weight != nullptr, params.ring_stages > 0),
      params, config, stream);
}

template <typename scalar_t>
void launch_few_tokens(const ForwardParams<scalar_t>& params, const LaunchConfig& config,
                       cudaStream_t stream) {
  auto launch = [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const auto grid = static_cast<unsigned>(config.grid);
    const auto threads = static_cast<unsigned>(config.tile.group);
    few_tokens_partials_kernel<scalar_t, VEC><<<grid, threads, 0, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    few_tokens_finish_kernel<scalar_t, VEC><<<grid, threads, config.smem_bytes, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (params.norm_weight != nullptr) {
      few_tokens_norm_kernel<scalar_t, VEC><<<grid, threads, 0, stream>>>(params);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  };
  if (config.tile.vec == 1) {
    launch(std::integral_constant<int, 1>{});
  } else {
    launch(std::integral_constant<int, natural_vec<scalar_t>()>{});
  }
}

template <typename scalar_t>
int forward_ring_blocks_per_sm(const TileConfig& tile, size_t smem_bytes, bool normed) {
  int blocks = 0;
  with_tile<scalar_t, kMaxElemsPerThread>(tile, [&](auto vec, auto vpt, auto group) {
    blocks = blocks_per_sm(forward_kernel_for<scalar_t>(normed, true)(vec, vpt, group),
                           tile.group * tile.tokens_per_cta, smem_bytes);
  });
  return blocks;
}

#define ATTNRES_INSTANTIATE_FORWARD(T)                                            \
  template void launch_forward<T>(const ForwardParams<T>&, const LaunchConfig&,    \
                                  cudaStream_t);                                   \
  template void launch_few_tokens<T>(const ForwardParams<T>&, const LaunchConfig&, \
                                     cudaStream_t);                                \
  template int forward_ring_blocks_per_sm<T>(const TileConfig&, size_t, bool);

ATTNRES_INSTANTIATE_FORWARD(double)
ATTNRES_INSTANTIATE_FORWARD(float)
ATTNRES_INSTANTIATE_FORWARD(c10::Half)
ATTNRES_INSTANTIATE_FORWARD(c10::BFloat16)
#undef ATTNRES_INSTANTIATE_FORWARD

}  // namespace cuda
}  // namespace attnres
