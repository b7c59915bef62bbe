// CUDA implementation of attnres::depth_attention_{fwd,bwd}: host side.
//
// Same checks, outputs and math as the CPU kernels (csrc/cpu/). Everything
// is launched on the current stream under a device guard, with no host
// synchronization and no host->device copies, so the ops can be captured in
// a CUDA graph:
//  - source pointers travel in the kernel parameters (kTableCapacity of
//    them); the rest are written to a device table by small kernels whose
//    parameters carry them (no pageable memcpy);
//  - scratch memory comes from the caching allocator;
//  - the query/gain gradient is reduced deterministically: per-CTA partial
//    rows, then a fixed-order sum (sum_partial_rows_kernel; no float atomics).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "attnres/checks.h"
#include "launch.h"
#include "plan.h"

namespace attnres {
namespace cuda {

struct OverflowChunk {
  SourceEntry entries[kTableCapacity];
  int count;
};

__global__ void fill_overflow_table(const __grid_constant__ OverflowChunk chunk,
                                    SourceEntry* dst) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < chunk.count) dst[i] = chunk.entries[i];
}

namespace {

void check_width_supported(int64_t D) {
  TORCH_CHECK_VALUE(D <= kMaxD,
                    "sources have D = ", D,
                    " but the CUDA kernels of attnres support D <= ", kMaxD);
}

// The sources as a pointer table for the kernels (no stacking: strided rows
// are used in place; layouts that don't collapse to rows are copied once).
struct DeviceSources {
  std::vector<at::Tensor> keep;
  SourceTable table{};
  at::Tensor overflow;  // SourceEntry[N - kTableCapacity] on the device
  bool vector_aligned = true;

