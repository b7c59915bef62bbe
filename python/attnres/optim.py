"""Optimizer parameter groups for models with Attention Residuals.

The depth logits of a read are ``query . RMSNorm(k) * gain`` summed over D
channels, so an Adam step of size ``lr`` on every channel of the query (or the
key-norm gain) moves a logit by up to about ``lr * D``: at a transformer's
usual learning rate the depth softmax turns sharp within the first steps,
long before the sublayers have learned what is worth reading. A smaller
learning rate for these parameters (and no weight decay: zero queries and
unit gains are the neutral point, not zero) lets the reads follow the
sublayers instead.
"""
from __future__ import annotations

import math
from typing import Dict, List

from torch import nn

from .modules import AttnResResidual


def param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    attnres_lr_scale: float = 0.1,
) -> List[Dict]:
    """Parameter groups for ``torch.optim`` optimizers (AdamW and the like).

    * ``"decay"``: every trainable parameter with two or more dimensions
      (weight matrices, embeddings), learning rate ``lr``, ``weight_decay``;
    * ``"no_decay"``: the other trainable parameters (biases, norm gains),
      learning rate ``lr``, no weight decay;
    * ``"attnres"``: the query and key-norm gain of every
      :class:`attnres.AttnResResidual` in ``model``, learning rate
      ``lr * attnres_lr_scale``, no weight decay.

    Each group carries its own ``"lr"``, so ``torch.optim.lr_scheduler``
    schedules scale all three alike and keep the ratio. Empty groups are left
    out; a parameter shared between modules (a tied head) appears once;
    parameters with ``requires_grad=False`` are left out.
    ``attnres_lr_scale=0`` freezes the reads at their initial values (zero
    queries: the uniform average of the sources).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("attnres_lr_scale", attnres_lr_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    # A read's query and key-norm gain; its out_weight is a pre-norm's gain
    # (the sublayer's norm fused into the read) and stays with the norm gains.
    attnres_ids = {
        id(module._parameters[name]) for module in model.modules()
        if isinstance(module, AttnResResidual)
        for name in ("query", "norm_weight") if module._parameters[name] is not None
    }
    decay, no_decay, attnres = [], [], []
    seen = set()
    for p in model.parameters():  # already deduplicated by identity (tied weights once)
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in attnres_ids:
            attnres.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)

    groups = [
        {"name": "decay", "params": decay, "lr": lr, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "lr": lr, "weight_decay": 0.0},
        {"name": "attnres", "params": attnres, "lr": lr * attnres_lr_scale, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
