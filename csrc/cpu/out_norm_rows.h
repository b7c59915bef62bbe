// The fused output norm's row epilogue and prologue (docs/design.md §11),
// and its call's tensors as the kernels take them (OutNormStore,
// OutNormGradRows), shared by the one-call kernels (kernels_cpu.cpp) and the
// Block reads (block_reads_cpu.cpp). Like vec_rows.h, only for the files
// built with the vector ISA flags: an anonymous namespace gives each its
// own copy.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "attnres/depth_math.h"
#include "attnres/op_sequence.h"  // OutNormForward, OutNormBackward
#include "vec_rows.h"

namespace attnres {
namespace cpu {
namespace {

// The fused output norm's store (docs/design.md §11): h = acc * factor
// rounded to scalar_t (the h the backward gets, so its r and n = r h agree
// with the saved h; also what the unfused read + RMSNorm computes),
// y = (r h) * w with r from sum(h^2) (rescued when out of range, as a key
// row), and h itself where h_out is set. Returns r.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
acc_t row_normed_store(scalar_t* y, scalar_t* h_out, const acc_t* acc, acc_t factor,
                       const acc_t* w, acc_t eps, int64_t D) {
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  const AVec f(factor);
  auto rounded_h = [&](int64_t j, AVec (&h)[L::kParts]) {
    for (int k = 0; k < L::kParts; ++k) h[k] = AVec::loadu(acc + j + k * AVec::size()) * f;
    if constexpr (L::kReduced) {
      std::tie(h[0], h[1]) =
          at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(h[0], h[1]));
    }
  };
  auto rounded_h_at = [&](int64_t j) {
    return static_cast<acc_t>(static_cast<scalar_t>(acc[j] * factor));
  };
  AVec sq[L::kParts];
  for (int k = 0; k < L::kParts; ++k) sq[k] = AVec(acc_t(0));
  int64_t j = 0;
  for (; j + L::kStep <= D; j += L::kStep) {
    AVec h[L::kParts];
    rounded_h(j, h);
    for (int k = 0; k < L::kParts; ++k) sq[k] = at::vec::fmadd(h[k], h[k], sq[k]);
  }
  acc_t sumsq = hsum(sq[0]);
  if constexpr (L::kParts == 2) sumsq += hsum(sq[1]);
  for (; j < D; ++j) {
    const acc_t h = rounded_h_at(j);
    sumsq += h * h;
  }
  acc_t r;
  if (!math::row_needs_rescale(sumsq, acc_t(0), eps)) {
    r = math::rstd_from_sumsq(sumsq, D, eps);
  } else {  // rare: scalar
    const acc_t c = math::rescale_factor(sumsq);
    acc_t sumsq_c = 0;
    for (int64_t d = 0; d < D; ++d) {
      const acc_t hc = rounded_h_at(d) * c;
      sumsq_c += hc * hc;
    }
    r = math::out_norm_rstd_rescaled(sumsq_c, c, D, eps);
  }
  const AVec rv(r);
  j = 0;
  for (; j + L::kStep <= D; j += L::kStep) {
    AVec h[L::kParts], o[L::kParts];
    rounded_h(j, h);
    for (int k = 0; k < L::kParts; ++k) {
      o[k] = (h[k] * rv) * AVec::loadu(w + j + k * AVec::size());
    }
    L::store(y + j, o);
    if (h_out) L::store(h_out + j, h);
  }
  for (; j < D; ++j) {
    const acc_t h = rounded_h_at(j);
    y[j] = static_cast<scalar_t>((h * r) * w[j]);
    if (h_out) h_out[j] = static_cast<scalar_t>(h);
  }
  return r;
}

// The fused output norm's backward prologue of one token: dh (accumulation
// dtype) from dy, the saved h and the norm's r; dw += dy * n where dw is
// set. Two sweeps of rows in L1: c = <g, n>/D, then dh.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_normed_grad(acc_t* dh, const scalar_t* dy, const scalar_t* h, const acc_t* w, acc_t r,
                     acc_t* dw, int64_t D) {
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  const AVec rv(r);
  // One step of dy, g = dy * w and n = h r: both sweeps form them alike.
  auto g_and_n = [&](int64_t j, AVec (&dyv)[L::kParts], AVec (&g)[L::kParts],
                     AVec (&n)[L::kParts]) {
    AVec hv[L::kParts];
    L::load(dy + j, dyv);
    L::load(h + j, hv);
    for (int k = 0; k < L::kParts; ++k) {
      g[k] = dyv[k] * AVec::loadu(w + j + k * AVec::size());
      n[k] = hv[k] * rv;
    }
  };
  AVec cs[L::kParts];
  for (int k = 0; k < L::kParts; ++k) cs[k] = AVec(acc_t(0));
  int64_t j = 0;
  for (; j + L::kStep <= D; j += L::kStep) {
    AVec dyv[L::kParts], g[L::kParts], n[L::kParts];
    g_and_n(j, dyv, g, n);
    for (int k = 0; k < L::kParts; ++k) cs[k] = at::vec::fmadd(g[k], n[k], cs[k]);
  }
  acc_t c = hsum(cs[0]);
  if constexpr (L::kParts == 2) c += hsum(cs[1]);
  for (; j < D; ++j) {
    c += (static_cast<acc_t>(dy[j]) * w[j]) * (static_cast<acc_t>(h[j]) * r);
  }
  c /= acc_t(D);
  const AVec cv(c);
  j = 0;
  for (; j + L::kStep <= D; j += L::kStep) {
    AVec dyv[L::kParts], g[L::kParts], n[L::kParts];
    g_and_n(j, dyv, g, n);
    for (int k = 0; k < L::kParts; ++k) {
      const int64_t jk = j + k * AVec::size();
      math::out_norm_grad(rv, g[k], cv, n[k]).store(dh + jk);
      if (dw) at::vec::fmadd(dyv[k], n[k], AVec::loadu(dw + jk)).store(dw + jk);
    }
  }
  for (; j < D; ++j) {
    const acc_t dyj = static_cast<acc_t>(dy[j]);
    const acc_t n = static_cast<acc_t>(h[j]) * r;
    dh[j] = math::out_norm_grad(r, dyj * w[j], c, n);
    if (dw) dw[j] += dyj * n;
  }
}

// The fused output norm of a forward (OutNormForward) as pointers, null
// without it (then false): the norm's weight and eps, the r per token to
// set, and the h to keep (null: not kept).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
struct OutNormStore {
  const acc_t* w = nullptr;
  acc_t eps = 0;
  acc_t* rstd = nullptr;
  scalar_t* h = nullptr;

