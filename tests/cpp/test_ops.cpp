// C++ tests of the attnres ops, called through the dispatcher (the C++ API of
// attnres/ops.h and c10::Dispatcher directly), against composite ATen math in
// float64 (DESIGN.md §1-§2). Backward references come from autograd on the
// composite, so they do not share the kernels' hand-derived formulas.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attnres/ops.h"

namespace {

using ::testing::HasSubstr;
using Tensors = std::vector<at::Tensor>;

constexpr double kEps = 1e-6;
constexpr double kScale = 0.8;

// ---- helpers ----------------------------------------------------------------

struct Tolerance {
  double rtol;
  double atol;  // relative to max(1, max |expected|): the tensor's own scale
};

// Outputs in the sources' dtype are rounded to it; statistics (rstd, weights)
// are always computed in fp32 (fp64 for fp64) from exactly representable
// inputs, so they get the accumulation dtype's tolerance.
Tolerance output_tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return {1e-9, 1e-10};
    case at::kFloat: return {1e-4, 1e-5};
    case at::kHalf: return {5e-3, 5e-3};
    default: return {2e-2, 2e-2};  // bfloat16: 8 mantissa bits
  }
}
Tolerance stat_tolerance(at::ScalarType dtype) {
  return dtype == at::kDouble ? Tolerance{1e-9, 1e-10} : Tolerance{1e-4, 1e-5};
}

// Elementwise |actual - expected| <= atol * scale + rtol * |expected|, in
// float64; on failure reports the worst element.
void expect_close(const at::Tensor& actual, const at::Tensor& expected,
                  Tolerance tol, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  if (expected.numel() == 0) return;
  const at::Tensor a = actual.to(at::kDouble);
  const at::Tensor e = expected.to(at::kDouble);
  const double scale = std::max(1.0, e.abs().max().item<double>());
  const at::Tensor excess = (a - e).abs() - (tol.atol * scale + tol.rtol * e.abs());
  const int64_t worst = excess.flatten().argmax().item<int64_t>();
  EXPECT_LE(excess.flatten()[worst].item<double>(), 0.0)
      << what << ": element " << worst << " is "
      << a.flatten()[worst].item<double>() << ", expected "
      << e.flatten()[worst].item<double>() << " (rtol " << tol.rtol
      << ", atol " << tol.atol << " x " << scale << ")";
}

at::Tensor random_tensor(at::IntArrayRef shape, at::ScalarType dtype,
                         double stddev = 1.0) {
  return (at::randn(shape, at::kDouble) * stddev).to(dtype);
}

Tensors random_sources(int64_t N, at::IntArrayRef shape, at::ScalarType dtype) {
  Tensors sources;
  for (int64_t i = 0; i < N; ++i) {
    // Different scales per source: the norm must remove them from the score.
    sources.push_back(random_tensor(shape, dtype, 0.5 + i % 3));
  }
  return sources;
}

Tensors to_double(const Tensors& ts) {
  Tensors out;
  for (const auto& t : ts) out.push_back(t.to(at::kDouble));
  return out;
}

// The composite: rstd = rsqrt(mean(v^2) + eps), keys = v * rstd * gain,
// scores = scale * <keys, query>, weights = softmax over sources,
// h = sum_i weights_i v_i. Inputs are used as given (float64 in the tests).
struct Composite {
  at::Tensor h, rstd, weights;
};
Composite composite_forward(const Tensors& sources, const at::Tensor& query,
                            const std::optional<at::Tensor>& gain, double eps,
                            double scale) {
  const at::Tensor v = at::stack(sources);  // [N, ..., D]
  const at::Tensor rstd = at::rsqrt(v.pow(2).mean(-1, /*keepdim=*/true) + eps);
  at::Tensor keys = v * rstd;
  if (gain) keys = keys * *gain;
  const at::Tensor scores = (keys * query).sum(-1) * scale;
  const at::Tensor weights = at::softmax(scores, 0);
  const at::Tensor h = (weights.unsqueeze(-1) * v).sum(0);
  return {h, rstd.squeeze(-1), weights};
}

