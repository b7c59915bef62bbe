// C++ tests of the C++ front end (<attnres/attnres.h>): autograd of
// attnres::depth_attention from C++, and the modules attnres::DepthStream and
// attnres::AttnResResidual against python/attnres/modules.py's rules and
// words (tests/python/test_modules.py checks the Python side the same way).
// References are plain ATen math in float64 (docs/design.md §1) and autograd
// on it; tolerances are the float64 row of tests/tolerances.txt.
#ifndef ATTNRES_TOLERANCES_FILE
#error "ATTNRES_TOLERANCES_FILE must name tests/tolerances.txt; CMakeLists.txt sets it"
#endif

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnres/attnres.h"

namespace {

using ::testing::HasSubstr;
using Tensors = std::vector<at::Tensor>;

// ---- helpers ----------------------------------------------------------------

// One column of the float64 row of tests/tolerances.txt (relative norm error
// allowed against float64 references): "output" or "grad".
double fp64_tolerance(const std::string& column) {
  std::ifstream in(ATTNRES_TOLERANCES_FILE);
  if (!in) throw std::runtime_error("cannot open " + std::string(ATTNRES_TOLERANCES_FILE));
  std::vector<std::string> header;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line.substr(0, line.find('#')));
    std::vector<std::string> row;
    for (std::string f; fields >> f;) row.push_back(f);
    if (row.empty()) continue;
    if (header.empty()) {
      header = row;
    } else if (row[0] == "float64") {
      const auto it = std::find(header.begin(), header.end(), column);
      if (it == header.end() || row.size() != header.size()) break;
      return std::stod(row[it - header.begin()]);
    }
  }
  throw std::runtime_error(std::string(ATTNRES_TOLERANCES_FILE) + ": no float64 '" + column +
                           "' entry");
}
const double kOutputTol = fp64_tolerance("output");
const double kGradTol = fp64_tolerance("grad");

double rel_err(const at::Tensor& actual, const at::Tensor& expected) {
  const at::Tensor a = actual.to(at::kDouble);
  const at::Tensor e = expected.to(at::kDouble);
  return (a - e).norm().item<double>() / std::max(e.norm().item<double>(), 1e-300);
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, double tol,
                  const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << " is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_LE(rel_err(actual, expected), tol) << what;
}

// The ATen composite in float64: rstd, keys, scores, softmax over the
// sources, weighted sum of the raw sources. Differentiable by autograd.
std::pair<at::Tensor, at::Tensor> composite(const Tensors& sources, const at::Tensor& query,
                                            const std::optional<at::Tensor>& gain,
                                            double eps = 1e-6, double scale = 1.0) {
  const at::Tensor v = at::stack(sources);  // [N, ..., D]
  at::Tensor keys = v * at::rsqrt(v.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (gain) keys = keys * *gain;
  const at::Tensor weights = at::softmax((keys * query).sum(-1) * scale, 0);
  return {(weights.unsqueeze(-1) * v).sum(0), weights};
}

Tensors leaves(int64_t n, at::IntArrayRef shape) {
  Tensors out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back((at::randn(shape, at::kDouble) * (0.5 + i % 3)).requires_grad_(true));
  }
  return out;
}

// The exception's message without the C++ backtrace.
template <typename Exception, typename Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception containing: " << needle;
  } catch (const Exception& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(needle));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type for '" << needle << "': " << e.what();
  }
}

// ---- autograd from C++ ----------------------------------------------------------

TEST(CppAutograd, GradientsOfSourcesQueryAndGainMatchAtenMath) {
  for (bool with_gain : {true, false}) {
    SCOPED_TRACE(with_gain ? "with gain" : "without gain");
    at::manual_seed(10);
    const int64_t D = 10;
    const Tensors sources = leaves(4, {2, 3, D});
    const at::Tensor query = (at::randn({D}, at::kDouble) * 0.5).requires_grad_(true);
    const at::Tensor gain = (at::rand({D}, at::kDouble) + 0.5).requires_grad_(true);
    const std::optional<at::Tensor> g = with_gain ? std::optional<at::Tensor>(gain) : std::nullopt;
    const at::Tensor grad_out = at::randn({2, 3, D}, at::kDouble);
    Tensors inputs = sources;
    inputs.push_back(query);
    if (with_gain) inputs.push_back(gain);

    const at::Tensor h = attnres::depth_attention(sources, query, g, 1e-6, 0.8);
    const Tensors grads = torch::autograd::grad({h}, inputs, {grad_out});
    const at::Tensor h_ref = composite(sources, query, g, 1e-6, 0.8).first;
    const Tensors ref = torch::autograd::grad({h_ref}, inputs, {grad_out});

    expect_close(h, h_ref, kOutputTol, "h");
    ASSERT_EQ(grads.size(), inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      ASSERT_GT(ref[i].abs().max().item<double>(), 0.0) << "trivial reference " << i;
      expect_close(grads[i], ref[i], kGradTol, "gradient of input " + std::to_string(i));
    }
  }
}

TEST(CppAutograd, FrozenInputsGetNoGradient) {
  at::manual_seed(11);
  const int64_t D = 6;
  Tensors sources = leaves(3, {4, D});
  sources[1] = sources[1].detach();  // frozen
  const at::Tensor query = at::randn({D}, at::kDouble);  // frozen
  const at::Tensor gain = (at::rand({D}, at::kDouble) + 0.5).requires_grad_(true);

  const at::Tensor h = attnres::depth_attention(sources, query, gain);
  ASSERT_TRUE(h.requires_grad());
  (h * at::randn_like(h)).sum().backward();
  EXPECT_TRUE(sources[0].grad().defined());
  EXPECT_FALSE(sources[1].grad().defined());
  EXPECT_TRUE(sources[2].grad().defined());
  EXPECT_FALSE(query.grad().defined());
  EXPECT_TRUE(gain.grad().defined());

  // Nothing trainable: no graph at all.
  const Tensors frozen = {sources[1], sources[1] * 2.0};
  EXPECT_FALSE(attnres::depth_attention(frozen, query, gain.detach()).requires_grad());
}

TEST(CppAutograd, DepthWeightsAreDifferentiable) {
  at::manual_seed(12);
  const int64_t D = 7;
  const Tensors sources = leaves(5, {3, D});
  const at::Tensor query = at::randn({D}, at::kDouble).requires_grad_(true);
  const at::Tensor gain = (at::rand({D}, at::kDouble) + 0.5).requires_grad_(true);
  Tensors inputs = sources;
  inputs.push_back(query);
  inputs.push_back(gain);
  const at::Tensor grad_w = at::randn({5, 3}, at::kDouble);
  const at::Tensor grad_h = at::randn({3, D}, at::kDouble);

  const auto [h, w] = attnres::depth_attention_with_weights(sources, query, gain);
  const auto [h_ref, w_ref] = composite(sources, query, gain);
  EXPECT_EQ(w.scalar_type(), at::kDouble);
  expect_close(w, w_ref, kOutputTol, "weights");
  // The weights alone, then h and the weights together.
  const Tensors g_w = torch::autograd::grad({w}, inputs, {grad_w}, /*retain_graph=*/true);
  const Tensors r_w = torch::autograd::grad({w_ref}, inputs, {grad_w}, /*retain_graph=*/true);
  const Tensors g_hw = torch::autograd::grad({h, w}, inputs, {grad_h, grad_w});
  const Tensors r_hw = torch::autograd::grad({h_ref, w_ref}, inputs, {grad_h, grad_w});
  for (size_t i = 0; i < inputs.size(); ++i) {
    expect_close(g_w[i], r_w[i], kGradTol, "weights only, input " + std::to_string(i));
    expect_close(g_hw[i], r_hw[i], kGradTol, "h and weights, input " + std::to_string(i));
  }
}

TEST(CppAutograd, DoubleBackwardRaises) {
  at::manual_seed(13);
  const Tensors sources = leaves(3, {2, 5});
  const at::Tensor query = at::randn({5}, at::kDouble).requires_grad_(true);
  const at::Tensor h = attnres::depth_attention(sources, query);
  const Tensors g = torch::autograd::grad({h.pow(2).sum()}, {query}, {}, /*retain_graph=*/true,
                                          /*create_graph=*/true);
  ASSERT_TRUE(g[0].requires_grad());
  try {
    g[0].sum().backward();
    ADD_FAILURE() << "double backward must raise";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("second derivatives of depth_attention are not implemented"));
  }
}

// ---- DepthStream: the Full / Block rule --------------------------------------

constexpr int64_t kOutputs = 11;

// Output j (0: the embedding) is (j + 1) * row * e_j: every sum of distinct
// outputs is a distinct tensor, exact in float32.
Tensors basis_outputs() {
  const at::Tensor rows = at::arange(1, 4, at::kFloat).view({3, 1});
  const at::Tensor eye = at::eye(kOutputs + 1, at::kFloat);
  Tensors out;
  for (int64_t j = 0; j <= kOutputs; ++j) out.push_back(rows * eye[j] * double(j + 1));
  return out;
}

at::Tensor sum_of(const std::vector<int>& group, const Tensors& basis) {
  at::Tensor s = at::zeros_like(basis[0]);
  for (int j : group) s = s + basis[j];
  return s;
}

// The rule, stated independently: the embedding, then outputs 1..n in
// consecutive chunks of S (Full: of one); the last chunk may be short (the
// partial sum) and an empty one is not listed.
std::vector<std::vector<int>> expected_groups(std::optional<int64_t> block_size, int n) {
  const int step = block_size ? static_cast<int>(*block_size) : 1;
  std::vector<std::vector<int>> groups = {{0}};
  for (int start = 1; start <= n; start += step) {
    std::vector<int> chunk;
    for (int j = start; j < start + step && j <= n; ++j) chunk.push_back(j);
    groups.push_back(chunk);
  }
  return groups;
}

