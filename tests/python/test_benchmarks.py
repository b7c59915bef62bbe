"""The benchmark harness runs end to end (benchmarks/bench.py --quick, CPU).

Each test runs the script in a subprocess into a temporary folder (never
benchmarks/results) and checks the CSV it writes: columns, one row per
shape x implementation x pass, positive times.
"""
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench_module():
    spec = importlib.util.spec_from_file_location("attnres_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_bench(args, out_dir):
    env = dict(os.environ)
    env.pop("OUT", None)  # no copies anywhere else
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--out-dir", str(out_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc


def read_single(out_dir, pattern):
    csvs = sorted(Path(out_dir).glob(pattern + ".csv"))
    mds = sorted(Path(out_dir).glob(pattern + ".md"))
    assert len(csvs) == 1 and len(mds) == 1, sorted(p.name for p in Path(out_dir).iterdir())
    with open(csvs[0], newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader), mds[0].read_text()


def test_quick_cpu_table(tmp_path, bench_module):
    run_bench(["--device", "cpu", "--quick"], tmp_path)
    columns, rows, md = read_single(tmp_path, "cpu_quick_*")
    assert columns == bench_module.COLUMNS
    shapes = bench_module.CPU_QUICK
    impls = ["attnres", "eager", "compile"]
    passes = ["fwd", "bwd", "fwd+bwd"]
    got = sorted((r["dtype"], int(r["N"]), int(r["tokens"]), int(r["D"]), r["pass"], r["impl"]) for r in rows)
    want = sorted((*s, p, i) for s in shapes for p in passes for i in impls)
    assert got == want
    for r in rows:
        assert r["device"] == "cpu"
        assert float(r["ms"]) > 0 and float(r["gbps"]) > 0 and float(r["pct_copy_bw"]) > 0
        assert float(r["peak_mib"]) >= 0
        assert int(r["samples"]) >= 1 and int(r["calls_per_sample"]) >= 1
    # The op's forward output alone is tokens x D elements, allocated in the call.
    fwd = next(r for r in rows if r["impl"] == "attnres" and r["pass"] == "fwd" and r["dtype"] == "float32")
    assert float(fwd["peak_mib"]) * 2**20 >= int(fwd["tokens"]) * int(fwd["D"]) * 4 * 0.99
    assert "copy bandwidth" in md and "torch " in md and "| attnres ms |" in md


def test_quick_overhead(tmp_path, bench_module):
    run_bench(["--overhead", "--quick"], tmp_path)
    columns, rows, md = read_single(tmp_path, "overhead_quick_*")
    assert columns == bench_module.OVERHEAD_COLUMNS
    got = sorted((int(r["N"]), r["requires_grad"], r["impl"]) for r in rows)
    want = sorted((n, rg, i) for n in (3, 33, 121) for rg in ("False", "True") for i in ("attnres", "op"))
    assert got == want
    for r in rows:
        assert (r["tokens"], r["D"], r["dtype"]) == ("1", "1024", "float32")
        assert float(r["us_per_call"]) > 0 and float(r["min_us"]) > 0 and float(r["cpu_us_per_call"]) > 0
        assert r["git_head"]
    assert "code: git" in md and "| wrapper µs wall |" in md
