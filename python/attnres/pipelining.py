"""Pipeline stages of a model whose layers take and return a DepthStream
(torch.distributed.pipelining; docs/design.md §3).

A stage of a standard transformer hands one hidden tensor to the next; an
AttnRes stage hands on every source the later reads need: Full, the
embedding and every output so far; Block, the embedding, the completed block
sums and the partial sum. Stages pass tensors, so a stage returns the stream's
tensors and the next one rebuilds the stream from them with the spec of the
boundary (the number of outputs appended before it), which the model fixes::

    stage = attnres.pipelining.StreamStage(blocks[4:8], outputs_before=8, block_size=S)
    torch.distributed.pipelining.PipelineStage(stage, stage_index, num_stages, device)

A boundary may fall inside a block. Tested with ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleLoopedBFS and ScheduleInterleavedZeroBubble
(tests/python/test_pipelining.py), and with checkpointed layers, compiled
stages and FSDP2 within a stage (test_pipelining_stack.py).

Cross-stage caching (interleaved schedules, Attention Residuals §4.1). With
V virtual stages per rank (stage i on rank i % P, C = P * V stages) the same
sources cross the same links again and again: stage i + P runs on the rank
that ran stage i, which already holds every *completed* source of stage i's
output stream (the embedding and the outputs, Full; the embedding and the
completed block sums, Block). A :class:`StreamCache` per rank, shared by the
rank's stages and built from the model's stage boundaries, lets each hop carry
only what the receiving rank does not hold: Full, the outputs appended since
the receiver's previous virtual stage ended; Block, the block sums completed
since then plus the current partial sum. Per microbatch:

* forward: stage i (with a later stage on its rank) puts its output stream's
  completed sources in the cache; stage i + P takes them, uses detached
  copies of them (leaves of its own graph) and receives the rest;
* backward: the leaves' gradients go back to stage i as extra output
  gradients of its graph. Stage i's sent outputs pass through an identity
  autograd function (``_Tap``) whose backward also returns, for each cached
  tensor, the gradient its leaf in stage i + P accumulated, which runs
  before stage i's backward (stage i's output gradient depends on it). So a
  cached source's gradient reaches the stage that received or produced it,
  and travels back over a link only with the tensors that crossed it.

Stages run under :class:`StreamPipelineStage`, a ``PipelineStage`` that tells
the cache which microbatch runs (``forward_one_chunk``'s ``fwd_chunk_id``)::

    cache = attnres.pipelining.StreamCache(boundaries=[0, 2, 4, 5, 7], num_ranks=2)
    stage = attnres.pipelining.StreamStage(layers[4:5], outputs_before=4, block_size=3, cache=cache)
    attnres.pipelining.StreamPipelineStage(stage, 2, 4, device)

With V = 1 (GPipe, 1F1B) nothing is cached and every hop is as without it.

What torch.distributed.pipelining (2.11) does not offer, and what stands in:

* a stage module cannot learn the microbatch it runs: only
  ``PipelineStage.forward_one_chunk`` gets the id (``StreamPipelineStage``
  overrides it; shape inference calls the module outside it, under no_grad,
  and uses the cache's ``None`` slot);
* a stage's backward takes gradients only for the outputs it sends to the
  next stage (``stage_backward(stage_output, output_grads, ...)``), so there
  is no way to feed extra output gradients (from a later stage on the same
  rank) into a stage's graph: ``_Tap`` carries them inside the graph;
* stages exchange tensors only with the adjacent stages (stage i receives
  from i - 1 alone), so a later stage cannot name a tensor it got earlier:
  the cache shares it through the rank's memory instead;
* the split backward of the zero-bubble schedules (``backward_one_chunk(...,
  full_backward=False)``) computes input gradients with ``autograd.grad`` over
  the received inputs only, so the cached leaves get no ``.grad``:
  ``StreamPipelineStage`` refuses it for a cached stage.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .modules import DepthStream, StreamSpec


def _num_completed(num_outputs: int, block_size: Optional[int]) -> int:
    """Completed sources of a stream after ``num_outputs`` outputs: the
    embedding and every output (Full) or every completed block sum (Block)."""
    return 1 + (num_outputs if block_size is None else num_outputs // block_size)


class _Record:
    """One microbatch's completed sources of one stage's output stream, kept
    for the rank's next stage: ``tensors`` (in the producing stage's graph)
    and ``leaves`` (the detached copies the next stage used)."""

    __slots__ = ("tensors", "leaves")

    def __init__(self, tensors: List[torch.Tensor]):
        self.tensors: Optional[List[torch.Tensor]] = tensors
        self.leaves: Optional[List[torch.Tensor]] = None

    def take_grads(self) -> List[Optional[torch.Tensor]]:
        n = len(self.tensors) if self.tensors is not None else 0
        grads: List[Optional[torch.Tensor]] = [None] * n
        if self.leaves is not None:
            for j, leaf in enumerate(self.leaves):
                grads[j], leaf.grad = leaf.grad, None
        self.tensors = self.leaves = None
        return grads


class _Tap(torch.autograd.Function):
    """Identity on the sent outputs; its backward also gives each cached
    tensor the gradient of its copy in the rank's next stage."""

    @staticmethod
    def forward(ctx, record: _Record, num_sent: int, *tensors: torch.Tensor):
        ctx.record = record
        return tuple(t.view_as(t) for t in tensors[:num_sent])

    @staticmethod
    def backward(ctx, *grads):
        if ctx.record.tensors is None:  # the leaves' gradients were handed on already
            raise RuntimeError(
                "a cached StreamStage's output graph takes one backward per forward (its cached "
                "sources' gradients are handed back once): retain_graph and a second backward "
                "are not supported"
            )
        return (None, None, *grads, *ctx.record.take_grads())


