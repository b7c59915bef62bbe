// Runs the CUDA kernels of csrc/cuda/kernels.cuh on the CPU (see
// cuda_runtime.h here) with the parameter blocks and launch shapes built by
// csrc/cuda/kernel_params.h (the CUDA host code's own set-up), and checks
// every output against a float64 evaluation of the per-token formulas. It
// exercises what the CPU kernels cannot: the thread/lane -> element map,
// masking, group reductions, tokens per CTA, the grid-stride token loop,
// backward staging in shared memory, the forward's cp.async ring (bit for
// bit against its register pipeline), the backward's (bit for bit against
// the backward of the same tile and grid without it), the source table overflow and the
// per-CTA query-gradient partials and their fixed-order sum, and the
// few-token kernels (a token's row split across CTAs). Built and run by
// tests/python/test_cuda_emulation.py. Exit status 0 when every case passes.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <tuple>
#include <utility>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "emulation_common.h"
#include "kernel_params.h"
#include "few_tokens.cuh"
#include "kernels.cuh"

using namespace attnres::cuda;
using namespace emulation;

namespace {

const char* group_class_name(int cls) {
  return cls == kAnyGroup ? "any" : cls == kWarpsGroup ? "warps" : "32";
}

struct Case {
  int N;
  int64_t T;
  int D;
  int extra_stride;  // row stride = D + extra_stride
  bool misaligned;   // sources start one element past an aligned address
  int64_t grid_cap;  // fewer CTAs than token blocks: exercises the token loop
  bool weight_grads = false;  // a gradient reaches the weights too
  bool partial = false;       // source 0's and the query/gain gradients not wanted
  // Range cases (docs/design.md §8): sources uniform in [-1, 1] times
  // magnitude[i % size] (empty: the default normal values), eps, and a NaN
  // query element (every output must then be NaN, as softmax gives).
  std::vector<double> magnitude = {};
  double eps = 1e-6;
  bool nan_query = false;
  double dh_scale = 1.0;  // small dh keeps the query gradient representable
  // Every source row the same: +magnitude[0] in even columns, -magnitude[0]
  // in odd ones (equal scores, weights 1/N that sum to 1 only up to
  // rounding: at the dtype's maximum h must stay finite, docs/design.md §8).
  bool at_magnitude = false;
  // The backward reads h (single pass) from a copy one element past an
  // aligned address: the 16-byte path must then be refused.
  bool misaligned_h = false;
  // h with rows D + h_extra_stride apart (padding NaN: a kernel that used D
  // instead of the row stride would read it).
  int h_extra_stride = 0;
  // The fused output norm (depth_attention with out_weight): out gets
  // RMSNorm(h) * w, the backward starts from dy. keep_h: the forward writes
  // h too (else it is written by a second forward, for the backward, after
  // checking that the first wrote none); want_dw: the norm weight's gradient
  // is wanted.
  bool norm = false;
  bool keep_h = true;
  bool want_dw = true;
  double out_eps = 1e-5;
  // The device's opt-in shared memory per block (H100/H200); 99 KiB
  // (sm_86/sm_89) sends the norm's accumulators of wide rows to global
  // memory.
  int64_t smem_optin = 227 * 1024;
  // Whether the backward's results are checked (they are always computed):
  // not for fp64 rows whose normed gradients leave fp64's range in alpha or
  // beta (float64 has no wider type on the device, docs/design.md §8).
  bool check_backward = true;
  // Whether the backward runs at all (the forward ring sweep skips it: the
  // ring is the forward's).
  bool run_backward = true;
  // Source t % N of token t along the query (u plus 1% noise, a random
  // scale per token): its weight saturates, 1 - a ~ exp(-|u| sqrt(D)). The
  // backward must then take the pivoted form from the rows
  // (math::Pivot::saturated), not <dh, h> from the rounded h: the query
  // gradient is a small difference. The pivot moves across the batches of
  // rows. 1: every token (the accuracy check: a plain token's larger
  // gradients would hide a saturated one's error in the norms); 2: every
  // third token plain, so saturated and plain tokens share warps and CTAs.
  int saturate = 0;
  // The kernels of the tile's group class (launch.h) are run again as their
  // kAnyGroup instantiation (G at run time: the kernels before the classes)
  // and every output must have the same bits.
  bool check_any_group_bits = false;
  // The fused prefix add (docs/design.md §12): the forward runs again with
  // the last source's entry holding P (3/4 of the drawn rows) and delta
  // (a quarter of them times uniform [-1, 1], laid out as the sources), and
  // must give the first run's bits (over P' = P + delta rounded as
  // torch.add, which every other check uses) and write P' bit for bit.
  bool prefix = false;
  // The few-token forward (docs/design.md §7) in place of the tiled one: -1
  // as plan_few_tokens plans it for kFewTokensSms SMs (which it must take),
  // k > 0 at most k slices (few_tokens_shape: widths the plan leaves to the
  // tiled forward). Its h must also be sum_i a_i v_i from the written weights
  // bit for bit (every CTA derived CTA 0's weights), and y (h r) w from the
  // written r.
  int few_tokens = 0;
};

constexpr int64_t kFewTokensSms = 132;

// Cases whose forward took the cp.async ring (each also compared bit for
// bit with the register pipeline), and whose backward took its ring (each
// also compared bit for bit with the backward without it: the same tile
// and grid, staged for the two-pass backward, from global memory for the
// single-pass one).
int ring_cases = 0;
int backward_ring_cases = 0;



// rel_err over the entries whose true value is representable (|want| <=
// limit): a true gradient beyond the dtype's maximum is legitimately inf.
double rel_err_representable(const std::vector<double>& got, const std::vector<double>& want,
                             double limit) {
  std::vector<double> g, w;
  for (size_t k = 0; k < want.size(); ++k) {
    if (std::fabs(want[k]) <= limit) {
      g.push_back(got[k]);
      w.push_back(want[k]);
    }
  }
  return rel_err(g, w);
}

template <typename scalar_t>
bool run_case(const Case& c, std::mt19937_64& rng) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int natural = natural_vec<scalar_t>();
  const int N = c.N, D = c.D;
  const int64_t T = c.T;
  const int64_t stride = D + c.extra_stride;
  const int offset = c.misaligned ? 1 : 0;
  const double eps = c.eps, scale = 0.8;
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);

  // Inputs, rounded to scalar_t; the reference uses the rounded values.
  std::vector<std::vector<scalar_t>> src(N, std::vector<scalar_t>(offset + T * stride + natural));
  for (int i = 0; i < N; ++i) {
    for (auto& x : src[i]) {
      x = c.magnitude.empty()
              ? static_cast<scalar_t>(normal(rng) * (1 + i % 3))
              : static_cast<scalar_t>(uniform(rng) * c.magnitude[i % c.magnitude.size()]);
    }
    if (c.at_magnitude) {
      for (int64_t k = 0; k < static_cast<int64_t>(src[i].size()); ++k) {
        const int64_t col = (k - offset) % stride;
        src[i][k] = static_cast<scalar_t>(col % 2 == 0 ? c.magnitude[0] : -c.magnitude[0]);
      }
    }
  }
  std::vector<acc_t> u(D);
  for (int d = 0; d < D; ++d) {
    const double q = normal(rng) / std::sqrt(double(D));
    const double g = 1 + 0.3 * normal(rng);
    u[d] = static_cast<acc_t>(scale * q * g);
  }
  if (c.nan_query) u[D / 2] = static_cast<acc_t>(NAN);
  if (c.saturate) {
    for (int64_t t = 0; t < T; ++t) {
      if (c.saturate == 2 && t % 3 == 2) continue;
      const double k = 1 + std::fabs(normal(rng));
      for (int d = 0; d < D; ++d) {
        src[t % N][offset + t * stride + d] =
            static_cast<scalar_t>(k * (double(u[d]) + 0.01 * normal(rng) / std::sqrt(double(D))));
      }
    }
  }
  // The prefix add's P and delta: P' (the last source as drawn above, which
  // every check reads) becomes round(P + delta), within the drawn range.
  std::vector<scalar_t> P0, delta;
  if (c.prefix) {
    std::vector<scalar_t>& last = src[N - 1];
    P0.resize(last.size());
    delta.resize(last.size());
    for (size_t k = 0; k < last.size(); ++k) {
      P0[k] = static_cast<scalar_t>(0.75 * double(last[k]));
      delta[k] = static_cast<scalar_t>(0.25 * double(last[k]) * uniform(rng));
      last[k] = static_cast<scalar_t>(static_cast<acc_t>(P0[k]) + static_cast<acc_t>(delta[k]));
    }
  }
  std::vector<scalar_t> dh(T * D);
  for (auto& x : dh) x = static_cast<scalar_t>(normal(rng) * c.dh_scale);

  std::vector<acc_t> grad_w(c.weight_grads ? N * T : 0);
  for (auto& x : grad_w) x = static_cast<acc_t>(normal(rng));

  // Gradient buffers start as NaN: a gradient not wanted must stay unwritten.
  std::vector<std::vector<scalar_t>> grads(N, std::vector<scalar_t>(T * D, static_cast<scalar_t>(NAN)));
  std::vector<SourceEntry> entries(N);
  for (int i = 0; i < N; ++i) {
    const bool wanted = !(c.partial && i == 0);
    entries[i] = {src[i].data() + offset, stride, wanted ? grads[i].data() : nullptr};
  }
  // The host set-up of csrc/cuda/depth_attention_cuda.cu; overflow entries
  // stay in host memory, which the emulated kernels read directly.
  const SourceTableLayout layout = layout_sources(entries, T, natural, sizeof(scalar_t));

  // The output norm's weight (accumulation dtype, as the op passes it).
  std::vector<acc_t> w_out(c.norm ? D : 0);
  for (auto& x : w_out) x = static_cast<acc_t>(1 + 0.3 * normal(rng));

  // Forward. With the norm, out is y and h goes to h_kept (NaN until
  // written).
  std::vector<scalar_t> out(T * D);
  std::vector<acc_t> rstd(N * T), weights(N * T);
  std::vector<scalar_t> h_kept(c.norm ? T * D : 0, static_cast<scalar_t>(NAN));
  std::vector<acc_t> out_rstd(c.norm ? T : 0, static_cast<acc_t>(NAN));
  // The forward's plan (the cp.async ring where the shape takes it, for the
  // case's opt-in shared memory) and, for comparison, the register
  // pipeline's (no shared memory to spare: plan_forward picks no ring).
  // The few-token path (Case::few_tokens) has no ring: fplan stays empty.
  const bool few = c.few_tokens != 0;
  auto few_plan_for = [&](const SourceTableLayout& l) {
    const int vec = l.vector_aligned && D % natural == 0 ? natural : 1;
    return c.few_tokens < 0 ? plan_few_tokens(T, N, D, l.vector_aligned, natural, kFewTokensSms)
                            : few_tokens_shape(D, vec, c.few_tokens);
  };
  const FewTokensPlan few_plan = few ? few_plan_for(layout) : FewTokensPlan{};
  const ForwardPlan fplan = few ? ForwardPlan{} : forward_plan<scalar_t>(layout, N, D, c.smem_optin);
  const ForwardPlan reg_plan = forward_plan<scalar_t>(layout, N, D, 0);
  auto forward_launch_for = [&](const ForwardPlan& plan, const FewTokensPlan& fp,
                                const SourceTableLayout& l, const SourceEntry* overflow,
                                scalar_t* out_, acc_t* rstd_, acc_t* weights_,
                                std::vector<acc_t>& scratch) {
    auto launch = forward_launch<scalar_t>(plan, l, overflow, u.data(), out_, rstd_, weights_, T,
                                           N, D, static_cast<acc_t>(eps), c.grid_cap);
    if (few) {
      scratch.assign(few_tokens_scratch_elems(fp, T, N, c.norm), static_cast<acc_t>(NAN));
      set_few_tokens<scalar_t>(launch, fp, scratch.data());
    }
    return launch;
  };
  std::vector<acc_t> few_scratch;
  auto fwd = forward_launch_for(fplan, few_plan, layout, layout.overflow.data(), out.data(),
                                rstd.data(), weights.data(), few_scratch);
  if (c.norm) {
    set_forward_norm<scalar_t>(fwd.params, w_out.data(), out_rstd.data(),
                               c.keep_h ? h_kept.data() : nullptr, static_cast<acc_t>(c.out_eps));
  }
  const TileConfig& ftile = fwd.config.tile;
  const auto fgrid = static_cast<unsigned>(fwd.config.grid);
  // The kernels of the tile's group class (with_tile, as the CUDA launchers
  // pick them) with the launch's ring or register pipeline, or (as_any) the
  // same through the kAnyGroup instantiation.
  auto run_forward_with = [&](const KernelLaunch<ForwardParams<scalar_t>>& launch,
                              bool as_any) {
    const TileConfig& tile = launch.config.tile;
    if (launch.params.few_splits > 0) {  // launch_few_tokens' kernels
      const auto grid = static_cast<unsigned>(launch.config.grid);
      auto kernels = [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        emu::launch(grid, tile.group, 0,
                    [&] { few_tokens_partials_kernel<scalar_t, VEC>(launch.params); });
        emu::launch(grid, tile.group, launch.config.smem_bytes,
                    [&] { few_tokens_finish_kernel<scalar_t, VEC>(launch.params); });
        if (launch.params.norm_weight == nullptr) return;
        emu::launch(grid, tile.group, 0,
                    [&] { few_tokens_norm_kernel<scalar_t, VEC>(launch.params); });
      };
      if (tile.vec == 1) {
        kernels(std::integral_constant<int, 1>{});
      } else {
        kernels(std::integral_constant<int, natural>{});
      }
      return;
    }
    with_tile<scalar_t, kMaxElemsPerThread>(tile, [&](auto vec, auto vpt, auto group) {
      constexpr int VEC = decltype(vec)::value, VPT = decltype(vpt)::value;
      constexpr int kClass = decltype(group)::value;
      const bool ring = launch.params.ring_stages > 0;
      if constexpr (!ring_tile_compiled(VEC, VPT, natural_vec<scalar_t>())) {
        if (ring) throw std::runtime_error("plan_forward chose a ring for a tile without one");
      }
      auto run = [&](auto cls) {
        constexpr int kGroup = decltype(cls)::value;
        emu::launch(static_cast<unsigned>(launch.config.grid), tile.group * tile.tokens_per_cta,
                    launch.config.smem_bytes, [&] {
                      if constexpr (ring_tile_compiled(VEC, VPT, natural_vec<scalar_t>())) {
                        if (ring) {
                          if (c.norm) {
                            depth_attention_fwd_kernel<scalar_t, VEC, VPT, true, kGroup, true>(
                                launch.params);
                          } else {
                            depth_attention_fwd_kernel<scalar_t, VEC, VPT, false, kGroup, true>(
                                launch.params);
                          }
                          return;
                        }
                      }
                      if (c.norm) {
                        depth_attention_fwd_kernel<scalar_t, VEC, VPT, true, kGroup>(
                            launch.params);
                      } else {
                        depth_attention_fwd_kernel<scalar_t, VEC, VPT, false, kGroup>(
                            launch.params);
                      }
                    });
      };
      if (as_any) {
        run(std::integral_constant<int, kAnyGroup>{});
      } else {
        run(std::integral_constant<int, kClass>{});
      }
    });
  };
  auto run_forward = [&](bool as_any = false) { run_forward_with(fwd, as_any); };
  run_forward();
  // The ring must give the register pipeline's bits: run that into fresh
  // buffers (set up like the first run's) and compare every output.
  bool ring_same_bits = true;
  if (fplan.ring_stages > 0) {
    ++ring_cases;
    std::vector<scalar_t> out2(T * D);
    std::vector<acc_t> rstd2(N * T), weights2(N * T);
    std::vector<scalar_t> h2(c.norm ? T * D : 0, static_cast<scalar_t>(NAN));
    std::vector<acc_t> out_rstd2(c.norm ? T : 0, static_cast<acc_t>(NAN));
    auto reg = forward_launch<scalar_t>(reg_plan, layout, layout.overflow.data(), u.data(),
                                        out2.data(), rstd2.data(), weights2.data(), T, N, D,
                                        static_cast<acc_t>(eps), c.grid_cap);
    if (c.norm) {
      set_forward_norm<scalar_t>(reg.params, w_out.data(), out_rstd2.data(),
                                 c.keep_h ? h2.data() : nullptr, static_cast<acc_t>(c.out_eps));
    }
    run_forward_with(reg, false);
    ring_same_bits = reg.params.ring_stages == 0 && same_bits(out, out2) &&
                     same_bits(rstd, rstd2) && same_bits(weights, weights2) &&
                     same_bits(h_kept, h2) && same_bits(out_rstd, out_rstd2);
  }
  // The prefix add: the same launch shape with P in the last entry, delta
  // and a P' buffer (NaN until written), into fresh buffers; its layout
  // (align_forward_prefix, as the host makes it) must plan the same tile.
  bool prefix_same_bits = true;
  if (c.prefix) {
    std::vector<scalar_t> sum(T * D, static_cast<scalar_t>(NAN));
    SourceTableLayout with_delta = layout;
    align_forward_prefix<scalar_t>(with_delta, delta.data() + offset, stride, sum.data(), T, D);
    const ForwardPlan pplan =
        few ? ForwardPlan{} : forward_plan<scalar_t>(with_delta, N, D, c.smem_optin);
    const FewTokensPlan pfew = few ? few_plan_for(with_delta) : FewTokensPlan{};
    std::vector<scalar_t> out3(T * D, static_cast<scalar_t>(NAN));
    std::vector<acc_t> rstd3(N * T, static_cast<acc_t>(NAN));
    std::vector<acc_t> weights3(N * T, static_cast<acc_t>(NAN));
    std::vector<scalar_t> h3(c.norm ? T * D : 0, static_cast<scalar_t>(NAN));
    std::vector<acc_t> out_rstd3(c.norm ? T : 0, static_cast<acc_t>(NAN));
    std::vector<SourceEntry> overflow = layout.overflow;
    std::vector<acc_t> scratch3;
    auto pre = forward_launch_for(pplan, pfew, with_delta, overflow.data(), out3.data(),
                                  rstd3.data(), weights3.data(), scratch3);
    SourceEntry& last = N - 1 < kTableCapacity ? pre.params.table.first[N - 1]
                                               : overflow[N - 1 - kTableCapacity];
    last.src = P0.data() + offset;
    if (c.norm) {
      set_forward_norm<scalar_t>(pre.params, w_out.data(), out_rstd3.data(),
                                 c.keep_h ? h3.data() : nullptr, static_cast<acc_t>(c.out_eps));
    }
    set_forward_prefix<scalar_t>(pre.params, delta.data() + offset, stride, sum.data());
    run_forward_with(pre, false);
    std::vector<scalar_t> want_sum(T * D);
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(src[N - 1].begin() + offset + t * stride, D, want_sum.begin() + t * D);
    }
    prefix_same_bits = pplan.tile.vec == fplan.tile.vec && pplan.tile.vpt == fplan.tile.vpt &&
                       pplan.tile.group == fplan.tile.group && pfew.splits == few_plan.splits &&
                       pfew.vec == few_plan.vec &&
                       pplan.ring_stages == fplan.ring_stages && same_bits(sum, want_sum) &&
                       same_bits(out3, out) && same_bits(rstd3, rstd) &&
                       same_bits(weights3, weights) && same_bits(out_rstd3, out_rstd) &&
                       (!c.keep_h || same_bits(h3, h_kept));
  }
  bool h_written_unkept = false;
  if (c.norm && !c.keep_h) {
    for (const auto& x : h_kept) h_written_unkept = h_written_unkept || !std::isnan(double(x));
    fwd.params.norm_h = h_kept.data();  // the backward's h
    run_forward();
  }
  const int fclass = group_class(ftile.vec, ftile.group);

  // Backward, from the forward's h (single pass: float32/float64; the
  // norm: every dtype) and statistics.
  const std::vector<scalar_t>& h_saved = c.norm ? h_kept : out;
  const int64_t h_stride = D + c.h_extra_stride;
  std::vector<scalar_t> h_copy;
  const scalar_t* h = h_saved.data();
  if (c.misaligned_h || c.h_extra_stride != 0) {
    const int64_t first = c.misaligned_h ? 1 : 0;
    h_copy.assign(first + T * h_stride, static_cast<scalar_t>(NAN));
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(h_saved.begin() + t * D, D, h_copy.begin() + first + t * h_stride);
    }
    h = h_copy.data() + first;
  }
  const bool want_dw = c.norm && c.want_dw;
  const BackwardPlan plan = backward_plan<scalar_t>(layout, dh.data(), D, h, h_stride, T, N, D,
                                                    c.smem_optin, c.norm, want_dw);
  auto bwd = backward_launch<scalar_t>(plan, layout, layout.overflow.data(), u.data(), dh.data(),
                                       D, h, h_stride, rstd.data(), weights.data(),
                                       c.weight_grads ? grad_w.data() : nullptr, T, N, D, c.grid_cap,
                                       c.norm);
  const TileConfig& btile = bwd.config.tile;
  const int64_t bgrid = bwd.config.grid;
  std::vector<acc_t> partial(bgrid * D, static_cast<acc_t>(NAN));
  bwd.params.z_partial = c.partial ? nullptr : partial.data();
  std::vector<acc_t> dw_partial(want_dw ? bgrid * D : 0, static_cast<acc_t>(NAN));
  std::vector<acc_t> dw_slots(
      want_dw && plan.norm_slots_offset < 0 ? bgrid * plan.norm_slots_per_cta : 0,
      static_cast<acc_t>(NAN));
  if (c.norm) {
    set_backward_norm<scalar_t>(bwd.params, w_out.data(), out_rstd.data(),
                                want_dw ? dw_partial.data() : nullptr,
                                dw_slots.empty() ? nullptr : dw_slots.data());
  }
  auto run_backward = [&](bool as_any = false) {
    with_tile<scalar_t, kBackwardPreferredElems>(btile, [&](auto vec, auto vpt, auto group) {
      constexpr int VEC = decltype(vec)::value, VPT = decltype(vpt)::value;
      constexpr int kGroup = decltype(group)::value;
      if (!c.run_backward) return;
      const bool ring = bwd.params.ring_stages > 0;
      if constexpr (!backward_ring_tile_compiled(VEC, VPT, natural_vec<scalar_t>())) {
        if (ring) throw std::runtime_error("plan_backward chose a ring for a tile without one");
      }
      emu::launch(static_cast<unsigned>(bgrid), btile.group * btile.tokens_per_cta,
                  bwd.config.smem_bytes, [&] {
                    if constexpr (backward_ring_tile_compiled(VEC, VPT,
                                                              natural_vec<scalar_t>())) {
                      if (ring) {
                        auto run_ring = [&](auto cls) {
                          constexpr int kCls = decltype(cls)::value;
                          if (c.norm) {
                            depth_attention_bwd_kernel<scalar_t, VEC, VPT, true, kCls, true>(
                                bwd.params);
                          } else {
                            depth_attention_bwd_kernel<scalar_t, VEC, VPT, false, kCls, true>(
                                bwd.params);
                          }
                        };
                        if (as_any) {
                          run_ring(std::integral_constant<int, kAnyGroup>{});
                        } else {
                          run_ring(std::integral_constant<int, kGroup>{});
                        }
                        return;
                      }
                    }
                    if (as_any) {
                      if (c.norm) {
                        depth_attention_bwd_kernel<scalar_t, VEC, VPT, true, kAnyGroup>(bwd.params);
                      } else {
                        depth_attention_bwd_kernel<scalar_t, VEC, VPT, false, kAnyGroup>(
                            bwd.params);
                      }
                    } else if (c.norm) {
                      depth_attention_bwd_kernel<scalar_t, VEC, VPT, true, kGroup>(bwd.params);
                    } else {
                      depth_attention_bwd_kernel<scalar_t, VEC, VPT, false, kGroup>(bwd.params);
                    }
                  });
    });
  };
  run_backward();
  // The ring must give the bits of the backward without it (same tile and
  // grid: the same partial rows; two-pass: staged): run that into the same
  // buffers, refilled with NaN, compare, and put the ring's results back.
  bool bwd_ring_same_bits = true;
  if (plan.ring_stages > 0 && c.run_backward) {
    ++backward_ring_cases;
    auto refill = [](auto& xs) {
      using T = typename std::decay_t<decltype(xs)>::value_type;
      std::fill(xs.begin(), xs.end(), static_cast<T>(NAN));
    };
    const auto grads_ring = grads;
    const auto partial_ring = partial, dw_partial_ring = dw_partial;
    for (auto& g : grads) refill(g);
    refill(partial), refill(dw_partial), refill(dw_slots);
    const BackwardParams<scalar_t> ring_params = bwd.params;
    bwd.params.ring_stages = 0;
    bwd.params.stage = !backward_single_pass<scalar_t>();
    run_backward();
    bwd_ring_same_bits = same_bits(partial, partial_ring) && same_bits(dw_partial, dw_partial_ring);
    for (int i = 0; i < N; ++i) bwd_ring_same_bits = bwd_ring_same_bits && same_bits(grads[i], grads_ring[i]);
    bwd.params = ring_params;
    for (int i = 0; i < N; ++i) std::copy(grads_ring[i].begin(), grads_ring[i].end(), grads[i].begin());
    std::copy(partial_ring.begin(), partial_ring.end(), partial.begin());
    std::copy(dw_partial_ring.begin(), dw_partial_ring.end(), dw_partial.begin());
  }
  const int bclass = group_class(btile.vec, btile.group);
  auto sum_rows = [&](std::vector<acc_t>& rows) {
    std::vector<acc_t> sum(D, static_cast<acc_t>(NAN));
    emu::launch(static_cast<unsigned>(ceil_div(D, kSumColumns)), kSumColumns * kSumSlices, 0,
                [&] { sum_partial_rows_kernel<acc_t>(rows.data(), bgrid, D, sum.data()); });
    return std::vector<double>(sum.begin(), sum.end());
  };
  std::vector<double> z(D, NAN), dw;
  if (!c.partial && c.run_backward) z = sum_rows(partial);
  if (want_dw && c.run_backward) dw = sum_rows(dw_partial);

  // The same launches through the kAnyGroup instantiations (G at run time),
  // into fresh (NaN) buffers: every output must have the same bits as the
  // class's kernels gave.
  double any_group_bits_differ = 0.0;
  if (c.check_any_group_bits) {
    auto refill = [](auto& xs) {
      using T = typename std::decay_t<decltype(xs)>::value_type;
      std::fill(xs.begin(), xs.end(), static_cast<T>(NAN));
    };
    const auto out0 = out, h0 = h_kept;
    const auto rstd0 = rstd, weights0 = weights, out_rstd0 = out_rstd;
    const auto partial0 = partial, dw_partial0 = dw_partial;
    const auto grads0 = grads;
    refill(out), refill(h_kept), refill(rstd), refill(weights), refill(out_rstd);
    refill(partial), refill(dw_partial), refill(dw_slots);
    for (auto& g : grads) refill(g);
    if (c.norm && !c.keep_h) {
      fwd.params.norm_h = nullptr;
      run_forward(true);
      fwd.params.norm_h = h_kept.data();
    }
    run_forward(true);
    // (the backward reads h from its copy, made from the first run's h)
    run_backward(true);
    bool same = same_bits(out, out0) && same_bits(h_kept, h0) && same_bits(rstd, rstd0) &&
                same_bits(weights, weights0) && same_bits(out_rstd, out_rstd0) &&
                same_bits(partial, partial0) && same_bits(dw_partial, dw_partial0);
    for (int i = 0; i < N; ++i) same = same && same_bits(grads[i], grads0[i]);
    any_group_bits_differ = same ? 0.0 : 1.0;
  }

  // Float64 evaluation of docs/design.md §1-§2 (and §11's output norm),
  // token by token.
  std::vector<double> ref_out(T * D), ref_rstd(N * T), ref_w(N * T), ref_z(D, 0.0);
  std::vector<double> ref_h(T * D), ref_out_rstd(T), ref_dw(D, 0.0);
  std::vector<std::vector<double>> ref_grads(N, std::vector<double>(T * D));
  // In long double (x87: exponent range to 1e4932), so float64 rows near
  // 1e308 do not overflow the reference either.
  using R = long double;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<R> r(N), s(N), dp(N), a(N);
    auto v = [&](int i, int d) { return R(double(src[i][offset + t * stride + d])); };
    R m = -INFINITY;
    for (int i = 0; i < N; ++i) {
      R ss = 0, uv = 0;
      for (int d = 0; d < D; ++d) {
        ss += v(i, d) * v(i, d);
        uv += R(u[d]) * v(i, d);
      }
      r[i] = 1 / std::sqrt(ss / D + R(eps));
      s[i] = r[i] * uv;
      m = std::isnan(s[i]) || std::isnan(m) ? R(NAN) : std::max(m, s[i]);
    }
    R l = 0;
    for (int i = 0; i < N; ++i) l += std::exp(s[i] - m);
    for (int i = 0; i < N; ++i) {
      a[i] = std::exp(s[i] - m) / l;
      ref_rstd[i * T + t] = double(r[i]);
      ref_w[i * T + t] = double(a[i]);
    }
    std::vector<R> hv(D), dhv(D);
    for (int d = 0; d < D; ++d) {
      R h = 0;
      for (int i = 0; i < N; ++i) h += a[i] * v(i, d);
      hv[d] = h;
      ref_out[t * D + d] = double(h);
      dhv[d] = R(double(dh[t * D + d]));
    }
    if (c.norm) {
      // The model of docs/design.md §11: the norm takes h rounded to the
      // source dtype (hn; straight through in the backward).
      // y = (hn r_o) w; from dy: n = r_o hn, g = dy w, dh = r_o (g - <g, n>/D n).
      std::vector<R> hn(D);
      for (int d = 0; d < D; ++d) hn[d] = R(double(static_cast<scalar_t>(double(hv[d]))));
      R sumsq = 0, gn = 0;
      for (int d = 0; d < D; ++d) sumsq += hn[d] * hn[d];
      const R ro = 1 / std::sqrt(sumsq / D + R(c.out_eps));
      ref_out_rstd[t] = double(ro);
      for (int d = 0; d < D; ++d) {
        ref_h[t * D + d] = double(hv[d]);
        ref_out[t * D + d] = double(hn[d] * ro * R(w_out[d]));
        gn += dhv[d] * R(w_out[d]) * (ro * hn[d]);
      }
      for (int d = 0; d < D; ++d) {
        const R n = ro * hn[d];
        ref_dw[d] += double(dhv[d] * n);
        dhv[d] = ro * (dhv[d] * R(w_out[d]) - gn / D * n);
      }
    }
    R sum_a_dp = 0;
    for (int i = 0; i < N; ++i) {
      R dv = 0;
      for (int d = 0; d < D; ++d) dv += dhv[d] * v(i, d);
      dp[i] = dv + (c.weight_grads ? R(grad_w[i * T + t]) : R(0));
      sum_a_dp += a[i] * dp[i];
    }
    for (int i = 0; i < N; ++i) {
      const R alpha = a[i] * (dp[i] - sum_a_dp) * r[i];
      const R beta = -alpha * r[i] * s[i] / D;
      for (int d = 0; d < D; ++d) {
        ref_grads[i][t * D + d] = double(a[i] * dhv[d] + alpha * R(u[d]) + beta * v(i, d));
        ref_z[d] += double(alpha * v(i, d));
      }
    }
  }

  auto as_double = [](const auto& xs) {
    std::vector<double> r(xs.size());
    for (size_t k = 0; k < xs.size(); ++k) r[k] = static_cast<double>(xs[k]);
    return r;
  };
  const Tolerance tol = read_tolerance(dtype_name<scalar_t>());
  struct Check {
    const char* what;
    double err;
    double tol;
  };
  std::vector<Check> checks = {
      {"out", rel_err(as_double(out), ref_out), tol.output},
      {"rstd", rel_err(as_double(rstd), ref_rstd), tol.stats},
      {"weights", rel_err(as_double(weights), ref_w), tol.stats},
  };
  if (fplan.ring_stages > 0) {
    checks.push_back({"ring_vs_registers_bits", ring_same_bits ? 0.0 : 1.0, 0.0});
  }
  if (c.prefix) checks.push_back({"prefix_add_bits", prefix_same_bits ? 0.0 : 1.0, 0.0});
  if (plan.ring_stages > 0 && c.run_backward) {
    checks.push_back({"bwd_ring_vs_plain_bits", bwd_ring_same_bits ? 0.0 : 1.0, 0.0});
  }
  if (c.norm) {
    checks.push_back({"h", rel_err(as_double(h_kept), ref_h), tol.output});
    // r from the kernel's own h (rounded to the dtype): against the
    // reference's h a bf16/fp16 element whose fp32 accumulation and float64
    // value round to neighbouring values moves sum(h^2) by ~2^-8 / D (seen:
    // 3.3e-5 at D = 256), beyond the statistics' tolerance; h itself is
    // checked above against the reference.
    std::vector<double> own_out_rstd(T);
    for (int64_t t = 0; t < T; ++t) {
      // long double (x87: exponents to 1e±4932): h^2 of fp64 rows of 1e±300
      // neither overflows nor underflows.
      long double sumsq = 0;
      for (int d = 0; d < D; ++d) {
        const long double x = static_cast<long double>(double(h_kept[t * D + d]));
        sumsq += x * x;
      }
      own_out_rstd[t] = static_cast<double>(1.0L / std::sqrt(sumsq / D + c.out_eps));
    }
    checks.push_back({"out_rstd", rel_err(as_double(out_rstd), own_out_rstd), tol.stats});
    checks.push_back({"out_rstd_vs_ref", rel_err(as_double(out_rstd), ref_out_rstd), tol.output});
    if (!c.keep_h) checks.push_back({"h_written_unkept", h_written_unkept ? 1.0 : 0.0, 0.0});
    if (want_dw && c.check_backward) checks.push_back({"dw", rel_err(dw, ref_dw), tol.grad});
  }
  // z (the query/gain gradients' sum over tokens) is not checked when its
  // true value comes near the accumulation dtype's maximum: its per-token
  // terms can exceed it then (docs/design.md §8's limit).
  const double acc_max = static_cast<double>(std::numeric_limits<acc_t>::max());
  const double src_max = static_cast<double>(std::numeric_limits<scalar_t>::max());
  bool z_near_max = false;
  for (double x : ref_z) z_near_max = z_near_max || !(std::fabs(x) <= acc_max / 8);
  if (!c.partial && !z_near_max && c.check_backward) {
    checks.push_back({"z", rel_err(z, ref_z), tol.grad});
  }
  double worst_grad = 0;
  for (int i = c.partial ? 1 : 0; i < N; ++i) {
    worst_grad = std::max(worst_grad,
                          rel_err_representable(as_double(grads[i]), ref_grads[i], src_max));
  }
  if (c.check_backward) checks.push_back({"grads", worst_grad, tol.grad});
  if (c.partial) {
    // The unwanted gradient buffer must be untouched (still all NaN).
    bool untouched = true;
    for (const auto& x : grads[0]) untouched = untouched && std::isnan(static_cast<double>(x));
    checks.push_back({"unwanted_grad_written", untouched ? 0.0 : 1.0, 0.0});
  }

  if (c.check_any_group_bits) checks.push_back({"any_group_bits", any_group_bits_differ, 0.0});
  if (c.h_extra_stride != 0 && (backward_single_pass<scalar_t>() || c.norm)) {
    // A row stride of h that is not a multiple of the pack refuses the
    // 16-byte path; one that is keeps it (D permitting).
    const bool pack_stride = (D + c.h_extra_stride) % natural_vec<scalar_t>() == 0;
    const bool want_vec = pack_stride && D % natural_vec<scalar_t>() == 0;
    checks.push_back({"padded_h_path", (btile.vec != 1) == want_vec ? 0.0 : 1.0, 0.0});
  }
  if (c.misaligned_h && (backward_single_pass<scalar_t>() || c.norm)) {
    // 16-byte loads of h would be misaligned: the plan must refuse them.
    checks.push_back({"misaligned_h_on_16B_path", btile.vec == 1 ? 0.0 : 1.0, 0.0});
  }
  if (c.nan_query) {
    // softmax of NaN scores is NaN: h, the weights and every gradient must
    // be NaN, never the sources passed through (N = 1 included).
    auto all_nan = [](const auto& xs) {
      for (const auto& x : xs) {
        if (!std::isnan(static_cast<double>(x))) return false;
      }
      return true;
    };
    bool grads_nan = true;
    for (int i = c.partial ? 1 : 0; i < N; ++i) grads_nan = grads_nan && all_nan(grads[i]);
    checks = {{"out_nan", all_nan(out) ? 0.0 : 1.0, 0.0},
              {"weights_nan", all_nan(weights) ? 0.0 : 1.0, 0.0},
              {"grads_nan", grads_nan ? 0.0 : 1.0, 0.0}};
    if (fplan.ring_stages > 0) {
      checks.push_back({"ring_vs_registers_bits", ring_same_bits ? 0.0 : 1.0, 0.0});
    }
    if (plan.ring_stages > 0 && c.run_backward) {
      checks.push_back({"bwd_ring_vs_plain_bits", bwd_ring_same_bits ? 0.0 : 1.0, 0.0});
    }
    if (c.norm && want_dw) checks.push_back({"dw_nan", all_nan(dw) ? 0.0 : 1.0, 0.0});
  }
  std::string few_label;
  if (few) {
    // Every CTA used CTA 0's weights and r: h from the written weights (in
    // the finish kernel's order, kept finite) and y from the written r, bit
    // for bit.
    bool h_bits = true, y_bits = true;
    const std::vector<scalar_t>& h_few = c.norm ? h_kept : out;
    for (int64_t t = 0; t < T; ++t) {
      for (int d = 0; d < D; ++d) {
        acc_t h = 0;
        for (int i = 0; i < N; ++i) {
          h += weights[i * T + t] * static_cast<acc_t>(src[i][offset + t * stride + d]);
        }
        const auto want = static_cast<scalar_t>(attnres::math::keep_finite<acc_t>(h));
        h_bits = h_bits && std::memcmp(&want, &h_few[t * D + d], sizeof want) == 0;
        if (!c.norm) continue;
        const auto y = static_cast<scalar_t>((static_cast<acc_t>(want) * out_rstd[t]) * w_out[d]);
        y_bits = y_bits && std::memcmp(&y, &out[t * D + d], sizeof y) == 0;
      }
    }
    checks.push_back({"few_tokens_planned", few_plan.splits > 0 ? 0.0 : 1.0, 0.0});
    checks.push_back({"few_h_from_weights_bits", h_bits ? 0.0 : 1.0, 0.0});
    if (c.norm) checks.push_back({"few_y_from_r_bits", y_bits ? 0.0 : 1.0, 0.0});
    char b[80];
    std::snprintf(b, sizeof b, " few_tokens[S=%d slice=%d threads=%d vec=%d]", few_plan.splits,
                  few_plan.slice, few_plan.threads, few_plan.vec);
    few_label = b;
  }
  bool ok = true;
  std::string detail;
  for (const auto& ch : checks) {
    const bool pass = ch.err <= ch.tol;
    ok = ok && pass;
    char buf[96];
    std::snprintf(buf, sizeof buf, " %s=%.2g%s", ch.what, ch.err, pass ? "" : "(FAIL)");
    detail += buf;
  }
  std::string range;
  if (!c.magnitude.empty()) {
    range = " mag=";
    for (double mg : c.magnitude) {
      char b[24];
      std::snprintf(b, sizeof b, "%s%.2g", range.size() > 5 ? "," : "", mg);
      range += b;
    }
  }
  if (c.eps != 1e-6) range += " eps=" + std::to_string(c.eps);
  if (c.nan_query) range += " nan_query";
  if (c.at_magnitude) range += " at_magnitude";
  if (c.saturate) range += c.saturate == 1 ? " saturated" : " saturated+plain";
  if (c.h_extra_stride != 0) range += " h_stride=" + std::to_string(D + c.h_extra_stride);
  if (c.norm) {
    range += std::string(" +norm[") + (c.keep_h ? "keep_h" : "no_h") + (want_dw ? " dw" : "") +
             (want_dw ? (plan.norm_slots_offset >= 0 ? " slots=smem" : " slots=global") : "") +
             (c.out_eps != 1e-5 ? " out_eps=" + std::to_string(c.out_eps) : std::string()) + "]";
  }
  if (c.smem_optin != 227 * 1024) range += " optin=" + std::to_string(c.smem_optin);
  if (c.prefix) range += " +prefix_add";
  range += few_label;
  if (!c.run_backward) {
    range += " (forward only)";
  } else if (!c.check_backward) {
    range += " (backward unchecked)";
  }
  std::printf("%s %-8s N=%d T=%ld D=%d stride=%ld%s%s%s fwd[vec=%d vpt=%d G=%d/%s tpc=%d grid=%u "
              "ring=%d] bwd[%s vec=%d vpt=%d G=%d/%s tpc=%d grid=%ld stage=%d ring=%d]%s%s%s\n",
              ok ? "ok  " : "FAIL", dtype_name<scalar_t>(), N, long(T), D, long(stride),
              c.misaligned ? " misaligned" : "", c.misaligned_h ? " misaligned_h" : "",
              range.c_str(), ftile.vec, ftile.vpt, ftile.group, group_class_name(fclass),
              ftile.tokens_per_cta, fgrid, fplan.ring_stages,
              backward_single_pass<scalar_t>() ? "1-pass" : "2-pass", btile.vec, btile.vpt,
              btile.group, group_class_name(bclass), btile.tokens_per_cta, long(bgrid),
              int(plan.stage), plan.ring_stages,
              c.weight_grads ? " +weight_grads" : "", c.partial ? " +partial" : "", detail.c_str());
  std::fflush(stdout);
  return ok;
}

