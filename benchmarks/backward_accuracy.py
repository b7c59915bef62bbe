"""Accuracy of the source, query and gain gradients against float64, per
dtype, for the attnres build on the Python path and for the eager reference
in the same dtype (docs/design.md §8: how h is saved for the single-pass
backward was chosen with this script).

    python benchmarks/backward_accuracy.py [--json out.json]

Cases: random sources; a dominant weight (one source scored far above the
rest: the pivoted form); a large component common to all sources (the
dp_j share a large part: where the plain form of ds cancels); mixed
magnitudes. Per case, the largest relative norm error over all gradients.
Run it with two builds on the path (e.g. before and after a kernel change)
and compare the JSON files: ours/eager is the FlashAttention-style rule.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from float64_reference import depth_attention_ref  # noqa: E402

import attnres  # noqa: E402
from attnres import reference  # noqa: E402


def rel_err(a, r):
    a, r = a.double(), r.double()
    return ((a - r).norm() / r.norm().clamp_min(1e-300)).item()


def grads(fn, srcs, q, g, dh):
    xs = [s.detach().clone().requires_grad_(True) for s in srcs]
    qq = q.detach().clone().requires_grad_(True)
    gg = g.detach().clone().requires_grad_(True)
    out = fn(xs, qq, gg)
    h = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(h, [*xs, qq, gg], dh.to(h.dtype))


def case_inputs(kind, dtype, N, T, D, gen):
    pd = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    base = torch.randn(N, T, D, generator=gen, dtype=torch.float64)
    q = torch.randn(D, generator=gen, dtype=torch.float64) / math.sqrt(D)
    if kind == "dominant":
        # Source 0 aligned with the query and a large scale: a_0 ~ 1 - 1e-3.
        base[0] = base[0] * 0.3 + 3.0 * q.sign()
        q = q * 4.0
    elif kind == "common":
        # A large part shared by every source: dp_j = C + small_j.
        base = base * 0.05 + 20.0 * torch.randn(1, T, D, generator=gen, dtype=torch.float64)
        q = q * 30.0
    elif kind == "mixed":
        mags = torch.logspace(-3, 3, N, dtype=torch.float64).view(N, 1, 1)
        base = base * mags
    g = 1 + 0.2 * torch.randn(D, generator=gen, dtype=torch.float64)
    srcs = [base[i].to(dtype) for i in range(N)]
    dh = torch.randn(T, D, generator=gen, dtype=torch.float64).to(dtype)
    return srcs, q.to(pd), g.to(pd), dh


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for kind in ("random", "dominant", "common", "mixed"):
            for N, T, D in ((2, 64, 64), (9, 64, 1000), (65, 16, 256)):
                seed = 100000 * ("random", "dominant", "common", "mixed").index(kind) + 1000 * N + D
                gen = torch.Generator().manual_seed(seed)
                srcs, q, g, dh = case_inputs(kind, dtype, N, T, D, gen)
                if kind == "mixed" and dtype == torch.float16:
                    continue  # 1e3 * randn overflows float16's range in the eager squares
                ref = grads(lambda s, a, b: depth_attention_ref(s, a, b, scale=1.0)[0],
                            [s.double() for s in srcs], q.double(), g.double(), dh.double())
                ours = grads(lambda s, a, b: attnres.depth_attention(s, a, b), srcs, q, g, dh)
                eager = grads(lambda s, a, b: reference.depth_attention(s, a, b), srcs, q, g, dh)
                e_ours = max(rel_err(a, r) for a, r in zip(ours, ref))
                e_eager = max(rel_err(a, r) for a, r in zip(eager, ref))
                rows.append(dict(dtype=str(dtype).split(".")[-1], kind=kind, N=N, T=T, D=D,
                                 ours=e_ours, eager=e_eager))
                print(f"{rows[-1]['dtype']:9s} {kind:9s} N={N:2d} D={D:4d}  ours {e_ours:.3g}  "
                      f"eager {e_eager:.3g}  ours/eager {e_ours / max(e_eager, 1e-300):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
