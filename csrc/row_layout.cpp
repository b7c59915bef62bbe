// See include/attnres/row_layout.h.
#include "attnres/row_layout.h"

namespace attnres {

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
  return Rows{t.contiguous(), D};
}

}  // namespace attnres
