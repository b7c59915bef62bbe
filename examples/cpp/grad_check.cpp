// Checks attnres::depth_attention's C++ autograd against the same math
// written in plain ATen ops (docs/design.md §1), in float64:
//
//   rstd_i = 1 / sqrt(mean(v_i^2) + eps)       keys_i = v_i * rstd_i * gain
//   s_i = <keys_i, query>    a = softmax_i(s)   h = sum_i a_i * v_i
//
// Gradients of the sources, the query and the gain come from
// torch::autograd::grad on both; exits non-zero if the largest relative
// error max|ours - ref| / max|ref| over all of them exceeds 1e-10.
#include <attnres/ops.h>
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace {

at::Tensor reference_depth_attention(const std::vector<at::Tensor>& sources,
                                     const at::Tensor& query, const at::Tensor& gain,
                                     double eps) {
  const at::Tensor v = at::stack(sources);                                // [N, ..., D]
  const at::Tensor rstd = at::rsqrt(v.pow(2).mean(-1, /*keepdim=*/true) + eps);
  const at::Tensor keys = v * rstd * gain;
  const at::Tensor scores = (keys * query).sum(-1);                       // [N, ...]
  const at::Tensor weights = at::softmax(scores, /*dim=*/0);              // over depth
  return (weights.unsqueeze(-1) * v).sum(0);                              // [..., D]
}

}  // namespace

int main() {
  at::manual_seed(0);
  const int64_t N = 5, D = 16;
  const double eps = 1e-6;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);

  std::vector<at::Tensor> sources;
  for (int64_t i = 0; i < N; ++i) sources.push_back(at::randn({2, 3, D}, f64).requires_grad_());
  const at::Tensor query = (0.5 * at::randn({D}, f64)).requires_grad_();
  const at::Tensor gain = (0.5 + at::rand({D}, f64)).requires_grad_();
  const at::Tensor grad_h = at::randn({2, 3, D}, f64);

  std::vector<at::Tensor> inputs = sources;
  inputs.push_back(query);
  inputs.push_back(gain);
  const at::Tensor h = attnres::depth_attention(sources, query, gain, eps);
  const at::Tensor h_ref = reference_depth_attention(sources, query, gain, eps);
  const auto grads = torch::autograd::grad({h}, inputs, {grad_h});
  const auto grads_ref = torch::autograd::grad({h_ref}, inputs, {grad_h});

  auto rel_err = [](const at::Tensor& x, const at::Tensor& ref) {
    return (x - ref).abs().max().item<double>() / ref.abs().max().item<double>();
  };
  double worst = rel_err(h, h_ref);
  bool ok = worst <= 1e-10;  // (written so that a NaN fails)
  std::printf("h              rel err %.2e\n", worst);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string name = i < sources.size() ? "d sources[" + std::to_string(i) + "]"
                             : i == sources.size() ? std::string("d query")
                                                   : std::string("d gain");
    const double err = rel_err(grads[i], grads_ref[i]);
    std::printf("%-14s rel err %.2e\n", name.c_str(), err);
    worst = std::max(worst, err);
    ok = ok && err <= 1e-10;
  }
  std::printf("max relative error %.2e: %s\n", worst, ok ? "ok" : "FAILED (> 1e-10)");
  return ok ? 0 : 1;
}
