"""Host time of a DepthStream read: the Python and dispatch work around the
kernels (docs/design.md §10, "Policy and API"), and where the two-phase
reads start to pay at inference.

  python benchmarks/read_host_time.py     # writes benchmarks/results/read_host_time_<cpu>.md

Table 1: a Block stream (S = 4) of 32 sublayers over one token of width 64
under torch.no_grad, so the kernels' own work is negligible and the time per
sublayer (an AttnResResidual read plus the stream's append) is what a
launch-bound GPU forward pays on the host for each read, before any kernel
runs. Baseline: the plain residual `h = h + f` over the same outputs. Each
read mode also with block_storage (the block sums built in one buffer).

Table 2 (skipped with --no-sweep): the same stream (24 sublayers, S = 4)
with T tokens of width D, one-call against two-phase reads under
torch.no_grad: the sizes below which "auto" reads one-call at inference.

Variants run interleaved (one forward each in turn), medians compared in
one run; no timing is a pass/fail criterion.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from attnres import AttnResResidual, DepthStream

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
import bench  # noqa: E402  (git_state, cpu_name: shared with bench.py)
import block_reads  # noqa: E402  (interleaved, machine_name)


def make_stream_forward(T: int, D: int, L: int, S: int):
    """A forward of L sublayers (read, then append a fixed output) and the
    final read over a Block stream of T tokens of width D."""
    embedding = torch.randn(1, T, D)
    readers = [AttnResResidual(D) for _ in range(L + 1)]
    for r in readers:
        torch.nn.init.normal_(r.query, std=0.1)
    outputs = [torch.randn(1, T, D) for _ in range(L)]

    def forward(mode, block_storage=None):
        stream = DepthStream(embedding, block_size=S, block_reads=mode, readers=readers,
                             block_storage=block_storage)
        for reader, f in zip(readers, outputs):
            reader(stream)
            stream.append(f)
        return readers[L](stream)

    def plain():
        h = embedding
        for f in outputs:
            h = h + f
        return h

    return forward, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=201)
    parser.add_argument("--no-sweep", action="store_true", help="table 1 only")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args()
    torch.manual_seed(0)
    D, L, S = 64, 32, 4
    forward, plain = make_stream_forward(1, D, L, S)
    storage = torch.empty(-(-L // S), 1, 1, D)
    fns = {"plain residual add": plain}
    for mode in ("one_call", "two_phase", "auto"):
        fns[f"Block {mode}"] = lambda mode=mode: forward(mode)
        fns[f"Block {mode}, block_storage"] = lambda mode=mode: forward(mode, storage)
    load_before = os.getloadavg()
    with torch.no_grad():
        for fn in fns.values():  # first touches
            fn(), fn()
        med = block_reads.interleaved(fns, args.repeats)
    machine = block_reads.machine_name()
    out = [
        "# Host time of a DepthStream read",
        "",
        f"Machine: {machine}; torch {torch.__version__}; {bench.git_state()}; command: "
        f"`python benchmarks/read_host_time.py --repeats {args.repeats}"
        f"{' --no-sweep' if args.no_sweep else ''}`",
        "",
        f"Block stream, S = {S}, {L} sublayers (a read and an append each) and the final read, one "
        f"token of width {D}, fp32, torch.no_grad; medians of {args.repeats} interleaved forwards "
        "(\"auto\" reads one-call here: sources of at most 2^18 elements).",
        "",
        "| variant | us per sublayer | / plain residual add |",
        "|---|---:|---:|",
    ]
    for name, t in med.items():
        out.append(f"| {name} | {1e6 * t / L:.1f} | {t / med['plain residual add']:.1f} |")
    if not args.no_sweep:
        L2 = 24
        out += [
            "",
            f"One-call vs two-phase reads by size: the same stream, {L2} sublayers, S = {S} "
            "(the final read sees 7 sources), T tokens of width D, fp32, torch.no_grad; medians "
            "of interleaved forwards (more rounds for the small sizes).",
            "",
            "| T | D | elements per source | one-call us per sublayer | two-phase us per sublayer "
            "| two-phase / one-call |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        with torch.no_grad():
            for D2 in (64, 1024, 7168):
                for T in (1, 4, 16, 64, 256, 1024):
                    if T * D2 > 1 << 21:
                        continue
                    fwd, _ = make_stream_forward(T, D2, L2, S)
                    pair = {m: (lambda m=m: fwd(m)) for m in ("one_call", "two_phase")}
                    for fn in pair.values():
                        fn(), fn()
                    m2 = block_reads.interleaved(pair, 21 if T * D2 < 100_000 else 7)
                    one, two = m2["one_call"], m2["two_phase"]
                    out.append(f"| {T} | {D2} | {T * D2} | {1e6 * one / L2:.1f} | "
                               f"{1e6 * two / L2:.1f} | {two / one:.2f} |")
                    print(out[-1], flush=True)
    out.append(block_reads.load_footer(load_before, os.getloadavg(),
                                       "this script keeps one thread busy"))
    print("\n".join(out))
    block_reads.write_results(out, args.out_dir, "read_host_time", machine)


if __name__ == "__main__":
    main()
