"""The benchmark harnesses run end to end on CPU (benchmarks/bench.py --quick,
benchmarks/bench_model.py --tiny) and their CUDA-only parts are checked
where a CPU can: the peers' skip rows, the CUDA shape order, the CSV written
row by row, the depth-read swap of the model benchmark, and the peers'
adapters against FLA's PyTorch reference / Liger's kernels under the Triton
interpreter (when their wheels are in .whl/).

Each run goes into a temporary folder (never benchmarks/results).
"""
import csv
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench.py"
BENCH_MODEL = ROOT / "benchmarks" / "bench_model.py"
PEERS = ROOT / "benchmarks" / "peers.py"
SPREAD = ROOT / "benchmarks" / "spread.py"
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.sh"


@pytest.fixture(scope="module")
def bench_module():
    spec = importlib.util.spec_from_file_location("attnres_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_bench(args, out_dir, script=BENCH):
    env = dict(os.environ)
    env.pop("OUT", None)  # no copies anywhere else
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--out-dir", str(out_dir)],
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
    # The peers (Triton, CUDA only) get a row per shape and pass saying why not.
    peer_rows = [r for r in rows if r["impl"] in ("fla", "liger")]
    rows = [r for r in rows if r["impl"] not in ("fla", "liger")]
    assert sorted((r["dtype"], int(r["N"]), r["pass"], r["impl"]) for r in peer_rows) == sorted(
        (s[0], s[1], p, i) for s in shapes for p in passes for i in ("fla", "liger"))
    for r in peer_rows:
        assert r["ms"] == "" and ("not installed" in r["note"] or "CPU" in r["note"]), r
    got = sorted((r["dtype"], int(r["N"]), int(r["tokens"]), int(r["D"]), r["pass"], r["impl"]) for r in rows)
    want = sorted((*s, p, i) for s in shapes for p in passes for i in impls)
    assert got == want
    for r in rows:
        assert r["note"] == ""
        if r["impl"] != "attnres":  # checked against attnres's output
            assert float(r["rel_err"]) < 1e-2, r
        assert r["device"] == "cpu"
        assert float(r["ms"]) > 0 and float(r["gbps"]) > 0 and float(r["pct_copy_bw"]) > 0
        # Ours gets a copy of the same bytes timed right after it; the others not.
        assert (float(r["pct_copy_next"]) > 0) if r["impl"] == "attnres" else r["pct_copy_next"] == ""
        assert float(r["peak_mib"]) >= 0
        assert int(r["samples"]) >= 1 and int(r["calls_per_sample"]) >= 1
    # The op's forward output alone is tokens x D elements, allocated in the call.
    fwd = next(r for r in rows if r["impl"] == "attnres" and r["pass"] == "fwd" and r["dtype"] == "float32")
    assert float(fwd["peak_mib"]) * 2**20 >= int(fwd["tokens"]) * int(fwd["D"]) * 4 * 0.99
    assert "copy bandwidth" in md and "torch " in md and "| attnres ms |" in md and "% next copy" in md


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


def test_cuda_shape_order(bench_module):
    """Priority shapes first (bf16 T=65536, N {9,17,33} x D {1024,4096,7168},
    the headline N=9 D=4096 leading), then the rest with T=65536 before 8192;
    gpu_check.sh's warm-up list is the same priority list."""
    prio = bench_module.cuda_shapes("priority")
    assert prio[0] == ("bfloat16", 9, 65536, 4096)
    assert sorted(prio) == sorted(("bfloat16", n, 65536, d) for n in (9, 17, 33) for d in (1024, 4096, 7168))
    rest = bench_module.cuda_shapes("rest")
    everything = bench_module.cuda_shapes("all")
    assert everything == prio + rest == bench_module.CUDA_SHAPES
    assert len(set(everything)) == len(everything) and not set(prio) & set(rest)
    ts = [t for _, _, t, _ in rest]
    assert ts == sorted(ts, reverse=True)  # all T=65536 before any T=8192
    assert rest[0][0] == "bfloat16"
    text = GPU_CHECK.read_text()
    line = next(l for l in text.splitlines() if l.startswith("PRIORITY_SHAPES="))
    listed = [tuple(x.split(":")) for x in line.split("=", 1)[1].strip('"').split(",")]
    assert [("bfloat16", int(n), int(t), int(d)) for _, n, t, d in listed] == prio
    assert all(dt == "bf16" for dt, *_ in listed)


def test_csv_rows_flushed_and_appended(tmp_path, bench_module, monkeypatch):
    """Each row is on disk as soon as it is added (a killed run keeps it), and
    --append keeps the rows of the earlier stages."""
    monkeypatch.delenv("OUT", raising=False)
    out = bench_module.Output(str(tmp_path), "t", ["a", "b"])
    out.add({"a": 1, "b": 2})
    assert (tmp_path / "t.csv").read_text().splitlines() == ["a,b", "1,2"]  # before close
    out.close()
    again = bench_module.Output(str(tmp_path), "t", ["a", "b"], append=True)
    assert again.previous_rows == [{"a": "1", "b": "2"}]
    again.add({"a": 3})
    again.close()
    assert (tmp_path / "t.csv").read_text().splitlines() == ["a,b", "1,2", "3,"]
    # Other columns: started afresh.
    bench_module.Output(str(tmp_path), "t", ["c"], append=True).close()
    assert (tmp_path / "t.csv").read_text().splitlines() == ["c"]
    # Two invocations of the script, the second appending.
    args = ["--device", "cpu", "--quick", "--impls", "attnres", "--passes", "fwd",
            "--shapes", "fp32:2:8:16"]
    run_bench(args, tmp_path)
    run_bench(args + ["--append"], tmp_path)
    _, rows, md = read_single(tmp_path, "cpu_quick_*")
    assert len(rows) == 2 and all(r["impl"] == "attnres" and float(r["ms"]) > 0 for r in rows)
    assert md.count("| float32 | 2 | 8 | 16 | fwd |") == 1


def test_peers_not_run_on_cpu(bench_module, monkeypatch):
    peers = bench_module.peers  # benchmarks/peers.py, as bench.py imports it
    assert peers.__file__ == str(PEERS)
    assert set(peers.DEFAULT_PEERS) == {"fla", "liger"}
    for name in peers.PEERS:
        assert peers.unavailable(name, "cpu")  # a reason, never None on CPU
    monkeypatch.setattr(peers, "installed", lambda name: True)
    assert "CUDA" in peers.unavailable("fla", "cpu")
    assert peers.unavailable("liger", "cuda") is None
    monkeypatch.setattr(peers, "installed", lambda name: False)
    assert "not installed" in peers.unavailable("fla", "cuda")


def test_liger_refused_at_2_31_elements(bench_module):
    """Liger's kernels offset V in 32-bit integers: the adapter refuses such a
    call (before it stacks anything) instead of faulting the CUDA context."""
    peers = bench_module.peers
    calls = []
    big = [torch.empty(65536, 4096, device="meta", dtype=torch.bfloat16)] * 8
    q = torch.empty(4096, device="meta")
    with pytest.raises(peers.PeerUnsupported, match="2\\^31 elements"):
        peers.liger_call(big, q, None, impl=lambda *a: calls.append(a))
    assert not calls
    # One element fewer than 2^31 reaches the peer.
    peers.liger_call([torch.empty(2**31 - 1, 1, device="meta")], torch.empty(1, device="meta"), None,
                     impl=lambda *a: calls.append(a))
    assert len(calls) == 1


def test_model_step_tiny(tmp_path):
    """The whole-model benchmark's code path (tiny model, CPU, compile backend
    'eager'): attnres and eager measured, FLA skipped with a row."""
    proc = run_bench(["--device", "cpu", "--tiny", "--impls", "attnres,eager,fla", "--warmup", "1",
                      "--min-run-s", "0.01"], tmp_path, script=BENCH_MODEL)
    csvs = sorted(tmp_path.glob("cpu_model_tiny_*.csv"))
    assert len(csvs) == 1, proc.stdout
    with open(csvs[0], newline="") as f:
        rows = {r["impl"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"attnres", "eager", "fla"}
    for impl in ("attnres", "eager"):
        r = rows[impl]
        assert float(r["ms_per_step"]) > 0 and float(r["peak_mib"]) >= 0 and r["note"] == "", r
        assert (r["layers"], r["d_model"], r["residual"], r["dtype"]) == ("2", "64", "full", "bfloat16")
    assert rows["fla"]["ms_per_step"] == "" and rows["fla"]["note"]
    assert "| attnres |" in sorted(tmp_path.glob("cpu_model_tiny_*.md"))[0].read_text()


def test_swap_depth_reads():
    """The model benchmark swaps every depth read of one model instance (the
    same Parameters), and a swap to attnres's own function changes nothing."""
    spec = importlib.util.spec_from_file_location("attnres_bench_model", BENCH_MODEL)
    bm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bm)
    import torch
    import attnres
    from attnres.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, residual="full")
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))  # non-zero queries
    idx = torch.randint(0, 32, (2, 8))
    want, _ = model(idx)
    params = {id(p) for p in model.parameters()}
    calls = []

    def fn(sources, q, g, eps):
        calls.append(len(sources))
        return attnres.depth_attention(sources, q, g, eps=eps)

    assert bm.swap_depth_reads(model, fn, "test") == 2 * cfg.n_layers + 1
    assert {id(p) for p in model.parameters()} == params
    got, _ = model(idx)
    assert calls == list(range(1, 2 * cfg.n_layers + 2))
    torch.testing.assert_close(got, want)


