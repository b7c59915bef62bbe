"""Plain eager PyTorch depth attention: the ground truth for tests and the
baseline for benchmarks. Same signature as :func:`attnres.depth_attention`.

It stacks the sources and materializes the normalized keys, which is exactly
what the fused op avoids; it is written for clarity, not speed.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Sources = Union[Sequence[torch.Tensor], torch.Tensor]


def depth_attention(
    sources: Sources,
    query: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    return_weights: bool = False,
):
    v = sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    vf = v.to(acc)
    rstd = torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)  # [N, ..., 1]
    keys = vf * rstd
    if norm_weight is not None:
        keys = keys * norm_weight.to(acc)
    scores = scale * (keys * query.to(acc)).sum(-1)  # [N, ...]
    weights = torch.softmax(scores, dim=0)
    h = (weights.unsqueeze(-1) * vf).sum(0).to(v.dtype)
    if return_weights:
        return h, weights.to(torch.float32)
    return h
