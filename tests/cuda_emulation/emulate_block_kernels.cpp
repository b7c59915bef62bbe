// Runs the CUDA kernels of the two-phase Block reads (csrc/cuda/block_kernels.cuh)
// on the CPU (cuda_runtime.h here), with the parameter blocks of
// csrc/cuda/block_read_params.h (the CUDA host code's own set-up), and checks
// every output against a long double evaluation of the formulas (docs/design.md
// §10, §11): phase 1 for S readers (several launches past kReadersPerLaunch),
// phase 2 out of place and in place, each plain and with the fused output
// norm, phase 2's backward (with the fixed-order sums of its partial rows),
// strided and misaligned rows (the one-element path), the grid-stride token
// loop, the source table's overflow, and rows near the dtype's limits (the
// range rescue, §8). Built and run by tests/python/test_cuda_emulation.py.
// Exit status 0 when every case passes.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "block_kernels.cuh"
#include "block_read_params.h"
#include "emulation_common.h"

using namespace attnres::cuda;
using namespace emulation;

namespace {

using ld = long double;
constexpr double kOutEps = 1e-5;  // the output norm's eps

struct Case {
  int N, S, D;
  int64_t T;
  int extra_stride = 0;     // source and block-sum rows D + extra_stride apart
  bool misaligned = false;  // sources start one element past an aligned address
  int64_t grid = 0;         // CTAs (0: one a warp's worth of tokens)
  bool norm = false;        // reader 0 (phase 1) / the reader (phase 2) normed
  bool keep_h = true;
  double magnitude = 0;     // > 0: values uniform in +-magnitude (the range rescue)
  double eps = 1e-6;
  // Every row +magnitude in even columns, -magnitude in odd ones: equal
  // scores, weights that sum to 1 only up to rounding; at the dtype's
  // maximum the reads must stay finite (the wide, clamped sums, §8).
  bool at_magnitude = false;
};

template <typename scalar_t>
std::vector<double> as_double(const std::vector<scalar_t>& v) {
  std::vector<double> d(v.size());
  for (size_t k = 0; k < v.size(); ++k) d[k] = static_cast<double>(v[k]);
  return d;
}

// Reference of one read: rstd and scores of `rows` for query u, the softmax
// (as lse and weights) and h = sum a_i v_i, all in long double.
struct RefRead {
  std::vector<ld> rstd, weights, h;
  ld lse;
};

template <typename acc_t>
RefRead ref_read(const std::vector<std::vector<ld>>& rows, const acc_t* u, int D, double eps) {
  RefRead r;
  const size_t n = rows.size();
  std::vector<ld> score(n);
  ld m = -INFINITY;
  for (size_t i = 0; i < n; ++i) {
    ld sq = 0, dot = 0;
    for (int j = 0; j < D; ++j) {
      sq += rows[i][j] * rows[i][j];
      dot += static_cast<ld>(u[j]) * rows[i][j];
    }
    r.rstd.push_back(1 / std::sqrt(sq / D + static_cast<ld>(static_cast<acc_t>(eps))));
    score[i] = r.rstd[i] * dot;
    m = std::max(m, score[i]);
  }
  ld l = 0;
  for (size_t i = 0; i < n; ++i) l += std::exp(score[i] - m);
  r.lse = m + std::log(l);
  r.h.assign(D, 0);
  for (size_t i = 0; i < n; ++i) {
    r.weights.push_back(std::exp(score[i] - m) / l);
    for (int j = 0; j < D; ++j) r.h[j] += r.weights[i] * rows[i][j];
  }
  return r;
}

// y = (r h) w of the rounded h (scalar_t), as the kernels' norm reads it.
template <typename scalar_t, typename acc_t>
std::vector<ld> ref_norm(const std::vector<ld>& h, const acc_t* w, int D, double eps, ld& r) {
  std::vector<ld> hr(D);
  ld sq = 0;
  for (int j = 0; j < D; ++j) {
    hr[j] = static_cast<ld>(static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(h[j]))));
    sq += hr[j] * hr[j];
  }
  r = 1 / std::sqrt(sq / D + static_cast<ld>(static_cast<acc_t>(eps)));
  std::vector<ld> y(D);
  for (int j = 0; j < D; ++j) y[j] = hr[j] * r * static_cast<ld>(w[j]);
  return y;
}

std::vector<double> to_double(const std::vector<ld>& v) {
  return std::vector<double>(v.begin(), v.end());
}

struct Checker {
  Tolerance tol;
  int failures = 0;
  void check(const std::string& what, const char* name, double err, double limit) {
    const bool ok = err <= limit;
    failures += ok ? 0 : 1;
    std::printf("%s %s %s: rel err %.3g (limit %.3g)\n", ok ? "ok  " : "FAIL", what.c_str(), name,
                err, limit);
  }
};

// One emulated launch of the merge kernel (vec: natural or 1) or of its
// backward, as block_reads_cuda.cu launches them.
template <typename scalar_t>
void emulate_merge(const MergeParams<scalar_t>& p, bool norm, int vec, int64_t grid) {
  constexpr int natural = natural_vec<scalar_t>();
  emu::launch(static_cast<unsigned>(grid), kBlockReadThreads, 0, [&] {
    if (vec == natural) {
      norm ? block_read_merge_kernel<scalar_t, natural, true>(p)
           : block_read_merge_kernel<scalar_t, natural, false>(p);
    } else {
      norm ? block_read_merge_kernel<scalar_t, 1, true>(p)
           : block_read_merge_kernel<scalar_t, 1, false>(p);
    }
  });
}

template <typename scalar_t>
void emulate_merge_backward(const MergeBackwardParams<scalar_t>& p, bool norm, int vec,
                            int64_t grid) {
  constexpr int natural = natural_vec<scalar_t>();
  emu::launch(static_cast<unsigned>(grid), kBlockReadThreads, 0, [&] {
    if (vec == natural) {
      norm ? block_read_merge_bwd_kernel<scalar_t, natural, true>(p)
           : block_read_merge_bwd_kernel<scalar_t, natural, false>(p);
    } else {
      norm ? block_read_merge_bwd_kernel<scalar_t, 1, true>(p)
           : block_read_merge_bwd_kernel<scalar_t, 1, false>(p);
    }
  });
}

// The output norm's contract with the backward (docs/design.md §11): the
// norm's r is that of the h the kernel kept (rounded to scalar_t), and
// y = (h r) w from that h and r.
template <typename scalar_t, typename acc_t>
void check_norm_contract(Checker& chk, const std::string& what, const std::vector<scalar_t>& h,
                         const std::vector<acc_t>& r, const std::vector<scalar_t>& y,
                         const std::vector<acc_t>& w, int64_t T, int D) {
  std::vector<double> r_ref(T), y_ref(T * D);
  for (int64_t t = 0; t < T; ++t) {
    ld sq = 0;
    for (int j = 0; j < D; ++j) sq += static_cast<ld>(h[t * D + j]) * static_cast<ld>(h[t * D + j]);
    r_ref[t] = static_cast<double>(1 / std::sqrt(sq / D + static_cast<ld>(static_cast<acc_t>(kOutEps))));
    for (int j = 0; j < D; ++j) {
      y_ref[t * D + j] = static_cast<double>(static_cast<ld>(h[t * D + j]) *
                                             static_cast<ld>(r[t]) * static_cast<ld>(w[j]));
    }
  }
  chk.check(what, "out rstd of the kept h", rel_err(as_double(r), r_ref), chk.tol.stats);
  chk.check(what, "y = (h r) w", rel_err(as_double(y), y_ref), chk.tol.output);
}

