// attnres::DepthStream and attnres::AttnResResidual (include/attnres/modules.h):
// the C++ counterparts of python/attnres/modules.py, with the same rules
// (docs/design.md §1) and the same error words. TORCH_CHECK_VALUE /
// TORCH_CHECK_TYPE throw c10::ValueError / c10::TypeError, which Python sees
// as ValueError / TypeError.
#include "attnres/modules.h"

#include "attnres/arguments.h"  // py_dtype

#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/stack.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "attnres/block_reads.h"
#include "attnres/ops.h"

namespace attnres {
namespace detail {

// The phase-1 results of one forward pass's blocks (docs/design.md §10),
// keyed by the number of completed sources; shared by a stream and its
// copies, so a checkpointed segment that starts mid-block uses the phase-1
// result computed before it.
struct BlockReadState {
  struct Entry {
    at::Tensor last_completed;  // identifies the block's completed sources
    std::vector<const AttnResResidualImpl*> readers;
    std::vector<at::Tensor> partials;  // undefined once an in-place merge consumed one
    at::Tensor lse;
    bool with_grad = false;  // made under grad mode: its results carry a graph
  };
  std::map<int64_t, Entry> entries;
};

}  // namespace detail

namespace {

// "auto" reads two-phase from this many completed sources on (below, the
// two-phase ops move as many bytes or more: docs/design.md §10), training
// included, except for bf16/fp16 streams under grad mode: their merge
// backward takes <dh, P - y> from the partial output rounded to 8/11 bits,
// which the one-call backward avoids for them (§8, §10).
constexpr int64_t kAutoMinCompleted = 3;
// Under no_grad/inference kAuto reads one-call while a source holds at most
// this many elements (decode-sized reads): the sources stay in cache, and the
// two-phase path's extra host work costs more than the bytes it saves.
constexpr int64_t kAutoOneCallInferenceNumel = int64_t{1} << 18;

std::optional<int64_t> checked_block_size(std::optional<int64_t> block_size) {
  TORCH_CHECK_VALUE(!block_size || *block_size > 0,
                    "block_size must be None (Full AttnRes) or a positive int S (Block "
                    "AttnRes), got ",
                    *block_size);
  return block_size;
}

}  // namespace

// ---- DepthStream ------------------------------------------------------------

DepthStream::DepthStream(at::Tensor embedding, std::optional<int64_t> block_size,
                         BlockReads block_reads, std::vector<AttnResResidual> readers,
                         at::Tensor block_storage)
    : embedding_(std::move(embedding)),
      block_reads_(block_reads),
      readers_(std::move(readers)),
      reads_(std::make_shared<detail::BlockReadState>()),
      block_storage_(std::move(block_storage)) {
  TORCH_CHECK_TYPE(embedding_.defined(),
                   "embedding must be a tensor [..., D], got an undefined tensor");
  TORCH_CHECK_VALUE(embedding_.dim() >= 1 && embedding_.size(-1) != 0,
                    "embedding must have shape [..., D] with D > 0, got ", embedding_.sizes());
  TORCH_CHECK_TYPE(embedding_.is_floating_point(),
                   "embedding must be a floating-point tensor, got ",
                   py_dtype(embedding_.scalar_type()));
  block_size_ = checked_block_size(block_size);
  for (const auto& r : readers_) {
    TORCH_CHECK_TYPE(!r.is_empty(), "readers must be AttnResResidual modules in read order, "
                     "got an empty holder");
  }
  TORCH_CHECK_VALUE(block_reads_ != BlockReads::kTwoPhase || !readers_.empty() ||
                        block_size_.value_or(1) == 1,
                    "block_reads='two_phase' needs the stream's readers declared: "
                    "DepthStream(..., readers=[the AttnResResidual modules in read order])");
  completed_.push_back(embedding_);
  if (block_storage_.defined()) check_block_storage();
}

void DepthStream::check_block_storage() {
  const at::Tensor& storage = block_storage_;
  TORCH_CHECK_VALUE(block_size_.has_value(),
                    "block_storage is for Block streams (block_size=S): a Full stream keeps each "
                    "output itself");
  const auto shape = embedding_.sizes();
  std::string wanted = "[R";
  for (const int64_t n : shape) wanted += ", " + std::to_string(n);
  TORCH_CHECK_VALUE(storage.dim() == embedding_.dim() + 1 && storage.sizes().slice(1) == shape &&
                        storage.size(0) >= 1,
                    "block_storage must have shape ", wanted,
                    "] (rows, then the embedding's shape) with R >= 1, got ", storage.sizes());
  TORCH_CHECK_TYPE(storage.scalar_type() == dtype(), "block_storage has dtype ",
                   py_dtype(storage.scalar_type()), " but the stream's dtype (its embedding's) is ",
                   py_dtype(dtype()));
  TORCH_CHECK_VALUE(storage.device() == device(), "block_storage is on device ", storage.device(),
                    " but the stream is on device ", device());
  TORCH_CHECK_VALUE(storage.is_contiguous(),
                    "block_storage must be contiguous (each block's row is written in place)");
  TORCH_CHECK_VALUE(!storage.requires_grad(),
                    "block_storage must not require grad: the stream writes its rows in place (it "
                    "is for inference)");
  TORCH_CHECK_VALUE(!shares_memory(storage, embedding_),
                    "block_storage must not share memory with the embedding");
  TORCH_CHECK_VALUE(!storage.is_inference() || c10::InferenceMode::is_enabled(),
                    "block_storage is an inference tensor (made under torch.inference_mode) but "
                    "the stream is built outside inference mode, where its rows cannot be written");
  rows_ = storage.unbind(0);
}

void DepthStream::check_storage_current() const {
  TORCH_CHECK_VALUE(writes_seen_ == *storage_writes_,
                    "DepthStream: another stream sharing this stream's block_storage (a clone) "
                    "has written a block into the rows since, so they no longer hold this "
                    "stream's sums; only one of the streams sharing block storage may go on");
}

const at::Tensor& DepthStream::storage_row(const at::Tensor& f) const {
  check_storage_current();
  TORCH_CHECK_VALUE(!(f.requires_grad() && at::GradMode::is_enabled()),
                    "DepthStream.append: a stream with block_storage writes its blocks in place "
                    "and is for inference, but this output requires grad; append under "
                    "torch.no_grad() or torch.inference_mode(), or build the stream without "
                    "block_storage");
  const size_t k = completed_.size() - 1;
  TORCH_CHECK_VALUE(k < rows_.size(), "DepthStream.append: block_storage has ", rows_.size(),
                    " rows but output ", num_outputs_ + 1, " belongs to block ", k + 1,
                    "; give it at least ceil(outputs / block_size) rows");
  return rows_[k];
}

DepthStream DepthStream::clone() const {
  if (!rows_.empty()) check_storage_current();
  return *this;
}

DepthStream DepthStream::from_sources(at::Tensor embedding,
                                      const std::vector<at::Tensor>& completed,
                                      const at::Tensor& partial,
                                      std::optional<int64_t> block_size, int64_t partial_count,
                                      BlockReads block_reads,
                                      std::vector<AttnResResidual> readers) {
  DepthStream stream(std::move(embedding), block_size, block_reads, std::move(readers));
  const auto S = stream.block_size_;
  TORCH_CHECK_VALUE(S || (!partial.defined() && partial_count == 0),
                    "a Full stream (block_size=None) has no partial sum");
  TORCH_CHECK_VALUE(!S || partial.defined() == (partial_count != 0),
                    "partial and partial_count go together: a partial sum holds 1 .. S-1 "
                    "outputs, got partial=", partial.defined() ? "a tensor" : "None",
                    ", partial_count=", partial_count);
  TORCH_CHECK_VALUE(!S || (partial_count >= 0 && partial_count < *S),
                    "partial_count must be in [0, block_size) = [0, ", S.value_or(0), "), got ",
                    partial_count);
  for (const auto& c : completed) stream.completed_.push_back(stream.checked_output(c, "from_sources"));
  if (partial.defined()) stream.partial_ = stream.checked_output(partial, "from_sources");
  stream.in_partial_ = partial_count;
  stream.num_outputs_ = static_cast<int64_t>(completed.size()) * S.value_or(1) + partial_count;
  return stream;
}

void DepthStream::settle() const {
  if (!pending_.defined()) return;
  if (at::GradMode::is_enabled() == pending_grad_ &&
      c10::InferenceMode::is_enabled() == pending_inference_) {
    partial_ = partial_ + pending_;
  } else {
    // InferenceMode(false) also turns grad mode on: set it after.
    c10::InferenceMode inference(pending_inference_);
    at::AutoGradMode grad(pending_grad_);
    partial_ = partial_ + pending_;
  }
  pending_ = at::Tensor();
}

std::optional<at::Tensor> DepthStream::take_pending() const {
  if (pending_.defined() && (pending_grad_ != at::GradMode::is_enabled() ||
                             pending_inference_ != c10::InferenceMode::is_enabled())) {
    settle();
  }
  if (!pending_.defined()) return std::nullopt;
  return std::exchange(pending_, at::Tensor());
}

at::Tensor DepthStream::read_one_call(AttnResResidualImpl& reader) const {
  const std::optional<at::Tensor> delta = take_pending();
  if (!delta) return reader.read_one_call(*this);
  std::vector<at::Tensor> sources = completed_;
  sources.push_back(partial_);
  try {
    auto result = depth_attention_fwd(sources, reader.query, reader.gain_or_none(),
                                      reader.options.eps(), 1.0, reader.out_weight_or_none(),
                                      reader.options.out_eps(), /*keep_h=*/false, delta);
    partial_ = std::get<5>(result);
    return std::get<0>(result);
  } catch (...) {
    pending_ = *delta;  // a failed read leaves the stream as it was
    throw;
  }
}

std::vector<at::Tensor> DepthStream::sources() const {
  if (!rows_.empty()) check_storage_current();
  settle();
  std::vector<at::Tensor> out = completed_;
  if (partial_.defined()) out.push_back(partial_);
  return out;
}

int64_t DepthStream::num_sources() const {
  return static_cast<int64_t>(completed_.size()) + (partial_.defined() ? 1 : 0);
}

void DepthStream::append(const at::Tensor& output) {
  at::Tensor f = checked_output(output);
  if (!block_size_) {
    ++num_outputs_;
    completed_.push_back(std::move(f));
    return;
  }
  // With block storage a block's sum is written into its row when the block
  // completes; the outputs before are held as without storage (the reads
  // fuse their adds, §12).
  const at::Tensor* row = rows_.empty() ? nullptr : &storage_row(f);
  const bool completes = in_partial_ + 1 == *block_size_;
  if (!partial_.defined()) {
    partial_ = row && completes ? row->copy_(f) : f;
  } else if (!completes) {
    // A later read of this block may add f in its merge (§12).
    settle();
    pending_ = std::move(f);
    pending_grad_ = at::GradMode::is_enabled();
    pending_inference_ = c10::InferenceMode::is_enabled();
  } else {
    settle();
    if (row) {
      at::NoGradGuard no_grad;  // the rows never carry a graph (inference)
      at::Tensor out = *row;
      partial_ = at::add_out(out, partial_, f);
    } else {
      partial_ = partial_ + f;  // out of place: autograd sees each step
    }
  }
  if (row && completes) writes_seen_ = ++*storage_writes_;
  ++num_outputs_;
  if (++in_partial_ == *block_size_) {
    completed_.push_back(partial_);
    partial_ = at::Tensor();
    in_partial_ = 0;
  }
}

bool DepthStream::two_phase(int64_t num_completed) const {
  if (readers_.empty() || !block_size_ || *block_size_ < 2) return false;
  if (block_reads_ == BlockReads::kOneCall) return false;
  if (!embedding_.device().is_cpu() && !embedding_.device().is_cuda()) return false;
  const auto t = embedding_.scalar_type();
  if (t != at::kDouble && t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) return false;
  // CUDA kernels for every phase op, not yet run on a GPU: used when asked
  // for (kTwoPhase), training included (docs/design.md §10).
  if (embedding_.device().is_cuda()) return block_reads_ == BlockReads::kTwoPhase;
  if (block_reads_ == BlockReads::kTwoPhase) return true;
  if (at::GradMode::is_enabled()) {
    if (t == at::kBFloat16 || t == at::kHalf) return false;
  } else if (embedding_.numel() <= kAutoOneCallInferenceNumel) {
    return false;
  }
  return num_completed >= kAutoMinCompleted;
}

void DepthStream::check_declared(const AttnResResidualImpl& reader) const {
  const int64_t k = num_outputs_;
  const bool listed = k < static_cast<int64_t>(readers_.size());
  TORCH_CHECK_VALUE(listed && readers_[k].get() == &reader, "DepthStream: the read after ", k,
                    " outputs is not the one the stream's readers declare there (",
                    listed ? "reader " + std::to_string(k) + " of the declared list" : "none",
                    "); declare every read in forward order, or build the stream without "
                    "readers");
}

at::Tensor DepthStream::read(AttnResResidualImpl& reader) const {
  if (!readers_.empty()) check_declared(reader);
  if (!rows_.empty()) check_storage_current();
  const int64_t num_completed = static_cast<int64_t>(completed_.size());
  if (!block_size_ || !two_phase(num_completed)) return read_one_call(reader);
  detail::BlockReadState& state = *reads_;
  const int64_t pos = in_partial_;
  const bool grad = at::GradMode::is_enabled();
  const std::optional<at::Tensor> gain = reader.gain_or_none();
  if (pos == 0) {
    std::vector<const AttnResResidualImpl*> readers{&reader};
    const int64_t end = std::min<int64_t>(num_outputs_ + *block_size_, readers_.size());
    for (int64_t k = num_outputs_ + 1; k < end; ++k) {
      const AttnResResidualImpl* next = readers_[k].get();
      if (!reader.can_share_phase_one(*next) ||
          std::find(readers.begin(), readers.end(), next) != readers.end()) {
        break;
      }
      readers.push_back(next);
    }
    std::vector<at::Tensor> queries, gains;
    for (const auto* r : readers) {
      queries.push_back(r->query);
      if (gain) gains.push_back(r->norm_weight);
    }
    const std::optional<at::Tensor> stacked_gains =
        gain ? std::optional<at::Tensor>(at::stack(gains)) : std::nullopt;
    // Reader 0's output norm (when it has one) is fused into phase 1:
    // partials[0] is its final read (docs/design.md §11).
    auto [partials, lse] =
        attnres::block_reads(completed_, at::stack(queries), stacked_gains, reader.options.eps(),
                             1.0, reader.out_weight_or_none(), reader.options.out_eps());
    // Nothing made without grad mode is recomputed: keep only the entries with
    // a graph (a checkpointed layer's recomputation may need them).
    if (!grad) {
      for (auto it = state.entries.begin(); it != state.entries.end();) {
        it = it->second.with_grad ? std::next(it) : state.entries.erase(it);
      }
    }
    state.entries[num_completed] = {completed_.back(), readers, partials, lse, grad};
    return partials[0];
  }
  const auto it = state.entries.find(num_completed);
  // A phase 1 made without grad has no graph to give a read with grad: one call.
  if (it == state.entries.end() || !it->second.last_completed.is_same(completed_.back()) ||
      pos >= static_cast<int64_t>(it->second.readers.size()) ||
      it->second.readers[pos] != &reader || !it->second.partials[pos].defined() ||
      (grad && !it->second.with_grad)) {
    return read_one_call(reader);
  }
  // Phase 2 fuses the reader's output norm when it has one (§11). Out of
  // place when either side has a graph (under no_grad the result has none),
  // or for an inference tensor outside inference mode (it cannot be written).
  // The last output joins the partial sum inside the merge (§12) when the
  // read runs in the modes of its append; otherwise it is added first.
  const std::optional<at::Tensor> delta = take_pending();
  const at::Tensor& y = it->second.partials[pos];
  try {
    if (grad || it->second.with_grad ||
        (y.is_inference() && !c10::InferenceMode::is_enabled())) {
      auto result = block_read_merge_fwd(it->second.partials[pos], it->second.lse[pos], partial_,
                                         reader.query, gain, reader.options.eps(), 1.0,
                                         reader.out_weight_or_none(), reader.options.out_eps(),
                                         /*keep_h=*/false, delta);
      if (delta) partial_ = std::get<5>(result);
      return std::get<0>(result);
    }
    // Inference: h (y with an output norm) overwrites the partial output it
    // consumes (no new output allocated); a second read at this position
    // reads one-call.
    at::Tensor h = std::move(it->second.partials[pos]);
    it->second.partials[pos] = at::Tensor();
    at::Tensor sum = block_read_merge_inplace(h, it->second.lse[pos], partial_, reader.query,
                                              gain, reader.options.eps(), 1.0,
                                              reader.out_weight_or_none(),
                                              reader.options.out_eps(), delta);
    if (delta) partial_ = std::move(sum);
    return h;
  } catch (...) {
    if (delta) pending_ = *delta;  // a failed read leaves the stream as it was
    throw;
  }
}

at::Tensor DepthStream::checked_output(const at::Tensor& f, const char* where) const {
  TORCH_CHECK_TYPE(f.defined(), "DepthStream.", where,
                   " expects a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(f.sizes() == embedding_.sizes(), "DepthStream.", where, ": output has shape ",
                    f.sizes(), " but the stream's embedding has shape ", embedding_.sizes(),
                    "; every sublayer output must have the embedding's shape");
  TORCH_CHECK_VALUE(f.device() == device(), "DepthStream.", where, ": output is on device ",
                    f.device(), " but the stream is on device ", device());
  if (f.scalar_type() != dtype()) {
    const at::DeviceType device_type = f.device().type();
    if (f.is_floating_point() && at::autocast::is_autocast_available(device_type) &&
        at::autocast::is_autocast_enabled(device_type)) {
      return f.to(dtype());
    }
    TORCH_CHECK_TYPE(false, "DepthStream.", where, ": output has dtype ", py_dtype(f.scalar_type()),
                     " but the stream's dtype (its embedding's) is ", py_dtype(dtype()),
                     "; outside torch.autocast every output must have the stream dtype");
  }
  return f;
}

std::ostream& operator<<(std::ostream& out, const DepthStream& stream) {
  out << "DepthStream(";
  if (stream.block_size()) {
    out << "Block(S=" << *stream.block_size() << ")";
  } else {
    out << "Full";
  }
  return out << ", shape=" << stream.shape() << ", dtype=" << py_dtype(stream.dtype())
             << ", outputs=" << stream.num_outputs() << ", sources=" << stream.num_sources()
             << ")";
}

// ---- AttnResResidual --------------------------------------------------------

AttnResResidualImpl::AttnResResidualImpl(const AttnResResidualOptions& options_)
    : options(options_) {
  // NOLINTNEXTLINE(clang-analyzer-optin.cplusplus.VirtualCall)
  reset();
}

void AttnResResidualImpl::reset() {
  TORCH_CHECK_VALUE(options.dim() > 0,
                    "dim must be a positive int (the model width D), got ", options.dim());
  TORCH_CHECK_VALUE(options.eps() >= 0.0 && std::isfinite(options.eps()),
                    "eps must be a finite number >= 0, got ", options.eps());
  TORCH_CHECK_VALUE(options.out_eps() >= 0.0 && std::isfinite(options.out_eps()),
                    "out_eps must be a finite number >= 0, got ", options.out_eps());
  at::TensorOptions factory;
  if (options.dtype()) factory = factory.dtype(*options.dtype());
  if (options.device()) factory = factory.device(*options.device());
  query = register_parameter("query", at::empty({options.dim()}, factory));
  if (options.key_norm_affine()) {
    norm_weight = register_parameter("norm_weight", at::empty({options.dim()}, factory));
  } else {
    norm_weight = at::Tensor();
  }
  if (options.out_norm() == OutNorm::kRMSNorm) {
    out_weight = register_parameter("out_weight", at::empty({options.dim()}, factory));
  } else {
    out_weight = at::Tensor();
  }
  reset_parameters();
}

void AttnResResidualImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  query.zero_();
  if (norm_weight.defined()) norm_weight.fill_(1.0);
  if (out_weight.defined()) out_weight.fill_(1.0);
}