def _peer_site(tmp_path):
    import zipfile

    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    names = " ".join(w.name for w in wheels)
    if not ("fla_core" in names and "liger_kernel" in names and "einops" in names):
        pytest.skip("the peers' wheels are not in .whl/ (pip download --no-deps -d .whl "
                    "fla-core flash-linear-attention liger-kernel einops packaging)")
    site = tmp_path / "site"
    for w in wheels:
        zipfile.ZipFile(w).extractall(site)
    return site


def test_peer_adapters_match_attnres(tmp_path):
    """The adapters' argument mapping, forward and backward, against attnres
    on CPU: fla_call with FLA's PyTorch reference naive_attnres (the fused
    kernels refuse CPU tensors), liger_call with Liger's Triton kernels under
    the Triton interpreter (TRITON_INTERPRET=1)."""
    site = _peer_site(tmp_path)
    code = f"""
import sys, torch
sys.path[:0] = [{str(ROOT / 'python')!r}, {str(ROOT / 'benchmarks')!r}]
import attnres, peers
from fla.ops.attnres import naive_attnres
from liger_kernel.transformers.functional import liger_attn_res
g = torch.Generator().manual_seed(0)
for N, T, D in ((1, 3, 16), (5, 4, 32)):
    srcs = [torch.randn(T, D, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(N)]
    q = (torch.randn(D, generator=g, dtype=torch.float64) / D ** 0.5).requires_grad_(True)
    w = (1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)).requires_grad_(True)
    dh = torch.randn(T, D, generator=g, dtype=torch.float64)
    ref = attnres.depth_attention(srcs, q, w, eps=1e-6)
    want = torch.autograd.grad(ref, [*srcs, q, w], dh)
    for name, call, tol in (("fla", lambda: peers.fla_call(srcs, q, w, 1e-6, impl=naive_attnres), 1e-5),  # FLA's reference computes in fp32
                            ("liger", lambda: peers.liger_call([s.float() for s in srcs], q.float(), w.float(),
                                                                1e-6, impl=liger_attn_res), 1e-4)):
        h = call()
        grads = torch.autograd.grad(h, [*srcs, q, w], dh.to(h.dtype))
        err = max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip((h, *grads), (ref, *want)))
        assert err < tol, (name, N, T, D, err)
        print(name, N, T, D, "max rel err", err)
print("adapters ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(site))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "adapters ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_block_reads_benchmark_quick():
    # Runs end to end (writes no results file with --quick); the byte
    # accounting agrees with docs/design.md §10's table (rows of D values,
    # statistics on top).
    script = ROOT / "benchmarks" / "block_reads.py"
    spec = importlib.util.spec_from_file_location("attnres_block_reads_bench", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    one, two = mod.row_counts(32, 4, 1 << 20)  # a huge D: the statistics vanish
    assert abs(one / (4 << 20) - 200) < 0.01 and abs(two / (4 << 20) - 140) < 0.01
    # Every kind of run gets a results file of its own.
    size = (16, 1024, 2, 256, 4)
    suffixes = [mod.results_suffix(False, False, 2048), mod.results_suffix(False, False, 4096),
                mod.results_suffix(False, False, 2048, size), mod.results_suffix(False, True, 8192),
                mod.results_suffix(True, False, 2048), mod.results_suffix(True, False, 2048, size)]
    assert suffixes == ["", "_T4096", "_model_16_1024_2_256_4", "_reads_T8192", "_gpt",
                        "_gpt_16_1024_2_256_4"]
    assert mod.parse_gpt_size("16,1024,2,256,4") == size
    for bad in ("16,512,4", "16,a,4,256,4", "16,512,4,256,0", "16,200,4,256,4"):  # 200: 3 heads
        with pytest.raises(ValueError, match="--gpt"):
            mod.parse_gpt_size(bad)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    # Part 1's nine (L, S) rows and part 3's one training row (L = 12, S = 4).
    assert sum(1 for r in rows if r.split("|")[1].strip() in ("12", "32", "64")) == 10
    assert "block two-phase" in proc.stdout and "training step" in proc.stdout
    assert "Phase 1 alone" not in proc.stdout
    # The example GPT's tables: the fused-norm Block model, page faults per
    # call, and (glibc) the same tables again with malloc keeping freed memory.
    assert "| block auto, fused RMSNorm |" in proc.stdout
    assert "minor page faults per call" in proc.stdout
    gpt_rows = [r.split("|") for r in rows if r.startswith("| block auto, fused RMSNorm |")]
    assert gpt_rows and all(len(r) == 7 and float(r[5]) >= 0 for r in gpt_rows), gpt_rows
    kept = proc.stdout.count("malloc keeping freed memory (mallopt(")
    assert kept == (2 if platform.libc_ver()[0] == "glibc" else 0), proc.stdout[-3000:]
    # --reads-only --tokens: part 1 and phase 1 alone, at the given size.
    proc = subprocess.run([sys.executable, str(script), "--quick", "--reads-only", "--tokens", "96"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    part1 = [r for r in rows if r.split("|")[1].strip() in ("12", "32", "64")]
    assert len(part1) == 9
    # 11 columns, among them the speeds against a copy and the least ratio
    # at copy speed: positive numbers.
    assert all(len(r.split("|")) == 13 and all(float(c) > 0 for c in r.split("|")[8:11])
               for r in part1), part1
    assert sum(1 for r in rows if r.split("|")[1].strip() in ("1", "4", "8")) == 3  # phase 1 alone
    assert "training step" not in proc.stdout and "block two-phase" not in proc.stdout
    assert "T = 96 tokens" in proc.stdout and "Phase 1 alone" in proc.stdout
    # --gpt-only --gpt: part 2 alone at the given size; a malformed size is refused.
    proc = subprocess.run([sys.executable, str(script), "--quick", "--gpt-only", "--gpt", "1,32,1,16,2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 layers (2 sublayers), D = 32, B = 1, T = 16, Block S = 2" in proc.stdout
    assert "Reads of a Block model" not in proc.stdout and "training step" not in proc.stdout
    proc = subprocess.run([sys.executable, str(script), "--gpt-only", "--gpt", "16,x,4,256,4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "LAYERS,D,B,T,S" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(script), "--gpt-only", "--reads-only"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "not allowed with" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(script), "--gpt-train"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--gpt-train goes with --gpt-only" in proc.stderr


def test_prefix_add_reads_benchmark_quick():
    # Runs end to end (no results file with --quick): a row per (grad, T),
    # every time and ratio positive (the fused merge's equality with the
    # unfused one is test_prefix_add.py's).
    script = ROOT / "benchmarks" / "prefix_add_reads.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r.split("|")[1:-1] for r in proc.stdout.splitlines()
            if r.startswith("| no |") or r.startswith("| with |")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("no", "1"), ("no", "16"), ("with", "1"), ("with", "16")]
    assert all(len(r) == 16 and all(float(c) > 0 for c in r[5:]) for r in rows), rows


def test_read_host_time_benchmark(tmp_path):
    # Runs end to end (results into tmp_path): the seven variants, each with
    # a positive time per sublayer and its ratio to the plain add (the size
    # sweep left out: minutes).
    script = ROOT / "benchmarks" / "read_host_time.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), "--repeats", "5", "--no-sweep",
                           "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r.split("|")[1].strip(): r.split("|")[2:4] for r in proc.stdout.splitlines()
            if r.startswith("| ") and not r.startswith("| variant")}
    modes = ("one_call", "two_phase", "auto")
    assert set(rows) == {"plain residual add", *(f"Block {m}" for m in modes),
                         *(f"Block {m}, block_storage" for m in modes)}
    assert all(float(us) > 0 and float(ratio) > 0 for us, ratio in rows.values())
    assert len(list(tmp_path.glob("read_host_time_*.md"))) == 1


def test_out_norm_benchmark_quick(tmp_path):
    # Runs end to end on small sizes (results into tmp_path): every read row
    # (2 dtypes x 2 N x 2 passes) and every model variant is printed.
    script = ROOT / "benchmarks" / "out_norm.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert sum(1 for r in rows if r.split("|")[3].strip() in ("infer", "train")) == 8
    assert "block, fused norm" in proc.stdout and "training step" in proc.stdout
    assert list(tmp_path.glob("quick_out_norm_*.md"))


def test_spread_across_processes_quick(tmp_path):
    """spread.py runs bench.py in separate processes and tabulates every
    process's row and the min / median / max (issue 8: the benchmark shows the
    spread across processes, not one run)."""
    out = run_bench(["--quick", "--processes", "2", "--shapes", "fp32:2:64:128"], tmp_path,
                    script=SPREAD)
    assert out.stdout.count("process ") >= 2, out.stdout
    md = next(tmp_path.glob("spread_quick_*.md")).read_text()
    rows = [line for line in md.splitlines() if line.startswith("| float32 | 2 | 64 | 128 |")]
    assert [r.split(" | ")[4] for r in rows] == ["fwd", "bwd", "fwd+bwd"], md
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        per_process = cells[5].split("), ")
        assert len(per_process) == 2, r
        lo, mid, hi = (float(v) for v in cells[6].split(" / "))
        assert 0 < lo <= mid <= hi, r


def test_spread_needs_several_processes(tmp_path):
    with pytest.raises(AssertionError, match="at least 2"):
        run_bench(["--quick", "--processes", "1"], tmp_path, script=SPREAD)


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.sh's CPU dry run: every stage's code (smoke check,
    the decode stage, bench.py, the out-norm stage, bench_model.py per implementation, the long
    tests, the sanitizer's shapes script) runs on the CPU with small shapes,
    rows reach $OUT as measured, nothing is written to benchmarks/results/."""
    results, out = tmp_path / "results", tmp_path / "out"
    env = dict(os.environ)
    env.update(GPU_CHECK_DRY_RUN="1", GPU_CHECK_RESULTS=str(results), OUT=str(out),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    before = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    proc = subprocess.run(["bash", str(GPU_CHECK)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    log = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{log[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    for expected in ("DRY RUN on the CPU", "attnres CPU kernels registered: True",
                     "smoke check: 0 failure(s)", "smoke rc=0", "smoke rings rc=0", "bench.py priority rc=0",
                     "bench.py rings on rc=0", "bench.py rings off rc=0",
                     "out_norm stage rc=0", "block_reads stage rc=0", "block_gpt stage rc=0",
                     "decode stage rc=0", "few-tokens stage rc=0",
                     "bench_model.py attnres rc=0", "bench_model.py eager rc=0",
                     "test_cuda.py rc=0", "sanitizer shapes on the CPU without compute-sanitizer: rc=0"):
        assert expected in log, f"{expected!r} not in the log:\n{log[-6000:]}"
    assert "FAIL" not in log.replace("failure(s)", "")
    # The decode stage checked every variant's decoded logits and timed them.
    assert "Every variant's decoded logits were checked" in log and "all agree." in log
    assert "| Block AttnRes, block_storage |" in log
    # The GPT stage's table: Block two-phase with the fused norm against the standard residual.
    assert "| block two-phase, fused RMSNorm |" in log and "Example GPT inference forward" in log
    # The smoke check compared both phases' backward too (every dtype and shape).
    assert log.count("merge backward: max rel err") >= 4, log[-6000:]
    assert log.count("reads backward: max rel err") >= 4, log[-6000:]
    assert (out / "gpu_check.log").read_text() == log
    bench_rows = list(csv.DictReader(open(next(out.glob("cpu_quick_*.csv")), newline="")))
    assert any(r["impl"] == "attnres" and float(r["ms"]) > 0 for r in bench_rows)
    # The rings' A/B rows (ATTNRES_CUDA_RING=1 in a process of its own).
    assert any(r["impl"] == "attnres_ring1" and float(r["ms"]) > 0 for r in bench_rows)
    model_rows = list(csv.DictReader(open(next(out.glob("cpu_model_tiny_*.csv")), newline="")))
    assert {r["impl"] for r in model_rows} >= {"attnres", "eager"}
    assert "| bf16 N, T, D | pass |" in (results / "gpu_out_norm.md").read_text()
    assert sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir()) == before
