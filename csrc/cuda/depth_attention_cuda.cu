// CUDA kernels of attnres::depth_attention_{fwd,bwd}: the device side of the
// host sequence in attnres/op_sequence.h (checks, u, output allocation and
// the parameter gradients are shared with the CPU).
//
// Everything is launched on the current stream with no host synchronization
// and no host->device copies, so the ops can be captured in a CUDA graph:
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
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include "attnres/op_sequence.h"
#include "attnres/row_layout.h"
#include "device_sources.cuh"
#include "kernel_params.h"
#include "launch.h"
#include "plan.h"

namespace attnres {
namespace cuda {

namespace {

// ATTNRES_CUDA_RING (parse_switch, plan.h), read once: whether the
// forward and backward take their cp.async rings where planned ("1") or
// never (unset or "0", the default).
bool rings_allowed() {
  static const bool allowed = parse_switch("ATTNRES_CUDA_RING", std::getenv("ATTNRES_CUDA_RING"), false);
  return allowed;
}

// ATTNRES_CUDA_FEW_TOKENS (parse_switch, plan.h), read once:
// whether the forward takes the few-token kernels where planned (unset or
// "1", the default) or never ("0").
bool few_tokens_allowed() {
  static const bool allowed =
      parse_switch("ATTNRES_CUDA_FEW_TOKENS", std::getenv("ATTNRES_CUDA_FEW_TOKENS"), true);
  return allowed;
}

void check_width_supported(const DepthProblem& p) {
  TORCH_CHECK_VALUE(p.D <= kMaxD, "sources have D = ", p.D,
                    " but the CUDA kernels of attnres support D <= ", kMaxD);
}

void forward(const ForwardCall& call) {
  const DepthProblem& p = call.problem;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.sources[0].scalar_type(), "attnres_forward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        DeviceSources src(call.sources, nullptr, p.T, natural_vec<scalar_t>(),
                          sizeof(scalar_t), stream);
        // The fused prefix add (docs/design.md §12): the kernel reads the
        // last source P with delta's row and writes P' (call.prefix->sum,
        // contiguous) while it reads the sources.
        std::optional<Rows> delta;
        if (call.prefix) {
          delta.emplace(as_rows(call.prefix->delta));
          align_forward_prefix<scalar_t>(src.layout, delta->tensor.const_data_ptr<scalar_t>(),
                                         delta->row_stride,
                                         call.prefix->sum.const_data_ptr<scalar_t>(), p.T, p.D);
        }
        // Few tokens (plan_few_tokens, ATTNRES_CUDA_FEW_TOKENS): each token's
        // row split across CTAs, their partial sums in scratch.
        const FewTokensPlan few =
            few_tokens_allowed()
                ? plan_few_tokens(p.T, p.N, p.D, src.layout.vector_aligned,
                                  natural_vec<scalar_t>(), props->multiProcessorCount)
                : FewTokensPlan{};
        // Else the cp.async ring when a token's rows fit its stages
        // (plan_forward) and rings are allowed (ATTNRES_CUDA_RING): a grid of
        // a few waves of the ring kernel's resident CTAs, each looping over
        // token blocks; else (or when the ring kernel cannot be resident:
        // occupancy 0) the register pipeline, one CTA per token block.
        const int64_t optin = static_cast<int64_t>(props->sharedMemPerBlockOptin);
        ForwardPlan plan = few.splits > 0 ? ForwardPlan{}
                                          : forward_plan<scalar_t>(src.layout, p.N, p.D, optin,
                                                                   rings_allowed());
        int64_t grid_cap = kMaxGrid;
        if (plan.ring_stages > 0) {
          const int blocks_per_sm = forward_ring_blocks_per_sm<scalar_t>(
              plan.tile, plan.smem_bytes, call.out_norm != nullptr);
          if (blocks_per_sm > 0) {
            grid_cap = forward_ring_grid_cap(static_cast<int64_t>(blocks_per_sm) *
                                             props->multiProcessorCount);
          } else {
            plan = forward_plan<scalar_t>(src.layout, p.N, p.D, optin, false);
          }
        }
        auto launch = forward_launch<scalar_t>(
            plan, src.layout, src.overflow_on_device(), call.u.const_data_ptr<acc_t>(),
            call.out.data_ptr<scalar_t>(), call.rstd.data_ptr<acc_t>(),
            call.weights.data_ptr<acc_t>(), p.T, p.N, p.D, static_cast<acc_t>(call.eps),
            grid_cap);
        at::Tensor few_scratch;
        if (few.splits > 0) {
          few_scratch = at::empty(
              {few_tokens_scratch_elems(few, p.T, p.N, call.out_norm != nullptr)},
              call.u.options());
          set_few_tokens<scalar_t>(launch, few, few_scratch.data_ptr<acc_t>());
        }
        at::Tensor norm_weight;
        if (const OutNormForward* norm = call.out_norm) {
          // The epilogue normalizes h in registers (few tokens: the norm
          // kernel): out gets (h r) * w, norm->h (when kept) h itself
          // (docs/design.md §7).
          norm_weight = pack_aligned(norm->weight);
          set_forward_norm<scalar_t>(
              launch.params, norm_weight.const_data_ptr<acc_t>(), norm->rstd.data_ptr<acc_t>(),
              norm->h.defined() ? norm->h.data_ptr<scalar_t>() : nullptr,
              static_cast<acc_t>(norm->eps));
        }
        if (delta) {
          set_forward_prefix<scalar_t>(launch.params, delta->tensor.const_data_ptr<scalar_t>(),
                                       delta->row_stride, call.prefix->sum.data_ptr<scalar_t>());
        }
        if (few.splits > 0) {
          launch_few_tokens<scalar_t>(launch.params, launch.config, stream);
        } else {
          launch_forward<scalar_t>(launch.params, launch.config, stream);
        }
      });
}