// The group classes (launch.h) against the tiles the host plans (plan.h):
// for every D = 1 .. 16384 and both alignments of the rows (16-byte packs
// allowed or not), the forward's tile (choose_tile) and the backward's
// (choose_backward_tile) with the class of their G must be compiled
// (group_class_is_compiled) and dispatched by with_tile; every compiled
// (tile, class) pair must be chosen for some D (no dead instantiation); a
// tile with a G of no compiled class must be refused by with_tile. Returns
// the failures and appends, per (tile, class) pair, a case of the median of
// the D (and alignments) that choose it (not the smallest: the normed
// single-pass backward at D = 1 is as inaccurate as the composition,
// docs/design.md §7).
template <typename scalar_t>
int check_group_classes(std::vector<Case>& class_cases) {
  constexpr int natural = natural_vec<scalar_t>();
  int failures = 0;
  std::map<std::pair<int64_t, bool>, bool> case_d;  // (D, vector_ok)
  auto sweep = [&](const char* kernel, int preferred, auto plan, auto dispatch) {
    std::map<std::tuple<int, int, int>, std::vector<std::pair<int64_t, bool>>> chosen;
    int64_t unmapped = 0;
    for (bool vector_ok : {true, false}) {
      for (int64_t D = 1; D <= kMaxD; ++D) {
        const TileConfig tile = plan(D, vector_ok);
        const int cls = group_class(tile.vec, tile.group);
        bool dispatched = false;
        try {
          dispatch(tile, dispatched);
        } catch (const c10::Error&) {
        }
        if (!group_class_is_compiled(tile.vec, tile.vpt, natural, preferred, cls) ||
            !dispatched) {
          if (unmapped++ < 5) {
            std::printf("FAIL %s %s D=%ld vector_ok=%d: tile <%d, %d> G=%d (class %s) has no "
                        "compiled kernel\n",
                        dtype_name<scalar_t>(), kernel, long(D), int(vector_ok), tile.vec,
                        tile.vpt, tile.group, group_class_name(cls));
          }
          continue;
        }
        chosen[std::make_tuple(tile.vec, tile.vpt, cls)].emplace_back(D, vector_ok);
      }
    }
    failures += unmapped > 0 ? 1 : 0;
    int compiled = 0, dead = 0;
    std::string pairs;
    for (int vec : {natural, 1}) {
      for (int vpt : kCandidateVpts) {
        for (int cls : {kAnyGroup, 32, kWarpsGroup}) {
          if (!group_class_is_compiled(vec, vpt, natural, preferred, cls)) continue;
          ++compiled;
          const auto it = chosen.find(std::make_tuple(vec, vpt, cls));
          char buf[64];
          if (it == chosen.end()) {
            ++dead;
            std::printf("FAIL %s %s: tile <%d, %d> class %s is compiled but no D chooses it\n",
                        dtype_name<scalar_t>(), kernel, vec, vpt, group_class_name(cls));
            continue;
          }
          auto& ds = it->second;
          std::sort(ds.begin(), ds.end());
          const auto median = ds[ds.size() / 2];
          std::snprintf(buf, sizeof buf, " <%d,%d>/%s:D=%ld..%ld,case %ld%s", vec, vpt,
                        group_class_name(cls), long(ds.front().first), long(ds.back().first),
                        long(median.first), median.second ? "" : "(unaligned)");
          pairs += buf;
          case_d.emplace(median, true);
        }
      }
    }
    failures += dead > 0 ? 1 : 0;
    std::printf("%s %-8s %s group classes: %d (tile, class) kernels compiled, %ld of %ld "
                "(D, alignment) plans unmapped, %d never chosen:%s\n",
                unmapped == 0 && dead == 0 ? "ok  " : "FAIL", dtype_name<scalar_t>(), kernel,
                compiled, long(unmapped), long(2 * kMaxD), dead, pairs.c_str());
  };
  sweep(
      "forward", kMaxElemsPerThread,
      [](int64_t D, bool vector_ok) { return choose_tile(D, vector_ok, natural); },
      [](const TileConfig& tile, bool& dispatched) {
        with_tile<scalar_t, kMaxElemsPerThread>(tile,
                                                [&](auto, auto, auto) { dispatched = true; });
      });
  sweep(
      "backward", kBackwardPreferredElems,
      [](int64_t D, bool vector_ok) { return choose_backward_tile(D, vector_ok, natural); },
      [](const TileConfig& tile, bool& dispatched) {
        with_tile<scalar_t, kBackwardPreferredElems>(
            tile, [&](auto, auto, auto) { dispatched = true; });
      });
  // A G of a class not compiled for the tile is refused, naming the tile
  // and G (the forward's 16-byte tiles: G = 8 with several packs per thread,
  // G = 64 with one pack where no D takes it).
  {
    bool refused = true;
    for (int vpt : kCandidateVpts) {
      for (int G : {8, 64}) {
        TileConfig tile;
        tile.vec = natural;
        tile.vpt = vpt;
        tile.group = G;
        if (!tile_is_compiled(natural, vpt, natural) ||
            group_class_is_compiled(natural, vpt, natural, kMaxElemsPerThread,
                                    group_class(natural, G))) {
          continue;
        }
        bool called = false, threw = false;
        try {
          with_tile<scalar_t, kMaxElemsPerThread>(tile, [&](auto, auto, auto) { called = true; });
        } catch (const c10::Error& e) {
          const std::string what = e.what();
          threw = what.find("vpt=" + std::to_string(vpt)) != std::string::npos &&
                  what.find("G=" + std::to_string(G)) != std::string::npos;
        }
        refused = refused && threw && !called;
      }
    }
    failures += refused ? 0 : 1;
    std::printf("%s %-8s with_tile refuses a G of no compiled class, naming tile and G\n",
                refused ? "ok  " : "FAIL", dtype_name<scalar_t>());
  }
  // One case per (D, alignment): N = 3, T = 5 tokens (a second CTA and the
  // token loop for the warp and block classes, surplus groups for the
  // sub-warp ones), misaligned sources where the scalar path is wanted.
  for (const auto& [dv, unused] : case_d) {
    Case c{3, 5, static_cast<int>(dv.first), 0, !dv.second, 2};
    c.check_any_group_bits = true;
    class_cases.push_back(c);
  }
  return failures;
}

}  // namespace

