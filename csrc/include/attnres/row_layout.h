// Tensors [..., D] seen as T rows of D contiguous values: the only layout
// the kernels read, so strided inputs are used in place whenever they can be.
#pragma once

#include <ATen/core/Tensor.h>

namespace attnres {

// A tensor [..., D] seen as T rows of D contiguous values, one row stride
// apart. Strided inputs whose leading dims collapse are used in place; other
// layouts are copied once (held in `tensor`).
struct Rows {
  at::Tensor tensor;
  int64_t row_stride = 0;
};
Rows as_rows(const at::Tensor& t);

}  // namespace attnres
