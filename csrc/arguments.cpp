// Argument checks shared by every device; see include/attnres/arguments.h.
#include "attnres/arguments.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>

namespace attnres {

std::string py_dtype(at::ScalarType dtype) { return "torch." + c10::getDtypeNames(dtype).first; }

namespace {

// A layout as Python names it (torch.sparse_coo), as the fake kernels print it.
const char* py_layout(at::Layout layout) {
  switch (layout) {
    case at::kStrided: return "torch.strided";
    case at::kSparse: return "torch.sparse_coo";
    case at::kSparseCsr: return "torch.sparse_csr";
    case at::kSparseCsc: return "torch.sparse_csc";
    case at::kSparseBsr: return "torch.sparse_bsr";
    case at::kSparseBsc: return "torch.sparse_bsc";
    case at::kMkldnn: return "torch._mkldnn";
    case at::kJagged: return "torch.jagged";
    default: return "an unknown layout";
  }
}

}  // namespace

void check_dense(const at::Tensor& t, const char* name, int64_t index) {
  if (!t.is_nested() && t.layout() == at::kStrided) return;
  const std::string what =
      index >= 0 ? std::string(name) + "[" + std::to_string(index) + "]" : std::string(name);
  TORCH_CHECK_VALUE(!t.is_nested(), what,
                    " is a nested tensor: depth_attention takes dense (strided) "
                    "tensors; pass the components one by one or pad them");
  TORCH_CHECK_VALUE(false, what, " has layout ", py_layout(t.layout()),
                    ": depth_attention takes dense (strided) tensors");
}

void check_dense_inputs(at::TensorList tensors, const char* name) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined()) check_dense(tensors[i], name, static_cast<int64_t>(i));
  }
}

namespace {

// The largest finite value of the accumulation dtype: eps and scale enter
// the kernels in it, so they must be finite there too.
double acc_max(at::ScalarType source_dtype) {
  return source_dtype == at::kDouble ? std::numeric_limits<double>::max()
                                     : static_cast<double>(std::numeric_limits<float>::max());
}

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kBFloat16 ||
         t == at::kHalf;
}

bool is_reduced(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf;
}

// query and norm_weight: [D], same device, dtype of the sources or fp32 with
// bf16/fp16 sources.
void check_parameter(const at::Tensor& p, const char* name,
                     const at::Tensor& src0, int64_t D) {
  TORCH_CHECK_VALUE(p.defined(), name, " must be a tensor of shape [D] = [", D,
                    "]");
  check_dense(p, name);
  TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == D, name,
                    " must have shape [D] = [", D, "], got ", p.sizes());
  TORCH_CHECK_TYPE(p.scalar_type() == src0.scalar_type() ||
                       (p.scalar_type() == at::kFloat &&
                        is_reduced(src0.scalar_type())),
                   name, " must have the sources' dtype (",
                   py_dtype(src0.scalar_type()),
                   ") or float32 when the sources are bfloat16/float16, got ",
                   py_dtype(p.scalar_type()));
  TORCH_CHECK_VALUE(p.device() == src0.device(), name, " is on device ",
                    p.device(), " but the sources are on device ",
                    src0.device());
}

}  // namespace

std::vector<int64_t> DepthProblem::stat_shape() const {
  std::vector<int64_t> shape{N};
  shape.insert(shape.end(), lead_shape.begin(), lead_shape.end());
  return shape;
}

at::ScalarType acc_dtype_for(at::ScalarType source_dtype) {
  return source_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

DepthProblem check_forward_args(at::TensorList sources, const at::Tensor& query,
                                const std::optional<at::Tensor>& norm_weight,
                                double eps, double scale) {
  TORCH_CHECK_VALUE(!sources.empty(),
                    "sources must be a non-empty list of tensors [..., D]");
  const at::Tensor& src0 = sources[0];
  TORCH_CHECK_VALUE(src0.defined(), "sources[0] is an undefined tensor");
  check_dense(src0, "sources", 0);
  TORCH_CHECK_VALUE(src0.dim() >= 1,
                    "sources must have at least one dimension [..., D], got "
                    "a 0-dim tensor");
  TORCH_CHECK_TYPE(is_supported_dtype(src0.scalar_type()),
                   "sources must be float64, float32, bfloat16 or float16, "
                   "got ",
                   py_dtype(src0.scalar_type()));
  const int64_t D = src0.size(-1);
  TORCH_CHECK_VALUE(D > 0, "sources must have a non-zero last dimension D, "
                    "got shape ", src0.sizes());
  for (size_t i = 1; i < sources.size(); ++i) {
    const at::Tensor& s = sources[i];
    TORCH_CHECK_VALUE(s.defined(), "sources[", i, "] is an undefined tensor");
    check_dense(s, "sources", static_cast<int64_t>(i));
    TORCH_CHECK_VALUE(s.sizes() == src0.sizes(), "sources[", i,
                      "] has shape ", s.sizes(), " but sources[0] has shape ",
                      src0.sizes(), ": all sources must have the same shape");
    TORCH_CHECK_TYPE(s.scalar_type() == src0.scalar_type(), "sources[", i,
                     "] has dtype ", py_dtype(s.scalar_type()),
                     " but sources[0] has dtype ", py_dtype(src0.scalar_type()),
                     ": all sources must have the same dtype");
    TORCH_CHECK_VALUE(s.device() == src0.device(), "sources[", i,
                      "] is on device ", s.device(),
                      " but sources[0] is on device ", src0.device(),
                      ": all sources must be on the same device");
  }
  check_parameter(query, "query", src0, D);
  if (norm_weight.has_value() && norm_weight->defined()) {
    check_parameter(*norm_weight, "norm_weight", src0, D);
  }
  const double limit = acc_max(src0.scalar_type());
  const char* acc_name = src0.scalar_type() == at::kDouble ? "float64" : "float32";
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0,
                    "eps must be a finite number >= 0, got ", eps);
  TORCH_CHECK_VALUE(eps <= limit, "eps must be finite in ", acc_name,
                    ", the accumulation dtype of ", py_dtype(src0.scalar_type()),
                    " sources (at most ", limit, "), got ", eps);
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be a finite number, got ",
                    scale);
  TORCH_CHECK_VALUE(std::fabs(scale) <= limit, "scale must be finite in ", acc_name,
                    ", the accumulation dtype of ", py_dtype(src0.scalar_type()),
                    " sources (|scale| at most ", limit, "), got ", scale);

  DepthProblem p;
  p.N = static_cast<int64_t>(sources.size());
  p.D = D;
  p.lead_shape.assign(src0.sizes().begin(), src0.sizes().end() - 1);
  p.T = 1;
  for (int64_t s : p.lead_shape) p.T *= s;
  return p;
}