template <typename scalar_t>
void run_case(const Case& c, std::mt19937_64& rng, Checker& chk) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int natural = natural_vec<scalar_t>();
  const int N = c.N, S = c.S, D = c.D;
  const int64_t T = c.T;
  const int64_t stride = D + c.extra_stride;
  const int offset = c.misaligned ? 1 : 0;
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  auto draw = [&](int i) {
    return c.magnitude > 0 ? uniform(rng) * c.magnitude : normal(rng) * (1 + i % 3);
  };
  // N completed sources and the partial block sum (source N), rounded.
  const size_t src_len = offset + T * stride + natural;
  std::vector<std::vector<scalar_t>> src(N + 1, std::vector<scalar_t>(src_len));
  for (int i = 0; i <= N; ++i) {
    for (auto& x : src[i]) x = static_cast<scalar_t>(draw(i));
    if (c.at_magnitude) {
      for (int64_t k = 0; k < static_cast<int64_t>(src[i].size()); ++k) {
        const int64_t col = (k - offset) % stride;
        src[i][k] = static_cast<scalar_t>(col % 2 == 0 ? c.magnitude : -c.magnitude);
      }
    }
  }
  auto row = [&](int i, int64_t t) {
    std::vector<ld> r(D);
    for (int j = 0; j < D; ++j) {
      r[j] = static_cast<ld>(static_cast<acc_t>(src[i][offset + t * stride + j]));
    }
    return r;
  };
  std::vector<acc_t> u(static_cast<size_t>(S) * D), w_out(D);
  for (auto& x : u) x = static_cast<acc_t>(0.8 * normal(rng) / std::sqrt(double(D)));
  for (auto& x : w_out) x = static_cast<acc_t>(1 + 0.3 * normal(rng));

  // ---- phase 1 ----
  std::vector<SourceEntry> entries(N);
  for (int i = 0; i < N; ++i) entries[i] = {src[i].data() + offset, stride, nullptr};
  const SourceTableLayout layout = layout_sources(entries, T, natural, sizeof(scalar_t));
  const scalar_t nan = static_cast<scalar_t>(NAN);
  std::vector<std::vector<scalar_t>> outs(S, std::vector<scalar_t>(T * D, nan));
  std::vector<scalar_t*> out_ptrs(S);
  for (int s = 0; s < S; ++s) out_ptrs[s] = outs[s].data();
  std::vector<double> lse(S * T);  // float64 for every dtype (docs/design.md §10)
  std::vector<acc_t> rstd(N * T), weights(static_cast<size_t>(S) * N * T);
  std::vector<acc_t> norm_rstd(T, static_cast<acc_t>(NAN));
  std::vector<scalar_t> h_keep(c.norm && c.keep_h ? T * D : 0, static_cast<scalar_t>(NAN));
  scalar_t* h_keep_p = h_keep.empty() ? nullptr : h_keep.data();
  const bool aligned1 =
      block_reads_rows_aligned<scalar_t>(layout, out_ptrs.data(), S, h_keep_p, T, D, natural);
  const int vec1 = block_read_vec(aligned1, D, natural);
  const int64_t grid = c.grid > 0 ? c.grid : block_read_grid(T, 0);
  // The CUDA host code's launch loop (block_read_params.h).
  for_each_block_reads_launch<scalar_t>(
      layout, layout.overflow.data(), u.data(), out_ptrs.data(), lse.data(), rstd.data(),
      weights.data(), T, N, S, D, static_cast<acc_t>(c.eps), c.norm ? w_out.data() : nullptr,
      norm_rstd.data(), h_keep_p, static_cast<acc_t>(kOutEps),
      [&](const BlockReadsParams<scalar_t>& p, bool with_norm) {
        emu::launch(static_cast<unsigned>(grid), kBlockReadThreads, 0, [&] {
          if (vec1 == natural) {
            with_norm ? block_reads_fwd_kernel<scalar_t, natural, true>(p)
                      : block_reads_fwd_kernel<scalar_t, natural, false>(p);
          } else {
            with_norm ? block_reads_fwd_kernel<scalar_t, 1, true>(p)
                      : block_reads_fwd_kernel<scalar_t, 1, false>(p);
          }
        });
      });
  // Reference, per token.
  std::vector<ld> ref_out(static_cast<size_t>(S) * T * D), ref_lse(S * T), ref_rstd(N * T),
      ref_w(static_cast<size_t>(S) * N * T), ref_h0(c.norm ? T * D : 0), ref_nr(c.norm ? T : 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::vector<ld>> rows(N);
    for (int i = 0; i < N; ++i) rows[i] = row(i, t);
    for (int s = 0; s < S; ++s) {
      const RefRead r = ref_read(rows, u.data() + static_cast<size_t>(s) * D, D, c.eps);
      ref_lse[s * T + t] = r.lse;
      for (int i = 0; i < N; ++i) {
        ref_w[(static_cast<int64_t>(s) * N + i) * T + t] = r.weights[i];
        if (s == 0) ref_rstd[i * T + t] = r.rstd[i];
      }
      std::vector<ld> y = r.h;
      if (c.norm && s == 0) {
        for (int j = 0; j < D; ++j) ref_h0[t * D + j] = r.h[j];
        y = ref_norm<scalar_t>(r.h, w_out.data(), D, kOutEps, ref_nr[t]);
      }
      for (int j = 0; j < D; ++j) ref_out[(static_cast<int64_t>(s) * T + t) * D + j] = y[j];
    }
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s phase1 N=%d S=%d D=%d T=%ld vec=%d%s%s%s%s",
                dtype_name<scalar_t>(), N, S, D, long(T), vec1, c.norm ? " norm" : "",
                c.norm && c.keep_h ? "+h" : "",
                c.at_magnitude ? " at max" : c.magnitude > 0 ? " range" : "",
                layout.overflow.empty() ? "" : " overflow");
  std::vector<double> got_out;
  for (const auto& o : outs) {
    const auto d = as_double(o);
    got_out.insert(got_out.end(), d.begin(), d.end());
  }
  chk.check(buf, "partial outs", rel_err(got_out, to_double(ref_out)), chk.tol.output);
  chk.check(buf, "lse", rel_err(as_double(lse), to_double(ref_lse)), chk.tol.stats);
  chk.check(buf, "rstd", rel_err(as_double(rstd), to_double(ref_rstd)), chk.tol.stats);
  chk.check(buf, "weights", rel_err(as_double(weights), to_double(ref_w)), chk.tol.stats);
  if (c.norm) {
    chk.check(buf, "out rstd", rel_err(as_double(norm_rstd), to_double(ref_nr)), chk.tol.stats);
    if (c.keep_h) {
      chk.check(buf, "h_0", rel_err(as_double(h_keep), to_double(ref_h0)), chk.tol.output);
      check_norm_contract(chk, buf, h_keep, norm_rstd, outs[0], w_out, T, D);
    }
  }

  // ---- phase 2: reader 1 (or 0) merges the block sum (source N), from the
  // kernel's own phase-1 output and lse, out of place and in place ----
  const int reader = S > 1 ? 1 : 0;
  if (c.norm && reader == 0) return;  // reader 0's output is y_0, not a partial h
  std::vector<ld> ref_h(T * D), ref_y(c.norm ? T * D : 0), ref_r(T), ref_take(T);
  std::vector<ld> ref_mr(c.norm ? T : 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::vector<ld>> rows(N + 1);
    for (int i = 0; i <= N; ++i) rows[i] = row(i, t);
    const RefRead r = ref_read(rows, u.data() + static_cast<size_t>(reader) * D, D, c.eps);
    ref_r[t] = r.rstd[N];
    ref_take[t] = r.weights[N];
    for (int j = 0; j < D; ++j) ref_h[t * D + j] = r.h[j];
    if (c.norm) {
      const std::vector<ld> y = ref_norm<scalar_t>(r.h, w_out.data(), D, kOutEps, ref_mr[t]);
      for (int j = 0; j < D; ++j) ref_y[t * D + j] = y[j];
    }
  }
  for (const bool in_place : {false, true}) {
    if (in_place && c.norm && c.keep_h) continue;  // the in-place op keeps no h
    std::vector<scalar_t> partial = outs[reader];
    std::vector<scalar_t> out_buf(T * D, static_cast<scalar_t>(NAN));
    std::vector<scalar_t> h2(c.norm && c.keep_h ? T * D : 0, static_cast<scalar_t>(NAN));
    std::vector<acc_t> r2(T), take2(T), nr2(T, static_cast<acc_t>(NAN));
    scalar_t* out_p = in_place ? partial.data() : out_buf.data();
    MergeParams<scalar_t> p = merge_params<scalar_t>(
        partial.data(), D, src[N].data() + offset, stride, lse.data() + reader * T,
        u.data() + static_cast<size_t>(reader) * D, out_p, r2.data(), take2.data(), T, D,
        static_cast<acc_t>(c.eps));
    if (c.norm) {
      set_block_read_norm(p, w_out.data(), nr2.data(), h2.empty() ? nullptr : h2.data(),
                          static_cast<acc_t>(kOutEps));
    }
    const int vec2 = block_read_vec(merge_rows_aligned(p, natural), D, natural);
    emulate_merge(p, c.norm, vec2, grid);
    char what[240];
    std::snprintf(what, sizeof what, "%s merge%s vec=%d", buf, in_place ? " in place" : "", vec2);
    const std::vector<scalar_t>& got = in_place ? partial : out_buf;
    chk.check(what, c.norm ? "y" : "h", rel_err(as_double(got), to_double(c.norm ? ref_y : ref_h)),
              chk.tol.output);
    chk.check(what, "rstd", rel_err(as_double(r2), to_double(ref_r)), chk.tol.stats);
    chk.check(what, "weight", rel_err(as_double(take2), to_double(ref_take)), chk.tol.stats);
    if (c.norm) {
      // The norm's rstd is a function of h, which reaches phase 2 through
      // phase 1's rounded partial output: h's (output) tolerance.
      chk.check(what, "out rstd", rel_err(as_double(nr2), to_double(ref_mr)), chk.tol.output);
      if (!h2.empty()) {
        chk.check(what, "h", rel_err(as_double(h2), to_double(ref_h)), chk.tol.output);
        check_norm_contract(chk, what, h2, nr2, got, w_out, T, D);
      }
    }
  }
  // The fused prefix add (§12): block sum P0 and delta (the sources' strides
  // and offset), out of place and in place. The kernel's P' must be the
  // sum rounded once from the accumulation type (as torch.add), and the
  // read bit for bit the plain merge of that P'.
  // Pp: P' in the sources' layout (the plain run takes the same packs), Pc
  // contiguous (the kernel's P' output).
  std::vector<scalar_t> P0(src_len), delta(src_len), Pp(src_len), Pc(T * D);
  for (auto& x : P0) x = static_cast<scalar_t>(draw(N));
  for (auto& x : delta) x = static_cast<scalar_t>(draw(N + 1));
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < D; ++j) {
      const int64_t k = offset + t * stride + j;
      Pp[k] = static_cast<scalar_t>(static_cast<acc_t>(P0[k]) + static_cast<acc_t>(delta[k]));
      Pc[t * D + j] = Pp[k];
    }
  }
  for (const bool in_place : {false, true}) {
    if (in_place && c.norm && c.keep_h) continue;
    struct Run {
      std::vector<scalar_t> partial, out, h, sum;
      std::vector<acc_t> r, take, nr;
    };
    auto merge_run = [&](bool fused) {
      Run run{outs[reader], std::vector<scalar_t>(T * D, static_cast<scalar_t>(NAN)),
              std::vector<scalar_t>(c.norm && c.keep_h ? T * D : 0, static_cast<scalar_t>(NAN)),
              std::vector<scalar_t>(fused ? T * D : 0, static_cast<scalar_t>(NAN)),
              std::vector<acc_t>(T), std::vector<acc_t>(T), std::vector<acc_t>(T, static_cast<acc_t>(NAN))};
      scalar_t* out_p = in_place ? run.partial.data() : run.out.data();
      MergeParams<scalar_t> p = merge_params<scalar_t>(
          run.partial.data(), D, (fused ? P0 : Pp).data() + offset, stride,
          lse.data() + reader * T, u.data() + static_cast<size_t>(reader) * D, out_p, run.r.data(),
          run.take.data(), T, D, static_cast<acc_t>(c.eps));
      if (fused) {
        p.delta = delta.data() + offset;
        p.delta_stride = stride;
        p.sum_out = run.sum.data();
      }
      if (c.norm) {
        set_block_read_norm(p, w_out.data(), run.nr.data(), run.h.empty() ? nullptr : run.h.data(),
                            static_cast<acc_t>(kOutEps));
      }
      const int vec = block_read_vec(merge_rows_aligned(p, natural), D, natural);
      emulate_merge(p, c.norm, vec, grid);
      if (in_place) run.out = run.partial;
      return run;
    };
    const Run plain = merge_run(false), fused = merge_run(true);
    char what[240];
    std::snprintf(what, sizeof what, "%s merge%s + prefix add", buf, in_place ? " in place" : "");
    const bool ok = same_bits(fused.sum, Pc) && same_bits(fused.out, plain.out) &&
                    same_bits(fused.r, plain.r) && same_bits(fused.take, plain.take) &&
                    same_bits(fused.h, plain.h) && (!c.norm || same_bits(fused.nr, plain.nr));
    chk.check(what, "P' and the read bit for bit the plain merge of P'", ok ? 0.0 : INFINITY, 0);
  }
}

