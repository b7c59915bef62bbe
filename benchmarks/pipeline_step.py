"""Pipelined training step of the example GPT on CPU ranks: AttnRes (Block,
Full) against the standard residual split the same way.

  python benchmarks/pipeline_step.py   # writes benchmarks/results/pipeline_step_<cpu>.md

Each configuration is examples/pipeline/train_pp.py under torchrun (gloo, one
thread per rank), which prints the mean time of its steps after the first two;
the residuals run in turn, round after round, and the medians over rounds are
compared in one run (the machine is shared: only the ratios mean much). Each
run's first pipelined loss equals the unsplit model's (the example prints both;
checked here). No timing is a pass/fail criterion.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
EXAMPLE = RESULTS.parents[1] / "examples" / "pipeline" / "train_pp.py"
sys.path.insert(0, str(RESULTS.parent))
import bench  # noqa: E402  (git_state, slug)
import block_reads  # noqa: E402  (machine_name)

RESIDUALS = ("standard", "block", "full")


def run_once(args, residual: str, port: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           "--master-port", str(port), str(EXAMPLE), "--residual", residual,
           "--steps", str(args.steps), "--layers", str(args.layers), "--d-model", str(args.d_model),
           "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--microbatches", str(args.microbatches), "--virtual-stages", str(args.virtual_stages)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    unsplit = float(re.search(r"unsplit model, first batch: loss (\S+)", out.stdout).group(1))
    first = float(re.search(r"step +1: pipelined loss (\S+)", out.stdout).group(1))
    if abs(first - unsplit) > 1e-4 * abs(unsplit):
        raise SystemExit(f"{residual}: pipelined loss {first} != unsplit {unsplit}")
    return float(re.search(r"mean step time after 2 steps: (\S+) ms", out.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args()
    times = {r: [] for r in RESIDUALS}
    for i in range(args.rounds):
        for r in RESIDUALS:
            times[r].append(run_once(args, r, 29500 + 7 * i + RESIDUALS.index(r)))
            print(f"round {i + 1}: {r} {times[r][-1]:.1f} ms", flush=True)
    med = {r: statistics.median(t) for r, t in times.items()}
    machine = block_reads.machine_name()
    command = "python benchmarks/pipeline_step.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out_dir")
    out = [
        "# Pipelined training step: AttnRes vs the standard residual",
        "",
        f"Machine: {machine}, {os.cpu_count()} CPUs; torch {torch.__version__}; {bench.git_state()}; "
        f"command: `{command}`.",
        "",
        f"examples/pipeline/train_pp.py: the example GPT ({args.layers} layers, d_model "
        f"{args.d_model}, Block S = 3 sublayers), {args.ranks} gloo ranks x {args.virtual_stages} "
        f"stage(s) each, one thread per rank, batch {args.batch} x {args.seq_len} tokens in "
        f"{args.microbatches} microbatches, forward + backward + AdamW; the mean of steps 3.."
        f"{args.steps} per run, median over {args.rounds} rounds (residuals in turn). Every run's "
        "first pipelined loss equals the unsplit model's.",
        "",
        "| residual | ms / step (median) | runs (ms) | vs standard |",
        "|---|---|---|---|",
    ]
    for r in RESIDUALS:
        runs = ", ".join(f"{t:.1f}" for t in times[r])
        out.append(f"| {r} | {med[r]:.1f} | {runs} | {med[r] / med['standard']:.3f}x |")
    text = "\n".join(out) + "\n"
    print(text)
    name = f"pipeline_step_{bench.slug(machine)}"
    if args.virtual_stages > 1:
        name += f"_V{args.virtual_stages}"
    path = Path(args.out_dir) / f"{name}.md"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
