// C++ tests of the attnres ops, called through the dispatcher (the C++ API of
// attnres/ops.h and c10::Dispatcher directly), against composite ATen math in
// float64 (docs/design.md §1-§2). Backward references come from autograd on
// the composite, so they do not share the kernels' hand-derived formulas.
//
// Tolerances come from the project's one table, tests/tolerances.txt (also
// read by the Python tests and the CUDA emulation), whose path the build
// passes as ATTNRES_TOLERANCES_FILE. Every comparison against the float64
// composite is the relative norm error ||x - ref|| / ||ref||, as in Python.
#ifndef ATTNRES_TOLERANCES_FILE
#error "ATTNRES_TOLERANCES_FILE must name tests/tolerances.txt (a string literal, e.g. -DATTNRES_TOLERANCES_FILE='\"/path/to/tests/tolerances.txt\"'); CMakeLists.txt sets it for attnres_cpp_tests"
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <gmock/gmock.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
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

// One row of tests/tolerances.txt: the relative error allowed against the
// float64 composite, for a given source dtype. `output`: h (in the sources'
// dtype); `grad`: gradients; `stats`: rstd and weights (always computed in
// fp32, or fp64 for fp64 sources).
struct Tolerances {
  double output;
  double grad;
  double stats;
};

std::string table_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return "float64";
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return std::string(c10::toString(dtype));
  }
}

// Parses the table: '#' starts a comment, the first other line is the header
// (first column "dtype"; the columns are found by name, so more may follow),
// then one row per dtype. Any malformed line is an error that names it.
std::map<std::string, Tolerances> read_tolerance_table(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw std::runtime_error(
        "cannot open the tolerance table '" + path +
        "' (ATTNRES_TOLERANCES_FILE, normally tests/tolerances.txt in the "
        "source tree): rebuild the C++ tests from this checkout");
  }
  auto where = [&](int line_no) {
    return path + ":" + std::to_string(line_no) + ": ";
  };
  std::vector<std::string> header;
  std::map<std::string, Tolerances> table;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    line = line.substr(0, line.find('#'));
    std::istringstream fields(line);
    std::vector<std::string> row;
    for (std::string f; fields >> f;) row.push_back(f);
    if (row.empty()) continue;
    if (header.empty()) {
      if (row[0] != "dtype") {
        throw std::runtime_error(where(line_no) +
                                 "the header must start with 'dtype'");
      }
      header = row;
      continue;
    }
    if (row.size() != header.size()) {
      throw std::runtime_error(where(line_no) + "expected " +
                               std::to_string(header.size()) +
                               " columns as in the header, got " +
                               std::to_string(row.size()));
    }
    auto column = [&](const std::string& name) {
      const auto it = std::find(header.begin(), header.end(), name);
      if (it == header.end()) {
        throw std::runtime_error(path + ": the header has no column '" +
                                 name + "'");
      }
      const std::string& text = row[it - header.begin()];
      size_t used = 0;
      double value = 0;
      try {
        value = std::stod(text, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != text.size() || !(value > 0.0)) {
        throw std::runtime_error(where(line_no) + "column '" + name +
                                 "' must be a positive number, got '" + text +
                                 "'");
      }
      return value;
    };
    table[row[0]] = {column("output"), column("grad"), column("stats")};
  }
  if (header.empty()) {
    throw std::runtime_error(path + ": no header line (dtype output grad stats)");
  }
  return table;
}

const Tolerances& tolerances(at::ScalarType dtype) {
  static const std::map<std::string, Tolerances> table =
      read_tolerance_table(ATTNRES_TOLERANCES_FILE);
  const auto it = table.find(table_dtype_name(dtype));
  if (it == table.end()) {
    throw std::runtime_error(std::string(ATTNRES_TOLERANCES_FILE) +
                             ": no row for dtype " + table_dtype_name(dtype));
  }
  return it->second;
}

// ||actual - expected|| / ||expected|| in float64 (the denominator clamped
// away from zero, as in tests/python/helpers.py rel_err).
double rel_err(const at::Tensor& actual, const at::Tensor& expected) {
  const at::Tensor a = actual.to(at::kDouble).cpu();
  const at::Tensor e = expected.to(at::kDouble).cpu();
  const double den = std::max(e.norm().item<double>(), 1e-300);
  return (a - e).norm().item<double>() / den;
}

