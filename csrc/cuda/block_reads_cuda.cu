// CUDA kernels of the two-phase Block reads' forward ops (docs/design.md
// §10): the device side of the host sequence in attnres/block_read_sequence.h
// (checks, u and the outputs are shared with the CPU). Launched on the
// current stream with no host synchronization and no host->device copies
// (capturable in a CUDA graph), like depth_attention_cuda.cu. The backward
// ops have no CUDA kernel yet: they raise NotImplementedError here.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attnres/block_read_sequence.h"
#include "attnres/row_layout.h"
#include "block_kernels.cuh"
#include "block_read_params.h"
#include "device_sources.cuh"

namespace attnres {
namespace cuda {
namespace {

int64_t resident_block_read_ctas() {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  return static_cast<int64_t>(props->multiProcessorCount) *
         std::max(1, props->maxThreadsPerMultiProcessor / kBlockReadThreads);
}

template <typename scalar_t, int VEC, bool kNorm>
void launch_reads(const BlockReadsParams<scalar_t>& p, int64_t grid, cudaStream_t stream) {
  block_reads_fwd_kernel<scalar_t, VEC, kNorm>
      <<<static_cast<unsigned>(grid), kBlockReadThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int VEC, bool kNorm>
void launch_merge(const MergeParams<scalar_t>& p, int64_t grid, cudaStream_t stream) {
  block_read_merge_kernel<scalar_t, VEC, kNorm>
      <<<static_cast<unsigned>(grid), kBlockReadThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Phase 1: one launch a kReadersPerLaunch readers (for_each_block_reads_launch;
// each launch reads the sources, and writes the same rstd).
void reads_forward(const BlockReadsForwardCall& call) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t grid = block_read_grid(call.T, resident_block_read_ctas());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.sources[0].scalar_type(), "attnres_block_reads_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        constexpr int natural = natural_vec<scalar_t>();
        const DeviceSources src(call.sources, nullptr, call.T, natural, sizeof(scalar_t), stream);
        const OutNormForward* norm = call.out_norm;
        at::Tensor norm_weight;
        if (norm) norm_weight = pack_aligned(norm->weight);
        std::vector<scalar_t*> outs;
        for (const auto& o : call.partial_outs) outs.push_back(o.data_ptr<scalar_t>());
        scalar_t* h_keep = norm && norm->h.defined() ? norm->h.data_ptr<scalar_t>() : nullptr;
        const int vec = block_read_vec(
            block_reads_rows_aligned<scalar_t>(src.layout, outs.data(), static_cast<int>(call.S),
                                               h_keep, call.T, static_cast<int>(call.D), natural),
            call.D, natural);
        for_each_block_reads_launch<scalar_t>(
            src.layout, src.overflow_on_device(), call.u.const_data_ptr<acc_t>(), outs.data(),
            call.lse.data_ptr<acc_t>(), call.rstd.data_ptr<acc_t>(),
            call.weights.data_ptr<acc_t>(), call.T, static_cast<int>(call.N),
            static_cast<int>(call.S), static_cast<int>(call.D), static_cast<acc_t>(call.eps),
            norm ? norm_weight.const_data_ptr<acc_t>() : nullptr,
            norm ? norm->rstd.data_ptr<acc_t>() : nullptr, h_keep,
            norm ? static_cast<acc_t>(norm->eps) : acc_t(0),
            [&](const BlockReadsParams<scalar_t>& p, bool with_norm) {
              if (vec == natural) {
                with_norm ? launch_reads<scalar_t, natural, true>(p, grid, stream)
                          : launch_reads<scalar_t, natural, false>(p, grid, stream);
              } else {
                with_norm ? launch_reads<scalar_t, 1, true>(p, grid, stream)
                          : launch_reads<scalar_t, 1, false>(p, grid, stream);
              }
            });
      });
}

void merge_forward(const MergeForwardCall& call) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t grid = block_read_grid(call.T, resident_block_read_ctas());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.block_sum.scalar_type(), "attnres_block_read_merge_cuda",
      [&] {
        using acc_t = at::opmath_type<scalar_t>;
        constexpr int natural = natural_vec<scalar_t>();
        // In place (out is partial_out) the op has checked it is contiguous.
        const Rows partial = as_rows(call.partial_out);
        const Rows block = as_rows(call.block_sum);
        const OutNormForward* norm = call.out_norm;
        at::Tensor norm_weight;
        if (norm) norm_weight = pack_aligned(norm->weight);
        MergeParams<scalar_t> p = merge_params<scalar_t>(
            partial.tensor.const_data_ptr<scalar_t>(), partial.row_stride,
            block.tensor.const_data_ptr<scalar_t>(), block.row_stride,
            call.lse.const_data_ptr<acc_t>(), call.u.const_data_ptr<acc_t>(),
            call.out.data_ptr<scalar_t>(), call.rstd.data_ptr<acc_t>(),
            call.weight.data_ptr<acc_t>(), call.T, static_cast<int>(call.D),
            static_cast<acc_t>(call.eps));
        if (norm) {
          set_block_read_norm(p, norm_weight.const_data_ptr<acc_t>(), norm->rstd.data_ptr<acc_t>(),
                              norm->h.defined() ? norm->h.data_ptr<scalar_t>() : nullptr,
                              static_cast<acc_t>(norm->eps));
        }
        const bool aligned = merge_rows_aligned(p, natural);
        const bool with_norm = norm != nullptr;
        if (block_read_vec(aligned, call.D, natural) == natural) {
          with_norm ? launch_merge<scalar_t, natural, true>(p, grid, stream)
                    : launch_merge<scalar_t, natural, false>(p, grid, stream);
        } else {
          with_norm ? launch_merge<scalar_t, 1, true>(p, grid, stream)
                    : launch_merge<scalar_t, 1, false>(p, grid, stream);
        }
      });
}

constexpr BlockReadKernels kCudaBlockReadKernels{nullptr, &reads_forward, &merge_forward};

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CUDA, m) {
  register_block_read_kernels<kCudaBlockReadKernels>(m);
  register_block_read_backward_missing_cuda(m);
}

}  // namespace cuda
}  // namespace attnres
