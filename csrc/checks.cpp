// Argument checks shared by every backend; see include/attnres/checks.h.
#include "attnres/checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace attnres {
namespace {

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
  TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == D, name,
                    " must have shape [D] = [", D, "], got ", p.sizes());
  TORCH_CHECK_TYPE(p.scalar_type() == src0.scalar_type() ||
                       (p.scalar_type() == at::kFloat &&
                        is_reduced(src0.scalar_type())),
                   name, " must have the sources' dtype (",
                   src0.scalar_type(),
                   ") or float32 when the sources are bfloat16/float16, got ",
                   p.scalar_type());
  TORCH_CHECK_VALUE(p.device() == src0.device(), name, " is on device ",
                    p.device(), " but the sources are on device ",
                    src0.device());
}

}  // namespace

at::ScalarType acc_dtype_for(at::ScalarType source_dtype) {
  return source_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

DepthProblem check_forward_args(at::TensorList sources, const at::Tensor& query,
                                const std::optional<at::Tensor>& norm_weight,
                                double eps) {
  TORCH_CHECK_VALUE(!sources.empty(),
                    "sources must be a non-empty list of tensors [..., D]");
  const at::Tensor& src0 = sources[0];
  TORCH_CHECK_VALUE(src0.defined(), "sources[0] is an undefined tensor");
  TORCH_CHECK_VALUE(src0.dim() >= 1,
                    "sources must have at least one dimension [..., D], got "
                    "a 0-dim tensor");
  TORCH_CHECK_TYPE(is_supported_dtype(src0.scalar_type()),
                   "sources must be float64, float32, bfloat16 or float16, "
                   "got ",
                   src0.scalar_type());
  const int64_t D = src0.size(-1);
  TORCH_CHECK_VALUE(D > 0, "sources must have a non-zero last dimension D, "
                    "got shape ", src0.sizes());
  for (size_t i = 1; i < sources.size(); ++i) {
    const at::Tensor& s = sources[i];
    TORCH_CHECK_VALUE(s.defined(), "sources[", i, "] is an undefined tensor");
    TORCH_CHECK_VALUE(s.sizes() == src0.sizes(), "sources[", i,
                      "] has shape ", s.sizes(), " but sources[0] has shape ",
                      src0.sizes(), ": all sources must have the same shape");
    TORCH_CHECK_TYPE(s.scalar_type() == src0.scalar_type(), "sources[", i,
                     "] has dtype ", s.scalar_type(),
                     " but sources[0] has dtype ", src0.scalar_type(),
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
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0,
                    "eps must be a finite number >= 0, got ", eps);

  DepthProblem p;
  p.N = static_cast<int64_t>(sources.size());
  p.D = D;
  p.lead_shape.assign(src0.sizes().begin(), src0.sizes().end() - 1);
  p.T = 1;
  for (int64_t s : p.lead_shape) p.T *= s;
  return p;
}

DepthProblem check_backward_args(const at::Tensor& grad_out,
                                 at::TensorList sources,
                                 const at::Tensor& query,
                                 const std::optional<at::Tensor>& norm_weight,
                                 const at::Tensor& rstd,
                                 const at::Tensor& weights) {
  DepthProblem p = check_forward_args(sources, query, norm_weight, 0.0);
  const at::Tensor& src0 = sources[0];
  TORCH_CHECK_VALUE(grad_out.defined() && grad_out.sizes() == src0.sizes(),
                    "grad_out must have the sources' shape ", src0.sizes());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == src0.scalar_type(),
                   "grad_out must have the sources' dtype ",
                   src0.scalar_type(), ", got ", grad_out.scalar_type());
  TORCH_CHECK_VALUE(grad_out.device() == src0.device(),
                    "grad_out must be on the sources' device");
  std::vector<int64_t> stat_shape{p.N};
  stat_shape.insert(stat_shape.end(), p.lead_shape.begin(),
                    p.lead_shape.end());
  const auto acc = acc_dtype_for(src0.scalar_type());
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{rstd, "rstd"},
        std::pair<const at::Tensor&, const char*>{weights, "weights"}}) {
    TORCH_CHECK_VALUE(t.defined() && t.sizes() == at::IntArrayRef(stat_shape),
                      name, " must have shape [N, ...] = ",
                      at::IntArrayRef(stat_shape));
    TORCH_CHECK_TYPE(t.scalar_type() == acc, name, " must have dtype ", acc,
                     ", got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == src0.device(), name,
                      " must be on the sources' device");
  }
  return p;
}

Rows as_rows(const at::Tensor& t) {
  const int64_t nd = t.dim();
  const int64_t D = t.size(-1);
  // Rows of D values must be contiguous (a width-1 row always is).
  bool ok = D == 1 || t.stride(-1) == 1;
  int64_t row_stride = nd >= 2 ? t.stride(nd - 2) : 0;
  // Leading dims collapse into one stride if each is the next one's span.
  // Size-1 dims carry no stride constraint.
  int64_t expected = -1;
  for (int64_t k = nd - 2; ok && k >= 0; --k) {
    if (t.size(k) == 1) continue;
    if (expected < 0) {
      row_stride = t.stride(k);
    } else if (t.stride(k) != expected) {
      ok = false;
    }
    expected = t.stride(k) * t.size(k);
  }
  if (ok) return Rows{t, row_stride};
  at::Tensor c = t.contiguous();
  return Rows{c, D};
}

at::Tensor effective_query(const at::Tensor& query,
                           const std::optional<at::Tensor>& norm_weight,
                           double scale, at::ScalarType acc_dtype) {
  at::Tensor u = query.to(acc_dtype).mul(scale);
  if (norm_weight.has_value() && norm_weight->defined()) {
    u.mul_(norm_weight->to(acc_dtype));
  }
  return u.contiguous();
}

ForwardOutputs allocate_forward_outputs(at::TensorList sources,
                                        const DepthProblem& p) {
  const at::Tensor& src0 = sources[0];
  const auto acc = acc_dtype_for(src0.scalar_type());
  std::vector<int64_t> stat_shape{p.N};
  stat_shape.insert(stat_shape.end(), p.lead_shape.begin(), p.lead_shape.end());
  ForwardOutputs o;
  o.out = at::empty(src0.sizes(),
                    src0.options().memory_format(at::MemoryFormat::Contiguous));
  o.rstd = at::empty(stat_shape, src0.options().dtype(acc));
  o.weights = at::empty(stat_shape, src0.options().dtype(acc));
  return o;
}

std::vector<at::Tensor> allocate_source_grads(at::TensorList sources) {
  std::vector<at::Tensor> grads;
  grads.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    grads.push_back(at::empty(
        sources[0].sizes(),
        sources[0].options().memory_format(at::MemoryFormat::Contiguous)));
  }
  return grads;
}

std::pair<at::Tensor, at::Tensor> parameter_grads(
    const at::Tensor& z, const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight, double scale) {
  const bool has_gain = norm_weight.has_value() && norm_weight->defined();
  const at::Tensor zs = z.mul(scale);
  at::Tensor grad_query =
      (has_gain ? zs.mul(norm_weight->to(z.scalar_type())) : zs)
          .to(query.scalar_type());
  at::Tensor grad_gain =
      zs.mul(query.to(z.scalar_type()))
          .to(has_gain ? norm_weight->scalar_type() : query.scalar_type());
  return {grad_query, grad_gain};
}

}  // namespace attnres