// Phase 2 at the dtype's maximum: y = P = +-max (alternating columns), u = 0
// (the block sum's score is exactly 0) and an lse for which keep + take
// rounds above 1, so that y keep + take P overflows in the accumulation
// type: h must come out as +-max (the wide, clamped sum of a rescued token).
template <typename scalar_t>
void run_merge_at_max(Checker& chk) {
  using acc_t = at::opmath_type<scalar_t>;
  const int D = 64;
  const int64_t T = 3;
  const acc_t mx = static_cast<acc_t>(std::numeric_limits<scalar_t>::max());
  acc_t lse_at = 0;
  bool found = false;
  for (int k = 0; k < 200000 && !found; ++k) {
    const acc_t lse = static_cast<acc_t>(-10.0 + 1e-4 * k);
    attnres::math::OnlineSoftmax<acc_t> st;
    st.init(lse);
    acc_t keep, take;
    st.push(acc_t(0), keep, take);
    const acc_t h = attnres::math::online_accumulate(mx, keep, take, mx);
    if (!(h <= mx)) {
      lse_at = lse;
      found = true;
    }
  }
  const std::string what = std::string(dtype_name<scalar_t>()) + " merge at max";
  if (!found) {
    chk.check(what, "an lse whose merge overflows (none found)", INFINITY, 0);
    return;
  }
  std::vector<scalar_t> y(T * D), P(T * D), out(T * D);
  std::vector<double> want(T * D);
  for (int64_t k = 0; k < T * D; ++k) {
    y[k] = P[k] = static_cast<scalar_t>(k % 2 == 0 ? mx : -mx);
    want[k] = static_cast<double>(y[k]);
  }
  std::vector<double> lse(T, static_cast<double>(lse_at));
  std::vector<acc_t> u(D, acc_t(0)), r(T), take(T);
  MergeParams<scalar_t> p = merge_params<scalar_t>(y.data(), D, P.data(), D, lse.data(), u.data(),
                                                   out.data(), r.data(), take.data(), T, D,
                                                   static_cast<acc_t>(1e-6));
  emu::launch(1, kBlockReadThreads, 0, [&] { block_read_merge_kernel<scalar_t, 1, false>(p); });
  chk.check(what, "h", rel_err(as_double(out), want), chk.tol.output);
}

