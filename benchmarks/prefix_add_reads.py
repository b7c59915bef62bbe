"""Per-call time of a Block read with the sublayer's add, fused or not
(docs/design.md §12), at decode and prefill sizes (D = 64: the host path alone).

  python benchmarks/prefix_add_reads.py     # writes benchmarks/results/prefix_add_reads_<machine>.md
  python benchmarks/prefix_add_reads.py --quick   # a dry run: few sizes and calls, no file
  python benchmarks/prefix_add_reads.py --device cuda --dtype bfloat16 [--suffix _tiled]
      # on the GPU (synchronized rounds; D in {1024, 7168}); gpu_check.sh runs it with the
      # few-token kernels and without (ATTNRES_CUDA_FEW_TOKENS=0, suffix _tiled)

What one sublayer's read costs in a Block model: its output f joins the
partial block sum P (P' = P + f) and the next read reads the completed
sources and P'. Variants, per shape (T tokens of width D, N completed
sources, fp32 unless --dtype, one stream's layout):
  - torch.add        P + f alone: the one-dispatcher-call floor;
  - one-call         P + f, then attnres.depth_attention over the N sources and P';
  - fused one-call   attnres.depth_attention(N sources and P, delta=f): the add inside the read;
  - merge            P + f, then attnres.block_read_merge (phase 2) over P';
  - fused merge      attnres.block_read_merge(..., delta=f): the add inside the merge.
Phase 1 (once per block) is not timed: it is shared by the block's reads.
"no grad" runs under torch.no_grad; "with grad" is forward + backward
(torch.autograd.grad of a loss on h and P' with respect to every input
that requires grad: the sources, P, f, the query and gain), against the same
for torch.add. At D = 7168 every row is timed with 1 and 2 threads. The
variants run interleaved (rounds of calls, the order rotated); per-call
medians are compared as ratios in one run. No timing is a pass/fail criterion.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import attnres

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
import bench  # noqa: E402  (git_state)
import block_reads  # noqa: E402  (machine_name, load_footer, write_results)


def problem(T, D, N, grad, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(T * 7 + D + N)

    def make(*shape, fn=torch.randn):
        return fn(*shape, generator=g).to(device, dtype)

    completed = [make(T, D) for _ in range(N)]
    P, f = make(T, D), make(T, D)
    queries = make(2, D) / D ** 0.5
    gains = make(2, D, fn=torch.rand) + 0.5
    with torch.no_grad():
        partials, lse = attnres.block_reads(completed, queries, gains)
    t = dict(completed=completed, P=P, f=f, query=queries[1].clone(), gain=gains[1].clone(),
             partial=partials[1], lse=lse[1])
    if grad:
        for k in ("P", "f", "query", "gain", "partial", "lse"):
            t[k].requires_grad_(True)
        for c in completed:
            c.requires_grad_(True)
    return t


def variants(t, grad):
    """name -> a call doing one read (and its backward with grad)."""
    w_h, w_p = torch.randn_like(t["P"]), torch.randn_like(t["P"])
    leaves = [t[k] for k in ("P", "f", "query", "gain")]

    def finish(h, P_next, extra=()):
        if grad:
            torch.autograd.grad((h * w_h).sum() + (P_next * w_p).sum(), [*leaves, *extra])

    def add():
        P_next = t["P"] + t["f"]
        if grad:
            torch.autograd.grad((P_next * w_p).sum(), [t["P"], t["f"]])

    def one_call():
        P_next = t["P"] + t["f"]
        finish(attnres.depth_attention([*t["completed"], P_next], t["query"], t["gain"]), P_next,
               t["completed"])

    def fused_one_call():
        h, P_next = attnres.depth_attention([*t["completed"], t["P"]], t["query"], t["gain"],
                                            delta=t["f"])
        finish(h, P_next, t["completed"])

    def merge():
        P_next = t["P"] + t["f"]
        finish(attnres.block_read_merge(t["partial"], t["lse"], P_next, t["query"], t["gain"]),
               P_next, [t["partial"], t["lse"]])

    def fused():
        h, P_next = attnres.block_read_merge(t["partial"], t["lse"], t["P"], t["query"], t["gain"],
                                             delta=t["f"])
        finish(h, P_next, [t["partial"], t["lse"]])

    return {"torch.add": add, "one-call": one_call, "fused one-call": fused_one_call,
            "merge": merge, "fused merge": fused}


def per_call(fns, calls, rounds, sync=lambda: None):
    """Median seconds per call of each function: `rounds` rounds of `calls`
    calls each, the order rotated every round (`sync`: the device's
    synchronize, before and after a round)."""
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / calls)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few sizes and calls (dry run), no file")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"),
                    default="float32")
    ap.add_argument("--suffix", default="", help="appended to the results file's name")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype)
    tokens, widths, Ns = (([1, 16], [64], [3]) if args.quick
                          else ([1, 4, 16, 256], [1024, 7168] if cuda else [64, 1024, 7168],
                                [3, 9]))
    rounds = 3 if args.quick else args.rounds
    block_reads.DEV = torch.device(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    machine = block_reads.machine_name()
    load_before = os.getloadavg()
    threads0 = torch.get_num_threads()
    out = ["# A Block read with its add, fused or not", "",
           f"Machine: {machine}; torch {torch.__version__}; {bench.git_state()}; command: "
           f"`{' '.join(['python', 'benchmarks/prefix_add_reads.py', *sys.argv[1:]])}`"
           + (f"; ATTNRES_CUDA_FEW_TOKENS={os.environ['ATTNRES_CUDA_FEW_TOKENS']}"
              if cuda and "ATTNRES_CUDA_FEW_TOKENS" in os.environ else ""), "",
           f"{args.dtype}; per-call medians (us) of interleaved rounds; ratios to torch.add (P + f alone) "
           "in the same run. \"fused 1c / 1c\": the fused one-call read over P + f then the "
           "one-call read; \"fused m / m\": the same for the merge.", "",
           "| grad | T | D | N | threads | torch.add us | one-call us | fused one-call us "
           "| merge us | fused merge us | one-call / add | fused one-call / add | merge / add "
           "| fused merge / add | fused 1c / 1c | fused m / m |",
           "|---|---:|---:|---:|---:|" + "---:|" * 11]
    for grad in (False, True):
        for D in widths:
            for T in tokens:
                for N in Ns:
                    for threads in ([1, 2] if D >= 7168 and not cuda else [threads0]):
                        torch.set_num_threads(threads)
                        t = problem(T, D, N, grad, args.device, dtype)
                        with torch.set_grad_enabled(grad):
                            fns = variants(t, grad)
                            for fn in fns.values():  # first touches
                                fn(), fn()
                            # about 20 ms a round and variant (CPU; launch-bound on CUDA)
                            calls = (5 if args.quick else 50 if cuda
                                     else max(5, min(2000, int(2e6 / (T * D)))))
                            med = per_call(fns, calls, rounds, sync)
                        a = med["torch.add"]
                        reads = ("one-call", "fused one-call", "merge", "fused merge")
                        row = " | ".join(
                            [f"| {'with' if grad else 'no'}", str(T), str(D), str(N), str(threads),
                             f"{1e6 * a:.1f}", *(f"{1e6 * med[k]:.1f}" for k in reads),
                             *(f"{med[k] / a:.2f}" for k in reads),
                             f"{med['fused one-call'] / med['one-call']:.3f}",
                             f"{med['fused merge'] / med['merge']:.3f} |"])
                        out.append(row)
                        print(row, flush=True)
    torch.set_num_threads(threads0)
    out.append(block_reads.load_footer(load_before, os.getloadavg(),
                                       "this script keeps up to 2 threads busy"))
    if not args.quick:
        block_reads.write_results(out, args.out_dir, "prefix_add_reads", machine, args.suffix)


if __name__ == "__main__":
    main()
