"""Whole-model benchmark: ms per compiled bf16 training step of the example
GPT (python/attnres/models.py) with Full AttnRes, for each implementation
of the depth reads.

  python benchmarks/bench_model.py --device cuda                 # 24 layers, D=1024, 16 heads, B=2, T=1024
  python benchmarks/bench_model.py --device cuda --impls fla --append
  python benchmarks/bench_model.py --device cpu --tiny           # dry run (CI): 2 layers, D=64

Implementations of the depth reads (every AttnResResidual of the model):
  attnres   the model as built: attnres.depth_attention (the fused op);
  eager     attnres.reference.depth_attention (plain PyTorch; it stacks the
            sources; inside the compiled step, so inductor compiles it);
  fla       FLA's fla.ops.attnres.fused_attnres through benchmarks/peers.py,
            under torch.compiler.disable (the compiled step graph-breaks at
            each read and FLA's autograd.Function and Triton kernels run as
            they do eagerly; dynamo does not trace its autotuner);
  liger     Liger-Kernel's liger_attn_res the same way (stacks the sources);
  standard  (not by default) the plain residual sum, residual="standard".

How the implementation is swapped (no global monkeypatching): for every
impl but attnres, each AttnResResidual child module of this model instance
is replaced by a SwappedDepthRead that holds the *same* query and gain
Parameters and calls the chosen function on stream.sources; the model's code
is not changed and other models are untouched.

The step: model.to(bf16) (parameters, activations and the depth-read
sources in bf16), torch.compile(model) (forward and backward, default
mode), loss = cross-entropy of the logits (float32), loss.backward(), then
AdamW (fused=True on CUDA: one kernel for all parameters; the optimizer
itself is not compiled) and zero_grad(set_to_none=True). Timing:
torch.utils.benchmark Timer.blocked_autorange (it synchronizes CUDA) after
--warmup steps (the first compiles: its time is the compile_s column);
median ms per step. peak_mib: torch.cuda.max_memory_allocated() over the
timed steps (CUDA) or the CPU profiler's peak of one step (CPU).

Each row is appended to <out-dir>/{gpu,cpu}_model_<machine>.csv as soon as
it is measured (and to $OUT when set); an implementation that cannot run
gets a row with a note. gpu_check.sh runs one process per implementation,
each under its own time cap, all appending to the same CSV.
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
import traceback

import torch
import torch.utils.benchmark as tbench
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

from attnres import reference  # noqa: E402
from attnres.models import GPT, GPTConfig  # noqa: E402
from attnres.modules import AttnResResidual  # noqa: E402

import bench  # noqa: E402  (Output, machine names, git state, peak memory)
import peers  # noqa: E402

IMPLS = ("attnres", "fla", "eager")
EXTRA_IMPLS = ("liger", "standard")
COLUMNS = ["machine", "device", "dtype", "layers", "d_model", "heads", "batch", "seq_len", "vocab",
           "residual", "impl", "compiled", "ms_per_step", "tokens_per_s", "peak_mib", "compile_s",
           "steps", "git_head", "note"]

FULL = dict(layers=24, d_model=1024, heads=16, batch=2, seq_len=1024, vocab=32000)
TINY = dict(layers=2, d_model=64, heads=4, batch=2, seq_len=16, vocab=64)


class SwappedDepthRead(nn.Module):
    """Stands in for one AttnResResidual: the same query and gain Parameters
    (shared, not copied), another function for the read."""

    def __init__(self, original: AttnResResidual, fn, name: str):
        super().__init__()
        self.query = original.query
        self.norm_weight = original.norm_weight
        self.eps = original.eps
        self.fn = fn
        self.impl = name

    def forward(self, stream, return_weights: bool = False):
        if return_weights:
            raise ValueError(f"the {self.impl} depth read does not return weights")
        return self.fn(stream.sources, self.query, self.norm_weight, self.eps)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"


def swap_depth_reads(model: nn.Module, fn, name: str) -> int:
    """Replace every AttnResResidual child of ``model`` by a SwappedDepthRead
    calling ``fn(sources, query, gain, eps)``; returns how many."""
    targets = [(parent, child_name, child)
               for parent in model.modules()
               for child_name, child in parent.named_children()
               if isinstance(child, AttnResResidual)]
    for parent, child_name, child in targets:
        setattr(parent, child_name, SwappedDepthRead(child, fn, name))
    return len(targets)


def read_function(impl: str):
    """fn(sources, query, gain, eps) for the impl (None: keep the model's own)."""
    if impl in ("attnres", "standard"):
        return None
    if impl == "eager":
        return lambda sources, q, g, eps: reference.depth_attention(sources, q, g, eps=eps)
    peer = peers.load(impl)
    # Not traced by dynamo: a graph break at each read, the peer runs as in eager.
    return torch.compiler.disable(lambda sources, q, g, eps: peer(sources, q, g, eps))


def build(cfg_kw: dict, impl: str, device: str, dtype: torch.dtype):
    cfg = GPTConfig(vocab_size=cfg_kw["vocab"], seq_len=cfg_kw["seq_len"], d_model=cfg_kw["d_model"],
                    n_layers=cfg_kw["layers"], n_heads=cfg_kw["heads"],
                    residual="standard" if impl == "standard" else "full")
    torch.manual_seed(0)
    model = GPT(cfg)
    fn = read_function(impl)
    if fn is not None:
        n = swap_depth_reads(model, fn, impl)
        assert n == 2 * cfg.n_layers + 1, n
    model = model.to(device=device, dtype=dtype).train()
    return cfg, model


def make_step(model, cuda: bool, compile_backend: str, compiled: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)
    fwd = torch.compile(model, backend=compile_backend) if compiled else model

    def step(idx, targets):
        _, loss = fwd(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run_one(impl: str, args, cfg_kw: dict, out, machine: str, git: str) -> bool:
    device = args.device
    cuda = device.startswith("cuda")
    dtype = getattr(torch, args.dtype)
    base = {"machine": machine, "device": "cuda" if cuda else "cpu", "dtype": args.dtype,
            "layers": cfg_kw["layers"], "d_model": cfg_kw["d_model"], "heads": cfg_kw["heads"],
            "batch": cfg_kw["batch"], "seq_len": cfg_kw["seq_len"], "vocab": cfg_kw["vocab"],
            "residual": "standard" if impl == "standard" else "full", "impl": impl,
            "compiled": not args.no_compile, "git_head": git.split()[0]}

    def note(why):
        out.add({**base, "note": why})
        print(f"model {impl}: not measured: {why}", flush=True)
        return False

    if impl in peers.PEERS:
        why = peers.unavailable(impl, device)
        if why:
            return note(why)
    torch._dynamo.reset()
    try:
        cfg, model = build(cfg_kw, impl, device, dtype)
    except Exception as exc:
        traceback.print_exc()
        return note(f"failed to build ({type(exc).__name__}: {exc})"[:300])
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (cfg_kw["batch"], cfg.seq_len), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (cfg_kw["batch"], cfg.seq_len), generator=gen).to(device)
    step = make_step(model, cuda, args.compile_backend, not args.no_compile)
    try:
        t0 = time.perf_counter()
        step(idx, targets)
        if cuda:
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            step(idx, targets)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_alloc = torch.cuda.memory_allocated()
        timer = tbench.Timer(stmt="step(idx, targets)", globals=dict(step=step, idx=idx, targets=targets),
                             num_threads=torch.get_num_threads())
        m = timer.blocked_autorange(min_run_time=args.min_run_s)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            peak_note = f"(of which {base_alloc / 2**20:.0f} MiB held before the timed steps)"
        else:
            peak = bench.peak_bytes(device, lambda: step(idx, targets))
            peak_note = ""
    except torch.OutOfMemoryError:
        return note("out of memory")
    except Stopped as exc:
        note(f"{exc} after {time.perf_counter() - t0:.0f} s (compiling or measuring)")
        raise SystemExit(124)
    except Exception as exc:
        traceback.print_exc()
        return note(f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"[:300])
    ms = m.median * 1e3
    tokens = cfg_kw["batch"] * cfg.seq_len
    row = {**base, "ms_per_step": f"{ms:.4g}", "tokens_per_s": f"{tokens / m.median:.0f}",
           "peak_mib": f"{peak / 2**20:.1f}", "compile_s": f"{compile_s:.1f}",
           "steps": len(m.raw_times) * m.number_per_run, "note": ""}
    out.add(row)
    print(f"model {impl}: {ms:.2f} ms/step, {tokens / m.median:.0f} tokens/s, peak {peak / 2**20:.0f} MiB "
          f"{peak_note}, first step (compile) {compile_s:.1f} s", flush=True)
    del model, step
    if cuda:
        torch.cuda.empty_cache()
    return True


def write_md(out, rows_csv: str, machine: str, args, cfg_kw: dict):
    import csv

    with open(rows_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    ours = next((r for r in rows if r["impl"] == "attnres" and r["ms_per_step"]), None)
    lines = [
        f"# attnres whole-model training step: {machine}",
        "",
        f"- torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else "")
        + f", Python {platform.python_version()}",
        f"- model: example GPT (attnres.models), Full AttnRes, {cfg_kw['layers']} layers, D={cfg_kw['d_model']}, "
        f"{cfg_kw['heads']} heads, batch {cfg_kw['batch']}, T={cfg_kw['seq_len']}, vocab {cfg_kw['vocab']}, "
        f"{args.dtype} parameters and activations",
        "- step: torch.compile(model) forward + backward, AdamW (fused on CUDA), zero_grad; median of "
        "torch.utils.benchmark blocked_autorange; peers' reads under torch.compiler.disable (graph breaks)",
        "",
        "| impl | ms/step | tokens/s | vs attnres | peak MiB | first step s | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (f"{float(r['ms_per_step']) / float(ours['ms_per_step']):.2f}x"
                 if ours and r["ms_per_step"] else "–")
        lines.append(f"| {r['impl']} | {r['ms_per_step'] or '–'} | {r['tokens_per_s'] or '–'} | {ratio} "
                     f"| {r['peak_mib'] or '–'} | {r['compile_s'] or '–'} | {r['note']} |")
    out.write_md("\n".join(lines) + "\n")


def parse_args(argv=None):
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=default_device)
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help=f"comma-separated subset of {', '.join(IMPLS + EXTRA_IMPLS)}")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU dry run)")
    ap.add_argument("--dtype", default="bfloat16")
    for k, v in FULL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} ({TINY[k]} with --tiny)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    ap.add_argument("--min-run-s", type=float, default=None, help="blocked_autorange min_run_time (default 3, tiny 0.05)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; 'eager' with --tiny on CPU)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--append", action="store_true", help="append to an existing CSV of the same columns")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.min_run_s is None:
        args.min_run_s = 0.05 if args.tiny else 3.0
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.tiny and not args.device.startswith("cuda") else "inductor"
    if args.out_dir is None:
        import tempfile

        args.out_dir = (os.path.join(tempfile.gettempdir(), "attnres-bench-quick") if args.tiny
                        else bench.RESULTS)
    for i in args.impls.split(","):
        if i not in IMPLS + EXTRA_IMPLS:
            ap.error(f"unknown implementation {i!r} ({', '.join(IMPLS + EXTRA_IMPLS)})")
    return args