// ---- phase 2's backward (block_read_merge_bwd_kernel) ----------------------------
// The row tensors of a backward case: T rows of D values, stride apart from
// an offset (one element: misaligned), rounded to scalar_t; random normal
// times `scale`, or uniform in +-magnitude for `big` ones.
template <typename scalar_t>
struct BackwardRows {
  int64_t stride;
  int offset;
  size_t len;
  double magnitude;
  std::mt19937_64& rng;
  BackwardRows(int64_t T, int D, int extra_stride, bool misaligned, double magnitude,
               std::mt19937_64& rng)
      : stride(D + extra_stride), offset(misaligned ? 1 : 0),
        len(offset + T * stride + natural_vec<scalar_t>()), magnitude(magnitude), rng(rng) {}
  std::vector<scalar_t> operator()(double scale, bool big) const {
    std::normal_distribution<double> normal;
    std::uniform_real_distribution<double> uniform(-1.0, 1.0);
    std::vector<scalar_t> v(len);
    for (auto& x : v) x = static_cast<scalar_t>(big ? uniform(rng) * magnitude : normal(rng) * scale);
    return v;
  }
  // Element j of row t, as the kernels read it (in the accumulation type).
  ld at(const std::vector<scalar_t>& v, int64_t t, int j) const {
    using acc_t = at::opmath_type<scalar_t>;
    return static_cast<ld>(static_cast<acc_t>(v[offset + t * stride + j]));
  }
};

struct BackwardCase {
  int D;
  int64_t T;
  int extra_stride = 0;     // grad_out, partial, block sum and h rows D + extra_stride apart
  bool misaligned = false;  // those rows start one element past an aligned address
  int64_t grid = 0;         // CTAs (0: one a warp's worth of tokens)
  bool norm = false;
  bool want_all = true;     // false: no dy, no z (dlse, dP and dw still wanted)
  double magnitude = 0;     // > 0: P and y uniform in +-magnitude (the rare path)
  bool want_dp_dlse = true; // false: no dP, no dlse
};

