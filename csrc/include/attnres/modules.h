// C++ drop-in modules for Attention Residuals, the counterparts of
// python/attnres/modules.py with the same rules and error words
// (docs/design.md §1, §3). A PreNorm block normally does
// `x = x + f(norm(x))`; with AttnRes the outputs are kept apart in a
// DepthStream and every sublayer reads them through its own AttnResResidual:
//
//   attnres::DepthStream stream(tok_emb, /*block_size=*/std::nullopt);  // or S
//   for (auto& blk : blocks) {
//     stream.append(blk->attn(blk->ln1(blk->res_attn(stream))));
//     stream.append(blk->mlp(blk->ln2(blk->res_mlp(stream))));
//   }
//   at::Tensor x = final_res(stream);
//
// Include <attnres/attnres.h> (this header and ops.h); link attnres::attnres.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <tuple>
#include <vector>

namespace attnres {

class DepthStream;

// How the reads of a Block stream with declared readers run (docs/design.md
// §10; without readers every read is one call): kAuto uses the
// two-phase ops for blocks with at least 3 completed sources (where they
// move fewer bytes than one-call reads) on CPU, training included, except
// bf16/fp16 streams under grad mode (their merge backward would take
// <dh, P - y> from a partial output rounded to 8/11 bits) and reads without
// grad mode of sources of at most 2^18 elements (decode sizes, where the
// sources stay in cache and host work dominates); kTwoPhase for
// every block on CPU, training included; kOneCall never. CUDA streams read
// two-phase only under kTwoPhase (training included): kAuto keeps one-call
// reads on CUDA (on an H200 two-phase was slower than one-call at S = 2).
enum class BlockReads { kAuto, kTwoPhase, kOneCall };

namespace detail {
struct BlockReadState;  // shared by a stream and its copies (modules.cpp)
}


// The output norm a read can carry (docs/design.md §11): none, or
// RMSNorm(h) * out_weight fused into the read (the sublayer's pre-norm).
enum class OutNorm { kNone, kRMSNorm };

// Options of AttnResResidual (torch::nn style):
//   attnres::AttnResResidual res(attnres::AttnResResidualOptions(512).eps(1e-6));
struct AttnResResidualOptions {
  /* implicit */ AttnResResidualOptions(int64_t dim) : dim_(dim) {}

  // The model width D.
  TORCH_ARG(int64_t, dim);
  // Inside the RMS of the keys' norm; finite and >= 0.
  TORCH_ARG(double, eps) = 1e-6;
  // Whether the keys' RMSNorm has a learned gain (the parameter norm_weight).
  TORCH_ARG(bool, key_norm_affine) = true;
  // kRMSNorm: the read returns RMSNorm(h) * out_weight (eps out_eps), the
  // norm fused into the read's kernels; use it instead of the sublayer's
  // own pre-norm.
  TORCH_ARG(OutNorm, out_norm) = OutNorm::kNone;
  // Inside the RMS of the output norm; finite and >= 0.
  TORCH_ARG(double, out_eps) = 1e-6;
  // dtype and device of the parameters (default: torch's default dtype, CPU);
  // module->to(...) moves them later as for any torch::nn module.
  TORCH_ARG(std::optional<at::ScalarType>, dtype) = std::nullopt;
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
};

// One depth-attention read: replaces the residual input of one sublayer (or,
// with its own instance, the network's final output). Parameters: "query"
// [dim], zeros (an untrained read is the plain average of its sources), and
// "norm_weight" [dim], ones, only with key_norm_affine (otherwise norm_weight
// is an undefined tensor and not registered), and "out_weight" [dim], ones,
// only with out_norm kRMSNorm.
class AttnResResidualImpl : public torch::nn::Cloneable<AttnResResidualImpl> {
 public:
  explicit AttnResResidualImpl(const AttnResResidualOptions& options_);

  // Registers the parameters (torch::nn::Cloneable calls it again in clone()).
  void reset() override;
  // query = 0, norm_weight = 1, out_weight = 1.
  void reset_parameters();

  // h [..., D] in the stream dtype: attnres::depth_attention on
  // stream.sources() (the list itself, never stacked), or in a Block stream
  // on CPU the same h from the two-phase ops (DepthStream::read). With an
  // output norm, RMSNorm(h) * out_weight (attnres::depth_attention with out_weight).
  at::Tensor forward(const DepthStream& stream);
  // h and the depth softmax weights [num_sources, ...] (fp32; fp64 for an
  // fp64 stream); both are differentiable.
  std::tuple<at::Tensor, at::Tensor> forward_with_weights(const DepthStream& stream);

