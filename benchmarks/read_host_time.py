"""Host time of a DepthStream read: the Python and dispatch work around the
kernels (docs/design.md §10, "Policy and API").

  python benchmarks/read_host_time.py     # writes benchmarks/results/read_host_time_<cpu>.md

A Block stream (S = 4) of 32 sublayers over one token of width 64 under
torch.no_grad, so the kernels' own work is negligible and the time per
sublayer (an AttnResResidual read plus the stream's append) is what a
launch-bound GPU forward pays on the host for each read, before any kernel
runs. Baseline: the plain residual `h = h + f` over the same outputs. Each
read mode also with block_storage (the block sums built in one buffer).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=201)
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args()
    torch.manual_seed(0)
    D, L, S = 64, 32, 4
    embedding = torch.randn(1, 1, D)
    readers = [AttnResResidual(D) for _ in range(L)]
    for r in readers:
        torch.nn.init.normal_(r.query, std=0.1)
    outputs = [torch.randn(1, 1, D) for _ in range(L)]

    storage = torch.empty(-(-L // S), 1, 1, D)

    def stream_forward(mode, block_storage=None):
        stream = DepthStream(embedding, block_size=S, block_reads=mode, readers=readers,
                             block_storage=block_storage)
        h = None
        for reader, f in zip(readers, outputs):
            h = reader(stream)
            stream.append(f)
        return h

    def plain():
        h = embedding
        for f in outputs:
            h = h + f
        return h

    fns = {"plain residual add": plain}
    for mode in ("one_call", "two_phase", "auto"):
        fns[f"Block {mode}"] = lambda mode=mode: stream_forward(mode)
        fns[f"Block {mode}, block_storage"] = lambda mode=mode: stream_forward(mode, storage)
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
        f"`python benchmarks/read_host_time.py --repeats {args.repeats}`",
        "",
        f"Block stream, S = {S}, {L} sublayers (a read and an append each), one token of width "
        f"{D}, fp32, torch.no_grad; medians of {args.repeats} interleaved forwards.",
        "",
        "| variant | us per sublayer | / plain residual add |",
        "|---|---:|---:|",
    ]
    for name, t in med.items():
        out.append(f"| {name} | {1e6 * t / L:.1f} | {t / med['plain residual add']:.1f} |")
    out.append(block_reads.load_footer(load_before, os.getloadavg(),
                                       "this script keeps one thread busy"))
    print("\n".join(out))
    block_reads.write_results(out, args.out_dir, "read_host_time", machine)


if __name__ == "__main__":
    main()