class BlockRule : public ::testing::TestWithParam<std::optional<int64_t>> {};

TEST_P(BlockRule, SourcesAfterEachAppend) {
  const std::optional<int64_t> S = GetParam();
  const Tensors basis = basis_outputs();
  attnres::DepthStream stream(basis[0], S);
  ASSERT_EQ(stream.sources().size(), 1u);
  EXPECT_TRUE(stream.sources()[0].is_same(basis[0]));
  for (int j = 1; j <= kOutputs; ++j) {
    stream.append(basis[j]);
    const auto groups = expected_groups(S, j);
    const Tensors got = stream.sources();
    ASSERT_EQ(got.size(), groups.size()) << "after " << j << " outputs";
    EXPECT_EQ(stream.num_sources(), static_cast<int64_t>(groups.size()));
    EXPECT_EQ(stream.num_outputs(), j);
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_TRUE(at::equal(got[k], sum_of(groups[k], basis)))
          << "source " << k << " after " << j << " outputs";
    }
  }
}

// The sources after all 11 outputs, written out by hand (docs/design.md §1).
TEST_P(BlockRule, SourcesAfterElevenOutputsWrittenOutByHand) {
  const std::optional<int64_t> S = GetParam();
  const std::vector<std::vector<int>> full = {{0}, {1}, {2}, {3}, {4},  {5},
                                              {6}, {7}, {8}, {9}, {10}, {11}};
  std::vector<std::vector<int>> expected;
  if (!S || *S == 1) expected = full;
  if (S && *S == 2) expected = {{0}, {1, 2}, {3, 4}, {5, 6}, {7, 8}, {9, 10}, {11}};
  if (S && *S == 3) expected = {{0}, {1, 2, 3}, {4, 5, 6}, {7, 8, 9}, {10, 11}};
  if (S && *S == 5) expected = {{0}, {1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}, {11}};
  ASSERT_FALSE(expected.empty());
  const Tensors basis = basis_outputs();
  attnres::DepthStream stream(basis[0], S);
  for (int j = 1; j <= kOutputs; ++j) stream.append(basis[j]);
  const Tensors got = stream.sources();
  ASSERT_EQ(got.size(), expected.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_TRUE(at::equal(got[k], sum_of(expected[k], basis))) << "source " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(FullAndBlock, BlockRule,
                         ::testing::Values(std::nullopt, 1, 2, 3, 5),
                         [](const ::testing::TestParamInfo<std::optional<int64_t>>& info) {
                           return info.param ? "Block" + std::to_string(*info.param)
                                             : std::string("Full");
                         });

TEST(DepthStream, FullKeepsTheAppendedTensorsThemselves) {
  const at::Tensor emb = at::randn({2, 4});
  const Tensors outs = {at::randn({2, 4}), at::randn({2, 4}), at::randn({2, 4})};
  attnres::DepthStream stream(emb);
  for (const auto& f : outs) stream.append(f);
  const Tensors got = stream.sources();
  ASSERT_EQ(got.size(), 4u);
  EXPECT_TRUE(got[0].is_same(emb));
  for (size_t i = 0; i < outs.size(); ++i) EXPECT_TRUE(got[i + 1].is_same(outs[i]));
}

TEST(DepthStream, AccessorsAndPrinting) {
  attnres::DepthStream stream(at::randn({2, 5, 8}), 2);
  stream.append(at::randn({2, 5, 8}));
  EXPECT_EQ(stream.width(), 8);
  EXPECT_EQ(stream.shape(), at::IntArrayRef({2, 5, 8}));
  EXPECT_EQ(stream.dtype(), at::kFloat);
  EXPECT_EQ(stream.device(), at::Device(at::kCPU));
  EXPECT_EQ(stream.block_size(), std::optional<int64_t>(2));
  EXPECT_EQ(stream.num_outputs(), 1);
  EXPECT_FALSE(attnres::DepthStream(at::randn({3})).block_size().has_value());
  std::ostringstream text;
  text << stream;
  EXPECT_EQ(text.str(),
            "DepthStream(Block(S=2), shape=[2, 5, 8], dtype=torch.float32, outputs=1, sources=2)");
}

TEST(DepthStream, SourcesIsAFreshListAndCloneIsIndependent) {
  attnres::DepthStream stream(at::randn({2, 4}), 2);
  stream.append(at::randn({2, 4}));
  Tensors listed = stream.sources();
  listed.push_back(at::randn({2, 4}));
  EXPECT_EQ(stream.num_sources(), 2);

  const Tensors before = stream.sources();
  attnres::DepthStream copy = stream.clone();
  copy.append(at::randn({2, 4}));
  copy.append(at::randn({2, 4}));
  EXPECT_EQ(copy.num_sources(), 3);
  EXPECT_EQ(copy.num_outputs(), 3);
  const Tensors after = stream.sources();
  ASSERT_EQ(after.size(), 2u);
  EXPECT_EQ(stream.num_outputs(), 1);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].is_same(before[i]));
}

// Sets CPU autocast for one scope and restores it.
class CpuAutocast {
 public:
  explicit CpuAutocast(at::ScalarType dtype)
      : was_enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
        old_dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, old_dtype_);
    at::autocast::clear_cache();
  }

 private:
  bool was_enabled_;
  at::ScalarType old_dtype_;
};

TEST(DepthStream, UnderAutocastOutputsAreCastToTheStreamDtype) {
  at::manual_seed(14);
  const int64_t D = 8;
  const at::Tensor emb = at::randn({3, D});
  const at::Tensor weight = at::randn({D, D});
  attnres::DepthStream stream(emb, 2);
  attnres::AttnResResidual read(D);
  at::Tensor f, h;
  {
    CpuAutocast autocast(at::kBFloat16);
    f = at::linear(emb, weight);
    ASSERT_EQ(f.scalar_type(), at::kBFloat16);
    stream.append(f);
    stream.append(f);
    h = read(stream);
  }
  for (const auto& s : stream.sources()) EXPECT_EQ(s.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(stream.sources()[1], f.to(at::kFloat) + f.to(at::kFloat)));
  EXPECT_EQ(h.scalar_type(), at::kFloat);
  // Outside autocast the same output is an error.
  expect_error<c10::TypeError>([&] { stream.append(f); },
                               "output has dtype torch.bfloat16 but the stream's dtype");
}

// ---- DepthStream: bad input ------------------------------------------------------

TEST(DepthStreamErrors, BlockSizeMustBePositive) {
  for (int64_t bad : {0, -3}) {
    expect_error<c10::ValueError>(
        [&] { attnres::DepthStream(at::randn({2, 8}), bad); },
        "block_size must be None (Full AttnRes) or a positive int S (Block AttnRes), got " +
            std::to_string(bad));
  }
}

TEST(DepthStreamErrors, BadEmbedding) {
  expect_error<c10::TypeError>([] { attnres::DepthStream{at::Tensor()}; },
                               "embedding must be a tensor [..., D], got an undefined tensor");
  expect_error<c10::ValueError>([] { attnres::DepthStream(at::randn({2, 0})); },
                                "embedding must have shape [..., D] with D > 0, got [2, 0]");
  expect_error<c10::ValueError>([] { attnres::DepthStream(at::randn({}, at::kFloat)); },
                                "embedding must have shape [..., D] with D > 0, got []");
  expect_error<c10::TypeError>([] { attnres::DepthStream(at::ones({2, 8}, at::kLong)); },
                               "embedding must be a floating-point tensor, got torch.int64");
}

TEST(DepthStreamErrors, AppendOfAnotherShapeDtypeOrDevice) {
  attnres::DepthStream stream(at::randn({2, 8}));
  expect_error<c10::ValueError>(
      [&] { stream.append(at::randn({2, 9})); },
      "DepthStream.append: output has shape [2, 9] but the stream's embedding has shape [2, 8]");
  expect_error<c10::ValueError>([&] { stream.append(at::randn({1, 2, 8})); },
                                "output has shape [1, 2, 8]");
  expect_error<c10::TypeError>(
      [&] { stream.append(at::randn({2, 8}, at::kDouble)); },
      "DepthStream.append: output has dtype torch.float64 but the stream's dtype (its "
      "embedding's) is torch.float32; outside torch.autocast every output must have the "
      "stream dtype");
  expect_error<c10::ValueError>(
      [&] { stream.append(at::empty({2, 8}, at::TensorOptions().device(at::kMeta))); },
      "DepthStream.append: output is on device meta but the stream is on device cpu");
  expect_error<c10::TypeError>([&] { stream.append(at::Tensor()); },
                               "DepthStream.append expects a tensor, got an undefined tensor");
  EXPECT_EQ(stream.num_outputs(), 0);
  EXPECT_EQ(stream.num_sources(), 1);
}

// ---- AttnResResidual ------------------------------------------------------------

std::vector<std::string> parameter_names(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& item : m.named_parameters()) names.push_back(item.key());
  return names;
}