// Gradients of <h, grad_out> by autograd on the float64 composite. Without a
// gain, the gain gradient is that of an all-ones gain (the op's contract).
struct CompositeGrads {
  Tensors sources;
  at::Tensor query, gain;
};
CompositeGrads composite_backward(const Tensors& sources,
                                  const at::Tensor& query,
                                  const std::optional<at::Tensor>& gain,
                                  const at::Tensor& grad_out, double eps,
                                  double scale) {
  Tensors leaves;
  for (const auto& s : sources) {
    leaves.push_back(s.to(at::kDouble).detach().requires_grad_(true));
  }
  const int64_t D = query.size(0);
  at::Tensor q = query.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor g = (gain ? gain->to(at::kDouble) : at::ones({D}, at::kDouble))
                     .detach()
                     .requires_grad_(true);
  const Composite c = composite_forward(leaves, q, g, eps, scale);
  Tensors inputs = leaves;
  inputs.push_back(q);
  inputs.push_back(g);
  const Tensors grads = torch::autograd::grad(
      {c.h}, inputs, {grad_out.to(at::kDouble)}, /*retain_graph=*/false,
      /*create_graph=*/false, /*allow_unused=*/true);
  CompositeGrads out;
  for (size_t i = 0; i < leaves.size(); ++i) {
    // A zero-token problem leaves no graph: its gradients are zeros.
    out.sources.push_back(grads[i].defined() ? grads[i]
                                             : at::zeros_like(leaves[i]));
  }
  out.query = grads[leaves.size()].defined() ? grads[leaves.size()]
                                              : at::zeros({D}, at::kDouble);
  out.gain = grads[leaves.size() + 1].defined()
                 ? grads[leaves.size() + 1]
                 : at::zeros({D}, at::kDouble);
  return out;
}

at::ScalarType acc_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return "fp64";
    case at::kFloat: return "fp32";
    case at::kHalf: return "fp16";
    default: return "bf16";
  }
}

// c10::Error's message without the C++ backtrace.
template <typename Exception, typename Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  EXPECT_THROW(fn(), Exception) << "expected: " << needle;
  try {
    fn();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(needle));
  }
}

// ---- registration and the two call paths ----------------------------------

TEST(Registration, OpsHaveCpuKernels) {
  for (const char* name :
       {"attnres::depth_attention_fwd", "attnres::depth_attention_bwd"}) {
    const auto op = c10::Dispatcher::singleton().findSchema({name, ""});
    ASSERT_TRUE(op.has_value()) << name << " is not registered";
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) << name;
  }
}

