"""Bytes sent between pipeline stages, naive vs cross-stage caching.

    PYTHONPATH=python python benchmarks/pipeline_traffic.py [--out benchmarks/results/pipeline_traffic.txt]

For P ranks and V virtual stages per rank (C = P * V stages, stage i on rank
i % P, the interleaved layout), Full and Block AttnRes (S in 2, 4, 8), a model
of L sublayers cut evenly into C stages (boundaries inside blocks where L / C
is not a multiple of S). Method: the real attnres.pipelining.StreamStage
modules run in one process, stage by stage per microbatch as a schedule runs
them (each stage's received tensors are fresh leaves, as a PipelineStage's
receive buffers; backward in reverse stage order), without a StreamCache
(naive) and with one per rank (cached). A hop's forward traffic is the
tensors the sending stage returns (what PipelineStage sends: every returned
tensor); its backward traffic is the gradients of the receiving stage's
inputs (what PipelineStage sends back: one per received tensor), both
counted from the tensors themselves. The shapes are small (a microbatch of
[1, 4] tokens, D = 16, float32: 256 bytes a tensor); bytes scale with
tokens * D * itemsize, so the table also gives MiB at [1, 4096] tokens,
D = 4096, bf16 (32 MiB a tensor), scaled, not run.

Paper (Attention Residuals §4.1, cross-stage caching): without caching the
peak per-transition traffic grows with the number of chunks C (the last hops
carry almost every block); with it, with the number of ranks P (a hop carries
the blocks produced in the P - 1 stages since the receiving rank's previous
stage). Target here: at V = 2 the cached peak hop is at most 1/V of the naive
peak plus one block (one source tensor).
"""
from __future__ import annotations

import argparse
import platform
import re
import sys
from pathlib import Path

import torch

import attnres
from attnres.pipelining import StreamCache, StreamStage

L = 64
TOKENS, D, DTYPE = 4, 16, torch.float32
MICROBATCHES = 2
BIG_TENSOR_MIB = 4096 * 4096 * 2 / 2**20  # [1, 4096] tokens, D = 4096, bf16


class Sublayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.res = attnres.AttnResResidual(D)
        self.proj = torch.nn.Linear(D, D)

    def forward(self, stream):
        stream = stream.clone()
        stream.append(torch.tanh(self.proj(self.res(stream))))
        return stream


def cpu_name() -> str:
    model = platform.processor() or "cpu"
    try:
        m = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
        if m:
            model = m.group(1).strip()
    except OSError:
        pass
    n = torch.get_num_threads()
    return f"{model} ({n} thread{'' if n == 1 else 's'})"


