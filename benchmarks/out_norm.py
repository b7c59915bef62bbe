"""The read with a fused output norm vs a read followed by its own RMSNorm
(issue 9 item 2; docs/design.md §11), and what it does to a whole model.

  python benchmarks/out_norm.py            # writes benchmarks/results/out_norm_<cpu>.md
  python benchmarks/out_norm.py --quick    # small sizes, few repeats (a dry run)
  python benchmarks/out_norm.py --parts block      # part 3 alone

Part 1, one read, CPU: N sources [T, D], D = 1024, T = 4096.
  fused     attnres.depth_attention(..., out_weight=w): RMSNorm(h) * w in the op;
  unfused   attnres.depth_attention(...) then torch.nn.functional.rms_norm;
  eager     attnres.reference.depth_attention then rms_norm (plain PyTorch);
  compile   torch.compile of the eager composite (fp32 N = 16 only: each
            shape and pass compiles afresh on this 2-core machine).
Passes: "infer" (forward under torch.no_grad: the fused read writes y
only), "train" (forward and backward: the fused read also keeps h for its
backward). Floor bytes, e = element size: infer (N + 1) T D e (read N
sources, write y); train (N + 2) T D e forward (y and h written) plus
(2N + 2) T D e backward (read N sources, dy and h; write N gradients).
GB/s is that over the median time of the fused read; "% copy" is the
time of a tensor copy moving the same bytes (half read, half written),
interleaved with the reads, over the fused read's time (so a shared,
loaded machine slows both alike). The unfused read moves 2 T D e more forward
(h written, read again, y written) and 2 T D e more backward (dh written by
the norm's backward and read by the read's).

Part 3 (--parts block runs it alone): a Block GPT with
norm="rmsnorm" under block_reads="auto" and "two_phase" (two-phase reads
with the norm fused into phase 1 and the merges) vs "one_call", inference
forward and training step, interleaved.

Part 2, the example GPT (python/attnres/models.py) with norm="rmsnorm":
standard residual (nn.RMSNorm pre-norms) vs Full and Block AttnRes whose
reads carry the pre-norms (out_norm="rmsnorm", fused); and the same
AttnRes models with norm="layernorm" (a read, then nn.LayerNorm) for
reference. Inference forward under torch.no_grad, and a training step
(forward, backward; no optimizer step). Block uses block_reads="auto".

Timing: variants of one configuration run interleaved, one call each in
turn with a rotating order, repeated; medians, reported as ratios to a
baseline measured in the same run (the VM is shared and noisy). No timing
is a pass/fail criterion.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import attnres
from attnres import reference
from attnres.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from block_reads import cpu_name, interleaved  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def copy_of(n_bytes: int):
    """A copy that reads n_bytes / 2 and writes n_bytes / 2 (float32)."""
    src = torch.randn(max(1, n_bytes // 8))
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# ---- part 1: one read -----------------------------------------------------------------


def read_fns(N, T, D, dtype, with_compile):
    gen = torch.Generator().manual_seed(N)
    pdt = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    srcs = [torch.randn(T, D, generator=gen).to(dtype) for _ in range(N)]
    q = (torch.randn(D, generator=gen) / D**0.5).to(pdt)
    g = (torch.rand(D, generator=gen) + 0.5).to(pdt)
    w = (torch.rand(D, generator=gen) + 0.5).to(pdt)
    dy = torch.randn(T, D, generator=gen).to(dtype)

    def fused(s, q, g, w):
        return attnres.depth_attention(s, q, g, out_weight=w, out_eps=1e-5)

    def unfused(s, q, g, w):
        h = attnres.depth_attention(s, q, g)
        return F.rms_norm(h, (D,), w.to(h.dtype), 1e-5)

    def eager(s, q, g, w):
        h = reference.depth_attention(s, q, g)
        return F.rms_norm(h, (D,), w.to(h.dtype), 1e-5)

    impls = {"fused": fused, "unfused": unfused, "eager": eager}
    if with_compile:
        impls["compile"] = torch.compile(eager, dynamic=False)
    leaves = [s.clone().requires_grad_() for s in srcs]
    params = [t.clone().requires_grad_() for t in (q, g, w)]

    def infer(fn):
        def call():
            with torch.no_grad():
                return fn(srcs, q, g, w)
        return call

    def train(fn):
        def call():
            y = fn(leaves, *params)
            return torch.autograd.grad(y, leaves + params, dy)
        return call

    return impls, infer, train, (srcs, q, g, w)


def part_read(T, D, repeats, out):
    out.append(f"## One read: N sources [{T}, {D}], fused norm vs read + separate RMSNorm\n")
    out.append("Time ratios are medians of interleaved runs (fused = 1). GB/s: the fused read's "
               "floor bytes over its time; % copy: the time of a copy of those bytes, run "
               "interleaved with the reads, over the fused read's time.\n")
    out.append("| dtype | N | pass | fused ms | GB/s | % copy | unfused / fused | eager / fused "
               "| compile / fused | max abs diff (unfused) |")
    out.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for N in (4, 16):
            with_compile = dtype == torch.float32 and N == 16
            impls, infer, train, (srcs, q, g, w) = read_fns(N, T, D, dtype, with_compile)
            with torch.no_grad():
                diff = (impls["fused"](srcs, q, g, w).float()
                        - impls["unfused"](srcs, q, g, w).float()).abs().max().item()
            e = srcs[0].element_size()
            for pass_name, wrap in (("infer", infer), ("train", train)):
                if pass_name == "infer":
                    floor = (N + 1) * T * D * e
                else:
                    floor = (N + 2) * T * D * e + (2 * N + 2) * T * D * e
                fns = {name: wrap(fn) for name, fn in impls.items()}
                fns["copy"] = copy_of(floor)
                for fn in fns.values():  # warm-up (and compile)
                    fn()
                med = interleaved(fns, repeats)
                gbps = floor / med["fused"] / 1e9
                comp = f"{med['compile'] / med['fused']:.2f}" if "compile" in med else "—"
                out.append(f"| {str(dtype).replace('torch.', '')} | {N} | {pass_name} | "
                           f"{med['fused'] * 1e3:.2f} | {gbps:.1f} | {100 * med['copy'] / med['fused']:.0f}% | "
                           f"{med['unfused'] / med['fused']:.2f} | {med['eager'] / med['fused']:.2f} "
                           f"| {comp} | {diff:.1e} |")
                print(out[-1], flush=True)


# ---- part 2: the example GPT ------------------------------------------------------------


def time_models(models, idx, repeats):
    """Medians of each model's inference forward (torch.no_grad) and
    training step (forward + backward), interleaved; each model runs once
    before timing (Block readers learn their order)."""
    results = {}
    with torch.no_grad():
        for m in models.values():
            m.eval()
            m(idx)
        results["inference forward (torch.no_grad)"] = interleaved(
            {name: (lambda m=m: m(idx)) for name, m in models.items()}, repeats)

    def step(m):
        _logits, loss = m(idx, idx)
        loss.backward()

    for m in models.values():
        m.train()
        step(m)
    results["training step (forward + backward)"] = interleaved(
        {name: (lambda m=m: step(m)) for name, m in models.items()}, max(3, repeats // 2))
    return results


def part_gpt(n_layers, D, B, T, S, repeats, out):
    variants = {
        "standard (RMSNorm)": dict(residual="standard", norm="rmsnorm"),
        "full, fused norm": dict(residual="full", norm="rmsnorm"),
        "block, fused norm": dict(residual="block", norm="rmsnorm"),
        "full, read + LayerNorm": dict(residual="full", norm="layernorm"),
        "block, read + LayerNorm": dict(residual="block", norm="layernorm"),
        "standard (LayerNorm)": dict(residual="standard", norm="layernorm"),
    }
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    models = {}
    for name, kw in variants.items():
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, seq_len=T, d_model=D, n_layers=n_layers,
                        n_heads=max(1, D // 64), block_size=S, **kw)
        models[name] = GPT(cfg)
    base = "standard (RMSNorm)"
    results = time_models(models, idx, repeats)
    out.append(f"\n## Example GPT: {n_layers} layers ({2 * n_layers} sublayers), D = {D}, "
               f"B = {B}, T = {T}, Block S = {S}, fp32\n")
    out.append("| variant | " + " | ".join(f"{k}: time / standard (RMSNorm)" for k in results)
               + " |")
    out.append("|---|" + "---:|" * len(results))
    for name in variants:
        out.append(f"| {name} | " + " | ".join(f"{med[name] / med[base]:.3f}"
                                              for med in results.values()) + " |")
    print("\n".join(out[-len(variants) - 3:]), flush=True)


def part_block_reads(n_layers, D, B, T, S, repeats, out):
    """Part 3: a Block GPT with norm="rmsnorm" (every read normed) under
    block_reads="auto" (two-phase from the third block sum on, the norm
    fused into phase 1 and the merges) and "two_phase" vs "one_call"."""
    modes = ("one_call", "auto", "two_phase")
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    models = {}
    for mode in modes:
        torch.manual_seed(0)
        models[mode] = GPT(GPTConfig(vocab_size=256, seq_len=T, d_model=D, n_layers=n_layers,
                                     n_heads=max(1, D // 64), residual="block", block_size=S,
                                     norm="rmsnorm", block_reads=mode))
    results = time_models(models, idx, repeats)
    out.append(f"\n## Block GPT, norm=\"rmsnorm\", two-phase reads with the fused norm: "
               f"{n_layers} layers, D = {D}, B = {B}, T = {T}, S = {S}, fp32\n")
    out.append("| block_reads | " + " | ".join(f"{k}: ms | {k}: time / one_call"
                                              for k in results) + " |")
    out.append("|---|" + "---:|---:|" * len(results))
    for mode in modes:
        out.append(f"| {mode} | " + " | ".join(
            f"{med[mode] * 1e3:.1f} | {med[mode] / med['one_call']:.3f}"
            for med in results.values()) + " |")
    print("\n".join(out[-len(modes) - 3:]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--parts", default="read,gpt,block",
                    help="which parts, comma-separated: read, gpt, block (part 3)")
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 15)
    T = 256 if args.quick else 4096
    out = [f"# Fused output norm vs read + separate norm, CPU\n",
           f"Machine: {cpu_name()}; torch {torch.__version__}; command: "
           f"`python benchmarks/out_norm.py {' '.join(sys.argv[1:])}`\n",
           "Load average (1, 5, 15 min) at the start: "
           + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + "\n"]
    parts = args.parts.split(",")
    if "read" in parts:
        part_read(T, 1024, repeats, out)
    if "gpt" in parts and args.quick:
        part_gpt(2, 128, 2, 64, 2, repeats, out)
    elif "gpt" in parts:
        part_gpt(16, 512, 4, 256, 4, repeats, out)
        part_gpt(16, 1024, 2, 256, 4, repeats, out)
    if "block" in parts and args.quick:
        part_block_reads(3, 128, 2, 64, 2, repeats, out)
    elif "block" in parts:
        part_block_reads(16, 512, 4, 256, 4, repeats, out)
        part_block_reads(16, 512, 4, 256, 2, repeats, out)
    out.append("\nLoad average at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    name = ("quick_out_norm" if args.quick else "out_norm") + (
        "" if set(parts) >= {"read", "gpt", "block"} else "_" + "_".join(parts))
    slug = cpu_name().split(" (")[0].replace("(R)", "").replace(" ", "_")
    path = Path(args.out_dir) / f"{name}_{slug}_{torch.get_num_threads()}_threads.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