TEST(Dispatcher, TypedAndBoxedCallsMatchTheCppApi) {
  at::manual_seed(1);
  const Tensors sources = random_sources(4, {3, 6, 11}, at::kFloat);
  const at::Tensor query = random_tensor({11}, at::kFloat, 0.3);
  const at::Tensor gain = random_tensor({11}, at::kFloat);
  const auto [h, rstd, weights] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);

  auto fwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("attnres::depth_attention_fwd", "")
                 .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                     at::TensorList, const at::Tensor&,
                     const std::optional<at::Tensor>&, double, double)>();
  const auto [h_typed, rstd_typed, weights_typed] =
      fwd.call(sources, query, gain, kEps, kScale);
  EXPECT_TRUE(at::equal(h, h_typed));
  EXPECT_TRUE(at::equal(rstd, rstd_typed));
  EXPECT_TRUE(at::equal(weights, weights_typed));

  // The boxed path parses Tensor[] and Tensor? from IValues.
  torch::jit::Stack stack{c10::IValue(c10::List<at::Tensor>(sources)),
                          query, c10::IValue(), kEps, kScale};
  c10::Dispatcher::singleton()
      .findSchemaOrThrow("attnres::depth_attention_fwd", "")
      .callBoxed(&stack);
  ASSERT_EQ(stack.size(), 3u);
  const auto [h_nogain, rstd_nogain, weights_nogain] =
      attnres::depth_attention_fwd(sources, query, std::nullopt, kEps, kScale);
  EXPECT_TRUE(at::equal(stack[0].toTensor(), h_nogain));
  EXPECT_TRUE(at::equal(stack[2].toTensor(), weights_nogain));

  const at::Tensor grad_out = random_tensor(h.sizes(), at::kFloat);
  auto bwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("attnres::depth_attention_bwd", "")
                 .typed<std::tuple<Tensors, at::Tensor, at::Tensor>(
                     const at::Tensor&, at::TensorList, const at::Tensor&,
                     const std::optional<at::Tensor>&, const at::Tensor&,
                     const at::Tensor&, double)>();
  const auto [gs_typed, gq_typed, gg_typed] =
      bwd.call(grad_out, sources, query, gain, rstd, weights, kScale);
  const auto [gs, gq, gg] = attnres::depth_attention_bwd(
      grad_out, sources, query, gain, rstd, weights, kScale);
  ASSERT_EQ(gs_typed.size(), sources.size());
  for (size_t i = 0; i < gs.size(); ++i) {
    EXPECT_TRUE(at::equal(gs[i], gs_typed[i])) << "source " << i;
  }
  EXPECT_TRUE(at::equal(gq, gq_typed));
  EXPECT_TRUE(at::equal(gg, gg_typed));
}

// ---- known answers ----------------------------------------------------------

// DESIGN.md §1: e=[2,0,0], f1=[0,4,0], f2=[0,0,6], eps 0, w=[0, ln2/sqrt3, 0]
// gives weights [1/4, 1/2, 1/4] and h = [0.5, 2, 1.5].
TEST(KnownAnswer, WorkedExampleFromTheDesign) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const Tensors sources = {at::tensor({2.0, 0.0, 0.0}, opts),
                           at::tensor({0.0, 4.0, 0.0}, opts),
                           at::tensor({0.0, 0.0, 6.0}, opts)};
  const double w = std::log(2.0) / std::sqrt(3.0);
  for (const std::optional<at::Tensor>& gain :
       {std::optional<at::Tensor>(at::ones({3}, opts)),
        std::optional<at::Tensor>()}) {
    const auto [h, rstd, weights] = attnres::depth_attention_fwd(
        sources, at::tensor({0.0, w, 0.0}, opts), gain, /*eps=*/0.0, 1.0);
    EXPECT_TRUE(at::allclose(h, at::tensor({0.5, 2.0, 1.5}, opts), 0, 1e-12))
        << h;
    EXPECT_TRUE(
        at::allclose(weights, at::tensor({0.25, 0.5, 0.25}, opts), 0, 1e-12))
        << weights;
    // rstd = 1/RMS: RMS of [2,0,0] is 2/sqrt3, etc.
    const at::Tensor expected_rstd = at::tensor(
        {std::sqrt(3.0) / 2, std::sqrt(3.0) / 4, std::sqrt(3.0) / 6}, opts);
    EXPECT_TRUE(at::allclose(rstd, expected_rstd, 0, 1e-12)) << rstd;

    // Weights [1/2, 1/4, 1/4] (score ln2 on e) give [1, 1, 1.5].
    const auto [h2, rstd2, weights2] = attnres::depth_attention_fwd(
        sources, at::tensor({w, 0.0, 0.0}, opts), gain, 0.0, 1.0);
    EXPECT_TRUE(at::allclose(h2, at::tensor({1.0, 1.0, 1.5}, opts), 0, 1e-12))
        << h2;
  }
}