// Inputs are random; the forward's saved statistics (the block sum's rstd
// and weight, h and the output norm's rstd) are computed in long double and
// rounded as the forward stores them, and the reference backward starts
// from those rounded values: dy = (1 - a) dh, ds = a (1 - a) <dh, P - y>,
// dlse = -ds, dP = a dh + ds r u - ds r^2 s / D P, z = sum_t ds r P, and
// with the norm dh = r_o (g w - c h r_o), c = <g w, h r_o> / D, dw = sum_t g h r_o.
template <typename scalar_t>
void run_merge_backward(const BackwardCase& c, std::mt19937_64& rng, Checker& chk) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int natural = natural_vec<scalar_t>();
  const int D = c.D;
  const int64_t T = c.T;
  const BackwardRows<scalar_t> rows_of(T, D, c.extra_stride, c.misaligned, c.magnitude, rng);
  const int64_t stride = rows_of.stride;
  const int offset = rows_of.offset;
  const double eps = 1e-6;
  std::normal_distribution<double> normal;
  const bool big = c.magnitude > 0;
  std::vector<scalar_t> g = rows_of(1.0, false), y = rows_of(1.0, big), P = rows_of(1.5, big);
  std::vector<acc_t> u(D), w(D), lse(T);
  for (auto& x : u) x = static_cast<acc_t>(0.8 * normal(rng) / std::sqrt(double(D)));
  for (auto& x : w) x = static_cast<acc_t>(1 + 0.3 * normal(rng));
  for (auto& x : lse) x = static_cast<acc_t>(0.5 * normal(rng));
  auto at = [&](const std::vector<scalar_t>& v, int64_t t, int j) { return rows_of.at(v, t, j); };
  // The forward's statistics, rounded as stored.
  std::vector<acc_t> rstd(T), weight(T), out_rstd(T);
  std::vector<scalar_t> h(c.norm ? rows_of.len : 0);
  for (int64_t t = 0; t < T; ++t) {
    ld sq = 0, dot = 0;
    for (int j = 0; j < D; ++j) {
      sq += at(P, t, j) * at(P, t, j);
      dot += static_cast<ld>(u[j]) * at(P, t, j);
    }
    rstd[t] = static_cast<acc_t>(1 / std::sqrt(sq / D + static_cast<ld>(static_cast<acc_t>(eps))));
    const ld s = static_cast<ld>(rstd[t]) * dot, m = std::max<ld>(s, lse[t]);
    weight[t] = static_cast<acc_t>(std::exp(s - m) / (std::exp(s - m) + std::exp(lse[t] - m)));
    if (c.norm) {
      const ld a = weight[t];
      ld hsq = 0;
      for (int j = 0; j < D; ++j) {
        const scalar_t hj = static_cast<scalar_t>(static_cast<acc_t>((1 - a) * at(y, t, j) + a * at(P, t, j)));
        h[offset + t * stride + j] = hj;
        hsq += static_cast<ld>(hj) * static_cast<ld>(hj);
      }
      out_rstd[t] = static_cast<acc_t>(1 / std::sqrt(hsq / D + static_cast<ld>(static_cast<acc_t>(kOutEps))));
    }
  }
  // Reference.
  std::vector<ld> ref_dy(T * D), ref_dP(T * D), ref_dlse(T), ref_z(D, 0), ref_dw(D, 0);
  for (int64_t t = 0; t < T; ++t) {
    const ld a = weight[t], r = rstd[t], nr = out_rstd[t];
    std::vector<ld> dh(D);
    ld cn = 0;
    if (c.norm) {
      for (int j = 0; j < D; ++j) cn += at(g, t, j) * static_cast<ld>(w[j]) * at(h, t, j) * nr;
      cn /= D;
    }
    ld cdot = 0, udot = 0;
    for (int j = 0; j < D; ++j) {
      dh[j] = c.norm ? nr * (at(g, t, j) * static_cast<ld>(w[j]) - cn * at(h, t, j) * nr) : at(g, t, j);
      cdot += dh[j] * (at(P, t, j) - at(y, t, j));
      udot += static_cast<ld>(u[j]) * at(P, t, j);
      if (c.norm) ref_dw[j] += at(g, t, j) * at(h, t, j) * nr;
    }
    const ld s = r * udot, ds = a * (1 - a) * cdot, alpha = ds * r, beta = -alpha * r * s / D;
    ref_dlse[t] = -ds;
    for (int j = 0; j < D; ++j) {
      ref_dy[t * D + j] = (1 - a) * dh[j];
      ref_dP[t * D + j] = a * dh[j] + alpha * static_cast<ld>(u[j]) + beta * at(P, t, j);
      ref_z[j] += alpha * at(P, t, j);
    }
  }
  // The kernel, then the fixed-order sums of its partial rows.
  const int64_t grid = c.grid > 0 ? c.grid : merge_backward_grid(T, 0, 0, D, sizeof(acc_t));
  const int64_t rows = merge_backward_rows(grid);
  const acc_t nan = static_cast<acc_t>(NAN);
  std::vector<scalar_t> dy(c.want_all ? T * D : 0, static_cast<scalar_t>(NAN)),
      dP(c.want_dp_dlse ? T * D : 0, static_cast<scalar_t>(NAN));
  std::vector<double> dlse(c.want_dp_dlse ? T : 0, NAN);
  std::vector<acc_t> z_rows(c.want_all ? rows * D : 0, nan), dw_rows(c.norm ? rows * D : 0, nan);
  MergeBackwardParams<scalar_t> p{};
  p.grad_out = g.data() + offset;
  p.partial = y.data() + offset;
  p.block_sum = P.data() + offset;
  p.h = c.norm ? h.data() + offset : nullptr;
  p.grad_stride = p.partial_stride = p.block_stride = p.h_stride = stride;
  p.u = u.data();
  p.rstd = rstd.data();
  p.weight = weight.data();
  p.norm_weight = c.norm ? w.data() : nullptr;
  p.norm_rstd = c.norm ? out_rstd.data() : nullptr;
  p.grad_partial = dy.empty() ? nullptr : dy.data();
  p.grad_lse = dlse.empty() ? nullptr : dlse.data();
  p.grad_block = dP.empty() ? nullptr : dP.data();
  p.z_rows = z_rows.empty() ? nullptr : z_rows.data();
  p.dw_rows = dw_rows.empty() ? nullptr : dw_rows.data();
  p.T = T;
  p.D = D;
  const int vec = block_read_vec(merge_backward_rows_aligned(p, natural), D, natural);
  emulate_merge_backward(p, c.norm, vec, grid);
  auto row_sums = [&](const std::vector<acc_t>& partial) {
    std::vector<acc_t> out(D, nan);
    emu::launch(static_cast<unsigned>((D + kSumColumns - 1) / kSumColumns), kSumColumns * kSumSlices, 0,
                [&] { sum_partial_rows_kernel<acc_t>(partial.data(), rows, D, out.data()); });
    return out;
  };
  // The fused prefix add's backward (§12): P''s own gradient (rows of the
  // case's stride) added to dP, rounded once as autograd's sum of the two;
  // every other output bit for bit the plain run's.
  bool prefix_ok = true;
  if (c.want_dp_dlse) {
    const std::vector<scalar_t> gs = rows_of(1.0, false);
    std::vector<scalar_t> dy2(dy.size(), static_cast<scalar_t>(NAN)), dP2(dP.size(), static_cast<scalar_t>(NAN));
    std::vector<double> dlse2(dlse.size(), NAN);
    std::vector<acc_t> z2(z_rows.size(), nan), dw2(dw_rows.size(), nan);
    MergeBackwardParams<scalar_t> q = p;
    q.grad_partial = dy2.empty() ? nullptr : dy2.data();
    q.grad_lse = dlse2.data();
    q.grad_block = dP2.data();
    q.z_rows = z2.empty() ? nullptr : z2.data();
    q.dw_rows = dw2.empty() ? nullptr : dw2.data();
    q.grad_sum = gs.data() + offset;
    q.grad_sum_stride = stride;
    const int vec2 = block_read_vec(merge_backward_rows_aligned(q, natural), D, natural);
    emulate_merge_backward(q, c.norm, vec2, grid);
    std::vector<scalar_t> want(dP.size());
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < D; ++j) {
        want[t * D + j] = static_cast<scalar_t>(static_cast<acc_t>(dP[t * D + j]) +
                                                static_cast<acc_t>(gs[offset + t * stride + j]));
      }
    }
    prefix_ok = vec2 == vec && same_bits(dP2, want) && same_bits(dy2, dy) &&
                same_bits(dlse2, dlse) && same_bits(z2, z_rows) && same_bits(dw2, dw_rows);
  }
  char what[200];
  std::snprintf(what, sizeof what, "%s merge backward D=%d T=%ld grid=%ld vec=%d%s%s%s%s%s",
                dtype_name<scalar_t>(), D, long(T), long(grid), vec, c.norm ? " norm" : "",
                c.extra_stride ? " strided" : "", c.want_all ? "" : " (no dy, no z)",
                c.want_dp_dlse ? "" : " (no dP, no dlse)", big ? " range" : "");
  if (c.want_dp_dlse) {
    chk.check(what, "dP", rel_err(as_double(dP), to_double(ref_dP)), chk.tol.grad);
    chk.check(what, "dlse", rel_err(as_double(dlse), to_double(ref_dlse)), chk.tol.grad);
    if (c.magnitude > 1e38) {  // the case must have dlse beyond float32 (float64 output)
      ld most = 0;
      for (const ld d : ref_dlse) most = std::max(most, std::fabs(d));
      chk.check(what, "a dlse beyond float32 (none found)",
                most > std::numeric_limits<float>::max() ? 0.0 : INFINITY, 0);
    }
  }
  if (c.want_all) {
    chk.check(what, "dy", rel_err(as_double(dy), to_double(ref_dy)), chk.tol.grad);
    chk.check(what, "z", rel_err(as_double(row_sums(z_rows)), to_double(ref_z)), chk.tol.grad);
  }
  if (c.norm) {
    chk.check(what, "dw", rel_err(as_double(row_sums(dw_rows)), to_double(ref_dw)), chk.tol.grad);
  }
  chk.check(what, "prefix add: dP + dP' and the rest bit for bit", prefix_ok ? 0.0 : INFINITY, 0);
}