  explicit OutNormStore(const OutNormForward* norm) {
    if (!norm) return;
    w = norm->weight.const_data_ptr<acc_t>();
    eps = static_cast<acc_t>(norm->eps);
    rstd = norm->rstd.data_ptr<acc_t>();
    if (norm->h.defined()) h = norm->h.data_ptr<scalar_t>();
  }
  explicit operator bool() const { return w != nullptr; }
  // Token t's row of the kept h, or null.
  scalar_t* h_row(int64_t t, int64_t D) const { return h ? h + t * D : nullptr; }
  // Token t's y row (and h_out where set) from its accumulator row, and
  // its r (row_normed_store).
  void store(int64_t t, scalar_t* y, scalar_t* h_out, const acc_t* acc, acc_t factor,
             int64_t D) const {
    rstd[t] = row_normed_store(y, h_out, acc, factor, w, eps, D);
  }
};

// The fused output norm of a backward (OutNormBackward) as rows and
// pointers, empty without it (then false): the forward's h (any strides),
// the norm's weight and the forward's r per token.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
struct OutNormGradRows {
  std::optional<RowsOf<scalar_t>> h;
  const acc_t* w = nullptr;
  const acc_t* r = nullptr;
  bool want_dw = false;  // the weight's gradient is to be set

  OutNormGradRows(const OutNormBackward* norm, const at::Tensor* h_saved) {
    if (!norm) return;
    h.emplace(*h_saved);
    w = norm->weight.const_data_ptr<acc_t>();
    r = norm->rstd.const_data_ptr<acc_t>();
    want_dw = norm->grad_weight.defined();
  }
  explicit operator bool() const { return h.has_value(); }
  // Token t's dh row from its dy row; dw += dy * n where dw is set
  // (row_normed_grad).
  void grad(acc_t* dh, int64_t t, const scalar_t* dy, acc_t* dw, int64_t D) const {
    row_normed_grad(dh, dy, h->row(t), w, r[t], dw, D);
  }
};

}  // namespace
}  // namespace cpu
}  // namespace attnres