TEST(KnownAnswer, ZeroQueryIsTheMeanOfTheSources) {
  at::manual_seed(2);
  const Tensors sources = random_sources(5, {2, 3, 9}, at::kDouble);
  const at::Tensor gain = random_tensor({9}, at::kDouble);
  const auto [h, rstd, weights] = attnres::depth_attention_fwd(
      sources, at::zeros({9}, at::kDouble), gain, kEps, kScale);
  EXPECT_TRUE(at::allclose(h, at::stack(sources).mean(0), 0, 1e-12));
  EXPECT_TRUE(at::allclose(weights, at::full({5, 2, 3}, 0.2, at::kDouble), 0,
                           1e-15));
}

// One source: h is the source exactly, its weight is 1, and the query gets no
// gradient (the softmax of a single score is constant).
TEST(KnownAnswer, OneSourceIsTheIdentity) {
  at::manual_seed(3);
  for (at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensors sources = random_sources(1, {4, 13}, dtype);
    const at::Tensor query = random_tensor({13}, dtype);
    const at::Tensor gain = random_tensor({13}, dtype);
    const auto [h, rstd, weights] =
        attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
    EXPECT_TRUE(at::equal(h, sources[0]));
    EXPECT_TRUE(at::equal(weights, at::ones({1, 4}, acc_dtype(dtype))));

    const at::Tensor grad_out = random_tensor({4, 13}, dtype);
    const auto [grad_sources, grad_query, grad_gain] =
        attnres::depth_attention_bwd(grad_out, sources, query, gain, rstd,
                                     weights, kScale);
    EXPECT_TRUE(at::equal(grad_sources[0], grad_out));
    EXPECT_TRUE(at::equal(grad_query, at::zeros({13}, dtype)));
    EXPECT_TRUE(at::equal(grad_gain, at::zeros({13}, dtype)));
  }
}

// ---- forward and backward against the composite, over dtype x N x D x shape --

struct Case {
  at::ScalarType dtype;
  int64_t N;
  int64_t D;
  bool batched;   // [B, T, D] when true, a single token [D] otherwise
  bool has_gain;  // with a gain, reduced-precision cases use fp32 parameters
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return dtype_name(c.dtype) + "_N" + std::to_string(c.N) + "_D" +
         std::to_string(c.D) + (c.batched ? "_BTD" : "_D1tok") +
         (c.has_gain ? "_gain" : "_nogain");
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (at::ScalarType dtype :
       {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t N : {1, 3, 17}) {
      for (int64_t D : {1, 7, 1000}) {
        for (bool batched : {true, false}) {
          for (bool has_gain : {true, false}) {
            cases.push_back({dtype, N, D, batched, has_gain});
          }
        }
      }
    }
  }
  return cases;
}

class DepthAttentionVsComposite : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    at::manual_seed(100 + c.N * 7 + c.D);
    shape = c.batched ? std::vector<int64_t>{2, 5, c.D}
                      : std::vector<int64_t>{c.D};
    sources = random_sources(c.N, shape, c.dtype);
    const bool reduced = c.dtype == at::kHalf || c.dtype == at::kBFloat16;
    const at::ScalarType param_dtype =
        reduced && c.has_gain ? at::kFloat : c.dtype;
    // ~1/sqrt(D) keeps the scores O(1), so the softmax is not one-hot.
    query = random_tensor({c.D}, param_dtype, 1.5 / std::sqrt(double(c.D)));
    if (c.has_gain) gain = random_tensor({c.D}, param_dtype) + 1.0;
  }

  std::vector<int64_t> shape;
  Tensors sources;
  at::Tensor query;
  std::optional<at::Tensor> gain;
};

TEST_P(DepthAttentionVsComposite, Forward) {
  const Case& c = GetParam();
  const auto [h, rstd, weights] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
  const Composite ref = composite_forward(
      to_double(sources), query.to(at::kDouble),
      gain ? std::optional<at::Tensor>(gain->to(at::kDouble)) : std::nullopt,
      kEps, kScale);

  EXPECT_EQ(h.scalar_type(), c.dtype);
  EXPECT_EQ(rstd.scalar_type(), acc_dtype(c.dtype));
  EXPECT_EQ(weights.scalar_type(), acc_dtype(c.dtype));
  expect_close(h, ref.h, output_tolerance(c.dtype), "h");
  expect_close(rstd, ref.rstd, stat_tolerance(c.dtype), "rstd");
  expect_close(weights, ref.weights, stat_tolerance(c.dtype), "weights");
}

