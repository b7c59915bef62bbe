// Launchers of the backward kernel (every compiled tile and dtype) and of
// the fixed-order sum of its query/gain-gradient partial rows.
#include "kernels.cuh"
#include "launch_kernel.cuh"

namespace attnres {
namespace cuda {
namespace {

template <typename scalar_t>
auto backward_kernel_for() {
  return [](auto vec, auto vpt) {
    return depth_attention_bwd_kernel<scalar_t, decltype(vec)::value, decltype(vpt)::value>;
  };
}

}  // namespace

template <typename scalar_t>
void launch_backward(const BackwardParams<scalar_t>& params, const LaunchConfig& config,
                     cudaStream_t stream) {
  launch_tiled<scalar_t>(backward_kernel_for<scalar_t>(), params, config, stream);
}

template <typename scalar_t>
int backward_blocks_per_sm(const TileConfig& tile, size_t smem_bytes) {
  int blocks = 0;
  with_tile<scalar_t>(tile.vec, tile.vpt, [&](auto vec, auto vpt) {
    blocks = blocks_per_sm(backward_kernel_for<scalar_t>()(vec, vpt),
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
