// The one host sequence of depth_attention_fwd/bwd, shared by every device:
//   check the arguments -> u = scale * query * gain (accumulation dtype)
//   -> allocate the outputs -> the device's kernel -> query/gain gradients.
// The fused output norm (out_weight) is an optional part of both.
// A device supplies only its kernels (DeviceKernels) and registers them with
// register_device_kernels; see cpu/register_cpu.cpp and
// cuda/depth_attention_cuda.cu.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "attnres/arguments.h"

namespace attnres {

// u = scale * query * gain in the accumulation dtype, contiguous ([D], or
// [S, D] for the S readers of a block, docs/design.md §10).
at::Tensor effective_query(const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                           double scale, at::ScalarType acc);

// dquery = scale * gain * Z and dgain = scale * query * Z (docs/design.md
// §2; Z, query and gain [D] or [S, D]), in the parameters' dtypes.
std::pair<at::Tensor, at::Tensor> parameter_grads(const at::Tensor& z, const at::Tensor& query,
                                                  const std::optional<at::Tensor>& norm_weight,
                                                  double scale);

// The end of a backward: the query/gain gradients from z (where z is
// defined), undefined where not wanted, and the wanted source gradients
// only, in order (the schemas' grad_sources).
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> finish_backward(
    std::vector<at::Tensor>& grads, const at::Tensor& z, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double scale, bool want_query, bool want_gain);

// The fused output norm of a read (docs/design.md §11): the forward writes
// y = RMSNorm(h) * weight instead of h, the backward starts from dy.
struct OutNormForward {
  const at::Tensor& weight;  // [D], accumulation dtype, contiguous
  double eps;
  at::Tensor& rstd;  // [lead...], accumulation dtype: the norm's rstd per token
  at::Tensor& h;     // h itself (the backward's), contiguous; undefined: not kept
};

struct OutNormBackward {
  const at::Tensor& weight;  // [D], accumulation dtype, contiguous
  const at::Tensor& rstd;    // the forward's, contiguous
  at::Tensor& grad_weight;   // [D], accumulation dtype: to set; undefined: not wanted
};

// The fused prefix add of a read (docs/design.md §12): delta [..., D] (any
// strides) and the contiguous P' = P + delta to fill, P being the read's
// last source (the partial block sum).
struct PrefixAdd {
  const at::Tensor& delta;
  at::Tensor& sum;
};

// What a device's forward kernel gets: outputs already allocated
// (out contiguous in the sources' dtype; rstd and weights [N, ...]
// contiguous in the accumulation dtype). Never called with T == 0.
struct ForwardCall {
  const DepthProblem& problem;
  at::TensorList sources;
  const at::Tensor& u;  // scale * query * gain, [D], accumulation dtype
  double eps;
  at::Tensor& out;
  at::Tensor& rstd;
  at::Tensor& weights;
  // Non-null (out_weight given): out gets RMSNorm(h) * out_norm->weight.
  const OutNormForward* out_norm = nullptr;
  // Non-null (delta given): the last source is P, and the read is over P' =
  // P + delta (rounded to the sources' dtype as torch.add), formed into
  // prefix->sum and read from there.
  const PrefixAdd* prefix = nullptr;
};

// What a device's backward kernel gets. grad_out is always defined (zeros
// when h had no gradient); out is the forward's h (the sources' shape and
// dtype, any strides: as_rows), from which sum_j a_j dp_j = <dh, h>; grad_weights [N, ...] (accumulation dtype,
// contiguous) is undefined when the weights had none. grad_sources holds
// one contiguous tensor to fill per source whose gradient is wanted and an
// undefined one otherwise; z [D] (accumulation dtype) is to be set to the
// sum over tokens and sources of alpha_i v_i (docs/design.md §2), or is
// undefined when neither the query nor the gain gradient is wanted. Never
// called with T == 0.
struct BackwardCall {
  const DepthProblem& problem;
  const at::Tensor& grad_out;
  const at::Tensor& grad_weights;
  at::TensorList sources;
  const at::Tensor& u;
  const at::Tensor& out;      // the forward's h
  const at::Tensor& rstd;     // contiguous
  const at::Tensor& weights;  // contiguous
  std::vector<at::Tensor>& grad_sources;
  at::Tensor& z;
  // Non-null (out_weight given): grad_out is the gradient of y =
  // RMSNorm(h) * weight, and out is h; dh is formed per token in the kernel.
  const OutNormBackward* out_norm = nullptr;
};

struct DeviceKernels {
  // Device limits beyond the common checks (may be null); runs before any
  // other work of the call.
  void (*check_supported)(const DepthProblem&);
  void (*forward)(const ForwardCall&);
  void (*backward)(const BackwardCall&);
};

// A forward's fused output norm (docs/design.md §11). With out_weight: the
// weight in the accumulation dtype, the outputs the op returns (h, written
// only with keep_h, else empty; rstd [lead...]) and the kernels' view of
// them. Without it h and rstd are empty tensors and kernel() is null, as
// native_layer_norm returns statistics of a fixed form. Construct after the
// checks (check_out_norm_args) and under the device guard.
class OutNormOutputs {
 public:
  OutNormOutputs(const std::optional<at::Tensor>& out_weight, double out_eps, bool keep_h,
                 const at::Tensor& like, const DepthProblem& p);
  OutNormOutputs(const OutNormOutputs&) = delete;  // kernel() points into it
  const OutNormForward* kernel() const { return view_ ? &*view_ : nullptr; }
  at::Tensor h, rstd;