  // attnres::AttnResResidual(dim=512, eps=1e-06, key_norm_affine=true)
  void pretty_print(std::ostream& stream) const override;

  AttnResResidualOptions options;
  at::Tensor query;
  at::Tensor norm_weight;  // undefined without key_norm_affine
  at::Tensor out_weight;   // undefined without an output norm

 private:
  friend class DepthStream;
  // The stream's width is dim, and a stream with block_storage is not read
  // with a graph.
  void check_width(const DepthStream& stream) const;
  at::Tensor read_one_call(const DepthStream& stream);
  // norm_weight and out_weight as the ops take them (nullopt when absent).
  std::optional<at::Tensor> gain_or_none() const {
    return norm_weight.defined() ? std::optional<at::Tensor>(norm_weight) : std::nullopt;
  }
  std::optional<at::Tensor> out_weight_or_none() const {
    return out_weight.defined() ? std::optional<at::Tensor>(out_weight) : std::nullopt;
  }
  // Whether `other` can join this reader's phase-1 call (one eps, stackable
  // parameters).
  bool can_share_phase_one(const AttnResResidualImpl& other) const;
};

// attnres::AttnResResidual(dim) or
// attnres::AttnResResidual(attnres::AttnResResidualOptions(dim).eps(...)):
// a shared-pointer holder, like every torch::nn module.
TORCH_MODULE(AttnResResidual);

// The sources that later sublayers read, for one forward pass.
//
// block_size = std::nullopt is Full AttnRes: the sources are the embedding
// and every sublayer output so far. block_size = S is Block AttnRes: the
// embedding, the sum of each completed block of S outputs, and (when it holds
// at least one output) the current block's partial sum. block_size = 1 gives
// the same sources as Full.
//
// `readers` (Block streams) declares the model's reads in forward order:
// readers[k] reads after k outputs were appended (the last one usually the
// final read). With it a block's reads can share one pass over its completed
// sources (two-phase reads, block_reads; docs/design.md §10); without it
// every read is one call. Either way the result is the same read.
//
// dtype rule: every source has the embedding's dtype (the "stream dtype").
// Under autocast (at::autocast::is_autocast_enabled for the output's device)
// append() casts a floating-point output to the stream dtype, the way
// `x + f` promotes a bf16 f into an fp32 residual stream; outside autocast a
// dtype mismatch is an error.
//
// The stream holds references, never copies: Full keeps each appended tensor
// itself; Block builds partial sums out of place so autograd sees every step.
// A Block stream defers an output's add into the partial sum to the next
// read, which adds it inside its kernels (the fused prefix add,
// docs/design.md §12); anything else that needs the sum adds it first, in
// the grad and inference modes of the append. So an appended output must not
// be changed in place, and one stream is not read from two threads at once
// (a const read may add or consume the deferred output).
// block_storage (Block streams, for inference and CUDA graphs): a
// preallocated contiguous tensor [R, embedding's shape...] in the stream's
// dtype and device. Block k's sum is then written into row k when the block
// completes (its last output added to the partial sum there), so completed
// blocks allocate nothing and the reads take the rows as views; the outputs
// before are added inside the reads as without storage (the fused prefix
// add). An output that requires grad under grad mode is refused. Copies
// share the rows: once one of the streams sharing them writes a block, the
// others refuse to read or append. R must cover every block the stream
// starts.
//
// A DepthStream is a small value: copying it (or clone()) shares the tensors
// and copies the lists, so appending to the copy leaves the original as it is
// (what activation checkpointing needs). Its tensors are sources(); a stream
// is rebuilt from them with from_sources (e.g. on the next pipeline stage).
//
// Bad input throws c10::ValueError / c10::TypeError (Python's ValueError /
// TypeError) with the words of the Python class.
class DepthStream {
 public:
  explicit DepthStream(at::Tensor embedding,
                       std::optional<int64_t> block_size = std::nullopt,
                       BlockReads block_reads = BlockReads::kAuto,
                       std::vector<AttnResResidual> readers = {},
                       at::Tensor block_storage = at::Tensor());
  // A stream from its parts: Full, the outputs so far as `completed`; Block,
  // the completed block sums as `completed` and the current block's partial
  // sum (undefined for none) with the number of outputs in it.
  static DepthStream from_sources(at::Tensor embedding, const std::vector<at::Tensor>& completed,
                                  const at::Tensor& partial = at::Tensor(),
                                  std::optional<int64_t> block_size = std::nullopt,
                                  int64_t partial_count = 0,
                                  BlockReads block_reads = BlockReads::kAuto,
                                  std::vector<AttnResResidual> readers = {});
  // Records the new output f of one sublayer (never a cumulative sum). f must
  // have the embedding's shape, device and dtype (under autocast: any
  // floating dtype, cast to the stream dtype).
  void append(const at::Tensor& f);
  // What the next read sees, in order: the embedding, the completed sources,
  // then the partial sum (Block only, and only when it is non-empty). A fresh
  // vector each call.
  std::vector<at::Tensor> sources() const;
  int64_t num_sources() const;
  // The model width D: the size of the last dimension of every source.
  int64_t width() const { return embedding_.size(-1); }
  // std::nullopt for Full, S for Block.
  std::optional<int64_t> block_size() const { return block_size_; }
  // Sublayer outputs appended so far.
  int64_t num_outputs() const { return num_outputs_; }
  // Outputs summed into the current block's partial sum (0 for Full).
  int64_t partial_count() const { return in_partial_; }
  BlockReads block_reads() const { return block_reads_; }
  const std::vector<AttnResResidual>& readers() const { return readers_; }
  // h for `reader` at this point of the stream (what AttnResResidual's
  // forward returns): with declared readers, in a Block stream, phase 1 at
  // the first read of a block for the block's readers, phase 2 at a later
  // read of it; a one-call read otherwise (docs/design.md §10). The path
  // depends only on the configuration, the grad mode and the inputs.
  at::Tensor read(AttnResResidualImpl& reader) const;
  const at::Tensor& embedding() const { return embedding_; }
  at::IntArrayRef shape() const { return embedding_.sizes(); }
  at::ScalarType dtype() const { return embedding_.scalar_type(); }
  at::Device device() const { return embedding_.device(); }
  // A new stream with the same sources (tensors shared, lists copied); the
  // same as a copy, named as in Python. Copies share the phase-1 results of
  // the forward pass (§10), as activation checkpointing needs, and the
  // block_storage rows.
  DepthStream clone() const;
  // The preallocated block storage (undefined: none).
  const at::Tensor& block_storage() const { return block_storage_; }

