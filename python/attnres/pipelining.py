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

A boundary may fall inside a block. Tested with ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .modules import DepthStream, StreamSpec


class StreamStage(nn.Module):
    """The layers ``[first, last)`` of a model as one pipeline stage.

    ``outputs_before``: sublayer outputs appended before this stage (0 for
    the first stage, which builds the stream: from ``embed(*inputs)``, or
    from its one input tensor without ``embed``). Later stages take the
    previous stage's tensors. The last stage returns ``head(stream)`` (the
    final read and whatever follows it); the others return
    ``tuple(stream.tensors())``. Each layer takes a stream and returns a new
    one (the layer contract).
    """

    def __init__(self, layers: Sequence[nn.Module], *, outputs_before: int,
                 block_size: Optional[int] = None, block_reads: str = "auto",
                 embed: Optional[nn.Module] = None, head: Optional[nn.Module] = None):
        super().__init__()
        if isinstance(outputs_before, bool) or not isinstance(outputs_before, int) or outputs_before < 0:
            raise ValueError(f"outputs_before must be an int >= 0, got {outputs_before!r}")
        if embed is not None and outputs_before:
            raise ValueError("embed belongs to the first stage (outputs_before=0)")
        self.layers = nn.ModuleList(layers)
        self.embed, self.head = embed, head
        # The stream's own checks of block_size and block_reads ("two_phase"
        # needs declared readers, which a stage's stream cannot have).
        DepthStream(torch.zeros(1, 1), block_size, block_reads=block_reads)
        self.spec = StreamSpec(block_size, outputs_before, block_reads, None)

    def forward(self, *inputs: torch.Tensor):
        if self.spec.num_outputs == 0:
            x = self.embed(*inputs) if self.embed is not None else inputs[0]
            stream = DepthStream(x, self.spec.block_size, block_reads=self.spec.block_reads)
        else:
            stream = DepthStream.unflatten(inputs, self.spec)
        for layer in self.layers:
            stream = layer(stream)
            if not isinstance(stream, DepthStream):
                raise TypeError(
                    f"a StreamStage layer must return the DepthStream (the layer contract), "
                    f"got {type(stream).__name__} from {type(layer).__name__}"
                )
        return self.head(stream) if self.head is not None else tuple(stream.tensors())

    def extra_repr(self) -> str:
        return f"outputs_before={self.spec.num_outputs}, block_size={self.spec.block_size}"