class StreamCache:
    """Per-rank store of the sources a rank's stages share (module docstring).

    ``boundaries``: the outputs appended before each stage, then the total
    ([0, b1, ..., L]; strictly increasing: no empty stage), the same on every
    rank; ``num_ranks``: P, stage i on rank i % P (the interleaved layout).
    Each rank builds its own and passes it to each of its
    :class:`StreamStage` modules; they look up their stage by
    ``outputs_before``. Records are keyed by microbatch (set by
    :class:`StreamPipelineStage`, or by hand with :meth:`microbatch`) and
    dropped once the later stage took them.
    """

    def __init__(self, boundaries: Sequence[int], num_ranks: int):
        boundaries = list(boundaries)
        if (len(boundaries) < 2 or any(isinstance(b, bool) or not isinstance(b, int) for b in boundaries)
                or boundaries[0] != 0 or any(a >= b for a, b in zip(boundaries, boundaries[1:]))):
            raise ValueError(
                f"boundaries must be ints [0, b1, ..., L], strictly increasing (no empty stage), "
                f"got {boundaries!r}"
            )
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 2:
            raise ValueError(f"num_ranks must be an int >= 2 (one rank has no links), got {num_ranks!r}")
        self.boundaries = tuple(boundaries)
        self.num_ranks = num_ranks
        self.num_stages = len(boundaries) - 1
        self._records: Dict[Tuple[Optional[int], int], _Record] = {}
        self._microbatch: Optional[int] = None

    @contextlib.contextmanager
    def microbatch(self, index: Optional[int]):
        """Runs the rank's stages for microbatch ``index`` inside it."""
        previous, self._microbatch = self._microbatch, index
        try:
            yield self
        finally:
            self._microbatch = previous

    def stage_index(self, outputs_before: int) -> int:
        try:
            return self.boundaries.index(outputs_before)
        except ValueError:
            raise ValueError(
                f"outputs_before={outputs_before} is not a stage boundary of the cache "
                f"{list(self.boundaries[:-1])}"
            ) from None

    def held_before(self, stage: int) -> Optional[int]:
        """The outputs of the stream that ``stage``'s rank held before it ran
        (its previous virtual stage's output), or None (its first stage)."""
        return self.boundaries[stage - self.num_ranks + 1] if stage >= self.num_ranks else None

    def clear(self) -> None:
        """Drops every record (e.g. after a step that raised)."""
        self._records.clear()

    def _key(self, stage: int, what: str) -> Tuple[Optional[int], int]:
        if self._microbatch is None and torch.is_grad_enabled():
            raise RuntimeError(
                f"StreamCache: stage {stage} {what} cached sources without a microbatch: run the "
                "stages under attnres.pipelining.StreamPipelineStage (or inside "
                "cache.microbatch(m) when calling them by hand)"
            )
        return (self._microbatch, stage)

    def _put(self, stage: int, record: _Record) -> None:
        key = self._key(stage, "keeps")
        if key[0] is None and key in self._records:
            raise RuntimeError(
                f"StreamCache: stage {stage} ran twice outside a microbatch before stage "
                f"{stage + self.num_ranks} took its sources: run the stages under "
                "attnres.pipelining.StreamPipelineStage (or inside cache.microbatch(m))"
            )
        self._records[key] = record  # an int key left over from a step that raised is replaced

    def _take(self, stage: int) -> _Record:
        key = (self._key(stage + self.num_ranks, "takes")[0], stage)
        record = self._records.pop(key, None)
        if record is None:
            raise RuntimeError(
                f"StreamCache: no sources of stage {stage} for microbatch {key[0]} (stage "
                f"{stage + self.num_ranks} needs them): the rank's stages must share one "
                "StreamCache, and stage i must run before stage i + num_ranks"
            )
        return record

    def __repr__(self) -> str:
        return f"StreamCache(boundaries={list(self.boundaries)}, num_ranks={self.num_ranks})"