// ---- phase 1's backward (block_reads_bwd_kernel) --------------------------------
struct ReadsBackwardCase {
  int N, S, D;
  int64_t T;
  int extra_stride = 0;     // source and dy rows D + extra_stride apart
  bool misaligned = false;  // those rows start one element past an aligned address
  int64_t grid = 0;         // CTAs (0: reads_backward_grid's)
  bool norm = false;        // reader 0's fused output norm
  bool has_dy = true;       // false: no partial output has a gradient (lse only)
  bool with_dlse = true;
  bool all_wanted = true;   // false: odd sources' gradients and z not wanted
  double magnitude = 0;     // > 0: sources uniform in +-magnitude (the rare tokens)
  // N = 2, S = 3, D = 2, eps 0: rows c = 1e-12 and (1/2, -1/2), scores ~1,
  // dy = K = 6.6e26: each reader's beta of row 0 (-alpha r s / D, alpha r s
  // = K / (2 c) = 3.3e38) is ~-1.65e38, in float32, and their sum is not
  // (the rare check on the summed betas; possible only when S > D).
  bool summed_betas = false;
  // dlse times this (float64, as the op takes it): 1e40 on rows of 1e36 is
  // beyond float32 while the source gradients are not (the token's sum over
  // the weights overflows: the wide path, reading the float64 dlse).
  double dlse_scale = 1;
};

