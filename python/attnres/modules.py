"""Drop-in modules for Attention Residuals (docs/design.md §1, §3).

A PreNorm block normally does ``x = x + f(norm(x))``. With AttnRes the
outputs are kept apart in a :class:`DepthStream` and every sublayer reads
them through its own :class:`AttnResResidual`::

    stream = attnres.DepthStream(tok_emb, block_size=None)   # or S for Block AttnRes
    for blk in blocks:
        stream.append(blk.attn(blk.ln1(blk.res_attn(stream))))
        stream.append(blk.mlp(blk.ln2(blk.res_mlp(stream))))
    x = final_res(stream)
"""
from __future__ import annotations

import warnings
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from . import ops
from .ops import block_read_merge, block_read_merge_inplace, block_reads, depth_attention

_BLOCK_READS = ("auto", "two_phase", "one_call")
# "auto" uses two-phase reads for a block from this many completed sources on:
# below it they move as many bytes (n = 2) or more (n = 1) than one-call
# reads (docs/design.md §10). Training included, except for bf16/fp16 streams:
# their merge backward takes <dh, P - y> from the partial output rounded to
# 8/11 bits, which the one-call backward avoids for them (§8, §10).
_AUTO_MIN_COMPLETED = 3
# Under no_grad/inference "auto" reads one-call while a source holds at most
# this many elements (decode-sized reads): there the sources stay in cache,
# and the two-phase path's extra host work (grouping the block's readers,
# stacking their queries, phase-1 bookkeeping) costs more than the bytes it
# saves (benchmarks/results/NOTES.md section 7, read_host_time.py's table 2).
_AUTO_ONE_CALL_INFERENCE_NUMEL = 1 << 18
_OUT_NORMS = (None, "rmsnorm")
_AUTO_ONE_CALL_TRAINING_DTYPES = (torch.bfloat16, torch.float16)
_TWO_PHASE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_UNSET = object()


class _PhaseOne(NamedTuple):
    """Phase 1 of one block (docs/design.md §10)."""

    last_completed: torch.Tensor  # identifies the block's completed sources
    readers: Tuple["AttnResResidual", ...]
    partials: List[Optional[torch.Tensor]]  # None once an in-place merge consumed it
    lse: torch.Tensor
    with_grad: bool  # made under grad mode: its results carry a graph


class StreamSpec(NamedTuple):
    """What :meth:`DepthStream.flatten` returns beside the tensors."""

    block_size: Optional[int]
    num_outputs: int
    block_reads: str
    readers: Optional[Tuple["AttnResResidual", ...]]


def _check_block_size(block_size) -> Optional[int]:
    if block_size is None:
        return None
    # bool is an int subclass, but True as a block size is surely a mistake.
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(
            f"block_size must be None (Full AttnRes) or a positive int S (Block AttnRes), "
            f"got {type(block_size).__name__} {block_size!r}"
        )
    if block_size <= 0:
        raise ValueError(
            f"block_size must be None (Full AttnRes) or a positive int S (Block AttnRes), "
            f"got {block_size}"
        )
    return block_size