TEST(AttnResResidual, ParametersAndInitialValues) {
  attnres::AttnResResidual read(8);
  EXPECT_EQ(parameter_names(*read), (std::vector<std::string>{"query", "norm_weight"}));
  EXPECT_TRUE(at::equal(read->query, at::zeros({8})));
  EXPECT_TRUE(at::equal(read->norm_weight, at::ones({8})));
  EXPECT_TRUE(read->query.requires_grad());
  EXPECT_TRUE(read->norm_weight.requires_grad());
  EXPECT_EQ(read->options.eps(), 1e-6);

  attnres::AttnResResidual plain(
      attnres::AttnResResidualOptions(8).eps(1e-5).key_norm_affine(false).dtype(at::kDouble));
  EXPECT_EQ(parameter_names(*plain), (std::vector<std::string>{"query"}));
  EXPECT_FALSE(plain->norm_weight.defined());
  EXPECT_EQ(plain->query.scalar_type(), at::kDouble);
  EXPECT_EQ(plain->options.eps(), 1e-5);

  std::ostringstream text;
  text << *read;
  EXPECT_EQ(text.str(), "attnres::AttnResResidual(dim=8, eps=1e-06, key_norm_affine=true)");
}

TEST(AttnResResidual, ForwardIsDepthAttentionOnTheSources) {
  at::manual_seed(15);
  const int64_t D = 8;
  attnres::DepthStream stream(at::randn({2, 3, D}, at::kDouble), 3);
  for (int i = 0; i < 4; ++i) stream.append(at::randn({2, 3, D}, at::kDouble));
  for (bool affine : {true, false}) {
    SCOPED_TRACE(affine ? "with gain" : "without gain");
    attnres::AttnResResidual read(attnres::AttnResResidualOptions(D)
                                      .key_norm_affine(affine)
                                      .eps(1e-5)
                                      .dtype(at::kDouble));
    {
      torch::NoGradGuard no_grad;
      read->query.normal_();
      if (affine) read->norm_weight.uniform_(0.5, 1.5);
    }
    const std::optional<at::Tensor> gain =
        affine ? std::optional<at::Tensor>(read->norm_weight) : std::nullopt;
    const at::Tensor h = read(stream);
    EXPECT_TRUE(at::equal(h, attnres::depth_attention(stream.sources(), read->query, gain, 1e-5)));
    const auto [h_ref, w_ref] = composite(stream.sources(), read->query, gain, 1e-5);
    expect_close(h, h_ref, kOutputTol, "h");
    const auto [h2, w] = read->forward_with_weights(stream);
    EXPECT_TRUE(at::equal(h2, h));
    EXPECT_EQ(w.sizes(), at::IntArrayRef({3, 2, 3}));  // e, f1+f2+f3, f4
    expect_close(w, w_ref, kOutputTol, "weights");
  }
}

TEST(AttnResResidual, ZeroQueryReadsTheMeanOfTheSources) {
  at::manual_seed(16);
  attnres::DepthStream stream(at::randn({4, 6, 8}, at::kDouble), 2);
  for (int i = 0; i < 5; ++i) stream.append(at::randn({4, 6, 8}, at::kDouble));
  attnres::AttnResResidual read(attnres::AttnResResidualOptions(8).dtype(at::kDouble));
  expect_close(read(stream), at::stack(stream.sources()).mean(0), kOutputTol, "h");
}

// docs/design.md §1: e=[2,0,0], f1=[0,4,0], f2=[0,0,6], eps 0,
// query [0, ln2/sqrt3, 0] gives weights [1/4, 1/2, 1/4] and h = [0.5, 2, 1.5].
TEST(AttnResResidual, WorkedExampleFromTheDesign) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  attnres::DepthStream stream(at::tensor({2.0, 0.0, 0.0}, f64));
  stream.append(at::tensor({0.0, 4.0, 0.0}, f64));
  stream.append(at::tensor({0.0, 0.0, 6.0}, f64));
  attnres::AttnResResidual read(attnres::AttnResResidualOptions(3).eps(0.0).dtype(at::kDouble));
  {
    torch::NoGradGuard no_grad;
    read->query.copy_(at::tensor({0.0, std::log(2.0) / std::sqrt(3.0), 0.0}, f64));
  }
  const auto [h, w] = read->forward_with_weights(stream);
  expect_close(w, at::tensor({0.25, 0.5, 0.25}, f64), kOutputTol, "weights");
  expect_close(h, at::tensor({0.5, 2.0, 1.5}, f64), kOutputTol, "h");
}