class StreamStage(nn.Module):
    """The layers ``[first, last)`` of a model as one pipeline stage.

    ``outputs_before``: sublayer outputs appended before this stage (0 for
    the first stage, which builds the stream: from ``embed(*inputs)``, or
    from its one input tensor without ``embed``). Later stages take the
    previous stage's tensors. The last stage returns ``head(stream)`` (the
    final read and whatever follows it); the others return
    ``tuple(stream.tensors())``. Each layer takes a stream and returns a new
    one (the layer contract).

    ``cache``: the rank's :class:`StreamCache` (cross-stage caching for
    interleaved schedules, module docstring). Then a stage takes only the
    sources its rank does not hold and returns only those the next stage's
    rank does not hold; run it under :class:`StreamPipelineStage`. The cache
    steps are Python side effects: ``torch.compile`` of such a stage breaks
    the graph there (``fullgraph=True`` refuses it); compile its layers.
    """

    def __init__(self, layers: Sequence[nn.Module], *, outputs_before: int,
                 block_size: Optional[int] = None, block_reads: str = "auto",
                 embed: Optional[nn.Module] = None, head: Optional[nn.Module] = None,
                 cache: Optional[StreamCache] = None):
        super().__init__()
        if isinstance(outputs_before, bool) or not isinstance(outputs_before, int) or outputs_before < 0:
            raise ValueError(f"outputs_before must be an int >= 0, got {outputs_before!r}")
        if embed is not None and outputs_before:
            raise ValueError("embed belongs to the first stage (outputs_before=0)")
        if cache is not None and not isinstance(cache, StreamCache):
            raise TypeError(f"cache must be an attnres.pipelining.StreamCache, got {type(cache).__name__}")
        self.layers = nn.ModuleList(layers)
        self.embed, self.head = embed, head
        # The stream's own checks of block_size and block_reads ("two_phase"
        # needs declared readers, which a stage's stream cannot have).
        DepthStream(torch.zeros(1, 1), block_size, block_reads=block_reads)
        self.spec = StreamSpec(block_size, outputs_before, block_reads, None)
        self.cache = cache
        self.stage_index = cache.stage_index(outputs_before) if cache is not None else None

    def forward(self, *inputs: torch.Tensor):
        cache, i = self.cache, self.stage_index
        if self.spec.num_outputs == 0:
            x = self.embed(*inputs) if self.embed is not None else inputs[0]
            stream = DepthStream(x, self.spec.block_size, block_reads=self.spec.block_reads)
        elif cache is not None and cache.held_before(i) is not None:
            record = cache._take(i - cache.num_ranks)
            # Leaves of this stage's graph; their gradients go back to the
            # stage that kept the tensors (_Tap), not over a link.
            record.leaves = [t.detach().requires_grad_(t.requires_grad) for t in record.tensors]
            stream = DepthStream.unflatten([*record.leaves, *inputs], self.spec)
        else:
            stream = DepthStream.unflatten(inputs, self.spec)
        for layer in self.layers:
            stream = layer(stream)
            if not isinstance(stream, DepthStream):
                raise TypeError(
                    f"a StreamStage layer must return the DepthStream (the layer contract), "
                    f"got {type(stream).__name__} from {type(layer).__name__}"
                )
        if self.head is not None:
            return self.head(stream)
        sources = stream.tensors()
        if cache is None or i + 1 == cache.num_stages:
            return tuple(sources)
        if stream.num_outputs != cache.boundaries[i + 1]:
            raise ValueError(
                f"StreamStage {i}: its layers appended up to output {stream.num_outputs}, but the "
                f"cache's boundaries end the stage at {cache.boundaries[i + 1]}"
            )
        held = cache.held_before(i + 1)
        sent = sources[_num_completed(held, self.spec.block_size):] if held is not None else sources
        if i + cache.num_ranks >= cache.num_stages:
            return tuple(sent)
        kept = sources[:_num_completed(stream.num_outputs, self.spec.block_size)]
        record = _Record(kept)
        cache._put(i, record)
        return tuple(_Tap.apply(record, len(sent), *sent, *kept))

    def extra_repr(self) -> str:
        text = f"outputs_before={self.spec.num_outputs}, block_size={self.spec.block_size}"
        if self.cache is not None:
            text += f", cache={self.cache!r}"
        return text


