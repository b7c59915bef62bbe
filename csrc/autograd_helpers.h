// Pieces shared by the C++ autograd of the attnres ops (autograd.cpp for
// depth_attention, block_reads.cpp for the two-phase Block reads). Internal:
// not installed.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <utility>

namespace attnres {
namespace autograd_helpers {

// Calls an op's kernel below the Autograd key (the dispatcher's next key).
template <typename Signature, typename... Args>
auto call_below_autograd(const char* name, Args&&... args) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(std::forward<Args>(args)...);
}

// A backward op's own backward: second derivatives are not implemented and
// must not silently come out as zero.
[[noreturn]] inline void no_double_backward(const char* what) {
  TORCH_CHECK(false, "attnres: second derivatives of ", what,
              " are not implemented (double backward / create_graph=True through its "
              "gradient)");
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

}  // namespace autograd_helpers
}  // namespace attnres