TEST_P(DepthAttentionVsComposite, Backward) {
  const Case& c = GetParam();
  const auto [h, rstd, weights] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
  const at::Tensor grad_out = random_tensor(h.sizes(), c.dtype);
  const auto [grad_sources, grad_query, grad_gain] =
      attnres::depth_attention_bwd(grad_out, sources, query, gain, rstd,
                                   weights, kScale);
  const CompositeGrads ref =
      composite_backward(sources, query, gain, grad_out, kEps, kScale);

  const Tolerance tol = output_tolerance(c.dtype);
  ASSERT_EQ(grad_sources.size(), sources.size());
  for (int64_t i = 0; i < c.N; ++i) {
    EXPECT_EQ(grad_sources[i].scalar_type(), c.dtype);
    expect_close(grad_sources[i], ref.sources[i], tol,
                 "grad of source " + std::to_string(i));
  }
  EXPECT_EQ(grad_query.scalar_type(), query.scalar_type());
  EXPECT_EQ(grad_gain.scalar_type(),
            gain ? gain->scalar_type() : query.scalar_type());
  // Parameter gradients are accumulated in fp32/fp64 and rounded once to the
  // parameter's dtype.
  const Tolerance param_tol = output_tolerance(query.scalar_type());
  expect_close(grad_query, ref.query, param_tol, "grad_query");
  expect_close(grad_gain, ref.gain, param_tol, "grad_norm_weight");
}

INSTANTIATE_TEST_SUITE_P(AllDtypesAndShapes, DepthAttentionVsComposite,
                         ::testing::ValuesIn(all_cases()), case_name);

// ---- layouts and sizes ------------------------------------------------------

// Non-contiguous sources and grad_out give the same bits as their contiguous
// copies: collapsible strides are read in place, others are copied once.
TEST(Layout, StridedSourcesMatchContiguousCopies) {
  at::manual_seed(4);
  const int64_t D = 19;
  const Tensors strided = {
      random_tensor({D, 6}, at::kFloat).t(),              // column-major rows
      random_tensor({12, D}, at::kFloat).slice(0, 0, 12, 2),  // every other row
      random_tensor({6, D + 5}, at::kFloat).slice(1, 2, 2 + D),  // padded rows
      random_tensor({6, 2, D}, at::kFloat).select(1, 1),  // interleaved rows
      random_tensor({1, D}, at::kFloat).expand({6, D}),   // row stride 0
  };
  Tensors contiguous;
  for (const auto& s : strided) contiguous.push_back(s.contiguous());
  ASSERT_FALSE(strided[0].is_contiguous());
  ASSERT_FALSE(strided[1].is_contiguous());
  ASSERT_FALSE(strided[2].is_contiguous());
  ASSERT_FALSE(strided[3].is_contiguous());
  ASSERT_FALSE(strided[4].is_contiguous());
  const at::Tensor query = random_tensor({D}, at::kFloat, 0.3);
  const at::Tensor gain = random_tensor({D}, at::kFloat);

  const auto [h, rstd, weights] =
      attnres::depth_attention_fwd(strided, query, gain, kEps, kScale);
  const auto [h_c, rstd_c, weights_c] =
      attnres::depth_attention_fwd(contiguous, query, gain, kEps, kScale);
  EXPECT_TRUE(at::equal(h, h_c));
  EXPECT_TRUE(at::equal(weights, weights_c));
  expect_close(h,
               composite_forward(to_double(strided), query.to(at::kDouble),
                                 gain.to(at::kDouble), kEps, kScale)
                   .h,
               output_tolerance(at::kFloat), "h of strided sources");

  const at::Tensor grad_out = random_tensor({D, 6}, at::kFloat).t();
  const auto [gs, gq, gg] = attnres::depth_attention_bwd(
      grad_out, strided, query, gain, rstd, weights, kScale);
  const auto [gs_c, gq_c, gg_c] = attnres::depth_attention_bwd(
      grad_out.contiguous(), contiguous, query, gain, rstd_c, weights_c,
      kScale);
  for (size_t i = 0; i < gs.size(); ++i) {
    EXPECT_TRUE(at::equal(gs[i], gs_c[i])) << "source " << i;
  }
  EXPECT_TRUE(at::equal(gq, gq_c));
  EXPECT_TRUE(at::equal(gg, gg_c));
}

