"""An implementation of depth attention written for the tests alone,
independently of attnres.reference and of the kernels (docs/design.md §1),
that is right for any finite input: each row is divided by a power of two
near its largest |entry| before its sum of squares and dot product are
taken, so nothing overflows or underflows in float64 even for float64
sources near 1e308. Gradients come from autograd through the same
expressions (the scale is a constant, and the expressions equal the plain
ones for any constant, so the derivatives are exact).

``acc`` picks the arithmetic: float64 (the ground truth) or float32 (an
fp32-accumulating evaluation of the same formulas, the yardstick of the
eager-relative rule in test_properties.py).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


class _Softmax0(torch.autograd.Function):
    """softmax over dim 0 whose backward is evaluated in the pivoted form:
    with p the source of the largest weight and sum_j a_j = 1,
        ds_i = a_i ((g_i - g_p) - sum_{j != p} a_j (g_j - g_p)).
    Autograd's a_i (g_i - sum_j a_j g_j) cancels |g| down to its rounding
    when one weight is near 1 (its error is then that of the rounding of
    sum_j a_j, times |g|): not accurate enough for a reference."""

    @staticmethod
    def forward(ctx, s):
        a = torch.softmax(s, dim=0)
        ctx.save_for_backward(a)
        return a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        p = a.argmax(dim=0, keepdim=True)  # the pivot per token
        g_p = torch.gather(g, 0, p)
        rel = g - g_p  # exactly 0 at the pivot
        total = (a * rel).sum(0, keepdim=True)  # the pivot's term is 0
        return a * (rel - total)


def _pow2_scale(v: torch.Tensor) -> torch.Tensor:
    """A power of two near max|v| per row (1 for all-zero or non-finite rows),
    as a constant (no gradient)."""
    with torch.no_grad():
        amax = v.abs().amax(-1, keepdim=True)
        ok = torch.isfinite(amax) & (amax > 0)
        _, exp = torch.frexp(torch.where(ok, amax, torch.ones_like(amax)))
        # 2^(e-1) <= max|v| < 2^e: the rows divided by it lie in [1, 2).
        return torch.ldexp(torch.ones_like(amax), (exp - 1).to(amax.dtype))


def depth_attention_ref(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    acc: torch.dtype = torch.float64,
    return_parts: bool = False,
):
    """h [..., D] (in ``acc``) and weights [N, ...] of depth attention.
    Differentiable in every tensor argument."""
    vs = [s.to(acc) for s in sources]
    u = query.to(acc) * scale
    if norm_weight is not None:
        u = u * norm_weight.to(acc)
    D = vs[0].shape[-1]
    scores, keys = [], []
    for v in vs:
        c = _pow2_scale(v)
        if eps > 0:
            # Only scale down: eps / c^2 must not overflow. Tiny rows are then
            # taken as they are (eps dominates their sum of squares).
            c = torch.clamp_min(c, 1.0)
        vc = v / c  # exact
        # r = 1/sqrt(mean(v^2) + eps) = 1/(c sqrt(mean(vc^2) + eps/c^2))
        root = torch.sqrt((vc * vc).sum(-1) / D + (eps / c.squeeze(-1)) / c.squeeze(-1))
        scores.append((vc * u).sum(-1) / root)  # s = r <u, v>
        keys.append(vc / root.unsqueeze(-1))  # r v, the unit-RMS key without gain
    s = torch.stack(scores)  # [N, ...]
    w = _Softmax0.apply(s)
    h = vs[0] * w[0].unsqueeze(-1)
    for i in range(1, len(vs)):
        h = h + vs[i] * w[i].unsqueeze(-1)
    if return_parts:
        return h, w, s, torch.stack(keys)
    return h, w


def parameter_grad_scales(sources, query, norm_weight, grad_out, grad_weights=None, *, eps=1e-6,
                          scale=1.0, return_z=False):
    """The sizes of the terms the query and gain gradients sum, in float64:
    scale * |gain| * sum size_i |k_i| (query) and scale * |query| * sum
    size_i |k_i| (gain), over tokens and sources, where size_i is the size of
    ds_i = a_i (dp_i - sum_j a_j dp_j) before its cancellation. sum_i ds_i = 0 for every
    token (softmax), so these gradients are cancellations wherever the keys
    agree; their error is measured against these sizes, not against the
    (possibly rounding-level) result. With return_z, also sum |ds_i| |k_i|
    itself (the size of the kernels' Z, docs/design.md §2)."""
    srcs = [s.detach().double() for s in sources]
    q = query.detach().double().requires_grad_(True)  # so that the scores have a graph
    g = norm_weight.detach().double() if norm_weight is not None else torch.ones_like(q)
    h, w, s, k = depth_attention_ref(srcs, q, g, eps=eps, scale=scale, return_parts=True)
    outs, gos = [h], [grad_out.double()]
    if grad_weights is not None:
        outs.append(w)
        gos.append(grad_weights.double())
    ds, dw = torch.autograd.grad(outs, [s, w], gos)
    # The size of ds_i before its cancellation: a_i (|dp_i| + |sum_j a_j dp_j|)
    # (dp = the gradient reaching the weights), at least |ds_i|.
    size = torch.maximum(ds.abs(), w * (dw.abs() + (w * dw).sum(0, keepdim=True).abs()))
    z = (size.detach().unsqueeze(-1) * k.abs()).reshape(-1, q.shape[0]).sum(0)
    if return_z:
        return abs(scale) * g.abs() * z, abs(scale) * q.detach().abs() * z, z
    return abs(scale) * g.abs() * z, abs(scale) * q.detach().abs() * z


def forward_and_grads(fn, sources, query, norm_weight, grad_out, grad_weights=None, **kw):
    """h, weights and the gradients [sources..., query, gain or None] of
    ``fn(sources, query, norm_weight, **kw) -> (h, weights)`` for the loss
    <grad_out, h> (+ <grad_weights, weights>), on fresh leaves."""
    srcs = [s.detach().clone().requires_grad_(True) for s in sources]
    q = query.detach().clone().requires_grad_(True)
    g = norm_weight.detach().clone().requires_grad_(True) if norm_weight is not None else None
    h, w = fn(srcs, q, g, **kw)
    outs, gos = [h], [grad_out.to(h.dtype)]
    if grad_weights is not None:
        outs.append(w)
        gos.append(grad_weights.to(w.dtype))
    leaves: List[torch.Tensor] = srcs + [q] + ([g] if g is not None else [])
    grads = torch.autograd.grad(outs, leaves, gos, allow_unused=True)
    grads = list(grads) + ([None] if g is None else [])
    return h.detach(), w.detach(), grads


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, computed on both divided by
    max|ref| so that values near 1e308 (or 1e-308) do not overflow (or
    underflow) the norms. NaN when either holds a NaN; 0 for 0 vs 0."""
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    m = ref.abs().max().item() if ref.numel() else 0.0
    if not (m > 0) or m == float("inf"):
        m = 1.0
    num = ((out / m) - (ref / m)).norm().item()
    den = (ref / m).norm().item()
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den