// Relative norm error at most `tol`; on failure also reports the element
// with the largest absolute error. A NaN anywhere fails.
void expect_close(const at::Tensor& actual, const at::Tensor& expected,
                  double tol, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  if (expected.numel() == 0) return;
  const double err = rel_err(actual, expected);
  if (err <= tol) return;
  const at::Tensor a = actual.to(at::kDouble).cpu().flatten();
  const at::Tensor e = expected.to(at::kDouble).cpu().flatten();
  const int64_t worst =
      (a - e).abs().masked_fill((a - e).isnan(), INFINITY).argmax().item<int64_t>();
  ADD_FAILURE() << what << ": relative error ||x - ref|| / ||ref|| = " << err
                << " > " << tol << " (" << ATTNRES_TOLERANCES_FILE
                << "); worst element " << worst << " is "
                << a[worst].item<double>() << ", expected "
                << e[worst].item<double>();
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

// Every gradient (sources, query, gain) from the gradient of h alone, without
// an output norm: depth_attention_bwd with N + 2 true flags.
attnres::DepthAttentionBackward backward_all(const at::Tensor& grad_out, const Tensors& sources,
                                             const at::Tensor& query,
                                             const std::optional<at::Tensor>& gain,
                                             const at::Tensor& h, const at::Tensor& rstd,
                                             const at::Tensor& weights, double scale) {
  c10::List<bool> every_gradient;
  for (size_t i = 0; i < sources.size() + 2; ++i) every_gradient.push_back(true);
  return attnres::depth_attention_bwd(grad_out, std::nullopt, sources, query, gain, h, rstd,
                                      weights, scale, every_gradient);
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

// ---- the tolerance table and the comparison itself ---------------------------

TEST(ToleranceTable, HasARowForEveryDtypeOrderedByPrecision) {
  for (at::ScalarType dtype :
       {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(table_dtype_name(dtype));
    const Tolerances& tol = tolerances(dtype);
    for (double t : {tol.output, tol.grad, tol.stats}) {
      EXPECT_GT(t, 0.0);
      EXPECT_LT(t, 0.1);
    }
  }
  EXPECT_LT(tolerances(at::kDouble).output, tolerances(at::kFloat).output);
  EXPECT_LT(tolerances(at::kFloat).output, tolerances(at::kHalf).output);
  EXPECT_LT(tolerances(at::kHalf).output, tolerances(at::kBFloat16).output);
}

TEST(ToleranceTable, MissingFileIsAClearError) {
  try {
    read_tolerance_table("/nonexistent/tolerances.txt");
    ADD_FAILURE() << "expected an exception";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot open the tolerance table"));
  }
}

// The relative norm error must still see one wrong element, and a NaN.
TEST(ToleranceTable, ExpectCloseCatchesOneBadElementAndNaN) {
  at::manual_seed(0);
  const at::Tensor expected = at::randn({4, 250}, at::kDouble);
  const double tol = tolerances(at::kFloat).output;
  expect_close(expected.to(at::kFloat), expected, tol, "rounded to fp32");
  at::Tensor bad = expected.clone();
  bad[2][17] += 0.01;  // 1% of the RMS in one element of 1000
  EXPECT_NONFATAL_FAILURE(expect_close(bad, expected, tol, "one bad element"),
                          "one bad element: relative error");
  bad[2][17] = NAN;
  EXPECT_NONFATAL_FAILURE(expect_close(bad, expected, tol, "a NaN"),
                          "a NaN: relative error");
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
  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
  // Without out_weight the output norm's statistics are empty tensors.
  EXPECT_EQ(h_kept.sizes(), at::IntArrayRef({0}));
  EXPECT_EQ(h_out_rstd.sizes(), at::IntArrayRef({0}));

  auto fwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("attnres::depth_attention_fwd", "")
                 .typed<attnres::DepthAttentionForward(
                     at::TensorList, const at::Tensor&,
                     const std::optional<at::Tensor>&, double, double,
                     const std::optional<at::Tensor>&, std::optional<double>, bool,
                     const std::optional<at::Tensor>&)>();
  const auto [h_typed, rstd_typed, weights_typed, h_typed_kept, h_typed_out_rstd, h_typed_prefix] =
      fwd.call(sources, query, gain, kEps, kScale, std::nullopt, std::nullopt, false,
               std::nullopt);
  EXPECT_TRUE(at::equal(h, h_typed));
  EXPECT_TRUE(at::equal(rstd, rstd_typed));
  EXPECT_TRUE(at::equal(weights, weights_typed));
  EXPECT_EQ(h_typed_kept.sizes(), at::IntArrayRef({0}));
  EXPECT_EQ(h_typed_out_rstd.sizes(), at::IntArrayRef({0}));

  // The boxed path parses Tensor[], Tensor? and float? from IValues.
  torch::jit::Stack stack{c10::IValue(c10::List<at::Tensor>(sources)),
                          query, c10::IValue(), kEps, kScale,
                          c10::IValue(), c10::IValue(), false, c10::IValue()};
  c10::Dispatcher::singleton()
      .findSchemaOrThrow("attnres::depth_attention_fwd", "")
      .callBoxed(&stack);
  ASSERT_EQ(stack.size(), 6u);
  const auto [h_nogain, rstd_nogain, weights_nogain, h_nogain_kept, h_nogain_out_rstd,
              h_nogain_prefix] =
      attnres::depth_attention_fwd(sources, query, std::nullopt, kEps, kScale);
  EXPECT_TRUE(at::equal(stack[0].toTensor(), h_nogain));
  EXPECT_TRUE(at::equal(stack[2].toTensor(), weights_nogain));
  EXPECT_EQ(stack[3].toTensor().sizes(), at::IntArrayRef({0}));
  EXPECT_EQ(stack[4].toTensor().sizes(), at::IntArrayRef({0}));

  const at::Tensor grad_out = random_tensor(h.sizes(), at::kFloat);
  auto bwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("attnres::depth_attention_bwd", "")
                 .typed<attnres::DepthAttentionBackward(
                     const std::optional<at::Tensor>&,
                     const std::optional<at::Tensor>&, at::TensorList,
                     const at::Tensor&, const std::optional<at::Tensor>&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     double, const c10::List<bool>&, const std::optional<at::Tensor>&,
                     const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  c10::List<bool> every_gradient;
  for (size_t i = 0; i < sources.size() + 2; ++i) every_gradient.push_back(true);
  const auto [gs_typed, gq_typed, gg_typed, gw_typed] =
      bwd.call(grad_out, std::nullopt, sources, query, gain, h, rstd, weights,
               kScale, every_gradient, std::nullopt, std::nullopt, std::nullopt);
  const auto [gs, gq, gg, gw] = backward_all(
      grad_out, sources, query, gain, h, rstd, weights, kScale);
  ASSERT_EQ(gs_typed.size(), sources.size());
  for (size_t i = 0; i < gs.size(); ++i) {
    EXPECT_TRUE(at::equal(gs[i], gs_typed[i])) << "source " << i;
  }
  EXPECT_TRUE(at::equal(gq, gq_typed));
  EXPECT_TRUE(at::equal(gg, gg_typed));
  // No out_weight: no out_weight gradient.
  EXPECT_FALSE(gw.defined());
  EXPECT_FALSE(gw_typed.defined());

  // With out_weight: the typed call and the C++ API agree, and out_eps
  // follows eps when absent.
  const at::Tensor out_weight = random_tensor({11}, at::kFloat) + 1.0;
  const auto [y, rstd_n, weights_n, h_n, out_rstd_n, y_prefix] = attnres::depth_attention_fwd(
      sources, query, gain, kEps, kScale, out_weight, std::nullopt, /*keep_h=*/true);
  const auto [y_typed, rstd_nt, weights_nt, h_nt, out_rstd_nt, y_typed_prefix] =
      fwd.call(sources, query, gain, kEps, kScale, out_weight, kEps, true, std::nullopt);
  EXPECT_TRUE(at::equal(y, y_typed));
  EXPECT_TRUE(at::equal(h_n, h_nt));
  EXPECT_TRUE(at::equal(out_rstd_n, out_rstd_nt));
  EXPECT_TRUE(at::equal(h_n, h));
  EXPECT_EQ(out_rstd_n.sizes(), at::IntArrayRef({3, 6}));
  c10::List<bool> every_normed_gradient = every_gradient.copy();
  every_normed_gradient.push_back(true);
  const auto [gs_n, gq_n, gg_n, gw_n] =
      attnres::depth_attention_bwd(grad_out, std::nullopt, sources, query, gain, h_n, rstd_n,
                                   weights_n, kScale, every_normed_gradient, out_weight,
                                   out_rstd_n);
  const auto [gs_nt, gq_nt, gg_nt, gw_nt] =
      bwd.call(grad_out, std::nullopt, sources, query, gain, h_nt, rstd_nt, weights_nt, kScale,
               every_normed_gradient, out_weight, out_rstd_nt, std::nullopt);
  ASSERT_EQ(gs_nt.size(), sources.size());
  for (size_t i = 0; i < gs_n.size(); ++i) {
    EXPECT_TRUE(at::equal(gs_n[i], gs_nt[i])) << "source " << i;
  }
  EXPECT_TRUE(at::equal(gq_n, gq_nt));
  EXPECT_TRUE(at::equal(gg_n, gg_nt));
  ASSERT_TRUE(gw_n.defined());
  EXPECT_TRUE(at::equal(gw_n, gw_nt));
}

// ---- known answers ----------------------------------------------------------

// docs/design.md §1: e=[2,0,0], f1=[0,4,0], f2=[0,0,6], eps 0, w=[0, ln2/sqrt3, 0]
// gives weights [1/4, 1/2, 1/4] and h = [0.5, 2, 1.5].
TEST(KnownAnswer, WorkedExampleFromTheDesign) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const Tensors sources = {at::tensor({2.0, 0.0, 0.0}, opts),
                           at::tensor({0.0, 4.0, 0.0}, opts),
                           at::tensor({0.0, 0.0, 6.0}, opts)};
  const double w = std::log(2.0) / std::sqrt(3.0);
  const Tolerances& tol = tolerances(at::kDouble);
  for (const std::optional<at::Tensor>& gain :
       {std::optional<at::Tensor>(at::ones({3}, opts)),
        std::optional<at::Tensor>()}) {
    SCOPED_TRACE(gain ? "gain of ones" : "no gain");
    const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] = attnres::depth_attention_fwd(
        sources, at::tensor({0.0, w, 0.0}, opts), gain, /*eps=*/0.0, 1.0);
    expect_close(h, at::tensor({0.5, 2.0, 1.5}, opts), tol.output, "h");
    expect_close(weights, at::tensor({0.25, 0.5, 0.25}, opts), tol.stats,
                 "weights");
    // rstd = 1/RMS: RMS of [2,0,0] is 2/sqrt3, etc.
    const at::Tensor expected_rstd = at::tensor(
        {std::sqrt(3.0) / 2, std::sqrt(3.0) / 4, std::sqrt(3.0) / 6}, opts);
    expect_close(rstd, expected_rstd, tol.stats, "rstd");

    // Weights [1/2, 1/4, 1/4] (score ln2 on e) give [1, 1, 1.5].
    const auto [h2, rstd2, weights2, h2_kept, h2_out_rstd, h2_prefix] = attnres::depth_attention_fwd(
        sources, at::tensor({w, 0.0, 0.0}, opts), gain, 0.0, 1.0);
    expect_close(h2, at::tensor({1.0, 1.0, 1.5}, opts), tol.output,
                 "h with the query on e");
  }
}

TEST(KnownAnswer, ZeroQueryIsTheMeanOfTheSources) {
  at::manual_seed(2);
  const Tensors sources = random_sources(5, {2, 3, 9}, at::kDouble);
  const at::Tensor gain = random_tensor({9}, at::kDouble);
  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] = attnres::depth_attention_fwd(
      sources, at::zeros({9}, at::kDouble), gain, kEps, kScale);
  const Tolerances& tol = tolerances(at::kDouble);
  expect_close(h, at::stack(sources).mean(0), tol.output, "h");
  expect_close(weights, at::full({5, 2, 3}, 0.2, at::kDouble), tol.stats,
               "weights");
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
    const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
        attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
    EXPECT_TRUE(at::equal(h, sources[0]));
    EXPECT_TRUE(at::equal(weights, at::ones({1, 4}, acc_dtype(dtype))));

    const at::Tensor grad_out = random_tensor({4, 13}, dtype);
    const auto [grad_sources, grad_query, grad_gain, grad_out_weight] =
        backward_all(grad_out, sources, query, gain, h, rstd,
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
    // At D = 1 a tiny eps makes the key sign(v) (1 - O(eps / v^2)): the query
    // and gain gradients are then O(eps) cancellations of O(1) terms that no
    // evaluation gets to a relative tolerance (not even float64 to 1e-10).
    // eps = 1 keeps every term O(1) there (as in tests/python/test_ops.py).
    eps = c.D == 1 ? 1.0 : kEps;
  }

  std::vector<int64_t> shape;
  Tensors sources;
  at::Tensor query;
  std::optional<at::Tensor> gain;
  double eps = kEps;
};

TEST_P(DepthAttentionVsComposite, Forward) {
  const Case& c = GetParam();
  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
      attnres::depth_attention_fwd(sources, query, gain, eps, kScale);
  const Composite ref = composite_forward(
      to_double(sources), query.to(at::kDouble),
      gain ? std::optional<at::Tensor>(gain->to(at::kDouble)) : std::nullopt,
      eps, kScale);

  EXPECT_EQ(h.scalar_type(), c.dtype);
  EXPECT_EQ(rstd.scalar_type(), acc_dtype(c.dtype));
  EXPECT_EQ(weights.scalar_type(), acc_dtype(c.dtype));
  const Tolerances& tol = tolerances(c.dtype);
  expect_close(h, ref.h, tol.output, "h");
  expect_close(rstd, ref.rstd, tol.stats, "rstd");
  expect_close(weights, ref.weights, tol.stats, "weights");
  // No out_weight: the output norm's statistics are empty.
  EXPECT_EQ(h_kept.sizes(), at::IntArrayRef({0}));
  EXPECT_EQ(h_out_rstd.sizes(), at::IntArrayRef({0}));
}

TEST_P(DepthAttentionVsComposite, Backward) {
  const Case& c = GetParam();
  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
      attnres::depth_attention_fwd(sources, query, gain, eps, kScale);
  const at::Tensor grad_out = random_tensor(h.sizes(), c.dtype);
  const auto [grad_sources, grad_query, grad_gain, grad_out_weight] =
      backward_all(grad_out, sources, query, gain, h, rstd,
                                   weights, kScale);
  const CompositeGrads ref =
      composite_backward(sources, query, gain, grad_out, eps, kScale);

  const double tol = tolerances(c.dtype).grad;
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
  const double param_tol = tolerances(query.scalar_type()).grad;
  expect_close(grad_query, ref.query, param_tol, "grad_query");
  expect_close(grad_gain, ref.gain, param_tol, "grad_norm_weight");
  EXPECT_FALSE(grad_out_weight.defined());
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

  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
      attnres::depth_attention_fwd(strided, query, gain, kEps, kScale);
  const auto [h_c, rstd_c, weights_c, h_c_kept, h_c_out_rstd, h_c_prefix] =
      attnres::depth_attention_fwd(contiguous, query, gain, kEps, kScale);
  EXPECT_TRUE(at::equal(h, h_c));
  EXPECT_TRUE(at::equal(weights, weights_c));
  expect_close(h,
               composite_forward(to_double(strided), query.to(at::kDouble),
                                 gain.to(at::kDouble), kEps, kScale)
                   .h,
               tolerances(at::kFloat).output, "h of strided sources");

  const at::Tensor grad_out = random_tensor({D, 6}, at::kFloat).t();
  const auto [gs, gq, gg, gw] = backward_all(
      grad_out, strided, query, gain, h, rstd, weights, kScale);
  const auto [gs_c, gq_c, gg_c, gw_c] = backward_all(
      grad_out.contiguous(), contiguous, query, gain, h_c, rstd_c, weights_c,
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
  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
      attnres::depth_attention_fwd(sources, query, std::nullopt, kEps, kScale);
  EXPECT_EQ(h.sizes(), at::IntArrayRef({0, D}));
  EXPECT_EQ(rstd.sizes(), at::IntArrayRef({3, 0}));
  EXPECT_EQ(weights.sizes(), at::IntArrayRef({3, 0}));

  const auto [gs, gq, gg, gw] = backward_all(
      at::empty({0, D}, at::kFloat), sources, query, std::nullopt, h, rstd,
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
  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
  const at::Tensor grad_out = random_tensor(h.sizes(), at::kFloat);

  const int saved_threads = at::get_num_threads();
  std::vector<attnres::DepthAttentionBackward> runs;
  for (int threads : {1, 2, 1, 3}) {
    at::set_num_threads(threads);
    runs.push_back(backward_all(grad_out, sources, query, gain, h, rstd, weights, kScale));
  }
  at::set_num_threads(saved_threads);

  const auto& [gs0, gq0, gg0, gw0] = runs[0];
  for (size_t r = 1; r < runs.size(); ++r) {
    const auto& [gs, gq, gg, gw] = runs[r];
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
      "sources must be float64, float32, bfloat16 or float16, got torch.int32");
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
  const auto [h, rstd, weights, h_kept, h_out_rstd, h_prefix] =
      attnres::depth_attention_fwd(sources, query, gain, kEps, kScale);
  const at::Tensor grad_out = random_tensor(h.sizes(), at::kFloat);
  auto backward = [&](const at::Tensor& go, const at::Tensor& r,
                      const at::Tensor& w, const at::Tensor& out) {
    return [=] {
      backward_all(go, sources, query, gain, out, r, w, kScale);
    };
  };
  expect_error<c10::ValueError>(
      backward(random_tensor({5, D}, at::kFloat), rstd, weights, h),
      "grad_out must have the sources' shape");
  expect_error<c10::TypeError>(backward(grad_out.to(at::kDouble), rstd, weights, h),
                               "grad_out must have the sources' dtype");
  expect_error<c10::ValueError>(backward(grad_out, rstd.slice(0, 0, 2), weights, h),
                                "rstd must have shape [3, 4]");
  expect_error<c10::TypeError>(
      backward(grad_out, rstd, weights.to(at::kDouble), h),
      "weights must have dtype torch.float32");
  // The forward's h (saved for the single-pass backward): the sources'
  // shape and dtype.
  expect_error<c10::ValueError>(
      backward(grad_out, rstd, weights, h.slice(0, 0, 2)),
      "h (the forward's read) must have the sources' shape");
  expect_error<c10::TypeError>(
      backward(grad_out, rstd, weights, h.to(at::kDouble)),
      "h (the forward's read) must have the sources' dtype");
  // output_mask: N + 2 flags without out_weight, N + 3 with it.
  auto masked_backward = [&](const at::Tensor& out, const at::Tensor& r, const at::Tensor& w,
                             const c10::List<bool>& mask,
                             const std::optional<at::Tensor>& out_weight,
                             const std::optional<at::Tensor>& out_rstd) {
    return [=] {
      attnres::depth_attention_bwd(grad_out, std::nullopt, sources, query, gain, out, r, w,
                                   kScale, mask, out_weight, out_rstd);
    };
  };
  expect_error<c10::ValueError>(
      masked_backward(h, rstd, weights, c10::List<bool>({true, true, true, true}), std::nullopt,
                      std::nullopt),
      "output_mask must have N + 2 = 5 entries (each source, query, norm_weight), got 4");
  const at::Tensor out_weight = random_tensor({D}, at::kFloat);
  const attnres::DepthAttentionForward normed = attnres::depth_attention_fwd(
      sources, query, gain, kEps, kScale, out_weight, std::nullopt, /*keep_h=*/true);
  expect_error<c10::ValueError>(
      masked_backward(std::get<3>(normed), std::get<1>(normed), std::get<2>(normed),
                      c10::List<bool>({true, true, true, true, true}), out_weight,
                      std::get<4>(normed)),
      "output_mask must have N + 3 = 6 entries (each source, query, norm_weight, "
      "out_weight), got 5");
}

}  // namespace