TEST(Layout, ZeroTokens) {
  const int64_t D = 8;
  const Tensors sources(3, at::empty({0, D}, at::kFloat));
  at::manual_seed(5);
  const at::Tensor query = random_tensor({D}, at::kFloat);
  const auto [h, rstd, weights] =
      attnres::depth_attention_fwd(sources, query, std::nullopt, kEps, kScale);
  EXPECT_EQ(h.sizes(), at::IntArrayRef({0, D}));
  EXPECT_EQ(rstd.sizes(), at::IntArrayRef({3, 0}));
  EXPECT_EQ(weights.sizes(), at::IntArrayRef({3, 0}));

  const auto [gs, gq, gg] = attnres::depth_attention_bwd(
      at::empty({0, D}, at::kFloat), sources, query, std::nullopt, rstd,
      weights, kScale);
  ASSERT_EQ(gs.size(), 3u);
  for (const auto& g : gs) EXPECT_EQ(g.sizes(), at::IntArrayRef({0, D}));
  EXPECT_TRUE(at::equal(gq, at::zeros({D}, at::kFloat)));
  EXPECT_TRUE(at::equal(gg, at::zeros({D}, at::kFloat)));
}

// ---- determinism --------------------------------------------------------------

// The parameter gradients are token reductions: their bits must not depend on
// the thread count (fixed chunking, no atomics).
TEST(Determinism, BackwardBitsDoNotDependOnThreadCount) {
  at::manual_seed(6);
  const int64_t D = 96;
  const Tensors sources = random_sources(5, {4099, D}, at::kFloat);
  const at::Tensor query = random_tensor({D}, at::kFloat, 0.2);
  const at::Tensor gain = random_tensor({D}, at::kFloat);
  const auto [h, rstd, weights] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
  const at::Tensor grad_out = random_tensor(h.sizes(), at::kFloat);

  const int saved_threads = at::get_num_threads();
  std::vector<std::tuple<Tensors, at::Tensor, at::Tensor>> runs;
  for (int threads : {1, 2, 1, 3}) {
    at::set_num_threads(threads);
    runs.push_back(attnres::depth_attention_bwd(grad_out, sources, query, gain,
                                                rstd, weights, kScale));
  }
  at::set_num_threads(saved_threads);

  const auto& [gs0, gq0, gg0] = runs[0];
  for (size_t r = 1; r < runs.size(); ++r) {
    const auto& [gs, gq, gg] = runs[r];
    EXPECT_TRUE(at::equal(gq, gq0)) << "run " << r;
    EXPECT_TRUE(at::equal(gg, gg0)) << "run " << r;
    for (size_t i = 0; i < gs.size(); ++i) {
      EXPECT_TRUE(at::equal(gs[i], gs0[i])) << "run " << r << " source " << i;
    }
  }
}

// ---- bad input: the exception type and words callers rely on -----------------

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    at::manual_seed(7);
    sources = random_sources(3, {4, D}, at::kFloat);
    query = random_tensor({D}, at::kFloat);
    gain = random_tensor({D}, at::kFloat);
  }
  auto forward(const Tensors& s, const at::Tensor& q,
               const std::optional<at::Tensor>& g, double eps = kEps) {
    return [=] { attnres::depth_attention_fwd(s, q, g, eps, kScale); };
  }

  const int64_t D = 7;
  Tensors sources;
  at::Tensor query, gain;
};

