"""Times attnres against the eager reference and torch.compile of it.

For every (dtype, N, tokens, D) and pass (fwd, bwd) it reports the median
time, the achieved bandwidth on the bytes the op must move (DESIGN.md §5) and
that bandwidth as a percentage of this machine's measured device copy
bandwidth.

  fwd: bytes = (N + 1) * tokens * D * elem   (read N sources, write h)
  bwd: bytes = (2N + 1) * tokens * D * elem  (read N sources and dh, write N grads)

Passes, the same for all three implementations (inputs require grad, as in
training):
  fwd  the forward call alone (recording the autograd graph);
  bwd  the backward alone: each repeat records a forward graph (not timed),
       then torch.autograd.grad through it is timed.

Implementations:
  attnres  attnres.depth_attention on the list of sources;
  eager    attnres.reference.depth_attention on the same list (it stacks);
  compile  torch.compile(attnres.reference.depth_attention, dynamic=True) on a
           pre-stacked [N, tokens, D] tensor: one compiled graph serves every
           shape of a dtype, and the stacking is *not* timed, which favours
           compile.

Inputs are rotated among several sets so that together they exceed the L2
cache several times over. Output: benchmarks/results/gpu_<device>.csv and
.md (and copies under $OUT when set).

  python3 benchmarks/bench_gpu.py                      # full run on the GPU
  python3 benchmarks/bench_gpu.py --device cpu --quick # dry run of the logic
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import re
import shutil
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import attnres  # noqa: E402
from attnres import reference  # noqa: E402

COLUMNS = ["device", "dtype", "N", "tokens", "D", "pass", "impl", "ms", "gbps", "pct_copy_bw"]
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float64: "fp64"}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (checks the script end to end)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new configs after this")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impls", default="attnres,eager,compile")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    return ap.parse_args()


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


class Timer:
    """Median wall time of a callable on the device, in milliseconds."""

    SLEEP_CYCLES = 200_000_000  # about 0.1 s

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def median_ms(self, fn, n_calls: int, prepare=None) -> float:
        """fn(k) for k < n_calls; prepare(k), when given, runs first, untimed,
        and its result is passed to fn."""
        if not self.cuda:
            times = []
            for k in range(n_calls):
                arg = prepare(k) if prepare is not None else k
                t0 = time.perf_counter()
                fn(arg)
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        # A busy-wait kernel first lets the host queue every call before the
        # GPU reaches them, so host overhead does not show in the events.
        torch.cuda._sleep(self.SLEEP_CYCLES)
        events = []
        for k in range(n_calls):
            arg = prepare(k) if prepare is not None else k
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            end.record()
            events.append((start, end))
            del arg
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth_gbps(device: str, timer: Timer, quick: bool) -> float:
    """Device-to-device copy: bytes read + written per second."""
    n_bytes = (64 << 20) if quick else (2 << 30)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    timer.sync()
    ms = timer.median_ms(lambda k: dst.copy_(src), 5 if quick else 20)
    del src, dst
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def configs(quick: bool):
    if quick:
        dtypes, ns, tokens, ds = [torch.bfloat16, torch.float32], [2, 3], [64], [64, 96]
    else:
        dtypes, ns, tokens, ds = [torch.bfloat16, torch.float32], [2, 9, 17, 33, 65], [8192, 65536], [1024, 2048, 4096, 7168]
    for dtype in dtypes:
        for t in tokens:
            for n in ns:
                for d in ds:
                    yield dtype, n, t, d


def floor_bytes(pass_name: str, N: int, T: int, D: int, elem: int) -> int:
    per_row = (N + 1) if pass_name == "fwd" else (2 * N + 1)
    return per_row * T * D * elem


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return 8 << 30  # the dry run uses tiny sizes


def make_sets(n_sets, N, T, D, dtype, device):
    sets = []
    for _ in range(n_sets):
        sources = [torch.randn(T, D, device=device, dtype=dtype) for _ in range(N)]
        query = torch.randn(D, device=device, dtype=torch.float32) / math.sqrt(D)
        gain = 1 + 0.1 * torch.randn(D, device=device, dtype=torch.float32)
        grad = torch.randn(T, D, device=device, dtype=dtype)
        sets.append((sources, query, gain, grad))
    return sets


def run_impl(impl, pass_name, sets, timer, repeats, compiled):
    """Median ms of one implementation and pass over the rotated sets.

    Inputs require grad in both passes (a training step), so the forward that
    is timed is the one that records the graph, and torch.compile builds one
    graph per dtype that serves both passes.
    """
    if impl == "compile":
        fn = compiled
    else:
        fn = attnres.depth_attention if impl == "attnres" else reference.depth_attention
    prepared = []
    for srcs, q, g, dh in sets:
        if impl == "compile":
            # One stacked tensor per set (stacking not timed, see the docstring).
            leaves = [torch.stack(srcs).requires_grad_(True)]
            first = leaves[0]
        else:
            leaves = [s.detach().requires_grad_(True) for s in srcs]
            first = leaves
        qq, gg = q.detach().requires_grad_(True), g.detach().requires_grad_(True)
        prepared.append((first, leaves + [qq, gg], dh))

    def forward(k):
        first, inputs, _ = prepared[k % len(prepared)]
        return fn(first, inputs[-2], inputs[-1])

    if pass_name == "fwd":
        forward(0)  # warm-up (and compilation for this dtype)
        forward(1)
        timer.sync()
        return timer.median_ms(forward, repeats)

    # Backward alone: each repeat records a forward graph (untimed) and times
    # one autograd.grad through it (no retain_graph, which compiled backwards
    # with donated buffers refuse).
    def record(k):
        return forward(k), prepared[k % len(prepared)][1], prepared[k % len(prepared)][2]

    def backward(recorded):
        out, inputs, dh = recorded
        torch.autograd.grad(out, inputs, dh)

    backward(record(0))  # warm-up (and compilation of the backward)
    backward(record(1))
    timer.sync()
    return timer.median_ms(backward, repeats, prepare=record)


def main():
    args = parse_args()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_gpu.py: no CUDA device visible; use --device cpu --quick for a dry run")
    impls = args.impls.split(",")
    label = device_label(device)
    timer = Timer(device)
    t_start = time.monotonic()

    copy_gbps = copy_bandwidth_gbps(device, timer, args.quick)
    print(f"device {label}: copy bandwidth {copy_gbps:.1f} GB/s (read + write)", flush=True)
    l2 = torch.cuda.get_device_properties(torch.device(device)).L2_cache_size if device.startswith("cuda") else 0
    repeats = 2 if args.quick else args.repeats

    compiled = torch.compile(reference.depth_attention, dynamic=True) if "compile" in impls else None

    rows, skipped = [], []
    for dtype, N, T, D in configs(args.quick):
        tag = f"{DTYPE_NAMES[dtype]} N={N} tokens={T} D={D}"
        if time.monotonic() - t_start > args.budget_s:
            skipped.append((tag, f"time budget of {args.budget_s:.0f} s spent"))
            continue
        elem = torch.tensor([], dtype=dtype).element_size()
        set_bytes = (N + 1) * T * D * elem
        # Our op's footprint per set: sources + dh, and h + N grads while timing.
        need_one = set_bytes + (N + 1) * T * D * elem
        n_sets = max(1, min(4, math.ceil(4 * l2 / set_bytes))) if l2 else 2
        if need_one > 0.8 * free_bytes(device):
            skipped.append((tag, f"needs {need_one / 2**30:.1f} GiB for one input set, "
                                 f"{free_bytes(device) / 2**30:.1f} GiB free"))
            print(f"skip {tag}: {skipped[-1][1]}", flush=True)
            continue
        while n_sets > 1 and n_sets * set_bytes + need_one > 0.6 * free_bytes(device):
            n_sets -= 1
        sets = make_sets(n_sets, N, T, D, dtype, device)
        for pass_name in ("fwd", "bwd"):
            for impl in impls:
                try:
                    ms = run_impl(impl, pass_name, sets, timer, repeats, compiled)
                except torch.OutOfMemoryError:
                    skipped.append((f"{tag} {pass_name} {impl}", "out of device memory"))
                    print(f"skip {tag} {pass_name} {impl}: out of device memory", flush=True)
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                    continue
                gbps = floor_bytes(pass_name, N, T, D, elem) / (ms * 1e-3) / 1e9
                rows.append(dict(device=label, dtype=DTYPE_NAMES[dtype], N=N, tokens=T, D=D, **{"pass": pass_name},
                                 impl=impl, ms=f"{ms:.4f}", gbps=f"{gbps:.1f}",
                                 pct_copy_bw=f"{100 * gbps / copy_gbps:.1f}"))
                print(f"{tag} {pass_name:3s} {impl:8s} {ms:9.3f} ms {gbps:8.1f} GB/s "
                      f"{100 * gbps / copy_gbps:5.1f}% of copy", flush=True)
        del sets
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    write_outputs(args.out_dir, label, copy_gbps, rows, skipped, time.monotonic() - t_start)


def write_outputs(out_dir, label, copy_gbps, rows, skipped, elapsed_s):
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, f"gpu_{label}.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)

    by_key = {}
    for r in rows:
        by_key.setdefault((r["dtype"], r["N"], r["tokens"], r["D"], r["pass"]), {})[r["impl"]] = r
    lines = [
        f"# attnres on {label}",
        "",
        f"Device copy bandwidth (large device-to-device copy, bytes read + written / time): "
        f"**{copy_gbps:.0f} GB/s**. GB/s below counts the bytes the op must move "
        "(fwd: (N+1)·tokens·D elements, bwd: (2N+1)·tokens·D); % is of the copy bandwidth. "
        "Speed-up = reference time / attnres time (> 1: attnres faster). fwd: forward alone (recording the graph); "
        "bwd: backward alone (autograd.grad of a recorded forward); inputs require grad in both. compile = torch.compile(reference, "
        "dynamic=True) on a pre-stacked tensor (stacking not timed). "
        f"Run took {elapsed_s:.0f} s; generated by benchmarks/bench_gpu.py.",
        "",
        "| dtype | N | tokens | D | pass | attnres ms | attnres GB/s | % copy | eager ms | compile ms "
        "| speed-up vs eager | speed-up vs compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dtype, N, T, D, p), impls in by_key.items():
        ours = impls.get("attnres")
        eager = impls.get("eager")
        comp = impls.get("compile")

        def ratio(other):
            if ours is None or other is None:
                return "–"
            return f"{float(other['ms']) / float(ours['ms']):.2f}×"

        lines.append(
            f"| {dtype} | {N} | {T} | {D} | {p} | {ours['ms'] if ours else '–'} | {ours['gbps'] if ours else '–'} "
            f"| {ours['pct_copy_bw'] if ours else '–'} | {eager['ms'] if eager else '–'} "
            f"| {comp['ms'] if comp else '–'} | {ratio(eager)} | {ratio(comp)} |"
        )
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {tag}: {why}" for tag, why in skipped]
    md_path = os.path.join(out_dir, f"gpu_{label}.md")
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {csv_path} and {md_path}")

    out_env = os.environ.get("OUT")
    if out_env:
        os.makedirs(out_env, exist_ok=True)
        for p in (csv_path, md_path):
            shutil.copy(p, out_env)


if __name__ == "__main__":
    main()
