// Launcher of the forward kernel for every compiled tile and dtype.
#include <c10/cuda/CUDAException.h>

#include "kernels.cuh"

namespace attnres {
namespace cuda {

template <typename scalar_t>
void launch_forward(const ForwardParams<scalar_t>& params,
                    const LaunchConfig& config, cudaStream_t stream) {
  with_tile<scalar_t>(config.tile.vec, config.tile.vpt, [&](auto vec, auto vpt) {
    constexpr int VEC = decltype(vec)::value;
    constexpr int VPT = decltype(vpt)::value;
    const int threads = config.tile.group * config.tile.tokens_per_cta;
    depth_attention_fwd_kernel<scalar_t, VEC, VPT>
        <<<static_cast<unsigned>(config.grid), threads, config.smem_bytes, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template void launch_forward<double>(const ForwardParams<double>&, const LaunchConfig&,
                                     cudaStream_t);
template void launch_forward<float>(const ForwardParams<float>&, const LaunchConfig&,
                                    cudaStream_t);
template void launch_forward<c10::Half>(const ForwardParams<c10::Half>&,
                                        const LaunchConfig&, cudaStream_t);
template void launch_forward<c10::BFloat16>(const ForwardParams<c10::BFloat16>&,
                                            const LaunchConfig&, cudaStream_t);

}  // namespace cuda
}  // namespace attnres
