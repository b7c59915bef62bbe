// Argument checks and shared host-side helpers used by every backend, so that
// C++ callers, the CPU kernels and the CUDA kernels report bad input with the
// same words (the Python wrapper mirrors them in python/attnres/ops.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <vector>

namespace attnres {

// Shape of one depth-attention problem: N sources of [lead..., D], T tokens.
struct DepthProblem {
  int64_t N = 0;
  int64_t D = 0;
  int64_t T = 0;
  std::vector<int64_t> lead_shape;  // the source shape without the last dim
};

DepthProblem check_forward_args(at::TensorList sources, const at::Tensor& query,
                                const std::optional<at::Tensor>& norm_weight,
                                double eps);

DepthProblem check_backward_args(const at::Tensor& grad_out,
                                 at::TensorList sources,
                                 const at::Tensor& query,
                                 const std::optional<at::Tensor>& norm_weight,
                                 const at::Tensor& rstd,
                                 const at::Tensor& weights);

// A tensor [..., D] seen as T rows of D contiguous values, one row stride
// apart. Strided inputs whose leading dims collapse are used in place; other
// layouts are copied once (held in `tensor`).
struct Rows {
  at::Tensor tensor;
  int64_t row_stride = 0;
};
Rows as_rows(const at::Tensor& t);

// u = scale * query * gain in the accumulation dtype (fp64 for fp64
// sources, fp32 otherwise): the only form of query and gain the kernels use.
at::Tensor effective_query(const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight,
                           double scale, at::ScalarType acc_dtype);

// Accumulation dtype for a source dtype.
at::ScalarType acc_dtype_for(at::ScalarType source_dtype);

// The forward's outputs, allocated alike by every backend: out (contiguous,
// the sources' shape and dtype), rstd and weights ([N, ...], acc dtype).
struct ForwardOutputs {
  at::Tensor out, rstd, weights;
};
ForwardOutputs allocate_forward_outputs(at::TensorList sources,
                                        const DepthProblem& p);

// One contiguous gradient per source.
std::vector<at::Tensor> allocate_source_grads(at::TensorList sources);

// dquery = scale * gain * Z and dgain = scale * query * Z (DESIGN.md §2),
// from Z = sum over tokens and sources of alpha_i v_i, in the parameters'
// dtypes (the gain gradient of an absent gain has the query's dtype).
std::pair<at::Tensor, at::Tensor> parameter_grads(
    const at::Tensor& z, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double scale);

}  // namespace attnres