// float32/float64: the single-pass backward (sum_j a_j dp_j = <dh, h> +
// sum_j a_j gw_j from the forward's h, call.out); bfloat16/float16: the
// two-pass one (from the saved weights; docs/design.md §2, §7, §8). With
// the output norm (call.out_norm), grad_out is dy and every kernel reads h
// (call.out) to form dh in its prologue.
void backward(const BackwardCall& call) {
  const DepthProblem& p = call.problem;
  const OutNormBackward* norm = call.out_norm;
  const bool want_dw = norm && norm->grad_weight.defined();
  const Rows dh = as_rows(call.grad_out);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, call.sources[0].scalar_type(), "attnres_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const DeviceSources src(call.sources, &call.grad_sources, p.T, natural_vec<scalar_t>(),
                                sizeof(scalar_t), stream);
        const scalar_t* grad_out = dh.tensor.const_data_ptr<scalar_t>();
        // h only where it is read (as rows: a layout that does not collapse
        // into rows is copied, which the plain two-pass kernel need not pay).
        const Rows h =
            backward_single_pass<scalar_t>() || norm ? as_rows(call.out) : Rows{};
        const scalar_t* out =
            h.tensor.defined() ? h.tensor.const_data_ptr<scalar_t>() : nullptr;
        // The cp.async ring where plan_backward takes it and rings are
        // allowed (ATTNRES_CUDA_RING); the plan without it when the ring
        // kernel cannot be resident (occupancy 0).
        const int64_t optin = static_cast<int64_t>(props->sharedMemPerBlockOptin);
        auto plan_with = [&](bool allow_ring) {
          return backward_plan<scalar_t>(src.layout, grad_out, dh.row_stride, out, h.row_stride,
                                         p.T, p.N, p.D, optin, norm != nullptr, want_dw,
                                         allow_ring);
        };
        BackwardPlan plan = plan_with(rings_allowed());
        // A grid of a few waves of the CTAs the device holds at once
        // (backward_grid_cap): each CTA loops over tokens and keeps its share
        // of z in registers, so the partial rows stay few. It depends only on
        // the shape, the device, the tile and the ring switch: same bits
        // every run.
        int blocks_per_sm = backward_blocks_per_sm<scalar_t>(
            plan.tile, plan.smem_bytes, norm != nullptr, plan.ring_stages > 0);
        if (plan.ring_stages > 0 && blocks_per_sm == 0) {
          plan = plan_with(false);
          blocks_per_sm =
              backward_blocks_per_sm<scalar_t>(plan.tile, plan.smem_bytes, norm != nullptr, false);
        }
        TORCH_CHECK(blocks_per_sm > 0, "attnres: the CUDA backward kernel cannot run with ",
                    plan.tile.group * plan.tile.tokens_per_cta, " threads and ",
                    plan.smem_bytes, " bytes of shared memory on this device");
        auto launch = backward_launch<scalar_t>(
            plan, src.layout, src.overflow_on_device(), call.u.const_data_ptr<acc_t>(), grad_out,
            dh.row_stride, out, h.row_stride, call.rstd.const_data_ptr<acc_t>(),
            call.weights.const_data_ptr<acc_t>(),
            call.grad_weights.defined() ? call.grad_weights.const_data_ptr<acc_t>() : nullptr,
            p.T, p.N, p.D,
            backward_grid_cap(static_cast<int64_t>(blocks_per_sm) * props->multiProcessorCount,
                              p.D, sizeof(acc_t)),
            norm != nullptr);
        at::Tensor partial;
        if (call.z.defined()) {
          partial = at::empty({launch.config.grid, p.D}, call.z.options());
          launch.params.z_partial = partial.data_ptr<acc_t>();
        }
        // The output norm's weight gradient: per-CTA partial rows like z's
        // (and the per-thread accumulators in global memory when the plan
        // found no room for them in shared memory), summed in a fixed order.
        at::Tensor norm_weight, dw_partial, dw_slots;
        if (norm) {
          norm_weight = pack_aligned(norm->weight);
          if (want_dw) {
            dw_partial = at::empty({launch.config.grid, p.D}, norm->grad_weight.options());
            if (plan.norm_slots_offset < 0) {
              dw_slots = at::empty({launch.config.grid, plan.norm_slots_per_cta},
                                   norm->grad_weight.options());
            }
          }
          set_backward_norm<scalar_t>(
              launch.params, norm_weight.const_data_ptr<acc_t>(),
              norm->rstd.const_data_ptr<acc_t>(),
              dw_partial.defined() ? dw_partial.data_ptr<acc_t>() : nullptr,
              dw_slots.defined() ? dw_slots.data_ptr<acc_t>() : nullptr);
        }
        launch_backward<scalar_t>(launch.params, launch.config, stream);
        if (call.z.defined()) {
          launch_sum_partial_rows<acc_t>(partial.const_data_ptr<acc_t>(), launch.config.grid,
                                         static_cast<int>(p.D), call.z.data_ptr<acc_t>(), stream);
        }
        if (want_dw) {
          launch_sum_partial_rows<acc_t>(dw_partial.const_data_ptr<acc_t>(), launch.config.grid,
                                         static_cast<int>(p.D),
                                         norm->grad_weight.data_ptr<acc_t>(), stream);
        }
      });
}

constexpr DeviceKernels kCudaKernels{&check_width_supported, &forward, &backward};

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CUDA, m) { register_device_kernels<kCudaKernels>(m); }

}  // namespace cuda
}  // namespace attnres