at::Tensor AttnResResidualImpl::read_one_call(const DepthStream& stream) {
  return depth_attention(stream.sources(), query, gain_or_none(), options.eps(), 1.0,
                         out_weight_or_none(), options.out_eps());
}

void AttnResResidualImpl::check_width(const DepthStream& stream) const {
  TORCH_CHECK_VALUE(stream.width() == options.dim(), "AttnResResidual has width dim = ",
                    options.dim(), " but the DepthStream has width D = ", stream.width());
  // A read with a graph saves views of the rows that later appends write.
  TORCH_CHECK_VALUE(
      !stream.block_storage().defined() || !at::GradMode::is_enabled() ||
          !(query.requires_grad() || (norm_weight.defined() && norm_weight.requires_grad()) ||
            (out_weight.defined() && out_weight.requires_grad())),
      "AttnResResidual: a read of a stream with block_storage under grad mode with parameters "
      "that require grad (the stream writes its rows in place: it is for inference); read under "
      "torch.no_grad() or torch.inference_mode(), or build the stream without block_storage");
}

at::Tensor AttnResResidualImpl::forward(const DepthStream& stream) {
  check_width(stream);
  if (!stream.block_size()) return read_one_call(stream);
  return stream.read(*this);
}

bool AttnResResidualImpl::can_share_phase_one(const AttnResResidualImpl& other) const {
  if (other.options.dim() != options.dim() || other.options.eps() != options.eps()) return false;
  if (other.query.scalar_type() != query.scalar_type() || other.query.device() != query.device()) {
    return false;
  }
  if (norm_weight.defined() != other.norm_weight.defined()) return false;
  if (out_weight.defined() != other.out_weight.defined()) return false;
  return !norm_weight.defined() || other.norm_weight.scalar_type() == norm_weight.scalar_type();
}

std::tuple<at::Tensor, at::Tensor> AttnResResidualImpl::forward_with_weights(
    const DepthStream& stream) {
  check_width(stream);
  return depth_attention_with_weights(stream.sources(), query, gain_or_none(), options.eps(), 1.0,
                                      out_weight_or_none(), options.out_eps());
}

void AttnResResidualImpl::pretty_print(std::ostream& stream) const {
  stream << "attnres::AttnResResidual(dim=" << options.dim() << ", eps=" << options.eps()
         << ", key_norm_affine=" << (options.key_norm_affine() ? "true" : "false");
  if (options.out_norm() == OutNorm::kRMSNorm) {
    stream << ", out_norm=rmsnorm, out_eps=" << options.out_eps();
  }
  stream << ")";
}

}  // namespace attnres