  DeviceSources(at::TensorList sources, const std::vector<at::Tensor>* grads,
                int64_t T, int natural, size_t elem_size, cudaStream_t stream) {
    const int64_t N = static_cast<int64_t>(sources.size());
    std::vector<SourceEntry> entries(N);
    keep.reserve(N);
    for (int64_t i = 0; i < N; ++i) {
      Rows r = as_rows(sources[i]);
      entries[i].src = r.tensor.const_data_ptr();
      entries[i].row_stride = r.row_stride;
      entries[i].grad = grads ? (*grads)[i].data_ptr() : nullptr;
      vector_aligned = vector_aligned && rows_aligned(entries[i].src, r.row_stride,
                                                      T, natural, elem_size);
      keep.push_back(std::move(r.tensor));
    }
    const int64_t in_table = std::min<int64_t>(N, kTableCapacity);
    for (int64_t i = 0; i < in_table; ++i) table.first[i] = entries[i];
    if (N <= kTableCapacity) return;
    overflow = at::empty(
        {(N - kTableCapacity) * static_cast<int64_t>(sizeof(SourceEntry))},
        sources[0].options().dtype(at::kByte));
    auto* dst = reinterpret_cast<SourceEntry*>(overflow.data_ptr());
    for (int64_t first = kTableCapacity; first < N; first += kTableCapacity) {
      OverflowChunk chunk{};
      chunk.count = static_cast<int>(std::min<int64_t>(kTableCapacity, N - first));
      for (int j = 0; j < chunk.count; ++j) chunk.entries[j] = entries[first + j];
      fill_overflow_table<<<1, kTableCapacity, 0, stream>>>(
          chunk, dst + (first - kTableCapacity));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  const SourceEntry* overflow_entries() const {
    return overflow.defined()
               ? reinterpret_cast<const SourceEntry*>(overflow.const_data_ptr())
               : nullptr;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> depth_attention_fwd_cuda(
    at::TensorList sources, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double eps, double scale) {
  const DepthProblem p = check_forward_args(sources, query, norm_weight, eps);
  check_width_supported(p.D);
  const c10::cuda::CUDAGuard guard(sources[0].device());
  const auto dtype = sources[0].scalar_type();
  const auto acc = acc_dtype_for(dtype);
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  // Named references, not structured bindings: C++17 lambdas cannot capture those.
  ForwardOutputs outputs = allocate_forward_outputs(sources, p);
  at::Tensor& out = outputs.out;
  at::Tensor& rstd = outputs.rstd;
  at::Tensor& weights = outputs.weights;
  if (p.T == 0) return {out, rstd, weights};

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, dtype, "depth_attention_fwd_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        constexpr int natural = natural_vec<scalar_t>();
        const DeviceSources src(sources, nullptr, p.T, natural, sizeof(scalar_t), stream);
        const TileConfig tile = choose_tile(p.D, src.vector_aligned, natural);

        ForwardParams<scalar_t> params{};
        params.table = src.table;
        params.overflow = src.overflow_entries();
        params.u = u.const_data_ptr<acc_t>();
        params.out = out.data_ptr<scalar_t>();
        params.rstd = rstd.data_ptr<acc_t>();
        params.weights = weights.data_ptr<acc_t>();
        params.T = p.T;
        params.token_blocks = ceil_div(p.T, tile.tokens_per_cta);
        params.N = static_cast<int>(p.N);
        params.D = static_cast<int>(p.D);
        params.group = tile.group;
        params.tokens_per_cta = tile.tokens_per_cta;
        params.eps = static_cast<acc_t>(eps);

        LaunchConfig config;
        config.tile = tile;
        config.grid = std::min(params.token_blocks, kMaxGrid);
        launch_forward<scalar_t>(params, config, stream);
      });
  return {out, rstd, weights};
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>
depth_attention_bwd_cuda(const at::Tensor& grad_out, at::TensorList sources,
                         const at::Tensor& query,
                         const std::optional<at::Tensor>& norm_weight,
                         const at::Tensor& rstd, const at::Tensor& weights,
                         double scale) {
  const DepthProblem p = check_backward_args(grad_out, sources, query,
                                             norm_weight, rstd, weights);
  check_width_supported(p.D);
  const c10::cuda::CUDAGuard guard(sources[0].device());
  const auto dtype = sources[0].scalar_type();
  const auto acc = acc_dtype_for(dtype);
  const at::Tensor u = effective_query(query, norm_weight, scale, acc);
  std::vector<at::Tensor> grads = allocate_source_grads(sources);
  // Z = sum over tokens and sources of alpha_i v_i (see depth_math.h).
  at::Tensor z = at::empty({p.D}, query.options().dtype(acc));
  if (p.T == 0) z.zero_();

  if (p.T > 0) {
    const at::Tensor rstd_c = rstd.contiguous();
    const at::Tensor weights_c = weights.contiguous();
    const Rows dh = as_rows(grad_out);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, dtype, "depth_attention_bwd_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          constexpr int natural = natural_vec<scalar_t>();
          const DeviceSources src(sources, &grads, p.T, natural, sizeof(scalar_t), stream);
          const bool vector_ok =
              src.vector_aligned && rows_aligned(dh.tensor.const_data_ptr(), dh.row_stride,
                                                 p.T, natural, sizeof(scalar_t));
          const BackwardPlan plan = plan_backward(
              choose_backward_tile(p.D, vector_ok, natural), p.N, p.D, natural, sizeof(acc_t),
              static_cast<int64_t>(props->sharedMemPerBlockOptin));
          const TileConfig& tile = plan.tile;
          const size_t smem = plan.smem_bytes;

          BackwardParams<scalar_t> params{};
          params.table = src.table;
          params.overflow = src.overflow_entries();
          params.u = u.const_data_ptr<acc_t>();
          params.grad_out = dh.tensor.const_data_ptr<scalar_t>();
          params.grad_out_stride = dh.row_stride;
          params.rstd = rstd_c.const_data_ptr<acc_t>();
          params.weights = weights_c.const_data_ptr<acc_t>();
          params.T = p.T;
          params.token_blocks = ceil_div(p.T, tile.tokens_per_cta);
          params.N = static_cast<int>(p.N);
          params.D = static_cast<int>(p.D);
          params.group = tile.group;
          params.tokens_per_cta = tile.tokens_per_cta;
          params.stage = plan.stage;

          // A grid that fits the device at once: each CTA loops over tokens
          // and keeps its share of z in registers, so the partial rows stay
          // few. It depends only on the shape and the device: same bits
          // every run.
          const int blocks_per_sm = backward_blocks_per_sm<scalar_t>(tile, smem);
          TORCH_CHECK(blocks_per_sm > 0,
                      "attnres: the CUDA backward kernel cannot run with ",
                      tile.group * tile.tokens_per_cta, " threads and ", smem,
                      " bytes of shared memory on this device");
          const int64_t resident =
              static_cast<int64_t>(blocks_per_sm) * props->multiProcessorCount;
          LaunchConfig config;
          config.tile = tile;
          config.grid = std::min({params.token_blocks, resident, kMaxGrid});
          config.smem_bytes = smem;

          at::Tensor partial = at::empty({config.grid, p.D}, z.options());
          params.z_partial = partial.data_ptr<acc_t>();
          launch_backward<scalar_t>(params, config, stream);

          launch_sum_partial_rows<acc_t>(partial.const_data_ptr<acc_t>(), config.grid,
                                         static_cast<int>(p.D), z.data_ptr<acc_t>(), stream);
        });
  }

  auto [grad_query, grad_gain] = parameter_grads(z, query, norm_weight, scale);
  return {grads, grad_query, grad_gain};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CUDA, m) {
  m.impl("depth_attention_fwd", &depth_attention_fwd_cuda);
  m.impl("depth_attention_bwd", &depth_attention_bwd_cuda);
}

}  // namespace cuda
}  // namespace attnres
