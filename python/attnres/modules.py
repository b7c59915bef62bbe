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
from typing import Dict, List, Optional

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
_OUT_NORMS = (None, "rmsnorm")
_AUTO_ONE_CALL_TRAINING_DTYPES = (torch.bfloat16, torch.float16)
_TWO_PHASE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class _Token:
    """Identity of one forward pass's read state (compared with ``is``)."""

    __slots__ = ()


class _ReadState:
    """What a stream and all its clones share about the reads of one forward
    pass (docs/design.md §10): the phase-1 results by block (keyed by the
    number of completed sources) and the last read, from which readers learn
    their successors. Shared, so a checkpointed segment that starts mid-block
    uses the phase-1 result computed before it, and its recomputation takes
    the same path as its first run."""

    __slots__ = ("token", "entries", "last")

    def __init__(self):
        self.token = _Token()
        self.entries: Dict[int, tuple] = {}
        self.last: Optional[tuple] = None


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


class DepthStream:
    """The sources that later sublayers read, for one forward pass.

    ``block_size=None`` is Full AttnRes: the sources are the embedding and
    every sublayer output so far. ``block_size=S`` is Block AttnRes: the
    embedding, the sum of each completed block of S outputs, and (when it
    holds at least one output) the current block's partial sum.
    ``block_size=1`` gives the same sources as Full.

    dtype rule: every source has the embedding's dtype (the "stream dtype").
    Inside ``torch.autocast`` the sublayer outputs come out in the autocast
    dtype, so :meth:`append` casts them to the stream dtype there, the same
    way ``x + f`` promotes a bf16 ``f`` into an fp32 residual stream. Outside
    autocast a dtype mismatch is an error. Pass a bf16 embedding to keep the
    whole stream in bf16.

    The stream holds references, never copies: Full keeps each appended
    tensor itself; Block builds partial sums out of place so autograd sees
    every step.
    """

    def __init__(self, embedding: torch.Tensor, block_size: Optional[int] = None, *,
                 block_reads: str = "auto"):
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
        self.block_reads = block_reads
        self._reads = _ReadState()
        self.embedding = embedding
        self._completed: List[torch.Tensor] = [embedding]
        self._partial: Optional[torch.Tensor] = None
        self._in_partial = 0  # outputs summed into the current block so far
        self.num_outputs = 0  # sublayer outputs appended so far

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
        if self._partial is None:
            return list(self._completed)
        return [*self._completed, self._partial]

    @property
    def num_sources(self) -> int:
        return len(self._completed) + (self._partial is not None)

    def append(self, f: torch.Tensor) -> None:
        """Record the new output ``f`` of one sublayer (never a cumulative sum)."""
        f = self._checked_output(f)
        self.num_outputs += 1
        if self.block_size is None:
            self._completed.append(f)
            return
        self._partial = f if self._partial is None else self._partial + f
        self._in_partial += 1
        if self._in_partial == self.block_size:
            self._completed.append(self._partial)
            self._partial = None
            self._in_partial = 0

    def clone(self) -> "DepthStream":
        """A new stream with the same sources (tensors shared, lists copied).

        Appending to the clone leaves this stream as it is, which is what
        activation checkpointing needs: the recomputation must start from
        the sources the first run saw.
        """
        other = DepthStream.__new__(DepthStream)
        other.block_size = self.block_size
        other.block_reads = self.block_reads
        other._reads = self._reads  # shared: docs/design.md §10
        other.embedding = self.embedding
        other._completed = list(self._completed)
        other._partial = self._partial
        other._in_partial = self._in_partial
        other.num_outputs = self.num_outputs
        return other

    def _two_phase(self, num_completed: int) -> bool:
        """Whether the reads of the current block use the two-phase ops."""
        if self.block_size is None or self.block_size < 2 or self.block_reads == "one_call":
            return False
        if self.device.type not in ("cpu", "cuda") or self.dtype not in _TWO_PHASE_DTYPES:
            return False
        if self.device.type == "cuda":
            # CUDA kernels for every phase op, not yet run on a GPU: used when
            # asked for ("two_phase"), training included (design §10).
            return self.block_reads == "two_phase"
        if self.block_reads == "two_phase":
            return True
        if torch.is_grad_enabled() and self.dtype in _AUTO_ONE_CALL_TRAINING_DTYPES:
            return False
        return num_completed >= _AUTO_MIN_COMPLETED

    def _read(self, reader: "AttnResResidual") -> torch.Tensor:
        """h for ``reader`` (docs/design.md §10): phase 1 at the first read of
        a block, for the readers the first one has learned follow it; phase
        2 at a later read whose reader phase 1 included at this position;
        a one-call read otherwise (same result)."""
        state = self._reads
        pos, num_completed = self._in_partial, len(self._completed)
        last = state.last
        if pos > 0 and last is not None and last[1] == num_completed and last[2] == pos - 1:
            last[0]._learn_successor(reader, state.token)
        state.last = (reader, num_completed, pos)
        if not self._two_phase(num_completed):
            return reader._one_call(self.sources)
        if pos == 0:
            readers = [reader]
            nxt = reader._successor(state.token)
            while nxt is not None and len(readers) < self.block_size:
                if not reader._can_share_phase_one(nxt) or any(nxt is r for r in readers):
                    break
                readers.append(nxt)
                nxt = nxt._successor(state.token)
            params = [r._read_params() for r in readers]
            queries = torch.stack([q for q, _, _ in params])
            gains = None
            if params[0][1] is not None:
                gains = torch.stack([g for _, g, _ in params])
            # Reader 0's output norm (when it has one) is fused into phase 1:
            # partials[0] is its final read (docs/design.md §11).
            partials, lse = block_reads(self._completed, queries, gains, eps=reader.eps,
                                        out_weight=params[0][2], out_eps=reader.out_eps)
            if not torch.is_grad_enabled():
                state.entries.clear()  # nothing to recompute: keep one block's partials only
            state.entries[num_completed] = (self._completed[-1], readers, partials, lse)
            return partials[0]
        entry = state.entries.get(num_completed)
        if (entry is None or entry[0] is not self._completed[-1] or pos >= len(entry[1])
                or entry[1][pos] is not reader or entry[2][pos] is None):
            return reader._one_call(self.sources)
        # Phase 2 fuses the reader's output norm when it has one (§11).
        query, gain, out_weight = reader._read_params()
        if torch.is_grad_enabled():
            return block_read_merge(
                entry[2][pos], entry[3][pos], self._partial, query, gain,
                eps=reader.eps, out_weight=out_weight, out_eps=reader.out_eps)
        # Inference: h (y with an output norm) overwrites the partial output
        # it consumes (no new output allocated); a second read at this
        # position reads one-call.
        partial = entry[2][pos]
        entry[2][pos] = None
        return block_read_merge_inplace(
            partial, entry[3][pos], self._partial, query, gain,
            eps=reader.eps, out_weight=out_weight, out_eps=reader.out_eps)

    def _checked_output(self, f) -> torch.Tensor:
        if not isinstance(f, torch.Tensor):
            raise TypeError(f"DepthStream.append expects a tensor, got {type(f).__name__}")
        if f.shape != self.embedding.shape:
            raise ValueError(
                f"DepthStream.append: output has shape {list(f.shape)} but the stream's "
                f"embedding has shape {list(self.embedding.shape)}; every sublayer output "
                "must have the embedding's shape"
            )
        if f.device != self.device:
            raise ValueError(
                f"DepthStream.append: output is on device {f.device} but the stream is on "
                f"device {self.device}"
            )
        if f.dtype != self.dtype:
            if f.is_floating_point() and torch.is_autocast_enabled(f.device.type):
                return f.to(self.dtype)
            raise TypeError(
                f"DepthStream.append: output has dtype {f.dtype} but the stream's dtype "
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
        # The reader that read right after this one in the same block, as
        # learned from the streams (docs/design.md §10). Plain attributes,
        # not submodules: object.__setattr__ keeps nn.Module from
        # registering them. A link learned during one forward pass takes
        # effect from the next one, so an activation-checkpoint
        # recomputation takes the same path as its first run.
        object.__setattr__(self, "_next_reader", None)
        object.__setattr__(self, "_pending_next_reader", None)
        self.reset_parameters()

    def _learn_successor(self, reader: "AttnResResidual", token) -> None:
        if reader is not self._next_reader:
            object.__setattr__(self, "_pending_next_reader", (token, reader))
        elif self._pending_next_reader is not None:
            object.__setattr__(self, "_pending_next_reader", None)

    def _successor(self, token) -> Optional["AttnResResidual"]:
        pending = self._pending_next_reader
        if pending is not None and pending[0] is not token:
            object.__setattr__(self, "_next_reader", pending[1])
            object.__setattr__(self, "_pending_next_reader", None)
        return self._next_reader

    def _read_params(self):
        """(query, norm_weight, out_weight), from ``_parameters`` directly: a
        read's host time is ~20 us, and nn.Module.__getattr__ costs ~0.4 us
        an access (about ten a read, design §10)."""
        p = self._parameters
        return p["query"], p["norm_weight"], p["out_weight"]

    def _can_share_phase_one(self, other) -> bool:
        """Whether ``other`` can be read in this reader's phase-1 call (one
        eps, stackable parameters)."""
        if not isinstance(other, AttnResResidual) or other.dim != self.dim or other.eps != self.eps:
            return False
        (q0, g0, w0), (q1, g1, w1) = self._read_params(), other._read_params()
        if (q1.dtype, q1.device) != (q0.dtype, q0.device):
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
        if return_weights or stream.block_size is None:
            return self._one_call(stream.sources, return_weights)
        return stream._read(self)

    def extra_repr(self) -> str:
        text = f"{self.dim}, eps={self.eps}, key_norm_affine={self.norm_weight is not None}"
        if self.out_norm is not None:
            text += f", out_norm={self.out_norm!r}, out_eps={self.out_eps}"
        return text