def _modes() -> Tuple[bool, bool]:
    """(grad mode, inference mode) now: a deferred add runs in its append's.
    torch.compile cannot trace is_inference_mode_enabled(); a compiled region
    runs in one inference mode, so there it counts as off."""
    if torch.compiler.is_compiling():
        return torch.is_grad_enabled(), False
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class DepthStream:
    """The sources that later sublayers read, for one forward pass.

    ``block_size=None`` is Full AttnRes: the sources are the embedding and
    every sublayer output so far. ``block_size=S`` is Block AttnRes: the
    embedding, the sum of each completed block of S outputs, and (when it
    holds at least one output) the current block's partial sum.
    ``block_size=1`` gives the same sources as Full.

    ``readers`` (Block streams) declares the model's reads in forward order:
    ``readers[k]`` is the :class:`AttnResResidual` that reads after ``k``
    outputs were appended (the last one usually the final read). With it a
    block's reads can share one pass over its completed sources (two-phase
    reads, ``block_reads``; docs/design.md §10); without it every read is one
    call. Either way the result is the same read.

    dtype rule: every source has the embedding's dtype (the "stream dtype").
    Inside ``torch.autocast`` the sublayer outputs come out in the autocast
    dtype, so :meth:`append` casts them to the stream dtype there, the same
    way ``x + f`` promotes a bf16 ``f`` into an fp32 residual stream. Outside
    autocast a dtype mismatch is an error. Pass a bf16 embedding to keep the
    whole stream in bf16.

    The stream holds references, never copies: Full keeps each appended
    tensor itself; Block builds partial sums out of place so autograd sees
    every step. A Block stream keeps an appended output until the next read,
    which adds it into the partial sum inside its kernels (the fused prefix
    add, docs/design.md §12); anything else that needs the sum adds it
    first. So do not change an appended output in place; and since a read
    and the partial sum it forms are outputs of one autograd node, a second
    backward through reads of one stream needs ``retain_graph=True``. It is
    a pytree of its tensors (:meth:`flatten`), so FSDP2, pipelining,
    checkpointing, hooks and ``torch.compile`` see them.

    ``block_storage`` (Block streams, for inference and CUDA graphs): a
    preallocated contiguous tensor ``[R, *embedding.shape]`` in the stream's
    dtype and device. Block ``k``'s sum is then written into row ``k`` when
    the block completes (its last output added to the partial sum there), so
    completed blocks allocate nothing and the reads take the rows as views;
    the outputs before are added inside the reads as without storage (the
    fused prefix add). An output that needs a gradient, or a read with
    parameters that need one, under grad mode is refused (in-place writes
    to one buffer would invalidate the views a backward saves). A clone
    shares the rows: once one of the streams sharing them writes a block,
    the others refuse to read or append. R must cover every block the
    stream starts: ``ceil(outputs / block_size)``.
    """

    def __init__(self, embedding: torch.Tensor, block_size: Optional[int] = None, *,
                 block_reads: str = "auto",
                 readers: Optional[Sequence["AttnResResidual"]] = None,
                 block_storage: Optional[torch.Tensor] = None):
        if not isinstance(embedding, torch.Tensor):
            raise TypeError(f"embedding must be a tensor [..., D], got {type(embedding).__name__}")
        if embedding.dim() < 1 or embedding.shape[-1] == 0:
            raise ValueError(
                f"embedding must have shape [..., D] with D > 0, got {list(embedding.shape)}"
            )
        if not embedding.is_floating_point():
            raise TypeError(f"embedding must be a floating-point tensor, got {embedding.dtype}")
        self.block_size = _check_block_size(block_size)
        if block_reads not in _BLOCK_READS:
            raise ValueError(
                f"block_reads must be one of {', '.join(map(repr, _BLOCK_READS))}, got {block_reads!r}"
            )
        if readers is not None:
            readers = tuple(readers) or None  # an empty list declares nothing, as in C++
            for r in readers or ():
                if not isinstance(r, AttnResResidual):
                    raise TypeError(
                        f"readers must be AttnResResidual modules in read order, got {type(r).__name__}"
                    )
        if block_reads == "two_phase" and readers is None and (self.block_size or 1) > 1:
            raise ValueError(
                "block_reads='two_phase' needs the stream's readers declared: "
                "DepthStream(..., readers=[the AttnResResidual modules in read order])"
            )
        self.block_reads = block_reads
        self.readers: Optional[Tuple[AttnResResidual, ...]] = readers
        self._phase_one: Dict[int, _PhaseOne] = {}
        self.embedding = embedding
        self._completed: List[torch.Tensor] = [embedding]
        self._partial: Optional[torch.Tensor] = None
        # An output not yet added to _partial, and the grad/inference modes
        # of its append: the next read adds it in its merge (the fused
        # prefix add, docs/design.md §12), anything else adds it first.
        self._pending: Optional[torch.Tensor] = None
        self._pending_mode: Tuple[bool, bool] = (False, False)
        self._in_partial = 0  # outputs summed into the current block so far
        self.num_outputs = 0  # sublayer outputs appended so far
        self._rule = self._read_rule()
        self.block_storage = block_storage
        # Row k of block_storage holds block k's sum (None: no storage). The
        # streams sharing the rows (clones) share _storage_writes, the number
        # of appends made to them; each knows how many it has seen.
        self._rows: Optional[List[torch.Tensor]] = (
            None if block_storage is None else self._storage_rows(block_storage))
        self._storage_writes = [0]
        self._writes_seen = 0

    @classmethod
    def from_sources(cls, embedding: torch.Tensor, completed: Sequence[torch.Tensor] = (),
                     partial: Optional[torch.Tensor] = None, *, block_size: Optional[int] = None,
                     partial_count: int = 0, block_reads: str = "auto",
                     readers: Optional[Sequence["AttnResResidual"]] = None) -> "DepthStream":
        """A stream from its parts, e.g. on the next pipeline stage: Full,
        the outputs so far as ``completed``; Block, the completed block sums
        as ``completed`` and the current block's partial sum with the number
        of outputs in it (``partial_count``, 0 without a partial sum)."""
        stream = cls(embedding, block_size, block_reads=block_reads, readers=readers)
        S = stream.block_size
        if isinstance(partial_count, bool) or not isinstance(partial_count, int):
            raise TypeError(f"partial_count must be an int, got {type(partial_count).__name__}")
        if S is None and (partial is not None or partial_count):
            raise ValueError("a Full stream (block_size=None) has no partial sum")
        if S is not None and (partial is None) != (partial_count == 0):
            raise ValueError(
                f"partial and partial_count go together: a partial sum holds 1 .. S-1 outputs, "
                f"got partial={'None' if partial is None else 'a tensor'}, partial_count={partial_count}"
            )
        if S is not None and not 0 <= partial_count < S:
            raise ValueError(f"partial_count must be in [0, block_size) = [0, {S}), got {partial_count}")
        stream._completed += [stream._checked_output(c, "from_sources") for c in completed]
        if partial is not None:
            stream._partial = stream._checked_output(partial, "from_sources")
        stream._in_partial = partial_count
        stream.num_outputs = len(completed) * (S or 1) + partial_count
        return stream

    def _storage_rows(self, storage) -> List[torch.Tensor]:
        """block_storage checked, as its rows (views, made once: phase 1
        knows a block by the identity of its last completed source)."""
        if self.block_size is None:
            raise ValueError(
                "block_storage is for Block streams (block_size=S): a Full stream keeps each "
                "output itself"
            )
        if not isinstance(storage, torch.Tensor):
            raise TypeError(f"block_storage must be a tensor [R, ..., D], got {type(storage).__name__}")
        shape = list(self.embedding.shape)
        if storage.dim() != len(shape) + 1 or list(storage.shape[1:]) != shape or storage.shape[0] < 1:
            raise ValueError(
                f"block_storage must have shape [R, {', '.join(map(str, shape))}] (rows, then the "
                f"embedding's shape) with R >= 1, got {list(storage.shape)}"
            )
        if storage.dtype != self.dtype:
            raise TypeError(
                f"block_storage has dtype {storage.dtype} but the stream's dtype (its "
                f"embedding's) is {self.dtype}"
            )
        if storage.device != self.device:
            raise ValueError(
                f"block_storage is on device {storage.device} but the stream is on device {self.device}"
            )
        if not storage.is_contiguous():
            raise ValueError("block_storage must be contiguous (each block's row is written in place)")
        if storage.requires_grad:
            raise ValueError(
                "block_storage must not require grad: the stream writes its rows in place (it is "
                "for inference)"
            )
        # Memory and inference-mode checks only in eager mode: dynamo traces
        # neither storage identities nor is_inference().
        if not torch.compiler.is_compiling():
            if ops._shares_memory(storage, self.embedding):
                raise ValueError("block_storage must not share memory with the embedding")
            if storage.is_inference() and not torch.is_inference_mode_enabled():
                raise ValueError(
                    "block_storage is an inference tensor (made under torch.inference_mode) but "
                    "the stream is built outside inference mode, where its rows cannot be written"
                )
        return list(storage.unbind(0))

    def _check_storage_current(self) -> None:
        if self._writes_seen != self._storage_writes[0]:
            raise ValueError(
                "DepthStream: another stream sharing this stream's block_storage (a clone) has "
                "written a block into the rows since, so they no longer hold this stream's sums; "
                "only one of the streams sharing block storage may go on"
            )

    def _storage_row(self, f: torch.Tensor) -> torch.Tensor:
        """The row that the output f is added into, or the reason it cannot be."""
        self._check_storage_current()
        if f.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "DepthStream.append: a stream with block_storage writes its blocks in place and "
                "is for inference, but this output requires grad; append under torch.no_grad() "
                "or torch.inference_mode(), or build the stream without block_storage"
            )
        k = len(self._completed) - 1
        if k >= len(self._rows):
            raise ValueError(
                f"DepthStream.append: block_storage has {len(self._rows)} rows but output "
                f"{self.num_outputs + 1} belongs to block {k + 1}; give it at least "
                "ceil(outputs / block_size) rows"
            )
        return self._rows[k]

    def flatten(self) -> Tuple[List[torch.Tensor], StreamSpec]:
        """``(tensors, spec)``: :attr:`sources` and what rebuilds the stream
        from them (:meth:`unflatten`); the pytree form of the stream. The
        rebuilt stream has no block_storage, and its sources are the rows
        themselves: the stream flattened must not append after."""
        return self.sources, StreamSpec(self.block_size, self.num_outputs, self.block_reads,
                                        self.readers)

    def tensors(self) -> List[torch.Tensor]:
        """The stream's tensors: :attr:`sources`, the flat form's leaves."""
        return self.sources

    @classmethod
    def unflatten(cls, tensors: Sequence[torch.Tensor], spec: StreamSpec) -> "DepthStream":
        """The stream :meth:`flatten` described, with ``tensors`` as its sources."""
        tensors = list(tensors)
        S = spec.block_size
        partial_count = 0 if S is None else spec.num_outputs % S
        expected = 1 + (spec.num_outputs if S is None else spec.num_outputs // S) + (partial_count > 0)
        if len(tensors) != expected:
            raise ValueError(f"DepthStream.unflatten: the spec needs {expected} tensors, got {len(tensors)}")
        partial = tensors.pop() if partial_count else None
        return cls.from_sources(tensors[0], tensors[1:], partial, block_size=S,
                                partial_count=partial_count, block_reads=spec.block_reads,
                                readers=spec.readers)

    @property
    def shape(self) -> torch.Size:
        return self.embedding.shape

    @property
    def width(self) -> int:
        """The model width D: the size of the last dimension of every source."""
        return self.embedding.shape[-1]

    @property
    def dim(self) -> int:
        """Deprecated alias of :attr:`width` (kept for one release)."""
        warnings.warn(
            "DepthStream.dim is deprecated; use DepthStream.width (a tensor's .dim() is its rank)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.width

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def sources(self) -> List[torch.Tensor]:
        """What the next read sees, in order: embedding, completed sources,
        then the partial sum (Block only, and only when it is non-empty)."""
        if self._rows is not None:
            self._check_storage_current()
        self._settle()
        if self._partial is None:
            return list(self._completed)
        return [*self._completed, self._partial]

    @property
    def num_sources(self) -> int:
        return len(self._completed) + (self._partial is not None)

    def append(self, f: torch.Tensor) -> None:
        """Record the new output ``f`` of one sublayer (never a cumulative sum)."""
        f = self._checked_output(f)
        if self.block_size is None:
            self.num_outputs += 1
            self._completed.append(f)
            return
        # With block storage a block's sum is written into its row when the
        # block completes; the outputs before are held as without storage
        # (the reads fuse their adds, §12).
        row = None if self._rows is None else self._storage_row(f)
        completes = self._in_partial + 1 == self.block_size
        if self._partial is None:
            self._partial = f if row is None or not completes else row.copy_(f)
        elif not completes:
            # A later read of this block may add f in its merge (§12).
            self._settle()
            self._pending = f
            self._pending_mode = _modes()
        elif row is None:
            self._settle()
            self._partial = self._partial + f
        else:
            self._settle()
            self._partial = _add_into_row(self._partial, f, row)
        if row is not None and completes:
            self._storage_writes[0] += 1
            self._writes_seen = self._storage_writes[0]
        self.num_outputs += 1
        self._in_partial += 1
        if self._in_partial == self.block_size:
            self._completed.append(self._partial)
            self._partial = None
            self._in_partial = 0

    def clone(self) -> "DepthStream":
        """A new stream with the same sources (tensors shared, lists copied).

        Appending to the clone leaves this stream as it is, which is what
        activation checkpointing needs: the recomputation must start from
        the sources the first run saw. The clone shares this stream's phase-1
        results (docs/design.md §10) and its block_storage rows.
        """
        self._settle()
        clone = DepthStream._build(self.embedding, list(self._completed), self._partial,
                                   self._in_partial, self.num_outputs, self.block_size,
                                   self.block_reads, self.readers, self._phase_one)
        if self._rows is not None:
            self._check_storage_current()
            clone.block_storage, clone._rows = self.block_storage, self._rows
            clone._storage_writes, clone._writes_seen = self._storage_writes, self._writes_seen
        return clone

    @staticmethod
    def _build(embedding, completed, partial, in_partial, num_outputs, block_size, block_reads,
               readers, phase_one) -> "DepthStream":
        """A stream from its fields, unchecked (clone, the pytree unflatten)."""
        stream = DepthStream.__new__(DepthStream)
        stream.block_size, stream.block_reads, stream.readers = block_size, block_reads, readers
        stream._phase_one = phase_one
        stream.embedding, stream._completed, stream._partial = embedding, completed, partial
        stream._pending, stream._pending_mode = None, (False, False)
        stream._in_partial, stream.num_outputs = in_partial, num_outputs
        stream.block_storage, stream._rows = None, None
        stream._storage_writes, stream._writes_seen = [0], 0
        stream._rule = _UNSET  # its leaves may be anything (tree_map): made at the first read
        return stream

    def _settle(self) -> None:
        """Adds a pending output to the partial sum, in the modes of its append."""
        if self._pending is None:
            return
        now = _modes()
        grad, inference = self._pending_mode
        if now == self._pending_mode:
            self._partial = self._partial + self._pending
        elif now[1] == inference:
            with torch.set_grad_enabled(grad):
                self._partial = self._partial + self._pending
        else:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self._partial = self._partial + self._pending
        self._pending = None

    def _take_pending(self) -> Optional[torch.Tensor]:
        """The pending output for a merge to add (§12) when the read runs in
        the modes of its append; otherwise it is added first, and None."""
        if self._pending is not None and self._pending_mode != _modes():
            self._settle()
        delta, self._pending = self._pending, None
        return delta

    def _read_rule(self) -> Optional[str]:
        """The part of the two-phase choice fixed by the configuration (made
        once: a read's host time matters at decode sizes): None for one-call
        reads only, "always", or the CPU's "auto" rule ("auto-small" for
        sources of decode size, which read one-call without grad mode)."""
        if self.readers is None or self.block_size is None or self.block_size < 2:
            return None
        if self.block_reads == "one_call":
            return None
        if self.device.type not in ("cpu", "cuda") or self.dtype not in _TWO_PHASE_DTYPES:
            return None
        if self.block_reads == "two_phase":
            return "always"
        if self.device.type == "cuda":
            # CUDA: two-phase only when asked for ("two_phase"), training
            # included; the auto rule on a GPU is open (design §10).
            return None
        return "auto-small" if self.embedding.numel() <= _AUTO_ONE_CALL_INFERENCE_NUMEL else "auto"

    def _two_phase(self, num_completed: int) -> bool:
        """Whether the reads of the current block use the two-phase ops."""
        rule = self._rule
        if rule is _UNSET:
            rule = self._rule = self._read_rule()
        if rule is None or rule == "always":
            return rule is not None
        if torch.is_grad_enabled():
            if self.dtype in _AUTO_ONE_CALL_TRAINING_DTYPES:
                return False
        elif rule == "auto-small":
            return False
        return num_completed >= _AUTO_MIN_COMPLETED

    def _check_declared(self, reader: "AttnResResidual") -> None:
        k = self.num_outputs
        if k >= len(self.readers) or self.readers[k] is not reader:
            declared = "none" if k >= len(self.readers) else f"reader {k} of the declared list"
            raise ValueError(
                f"DepthStream: the read after {k} outputs is not the one the stream's readers "
                f"declare there ({declared}); declare every read in forward order, or build the "
                "stream without readers"
            )

    def _read(self, reader: "AttnResResidual") -> torch.Tensor:
        """h for ``reader`` (docs/design.md §10): with declared readers, phase
        1 at the first read of a block for the block's readers, phase 2 at a
        later read of it; a one-call read otherwise. The path depends only
        on the configuration, the grad mode and the inputs."""
        if self.readers is not None:
            self._check_declared(reader)
        if self._rows is not None:
            self._check_storage_current()
        num_completed = len(self._completed)
        if not self._two_phase(num_completed):
            return self._read_one_call(reader)
        pos, grad = self._in_partial, torch.is_grad_enabled()
        if pos == 0:
            readers = [reader]
            for nxt in self.readers[self.num_outputs + 1: self.num_outputs + self.block_size]:
                if not reader._can_share_phase_one(nxt) or any(nxt is r for r in readers):
                    break
                readers.append(nxt)
            params = [r._read_params() for r in readers]
            queries = torch.stack([q for q, _, _ in params])
            gains = None
            if params[0][1] is not None:
                gains = torch.stack([g for _, g, _ in params])
            # Reader 0's output norm (when it has one) is fused into phase 1:
            # partials[0] is its final read (docs/design.md §11).
            partials, lse = block_reads(self._completed, queries, gains, eps=reader.eps,
                                        out_weight=params[0][2], out_eps=reader.out_eps)
            if not grad:
                # Nothing made now is recomputed: keep only the entries with a
                # graph (a checkpointed layer's recomputation may need them).
                for key in [k for k, e in self._phase_one.items() if not e.with_grad]:
                    del self._phase_one[key]
            self._phase_one[num_completed] = _PhaseOne(self._completed[-1], tuple(readers),
                                                       list(partials), lse, grad)
            return partials[0]
        entry = self._phase_one.get(num_completed)
        if (entry is None or entry.last_completed is not self._completed[-1]
                or pos >= len(entry.readers) or entry.readers[pos] is not reader
                or entry.partials[pos] is None or (grad and not entry.with_grad)):
            # A phase 1 made without grad has no graph to give a read with grad.
            return self._read_one_call(reader)
        # Phase 2 fuses the reader's output norm when it has one (§11).
        query, gain, out_weight = reader._read_params()
        partial = entry.partials[pos]
        # The last output joins the partial sum inside the merge (§12).
        delta = self._take_pending()
        try:
            if grad or entry.with_grad or _inference_tensor_outside_inference_mode(partial):
                # Out of place (under no_grad the result has no graph; an
                # inference tensor cannot be written outside inference mode).
                out = block_read_merge(
                    partial, entry.lse[pos], self._partial, query, gain,
                    eps=reader.eps, out_weight=out_weight, out_eps=reader.out_eps, delta=delta)
            else:
                # Inference: h (y with an output norm) overwrites the partial
                # output it consumes (no new output allocated); a second read
                # at this position reads one-call.
                entry.partials[pos] = None
                out = block_read_merge_inplace(
                    partial, entry.lse[pos], self._partial, query, gain,
                    eps=reader.eps, out_weight=out_weight, out_eps=reader.out_eps, delta=delta)
        except BaseException:
            self._pending = delta  # a failed read leaves the stream as it was
            raise
        if delta is None:
            return out
        out, self._partial = out
        return out

    def _read_one_call(self, reader: "AttnResResidual") -> torch.Tensor:
        """A one-call read of the sources, the pending output added inside
        it (§12)."""
        delta = self._take_pending()
        if delta is None:
            return reader._one_call(self.sources)
        query, gain, out_weight = reader._read_params()
        try:
            out, self._partial = depth_attention(
                [*self._completed, self._partial], query, gain, eps=reader.eps,
                out_weight=out_weight, out_eps=reader.out_eps, delta=delta)
        except BaseException:
            self._pending = delta  # a failed read leaves the stream as it was
            raise
        return out

    def _checked_output(self, f, where: str = "append") -> torch.Tensor:
        if not isinstance(f, torch.Tensor):
            raise TypeError(f"DepthStream.{where} expects a tensor, got {type(f).__name__}")
        if f.shape != self.embedding.shape:
            raise ValueError(
                f"DepthStream.{where}: output has shape {list(f.shape)} but the stream's "
                f"embedding has shape {list(self.embedding.shape)}; every sublayer output "
                "must have the embedding's shape"
            )
        if f.device != self.device:
            raise ValueError(
                f"DepthStream.{where}: output is on device {f.device} but the stream is on "
                f"device {self.device}"
            )
        if f.dtype != self.dtype:
            if f.is_floating_point() and torch.is_autocast_enabled(f.device.type):
                return f.to(self.dtype)
            raise TypeError(
                f"DepthStream.{where}: output has dtype {f.dtype} but the stream's dtype "
                f"(its embedding's) is {self.dtype}; outside torch.autocast every output "
                "must have the stream dtype"
            )
        return f

    def __repr__(self) -> str:
        mode = "Full" if self.block_size is None else f"Block(S={self.block_size})"
        return (
            f"DepthStream({mode}, shape={list(self.shape)}, dtype={self.dtype}, "
            f"outputs={self.num_outputs}, sources={self.num_sources})"
        )


class AttnResResidual(nn.Module):
    """One depth-attention read: replaces the residual input of one sublayer
    (or, with its own instance, the network's final output).

    ``query`` starts at zero, so an untrained read is the uniform average of
    its sources. ``norm_weight`` is the RMSNorm gain of the keys (ones), or
    ``None`` with ``key_norm_affine=False``.

    ``out_norm="rmsnorm"`` makes the read return ``RMSNorm(h) * out_weight``
    (eps ``out_eps``; ``out_weight`` learnable, ones), the norm fused into
    the read's kernels (docs/design.md §11): use it in place of the
    sublayer's own pre-norm. ``out_weight`` is ``None`` without it.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        key_norm_affine: bool = True,
        out_norm: Optional[str] = None,
        out_eps: float = 1e-6,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int (the model width D), got {dim!r}")
        eps = ops._as_float(eps, "eps")
        if not (eps >= 0.0 and eps != float("inf")):
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
        if out_norm not in _OUT_NORMS:
            raise ValueError(f"out_norm must be None or 'rmsnorm', got {out_norm!r}")
        out_eps = ops._as_float(out_eps, "out_eps")
        if not (out_eps >= 0.0 and out_eps != float("inf")):
            raise ValueError(f"out_eps must be a finite number >= 0, got {out_eps}")
        factory = {"device": device, "dtype": dtype}
        self.dim = dim
        self.eps = float(eps)
        self.out_norm = out_norm
        self.out_eps = float(out_eps)
        self.query = nn.Parameter(torch.empty(dim, **factory))
        if key_norm_affine:
            self.norm_weight = nn.Parameter(torch.empty(dim, **factory))
        else:
            self.register_parameter("norm_weight", None)
        if out_norm is not None:
            self.out_weight = nn.Parameter(torch.empty(dim, **factory))
        else:
            self.register_parameter("out_weight", None)
        self.reset_parameters()

    def _read_params(self):
        """(query, norm_weight, out_weight), from ``_parameters`` directly: a
        read's host time is ~20 us, and nn.Module.__getattr__ costs ~0.4 us
        an access (about ten a read, design §10)."""
        p = self._parameters
        return p["query"], p["norm_weight"], p["out_weight"]

    def _can_share_phase_one(self, other) -> bool:
        """Whether ``other`` can be read in this reader's phase-1 call (one
        eps, stackable parameters of one tensor type: under FSDP2 another
        layer's parameters are sharded DTensors between its forwards)."""
        if not isinstance(other, AttnResResidual) or other.dim != self.dim or other.eps != self.eps:
            return False
        (q0, g0, w0), (q1, g1, w1) = self._read_params(), other._read_params()
        if (type(q1), q1.dtype, q1.device) != (type(q0), q0.dtype, q0.device):
            return False
        if (g0 is None) != (g1 is None) or (w0 is None) != (w1 is None):
            return False
        return g0 is None or g1.dtype == g0.dtype

    def _one_call(self, sources: List[torch.Tensor], return_weights: bool = False):
        query, gain, out_weight = self._read_params()
        return depth_attention(sources, query, gain, eps=self.eps,
                               return_weights=return_weights, out_weight=out_weight,
                               out_eps=self.out_eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        if self.norm_weight is not None:
            nn.init.ones_(self.norm_weight)
        if self.out_weight is not None:
            nn.init.ones_(self.out_weight)

    def forward(self, stream: DepthStream, return_weights: bool = False):
        """``h`` [..., D] in the stream dtype (``RMSNorm(h) * out_weight`` with
        an output norm); with ``return_weights`` also the depth softmax
        weights [num_sources, ...] (float32)."""
        if not isinstance(stream, DepthStream):
            raise TypeError(
                f"AttnResResidual expects an attnres.DepthStream, got {type(stream).__name__}"
            )
        if stream.width != self.dim:
            raise ValueError(
                f"AttnResResidual has width dim = {self.dim} but the DepthStream has width "
                f"D = {stream.width}"
            )
        if stream._rows is not None and torch.is_grad_enabled() and any(
                p is not None and p.requires_grad for p in self._read_params()):
            # A read with a graph saves views of the rows that later appends write.
            raise ValueError(
                "AttnResResidual: a read of a stream with block_storage under grad mode with "
                "parameters that require grad (the stream writes its rows in place: it is for "
                "inference); read under torch.no_grad() or torch.inference_mode(), or build the "
                "stream without block_storage"
            )
        if not torch.is_grad_enabled():
            _refuse_reentrant_checkpoint(stream)
        if return_weights or stream.block_size is None:
            return self._one_call(stream.sources, return_weights)
        return stream._read(self)

    def extra_repr(self) -> str:
        text = f"{self.dim}, eps={self.eps}, key_norm_affine={self.norm_weight is not None}"
        if self.out_norm is not None:
            text += f", out_norm={self.out_norm!r}, out_eps={self.out_eps}"
        return text


def _add_into_row(partial: torch.Tensor, f: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """partial + f written into a block_storage row, without a graph (the rows
    are for inference; under grad mode partial may have one)."""
    if not torch.is_grad_enabled():
        return torch.add(partial, f, out=row)
    with torch.no_grad():
        return torch.add(partial, f, out=row)


def _inference_tensor_outside_inference_mode(t: torch.Tensor) -> bool:
    # torch.compile cannot trace is_inference(): compiled reads skip the check
    # (dynamo's own advice is torch.no_grad rather than inference_mode).
    if torch.compiler.is_compiling():
        return False
    return t.is_inference() and not torch.is_inference_mode_enabled()


def _refuse_reentrant_checkpoint(stream: DepthStream) -> None:
    """Raises inside ``torch.utils.checkpoint(..., use_reentrant=True)`` when a
    source that needs a gradient is not one of its top-level tensor
    arguments: that form gives gradients only to those, so the source's
    would be lost without a word (its forward runs under no_grad)."""
    if torch.compiler.is_compiling():
        return
    # The stream's tensors as they are: reading `sources` would add a
    # deferred output here, outside the merge that fuses it (§12).
    held = [*stream._completed, stream._partial, stream._pending]
    needy = [t for t in held if t is not None and t.requires_grad]
    if not needy:
        return
    code = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return
    args = frame.f_locals.get("args", ())
    if all(any(t is a for a in args) for t in needy):
        return
    raise RuntimeError(
        "a DepthStream read inside torch.utils.checkpoint(..., use_reentrant=True): that "
        "form gives gradients only to top-level tensor arguments, so the stream's sources "
        "would get none. Use attnres.checkpoint(fn, stream, ...) (either form) or "
        "use_reentrant=False"
    )


def checkpoint(fn, stream: DepthStream, *args, use_reentrant: bool = False, **kwargs):
    """``torch.utils.checkpoint.checkpoint(fn, stream, *args)`` for a function
    of a :class:`DepthStream` (a layer that takes the stream and returns a
    new one, or any pytree of streams and tensors). ``fn`` must not append
    to the stream it is given: clone it first (the recomputation must see
    the same sources). With ``use_reentrant=True`` the stream travels as its
    tensors, the only arguments that form gives gradients to. Under
    ``torch.compile`` (either form, one graph) ``fn`` must return one stream
    with the input's block size and schedule (the layer contract)."""
    if not isinstance(stream, DepthStream):
        raise TypeError(f"attnres.checkpoint expects a DepthStream, got {type(stream).__name__}")
    if torch.compiler.is_compiling():
        return _checkpoint_traced(fn, stream, args, use_reentrant, kwargs)
    if not use_reentrant:
        return torch.utils.checkpoint.checkpoint(fn, stream, *args, use_reentrant=False, **kwargs)
    tensors, spec = stream.flatten()
    n = len(tensors)
    out_spec = []

    def run(*flat):
        inner = DepthStream.unflatten(flat[:n], spec)
        leaves, tree = torch.utils._pytree.tree_flatten(fn(inner, *flat[n:]))
        out_spec[:] = [tree]
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"attnres.checkpoint: fn must return streams and tensors, got {type(leaf).__name__}"
                )
        return tuple(leaves)

    leaves = torch.utils.checkpoint.checkpoint(run, *tensors, *args, use_reentrant=True, **kwargs)
    return torch.utils._pytree.tree_unflatten(list(leaves), out_spec[0])


def _checkpoint_traced(fn, stream: DepthStream, args, use_reentrant: bool, kwargs):
    """attnres.checkpoint under torch.compile. Dynamo's checkpoint region
    takes and returns tensors only and must not write to anything outside
    it, so the stream enters as its tensors (rebuilt without the checks,
    which would put symbolic sizes in Python conditions) and leaves as its
    tensors plus its number of outputs as the shape of an empty tensor (a
    trace-time constant). ``fn`` must follow the layer contract: return one
    stream with the input's block size and schedule."""
    tensors, spec = stream.flatten()
    n = len(tensors)

    def run(*flat):
        out = fn(_unflatten_leaves(flat[:n], spec), *flat[n:])
        if not isinstance(out, DepthStream) or (out.block_size, out.block_reads, out.readers) != (
                spec.block_size, spec.block_reads, spec.readers):
            raise TypeError(
                "attnres.checkpoint under torch.compile: fn must return one DepthStream with the "
                "stream's block_size, block_reads and readers (the layer contract), got "
                f"{type(out).__name__}"
            )
        return (*out.tensors(), flat[0].new_empty(out.num_outputs, 0))

    *leaves, count = torch.utils.checkpoint.checkpoint(run, *tensors, *args,
                                                       use_reentrant=use_reentrant, **kwargs)
    return _unflatten_leaves(leaves, spec._replace(num_outputs=count.shape[0]))


def _unflatten_leaves(leaves, spec: StreamSpec) -> DepthStream:
    """The pytree unflatten: like :meth:`DepthStream.unflatten` without its
    checks, since ``tree_map`` may put any value in a leaf's place."""
    leaves = list(leaves)
    S = spec.block_size
    partial_count = 0 if S is None else spec.num_outputs % S
    return DepthStream._build(leaves[0], leaves[:len(leaves) - (partial_count > 0)],
                              leaves[-1] if partial_count else None, partial_count,
                              spec.num_outputs, S, spec.block_reads, spec.readers, {})


torch.utils._pytree.register_pytree_node(
    DepthStream,
    lambda stream: stream.flatten(),
    _unflatten_leaves,
    serialized_type_name="attnres.DepthStream",
)
