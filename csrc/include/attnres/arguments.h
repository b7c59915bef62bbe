// Argument checks of the attnres ops, the same for every device, so C++
// callers, the CPU kernels and the CUDA kernels report bad input with the
// same words. In eager mode these are the only checks a call makes; the fake
// kernels in python/attnres/ops.py raise the same words while tracing.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <string>
#include <vector>

namespace attnres {

// Shape of one depth-attention problem: N sources of [lead..., D], T tokens.
struct DepthProblem {
  int64_t N = 0;
  int64_t D = 0;
  int64_t T = 0;
  std::vector<int64_t> lead_shape;  // the source shape without the last dim

  // Shape of the per-source statistics (rstd, weights): [N, lead...].
  std::vector<int64_t> stat_shape() const;
};

DepthProblem check_forward_args(at::TensorList sources, const at::Tensor& query,
                                const std::optional<at::Tensor>& norm_weight,
                                double eps, double scale);

// The backward's arguments: h is the forward's read (its out without
// out_weight); output_mask has N + 2 entries (each source, query,
// norm_weight), N + 3 with out_weight, which also needs out_rstd [lead...]
// in the accumulation dtype.
DepthProblem check_backward_args(const std::optional<at::Tensor>& grad_out,
                                 const std::optional<at::Tensor>& grad_weights,
                                 at::TensorList sources, const at::Tensor& query,
                                 const std::optional<at::Tensor>& norm_weight,
                                 const at::Tensor& h, const at::Tensor& rstd,
                                 const at::Tensor& weights, double scale,
                                 const c10::List<bool>& output_mask,
                                 const std::optional<at::Tensor>& out_weight,
                                 const std::optional<at::Tensor>& out_rstd);

// The fused output norm (docs/design.md §11): out_weight [D] on the sources'
// device, in their dtype or fp32 with bf16/fp16 sources (as query), and
// out_eps finite and >= 0 (as eps).
void check_out_norm_args(const at::Tensor& out_weight, double out_eps,
                         at::TensorList sources, const DepthProblem& p);

// The one tensor check of the saved statistics and incoming gradients: a
// defined dense tensor of `shape` and `dtype` on src0's device
// ("<name> must have shape [..], got [..]"), or, check_like, of the shape,
// dtype and device of `like` ("<name> must have <like_name> shape ..."; like_name
// "the sources'", "block_sum's"). The fake kernels (python/attnres/ops.py)
// mirror these two with one helper.
void check_stat(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype,
                const at::Tensor& src0);
void check_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                const char* like_name);

// A dense (strided) tensor, or a ValueError naming the argument (name, or
// name[index] when index >= 0): nested and sparse tensors have no sizes or
// strides the kernels can read. check_forward_args/check_backward_args run
// it; the autograd kernels run it first, before autograd reads the inputs'
// sizes.
// The two-phase backwards' output_mask: block_reads_bwd has one flag per
// source, queries, norm_weights (and out_weight); block_read_merge_bwd five
// (partial_out, lse, block_sum, query, norm_weight) or six with out_weight.
void check_reads_mask(const c10::List<bool>& mask, size_t n_sources, bool with_out_weight);
void check_merge_mask(const c10::List<bool>& mask, bool with_out_weight);

void check_dense(const at::Tensor& t, const char* name, int64_t index = -1);
void check_dense_inputs(at::TensorList tensors, const char* name);

// Whether two tensors' byte spans in one storage intersect (`contiguous`
// must be contiguous). A span test and not at::get_overlap_status: that one
// answers "too hard" for strided views (an lse viewing a column of
// partial_out), which must be refused too.
bool shares_memory(const at::Tensor& contiguous, const at::Tensor& t);

// A dtype as Python names it (torch.float32): every check's message, C++
// and the fake kernels alike.
std::string py_dtype(at::ScalarType dtype);

// Accumulation dtype for a source dtype: fp64 for fp64, fp32 otherwise.
at::ScalarType acc_dtype_for(at::ScalarType source_dtype);

}  // namespace attnres