TEST(AttnResResidual, CloneCopiesTheParameters) {
  attnres::AttnResResidual read(4);
  {
    torch::NoGradGuard no_grad;
    read->query.fill_(0.5);
  }
  const auto copy = std::dynamic_pointer_cast<attnres::AttnResResidualImpl>(read->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(at::equal(copy->query, read->query));
  EXPECT_FALSE(copy->query.is_same(read->query));
  EXPECT_EQ(parameter_names(*copy), parameter_names(*read));
}

TEST(AttnResResidualErrors, BadOptionsAndWidth) {
  for (int64_t bad : {0, -1}) {
    expect_error<c10::ValueError>([&] { attnres::AttnResResidual{bad}; },
                                  "dim must be a positive int (the model width D), got " +
                                      std::to_string(bad));
  }
  expect_error<c10::ValueError>(
      [] { attnres::AttnResResidual(attnres::AttnResResidualOptions(8).eps(-1e-6)); },
      "eps must be a finite number >= 0, got -1e-06");
  expect_error<c10::ValueError>(
      [] { attnres::AttnResResidual(attnres::AttnResResidualOptions(8).eps(INFINITY)); },
      "eps must be a finite number >= 0");
  attnres::DepthStream stream(at::randn({2, 8}));
  attnres::AttnResResidual wide(16);
  expect_error<c10::ValueError>(
      [&] { wide(stream); },
      "AttnResResidual has width dim = 16 but the DepthStream has width D = 8");
}

// ---- a small network: the modules vs the same network tracked by hand -------

constexpr int64_t kD = 8;
constexpr int kDepth = 7;  // sublayers; 2 and 3 do not divide it

// kDepth sublayers f_l = tanh(W_l rmsnorm(h_l)), each read through its own
// AttnResResidual, plus the final read (fp64, non-trivial queries and gains).
struct TinyNetImpl : torch::nn::Module {
  explicit TinyNetImpl(std::optional<int64_t> block_size) : block_size(block_size) {
    for (int l = 0; l < kDepth; ++l) {
      layers.push_back(register_module(
          "layer" + std::to_string(l),
          torch::nn::Linear(torch::nn::LinearOptions(kD, kD))));
    }
    for (int l = 0; l <= kDepth; ++l) {
      reads.push_back(register_module("read" + std::to_string(l),
                                      attnres::AttnResResidual(kD)));
    }
    to(at::kDouble);
    torch::NoGradGuard no_grad;
    for (auto& r : reads) {
      r->query.normal_();
      r->norm_weight.uniform_(0.5, 1.5);
    }
  }

  at::Tensor sublayer(int l, const at::Tensor& h) {
    return at::tanh(layers[l](h * at::rsqrt(h.pow(2).mean(-1, true) + 1e-6)));
  }

  at::Tensor forward(const at::Tensor& emb) {
    attnres::DepthStream stream(emb, block_size, block_reads, reads);
    for (int l = 0; l < kDepth; ++l) stream.append(sublayer(l, reads[l](stream)));
    return reads[kDepth](stream);
  }

  // The same network with the sources tracked by hand and read through the
  // ATen composite (no DepthStream, no fused op).
  at::Tensor forward_reference(const at::Tensor& emb) {
    const int64_t S = block_size.value_or(1);
    Tensors completed = {emb};
    at::Tensor partial;
    int64_t in_partial = 0;
    auto read = [&](const attnres::AttnResResidual& r) {
      Tensors sources = completed;
      if (partial.defined()) sources.push_back(partial);
      return composite(sources, r->query, r->norm_weight).first;
    };
    for (int l = 0; l < kDepth; ++l) {
      const at::Tensor f = sublayer(l, read(reads[l]));
      partial = partial.defined() ? partial + f : f;
      if (++in_partial == S) {
        completed.push_back(partial);
        partial = at::Tensor();
        in_partial = 0;
      }
    }
    return read(reads[kDepth]);
  }

  std::optional<int64_t> block_size;
  attnres::BlockReads block_reads = attnres::BlockReads::kAuto;
  std::vector<torch::nn::Linear> layers;
  std::vector<attnres::AttnResResidual> reads;
};
TORCH_MODULE(TinyNet);

class TinyNetVsReference : public ::testing::TestWithParam<std::optional<int64_t>> {};

TEST_P(TinyNetVsReference, OutputAndEveryGradient) {
  at::manual_seed(0);
  TinyNet net(GetParam());
  const at::Tensor emb = at::randn({3, 5, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor grad_out = at::randn({3, 5, kD}, at::kDouble);
  Tensors inputs = {emb};
  for (const auto& p : net->parameters()) inputs.push_back(p);
  ASSERT_EQ(inputs.size(), 1u + 2 * kDepth + 2 * (kDepth + 1));

  const at::Tensor out = net(emb);
  const Tensors grads = torch::autograd::grad({out}, inputs, {grad_out});
  const at::Tensor ref = net->forward_reference(emb);
  const Tensors ref_grads = torch::autograd::grad({ref}, inputs, {grad_out});

  expect_close(out, ref, kOutputTol, "output");
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i == 1 + 2 * kDepth || i == 2 + 2 * kDepth) {
      // The first read has one source (the embedding): its weight is 1 whatever
      // the query, so its query and gain gradients are exactly zero.
      EXPECT_EQ(grads[i].count_nonzero().item<int64_t>(), 0) << "input " << i;
      EXPECT_EQ(ref_grads[i].count_nonzero().item<int64_t>(), 0) << "input " << i;
      continue;
    }
    ASSERT_GT(ref_grads[i].abs().max().item<double>(), 0.0) << "trivial reference " << i;
    expect_close(grads[i], ref_grads[i], kGradTol, "gradient of input " + std::to_string(i));
  }
}

INSTANTIATE_TEST_SUITE_P(FullAndBlock, TinyNetVsReference,
                         ::testing::Values(std::nullopt, 1, 2, 3),
                         [](const ::testing::TestParamInfo<std::optional<int64_t>>& info) {
                           return info.param ? "Block" + std::to_string(*info.param)
                                             : std::string("Full");
                         });

TEST(TinyNet, BlockSizeOneEqualsFull) {
  at::manual_seed(1);
  TinyNet full(std::nullopt);
  at::manual_seed(1);
  TinyNet block(1);
  const at::Tensor emb = at::randn({4, kD}, at::kDouble);
  const at::Tensor grad_out = at::randn({4, kD}, at::kDouble);
  const at::Tensor out_full = full(emb);
  const at::Tensor out_block = block(emb);
  EXPECT_TRUE(at::equal(out_full, out_block));
  const Tensors g_full = torch::autograd::grad({out_full}, full->parameters(), {grad_out});
  const Tensors g_block = torch::autograd::grad({out_block}, block->parameters(), {grad_out});
  ASSERT_EQ(g_full.size(), g_block.size());
  for (size_t i = 0; i < g_full.size(); ++i) EXPECT_TRUE(at::equal(g_full[i], g_block[i])) << i;
}

// ---- two-phase Block reads (docs/design.md §10) ------------------------------------

TEST(TwoPhaseBlockReads, OpsEqualTheOneCallRead) {
  at::manual_seed(5);
  const Tensors completed = leaves(3, {4, 6, kD});
  const at::Tensor block_sum = at::randn({4, 6, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor queries = at::randn({3, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor gains = (at::rand({3, kD}, at::kDouble) + 0.5).requires_grad_(true);
  auto [partials, lse] = attnres::block_reads(completed, queries, gains);
  ASSERT_EQ(partials.size(), 3u);
  at::Tensor loss = partials[0].sum();
  at::Tensor ref_loss = composite(completed, queries[0], gains[0]).first.sum();
  Tensors with_block = completed;
  with_block.push_back(block_sum);
  for (int64_t r = 1; r < 3; ++r) {
    const at::Tensor h = attnres::block_read_merge(partials[r], lse[r], block_sum, queries[r],
                                                   gains[r]);
    const at::Tensor ref = composite(with_block, queries[r], gains[r]).first;
    expect_close(h, ref, kOutputTol, "merged read " + std::to_string(r));
    loss = loss + h.pow(2).sum();
    ref_loss = ref_loss + ref.pow(2).sum();
  }
  Tensors inputs = completed;
  inputs.push_back(block_sum);
  inputs.push_back(queries);
  inputs.push_back(gains);
  const Tensors grads = torch::autograd::grad({loss}, inputs);
  const Tensors ref_grads = torch::autograd::grad({ref_loss}, inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    expect_close(grads[i], ref_grads[i], kGradTol, "gradient of input " + std::to_string(i));
  }
}

TEST(TwoPhaseBlockReads, ModulesWithDeclaredReadersEqualOneCallReads) {
  for (int64_t S : {2, 3, 4}) {
    SCOPED_TRACE("S=" + std::to_string(S));
    at::manual_seed(6);
    TinyNet net(S);
    const at::Tensor emb = at::randn({3, 5, kD}, at::kDouble).requires_grad_(true);
    const at::Tensor grad_out = at::randn({3, 5, kD}, at::kDouble);
    Tensors inputs = {emb};
    for (const auto& p : net->parameters()) inputs.push_back(p);
    net->block_reads = attnres::BlockReads::kOneCall;
    const at::Tensor want = net(emb);
    const Tensors want_grads = torch::autograd::grad({want}, inputs, {grad_out});
    net->block_reads = attnres::BlockReads::kTwoPhase;
    // The net declares its readers: the final read (position 7 % S > 0 of
    // its block) merges from the first pass.
    const at::Tensor got = net(emb);
    EXPECT_THAT(got.grad_fn()->name(), HasSubstr("MergeFunction"));
    const Tensors got_grads = torch::autograd::grad({got}, inputs, {grad_out});
    expect_close(got, want, kOutputTol, "output");
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!want_grads[i].defined() || want_grads[i].count_nonzero().item<int64_t>() == 0) continue;
      expect_close(got_grads[i], want_grads[i], kGradTol, "gradient of input " + std::to_string(i));
    }
  }
}

TEST(TwoPhaseBlockReads, InferenceMergesInPlaceWithTheSameResult) {
  torch::NoGradGuard no_grad;
  at::manual_seed(8);
  TinyNet net(3);
  const at::Tensor emb = at::randn({2, 5, kD}, at::kDouble);
  net->block_reads = attnres::BlockReads::kOneCall;
  const at::Tensor want = net(emb);
  net->block_reads = attnres::BlockReads::kTwoPhase;
  const at::Tensor got = net(emb);
  expect_close(got, want, kOutputTol, "output");
  // The in-place merge refuses inputs that want a gradient under grad mode.
  torch::AutoGradMode grad_mode(true);
  const Tensors completed = leaves(2, {3, kD});
  const at::Tensor queries = at::randn({2, kD}, at::kDouble);
  auto [partials, lse] = attnres::block_reads(completed, queries);
  const at::Tensor query = queries[1].clone().requires_grad_(true);
  expect_error<c10::Error>(
      [&] {
        attnres::block_read_merge_inplace(partials[1].detach().clone(), lse[1].detach(),
                                          completed[0].detach(), query);
      },
      "block_read_merge_inplace has no derivative");
}

// The fused prefix add's tests: a read's output and P', then the gradients
// of a loss on both with respect to `inputs`.
Tensors outputs_and_grads(const at::Tensor& out, const at::Tensor& P_next, const at::Tensor& w_out,
                          const at::Tensor& w_sum, const Tensors& inputs) {
  Tensors result = torch::autograd::grad({(out * w_out).sum() + (P_next * w_sum).sum()}, inputs);
  result.insert(result.begin(), {out, P_next});
  return result;
}

// run(true) (the fused read) equals run(false) (add, then read) bit for bit,
// and no compared tensor is all zeros.
void expect_fused_is_unfused(const std::function<Tensors(bool)>& run) {
  const Tensors got = run(true), want = run(false);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_GT(want[i].count_nonzero().item<int64_t>(), 0) << i;
    EXPECT_TRUE(at::equal(got[i], want[i])) << i;
  }
}

std::vector<attnres::AttnResResidual> fp64_readers(int n) {
  std::vector<attnres::AttnResResidual> readers;
  for (int i = 0; i < n; ++i) {
    readers.emplace_back(attnres::AttnResResidualOptions(kD).dtype(at::kDouble));
  }
  return readers;
}

// The fused prefix add (docs/design.md §12): the merge with delta is
// torch.add then the plain merge, bit for bit, forward and gradients, and
// the stream's deferred add is settled by anything that reads its sources.
TEST(TwoPhaseBlockReads, FusedPrefixAddIsAddThenMergeBitForBit) {
  at::manual_seed(21);
  const Tensors completed = leaves(3, {4, 6, kD});
  const at::Tensor queries = at::randn({2, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor gains = (at::rand({2, kD}, at::kDouble) + 0.5).requires_grad_(true);
  const at::Tensor P = at::randn({4, 6, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor delta = at::randn({4, 6, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor w_out = at::randn({4, 6, kD}, at::kDouble);
  const at::Tensor w_sum = at::randn({4, 6, kD}, at::kDouble);
  Tensors inputs = completed;
  for (const auto& t : {queries, gains, P, delta}) inputs.push_back(t);
  auto run = [&](bool fused) {
    auto [partials, lse] = attnres::block_reads(completed, queries, gains);
    at::Tensor out, P_next;
    if (fused) {
      auto result = attnres::block_read_merge_fwd(partials[1], lse[1], P, queries[1], gains[1],
                                                  1e-6, 1.0, std::nullopt, std::nullopt, false,
                                                  delta);
      out = std::get<0>(result);
      P_next = std::get<5>(result);
    } else {
      P_next = P + delta;
      out = attnres::block_read_merge(partials[1], lse[1], P_next, queries[1], gains[1]);
    }
    return outputs_and_grads(out, P_next, w_out, w_sum, inputs);
  };
  expect_fused_is_unfused(run);
  // The stream defers f2 into the next read; sources() and a copy see it.
  std::vector<attnres::AttnResResidual> readers = fp64_readers(3);
  attnres::DepthStream stream(at::randn({2, kD}, at::kDouble), 4, attnres::BlockReads::kTwoPhase,
                              readers);
  const at::Tensor f1 = at::randn({2, kD}, at::kDouble), f2 = at::randn({2, kD}, at::kDouble);
  readers[0](stream);
  stream.append(f1);
  readers[1](stream);
  stream.append(f2);
  const attnres::DepthStream copy = stream;
  EXPECT_TRUE(at::equal(stream.sources().back(), f1 + f2));
  EXPECT_TRUE(at::equal(copy.sources().back(), f1 + f2));
  EXPECT_EQ(stream.num_sources(), 2);
  // With a graph: the read after f2 takes it in its merge, so the partial
  // sum it leaves is the merge's P' output (not an add's), equal to f1 + f2.
  const at::Tensor g1 = at::randn({2, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor g2 = at::randn({2, kD}, at::kDouble).requires_grad_(true);
  attnres::DepthStream trained(at::randn({2, kD}, at::kDouble), 4,
                               attnres::BlockReads::kTwoPhase, readers);
  readers[0](trained);
  trained.append(g1 * 1.0);
  readers[1](trained);
  trained.append(g2 * 1.0);
  readers[2](trained);
  const at::Tensor partial = trained.sources().back();
  EXPECT_THAT(partial.grad_fn()->name(), HasSubstr("MergeFunction"));
  EXPECT_TRUE(at::equal(partial, g1 + g2));
}

// The one-call read with delta: add then read, bit for bit (forward and
// gradients); a one-call stream's read after a deferred output takes it
// (its partial sum is the read's P' output).
TEST(TwoPhaseBlockReads, FusedPrefixAddIsAddThenOneCallReadBitForBit) {
  at::manual_seed(22);
  const Tensors sources = leaves(3, {4, 6, kD});
  const at::Tensor query = at::randn({kD}, at::kDouble).requires_grad_(true);
  const at::Tensor gain = (at::rand({kD}, at::kDouble) + 0.5).requires_grad_(true);
  const at::Tensor out_weight = (at::rand({kD}, at::kDouble) + 0.5).requires_grad_(true);
  const at::Tensor delta = at::randn({4, 6, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor w_out = at::randn({4, 6, kD}, at::kDouble);
  const at::Tensor w_sum = at::randn({4, 6, kD}, at::kDouble);
  Tensors inputs = sources;
  for (const auto& t : {query, gain, out_weight, delta}) inputs.push_back(t);
  auto run = [&](bool fused) {
    at::Tensor out, P_next;
    if (fused) {
      auto result = attnres::depth_attention_fwd(sources, query, gain, 1e-6, 1.0, out_weight,
                                                 std::nullopt, false, delta);
      out = std::get<0>(result);
      P_next = std::get<5>(result);
    } else {
      P_next = sources[2] + delta;
      out = attnres::depth_attention({sources[0], sources[1], P_next}, query, gain, 1e-6, 1.0,
                                     out_weight);
    }
    return outputs_and_grads(out, P_next, w_out, w_sum, inputs);
  };
  expect_fused_is_unfused(run);
  std::vector<attnres::AttnResResidual> readers = fp64_readers(3);
  const at::Tensor g1 = at::randn({2, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor g2 = at::randn({2, kD}, at::kDouble).requires_grad_(true);
  attnres::DepthStream stream(at::randn({2, kD}, at::kDouble), 4, attnres::BlockReads::kOneCall,
                              readers);
  // A stream without declared readers defers the same way.
  attnres::DepthStream undeclared(at::randn({2, kD}, at::kDouble), 4);
  for (attnres::DepthStream* s : {&stream, &undeclared}) {
    readers[0](*s);
    s->append(g1 * 1.0);
    readers[1](*s);
    s->append(g2 * 1.0);
    readers[2](*s);
    const at::Tensor partial = s->sources().back();
    EXPECT_THAT(partial.grad_fn()->name(), HasSubstr("DepthAttentionFunction"));
    EXPECT_TRUE(at::equal(partial, g1 + g2));
  }
}

// kAuto reads two-phase from the third completed source on, the reads
// autograd records too (fp64 here); a bf16 stream keeps those one-call (its
// merge backward would take <dh, P - y> from a partial output rounded to
// 8 bits, docs/design.md §10).
TEST(TwoPhaseBlockReads, AutoMergesTrainingReadsFromTheThirdCompletedSource) {
  at::manual_seed(6);
  TinyNet net(2);
  ASSERT_EQ(net->block_reads, attnres::BlockReads::kAuto);
  const at::Tensor emb = at::randn({3, 5, kD}, at::kDouble).requires_grad_(true);
  const at::Tensor grad_out = at::randn({3, 5, kD}, at::kDouble);
  Tensors inputs = {emb};
  for (const auto& p : net->parameters()) inputs.push_back(p);
  net->block_reads = attnres::BlockReads::kOneCall;
  const at::Tensor want = net(emb);
  const Tensors want_grads = torch::autograd::grad({want}, inputs, {grad_out});
  net->block_reads = attnres::BlockReads::kAuto;
  // The final read, position 1 of the block with 4 completed sources, merges.
  const at::Tensor got = net(emb);
  EXPECT_THAT(got.grad_fn()->name(), HasSubstr("MergeFunction"));
  const Tensors got_grads = torch::autograd::grad({got}, inputs, {grad_out});
  expect_close(got, want, kOutputTol, "output");
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!want_grads[i].defined() || want_grads[i].count_nonzero().item<int64_t>() == 0) continue;
    expect_close(got_grads[i], want_grads[i], kGradTol, "gradient of input " + std::to_string(i));
  }
  // S = 4: the final read's block has 2 completed sources, so it reads one-call.
  TinyNet four(4);
  four(emb);
  EXPECT_THAT(four(emb).grad_fn()->name(), HasSubstr("DepthAttentionFunction"));
  // A bf16 stream: one-call under grad mode, two-phase with kTwoPhase.
  net->to(at::kBFloat16);
  const at::Tensor emb16 = emb.detach().to(at::kBFloat16).requires_grad_(true);
  EXPECT_THAT(net(emb16).grad_fn()->name(), HasSubstr("DepthAttentionFunction"));
  net->block_reads = attnres::BlockReads::kTwoPhase;
  EXPECT_THAT(net(emb16).grad_fn()->name(), HasSubstr("MergeFunction"));
}

// Calls of each op by name on this thread (RecordFunction sees every
// dispatcher call while the callback is registered).
thread_local std::map<std::string, int> op_calls;
std::unique_ptr<at::ObserverContext> count_op_call(const at::RecordFunction& fn) {
  ++op_calls[fn.name()];
  return nullptr;
}

// Without grad mode kAuto reads one-call while a source holds at most 2^18
// elements (decode sizes), two-phase from one more, as in Python.
TEST(TwoPhaseBlockReads, AutoReadsDecodeSizedInferenceOneCall) {
  at::manual_seed(16);
  TinyNet net(2);
  ASSERT_EQ(net->block_reads, attnres::BlockReads::kAuto);
  const at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(count_op_call).scopes({at::RecordScope::FUNCTION}));
  const int64_t decode_rows = (int64_t{1} << 18) / kD;
  for (const int64_t rows : {int64_t{1}, decode_rows, decode_rows + 1}) {
    for (const bool inference : {false, true}) {
      SCOPED_TRACE(std::to_string(rows) + (inference ? " rows, inference mode" : " rows, no_grad"));
      c10::InferenceMode inference_mode(inference);
      torch::NoGradGuard no_grad;
      const at::Tensor emb = at::randn({rows, kD}, at::kDouble);
      op_calls.clear();
      const at::Tensor got = net(emb);
      // Blocks with 3 and 4 completed sources read two-phase or not at all
      // (outside inference mode the autograd kernel's redispatch records too).
      EXPECT_EQ(op_calls["attnres::block_reads_fwd"] > 0, rows > decode_rows);
      net->block_reads = attnres::BlockReads::kOneCall;
      expect_close(got, net(emb), kOutputTol, "auto vs one-call");
      net->block_reads = attnres::BlockReads::kAuto;
    }
  }
  at::removeCallback(handle);
}

TEST(TwoPhaseBlockReads, StreamReportsItsMode) {
  const at::Tensor emb = at::randn({2, kD});
  EXPECT_EQ(attnres::DepthStream(emb, 2).block_reads(), attnres::BlockReads::kAuto);
  EXPECT_EQ(attnres::DepthStream(emb, 2, attnres::BlockReads::kOneCall).block_reads(),
            attnres::BlockReads::kOneCall);
  expect_error<c10::ValueError>(
      [&] { attnres::DepthStream(emb, 2, attnres::BlockReads::kTwoPhase); },
      "block_reads='two_phase' needs the stream's readers declared");
}

// The declared order is checked at every read; without readers a Block
// stream reads one call (the same result).
TEST(TwoPhaseBlockReads, ReadsFollowTheDeclaredReadersOrReadOneCall) {
  at::manual_seed(12);
  TinyNet net(3);
  const at::Tensor emb = at::randn({2, 5, kD}, at::kDouble);
  std::vector<attnres::AttnResResidual> swapped = net->reads;
  std::swap(swapped[0], swapped[1]);
  attnres::DepthStream stream(emb, 3, attnres::BlockReads::kAuto, swapped);
  expect_error<c10::ValueError>(
      [&] { net->reads[0](stream); },
      "DepthStream: the read after 0 outputs is not the one the stream's readers declare there "
      "(reader 0 of the declared list)");
  attnres::DepthStream plain(emb, 3, attnres::BlockReads::kAuto);
  for (int l = 0; l < kDepth; ++l) plain.append(net->sublayer(l, net->reads[l](plain)));
  EXPECT_THAT(net->reads[kDepth](plain).grad_fn()->name(), HasSubstr("DepthAttentionFunction"));
}

// Grad mode is honoured per read: a block whose phase 1 ran under no_grad
// reads one call with grad (the gradients of the one-call read); a read under
// no_grad after a phase 1 with grad has no graph.
TEST(TwoPhaseBlockReads, GradModeIsHonouredPerRead) {
  at::manual_seed(13);
  TinyNet net(3);
  net->block_reads = attnres::BlockReads::kTwoPhase;
  const at::Tensor emb = at::randn({2, 5, kD}, at::kDouble).requires_grad_(true);
  for (const bool first_with_grad : {false, true}) {
    SCOPED_TRACE(first_with_grad ? "phase 1 with grad" : "phase 1 under no_grad");
    attnres::DepthStream stream(emb, 3, attnres::BlockReads::kTwoPhase, net->reads);
    attnres::DepthStream reference(emb, 3, attnres::BlockReads::kOneCall);
    at::Tensor h0;
    {
      torch::AutoGradMode mode(first_with_grad);
      h0 = net->reads[0](stream);
    }
    EXPECT_EQ(h0.requires_grad(), first_with_grad);
    const at::Tensor f = at::tanh(emb * 0.5);
    stream.append(f);
    reference.append(f);
    at::Tensor h1;
    {
      torch::AutoGradMode mode(!first_with_grad);
      h1 = net->reads[1](stream);
    }
    EXPECT_EQ(h1.requires_grad(), !first_with_grad);
    if (!first_with_grad) {
      EXPECT_THAT(h1.grad_fn()->name(), HasSubstr("DepthAttentionFunction"));
      const at::Tensor want = net->reads[1](reference);
      expect_close(h1, want, kOutputTol, "read 1");
      const Tensors got_g =
          torch::autograd::grad({h1.sum()}, {emb, net->reads[1]->query}, {}, true);
      const Tensors want_g = torch::autograd::grad({want.sum()}, {emb, net->reads[1]->query});
      expect_close(got_g[0], want_g[0], kGradTol, "embedding gradient");
      expect_close(got_g[1], want_g[1], kGradTol, "query gradient");
    } else {
      EXPECT_THAT(h0.grad_fn()->name(), HasSubstr("BlockReadsFunction"));
      torch::NoGradGuard no_grad;
      expect_close(h1, net->reads[1](reference), kOutputTol, "read 1 (merged under no_grad)");
    }
  }
  // Phase 1 under inference mode, a later read under plain no_grad: merged
  // out of place (an inference tensor cannot be written outside it).
  attnres::DepthStream stream(emb.detach(), 3, attnres::BlockReads::kTwoPhase, net->reads);
  attnres::DepthStream reference(emb.detach(), 3, attnres::BlockReads::kOneCall);
  {
    c10::InferenceMode inference;
    net->reads[0](stream);
  }
  const at::Tensor f = at::tanh(emb.detach());
  stream.append(f);
  reference.append(f);
  torch::NoGradGuard no_grad;
  expect_close(net->reads[1](stream), net->reads[1](reference), kOutputTol,
               "read after an inference-mode phase 1");
}

// A stream rebuilt from its parts (the next pipeline stage) reads as the
// stream that was never split.
TEST(TwoPhaseBlockReads, FromSourcesRebuildsAStreamMidBlock) {
  at::manual_seed(14);
  TinyNet net(3);
  const at::Tensor emb = at::randn({4, kD}, at::kDouble);
  attnres::DepthStream whole(emb, 3);
  Tensors outs;
  for (int i = 0; i < 5; ++i) {
    outs.push_back(at::randn({4, kD}, at::kDouble));
    whole.append(outs.back());
  }
  const auto part = attnres::DepthStream::from_sources(emb, {outs[0] + outs[1] + outs[2]},
                                                       outs[3] + outs[4], 3, 2);
  EXPECT_EQ(part.num_outputs(), 5);
  EXPECT_EQ(part.partial_count(), 2);
  expect_close(net->reads[5](part), net->reads[5](whole), kOutputTol, "read after the split");
  expect_error<c10::ValueError>(
      [&] { attnres::DepthStream::from_sources(emb, {}, outs[0], 3, 0); },
      "partial and partial_count go together");
  expect_error<c10::ValueError>(
      [&] { attnres::DepthStream::from_sources(emb, {}, outs[0], 3, 3); },
      "partial_count must be in [0, block_size) = [0, 3)");
  expect_error<c10::ValueError>(
      [&] { attnres::DepthStream::from_sources(emb, {}, outs[0], std::nullopt, 1); },
      "a Full stream");
}

// block_storage: the block sums written into the rows of one buffer give
// every read of a stream without storage bit for bit, in each read mode, and
// the completed blocks' sources are the rows themselves.
TEST(BlockStorage, ReadsEqualAStreamWithoutStorageAndSourcesAreTheRows) {
  at::manual_seed(15);
  TinyNet net(3);
  const at::Tensor emb = at::randn({2, 5, kD}, at::kDouble);
  for (const auto mode : {attnres::BlockReads::kAuto, attnres::BlockReads::kTwoPhase,
                          attnres::BlockReads::kOneCall}) {
    for (const bool inference : {false, true}) {
      SCOPED_TRACE(inference ? "inference mode" : "no_grad");
      c10::InferenceMode inference_mode(inference);
      torch::NoGradGuard no_grad;
      const at::Tensor storage = at::full({3, 2, 5, kD}, NAN, at::kDouble);
      attnres::DepthStream plain(emb, 3, mode, net->reads);
      attnres::DepthStream stored(emb, 3, mode, net->reads, storage);
      EXPECT_TRUE(stored.block_storage().is_same(storage));
      for (int l = 0; l <= kDepth; ++l) {
        const at::Tensor want = net->reads[l](plain);
        const at::Tensor got = net->reads[l](stored);
        EXPECT_TRUE(at::equal(got, want)) << "read " << l;
        if (l == kDepth) break;
        const at::Tensor f = net->sublayer(l, want);
        plain.append(f);
        stored.append(f);
        // A block's row is written once, when the block completes.
        EXPECT_EQ(storage[l / 3].isnan().all().item<bool>(), (l + 1) % 3 != 0) << "output " << l;
      }
      const Tensors sources = stored.sources();
      ASSERT_EQ(sources.size(), 4u);  // the embedding, two blocks, a partial sum of one
      for (size_t k = 1; k < 3; ++k) {
        EXPECT_EQ(sources[k].data_ptr(), storage[k - 1].data_ptr()) << "source " << k;
      }
      // The block in progress is not written into its row.
      EXPECT_TRUE(storage[2].isnan().all().item<bool>());
    }
  }
}

// Copies share the rows: once one writes a block, the other refuses to go on.
TEST(BlockStorage, CopiesShareTheRowsAndOnlyOneMayGoOn) {
  torch::NoGradGuard no_grad;
  attnres::AttnResResidual read(kD);
  attnres::DepthStream stream(at::randn({3, kD}), 2, attnres::BlockReads::kAuto, {},
                              at::empty({2, 3, kD}));
  stream.append(at::randn({3, kD}));
  attnres::DepthStream copy = stream.clone();
  copy.append(at::randn({3, kD}));
  read(copy);
  const std::string words = "another stream sharing this stream's block_storage (a clone) has "
                            "written a block into the rows since";
  expect_error<c10::ValueError>([&] { stream.sources(); }, words);
  expect_error<c10::ValueError>([&] { read(stream); }, words);
  expect_error<c10::ValueError>([&] { stream.append(at::randn({3, kD})); }, words);
  expect_error<c10::ValueError>([&] { stream.clone(); }, words);
}

// Bad storage is refused with the Python class's words.
TEST(BlockStorage, BadStorageIsRefusedWithItsReason) {
  const at::Tensor emb = at::randn({2, 4});
  auto make = [&](std::optional<int64_t> S, const at::Tensor& storage) {
    attnres::DepthStream(emb, S, attnres::BlockReads::kAuto, {}, storage);
  };
  expect_error<c10::ValueError>([&] { make(std::nullopt, at::empty({1, 2, 4})); },
                                "block_storage is for Block streams");
  expect_error<c10::ValueError>(
      [&] { make(2, at::empty({2, 2, 5})); },
      "block_storage must have shape [R, 2, 4] (rows, then the embedding's shape) with R >= 1, "
      "got [2, 2, 5]");
  expect_error<c10::ValueError>([&] { make(2, at::empty({0, 2, 4})); }, "with R >= 1, got");
  expect_error<c10::TypeError>([&] { make(2, at::empty({2, 2, 4}, at::kDouble)); },
                               "block_storage has dtype torch.float64 but the stream's dtype");
  expect_error<c10::ValueError>([&] { make(2, at::empty({2, 2, 4}, at::Device("meta"))); },
                                "block_storage is on device meta but the stream is on device cpu");
  expect_error<c10::ValueError>([&] { make(2, at::empty({2, 4, 2}).transpose(1, 2)); },
                                "block_storage must be contiguous");
  expect_error<c10::ValueError>([&] { make(2, at::empty({2, 2, 4}).requires_grad_(true)); },
                                "block_storage must not require grad");
  const at::Tensor buf = at::empty({3, 2, 4});
  expect_error<c10::ValueError>(
      [&] { attnres::DepthStream(buf[1], 2, attnres::BlockReads::kAuto, {}, buf); },
      "block_storage must not share memory with the embedding");
  attnres::DepthStream beside(buf[0], 2, attnres::BlockReads::kAuto, {}, buf.slice(0, 1));
  // Too few rows, and an output that needs a gradient under grad mode.
  attnres::DepthStream one_row(emb, 2, attnres::BlockReads::kAuto, {}, at::empty({1, 2, 4}));
  {
    torch::NoGradGuard no_grad;
    one_row.append(at::randn({2, 4}));
    one_row.append(at::randn({2, 4}));
    expect_error<c10::ValueError>([&] { one_row.append(at::randn({2, 4})); },
                                  "block_storage has 1 rows but output 3 belongs to block 2");
  }
  EXPECT_EQ(one_row.num_outputs(), 2);
  const at::Tensor w = at::randn({2, 4}).requires_grad_(true);
  attnres::DepthStream training(emb, 2, attnres::BlockReads::kAuto, {}, at::empty({1, 2, 4}));
  expect_error<c10::ValueError>([&] { training.append(w * 2); },
                                "writes its blocks in place and is for inference");
  // A read whose parameters need a gradient would save views of the rows.
  attnres::AttnResResidual read(4);
  expect_error<c10::ValueError>([&] { read(training); },
                                "a read of a stream with block_storage under grad mode");
  expect_error<c10::ValueError>([&] { read->forward_with_weights(training); },
                                "a read of a stream with block_storage under grad mode");
  {
    torch::NoGradGuard no_grad;
    read(training);
  }
  // An inference tensor as storage, outside inference mode.
  at::Tensor made_in_inference;
  {
    c10::InferenceMode inference;
    made_in_inference = at::empty({2, 2, 4});
    make(2, made_in_inference);
  }
  expect_error<c10::ValueError>([&] { make(2, made_in_inference); },
                                "block_storage is an inference tensor");
}

// A CUDA stream reads two-phase when asked (kTwoPhase), training included:
// its output and every gradient equal the one-call reads'; kAuto reads
// one-call on CUDA (docs/design.md §10).
TEST(TwoPhaseBlockReads, CudaReadsTwoPhaseWhenAsked) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device (none visible)";
  at::manual_seed(9);
  TinyNet net(2);
  net->to(at::kCUDA);
  const at::Tensor emb =
      at::randn({2, 5, kD}, at::TensorOptions(at::kDouble).device(at::kCUDA)).requires_grad_(true);
  const at::Tensor grad_out = at::randn({2, 5, kD}, emb.options());
  Tensors inputs = {emb};
  for (const auto& p : net->parameters()) inputs.push_back(p);
  net->block_reads = attnres::BlockReads::kOneCall;
  const at::Tensor want = net(emb);
  const Tensors want_grads = torch::autograd::grad({want}, inputs, {grad_out});
  net->block_reads = attnres::BlockReads::kTwoPhase;
  const at::Tensor got = net(emb);
  EXPECT_THAT(got.grad_fn()->name(), HasSubstr("MergeFunction"));
  const Tensors got_grads = torch::autograd::grad({got}, inputs, {grad_out});
  expect_close(got.cpu(), want.cpu(), kOutputTol, "CUDA two-phase output");
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!want_grads[i].defined() || want_grads[i].count_nonzero().item<int64_t>() == 0) continue;
    expect_close(got_grads[i].cpu(), want_grads[i].cpu(), kGradTol,
                 "gradient of input " + std::to_string(i));
  }
  {
    torch::NoGradGuard no_grad;
    expect_close(net(emb).cpu(), want.cpu(), kOutputTol, "CUDA two-phase inference");
  }
  net->block_reads = attnres::BlockReads::kAuto;
  EXPECT_THAT(net(emb).grad_fn()->name(), HasSubstr("DepthAttentionFunction"));
}

// Phase 2's backward on CUDA (plain and normed), through the C++ autograd:
// every gradient equals the CPU's (float64), and a second run gives the same
// bits (fixed-order sums of the query and out-weight gradients).
TEST(TwoPhaseBlockReads, CudaMergeBackwardMatchesTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device (none visible)";
  at::manual_seed(11);
  const Tensors completed = leaves(3, {4, 6, kD});
  const at::Tensor queries = at::randn({2, kD}, at::kDouble);
  Tensors phase1;
  {
    torch::NoGradGuard no_grad;
    auto [partials, lse] = attnres::block_reads(completed, queries, std::nullopt);
    phase1 = {partials[1], lse[1]};
  }
  const at::Tensor block_sum = at::randn({4, 6, kD}, at::kDouble);
  const at::Tensor gain = at::rand({kD}, at::kDouble) + 0.5;
  const at::Tensor out_weight = at::rand({kD}, at::kDouble) + 0.5;
  const at::Tensor grad = at::randn({4, 6, kD}, at::kDouble);
  for (bool normed : {false, true}) {
    SCOPED_TRACE(normed ? "normed" : "plain");
    auto run = [&](at::Device device) {
      Tensors in;
      for (const at::Tensor& t : {phase1[0], phase1[1], block_sum, queries[1], gain, out_weight}) {
        in.push_back(t.to(device, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true));
      }
      const at::Tensor out =
          normed ? attnres::block_read_merge(in[0], in[1], in[2], in[3], in[4], 1e-6, 1.0, in[5])
                 : attnres::block_read_merge(in[0], in[1], in[2], in[3], in[4]);
      if (!normed) in.pop_back();
      return torch::autograd::grad({out}, in, {grad.to(device)});
    };
    const Tensors want = run(at::kCPU);
    const Tensors got = run(at::kCUDA);
    const Tensors again = run(at::kCUDA);
    for (size_t i = 0; i < want.size(); ++i) {
      expect_close(got[i].cpu(), want[i], kGradTol, "gradient of input " + std::to_string(i));
      EXPECT_TRUE(at::equal(got[i], again[i])) << "input " << i << " differs between two runs";
    }
  }
}

// ---- training --------------------------------------------------------------------

TEST(Training, AFewAdamStepsReduceTheLoss) {
  for (std::optional<int64_t> S : {std::optional<int64_t>(), std::optional<int64_t>(2)}) {
    SCOPED_TRACE(S ? "Block S=2" : "Full");
    at::manual_seed(2);
    TinyNet net(S);
    const at::Tensor x = at::randn({64, kD}, at::kDouble);
    const at::Tensor target = at::sin(x.flip(-1) * 2.0);
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
    std::vector<double> losses;
    for (int step = 0; step < 30; ++step) {
      opt.zero_grad();
      const at::Tensor loss = (net(x) - target).pow(2).mean();
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
    EXPECT_LT(losses.back(), 0.7 * losses.front())
        << "loss " << losses.front() << " -> " << losses.back();
    // The reads learned: queries of reads with more than one source moved.
    EXPECT_GT(net->reads[kDepth]->query.grad().abs().max().item<double>(), 0.0);
  }
}

}  // namespace

// ---- the read with a fused output norm (docs/design.md §11) -------------------

TEST(OutNorm, NormedReadAndItsGradientsMatchAtenMath) {
  for (bool with_gain : {true, false}) {
    SCOPED_TRACE(with_gain ? "with gain" : "without gain");
    at::manual_seed(21);
    const int64_t D = 12;
    const Tensors sources = leaves(5, {2, 3, D});
    const at::Tensor query = (at::randn({D}, at::kDouble) * 0.5).requires_grad_(true);
    const at::Tensor gain = (at::rand({D}, at::kDouble) + 0.5).requires_grad_(true);
    const at::Tensor out_weight = (at::rand({D}, at::kDouble) + 0.5).requires_grad_(true);
    const std::optional<at::Tensor> g = with_gain ? std::optional<at::Tensor>(gain) : std::nullopt;
    const at::Tensor grad_out = at::randn({2, 3, D}, at::kDouble);
    Tensors inputs = sources;
    inputs.push_back(query);
    if (with_gain) inputs.push_back(gain);
    inputs.push_back(out_weight);

    const at::Tensor y =
        attnres::depth_attention(sources, query, g, 1e-6, 0.8, out_weight, 1e-5);
    const Tensors grads = torch::autograd::grad({y}, inputs, {grad_out});
    const at::Tensor h_ref = composite(sources, query, g, 1e-6, 0.8).first;
    const at::Tensor y_ref = at::rms_norm(h_ref, {D}, out_weight, 1e-5);
    const Tensors ref = torch::autograd::grad({y_ref}, inputs, {grad_out});

    expect_close(y, y_ref, kOutputTol, "y");
    for (size_t i = 0; i < inputs.size(); ++i) {
      ASSERT_GT(ref[i].abs().max().item<double>(), 0.0) << "trivial reference " << i;
      expect_close(grads[i], ref[i], kGradTol, "gradient of input " + std::to_string(i));
    }
  }
}

TEST(OutNorm, RawOpsKeepHOnlyWhenAskedAndComputeOnlyTheMaskedGradients) {
  at::manual_seed(22);
  const int64_t D = 9;
  Tensors sources;
  for (int i = 0; i < 3; ++i) sources.push_back(at::randn({4, D}, at::kDouble));
  const at::Tensor query = at::randn({D}, at::kDouble);
  const at::Tensor w = at::rand({D}, at::kDouble) + 0.5;
  const auto [y, rstd, weights, h, out_rstd, y_prefix] =
      attnres::depth_attention_fwd(sources, query, std::nullopt, 1e-6, 1.0, w, 1e-6, true);
  const auto [y2, rstd2, weights2, no_h, out_rstd2, y2_prefix] =
      attnres::depth_attention_fwd(sources, query, std::nullopt, 1e-6, 1.0, w, 1e-6, false);
  EXPECT_EQ(no_h.numel(), 0);
  EXPECT_TRUE(at::equal(y, y2));
  EXPECT_TRUE(at::equal(h, attnres::depth_attention(sources, query, std::nullopt, 1e-6, 1.0)));
  EXPECT_EQ(out_rstd.sizes(), at::IntArrayRef({4}));
  // out_eps follows eps when absent (an eps large enough to show in y).
  const auto follows =
      attnres::depth_attention_fwd(sources, query, std::nullopt, 0.5, 1.0, w, std::nullopt, false);
  const auto same =
      attnres::depth_attention_fwd(sources, query, std::nullopt, 0.5, 1.0, w, 0.5, false);
  const auto other =
      attnres::depth_attention_fwd(sources, query, std::nullopt, 0.5, 1.0, w, 1e-6, false);
  EXPECT_TRUE(at::equal(std::get<0>(follows), std::get<0>(same)));
  EXPECT_TRUE(at::equal(std::get<4>(follows), std::get<4>(same)));
  EXPECT_FALSE(at::allclose(std::get<0>(follows), std::get<0>(other)));
  const at::Tensor dy = at::randn({4, D}, at::kDouble);
  c10::List<bool> all({true, true, true, true, true, true});
  c10::List<bool> only_w({false, false, false, false, false, true});
  const auto every = attnres::depth_attention_bwd(dy, std::nullopt, sources, query,
                                                  std::nullopt, h, rstd, weights, 1.0, all, w,
                                                  out_rstd);
  const auto some = attnres::depth_attention_bwd(dy, std::nullopt, sources, query,
                                                 std::nullopt, h, rstd, weights, 1.0, only_w, w,
                                                 out_rstd);
  EXPECT_EQ(std::get<0>(every).size(), 3u);
  EXPECT_TRUE(std::get<0>(some).empty());
  EXPECT_FALSE(std::get<1>(some).defined());
  EXPECT_TRUE(at::equal(std::get<3>(some), std::get<3>(every)));
  expect_error<c10::ValueError>(
      [&] {
        attnres::depth_attention_fwd(sources, query, std::nullopt, 1e-6, 1.0,
                                     at::ones({D + 1}, at::kDouble), 1e-6, false);
      },
      "out_weight must have shape [D]");
}

TEST(OutNorm, ModuleReadsAreTheNormOfThePlainReadsInFullAndBlock) {
  const int64_t D = 8;
  for (std::optional<int64_t> S : {std::optional<int64_t>(), std::optional<int64_t>(3)}) {
    for (auto mode : {attnres::BlockReads::kAuto, attnres::BlockReads::kTwoPhase}) {
      SCOPED_TRACE(S ? "Block" : "Full");
      at::manual_seed(23);
      std::vector<attnres::AttnResResidual> plain, normed;
      for (int i = 0; i < 8; ++i) {
        plain.emplace_back(attnres::AttnResResidualOptions(D).dtype(at::kDouble));
        normed.emplace_back(attnres::AttnResResidualOptions(D)
                                .dtype(at::kDouble)
                                .out_norm(attnres::OutNorm::kRMSNorm)
                                .out_eps(1e-5));
        torch::NoGradGuard no_grad;
        plain.back()->query.normal_();
        normed.back()->query.copy_(plain.back()->query);
        normed.back()->out_weight.uniform_(0.5, 1.5);
      }
      const Tensors outputs = [&] {
        Tensors o;
        for (int i = 0; i < 8; ++i) o.push_back(at::randn({2, 3, D}, at::kDouble));
        return o;
      }();
      attnres::DepthStream a(outputs[0], S, mode, plain), b(outputs[0], S, mode, normed);
      for (int i = 0; i < 8; ++i) {
        const at::Tensor h = plain[i](a);
        const at::Tensor y = normed[i](b);
        expect_close(y, at::rms_norm(h, {D}, normed[i]->out_weight, 1e-5), kOutputTol, "y");
        a.append(outputs[i] * 0.5 + h * 0.1);
        b.append(outputs[i] * 0.5 + h * 0.1);
      }
    }
  }
  attnres::AttnResResidual res(
      attnres::AttnResResidualOptions(D).out_norm(attnres::OutNorm::kRMSNorm));
  EXPECT_EQ(parameter_names(*res),
            (std::vector<std::string>{"query", "norm_weight", "out_weight"}));
  EXPECT_TRUE(at::equal(res->out_weight, at::ones({D})));
  std::ostringstream text;
  text << *res;
  EXPECT_EQ(text.str(),
            "attnres::AttnResResidual(dim=8, eps=1e-06, key_norm_affine=true, "
            "out_norm=rmsnorm, out_eps=1e-06)");
  expect_error<c10::ValueError>(
      [&] {
        attnres::AttnResResidual{attnres::AttnResResidualOptions(D).out_eps(-1.0)};
      },
      "out_eps must be a finite number >= 0");
}

// Two-phase reads of normed readers fuse the norm into phase 1 (reader 0)
// and into the merges (docs/design.md §11): same outputs and gradients as
// one-call normed reads, training and inference.
TEST(OutNorm, TwoPhaseReadsFuseTheNormAndEqualOneCallReads) {
  const int64_t D = 8, S = 3;
  at::manual_seed(29);
  std::vector<attnres::AttnResResidual> readers;
  for (int i = 0; i < 8; ++i) {
    readers.emplace_back(attnres::AttnResResidualOptions(D)
                             .dtype(at::kDouble)
                             .out_norm(attnres::OutNorm::kRMSNorm)
                             .out_eps(1e-5));
    torch::NoGradGuard no_grad;
    readers.back()->query.normal_();
    readers.back()->out_weight.uniform_(0.5, 1.5);
  }
  const at::Tensor emb = at::randn({2, 3, D}, at::kDouble).requires_grad_(true);
  Tensors inputs = {emb};
  for (auto& r : readers) {
    for (const auto& p : r->parameters()) inputs.push_back(p);
  }
  auto run = [&](attnres::BlockReads mode, std::vector<std::string>* fns) {
    attnres::DepthStream stream(emb, S, mode, readers);
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (int i = 0; i < 8; ++i) {
      const at::Tensor y = readers[i](stream);
      if (fns && y.grad_fn()) fns->push_back(y.grad_fn()->name());
      loss = loss + y.pow(2).sum();
      stream.append(at::tanh(y));
    }
    return loss;
  };
  const at::Tensor want = run(attnres::BlockReads::kOneCall, nullptr);
  const Tensors want_grads = torch::autograd::grad({want}, inputs);
  std::vector<std::string> fns;
  const at::Tensor got = run(attnres::BlockReads::kTwoPhase, &fns);
  const Tensors got_grads = torch::autograd::grad({got}, inputs);
  ASSERT_EQ(fns.size(), 8u);
  for (size_t i = 0; i < fns.size(); ++i) {
    EXPECT_THAT(fns[i], HasSubstr(i % S == 0 ? "BlockReadsFunction" : "MergeFunction"))
        << "read " << i;
  }
  expect_close(got, want, kOutputTol, "loss");
  for (size_t i = 0; i < inputs.size(); ++i) {
    expect_close(got_grads[i], want_grads[i], kGradTol, "gradient of input " + std::to_string(i));
  }
  {
    torch::NoGradGuard no_grad;
    expect_close(run(attnres::BlockReads::kTwoPhase, nullptr),
                 run(attnres::BlockReads::kOneCall, nullptr), kOutputTol, "inference loss");
  }
  // The in-place merge with out_weight refuses inputs that want a gradient
  // (here out_weight itself).
  const Tensors completed = leaves(2, {3, D});
  auto [partials, lse] = attnres::block_reads(completed, at::randn({2, D}, at::kDouble));
  expect_error<c10::Error>(
      [&] {
        attnres::block_read_merge_inplace(
            partials[1].detach().clone(), lse[1].detach(), completed[0].detach(),
            at::zeros({D}, at::kDouble), std::nullopt, 1e-6, 1.0, readers[0]->out_weight);
      },
      "attnres::block_read_merge_inplace has no derivative");
}

// The CPU gradient cache (attnres/gradient_cache.h) from C++: freed source
// gradients and forward outputs are handed out again to the next call, with
// the same bits as with the cache off; the limit and empty work
// (tests/python/test_gradient_cache.py covers the rest from Python).
TEST(CpuGradientCache, ReusesFreedGradientsWithTheSameBits) {
  const int64_t before = attnres::cpu_gradient_cache_stats().limit_bytes;
  at::manual_seed(12);
  const int64_t D = 512;  // [600, 512] float32: 1.17 MiB per gradient and for h
  std::vector<at::Tensor> sources;
  for (int i = 0; i < 3; ++i) sources.push_back(at::randn({600, D}).requires_grad_(true));
  const at::Tensor query = (at::randn({D}) * 0.05).requires_grad_(true);
  const at::Tensor dh = at::randn({600, D});
  std::vector<const void*> kept_ptrs;  // blocks of the first call, freed
  auto grads = [&](bool record) {
    const at::Tensor h = attnres::depth_attention(sources, query);
    if (record) kept_ptrs.push_back(h.data_ptr());
    return torch::autograd::grad({h}, sources, {dh});
  };

  attnres::set_cpu_gradient_cache_limit(0);
  const auto off = grads(false);
  attnres::set_cpu_gradient_cache_limit(int64_t(64) << 20);
  const int64_t hits0 = attnres::cpu_gradient_cache_stats().hits;
  {
    const auto first = grads(true);
    for (const auto& g : first) kept_ptrs.push_back(g.data_ptr());
  }
  EXPECT_EQ(attnres::cpu_gradient_cache_stats().cached_blocks, 4);  // h and 3 gradients
  const auto second = grads(false);
  EXPECT_EQ(attnres::cpu_gradient_cache_stats().hits - hits0, 4);
  for (size_t i = 0; i < second.size(); ++i) {
    EXPECT_TRUE(at::equal(second[i], off[i])) << "source " << i;
    EXPECT_NE(std::find(kept_ptrs.begin(), kept_ptrs.end(), second[i].data_ptr()),
              kept_ptrs.end());
  }
  attnres::empty_cpu_gradient_cache();
  EXPECT_EQ(attnres::cpu_gradient_cache_stats().cached_bytes, 0);
  EXPECT_THROW(attnres::set_cpu_gradient_cache_limit(-1), c10::ValueError);
  attnres::set_cpu_gradient_cache_limit(before);
}