 private:
  at::Tensor weight_, kernel_h_;
  std::optional<OutNormForward> view_;
};

// A backward's fused output norm: the kernels' view (null without
// out_weight) and the out_weight gradient when wanted.
class OutNormGrads {
 public:
  OutNormGrads(const std::optional<at::Tensor>& out_weight,
               const std::optional<at::Tensor>& out_rstd, bool want_grad, int64_t D);
  OutNormGrads(const OutNormGrads&) = delete;
  const OutNormBackward* kernel() const { return view_ ? &*view_ : nullptr; }
  // The out_weight gradient in out_weight's dtype (undefined: not wanted).
  at::Tensor grad() const;

 private:
  at::Tensor weight_, rstd_, grad_;
  at::ScalarType dtype_ = at::kFloat;
  std::optional<OutNormBackward> view_;
};

// out_eps as the op takes it: `float? out_eps`, following eps when absent.
inline double resolve_out_eps(std::optional<double> out_eps, double eps) {
  return out_eps.value_or(eps);
}

// The op's host functions: the schemas' arguments after the device's kernels.
using ForwardResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using BackwardResult = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor>;

ForwardResult run_forward(const DeviceKernels& kernels, at::TensorList sources,
                          const at::Tensor& query, const std::optional<at::Tensor>& norm_weight,
                          double eps, double scale, const std::optional<at::Tensor>& out_weight,
                          std::optional<double> out_eps, bool keep_h,
                          const std::optional<at::Tensor>& delta);

BackwardResult run_backward(const DeviceKernels& kernels,
                            const std::optional<at::Tensor>& grad_out,
                            const std::optional<at::Tensor>& grad_weights,
                            at::TensorList sources, const at::Tensor& query,
                            const std::optional<at::Tensor>& norm_weight, const at::Tensor& h,
                            const at::Tensor& rstd, const at::Tensor& weights, double scale,
                            const c10::List<bool>& output_mask,
                            const std::optional<at::Tensor>& out_weight,
                            const std::optional<at::Tensor>& out_rstd,
                            const std::optional<at::Tensor>& grad_prefix_out);

// A host function with its first argument (the device's kernels) bound:
// the op's kernel signature, registered as is, so a schema's arguments are
// spelled once more only in the host function itself.
template <auto host, const auto& kernels>
struct BindKernels;
template <class K, class R, class... A, R (*host)(const K&, A...), const K& kernels>
struct BindKernels<host, kernels> {
  static R call(A... args) { return host(kernels, args...); }
};

// Registers a device's kernels for both ops under its dispatch key:
//   TORCH_LIBRARY_IMPL(attnres, CPU, m) { register_device_kernels<kCpu>(m); }
template <const DeviceKernels& kernels>
void register_device_kernels(torch::Library& m) {
  m.impl("depth_attention_fwd", &BindKernels<&run_forward, kernels>::call);
  m.impl("depth_attention_bwd", &BindKernels<&run_backward, kernels>::call);
}

}  // namespace attnres