// A range case: sources of the given magnitudes (docs/design.md §8).
Case range_case(int N, int64_t T, int D, std::vector<double> magnitude, double eps = 1e-6,
                bool nan_query = false, int64_t grid_cap = 2, double dh_scale = 1.0) {
  Case c{N, T, D, 0, false, grid_cap};
  c.dh_scale = dh_scale;
  c.magnitude = std::move(magnitude);
  c.eps = eps;
  c.nan_query = nan_query;
  return c;
}

int main(int argc, char** argv) {
  // argv[1], when given and not "all", keeps only the cases of one dtype;
  // argv[2] = "k/n" keeps every n-th case from the k-th (make sanitize runs
  // complementary halves of two dtypes side by side).
  const std::string only = argc > 1 && std::string(argv[1]) != "all" ? argv[1] : "";
  int shard = 0, shards = 1;
  if (argc > 2 && (std::sscanf(argv[2], "%d/%d", &shard, &shards) != 2 || shards < 1 ||
                   shard < 0 || shard >= shards)) {
    std::fprintf(stderr, "usage: %s [dtype|all] [k/n]\n", argv[0]);
    return 2;
  }
#ifdef ATTNRES_EMULATE_ONLY
  if (!only.empty() && only != ATTNRES_EMULATE_ONLY) {  // its cases are not compiled in
    std::fprintf(stderr, "%s: built for %s only, asked for %s\n", argv[0], ATTNRES_EMULATE_ONLY,
                 only.c_str());
    return 2;
  }
#endif
  int64_t case_index = 0;
  std::mt19937_64 rng(12345);
  int failures = 0;
  // The backward grid's waves (host planning, plan.h): 4 waves while the
  // partial rows stay within kPartialRowBytes, fewer above, never under one.
  {
    struct GridCase {
      int64_t resident, D, acc_size, want;
    };
    const GridCase grid_cases[] = {
        {264, 4096, 4, 4 * 264},   // H200-like, bf16/fp32 D = 4096: 16.5 MiB of rows
        {132, 16384, 4, 3 * 132},  // 4 waves would be 33 MiB
        {132, 16384, 8, 1 * 132},  // fp64: 16.5 MiB a wave, still one wave
        {1024, 16384, 8, 1024},    // beyond the budget in one wave: one wave
        {0, 64, 4, 4},             // no occupancy information: at least one CTA
    };
    for (const auto& g : grid_cases) {
      const int64_t got = backward_grid_cap(g.resident, g.D, g.acc_size);
      const bool ok = got == g.want;
      failures += ok ? 0 : 1;
      std::printf("%s grid cap resident=%ld D=%ld acc=%ld -> %ld (want %ld)\n", ok ? "ok  " : "FAIL",
                  long(g.resident), long(g.D), long(g.acc_size), long(got), long(g.want));
    }
  }
  // The forward's plan (plan_forward): the cp.async ring when a token's
  // rows take <= 32 KiB a stage and the CTA's stages <= 64 KiB (3 stages up
  // to 16 KiB a stage, else 2; sub-warp groups in whole warps), on the
  // 16-byte path of a tile with a ring kernel; else the register pipeline.
  {
    struct PlanCase {
      const char* what;
      int64_t N, D;
      bool vector_ok;
      int natural;
      int64_t optin;
      int want_stages, want_vpt, want_group, want_tpc;
      size_t want_smem;
    };
    constexpr int64_t kH200 = 227 * 1024;
    const PlanCase plan_cases[] = {
        {"bf16 N=9 D=1024 (priority shape)", 9, 1024, true, 8, kH200, 2, 4, 32, 1, 36864},
        {"bf16 N=17 D=1024: 34 KiB a token", 17, 1024, true, 8, kH200, 0, 4, 32, 8, 0},
        {"bf16 N=9 D=4096: 72 KiB a token", 9, 4096, true, 8, kH200, 0, 2, 256, 1, 0},
        {"bf16 N=8 D=1024: 16 KiB, 3 stages", 8, 1024, true, 8, kH200, 3, 4, 32, 1, 49152},
        {"bf16 N=16 D=1024: 32 KiB, 2 stages", 16, 1024, true, 8, kH200, 2, 4, 32, 1, 65536},
        {"bf16 N=3 D=64: sub-warp, 32 tokens", 3, 64, true, 8, kH200, 3, 1, 8, 32, 36864},
        {"bf16 N=70 D=64: not a whole warp", 70, 64, true, 8, kH200, 0, 1, 8, 32, 0},
        {"bf16 N=3 D=64 misaligned: scalar", 3, 64, false, 8, kH200, 0, 4, 16, 16, 0},
        {"bf16 N=1 D=16384: 32 KiB, G=512", 1, 16384, true, 8, kH200, 2, 4, 512, 1, 65536},
        {"bf16 N=2 D=16384: 64 KiB a token", 2, 16384, true, 8, kH200, 0, 4, 512, 1, 0},
        {"bf16 N=9 D=1024, 40 KiB opt-in", 9, 1024, true, 8, 40 * 1024, 2, 4, 32, 1, 36864},
        {"bf16 N=9 D=1024, 32 KiB opt-in", 9, 1024, true, 8, 32 * 1024, 0, 4, 32, 8, 0},
        {"bf16 N=9 D=1024, no opt-in", 9, 1024, true, 8, 0, 0, 4, 32, 8, 0},
        {"fp16 N=17 D=64: 8 tokens", 17, 64, true, 8, kH200, 3, 1, 8, 8, 52224},
        {"fp32 N=2 D=2048: block group", 2, 2048, true, 4, kH200, 3, 2, 256, 1, 49152},
        {"fp32 N=9 D=4096: 144 KiB a token", 9, 4096, true, 4, kH200, 0, 4, 256, 1, 0},
        {"fp64 N=3 D=70: 7 tokens", 3, 70, true, 2, kH200, 3, 2, 32, 7, 64512},
        {"fp64 N=1 D=512: <2, 8> has no ring", 1, 512, true, 2, kH200, 0, 8, 32, 8, 0},
    };
    for (const auto& pc : plan_cases) {
      const ForwardPlan fp = plan_forward(pc.N, pc.D, pc.vector_ok, pc.natural, pc.optin);
      const bool ok = fp.ring_stages == pc.want_stages && fp.tile.vpt == pc.want_vpt &&
                      fp.tile.group == pc.want_group && fp.tile.tokens_per_cta == pc.want_tpc &&
                      fp.smem_bytes == pc.want_smem;
      failures += ok ? 0 : 1;
      std::printf("%s plan_forward %s -> stages=%d vpt=%d G=%d tpc=%d smem=%zu (want %d %d %d %d %zu)\n",
                  ok ? "ok  " : "FAIL", pc.what, fp.ring_stages, fp.tile.vpt, fp.tile.group,
                  fp.tile.tokens_per_cta, fp.smem_bytes, pc.want_stages, pc.want_vpt,
                  pc.want_group, pc.want_tpc, pc.want_smem);
    }
    const bool ok = forward_ring_grid_cap(264) == 4 * 264 && forward_ring_grid_cap(0) == 4;
    failures += ok ? 0 : 1;
    std::printf("%s forward_ring_grid_cap: 4 waves, at least one CTA's worth\n", ok ? "ok  " : "FAIL");
    // allow_ring = false (ATTNRES_CUDA_RING unset or 0): the register pipeline.
    const ForwardPlan off = plan_forward(9, 1024, true, 8, kH200, false);
    const bool off_ok = off.ring_stages == 0 && off.smem_bytes == 0 && off.tile.tokens_per_cta == 8;
    failures += off_ok ? 0 : 1;
    std::printf("%s plan_forward bf16 N=9 D=1024 without rings -> stages=%d tpc=%d smem=%zu\n",
                off_ok ? "ok  " : "FAIL", off.ring_stages, off.tile.tokens_per_cta, off.smem_bytes);
  }
  // The backward's plan (plan_backward): the ring by the forward's rule
  // (ring_shape) in the shared memory left after u and the norm's
  // accumulators, on 16-byte tiles with a backward ring kernel, either
  // backward; else staging (two-pass, a token's rows <= 32 KiB, the CTA's
  // <= 64 KiB) or neither. Tiles from choose_backward_tile.
  {
    struct PlanCase {
      const char* what;
      int64_t N, D;
      bool vector_ok;
      int natural;
      int64_t optin;
      bool norm_slots, allow_ring;
      int want_stages;
      bool want_stage;
      int want_vpt, want_group, want_tpc;
      size_t want_smem;
    };
    constexpr int64_t kH200 = 227 * 1024;
    const PlanCase plan_cases[] = {
        // bf16 D = 1024: <8, 1>, G = 128 (2 tokens a CTA without a ring), u 4 KiB.
        {"bf16 N=8 D=1024: 16 KiB, 3 stages", 8, 1024, true, 8, kH200, false, true, 3, false, 1,
         128, 1, 49152 + 4096},
        {"bf16 N=9 D=1024 (priority shape): 2 stages", 9, 1024, true, 8, kH200, false, true, 2,
         false, 1, 128, 1, 36864 + 4096},
        {"bf16 N=16 D=1024: 32 KiB, 2 stages", 16, 1024, true, 8, kH200, false, true, 2, false,
         1, 128, 1, 65536 + 4096},
        {"bf16 N=17 D=1024: 34 KiB, neither", 17, 1024, true, 8, kH200, false, true, 0, false, 1,
         128, 2, 4096 + 4096},
        {"bf16 N=9 D=1024 without rings: staged", 9, 1024, true, 8, kH200, false, false, 0, true,
         1, 128, 2, 36864 + 4096},
        {"bf16 N=9 D=1024, 40 KiB opt-in: staged", 9, 1024, true, 8, 40 * 1024, false, true, 0,
         true, 1, 128, 1, 18432 + 4096},
        {"bf16 N=9 D=1024 +norm slots", 9, 1024, true, 8, kH200, true, true, 2, false, 1, 128, 1,
         36864 + 4096 + 4096},
        {"bf16 N=2 D=4096: <8, 2> G=256, 3 stages", 2, 4096, true, 8, kH200, false, true, 3,
         false, 2, 256, 1, 49152 + 16384},
        {"bf16 N=9 D=4096: 72 KiB, neither", 9, 4096, true, 8, kH200, false, true, 0, false, 2,
         256, 1, 16384},
        {"bf16 N=3 D=64: sub-warp, 32 tokens", 3, 64, true, 8, kH200, false, true, 3, false, 1,
         8, 32, 36864 + 256},
        {"bf16 N=70 D=64: not a whole warp, staged", 70, 64, true, 8, kH200, false, true, 0, true,
         1, 8, 4, 35840 + 256},
        {"bf16 N=3 D=64 misaligned: scalar", 3, 64, false, 8, kH200, false, true, 0, false, 4, 16,
         16, 256 + 256},
        // fp32 single pass: D = 512 <4, 4> G = 32 (8 tokens), u 2 KiB.
        {"fp32 N=5 D=512: 3 stages, 2 tokens", 5, 512, true, 4, kH200, false, true, 3, false, 4,
         32, 2, 61440 + 2048},
        {"fp32 N=8 D=512: 16 KiB, 3 stages", 8, 512, true, 4, kH200, false, true, 3, false, 4,
         32, 1, 49152 + 2048},
        {"fp32 N=16 D=512: 32 KiB, 2 stages", 16, 512, true, 4, kH200, false, true, 2, false, 4,
         32, 1, 65536 + 2048},
        {"fp32 N=17 D=512: 34 KiB, none", 17, 512, true, 4, kH200, false, true, 0, false, 4, 32,
         8, 2048 + 2048},
        {"fp32 N=16 D=1024 (priority shape): 64 KiB, none", 16, 1024, true, 4, kH200, false,
         true, 0, false, 1, 256, 1, 4096},
        {"fp64 N=3 D=64: u global, 8 tokens", 3, 64, true, 2, kH200, false, true, 3, false, 1,
         32, 8, 36864},
        {"fp64 N=1 D=512: <2, 8> has no ring", 1, 512, true, 2, kH200, false, true, 0, false, 8,
         32, 8, 4096},
    };
    for (const auto& pc : plan_cases) {
      const size_t acc_size = pc.natural == 2 ? 8 : 4;
      const bool single_pass = pc.natural <= 4;
      const BackwardPlan bp =
          plan_backward(choose_backward_tile(pc.D, pc.vector_ok, pc.natural), pc.N, pc.D,
                        pc.natural, acc_size, pc.optin, single_pass, pc.norm_slots, pc.allow_ring);
      const bool ok = bp.ring_stages == pc.want_stages && bp.stage == pc.want_stage &&
                      bp.tile.vpt == pc.want_vpt && bp.tile.group == pc.want_group &&
                      bp.tile.tokens_per_cta == pc.want_tpc && bp.smem_bytes == pc.want_smem &&
                      (!pc.norm_slots || bp.norm_slots_offset >= 0);
      failures += ok ? 0 : 1;
      std::printf("%s plan_backward %s -> stages=%d stage=%d vpt=%d G=%d tpc=%d smem=%zu (want "
                  "%d %d %d %d %d %zu)\n",
                  ok ? "ok  " : "FAIL", pc.what, bp.ring_stages, int(bp.stage), bp.tile.vpt,
                  bp.tile.group, bp.tile.tokens_per_cta, bp.smem_bytes, pc.want_stages,
                  int(pc.want_stage), pc.want_vpt, pc.want_group, pc.want_tpc, pc.want_smem);
    }
  }
  // The few-token plan (plan_few_tokens): T <= 16, D >= 1024, N <= 1024, at
  // least 2 slices of >= 256 columns, min(SMs / T, D / 256) of them.
  {
    struct FewCase {
      const char* what;
      int64_t T, N, D;
      bool vector_ok;
      int natural;
      int64_t sms;
      int want_splits, want_vec, want_slice, want_threads;
    };
    const FewCase few_cases[] = {
        {"K3 bf16 T=1 N=10 D=7168", 1, 10, 7168, true, 8, 132, 28, 8, 256, 32},
        {"K3 bf16 T=16 N=10 D=7168", 16, 10, 7168, true, 8, 132, 8, 8, 896, 128},
        {"bf16 T=16 D=7168 on 16 SMs: 1 slice", 16, 10, 7168, true, 8, 16, 0, 0, 0, 0},
        {"bf16 T=1 D=7168 misaligned: scalar", 1, 10, 7168, false, 8, 132, 28, 1, 256, 256},
        {"fp32 T=1 D=16384", 1, 3, 16384, true, 4, 132, 64, 4, 256, 64},
        {"fp32 T=3 D=7001: scalar, 27 slices", 3, 3, 7001, true, 4, 132, 27, 1, 260, 256},
        {"fp64 T=16 D=1024", 16, 3, 1024, true, 2, 132, 4, 2, 256, 128},
        {"T=0", 0, 3, 7168, true, 8, 132, 0, 0, 0, 0},
        {"T=17", 17, 3, 7168, true, 8, 132, 0, 0, 0, 0},
        {"D=1023", 1, 3, 1023, true, 8, 132, 0, 0, 0, 0},
        {"N=1025", 1, 1025, 7168, true, 8, 132, 0, 0, 0, 0},
    };
    for (const auto& fc : few_cases) {
      const FewTokensPlan fp = plan_few_tokens(fc.T, fc.N, fc.D, fc.vector_ok, fc.natural, fc.sms);
      const bool ok = fp.splits == fc.want_splits &&
                      (fp.splits == 0 || (fp.vec == fc.want_vec && fp.slice == fc.want_slice &&
                                          fp.threads == fc.want_threads));
      failures += ok ? 0 : 1;
      std::printf("%s plan_few_tokens %s -> splits=%d vec=%d slice=%d threads=%d (want %d %d %d "
                  "%d)\n",
                  ok ? "ok  " : "FAIL", fc.what, fp.splits, fp.vec, fp.slice, fp.threads,
                  fc.want_splits, fc.want_vec, fc.want_slice, fc.want_threads);
    }
  }
  // The run-time switches (parse_switch): "1" on, "0" off, unset the
  // default, any other value refused with the variable's name.
  for (const auto& [name, when_unset] : {std::pair<const char*, bool>{"ATTNRES_CUDA_RING", false},
                                         {"ATTNRES_CUDA_FEW_TOKENS", true}}) {
    bool ok = parse_switch(name, nullptr, when_unset) == when_unset &&
              parse_switch(name, "1", when_unset) && !parse_switch(name, "0", when_unset);
    for (const char* bad : {"", "2", "yes", "01"}) {
      bool refused = false;
      try {
        parse_switch(name, bad, when_unset);
      } catch (const c10::Error& e) {
        refused = std::string(e.what()).find(name) != std::string::npos;
      }
      ok = ok && refused;
    }
    failures += ok ? 0 : 1;
    std::printf("%s %s: 1 -> on, 0 -> off, unset -> %s, other values refused\n",
                ok ? "ok  " : "FAIL", name, when_unset ? "on" : "off");
  }
  auto run = [&](auto tag, std::vector<Case> cases) {
    using scalar_t = decltype(tag);
    if constexpr (compiled_in<scalar_t>()) {
      if (!only.empty() && only != dtype_name<scalar_t>()) return;
      for (const auto& c : cases) {
        if (case_index++ % shards != shard) continue;
        failures += run_case<scalar_t>(c, rng) ? 0 : 1;
      }
    }
  };
  // The group classes: every (tile, class) kernel the plans can choose, and
  // only those, is compiled; each runs here, plain and normed, against
  // float64 and bit for bit against its kAnyGroup instantiation.
  auto run_group_classes = [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (compiled_in<scalar_t>()) {
      if (!only.empty() && only != dtype_name<scalar_t>()) return;
      std::vector<Case> cases;
      failures += check_group_classes<scalar_t>(cases);
      std::vector<Case> with_norm = cases;
      for (Case c : cases) {
        c.norm = true;
        with_norm.push_back(c);
      }
      run(tag, with_norm);
    }
  };
  run_group_classes(double{});
  run_group_classes(float{});
  run_group_classes(c10::BFloat16{});
  run_group_classes(c10::Half{});
  //            N    T     D  +stride misaligned grid_cap
  // h read from a misaligned copy: the single-pass backward (float32/64)
  // must take the scalar path although the sources allow 16-byte packs.
  auto padded_h = [](Case c, int extra) {
    c.h_extra_stride = extra;
    return c;
  };
  auto misaligned_h = [](Case c) {
    c.misaligned_h = true;
    return c;
  };
  run(double{}, {{3, 5, 5, 0, false, 2},         // scalar path, sub-warp groups
                 {3, 5, 8, 0, false, 2},         // 16-byte path (single pass: no staging)
                 {5, 9, 8, 0, false, 2, true, true},  // weight gradients, partial
                 misaligned_h({3, 5, 8, 0, false, 2}),
                 {2, 3, 70, 0, false, 1},
                 {70, 3, 16, 0, false, 2},       // source table overflow
                 {2, 2, 1030, 0, false, 2}});    // block mode
  run(float{}, {{1, 4, 3, 0, false, 4},
                {7, 9, 64, 0, false, 2},
                {3, 70, 64, 0, false, 2},        // 5 token blocks on 2 CTAs
                {2, 400, 64, 0, false, 20},      // 20 partial rows to sum
                {5, 6, 1000, 0, false, 2},       // warp per token, 8 packs per lane
                {3, 4, 2052, 0, false, 2},       // block mode (G > 32)
                {2, 3, 16384, 0, false, 2},      // the widest rows
                {3, 4, 100, 1, false, 2},        // odd row stride: scalar path
                {3, 4, 64, 64, false, 2},        // strided rows, 16-byte path
                {3, 4, 64, 0, true, 2},          // misaligned start
                {130, 3, 8, 0, false, 2},        // two overflow chunks
                {7, 9, 64, 0, false, 2, true, false},   // gradient of the weights too
                {3, 4, 2052, 0, false, 2, true, true},  // block mode, partial gradients
                {70, 3, 16, 0, false, 2, false, true},  // overflow, partial
                // weight gradients summed over sources lane, lane+G, ... (G = 4 < N)
                {70, 5, 16, 0, false, 2, true, false},
                {5, 6, 1000, 0, false, 2, true, false},  // the same, a warp per token
                misaligned_h({7, 9, 64, 0, false, 2}),
                misaligned_h({3, 4, 2052, 0, false, 2, true, false}),
                padded_h({7, 9, 64, 0, false, 2}, 4),     // h rows 68 apart: 16-byte path
                padded_h({5, 6, 1000, 0, false, 2}, 3)});  // odd h stride: scalar path
  run(c10::BFloat16{}, {{9, 20, 1000, 0, false, 2},  // staged, 3 tokens per CTA
                        {9, 20, 1024, 0, false, 3},
                        {65, 3, 1000, 0, false, 2}, // not staged
                        {3, 5, 7186, 0, false, 2},  // scalar path, block mode
                        {2, 4, 4096, 0, false, 3},
                        {17, 7, 2048, 0, false, 2},
                        {9, 20, 1024, 0, false, 3, true, true}});  // staged, partial
  run(c10::Half{}, {{17, 6, 64, 0, false, 1},       // 8 lanes per token, staged
                    {4, 300, 24, 0, false, 2},
                    {2, 3, 16384, 0, false, 2}});
  // Range: sums of squares that overflow (|v| > ~1.8e19/sqrt(D) in
  // fp32/bf16) or underflow (eps = 0), up to the dtype's maximum, mixed in
  // one token; and NaN scores (N = 1 included). Every kernel path: sub-warp,
  // warp and block groups, staged and unstaged backward, > 64 sources,
  // scalar path.
  run(double{}, {range_case(3, 5, 8, {1e150, 1.0, 1e-150}),
                 range_case(2, 3, 70, {1e-300}, 0.0),
                 range_case(1, 3, 8, {}, 1e-6, true)});
  run(float{}, {range_case(2, 3, 4, {3e19}),
                range_case(3, 5, 64, {3e38, 1.0, 1e-30}),
                range_case(3, 9, 64, {1e-30}, 0.0),
                range_case(3, 4, 1000, {1e38, 1e20}),
                range_case(2, 4, 2052, {3e38, 1e30}),
                range_case(70, 3, 16, {3e38, 1.0}),
                range_case(1, 3, 8, {}, 1e-6, true),
                range_case(3, 3, 2052, {}, 1e-6, true),
                // dh of 1e-20: the query gradient stays representable (z checked)
                range_case(3, 5, 64, {3e38, 1.0, 1e-30}, 1e-6, false, 2, 1e-20),
                range_case(2, 4, 2052, {3e38, 1e30}, 1e-6, false, 2, 1e-20),
                range_case(70, 3, 16, {3e38, 1.0}, 1e-6, false, 2, 1e-20)});
  run(c10::BFloat16{}, {range_case(9, 20, 1024, {3e38, 1e-30, 1.0}, 1e-6, false, 3),
                        range_case(3, 5, 7186, {1e38}),
                        range_case(65, 3, 1000, {1e30, 1.0}),
                        range_case(9, 20, 1024, {3e38, 1e-30, 1.0}, 1e-6, false, 3, 1e-20)});
  run(c10::Half{}, {range_case(4, 10, 64, {6e4, 1e-4}),
                    range_case(1, 4, 64, {}, 1e-6, true)});
  // Every source at the dtype's maximum (forward only): the weights' sum an
  // ulp above 1 made h inf (N >= 6); the rescue keeps h in the rows' range.
  auto at_maximum = [](int N, int64_t T, int D, double max, bool norm = false) {
    Case c = range_case(N, T, D, {max});
    c.at_magnitude = true;
    c.run_backward = false;
    c.check_backward = false;
    c.norm = norm;
    return c;
  };
  // N: where sum_i fl(fl(1/N) max) overflows without FMA (the host build;
  // fp32 10, 18, ..., fp64 11, 17, ...) or with it (fp32 6, as a GPU may
  // contract).
  run(double{}, {at_maximum(11, 3, 70, 1.7976931348623157e308),
                 at_maximum(17, 3, 64, 1.7976931348623157e308, true)});
  run(float{}, {at_maximum(6, 3, 64, 3.4028234663852886e38),
                at_maximum(10, 5, 1024, 3.4028234663852886e38),
                at_maximum(18, 3, 4100, 3.4028234663852886e38),
                at_maximum(10, 3, 33, 3.4028234663852886e38, true)});
  run(c10::BFloat16{}, {at_maximum(7, 4, 1024, 3.3895313892515355e38),
                        at_maximum(13, 3, 64, 3.3895313892515355e38, true)});
  // The fused output norm (depth_attention with out_weight): every path above with
  // the epilogue's norm and the prologue's dh, h kept or not, the weight
  // gradient wanted or not (its accumulators in shared memory, or in
  // global memory when a 99 KiB device has no room), odd D, N = 1 .. 70.
  auto normed = [](Case c, bool keep_h = true, bool want_dw = true, double out_eps = 1e-5,
                   int64_t smem_optin = 227 * 1024) {
    c.norm = true;
    c.keep_h = keep_h;
    c.want_dw = want_dw;
    c.out_eps = out_eps;
    c.smem_optin = smem_optin;
    return c;
  };
  constexpr int64_t k99KiB = 99 * 1024;
  auto forward_only = [](Case c) {
    c.check_backward = false;
    return c;
  };
  run(double{}, {normed({3, 5, 5, 0, false, 2}),            // scalar path, sub-warp groups
                 normed({3, 5, 8, 0, false, 2}, false),     // h not kept
                 normed({5, 9, 8, 0, false, 2, true, true}, true, false),  // no dw, partial
                 normed({1, 4, 999, 0, false, 2}),          // N = 1, odd D
                 normed({2, 2, 1030, 0, false, 2}),         // block mode
                 normed({70, 3, 16, 0, false, 2}),          // source table overflow
                 normed(misaligned_h({3, 5, 8, 0, false, 2})),
                 normed({2, 3, 8192, 0, false, 1}, true, true, 1e-5, k99KiB),
                 normed(range_case(3, 5, 8, {1e150, 3e149})),
                 // sum(h^2) overflows / underflows: the forward's rescue of
                 // the norm; their gradients need r^2 (r_o r^2) beyond fp64.
                 forward_only(normed(range_case(3, 5, 8, {1e200, 1.0, 1e-150}))),
                 forward_only(normed(range_case(2, 3, 70, {1e-300}, 0.0), true, true, 0.0)),
                 normed(range_case(1, 3, 8, {}, 1e-6, true))});
  run(float{}, {normed({1, 4, 3, 0, false, 4}),
                normed({3, 6, 3, 0, false, 2}),
                normed({7, 9, 64, 0, false, 2}, false),
                normed({2, 400, 64, 0, false, 20}),       // 20 partial rows to sum
                normed({5, 6, 1000, 0, false, 2}, true, false),
                normed({3, 4, 2052, 0, false, 2, true, true}),  // block mode, partial
                normed({65, 3, 1000, 0, false, 2}),
                normed({3, 5, 7186, 0, false, 2}),        // scalar path, block mode
                normed({2, 3, 16384, 0, false, 2}),       // the widest rows, slots in smem
                normed({2, 3, 16384, 0, false, 2}, true, true, 1e-5, k99KiB),  // in global
                normed({70, 5, 16, 0, false, 2, true, false}),
                normed(misaligned_h({7, 9, 64, 0, false, 2})),
                normed(padded_h({5, 6, 1000, 0, false, 2}, 3)),
                // Range: sum(h^2) overflows (rows near the maximum) or
                // underflows (eps = out_eps = 0) in one token, rows of one
                // scale (rows of very different scales in one token: the
                // normed backward is as accurate as the composition, see
                // docs/design.md §7).
                normed(range_case(3, 5, 64, {3e38, 2e38})),
                normed(range_case(3, 5, 64, {3e38, 1e38}, 1e-6, false, 1)),
                normed(range_case(3, 9, 64, {1e-30}, 0.0), true, true, 0.0),
                normed(range_case(3, 4, 1000, {1e38, 3e37})),
                normed(range_case(2, 4, 2052, {3e38, 1e38}), false),
                normed(range_case(3, 3, 2052, {}, 1e-6, true))});
  run(c10::BFloat16{}, {normed({3, 6, 1, 0, false, 2}),      // D = 1, D = 3: the norm
                        normed({2, 5, 3, 0, false, 2}),      // of the rounded h
                        normed({9, 20, 1000, 0, false, 2}),  // staged
                        normed({9, 20, 1024, 0, false, 3, true, true}, false),
                        normed({65, 3, 1000, 0, false, 2}, true, false),  // not staged
                        normed({3, 5, 7186, 0, false, 2}),  // scalar path, block mode
                        normed({1, 7, 2048, 0, false, 2}),
                        normed(misaligned_h({9, 20, 1000, 0, false, 2})),
                        normed(padded_h({17, 7, 2048, 0, false, 2}, 8)),
                        normed(range_case(9, 20, 1024, {3e38, 1e38}, 1e-6, false, 3)),
                        normed(range_case(3, 5, 64, {1e-30}, 0.0), true, true, 0.0),
                        normed(range_case(3, 5, 7186, {1e38})),
                        normed(range_case(1, 4, 64, {}, 1e-6, true))});
  run(c10::Half{}, {normed({3, 6, 1, 0, false, 2}),
                    normed({17, 6, 64, 0, false, 1}),
                    normed({4, 300, 24, 0, false, 2}, false, false),
                    normed({2, 3, 16384, 0, false, 2}, true, true, 1e-5, k99KiB),
                    normed({3, 4, 1000, 1, false, 2}),      // odd row stride: scalar path
                    normed(range_case(4, 10, 64, {6e4, 2e4})),
                    normed(range_case(4, 10, 64, {1e-4}))});
  // Saturated softmax (Case::saturate): 1 - a from ~4e-3 (D = 64) to
  // below float32's epsilon (D = 1000), plain and normed (dh orthogonal to
  // h), single pass (fp32/fp64) and two-pass (bf16/fp16), N = 1 included.
  auto saturated = [](Case c, bool with_norm = false, int mode = 1) {
    c.saturate = mode;
    c.norm = with_norm;
    return c;
  };
  for (bool with_norm : {false, true}) {
    run(double{}, {saturated({4, 9, 256, 0, false, 2}, with_norm),
                   saturated({1, 5, 64, 0, false, 2}, with_norm)});
    run(float{}, {saturated({4, 9, 64, 0, false, 2}, with_norm),
                  saturated({4, 9, 256, 0, false, 2}, with_norm),
                  saturated({5, 6, 1000, 0, false, 2, true, false}, with_norm),
                  saturated({9, 12, 256, 0, false, 2}, with_norm),
                  saturated({1, 7, 1000, 0, false, 2}, with_norm)});
    run(c10::BFloat16{}, {saturated({4, 9, 256, 0, false, 2}, with_norm),
                          saturated({9, 20, 1024, 0, false, 3}, with_norm),
                          saturated({9, 12, 256, 0, false, 2}, with_norm),
                          saturated({1, 7, 1000, 0, false, 2}, with_norm)});
    run(c10::Half{}, {saturated({4, 9, 256, 0, false, 2}, with_norm),
                      saturated({1, 5, 64, 0, false, 2}, with_norm)});
    // Saturated and plain tokens mixed in a warp (sub-warp groups), a warp
    // and a CTA.
    run(float{}, {saturated({4, 9, 64, 0, false, 2}, with_norm, 2),
                  saturated({9, 12, 256, 0, false, 2}, with_norm, 2)});
    run(c10::BFloat16{}, {saturated({3, 40, 64, 0, false, 1}, with_norm, 2),
                          saturated({9, 20, 1024, 0, false, 3}, with_norm, 2)});
  }
  // The fused prefix add (Case::prefix; forward only: the backward does not
  // see it): P last in the table, in the overflow and alone (N = 1), at
  // either end of a row batch, every group class, the ring (bf16 N = 9
  // D = 1024), the scalar path (odd stride, misaligned), the norm with h
  // kept or not, and rescued tokens (P of scale 1 beside rows near the
  // maximum: the rescue reads P' again).
  auto prefix = [](Case c) {
    c.prefix = true;
    c.run_backward = false;
    c.check_backward = false;
    return c;
  };
  run(double{}, {prefix({3, 5, 8, 0, false, 2}), prefix({70, 3, 16, 0, false, 2}),
                 prefix(normed({2, 2, 1030, 0, false, 2})),
                 prefix(range_case(3, 5, 8, {1e160, 1e-150, 1.0}))});
  run(float{}, {prefix({1, 4, 3, 0, false, 4}), prefix({7, 9, 64, 0, false, 2}),
                prefix({5, 6, 1000, 0, false, 2}), prefix({3, 4, 2052, 0, false, 2}),
                prefix({3, 4, 100, 1, false, 2}), prefix({3, 4, 64, 0, true, 2}),
                prefix({130, 3, 8, 0, false, 2}), prefix(normed({7, 9, 64, 0, false, 2}, false)),
                prefix(range_case(3, 5, 64, {3e38, 1e-30, 1.0})),
                prefix(normed(range_case(3, 5, 64, {3e38, 2e38})))});
  run(c10::BFloat16{}, {prefix({9, 20, 1024, 0, false, 3}), prefix({3, 5, 7186, 0, false, 2}),
                        prefix(normed({9, 20, 1000, 0, false, 2})), prefix({1, 7, 1, 0, false, 2})});
  run(c10::Half{}, {prefix({17, 6, 64, 0, false, 1}), prefix({4, 300, 24, 0, false, 2})});
  // The few-token forward (Case::few_tokens): as planned (K3's decode read,
  // N = 10, D = 7168, T = 1 and 16, with P and delta and the norm), forced
  // slices at widths the plan leaves to the tiled forward (D = 1, 7, 1000),
  // N = 1 .. 70 (the overflow table), the scalar path (odd stride,
  // misaligned), h not kept, rescued rows (the last one P' too), rows at the
  // dtype's maximum, NaN; forward only, but for one backward a dtype from its
  // statistics.
  auto few_tokens = [](Case c, int splits = -1, bool backward = false) {
    c.few_tokens = splits;
    c.run_backward = c.check_backward = backward;
    return c;
  };
  run(double{}, {few_tokens(prefix(normed({10, 1, 7168, 0, false, 1}))),
                 few_tokens({3, 3, 1024, 0, false, 1}, -1, true),
                 few_tokens(prefix({70, 3, 1024, 0, false, 1})),
                 few_tokens(normed({1, 1, 7, 0, false, 1}), 3),
                 few_tokens(prefix({3, 3, 1024, 0, true, 1})),
                 few_tokens(prefix(range_case(3, 3, 1024, {1e160, 1e-150, 1.0}))),
                 few_tokens(range_case(2, 3, 1024, {1e-300}, 0.0)),
                 few_tokens(normed(range_case(3, 3, 1024, {1e200, 1e199})))});
  run(float{}, {few_tokens(prefix(normed({10, 1, 7168, 0, false, 1}))),
                few_tokens(prefix({10, 16, 1024, 0, false, 1})),
                few_tokens({3, 3, 1024, 0, false, 1}, -1, true),
                few_tokens(normed({1, 1, 1024, 0, false, 1})),
                few_tokens(prefix({70, 3, 1024, 0, false, 1})),
                few_tokens(prefix(normed({3, 3, 1, 0, false, 1})), 2),
                few_tokens(normed({3, 1, 7, 0, false, 1}), 3),
                few_tokens(prefix(normed({10, 3, 1000, 0, false, 1}, false)), 4),
                few_tokens({3, 3, 1024, 1, false, 1}),           // odd row stride: scalar
                few_tokens(prefix({3, 3, 1024, 8, false, 1})),   // strided, 16-byte path
                few_tokens(prefix(normed({3, 3, 1024, 0, true, 1}))),  // misaligned: scalar
                few_tokens(range_case(3, 3, 1024, {1e30, 1.0, 1e-30})),
                few_tokens(range_case(3, 3, 1024, {1e-30}, 0.0)),
                few_tokens(prefix(range_case(2, 3, 1024, {1.0, 3e38}))),  // P' rescued
                few_tokens(normed(range_case(3, 3, 1024, {3e38, 2e38}))),
                few_tokens(normed(range_case(3, 3, 1024, {1e-30}, 0.0), true, true, 0.0)),
                few_tokens(range_case(1, 3, 1024, {}, 1e-6, true)),
                few_tokens(at_maximum(10, 3, 1024, 3.4028234663852886e38))});
  run(c10::BFloat16{}, {few_tokens(prefix(normed({10, 1, 7168, 0, false, 1}))),
                        few_tokens(prefix({10, 16, 7168, 0, false, 1})),
                        few_tokens({10, 3, 1024, 0, false, 1}, -1, true),
                        few_tokens(prefix({70, 3, 1024, 0, false, 1})),
                        few_tokens(prefix(normed({1, 1, 1024, 0, false, 1}))),
                        few_tokens(prefix({3, 16, 1000, 0, false, 1}), 5),
                        few_tokens(prefix(normed({3, 3, 7, 0, false, 1})), 2),
                        few_tokens(prefix({3, 3, 1024, 0, true, 1})),
                        few_tokens(range_case(3, 3, 1024, {3e38, 1e-30, 1.0})),
                        few_tokens(normed(range_case(3, 3, 1024, {3e38, 1e38}))),
                        few_tokens(at_maximum(7, 3, 1024, 3.3895313892515355e38))});
  run(c10::Half{}, {few_tokens(prefix(normed({10, 1, 7168, 0, false, 1}))),
                    few_tokens({3, 3, 1024, 0, false, 1}, -1, true),
                    few_tokens(prefix({70, 1, 1024, 0, false, 1})),
                    few_tokens(normed({1, 16, 1, 0, false, 1}), 2),
                    few_tokens(prefix({3, 3, 1024, 1, false, 1})),
                    few_tokens(range_case(4, 3, 1024, {6e4, 1e-4})),
                    few_tokens(normed(range_case(4, 3, 1024, {6e4, 2e4})))});
  // The forward's cp.async ring over N (forward only): one warp per token
  // (32 packs a row), rows of 512 bytes per warp, so 3 stages up to N = 32,
  // 2 up to N = 64 (the CTA's 64 KiB), none at 65 and 70; tokens per CTA
  // from 8 down to 1, a grid of 2 CTAs walking all token blocks (the ring
  // wraps); plain, and normed at the stage-count boundaries (CI time).
  auto ring_sweep = [&](auto tag, int D) {
    using scalar_t = decltype(tag);
    std::vector<Case> cases;
    for (int n : {1, 2, 3, 8, 17, 31, 32, 33, 47, 64, 65, 70}) {
      Case c{n, 19, D, 0, false, 2};
      c.run_backward = false;
      c.check_backward = false;
      cases.push_back(c);
      if (n == 1 || n == 32 || n == 33 || n == 64 || n == 65) cases.push_back(normed(c));
    }
    run(scalar_t{}, cases);
  };
  ring_sweep(double{}, 64);
  ring_sweep(float{}, 128);
  ring_sweep(c10::BFloat16{}, 256);
  ring_sweep(c10::Half{}, 256);
  // Ring refills that carry data: one CTA walks more than S token blocks, so
  // stages are refilled and read again, in every group class (sub-warp G at
  // run time, whole warps, a warp); forward and backward, plain and normed.
  auto ring_refills = [&](auto tag, std::vector<Case> cases) {
    std::vector<Case> all;
    for (const Case& c : cases) {
      all.push_back(c);
      all.push_back(normed(c));
    }
    run(tag, all);
  };
  // The backward's ring takes the same cases (its tiles, classes and token
  // blocks in the comments after the forward's), plus its class 32 (D = 512)
  // and, bf16, whole warps with 2 tokens a CTA.
  auto all_refills = [&] {
    ring_refills(c10::BFloat16{}, {{3, 200, 64, 0, false, 1},     // G = 8, 7 blocks; bwd same
                                   {2, 8, 4096, 0, false, 1},     // G = 256 warps, 8 blocks; bwd same
                                   {2, 9, 2048, 0, false, 1},     // warps at vpt = 1; bwd same
                                   {3, 40, 512, 0, false, 1},     // bwd <8, 2> G = 32, 6 blocks
                                   {2, 20, 1024, 0, false, 1}});  // bwd G = 128, 2 tokens, 10 blocks
    ring_refills(c10::Half{}, {{3, 200, 64, 0, false, 1}, {2, 8, 4096, 0, false, 1},
                               {3, 40, 512, 0, false, 1}});       // bwd G = 32, 6 blocks
    ring_refills(float{}, {{3, 100, 32, 0, false, 1},     // G = 8, 4 blocks; bwd same
                           {3, 200, 64, 0, false, 1},     // G = 16, 13 blocks; bwd same
                           {2, 8, 2048, 0, false, 1},     // warps; bwd <4, 2> G = 256, 8 blocks
                           {2, 9, 1024, 0, false, 1},     // a warp, 5 blocks; bwd G = 256, 9 blocks
                           {3, 40, 512, 0, false, 1}});   // bwd <4, 4> G = 32, 3 tokens, 14 blocks
    ring_refills(double{}, {{3, 200, 64, 0, false, 1},    // bwd G = 32, 8 tokens, 25 blocks
                            {2, 8, 1024, 0, false, 1},    // bwd <2, 2> G = 256, 8 blocks
                            {3, 300, 8, 0, false, 1}});   // bwd G = 4, 64 tokens, 5 blocks
  };
  all_refills();
  // The same refill cases with every cp.async performed when it is issued:
  // a stage refilled before its last read (the forward's sweep, the
  // backward's passes or rare path) would then hand that read the rows S
  // token blocks ahead, and the bit-for-bit comparison with the kernel
  // without the ring fails. The queued mode above catches the opposite race
  // (a read before its wait_group).
  emu::cp_async_at_issue = true;
  all_refills();
  emu::cp_async_at_issue = false;
  std::printf("%d case(s) took the forward ring\n", ring_cases);
  std::printf("%d case(s) took the backward ring\n", backward_ring_cases);
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
