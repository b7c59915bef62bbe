// Launcher of the forward kernel for every compiled tile and dtype.
#include "kernels.cuh"
#include "launch_kernel.cuh"

namespace attnres {
namespace cuda {

template <typename scalar_t>
void launch_forward(const ForwardParams<scalar_t>& params, const LaunchConfig& config,
                    cudaStream_t stream) {
  // The fused output norm (params.norm_weight set) has its own
  // instantiation, so the plain kernel's registers do not change.
  const bool normed = params.norm_weight != nullptr;
  launch_tiled<scalar_t, kMaxElemsPerThread>(
      [normed](auto vec, auto vpt, auto group) {
        constexpr int VEC = decltype(vec)::value, VPT = decltype(vpt)::value;
        constexpr int kGroup = decltype(group)::value;
        return normed ? depth_attention_fwd_kernel<scalar_t, VEC, VPT, true, kGroup>
                      : depth_attention_fwd_kernel<scalar_t, VEC, VPT, false, kGroup>;
      },
      params, config, stream);
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
