// Pieces shared by the C++ autograd of the attnres ops (autograd.cpp for
// depth_attention, block_reads.cpp for the two-phase Block reads) and by
// the C++ API's calls through the dispatcher. Internal: not installed.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "attnres/arguments.h"
#include "attnres/block_reads.h"
#include "attnres/ops.h"

namespace attnres {

// One registered op: its name, its C++ signature (the C++ API function's
// type: the API spells each schema's arguments once) and its family's name
// for messages.
#define ATTNRES_OP(Type, fn, family)                              \
  struct Type {                                                   \
    static constexpr const char* name = "attnres::" #fn;          \
    static constexpr const char* what = family;                   \
    using Signature = decltype(::attnres::fn);                    \
  }

ATTNRES_OP(DepthAttentionFwdOp, depth_attention_fwd, "depth_attention");
ATTNRES_OP(DepthAttentionBwdOp, depth_attention_bwd, "depth_attention");
ATTNRES_OP(BlockReadsFwdOp, block_reads_fwd, "block_reads");
ATTNRES_OP(BlockReadsBwdOp, block_reads_bwd, "block_reads");
ATTNRES_OP(MergeFwdOp, block_read_merge_fwd, "block_read_merge");
ATTNRES_OP(MergeBwdOp, block_read_merge_bwd, "block_read_merge");
ATTNRES_OP(MergeInplaceOp, block_read_merge_inplace, "block_read_merge");
#undef ATTNRES_OP

// Calls an op through the dispatcher; the handle is looked up once per op.
template <class Op, class... Args>
auto call_op(Args&&... args) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(Op::name, "")
                             .template typed<typename Op::Signature>();
  return op.call(std::forward<Args>(args)...);
}

namespace autograd_helpers {

// Calls an op's kernel below the Autograd key (the dispatcher's next key).
template <class Op, class... Args>
auto call_below_autograd(Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return call_op<Op>(std::forward<Args>(args)...);
}

inline bool is_defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline const at::Tensor* ptr(const std::optional<at::Tensor>& t) { return t ? &*t : nullptr; }

// Whether autograd records a call: grad mode on and any of these tensors
// (null: absent) or of the sources requires grad.
inline bool records(std::initializer_list<const at::Tensor*> inputs, at::TensorList sources = {}) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& s : sources) {
    if (s.requires_grad()) return true;
  }
  for (const at::Tensor* t : inputs) {
    if (t && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

// Whether a forward op may run its kernel alone, without a Function node:
// nothing records (`record`), no input carries a forward-mode tangent (dual
// tensors) and no torch.func transform is active. Function::apply refuses
// forward-mode AD; the kernel alone would silently drop the tangents.
inline bool kernel_alone(bool record, std::initializer_list<const at::Tensor*> inputs,
                         at::TensorList sources = {}) {
  // A torch.func transform keeps its dynamic-layer keys included while active.
  using c10::impl::tls_is_dispatch_key_included;
  if (record || tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerBackMode)) {
    return false;
  }
  for (const auto& s : sources) {
    if (s._fw_grad(/*level=*/0).defined()) return false;
  }
  for (const at::Tensor* t : inputs) {
    if (t && t->defined() && t->_fw_grad(/*level=*/0).defined()) return false;
  }
  return true;
}

// Before autograd reads an input's sizes (a nested tensor has none).
inline void check_dense_optional(const std::optional<at::Tensor>& t, const char* name) {
  if (is_defined(t)) check_dense(*t, name);
}

inline std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A backward op's own backward: second derivatives are not implemented and
// must not silently come out as zero.
[[noreturn]] inline void no_double_backward(const char* what) {
  TORCH_CHECK(false, "attnres: second derivatives of ", what,
              " are not implemented (double backward / create_graph=True through its "
              "gradient)");
}

// The defined tensors of a backward op's result, in order: the gradients
// its output_mask asked for (a wanted gradient is always defined).
inline void append_defined(torch::autograd::variable_list& out, const at::Tensor& t) {
  if (t.defined()) out.push_back(t);
}
inline void append_defined(torch::autograd::variable_list& out,
                           const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) append_defined(out, t);
}
template <class Tuple>
torch::autograd::variable_list defined_of(const Tuple& result) {
  torch::autograd::variable_list out;
  std::apply([&](const auto&... part) { (append_defined(out, part), ...); }, result);
  return out;
}

// All of a backward's gradients (output_mask.size() of them, undefined where
// not asked for) from the wanted ones, in order.
inline torch::autograd::variable_list expand_masked(const torch::autograd::variable_list& wanted,
                                                    const c10::List<bool>& output_mask) {
  torch::autograd::variable_list all(output_mask.size());
  size_t next = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (output_mask.get(i)) all[i] = wanted[next++];
  }
  return all;
}

// Whether an argument carries a forward-mode tangent (a dual tensor): a
// kernel called alone would drop it without a word.
inline bool carries_tangent(const at::Tensor& t) {
  return t.defined() && t._fw_grad(/*level=*/0).defined();
}
inline bool carries_tangent(const std::optional<at::Tensor>& t) {
  return t && carries_tangent(*t);
}
inline bool carries_tangent(at::TensorList ts) {
  for (const auto& t : ts) {
    if (carries_tangent(t)) return true;
  }
  return false;
}
inline bool carries_tangent(const std::vector<at::Tensor>& ts) {
  return carries_tangent(at::TensorList(ts));
}
template <class T>
bool carries_tangent(const T&) {  // not a tensor
  return false;
}

// The node a backward op records: its forward runs the op and returns the
// wanted gradients (autograd cannot attach history to an undefined tensor);
// its backward refuses (first derivatives only).
template <class Op>
class BackwardNode : public torch::autograd::Function<BackwardNode<Op>> {
 public:
  template <class... Args>
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* /*ctx*/,
                                                Args&&... args) {
    return defined_of(call_below_autograd<Op>(std::forward<Args>(args)...));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    no_double_backward(Op::what);
  }
  // The call from a first derivative's backward: the op alone when grad
  // mode is off (a backward without create_graph, the usual case: no node
  // to build and drop, a decode-sized backward being host-bound) and no
  // argument carries a tangent, else through this node, so that a second
  // derivative, or forward-mode AD through it, raises.
  template <class... Args>
  static torch::autograd::variable_list run(Args&&... args) {
    if (!at::GradMode::is_enabled() && !(carries_tangent(args) || ...)) {
      return defined_of(call_below_autograd<Op>(std::forward<Args>(args)...));
    }
    return BackwardNode::apply(std::forward<Args>(args)...);
  }
};

// The wanted gradients of a backward op's call, back in its result's form:
// the first n_list flags select the list part (when the result starts with
// one), the others fill the tensor slots in order.
inline std::vector<at::Tensor> take_front(const torch::autograd::variable_list& all,
                                          size_t n) {
  std::vector<at::Tensor> wanted;
  for (size_t i = 0; i < n; ++i) {
    if (all[i].defined()) wanted.push_back(all[i]);
  }
  return wanted;
}

}  // namespace autograd_helpers
}  // namespace attnres