def _stream_cache_of(module: nn.Module) -> Tuple[Optional[StreamCache], Optional["StreamStage"]]:
    for m in module.modules():  # through DDP/FSDP wrappers
        if isinstance(m, StreamStage) and m.cache is not None:
            return m.cache, m
    return None, None


_STREAM_PIPELINE_STAGE = None


def __getattr__(name: str):
    # StreamPipelineStage subclasses torch.distributed.pipelining.PipelineStage,
    # whose import costs about a second: made on first use, not at import.
    global _STREAM_PIPELINE_STAGE
    if name != "StreamPipelineStage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _STREAM_PIPELINE_STAGE is None:
        _STREAM_PIPELINE_STAGE = _make_stream_pipeline_stage()
    return _STREAM_PIPELINE_STAGE


def _make_stream_pipeline_stage():
    from torch.distributed.pipelining import PipelineStage

    class StreamPipelineStage(PipelineStage):
        """``torch.distributed.pipelining.PipelineStage`` (same arguments)
        for a :class:`StreamStage` with a ``cache``: runs each forward inside
        ``cache.microbatch(fwd_chunk_id)``. Refuses the split (input /
        weight) backward of the zero-bubble schedules, which would not give
        the cached sources their gradients. Without a cache, a plain
        ``PipelineStage``."""

        def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, *args, **kwargs):
            super().__init__(submodule, stage_index, num_stages, *args, **kwargs)
            self._stream_cache, stage = _stream_cache_of(submodule)
            if stage is not None and (stage.stage_index != stage_index
                                      or self._stream_cache.num_stages != num_stages):
                raise ValueError(
                    f"StreamPipelineStage: stage {stage_index} of {num_stages}, but its StreamStage "
                    f"is stage {stage.stage_index} of {self._stream_cache.num_stages} by its cache"
                )

        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            if self._stream_cache is None:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            with self._stream_cache.microbatch(fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                               last_backward=False):
            if self._stream_cache is not None and not full_backward:
                raise NotImplementedError(
                    "StreamPipelineStage: a cached StreamStage needs the full backward (its cached "
                    "sources' gradients are leaves' .grad); the split input/weight backward of the "
                    "zero-bubble schedules computes only the received inputs' gradients"
                )
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    return StreamPipelineStage