 private:
  at::Tensor checked_output(const at::Tensor& f, const char* where = "append") const;
  void check_block_storage();
  // The block_storage row of f's block, or the reason f cannot be appended.
  const at::Tensor& storage_row(const at::Tensor& f) const;
  // Throws when another stream sharing the rows has appended since this one.
  void check_storage_current() const;
  bool two_phase(int64_t num_completed) const;
  void check_declared(const AttnResResidualImpl& reader) const;
  // Adds a pending output to the partial sum, in the modes of its append.
  void settle() const;
  // The pending output for a read to add (§12) when the read runs in the
  // modes of its append (it is then no longer pending); otherwise it is
  // added first, and none.
  std::optional<at::Tensor> take_pending() const;
  // A one-call read of the sources, the pending output added inside it.
  at::Tensor read_one_call(AttnResResidualImpl& reader) const;

  at::Tensor embedding_;
  std::optional<int64_t> block_size_;
  std::vector<at::Tensor> completed_;  // the embedding, then completed sources
  // The partial sum (undefined when the block is empty) and an output not
  // yet added to it (undefined: none), with its append's grad and
  // inference modes. Mutable: a const read settles or consumes it.
  mutable at::Tensor partial_;
  mutable at::Tensor pending_;
  bool pending_grad_ = false, pending_inference_ = false;
  int64_t in_partial_ = 0;             // outputs summed into the partial so far
  int64_t num_outputs_ = 0;
  BlockReads block_reads_ = BlockReads::kAuto;
  std::vector<AttnResResidual> readers_;  // empty: none declared
  std::shared_ptr<detail::BlockReadState> reads_;
  at::Tensor block_storage_;
  std::vector<at::Tensor> rows_;  // row k holds block k's sum (empty: no storage)
  // Blocks written into the rows by all the streams sharing them, and by this one's count.
  std::shared_ptr<int64_t> storage_writes_ = std::make_shared<int64_t>(0);
  int64_t writes_seen_ = 0;
};

// DepthStream(Full, shape=[2, 5, 8], dtype=torch.float32, outputs=3, sources=4)
std::ostream& operator<<(std::ostream& out, const DepthStream& stream);


}  // namespace attnres
