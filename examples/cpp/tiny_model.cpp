// A tiny model with Attention Residuals, in C++ only (LibTorch + attnres).
//
//   token embedding -> kDepth PreNorm MLP sublayers, each reading the depth
//   stream through its own attnres::AttnResResidual -> a final read ->
//   LayerNorm -> linear head
//
// trained with Adam on a synthetic task (label = (7 * token + 3) mod kVocab),
// once with Full AttnRes and once with Block AttnRes (S = 2). Prints the
// losses and the final read's depth weights; exits non-zero unless the loss
// goes down in both.
#include <attnres/attnres.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int64_t kVocab = 32, kWidth = 32, kDepth = 6;
constexpr int64_t kBatch = 32, kSeq = 8, kSteps = 40;

// One PreNorm sublayer. Where a standard block does x = x + mlp(norm(x)),
// this one reads the stream (a learned softmax over depth) and returns its
// new output f; the caller appends f to the stream (never x + f).
struct MlpSublayerImpl : torch::nn::Module {
  explicit MlpSublayerImpl(int64_t width)
      : read(register_module("read", attnres::AttnResResidual(width))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, width))) {}

  at::Tensor forward(const attnres::DepthStream& stream) {
    return fc2(at::gelu(fc1(norm(read(stream)))));
  }

  attnres::AttnResResidual read;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MlpSublayer);

struct TinyModelImpl : torch::nn::Module {
  // block_size: std::nullopt for Full AttnRes, S for Block AttnRes.
  explicit TinyModelImpl(std::optional<int64_t> block_size) : block_size(block_size) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kWidth));
    for (int64_t l = 0; l < kDepth; ++l) {
      sublayers.push_back(register_module("sublayer" + std::to_string(l), MlpSublayer(kWidth)));
    }
    final_read = register_module("final_read", attnres::AttnResResidual(kWidth));
    final_norm = register_module("final_norm",
                                 torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    head = register_module("head", torch::nn::Linear(kWidth, kVocab));
  }

  // The sources after every sublayer: the embedding and each output (Full),
  // or the embedding, the block sums and the current partial sum (Block).
  attnres::DepthStream stream_of(const at::Tensor& tokens) {
    attnres::DepthStream stream(embed(tokens), block_size);
    for (auto& sublayer : sublayers) stream.append(sublayer(stream));
    return stream;
  }

  at::Tensor forward(const at::Tensor& tokens) {  // logits [B, T, kVocab]
    return head(final_norm(final_read(stream_of(tokens))));
  }

  std::optional<int64_t> block_size;
  torch::nn::Embedding embed{nullptr};
  std::vector<MlpSublayer> sublayers;
  attnres::AttnResResidual final_read{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyModel);

// Trains one model; returns true when the loss went down (last < half the first).
bool train(const char* name, std::optional<int64_t> block_size) {
  torch::manual_seed(0);
  TinyModel model(block_size);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
  double first = 0.0, last = 0.0;
  for (int64_t step = 0; step < kSteps; ++step) {
    const at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq});
    const at::Tensor labels = (tokens * 7 + 3).remainder(kVocab);
    const at::Tensor logits = model(tokens);
    const at::Tensor loss = at::cross_entropy_loss(logits.view({-1, kVocab}), labels.view({-1}));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    last = loss.item<double>();
    if (step == 0) first = last;
    if (step % 10 == 0 || step == kSteps - 1) {
      std::printf("%-22s step %2lld  loss %.4f\n", name, static_cast<long long>(step), last);
    }
  }

  // What the final read looks at: its depth weights, averaged over tokens.
  torch::NoGradGuard no_grad;
  const attnres::DepthStream stream = model->stream_of(at::randint(kVocab, {kBatch, kSeq}));
  const auto [h, weights] = model->final_read->forward_with_weights(stream);  // [sources, B, T]
  const at::Tensor mean = weights.mean({1, 2});
  std::printf("%-22s final read over %lld sources:", name,
              static_cast<long long>(stream.num_sources()));
  for (int64_t i = 0; i < mean.size(0); ++i) std::printf(" %.3f", mean[i].item<double>());
  std::printf("\n");

  const bool ok = last < 0.5 * first;
  std::printf("%-22s loss %.4f -> %.4f: %s\n", name, first, last, ok ? "down" : "NOT DOWN");
  return ok;
}

}  // namespace

int main() {
  const bool full = train("Full AttnRes", std::nullopt);
  const bool block = train("Block AttnRes (S=2)", 2);
  return full && block ? 0 : 1;
}
