"""Training step of a small Block AttnRes model at 1 and 2 threads: whether
tiny reads start the thread team (docs/design.md §6, the parallel grain).

  python benchmarks/small_step_threads.py   # writes benchmarks/results/small_step_threads_<cpu>.md

The example GPT (Block, S = 2, 4 layers, D = 64, 4 x 128 = 512 tokens, fp32),
forward + backward + AdamW step. The thread counts run interleaved (one step
each in turn, torch.set_num_threads between them), medians compared in one
run; the step of "2 threads" over "1 thread" is the figure. No timing is a
pass/fail criterion.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import attnres
from attnres.models import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
import bench  # noqa: E402  (git_state)
import block_reads  # noqa: E402  (interleaved, machine_name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=128, d_model=64, n_layers=4, n_heads=4,
                    residual="block", block_size=2)
    model = GPT(cfg)
    opt = torch.optim.AdamW(attnres.param_groups(model, lr=1e-3, weight_decay=0.1))
    idx = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1))

    def step(threads):
        def run():
            torch.set_num_threads(threads)
            opt.zero_grad(set_to_none=True)
            model(idx, idx)[1].backward()
            opt.step()
        return run

    fns = {"1 thread": step(1), "2 threads": step(2)}
    for fn in fns.values():
        fn(), fn()
    load_before = os.getloadavg()[0]
    med = block_reads.interleaved(fns, args.repeats)
    load_after = os.getloadavg()[0]
    machine = block_reads.machine_name()
    out = [
        "# Small Block model: training step at 1 and 2 threads",
        "",
        f"Machine: {machine}; torch {torch.__version__}; {bench.git_state()}; command: "
        f"`python benchmarks/small_step_threads.py --repeats {args.repeats}`; 1-minute load "
        f"average {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs.",
        "",
        "Example GPT, Block S = 2, 4 layers, D = 64, 512 tokens, fp32; forward + backward + AdamW "
        "step; medians of interleaved steps.",
        "",
        "| threads | ms / step | vs 1 thread |",
        "|---|---|---|",
    ]
    for name, sec in med.items():
        out.append(f"| {name} | {sec * 1e3:.2f} | {sec / med['1 thread']:.2f}x |")
    text = "\n".join(out) + "\n"
    print(text)
    path = Path(args.out_dir) / f"small_step_threads_{bench.slug(machine)}.md"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
