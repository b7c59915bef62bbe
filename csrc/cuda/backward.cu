// Launchers of the backward kernel (every compiled tile and dtype) and of
// the fixed-order sum of its query/gain-gradient partial rows.
#include "kernels.cuh"
#include "launch_kernel.cuh"

namespace attnres {
namespace cuda {
namespace {

// The plain kernel, or the fused output norm's instantiation (its own, so
// the plain kernel's registers do not change), with or without the cp.async
// ring (kRing: compiled only for backward_ring_tile_compiled tiles).
template <typename scalar_t>
auto backward_kernel_for(bool normed, bool ring) {
  return [normed, ring](auto vec, auto vpt, auto group) {
    constexpr int VEC = decltype(vec)::value, VPT = decltype(vpt)::value;
    constexpr int kGroup = decltype(group)::value;
    if constexpr (backward_ring_tile_compiled(VEC, VPT, natural_vec<scalar_t>())) {
      if (ring) {
        return normed ? depth_attention_bwd_kernel<scalar_t, VEC, VPT, true, kGroup, true>
                      : depth_attention_bwd_kernel<scalar_t, VEC, VPT, false, kGroup, true>;
      }
    }
    TORCH_CHECK(!ring, "attnres: no backward ring kernel compiled for a tile of vec=", VEC,
                ", vpt=", VPT);
    return normed ? depth_attention_bwd_kernel<scalar_t, VEC, VPT, true, kGroup>
                  : depth_attention_bwd_kernel<scalar_t, VEC, VPT, false, kGroup>;
  };
}

}  // namespace

template <typename scalar_t>
void launch_backward(const BackwardParams<scalar_t>& params, const LaunchConfig& config,
                     cudaStream_t stream) {
  launch_tiled<scalar_t, kBackwardPreferredElems>(
      backward_kernel_for<scalar_t>(params.norm_weight != nullptr, params.ring_stages > 0),
      params, config, stream);
}

template <typename scalar_t>
int backward_blocks_per_sm(const TileConfig& tile, size_t smem_bytes, bool normed, bool ring) {
  int blocks = 0;
  with_tile<scalar_t, kBackwardPreferredElems>(tile, [&](auto vec, auto vpt, auto group) {
    blocks = blocks_per_sm(backward_kernel_for<scalar_t>(normed, ring)(vec, vpt, group),
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
  template int backward_blocks_per_sm<T>(const TileConfig&, size_t, bool, bool);

ATTNRES_INSTANTIATE_BACKWARD(double)
ATTNRES_INSTANTIATE_BACKWARD(float)
ATTNRES_INSTANTIATE_BACKWARD(c10::Half)
ATTNRES_INSTANTIATE_BACKWARD(c10::BFloat16)
#undef ATTNRES_INSTANTIATE_BACKWARD

}  // namespace cuda
}  // namespace attnres