void check_out_norm_args(const at::Tensor& out_weight, double out_eps,
                         at::TensorList sources, const DepthProblem& p) {
  const at::Tensor& src0 = sources[0];
  check_parameter(out_weight, "out_weight", src0, p.D);
  const double limit = acc_max(src0.scalar_type());
  TORCH_CHECK_VALUE(std::isfinite(out_eps) && out_eps >= 0.0 && out_eps <= limit,
                    "out_eps must be a finite number >= 0 (finite in the accumulation "
                    "dtype), got ", out_eps);
}

void check_stat(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype,
                const at::Tensor& src0) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor");
  check_dense(t, name);
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", py_dtype(dtype), ", got ",
                   py_dtype(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == src0.device(), name, " must be on the sources' device");
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                const char* like_name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor");
  check_dense(t, name);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have ", like_name, " shape ",
                    like.sizes(), ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have ", like_name,
                   " dtype ", py_dtype(like.scalar_type()), ", got ", py_dtype(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on ", like_name, " device");
}

namespace {
void check_mask(const c10::List<bool>& mask, size_t expected, const char* what) {
  TORCH_CHECK_VALUE(mask.size() == expected, "output_mask must have ", expected, " entries (",
                    what, "), got ", mask.size());
}
}  // namespace

void check_reads_mask(const c10::List<bool>& mask, size_t n_sources, bool with_out_weight) {
  if (with_out_weight) {
    check_mask(mask, n_sources + 3, "each source, queries, norm_weights, out_weight");
  } else {
    check_mask(mask, n_sources + 2, "each source, queries, norm_weights");
  }
}

void check_merge_mask(const c10::List<bool>& mask, bool with_out_weight) {
  if (with_out_weight) {
    check_mask(mask, 6, "partial_out, lse, block_sum, query, norm_weight, out_weight");
  } else {
    check_mask(mask, 5, "partial_out, lse, block_sum, query, norm_weight");
  }
}

DepthProblem check_backward_args(const std::optional<at::Tensor>& grad_out,
                                 const std::optional<at::Tensor>& grad_weights,
                                 at::TensorList sources, const at::Tensor& query,
                                 const std::optional<at::Tensor>& norm_weight,
                                 const at::Tensor& h, const at::Tensor& rstd,
                                 const at::Tensor& weights, double scale,
                                 const c10::List<bool>& output_mask,
                                 const std::optional<at::Tensor>& out_weight,
                                 const std::optional<at::Tensor>& out_rstd) {
  DepthProblem p = check_forward_args(sources, query, norm_weight, 0.0, scale);
  const at::Tensor& src0 = sources[0];
  if (grad_out.has_value() && grad_out->defined()) {
    check_like(*grad_out, "grad_out", src0, "the sources'");
  }
  // The forward's h: the backward reads <dh, h> from it (docs/design.md §2).
  check_like(h, "h (the forward's read)", src0, "the sources'");
  const auto stat_shape = p.stat_shape();
  const auto acc = acc_dtype_for(src0.scalar_type());
  check_stat(rstd, "rstd", stat_shape, acc, src0);
  check_stat(weights, "weights", stat_shape, acc, src0);
  if (grad_weights.has_value() && grad_weights->defined()) {
    check_stat(*grad_weights, "grad_weights", stat_shape, acc, src0);
  }
  const bool normed = out_weight.has_value() && out_weight->defined();
  const int64_t flags = p.N + (normed ? 3 : 2);
  TORCH_CHECK_VALUE(static_cast<int64_t>(output_mask.size()) == flags,
                    "output_mask must have N + ", flags - p.N, " = ", flags,
                    " entries (each source, query, norm_weight",
                    normed ? ", out_weight" : "", "), got ", output_mask.size());
  if (normed) {
    check_out_norm_args(*out_weight, 0.0, sources, p);
    check_stat(out_rstd.value_or(at::Tensor()), "out_rstd", p.lead_shape, acc, src0);
  }
  return p;
}

bool shares_memory(const at::Tensor& contiguous, const at::Tensor& t) {
  if (contiguous.numel() == 0 || t.numel() == 0 || !t.has_storage() ||
      !contiguous.storage().is_alias_of(t.storage()))
    return false;
  const int64_t a0 = contiguous.storage_offset() * contiguous.element_size();
  const int64_t a1 = a0 + contiguous.numel() * contiguous.element_size();
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const int64_t b0 = t.storage_offset() * t.element_size();
  const int64_t b1 = b0 + extent * t.element_size();
  return a0 < b1 && b0 < a1;
}

}  // namespace attnres