TEST_F(BadInput, EmptySourceList) {
  expect_error<c10::ValueError>(forward({}, query, gain),
                                "sources must be a non-empty list");
}

TEST_F(BadInput, MismatchedShapes) {
  Tensors s = sources;
  s[2] = random_tensor({5, D}, at::kFloat);
  expect_error<c10::ValueError>(forward(s, query, gain),
                                "sources[2] has shape [5, 7] but sources[0] "
                                "has shape [4, 7]");
}

TEST_F(BadInput, MismatchedDtypes) {
  Tensors s = sources;
  s[1] = s[1].to(at::kDouble);
  expect_error<c10::TypeError>(forward(s, query, gain),
                               "all sources must have the same dtype");
}

TEST_F(BadInput, QueryNotOfShapeD) {
  expect_error<c10::ValueError>(
      forward(sources, random_tensor({D + 1}, at::kFloat), gain),
      "query must have shape [D] = [7], got [8]");
  expect_error<c10::ValueError>(
      forward(sources, random_tensor({1, D}, at::kFloat), gain),
      "query must have shape [D] = [7]");
}

TEST_F(BadInput, QueryOfAnotherDtype) {
  expect_error<c10::TypeError>(forward(sources, query.to(at::kDouble), gain),
                               "query must have the sources' dtype");
}

TEST_F(BadInput, NormWeightNotOfShapeD) {
  expect_error<c10::ValueError>(
      forward(sources, query, random_tensor({D, 1}, at::kFloat)),
      "norm_weight must have shape [D] = [7]");
}

TEST_F(BadInput, NegativeOrNonFiniteEps) {
  expect_error<c10::ValueError>(forward(sources, query, gain, -1e-6),
                                "eps must be a finite number >= 0");
  expect_error<c10::ValueError>(forward(sources, query, gain, NAN),
                                "eps must be a finite number >= 0");
}

TEST_F(BadInput, IntegerSources) {
  Tensors s;
  for (const auto& t : sources) s.push_back(t.to(at::kInt));
  expect_error<c10::TypeError>(
      forward(s, query.to(at::kInt), std::nullopt),
      "sources must be float64, float32, bfloat16 or float16, got Int");
}

TEST_F(BadInput, ZeroWidth) {
  const Tensors s(2, at::empty({4, 0}, at::kFloat));
  expect_error<c10::ValueError>(forward(s, at::empty({0}, at::kFloat), gain),
                                "sources must have a non-zero last dimension D");
}

TEST_F(BadInput, ZeroDimSource) {
  const Tensors s(2, at::randn({}, at::kFloat));
  expect_error<c10::ValueError>(forward(s, query, gain),
                                "sources must have at least one dimension");
}

TEST_F(BadInput, BackwardStatisticsAndGradOut) {
  const auto [h, rstd, weights] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
  const at::Tensor grad_out = random_tensor(h.sizes(), at::kFloat);
  auto backward = [&](const at::Tensor& go, const at::Tensor& r,
                      const at::Tensor& w) {
    return [=] {
      attnres::depth_attention_bwd(go, sources, query, gain, r, w, kScale);
    };
  };
  expect_error<c10::ValueError>(
      backward(random_tensor({5, D}, at::kFloat), rstd, weights),
      "grad_out must have the sources' shape");
  expect_error<c10::TypeError>(backward(grad_out.to(at::kDouble), rstd, weights),
                               "grad_out must have the sources' dtype");
  expect_error<c10::ValueError>(backward(grad_out, rstd.slice(0, 0, 2), weights),
                                "rstd must have shape [N, ...] = [3, 4]");
  expect_error<c10::TypeError>(
      backward(grad_out, rstd, weights.to(at::kDouble)),
      "weights must have dtype Float");
}

}  // namespace