// The forward's statistics are computed in long double and rounded as
// stored; the reference backward starts from them: dh_s = dy_s (reader 0's
// r_o (g w - c h r_o) with the norm), dp = <dh_s, v_i>, ds = a (dp - sum_j
// a_j dp_j + dlse_s), alpha = ds r_i, beta = -alpha r_i s / D, dv_i = sum_s
// (a dh_s + alpha u_s + beta v_i), z_s = sum alpha v_i, dw = sum g h r_o.
template <typename scalar_t>
void run_reads_backward(const ReadsBackwardCase& c, std::mt19937_64& rng, Checker& chk) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int natural = natural_vec<scalar_t>();
  const int N = c.N, S = c.S, D = c.D;
  const int64_t T = c.T;
  const BackwardRows<scalar_t> rows_of(T, D, c.extra_stride, c.misaligned, c.magnitude, rng);
  const int64_t stride = rows_of.stride;
  const int offset = rows_of.offset;
  const double eps = c.summed_betas ? 0.0 : 1e-6;
  std::normal_distribution<double> normal;
  std::vector<std::vector<scalar_t>> src(N), dy(c.has_dy ? S : 0);
  for (int i = 0; i < N; ++i) src[i] = rows_of(1.0 + i % 3, c.magnitude > 0);
  for (auto& g : dy) g = rows_of(1.0, false);
  std::vector<acc_t> u(static_cast<size_t>(S) * D), w(D);
  std::vector<double> dlse(c.with_dlse ? S * T : 0);
  for (auto& x : u) x = static_cast<acc_t>(0.8 * normal(rng) / std::sqrt(double(D)));
  if (c.summed_betas) {
    if (N != 2 || S != 3 || D != 2 || !c.has_dy) {
      std::fprintf(stderr, "summed_betas needs N = 2, S = 3, D = 2 and dy\n");
      std::abort();
    }
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < D; ++j) {
        const int64_t k = rows_of.offset + t * rows_of.stride + j;
        src[0][k] = static_cast<scalar_t>(1e-12);
        src[1][k] = static_cast<scalar_t>(j ? -0.5 : 0.5);
        for (auto& g : dy) g[k] = static_cast<scalar_t>(6.6e26);
      }
    }
    // Three different readers, nearly equal weights.
    const acc_t q[3][2] = {{1, 0}, {1, acc_t(1e-3)}, {1, acc_t(-1e-3)}};
    for (int s = 0; s < 3; ++s) std::copy(q[s], q[s] + 2, u.begin() + 2 * s);
  }
  for (auto& x : w) x = static_cast<acc_t>(1 + 0.3 * normal(rng));
  for (auto& x : dlse) x = normal(rng) * c.dlse_scale;
  auto at = [&](const std::vector<scalar_t>& v, int64_t t, int j) { return rows_of.at(v, t, j); };
  // The forward's statistics, rounded as stored.
  std::vector<acc_t> rstd(N * T), weights(static_cast<size_t>(S) * N * T), out_rstd(T);
  std::vector<scalar_t> h(c.norm ? T * D : 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::vector<ld>> rows(N, std::vector<ld>(D));
    for (int i = 0; i < N; ++i) {
      for (int j = 0; j < D; ++j) rows[i][j] = at(src[i], t, j);
    }
    for (int s = 0; s < S; ++s) {
      const RefRead r = ref_read(rows, u.data() + static_cast<size_t>(s) * D, D, eps);
      for (int i = 0; i < N; ++i) {
        weights[(static_cast<int64_t>(s) * N + i) * T + t] = static_cast<acc_t>(r.weights[i]);
        if (s == 0) rstd[i * T + t] = static_cast<acc_t>(r.rstd[i]);
      }
      if (c.norm && s == 0) {
        ld hsq = 0;
        for (int j = 0; j < D; ++j) {
          h[t * D + j] = static_cast<scalar_t>(static_cast<acc_t>(r.h[j]));
          hsq += static_cast<ld>(h[t * D + j]) * static_cast<ld>(h[t * D + j]);
        }
        out_rstd[t] = static_cast<acc_t>(1 / std::sqrt(hsq / D + static_cast<ld>(static_cast<acc_t>(kOutEps))));
      }
    }
  }
  auto wanted = [&](int i) { return c.all_wanted || i % 2 == 0; };
  // Reference.
  std::vector<std::vector<ld>> ref_dv(N, std::vector<ld>(T * D, 0));
  std::vector<ld> ref_z(static_cast<size_t>(S) * D, 0), ref_dw(D, 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::vector<ld>> dh(S, std::vector<ld>(D, 0));
    if (c.has_dy) {
      for (int s = 0; s < S; ++s) {
        for (int j = 0; j < D; ++j) dh[s][j] = at(dy[s], t, j);
      }
      if (c.norm) {
        const ld nr = out_rstd[t];
        ld cn = 0;
        for (int j = 0; j < D; ++j) cn += dh[0][j] * static_cast<ld>(w[j]) * static_cast<ld>(h[t * D + j]) * nr;
        cn /= D;
        for (int j = 0; j < D; ++j) {
          const ld g = dh[0][j], n = static_cast<ld>(h[t * D + j]) * nr;
          ref_dw[j] += g * n;
          dh[0][j] = nr * (g * static_cast<ld>(w[j]) - cn * n);
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      std::vector<ld> dp(N, 0), su(N, 0);
      ld mean = 0;
      for (int i = 0; i < N; ++i) {
        ld dot = 0;
        for (int j = 0; j < D; ++j) {
          dp[i] += dh[s][j] * at(src[i], t, j);
          dot += static_cast<ld>(u[static_cast<size_t>(s) * D + j]) * at(src[i], t, j);
        }
        su[i] = static_cast<ld>(rstd[i * T + t]) * dot;
        mean += static_cast<ld>(weights[(static_cast<int64_t>(s) * N + i) * T + t]) * dp[i];
      }
      const ld dl = c.with_dlse ? static_cast<ld>(dlse[s * T + t]) : 0;
      for (int i = 0; i < N; ++i) {
        const ld a = weights[(static_cast<int64_t>(s) * N + i) * T + t], r = rstd[i * T + t];
        const ld ds = a * (dp[i] - mean + dl), alpha = ds * r, beta = -alpha * r * su[i] / D;
        for (int j = 0; j < D; ++j) {
          const ld vj = at(src[i], t, j);
          ref_dv[i][t * D + j] += a * dh[s][j] + alpha * static_cast<ld>(u[static_cast<size_t>(s) * D + j]) + beta * vj;
          ref_z[static_cast<size_t>(s) * D + j] += alpha * vj;
        }
      }
    }
  }
  // The kernel.
  const int64_t grid =
      c.grid > 0 ? c.grid : reads_backward_grid(T, 0, 0, c.all_wanted ? S : 1, D, sizeof(acc_t));
  const int64_t rows = merge_backward_rows(grid);
  const acc_t nan = static_cast<acc_t>(NAN);
  std::vector<std::vector<scalar_t>> dv(N);
  std::vector<SourceEntry> entries(N), dy_entries(dy.size());
  std::vector<const void*> grads(N, nullptr);
  for (int i = 0; i < N; ++i) {
    if (wanted(i)) dv[i].assign(T * D, static_cast<scalar_t>(NAN));
    grads[i] = dv[i].empty() ? nullptr : dv[i].data();
    entries[i] = {src[i].data() + offset, stride, dv[i].empty() ? nullptr : dv[i].data()};
  }
  for (size_t s = 0; s < dy.size(); ++s) dy_entries[s] = {dy[s].data() + offset, stride, nullptr};
  const SourceTableLayout layout = layout_sources(entries, T, natural, sizeof(scalar_t));
  const SourceTableLayout dy_layout = layout_sources(dy_entries, T, natural, sizeof(scalar_t));
  std::vector<acc_t> dot(static_cast<size_t>(rows) * S * N, nan), coef(dot.size(), nan),
      beta(rows * N, nan);
  std::vector<double> wide_dot(dot.size(), NAN), wide_coef(dot.size(), NAN), wide_beta(beta.size(), NAN);
  std::vector<acc_t> z_rows(c.all_wanted ? rows * S * D : 0, nan);
  const bool norm_active = c.norm && c.has_dy;
  std::vector<acc_t> dw_rows(norm_active ? rows * D : 0, nan);
  BlockReadsBackwardParams<scalar_t> p{};
  p.table = layout.table;
  p.overflow = layout.overflow.data();
  p.dy_table = dy_layout.table;
  p.dy_overflow = dy_layout.overflow.data();
  p.has_dy = c.has_dy;
  p.u = u.data();
  p.rstd = rstd.data();
  p.weights = weights.data();
  p.grad_lse = c.with_dlse ? dlse.data() : nullptr;
  p.dot_scratch = dot.data();
  p.coef_scratch = coef.data();
  p.beta = beta.data();
  p.wide_dot = wide_dot.data();
  p.wide_coef = wide_coef.data();
  p.wide_beta = wide_beta.data();
  p.z_rows = z_rows.empty() ? nullptr : z_rows.data();
  p.dw_rows = dw_rows.empty() ? nullptr : dw_rows.data();
  if (norm_active) {
    p.h = h.data();
    p.h_stride = D;
    p.norm_weight = w.data();
    p.norm_rstd = out_rstd.data();
  }
  p.T = T;
  p.N = N;
  p.S = S;
  p.D = D;
  const bool aligned =
      reads_backward_rows_aligned(p, layout, c.has_dy ? &dy_layout : nullptr, grads, natural);
  const int vec = block_read_vec(aligned, D, natural);
  emu::launch(static_cast<unsigned>(grid), kBlockReadThreads, 0, [&] {
    vec == natural ? block_reads_bwd_kernel<scalar_t, natural>(p)
                   : block_reads_bwd_kernel<scalar_t, 1>(p);
  });
  auto row_sums = [&](const std::vector<acc_t>& partial, int width) {
    std::vector<acc_t> out(width, nan);
    emu::launch(static_cast<unsigned>((width + kSumColumns - 1) / kSumColumns),
                kSumColumns * kSumSlices, 0,
                [&] { sum_partial_rows_kernel<acc_t>(partial.data(), rows, width, out.data()); });
    return out;
  };
  char what[240];
  std::snprintf(what, sizeof what, "%s reads backward N=%d S=%d D=%d T=%ld grid=%ld vec=%d%s%s%s%s%s%s",
                dtype_name<scalar_t>(), N, S, D, long(T), long(grid), vec, c.norm ? " norm" : "",
                c.has_dy ? "" : " (no dy)", c.with_dlse ? "" : " (no dlse)",
                c.all_wanted ? "" : " (some dv, no z)", c.magnitude > 0 ? " range" : "",
                layout.overflow.empty() ? "" : " overflow");
  if (c.summed_betas) std::strncat(what, " summed betas", sizeof what - std::strlen(what) - 1);
  if (c.dlse_scale != 1) std::strncat(what, " dlse 1e40", sizeof what - std::strlen(what) - 1);
  std::vector<double> got_dv, want_dv;
  for (int i = 0; i < N; ++i) {
    if (!wanted(i)) continue;
    const auto d = as_double(dv[i]);
    got_dv.insert(got_dv.end(), d.begin(), d.end());
    const auto r = to_double(ref_dv[i]);
    want_dv.insert(want_dv.end(), r.begin(), r.end());
  }
  chk.check(what, "dv", rel_err(got_dv, want_dv), chk.tol.grad);
  if (c.all_wanted) {
    chk.check(what, "z", rel_err(as_double(row_sums(z_rows, S * D)), to_double(ref_z)), chk.tol.grad);
  }
  if (norm_active) {
    chk.check(what, "dw", rel_err(as_double(row_sums(dw_rows, D)), to_double(ref_dw)), chk.tol.grad);
  }
}

template <typename scalar_t>
int run_dtype(std::mt19937_64& rng) {
  Checker chk{read_tolerance(dtype_name<scalar_t>())};
  std::vector<Case> cases = {
      {1, 1, 64, 5},                                   // one source, one reader
      {3, 4, 1000, 7},                                 // D = 1000, 4 readers (one sweep)
      {5, 6, 72, 9, 8},                                // two reader sweeps; strided rows
      {4, 3, 70, 6, 0, true},                          // misaligned: one element a lane
      {2, 2, 33, 11, 0, false, 1},                     // one CTA: the grid-stride loop
      {3, 5, 96, 5, 0, false, 0, true, true},          // norm, h kept
      {3, 2, 80, 5, 4, false, 0, true, false},         // norm, h not kept; strided
      {2, 18, 40, 3},                                  // two phase-1 launches (> 16 readers)
      {3, 18, 48, 3, 0, false, 0, true, true},         // the same, reader 0 normed
      {67, 2, 24, 3},                                  // 67 sources: the table's overflow
  };
  if constexpr (!std::is_same_v<scalar_t, c10::Half>) {
    // Rows whose sum of squares overflows the accumulation type (the range
    // rescue, §8); fp16's range cannot reach it.
    const double big = std::is_same_v<scalar_t, double> ? 1e300 : 1e36;
    cases.push_back({3, 3, 64, 4, 0, false, 0, false, true, big});
    cases.push_back({3, 3, 64, 4, 0, false, 0, true, true, big});
    const double max = static_cast<double>(std::numeric_limits<scalar_t>::max());
    cases.push_back({18, 2, 64, 3, 0, false, 0, false, true, max, 1e-6, true});
  }
  for (const Case& c : cases) run_case<scalar_t>(c, rng, chk);
  std::vector<BackwardCase> backward_cases = {
      {64, 5},                               // 8 warps for 5 tokens: empty warps' rows are zero
      {1000, 7},                             // D = 1000
      {72, 9, 8},                            // strided rows
      {70, 6, 0, true},                      // misaligned: one element a lane
      {33, 11, 0, false, 1},                 // one CTA: a warp sums several tokens
      {96, 5, 0, false, 0, true},            // the fused norm
      {80, 9, 4, true, 1, true},             // the norm, strided, misaligned, one CTA
      {48, 6, 0, false, 0, false, false},    // dy and z not wanted
      {40, 5, 0, false, 0, true, false},     // the norm without dy and z
      {56, 7, 0, false, 0, true, true, 0, false},  // the norm without dP and dlse
  };
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    // Rows near the accumulation type's limits: the rare (WideType) tokens,
    // also several a warp (one CTA), whose wide sums add to rows the warp
    // started. Not fp16 (its range cannot reach them) and not fp64, which
    // has no wider type on the device (docs/design.md §8).
    for (const bool norm : {false, true}) {
      backward_cases.push_back({64, 4, 0, false, 0, norm, true, 1e36});
      backward_cases.push_back({64, 9, 0, false, 1, norm, true, 1e36});
    }
    // Rows near float32's maximum: <dh, P - y> and the lse gradient (float64,
    // a few 1e38 to 1e39) beyond float32 in some tokens (checked); z, beyond
    // it too, not wanted.
    backward_cases.push_back({64, 16, 0, false, 0, false, false, 3e38});
  }
  for (const BackwardCase& c : backward_cases) run_merge_backward<scalar_t>(c, rng, chk);
  std::vector<ReadsBackwardCase> reads_cases = {
      {3, 4, 64, 5},                                      // 8 warps, 5 tokens: empty warps
      {5, 6, 1000, 7},                                    // D = 1000, two reader sweeps
      {4, 3, 72, 9, 8},                                   // strided rows
      {4, 3, 70, 6, 0, true},                             // misaligned: one element a lane
      {3, 2, 33, 11, 0, false, 1},                        // one CTA: several tokens a warp
      {3, 5, 96, 5, 0, false, 0, true},                   // reader 0 normed
      {4, 3, 80, 9, 4, true, 1, true},                    // normed, strided, misaligned, one CTA
      {67, 2, 24, 3},                                     // 67 sources: the table's overflow
      {2, 18, 40, 3},                                     // 18 readers
      {3, 3, 48, 4, 0, false, 0, false, false},           // no dy: the lse gradient only
      {3, 3, 48, 4, 0, false, 0, true, true, false},      // no dlse
      {5, 2, 56, 6, 0, false, 0, true, true, true, false},  // odd sources' dv and z not wanted
  };
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    // Rows near the accumulation type's limits (not fp16, whose range
    // cannot reach them; not fp64, no wider type on the device): the rare
    // tokens are those whose every term is ~1/magnitude, i.e. one normed
    // reader, or the lse gradient alone; also several a warp (one CTA).
    for (const bool norm : {false, true}) {
      reads_cases.push_back({3, 3, 64, 4, 0, false, 0, norm, true, true, true, 1e36});
    }
    reads_cases.push_back({3, 1, 64, 4, 0, false, 0, true, true, true, true, 1e36});
    reads_cases.push_back({3, 1, 64, 9, 0, false, 1, true, true, true, true, 1e36});
    reads_cases.push_back({3, 3, 64, 9, 0, false, 1, false, false, true, true, 1e36});
    // Betas that overflow only when the readers' are summed; also one CTA.
    reads_cases.push_back({2, 3, 2, 5, 0, false, 0, false, true, true, true, 0, true});
    reads_cases.push_back({2, 3, 2, 9, 0, false, 1, false, true, true, true, 0, true});
    // An lse gradient beyond float32 (z, ~1e40, not wanted); also one CTA.
    reads_cases.push_back({3, 3, 64, 4, 0, false, 0, false, true, true, false, 1e36, false, 1e40});
    reads_cases.push_back({3, 3, 64, 9, 0, false, 1, false, true, true, false, 1e36, false, 1e40});
  }
  for (const ReadsBackwardCase& c : reads_cases) run_reads_backward<scalar_t>(c, rng, chk);
  if constexpr (!std::is_same_v<scalar_t, c10::Half>) run_merge_at_max<scalar_t>(chk);
  return chk.failures;
}