class Stopped(Exception):
    pass


def _stop(signum, frame):
    raise Stopped(f"stopped by signal {signum} (the caller's time cap)")


def main(argv=None) -> int:
    args = parse_args(argv)
    # gpu_check.sh's timeout sends SIGTERM: the implementation being measured
    # then gets a row saying so instead of no row.
    signal.signal(signal.SIGTERM, _stop)
    cfg_kw = dict(TINY if args.tiny else FULL)
    for k in FULL:
        v = getattr(args, k)
        if v is not None:
            cfg_kw[k] = v
    cuda = args.device.startswith("cuda")
    machine = bench.machine_name(args.device)
    kind = "gpu" if cuda else "cpu"
    stem = f"{kind}_model_{'tiny_' if args.tiny else ''}{bench.slug(machine)}"
    out = bench.Output(args.out_dir, stem, COLUMNS, append=args.append)
    git = bench.git_state()
    print(f"model step: {machine}; {cfg_kw}; impls {args.impls}", flush=True)
    failed = 0
    for impl in args.impls.split(","):
        ok = run_one(impl, args, cfg_kw, out, machine, git)
        failed += (not ok) and impl in ("attnres", "eager", "standard")
        write_md(out, out.csv_path, machine, args, cfg_kw)
    out.close()
    print(open(out.md_path).read())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
