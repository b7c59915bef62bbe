// attnres::DepthStream and attnres::AttnResResidual (include/attnres/modules.h):
// the C++ counterparts of python/attnres/modules.py, with the same rules
// (docs/design.md §1) and the same error words. TORCH_CHECK_VALUE /
// TORCH_CHECK_TYPE throw c10::ValueError / c10::TypeError, which Python sees
// as ValueError / TypeError.
#include "attnres/modules.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <string>

#include "attnres/ops.h"

namespace attnres {
namespace {

// Python's name of a dtype ("torch.float32"), so the messages read alike.
std::string py_dtype(at::ScalarType dtype) {
  return "torch." + c10::getDtypeNames(dtype).first;
}

std::optional<int64_t> checked_block_size(std::optional<int64_t> block_size) {
  TORCH_CHECK_VALUE(!block_size || *block_size > 0,
                    "block_size must be None (Full AttnRes) or a positive int S (Block "
                    "AttnRes), got ",
                    *block_size);
  return block_size;
}

}  // namespace

// ---- DepthStream ------------------------------------------------------------

DepthStream::DepthStream(at::Tensor embedding, std::optional<int64_t> block_size)
    : embedding_(std::move(embedding)) {
  TORCH_CHECK_TYPE(embedding_.defined(),
                   "embedding must be a tensor [..., D], got an undefined tensor");
  TORCH_CHECK_VALUE(embedding_.dim() >= 1 && embedding_.size(-1) != 0,
                    "embedding must have shape [..., D] with D > 0, got ", embedding_.sizes());
  TORCH_CHECK_TYPE(embedding_.is_floating_point(),
                   "embedding must be a floating-point tensor, got ",
                   py_dtype(embedding_.scalar_type()));
  block_size_ = checked_block_size(block_size);
  completed_.push_back(embedding_);
}

std::vector<at::Tensor> DepthStream::sources() const {
  std::vector<at::Tensor> out = completed_;
  if (partial_.defined()) out.push_back(partial_);
  return out;
}

int64_t DepthStream::num_sources() const {
  return static_cast<int64_t>(completed_.size()) + (partial_.defined() ? 1 : 0);
}

void DepthStream::append(const at::Tensor& output) {
  at::Tensor f = checked_output(output);
  ++num_outputs_;
  if (!block_size_) {
    completed_.push_back(std::move(f));
    return;
  }
  partial_ = partial_.defined() ? partial_ + f : f;  // out of place: autograd sees each step
  if (++in_partial_ == *block_size_) {
    completed_.push_back(partial_);
    partial_ = at::Tensor();
    in_partial_ = 0;
  }
}

at::Tensor DepthStream::checked_output(const at::Tensor& f) const {
  TORCH_CHECK_TYPE(f.defined(), "DepthStream.append expects a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(f.sizes() == embedding_.sizes(), "DepthStream.append: output has shape ",
                    f.sizes(), " but the stream's embedding has shape ", embedding_.sizes(),
                    "; every sublayer output must have the embedding's shape");
  TORCH_CHECK_VALUE(f.device() == device(), "DepthStream.append: output is on device ",
                    f.device(), " but the stream is on device ", device());
  if (f.scalar_type() != dtype()) {
    const at::DeviceType device_type = f.device().type();
    if (f.is_floating_point() && at::autocast::is_autocast_available(device_type) &&
        at::autocast::is_autocast_enabled(device_type)) {
      return f.to(dtype());
    }
    TORCH_CHECK_TYPE(false, "DepthStream.append: output has dtype ", py_dtype(f.scalar_type()),
                     " but the stream's dtype (its embedding's) is ", py_dtype(dtype()),
                     "; outside torch.autocast every output must have the stream dtype");
  }
  return f;
}

std::ostream& operator<<(std::ostream& out, const DepthStream& stream) {
  out << "DepthStream(";
  if (stream.block_size()) {
    out << "Block(S=" << *stream.block_size() << ")";
  } else {
    out << "Full";
  }
  return out << ", shape=" << stream.shape() << ", dtype=" << py_dtype(stream.dtype())
             << ", outputs=" << stream.num_outputs() << ", sources=" << stream.num_sources()
             << ")";
}

// ---- AttnResResidual --------------------------------------------------------

AttnResResidualImpl::AttnResResidualImpl(const AttnResResidualOptions& options_)
    : options(options_) {
  // NOLINTNEXTLINE(clang-analyzer-optin.cplusplus.VirtualCall)
  reset();
}

void AttnResResidualImpl::reset() {
  TORCH_CHECK_VALUE(options.dim() > 0,
                    "dim must be a positive int (the model width D), got ", options.dim());
  TORCH_CHECK_VALUE(options.eps() >= 0.0 && std::isfinite(options.eps()),
                    "eps must be a finite number >= 0, got ", options.eps());
  at::TensorOptions factory;
  if (options.dtype()) factory = factory.dtype(*options.dtype());
  if (options.device()) factory = factory.device(*options.device());
  query = register_parameter("query", at::empty({options.dim()}, factory));
  if (options.key_norm_affine()) {
    norm_weight = register_parameter("norm_weight", at::empty({options.dim()}, factory));
  } else {
    norm_weight = at::Tensor();
  }
  reset_parameters();
}

void AttnResResidualImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  query.zero_();
  if (norm_weight.defined()) norm_weight.fill_(1.0);
}

void AttnResResidualImpl::check_width(const DepthStream& stream) const {
  TORCH_CHECK_VALUE(stream.width() == options.dim(), "AttnResResidual has width dim = ",
                    options.dim(), " but the DepthStream has width D = ", stream.width());
}

at::Tensor AttnResResidualImpl::forward(const DepthStream& stream) {
  check_width(stream);
  return depth_attention(stream.sources(), query,
                         norm_weight.defined() ? std::optional<at::Tensor>(norm_weight)
                                               : std::nullopt,
                         options.eps());
}

std::tuple<at::Tensor, at::Tensor> AttnResResidualImpl::forward_with_weights(
    const DepthStream& stream) {
  check_width(stream);
  return depth_attention_with_weights(
      stream.sources(), query,
      norm_weight.defined() ? std::optional<at::Tensor>(norm_weight) : std::nullopt,
      options.eps());
}

void AttnResResidualImpl::pretty_print(std::ostream& stream) const {
  stream << "attnres::AttnResResidual(dim=" << options.dim() << ", eps=" << options.eps()
         << ", key_norm_affine=" << (options.key_norm_affine() ? "true" : "false") << ")";
}

}  // namespace attnres
