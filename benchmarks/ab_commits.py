"""Before/after speed of two commits on the CPU, in one run.

Builds each commit CPU-only (CMake, ATTNRES_NO_CUDA) in a git worktree under
--work-dir, then alternates fresh processes, one per commit per round, each
timing the same three cases with its own build on PYTHONPATH:

  fwd              depth_attention, float32, N = 16 sources [4096, 1024], no grad
  fwd+bwd          the same read and autograd.grad of every input
  gpt_block_infer  the example GPT (16 layers, D = 1024, Block S = 4, fused
                   RMSNorm reads), batch 2 x 256 tokens, no grad

Medians over rounds of each process's medians; the ratio is after / before.

  python benchmarks/ab_commits.py BEFORE AFTER [--rounds 6] [--work-dir /tmp/attnres-ab]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_PROCESS = r"""
import json, statistics, time
import torch, attnres
from attnres.models import GPT, GPTConfig

torch.manual_seed(0)

def med(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

out = {}
src = [torch.randn(4096, 1024).requires_grad_() for _ in range(16)]
q = (torch.randn(1024) / 32).requires_grad_()
w = torch.ones(1024, requires_grad=True)
with torch.no_grad():
    out["fwd"] = med(lambda: attnres.depth_attention(src, q, w), 15)
dh = torch.randn(4096, 1024)
out["fwd+bwd"] = med(lambda: torch.autograd.grad(attnres.depth_attention(src, q, w), src + [q, w], dh), 9)
cfg = GPTConfig(vocab_size=256, seq_len=256, d_model=1024, n_layers=16, n_heads=8, residual="block",
                block_size=4, norm="rmsnorm")
model = GPT(cfg).eval()
idx = torch.randint(0, 256, (2, 256))
with torch.no_grad():
    out["gpt_block_infer"] = med(lambda: model(idx), 7)
print(json.dumps(out))
"""


def run(cmd) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"ab_commits.py: {' '.join(cmd)} failed (rc {out.returncode}):\n{out.stdout[-2000:]}"
                 f"{out.stderr[-3000:]}")


def build(commit: str, work: Path) -> Path:
    tree = work / commit
    if not (tree / "python" / "attnres" / "libattnres.so").exists():
        if not (tree / "CMakeLists.txt").exists():  # a worktree left by an earlier run is reused
            run(["git", "-C", str(ROOT), "worktree", "add", "-f", str(tree), commit])
        import torch

        run(["cmake", "-S", str(tree), "-B", str(tree / "build"), "-DCMAKE_BUILD_TYPE=Release",
             "-DATTNRES_NO_CUDA=ON", "-DATTNRES_BUILD_PYTHON=ON",
             f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DPython3_EXECUTABLE={sys.executable}"])
        run(["cmake", "--build", str(tree / "build"), "-j", os.environ.get("MAX_JOBS", "2")])
        for lib in list((tree / "build").glob("_C*.so")) + [tree / "build" / "libattnres.so"]:
            (tree / "python" / "attnres" / lib.name).write_bytes(lib.read_bytes())
    return tree / "python"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--work-dir", default="/tmp/attnres-ab")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    paths = {c: build(c, work) for c in (args.before, args.after)}
    runs = {c: [] for c in paths}
    for rnd in range(args.rounds):
        for commit, path in paths.items():
            env = dict(os.environ, PYTHONPATH=str(path))
            out = subprocess.run([sys.executable, "-c", ONE_PROCESS], env=env, capture_output=True, text=True,
                                 cwd=work)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            runs[commit].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {rnd + 1} {commit}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in runs[commit][-1].items()),
                  flush=True)
    import torch

    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {args.rounds} rounds of one process per commit, alternating")
    print("| case | before ms | after ms | after / before | before range | after range |")
    print("|---|---|---|---|---|---|")
    for case in runs[args.before][0]:
        b = [r[case] for r in runs[args.before]]
        a = [r[case] for r in runs[args.after]]
        print(f"| {case} | {statistics.median(b):.2f} | {statistics.median(a):.2f} | "
              f"{statistics.median(a) / statistics.median(b):.3f} | {min(b):.1f}–{max(b):.1f} | "
              f"{min(a):.1f}–{max(a):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
