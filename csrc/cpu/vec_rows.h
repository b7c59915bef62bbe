// Row vectors of the CPU kernels (kernels_cpu.cpp, block_reads_cpu.cpp):
// a step of a row as accumulation-dtype vectors, and the horizontal sum.
// Only for the files built with the vector ISA flags (CMakeLists.txt), so
// its contents sit in an anonymous namespace: each of them gets its own
// copy, compiled for its own flags.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "attnres/depth_math.h"
#include "attnres/row_layout.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace attnres {
namespace {

// Items (tokens, or token chunks) per parallel task, at least `at_least`,
// so that a task touches at least kParallelGrainElements row elements: a
// smaller call runs on the calling thread, since waking the thread team
// costs more than it takes (at::parallel_for's grain convention).
constexpr int64_t kParallelGrainElements = 65536;
inline int64_t parallel_grain(int64_t elements_per_item, int64_t at_least = 1) {
  const int64_t per = elements_per_item > 0 ? elements_per_item : 1;
  return std::max<int64_t>(at_least, (kParallelGrainElements + per - 1) / per);
}

}  // namespace
}  // namespace attnres

namespace attnres {
namespace cpu {
namespace {

using at::vec::Vectorized;

// Software prefetch distance of the row sweeps that read from memory: the
// hardware prefetcher ramps up too slowly on N interleaved streams (fp32,
// N=16, D=1024 forward: 22.7 ms without, 16.7 ms at 2 KiB, 18.2 ms at 1 KiB,
// 20 ms at 4 KiB on this 2-core machine).
constexpr int64_t kPrefetchBytes = 2048;

// Loads/stores one step of a row as opmath vectors: one vector for
// float/double, two float vectors for bf16/fp16.
template <typename scalar_t>
struct Lanes {
  using acc_t = at::opmath_type<scalar_t>;
  using AVec = Vectorized<acc_t>;
  static constexpr bool kReduced =
      at::vec::is_reduced_floating_point_v<scalar_t>;
  static constexpr int kParts = kReduced ? 2 : 1;
  static constexpr int64_t kStep = AVec::size() * kParts;

  static void load(const scalar_t* p, AVec (&v)[kParts]) {
    if constexpr (kReduced) {
      at::vec::load_to_float<scalar_t>(p, v[0], v[1]);
    } else {
      v[0] = AVec::loadu(p);
    }
  }
  static void store(scalar_t* p, const AVec (&v)[kParts]) {
    if constexpr (kReduced) {
      at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p);
    } else {
      v[0].store(p);
    }
  }
  // A non-temporal store (no read of the line before it is written) where
  // the ISA has one for the type; p must be 32-byte aligned.
  static void store_stream(scalar_t* p, const AVec (&v)[kParts]) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<scalar_t, float>) {
      _mm256_stream_ps(p, v[0]);
      return;
    } else if constexpr (std::is_same_v<scalar_t, double>) {
      _mm256_stream_pd(p, v[0]);
      return;
    } else if constexpr (kReduced) {
      const __m256i packed = at::vec::convert_from_float<scalar_t>(v[0], v[1]);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed);
      return;
    }
#endif
    store(p, v);
  }
};

// Two accumulation vectors of a row: one step of bf16/fp16 (its two float
// halves), two steps of float/double. A sweep that reduces a round at a time
// keeps two FMA chains whose index is a constant after unrolling; a chain
// index computed from j at run time kept the chains in memory (a store and a
// reload per FMA: phase 1's sweeps ran at about half speed, design §10).
template <typename scalar_t>
struct Round {
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  static constexpr int kVecs = 2;
  static constexpr int kSteps = kVecs / L::kParts;
  static constexpr int64_t kSize = kSteps * L::kStep;  // elements a round
  static void load(const scalar_t* p, AVec (&v)[kVecs]) {
#pragma GCC unroll 2
    for (int r = 0; r < kSteps; ++r) {
      AVec part[L::kParts];
      L::load(p + r * L::kStep, part);
#pragma GCC unroll 2
      for (int k = 0; k < L::kParts; ++k) v[r * L::kParts + k] = part[k];
    }
  }
  static void store(scalar_t* p, const AVec (&v)[kVecs]) {
#pragma GCC unroll 2
    for (int r = 0; r < kSteps; ++r) {
      AVec part[L::kParts];
#pragma GCC unroll 2
      for (int k = 0; k < L::kParts; ++k) part[k] = v[r * L::kParts + k];
      L::store(p + r * L::kStep, part);
    }
  }
};

template <typename acc_t>
acc_t hsum(const Vectorized<acc_t>& v) {
  return at::vec::vec_reduce_all<acc_t>(
      [](Vectorized<acc_t>& a, Vectorized<acc_t>& b) { return a + b; }, v);
}

// h of one token whose rows took the range rescue (docs/design.md §8):
// sum_i w_i v_i in math::WideType (no overflow between the terms), kept
// finite (math::keep_finite: the weights sum to 1 only up to rounding), in
// the accumulation dtype. Scalar: rare tokens only.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_average_kept_finite(acc_t* out, const scalar_t* const* rows, const acc_t* w, int64_t N,
                             int64_t D) {
  using wide_t = typename math::WideType<acc_t>::type;
  for (int64_t j = 0; j < D; ++j) {
    wide_t sum = 0;
    for (int64_t i = 0; i < N; ++i) {
      sum += static_cast<wide_t>(w[i]) * static_cast<wide_t>(static_cast<acc_t>(rows[i][j]));
    }
    out[j] = static_cast<acc_t>(math::keep_finite<acc_t>(sum));
  }
}

// Rows of a tensor [..., D] (strided rows used in place; as_rows copies the
// layouts that do not collapse).
template <typename scalar_t>
struct RowsOf {
  Rows rows;
  const scalar_t* ptr;
  explicit RowsOf(const at::Tensor& t) : rows(as_rows(t)) {
    ptr = rows.tensor.template const_data_ptr<scalar_t>();
  }
  const scalar_t* row(int64_t t) const { return ptr + t * rows.row_stride; }
};

// dst = a + b elementwise, each sum rounded to scalar_t once from the
// accumulation type, as torch.add rounds (the fused prefix add P' = P +
// delta of a read, and the merge gradient's dP + dP'); dst may be a.
template <typename scalar_t>
void row_add(scalar_t* dst, const scalar_t* a, const scalar_t* b, int64_t D) {
  using acc_t = at::opmath_type<scalar_t>;
  using L = Lanes<scalar_t>;
  using AVec = typename L::AVec;
  int64_t j = 0;
  for (; j + L::kStep <= D; j += L::kStep) {
    AVec av[L::kParts], bv[L::kParts];
    L::load(a + j, av);
    L::load(b + j, bv);
    for (int k = 0; k < L::kParts; ++k) av[k] = av[k] + bv[k];
    L::store(dst + j, av);
  }
  for (; j < D; ++j) {
    dst[j] = static_cast<scalar_t>(static_cast<acc_t>(a[j]) + static_cast<acc_t>(b[j]));
  }
}

}  // namespace
}  // namespace cpu
}  // namespace attnres
