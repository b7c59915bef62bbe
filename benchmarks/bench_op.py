"""CPU benchmark of the fused depth-attention op.

In one run it times, per configuration, forward and forward+backward of
  attnres  - the fused op (attnres.depth_attention, a list of sources),
  eager    - attnres.reference.depth_attention (plain PyTorch),
  compile  - torch.compile of that reference,
takes medians over repeats, and reports achieved GB/s (the bytes the op must
move, DESIGN.md §5) next to the copy bandwidth of this machine measured in
the same run on a buffer of the same size.

Writes benchmarks/results/cpu_<machine>.csv and .md.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import torch

import attnres
from attnres import reference

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# (dtype, N, tokens, D): the first row is the target configuration.
DEFAULT_CONFIGS = [
    ("float32", 16, 4096, 1024),
    ("bfloat16", 16, 4096, 1024),
    ("float32", 4, 4096, 4096),
    ("float32", 33, 2048, 1024),
    ("float32", 2, 8192, 7186),
]
QUICK_CONFIGS = [("float32", 4, 256, 1000), ("bfloat16", 3, 128, 64)]


def machine_name() -> str:
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            if m:
                model = m.group(1)
    except OSError:
        pass
    return f"{model.strip()} ({torch.get_num_threads()} threads)"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", re.sub(r"\((R|TM)\)", "", text)).strip("_")


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(nbytes: int, repeats: int) -> float:
    """Read+write bytes per second of a large tensor copy."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def op_bytes(n: int, tokens: int, d: int, elt: int, with_backward: bool) -> int:
    """Bytes the op must move: forward reads N*T*D and writes T*D values;
    the backward reads N*T*D + T*D and writes N*T*D (stats are negligible)."""
    fwd = (n + 1) * tokens * d * elt
    bwd = (2 * n + 1) * tokens * d * elt
    return fwd + (bwd if with_backward else 0)


def bench_config(dtype_name, n, tokens, d, repeats, sets=2):
    dtype = getattr(torch, dtype_name)
    pdtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    gen = torch.Generator().manual_seed(0)
    # Several input sets, rotated, so a cache never holds the whole input.
    inputs = []
    for _ in range(sets):
        srcs = [torch.randn(tokens, d, generator=gen).to(dtype).requires_grad_(True) for _ in range(n)]
        q = (torch.randn(d, generator=gen) / d**0.5).to(pdtype).requires_grad_(True)
        g = (torch.rand(d, generator=gen) + 0.5).to(pdtype).requires_grad_(True)
        dh = torch.randn(tokens, d, generator=gen).to(dtype)
        inputs.append((srcs, q, g, dh))

    compiled_ref = torch.compile(reference.depth_attention, dynamic=False)
    impls = {
        "attnres": attnres.depth_attention,
        "eager": reference.depth_attention,
        "compile": compiled_ref,
    }
    rows = []
    for name, fn in impls.items():
        state = {"i": 0}

        def next_inputs():
            state["i"] = (state["i"] + 1) % sets
            return inputs[state["i"]]

        def fwd():
            srcs, q, g, _ = next_inputs()
            with torch.no_grad():
                fn(srcs, q, g)

        def fwd_bwd():
            srcs, q, g, dh = next_inputs()
            h = fn(srcs, q, g)
            torch.autograd.grad(h, [*srcs, q, g], dh)

        elt = torch.finfo(dtype).bits // 8
        for pass_name, call, with_bwd in (("fwd", fwd, False), ("fwd+bwd", fwd_bwd, True)):
            ms = median_ms(call, repeats, warmup=3 if name == "compile" else 2)
            gbps = op_bytes(n, tokens, d, elt, with_bwd) / (ms * 1e-3) / 1e9
            rows.append(dict(dtype=dtype_name, N=n, tokens=tokens, D=d, pass_=pass_name, impl=name, ms=ms, gbps=gbps))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script end to end")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="folder for the csv and md files "
                    "(default: benchmarks/results; a temporary folder with --quick)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(tempfile.gettempdir(), "attnres-bench-quick") if args.quick else RESULTS

    configs = QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS
    machine = machine_name()
    biggest = max(n * t * d * 4 for _, n, t, d in configs)
    copy_bw = copy_bandwidth_gbps(biggest, args.repeats)
    print(f"machine: {machine}; torch {torch.__version__}; copy bandwidth {copy_bw:.1f} GB/s "
          f"(read+write, {biggest / 2**20:.0f} MiB buffer)", flush=True)

    rows = []
    for cfg in configs:
        print(f"  {cfg} ...", file=sys.stderr, flush=True)
        rows += bench_config(*cfg, repeats=args.repeats)
    for r in rows:
        r["pct_copy_bw"] = 100 * r["gbps"] / copy_bw

    os.makedirs(args.out, exist_ok=True)
    stem = "cpu_quick_" + slug(machine) if args.quick else "cpu_" + slug(machine)
    csv_path = os.path.join(args.out, stem + ".csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["machine", "dtype", "N", "tokens", "D", "pass", "impl", "ms", "gbps", "pct_copy_bw"])
        for r in rows:
            w.writerow([machine, r["dtype"], r["N"], r["tokens"], r["D"], r["pass_"], r["impl"],
                        f"{r['ms']:.3f}", f"{r['gbps']:.2f}", f"{r['pct_copy_bw']:.1f}"])

    lines = [
        f"CPU: {machine}, torch {torch.__version__}, measured copy bandwidth {copy_bw:.1f} GB/s "
        f"(read+write). Medians of {args.repeats} runs; `python benchmarks/bench_op.py`.",
        "",
        "| dtype | N | tokens | D | pass | attnres ms | GB/s | % copy BW | eager ms | compile ms | vs eager | vs compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["dtype"], r["N"], r["tokens"], r["D"], r["pass_"]), {})[r["impl"]] = r
    for (dt, n, t, d, p), impls in by_key.items():
        ours, eager, comp = impls["attnres"], impls["eager"], impls["compile"]
        lines.append(
            f"| {dt} | {n} | {t} | {d} | {p} | {ours['ms']:.2f} | {ours['gbps']:.1f} | {ours['pct_copy_bw']:.0f}% "
            f"| {eager['ms']:.2f} | {comp['ms']:.2f} | {eager['ms'] / ours['ms']:.1f}x | {comp['ms'] / ours['ms']:.1f}x |"
        )
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {csv_path} and {stem}.md")


if __name__ == "__main__":
    main()
