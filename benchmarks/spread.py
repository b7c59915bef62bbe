"""The spread across processes of the headline CPU row (issue 8: "a user's run
pays whichever it gets, so the benchmark must show the spread (several
processes), not one lucky run").

Runs benchmarks/bench.py K times, each in a fresh process (its own
allocator state, page faults, copy-bandwidth measurement and thread
placement), on the same shapes (default fp32 N=16 [4096, 1024], attnres only,
CPU passes fwd, bwd and fwd+bwd), one after the other. Prints and writes, per
shape and pass: every process's ms, % copy (of that process's own measured
copy bandwidth) and % next copy, and their min / median / max.

  python benchmarks/spread.py                      # K = 5, the headline shape
  python benchmarks/spread.py --processes 8 --shapes fp32:16:4096:1024,bf16:16:4096:1024
  python benchmarks/spread.py --quick --processes 2 --shapes fp32:2:64:128   # a dry run

Writes benchmarks/results/spread_<machine>.md (--out-dir to change; --quick
defaults to a temporary folder). The bench.py options that are not its own
(--min-run-s, --max-run-s, --repeats) are passed through.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench  # noqa: E402  (the machine name and the file naming)


def run_process(k: int, args, work: str, passthrough: list[str]) -> list[dict]:
    out_dir = os.path.join(work, f"process_{k}")
    cmd = [sys.executable, os.path.join(HERE, "bench.py"), "--device", "cpu", "--impls", "attnres",
           "--shapes", args.shapes, "--out-dir", out_dir, *passthrough]
    if args.quick:
        cmd.append("--quick")
    started = time.perf_counter()
    env = dict(os.environ)
    env.pop("OUT", None)  # the per-process CSVs are intermediate: no copies under $OUT
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"bench.py process {k} failed with rc={done.returncode}")
    csvs = [f for f in os.listdir(out_dir) if f.endswith(".csv")]
    if len(csvs) != 1:
        raise SystemExit(f"bench.py process {k} wrote {csvs} in {out_dir}, expected one CSV")
    with open(os.path.join(out_dir, csvs[0])) as f:
        rows = [r for r in csv.DictReader(f) if r["impl"] == "attnres" and r["ms"]]
    if not rows:
        raise SystemExit(f"bench.py process {k} measured no attnres row")
    print(f"process {k}: {len(rows)} rows in {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def number(text: str):
    return float(text) if text not in ("", None) else None


def summary(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return "–", "–", "–"
    return min(vals), statistics.median(vals), max(vals)


def fmt(v, spec):
    return "–" if v in ("–", None) else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=5, help="fresh processes (default 5)")
    ap.add_argument("--shapes", default="fp32:16:4096:1024",
                    help="bench.py --shapes (dtype:N:tokens:D, comma-separated)")
    ap.add_argument("--quick", action="store_true", help="bench.py --quick in each process")
    ap.add_argument("--out-dir", default=None,
                    help="folder for the .md (default benchmarks/results; a temporary folder "
                         "with --quick)")
    args, passthrough = ap.parse_known_args()
    if args.processes < 2:
        ap.error("--processes must be at least 2 (a spread needs several processes)")
    out_dir = args.out_dir or (tempfile.mkdtemp(prefix="attnres-spread-") if args.quick
                               else os.path.join(HERE, "results"))
    os.makedirs(out_dir, exist_ok=True)

    import torch

    machine = bench.machine_name("cpu")
    started = time.perf_counter()
    per_process = []
    with tempfile.TemporaryDirectory(prefix="attnres-spread-runs-") as work:
        for k in range(args.processes):
            per_process.append(run_process(k, args, work, passthrough))
    wall = time.perf_counter() - started

    keys = []
    for rows in per_process:
        for r in rows:
            key = (r["dtype"], r["N"], r["tokens"], r["D"], r["pass"])
            if key not in keys:
                keys.append(key)
    lines = [
        f"# attnres: spread across {args.processes} processes, {machine}",
        "",
        f"- machine: {machine}; torch {torch.__version__}; no GPU involved (CPU kernels)",
        f"- code: git {bench.git_state()}",
        f"- command: `python benchmarks/spread.py {' '.join(sys.argv[1:])}`; "
        f"{wall:.0f} s in all, the processes one after the other",
        "- each process: `bench.py --device cpu --impls attnres --shapes "
        f"{args.shapes}{' --quick' if args.quick else ''}` — its own copy-bandwidth "
        "measurement (\"% copy\"), the copy of the same bytes timed right after each row "
        "(\"% next copy\"), medians of its own repeats (bench.py's docstring)",
        "",
        "| dtype | N | tokens | D | pass | per process: ms (% copy / % next copy) | ms min / median / max "
        "| % copy min / median / max | % next copy min / median / max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        got = [next((r for r in rows if (r["dtype"], r["N"], r["tokens"], r["D"], r["pass"]) == key),
                    None) for rows in per_process]
        ms = [number(r["ms"]) if r else None for r in got]
        pc = [number(r["pct_copy_bw"]) if r else None for r in got]
        pn = [number(r["pct_copy_next"]) if r else None for r in got]
        each = ", ".join("–" if m is None else f"{m:.3g} ({fmt(c, '.0f')}/{fmt(n, '.0f')})"
                         for m, c, n in zip(ms, pc, pn))
        s_ms, s_pc, s_pn = summary(ms), summary(pc), summary(pn)
        lines.append(f"| {' | '.join(key)} | {each} | "
                     f"{' / '.join(fmt(v, '.3g') for v in s_ms)} | "
                     f"{' / '.join(fmt(v, '.1f') for v in s_pc)} | "
                     f"{' / '.join(fmt(v, '.1f') for v in s_pn)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    name = f"spread_{'quick_' if args.quick else ''}{bench.slug(machine)}.md"
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