def measure(P: int, V: int, S, cached: bool):
    """Per hop j = 1 .. C-1: (forward bytes, backward bytes, forward tensors)
    for one microbatch (the same for each; checked)."""
    torch.manual_seed(0)
    C = P * V
    cuts = [round(i * L / C) for i in range(C + 1)]
    layers = torch.nn.ModuleList(Sublayer() for _ in range(L)).to(DTYPE)
    final = attnres.AttnResResidual(D, dtype=DTYPE)
    caches = [StreamCache(cuts, P) if cached else None for _ in range(P)]
    stages = [StreamStage(layers[cuts[i]:cuts[i + 1]], outputs_before=cuts[i], block_size=S,
                          head=final if i == C - 1 else None, cache=caches[i % P])
              for i in range(C)]
    per_mb = []
    for m in range(MICROBATCHES):
        x = torch.randn(1, TOKENS, D, dtype=DTYPE)
        inputs, outputs = [(x,)], []
        for i in range(C):
            if i:
                inputs.append(tuple(t.detach().requires_grad_() for t in outputs[-1]))
            if cached:
                with caches[i % P].microbatch(m):
                    outputs.append(stages[i](*inputs[-1]))
            else:
                outputs.append(stages[i](*inputs[-1]))
        outputs[-1].pow(2).sum().backward()
        for i in range(C - 2, -1, -1):
            pairs = [(o, t.grad) for o, t in zip(outputs[i], inputs[i + 1]) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        hops = []
        for j in range(1, C):
            fwd = outputs[j - 1]
            grads = [t.grad for t in inputs[j]]
            assert all(g is not None for g in grads)  # PipelineStage sends one per input
            hops.append((sum(t.numel() * t.element_size() for t in fwd),
                         sum(g.numel() * g.element_size() for g in grads), len(fwd)))
        per_mb.append(hops)
    assert all(h == per_mb[0] for h in per_mb)
    return per_mb[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensor_bytes = TOKENS * D * torch.finfo(DTYPE).bits // 8
    lines = [
        "# Pipeline traffic: naive vs cross-stage caching (benchmarks/pipeline_traffic.py)",
        f"machine: {cpu_name()}; torch {torch.__version__}; Python {platform.python_version()}",
        f"method: attnres.pipelining.StreamStage modules run in one process (no real send), "
        f"L = {L} sublayers cut evenly into C = P*V stages (stage i on rank i % P), "
        f"{MICROBATCHES} microbatches of [1, {TOKENS}] tokens, D = {D}, {str(DTYPE)[6:]} "
        f"({tensor_bytes} B a source tensor); a hop's bytes are those of the tensors the "
        "sending stage returns (forward) plus the gradients of the receiving stage's inputs "
        "(backward), counted from the tensors; every microbatch sends the same.",
        f"columns: peak = the largest hop (forward bytes of one microbatch; backward the same), "
        f"in tensors and bytes; step = all hops, forward + backward, all {MICROBATCHES} "
        f"microbatches; MiB@4k = the peak hop at [1, 4096] tokens, D = 4096, bf16 "
        f"({BIG_TENSOR_MIB:.0f} MiB a tensor; scaled, not run); target = cached peak <= "
        "naive peak / V + one block (one tensor).",
        "paper (Attention Residuals §4.1): peak per-transition traffic O(C) naive -> O(P) "
        "cached, C = P*V chunks.",
        "",
        f"{'mode':<9} {'P':>2} {'V':>2} {'C':>3} | {'naive peak':>16} {'cached peak':>16} "
        f"{'ratio':>6} | {'MiB@4k naive':>12} {'cached':>7} | {'step naive B':>12} "
        f"{'cached B':>9} {'ratio':>6} | target | hops naive -> cached (tensors)",
    ]
    failures = []
    for S in (None, 2, 4, 8):
        mode = "Full" if S is None else f"Block S={S}"
        for P in (2, 4):
            for V in (1, 2, 4):
                naive, cached = measure(P, V, S, False), measure(P, V, S, True)
                for (nf, nb, _), (cf, cb, _) in zip(naive, cached):
                    assert nf == nb and cf == cb  # backward mirrors forward
                n_peak = max(h[0] for h in naive)
                c_peak = max(h[0] for h in cached)
                n_step = sum(h[0] + h[1] for h in naive) * MICROBATCHES
                c_step = sum(h[0] + h[1] for h in cached) * MICROBATCHES
                ok = c_peak <= n_peak / V + tensor_bytes
                if not ok:
                    failures.append((mode, P, V))
                hops = (" ".join(str(h[2]) for h in naive) + " -> "
                        + " ".join(str(h[2]) for h in cached))
                lines.append(
                    f"{mode:<9} {P:>2} {V:>2} {P * V:>3} | "
                    f"{n_peak // tensor_bytes:>4} t {n_peak:>8} B {c_peak // tensor_bytes:>4} t "
                    f"{c_peak:>8} B {c_peak / n_peak:>6.2f} | "
                    f"{n_peak // tensor_bytes * BIG_TENSOR_MIB:>12.0f} "
                    f"{c_peak // tensor_bytes * BIG_TENSOR_MIB:>7.0f} | "
                    f"{n_step:>12} {c_step:>9} {c_step / n_step:>6.2f} | "
                    f"{'ok' if ok else 'MISSED':<6} | {hops}")
            lines.append("")
    lines.append("target (cached peak <= naive peak / V + one block): "
                 + ("met in every row" if not failures else f"missed in {failures}"))
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
