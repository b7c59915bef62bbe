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
from typing import List, Optional

import torch
from torch import nn

from . import ops
from .ops import depth_attention


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

    def __init__(self, embedding: torch.Tensor, block_size: Optional[int] = None):
        if not isinstance(embedding, torch.Tensor):
            raise TypeError(f"embedding must be a tensor [..., D], got {type(embedding).__name__}")
        if embedding.dim() < 1 or embedding.shape[-1] == 0:
            raise ValueError(
                f"embedding must have shape [..., D] with D > 0, got {list(embedding.shape)}"
            )
        if not embedding.is_floating_point():
            raise TypeError(f"embedding must be a floating-point tensor, got {embedding.dtype}")
        self.block_size = _check_block_size(block_size)
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
        other.embedding = self.embedding
        other._completed = list(self._completed)
        other._partial = self._partial
        other._in_partial = self._in_partial
        other.num_outputs = self.num_outputs
        return other

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
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        key_norm_affine: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int (the model width D), got {dim!r}")
        eps = ops._as_float(eps, "eps")
        if not (eps >= 0.0 and eps != float("inf")):
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
        factory = {"device": device, "dtype": dtype}
        self.dim = dim
        self.eps = float(eps)
        self.query = nn.Parameter(torch.empty(dim, **factory))
        if key_norm_affine:
            self.norm_weight = nn.Parameter(torch.empty(dim, **factory))
        else:
            self.register_parameter("norm_weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        if self.norm_weight is not None:
            nn.init.ones_(self.norm_weight)

    def forward(self, stream: DepthStream, return_weights: bool = False):
        """``h`` [..., D] in the stream dtype; with ``return_weights`` also the
        depth softmax weights [num_sources, ...] (float32)."""
        if not isinstance(stream, DepthStream):
            raise TypeError(
                f"AttnResResidual expects an attnres.DepthStream, got {type(stream).__name__}"
            )
        if stream.width != self.dim:
            raise ValueError(
                f"AttnResResidual has width dim = {self.dim} but the DepthStream has width "
                f"D = {stream.width}"
            )
        return depth_attention(
            stream.sources, self.query, self.norm_weight, eps=self.eps,
            return_weights=return_weights,
        )

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, key_norm_affine={self.norm_weight is not None}"