// merge_backward_grid: the partial rows stay within kPartialRowBytes, never
// below one CTA an SM, and short inputs keep block_read_grid's grid.
int check_merge_backward_grid() {
  struct Rule {
    int64_t T, resident, sms, D, acc;
    int64_t want;
  };
  const Rule rules[] = {
      {int64_t{1} << 20, 8448, 132, 1024, 4, (int64_t{32} << 20) / (4 * 1024 * 4)},  // 2048
      {int64_t{1} << 20, 8448, 132, 16384, 8, 132},  // the cap (64) is below one CTA an SM
      {4000, 8448, 132, 1024, 4, 1000},              // a warp a token
      {5, 0, 0, 64, 8, 2},                           // the emulation's grids
  };
  int failures = 0;
  for (const Rule& r : rules) {
    const int64_t got = merge_backward_grid(r.T, r.resident, r.sms, r.D, r.acc);
    const bool ok = got == r.want;
    failures += ok ? 0 : 1;
    std::printf("%s merge_backward_grid(T=%ld, D=%ld, acc=%ld) = %ld (want %ld)\n",
                ok ? "ok  " : "FAIL", long(r.T), long(r.D), long(r.acc), long(got), long(r.want));
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  std::mt19937_64 rng(2026);
  int failures = check_merge_backward_grid();
  if (only.empty() || only == "float64") failures += run_dtype<double>(rng);
  if (only.empty() || only == "float32") failures += run_dtype<float>(rng);
  if (only.empty() || only == "bfloat16") failures += run_dtype<c10::BFloat16>(rng);
  if (only.empty() || only == "float16") failures += run_dtype<c10::Half>(rng);
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
