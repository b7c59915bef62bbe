// CUDA kernels of the two-phase Block read ops, forward and backward
// (docs/design.md §10): the device side of the host sequence in
// attnres/block_read_sequence.h (checks, u and the outputs are shared with
// the CPU). Launched on the current stream with no host synchronization and
// no host->device copies (capturable in a CUDA graph), like
// depth_attention_cuda.cu.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "attnres/block_read_sequence.h"
#include "attnres/row_layout.h"
#include "block_kernels.cuh"
#include "block_read_params.h"
#include "device_sources.cuh"

namespace attnres {
namespace cuda {
namespace {

int64_t sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

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
            call.lse.data_ptr<double>(), call.rstd.data_ptr<acc_t>(),
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
            call.lse.const_data_ptr<double>(), call.u.const_data_ptr<acc_t>(),
            call.out.data_ptr<scalar_t>(), call.rstd.data_ptr<acc_t>(),
            call.weight.data_ptr<acc_t>(), call.T, static_cast<int>(call.D),
            static_cast<acc_t>(call.eps));
        if (norm) {
          set_block_read_norm(p, norm_weight.const_data_ptr<acc_t>(), norm->rstd.data_ptr<acc_t>(),
                              norm->h.defined() ? norm->h.data_ptr<scalar_t>() : nullptr,
                              static_cast<acc_t>(norm->eps));
        }
        std::optional<Rows> delta;
        if (call.prefix) {
          delta.emplace(as_rows(call.prefix->delta));
          p.delta = delta->tensor.const_data_ptr<scalar_t>();
          p.delta_stride = delta->row_stride;
          p.sum_out = call.prefix->sum.data_ptr<scalar_t>();
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

template <typename scalar_t, int VEC, bool kNorm>
void launch_merge_backward(const MergeBackwardParams<scalar_t>& p, int64_t grid,
                           cudaStream_t stream) {
  block_read_merge_bwd_kernel<scalar_t, VEC, kNorm>
      <<<static_cast<unsigned>(grid), kBlockReadThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// z (or dw) = the fixed-order sum of the warps' partial rows.
template <typename acc_t>
void sum_rows(const at::Tensor& partial, int64_t rows, int D, at::Tensor& out,
              cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((D + kSumColumns - 1) / kSumColumns);
  sum_partial_rows_kernel<acc_t><<<blocks, kSumColumns * kSumSlices, 0, stream>>>(
      partial.const_data_ptr<acc_t>(), rows, D, out.data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fused norm's part of a backward launch's parameters (phase 2's, or
// phase 1's reader 0): the saved h, the norm weight (16-byte aligned) and
// rstd, and the warps' partial rows of its gradient when wanted. The
// returned buffers must outlive the launch.
struct NormBackwardBuffers {
  std::optional<Rows> h;
  at::Tensor weight, dw_rows;
};

template <typename scalar_t, typename Params>
NormBackwardBuffers set_backward_norm(Params& p, const OutNormBackward& norm, const at::Tensor& h,
                                      int64_t rows, int64_t D, const at::TensorOptions& acc_opts) {
  using acc_t = at::opmath_type<scalar_t>;
  NormBackwardBuffers b;
  b.h.emplace(as_rows(h));
  p.h = b.h->tensor.template const_data_ptr<scalar_t>();
  p.h_stride = b.h->row_stride;
  b.weight = pack_aligned(norm.weight);
  p.norm_weight = b.weight.template const_data_ptr<acc_t>();
  p.norm_rstd = norm.rstd.template const_data_ptr<acc_t>();
  if (norm.grad_weight.defined()) {
    b.dw_rows = at::empty({rows, D}, acc_opts);
    p.dw_rows = b.dw_rows.template data_ptr<acc_t>();
  }
  return b;
}

// Phase 2's backward: one launch over the tokens, then the fixed-order sums
// of the warps' partial rows (z, and the fused norm's weight gradient).
void merge_backward(const MergeBackwardCall& call) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t grid = merge_backward_grid(call.T, resident_block_read_ctas(), sm_count(), call.D,
                                           static_cast<int64_t>(call.u.element_size()));
  const int64_t rows = merge_backward_rows(grid);
  const int D = static_cast<int>(call.D);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.block_sum.scalar_type(),
      "attnres_block_read_merge_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        constexpr int natural = natural_vec<scalar_t>();
        const Rows grad = as_rows(call.grad_out);
        const Rows partial = as_rows(call.partial_out);
        const Rows block = as_rows(call.block_sum);
        const OutNormBackward* norm = call.out_norm;
        const auto acc_opts = call.block_sum.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
        MergeBackwardParams<scalar_t> p{};
        p.grad_out = grad.tensor.const_data_ptr<scalar_t>();
        p.grad_stride = grad.row_stride;
        p.partial = partial.tensor.const_data_ptr<scalar_t>();
        p.partial_stride = partial.row_stride;
        p.block_sum = block.tensor.const_data_ptr<scalar_t>();
        p.block_stride = block.row_stride;
        p.u = call.u.const_data_ptr<acc_t>();
        p.rstd = call.rstd.const_data_ptr<acc_t>();
        p.weight = call.weight.const_data_ptr<acc_t>();
        p.grad_partial =
            call.grad_partial_out.defined() ? call.grad_partial_out.data_ptr<scalar_t>() : nullptr;
        p.grad_lse = call.grad_lse.defined() ? call.grad_lse.data_ptr<double>() : nullptr;
        p.grad_block =
            call.grad_block_sum.defined() ? call.grad_block_sum.data_ptr<scalar_t>() : nullptr;
        std::optional<Rows> grad_sum;
        if (call.grad_sum && p.grad_block) {
          grad_sum.emplace(as_rows(*call.grad_sum));
          p.grad_sum = grad_sum->tensor.const_data_ptr<scalar_t>();
          p.grad_sum_stride = grad_sum->row_stride;
        }
        p.T = call.T;
        p.D = D;
        at::Tensor z_rows;
        if (call.z.defined()) {
          z_rows = at::empty({rows, call.D}, acc_opts);
          p.z_rows = z_rows.data_ptr<acc_t>();
        }
        NormBackwardBuffers nb;
        if (norm) nb = set_backward_norm<scalar_t>(p, *norm, *call.h, rows, call.D, acc_opts);
        const bool with_norm = norm != nullptr;
        if (block_read_vec(merge_backward_rows_aligned(p, natural), call.D, natural) == natural) {
          with_norm ? launch_merge_backward<scalar_t, natural, true>(p, grid, stream)
                    : launch_merge_backward<scalar_t, natural, false>(p, grid, stream);
        } else {
          with_norm ? launch_merge_backward<scalar_t, 1, true>(p, grid, stream)
                    : launch_merge_backward<scalar_t, 1, false>(p, grid, stream);
        }
        if (z_rows.defined()) sum_rows<acc_t>(z_rows, rows, D, call.z, stream);
        if (nb.dw_rows.defined()) sum_rows<acc_t>(nb.dw_rows, rows, D, norm->grad_weight, stream);
      });
}

template <typename scalar_t, int VEC>
void launch_reads_backward(const BlockReadsBackwardParams<scalar_t>& p, int64_t grid,
                           cudaStream_t stream) {
  block_reads_bwd_kernel<scalar_t, VEC>
      <<<static_cast<unsigned>(grid), kBlockReadThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Phase 1's backward: one launch over the tokens (per-token scratch for the
// readers' sums and coefficients), then the fixed-order sums of the warps'
// partial rows (z [S, D], and reader 0's norm weight gradient).
void reads_backward(const BlockReadsBackwardCall& call) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t N = call.N, S = call.S, D = call.D, T = call.T;
  const int64_t grid = reads_backward_grid(T, resident_block_read_ctas(), sm_count(),
                                           call.z.defined() ? S : 1, D,
                                           static_cast<int64_t>(call.u.element_size()));
  const int64_t rows = merge_backward_rows(grid);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.sources[0].scalar_type(), "attnres_block_reads_backward_cuda",
      [&] {
        using acc_t = at::opmath_type<scalar_t>;
        constexpr int natural = natural_vec<scalar_t>();
        const auto opts = call.sources[0].options();
        const auto acc_opts = opts.dtype(c10::CppTypeToScalarType<acc_t>::value);
        const DeviceSources src(call.sources, &call.grad_sources, T, natural, sizeof(scalar_t),
                                stream);
        const bool has_dy = !call.grad_partial_outs.empty();
        std::optional<DeviceSources> dys;
        if (has_dy) {
          dys.emplace(call.grad_partial_outs, nullptr, T, natural, sizeof(scalar_t), stream);
        }
        BlockReadsBackwardParams<scalar_t> p{};
        p.table = src.layout.table;
        p.overflow = src.overflow_on_device();
        if (has_dy) {
          p.dy_table = dys->layout.table;
          p.dy_overflow = dys->overflow_on_device();
        }
        p.has_dy = has_dy;
        p.u = call.u.const_data_ptr<acc_t>();
        p.rstd = call.rstd.const_data_ptr<acc_t>();
        p.weights = call.weights.const_data_ptr<acc_t>();
        p.grad_lse = call.grad_lse.defined() ? call.grad_lse.const_data_ptr<double>() : nullptr;
        // A warp's scratch ([S, N] twice, [N]); the rare tokens' in double
        // where the accumulation is float.
        const at::Tensor dot = at::empty({rows, S, N}, acc_opts);
        const at::Tensor coef = at::empty({rows, S, N}, acc_opts);
        const at::Tensor beta = at::empty({rows, N}, acc_opts);
        p.dot_scratch = dot.data_ptr<acc_t>();
        p.coef_scratch = coef.data_ptr<acc_t>();
        p.beta = beta.data_ptr<acc_t>();
        at::Tensor wide_dot, wide_coef, wide_beta;
        if constexpr (backward_has_rare_path<acc_t>()) {
          wide_dot = at::empty({rows, S, N}, opts.dtype(at::kDouble));
          wide_coef = at::empty({rows, S, N}, opts.dtype(at::kDouble));
          wide_beta = at::empty({rows, N}, opts.dtype(at::kDouble));
          p.wide_dot = wide_dot.data_ptr<double>();
          p.wide_coef = wide_coef.data_ptr<double>();
          p.wide_beta = wide_beta.data_ptr<double>();
        }
        at::Tensor z_rows;
        if (call.z.defined()) {
          z_rows = at::empty({rows, S, D}, acc_opts);
          p.z_rows = z_rows.data_ptr<acc_t>();
        }
        // Reader 0's fused norm (only where its partial output has a gradient).
        const OutNormBackward* norm = has_dy ? call.out_norm : nullptr;
        NormBackwardBuffers nb;
        if (norm) nb = set_backward_norm<scalar_t>(p, *norm, *call.h, rows, D, acc_opts);
        p.T = T;
        p.N = static_cast<int>(N);
        p.S = static_cast<int>(S);
        p.D = static_cast<int>(D);
        std::vector<const void*> grads;
        for (const auto& g : call.grad_sources) grads.push_back(g.defined() ? g.const_data_ptr() : nullptr);
        const bool aligned = reads_backward_rows_aligned(
            p, src.layout, has_dy ? &dys->layout : nullptr, grads, natural);
        if (block_read_vec(aligned, D, natural) == natural) {
          launch_reads_backward<scalar_t, natural>(p, grid, stream);
        } else {
          launch_reads_backward<scalar_t, 1>(p, grid, stream);
        }
        if (z_rows.defined()) sum_rows<acc_t>(z_rows, rows, static_cast<int>(S * D), call.z, stream);
        if (nb.dw_rows.defined()) {
          sum_rows<acc_t>(nb.dw_rows, rows, static_cast<int>(D), norm->grad_weight, stream);
        }
      });
}

constexpr BlockReadKernels kCudaBlockReadKernels{nullptr, &reads_forward, &merge_forward,
                                                 &merge_backward, &reads_backward};

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CUDA, m) {
  register_block_read_kernels<kCudaBlockReadKernels>(m);
}

}  // namespace cuda
}  // namespace attnres
