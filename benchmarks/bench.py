"""Benchmark of the fused depth-attention op on CPU or CUDA.

  python benchmarks/bench.py                          # cuda if visible, else cpu
  python benchmarks/bench.py --device cpu             # the CPU table
  python benchmarks/bench.py --device cuda --budget-s 400
  python benchmarks/bench.py --device cpu --quick     # dry run, a few seconds
  python benchmarks/bench.py --overhead               # per-call host overhead (CPU)
  python benchmarks/bench.py --device cuda --shapes priority --append   # gpu_check.sh's stages

Implementations (same inputs, all requiring grad as in training):
  attnres  attnres.depth_attention on the list of sources;
  eager    attnres.reference.depth_attention on the same list (it stacks);
  compile  torch.compile of that reference. --compile static (the CPU
           default): dynamic=False on the list of sources, compiled afresh
           for every shape (the stacking is inside the compiled graph, so it
           is timed). --compile dynamic (the CUDA default): one
           dynamic=True compilation per dtype that serves every shape, on a
           pre-stacked [N, tokens, D] tensor (stacking *not* timed, which
           favours compile).
  fla      FLA's fla.ops.attnres.fused_attnres (Triton), on the list of sources;
  liger    Liger-Kernel's liger_attn_res (Triton), on torch.stack(sources)
           (the stacking and its backward timed as part of its call);
  fla_gluon (not by default) FLA's opt-in Gluon backend.
           The peers (benchmarks/peers.py says how each is called) run on
           CUDA only; where a peer is not installed, not runnable on the
           device, or refuses a shape, its rows say so in the "note" column.
           Their first call per shape compiles (and FLA autotunes); that is
           in the warm-up, not in the times.

Passes (CPU: fwd, bwd, fwd+bwd; CUDA: fwd, bwd; see --passes):
  fwd      the forward call alone (recording the autograd graph);
  bwd      the backward alone: each repeat records a forward (not timed),
           then torch.autograd.grad through it is timed;
  fwd+bwd  forward and autograd.grad together.

Bytes the op must move (docs/design.md §5), e = element size:
  fwd: (N + 1) * tokens * D * e   (read N sources, write h)
  bwd: (2N + 1) * tokens * D * e  (read N sources and dh, write N grads)
  fwd+bwd: the sum.
GB/s is that count over the median time; "% copy" is it over the copy
bandwidth (bytes read + written per second of a large tensor copy) measured
on the same device in the same run. CPU, attnres rows: "% next copy" is the
time of a copy of the same bytes timed right after the row over the row's
time (a shared machine's bandwidth drifts during a run).

Shapes (CUDA): --shapes priority: bf16 T=65536, N in {9, 17, 33} x D in
{4096, 1024, 7168} (the headline bf16 N=9 D=4096 first); --shapes rest: the
rest of the grid {bf16, fp32} x T {65536, 8192} x N {9, 17, 33, 65, 2} x D
{4096, 1024, 7168, 2048}, T=65536 before 8192 and bf16 before fp32 at each
T; the default is both, priority first (cuda_shapes()).

Correctness: "rel_err" is ||h - h_attnres|| / ||h_attnres|| of the
forward output of each other implementation on the same inputs, once per
shape (a wrong adapter or kernel shows there, it does not stop the run).

Timing. CPU: fwd and fwd+bwd with torch.utils.benchmark's
Timer.adaptive_autorange (warm-up, block size, at least 4 blocks, median);
bwd, which needs an untimed forward before every timed call, with a plain
loop of --repeats calls (median). CUDA: CUDA events around every call, after
a busy-wait kernel that lets the host queue the calls ahead of the GPU, so
the times are device times without host overhead (small shapes on a large
GPU last microseconds, comparable to the per-call host cost); median of
--repeats calls. Before every timed call (after the untimed forward of the
bwd pass) a buffer of 4x the L2 size is zeroed, so no timed call finds its
inputs in L2 (flush not timed: the start event is recorded after it;
--no-flush to turn off). Inputs are rotated among up to 4 sets, as many as it takes
for them to exceed 4x the largest CPU cache or the GPU's L2 together (memory
permitting; a single set when one is that large).

Peak memory ("peak MiB"): the most memory held at once, during one call of
the pass, by tensors allocated in that call (beyond what was allocated
before it). CUDA: torch.cuda.max_memory_allocated() minus
torch.cuda.memory_allocated() before the call. CPU: from the allocation and
free events of torch.profiler (profile_memory=True): the running total of
the bytes allocated minus freed during the call, maximum over the call
(tensors from the PyTorch CPU allocator; memory allocated outside it is not
seen).

Output: benchmarks/results/cpu_<cpu model>_<threads>_threads.{csv,md} or
gpu_<device>.{csv,md} (--out-dir to change; --quick defaults to a temporary
folder and prefixes the names with "quick"), and copies under $OUT when set.
Every CSV row is written and flushed as soon as it is measured, and the .md
is rewritten after every row, so a run stopped by a timeout keeps what it
measured. --append adds the rows to an existing CSV of the same columns (the
.md then covers all its rows): gpu_check.sh's stages share one CSV.

--overhead: per-call host time of attnres.depth_attention (eager, forward
only) at N in {3, 33, 121}, tokens=1, D=1024, fp32, on CPU, with inputs not
requiring grad and requiring grad; the raw op torch.ops.attnres.
depth_attention_fwd (no Python wrapper) is timed next to it. Median over the
blocks of Timer.blocked_autorange, pooled over --rounds interleaved rounds.
Writes benchmarks/results/overhead_<machine>.{csv,md}.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import traceback
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # quiet the profiler on machines without a GPU

import torch  # noqa: E402
import torch.utils.benchmark as tbench  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))  # an in-place build works without installing
sys.path.insert(0, HERE)

import attnres  # noqa: E402
from attnres import reference  # noqa: E402

import peers  # noqa: E402  (benchmarks/peers.py)

RESULTS = os.path.join(HERE, "results")

COLUMNS = ["machine", "device", "dtype", "N", "tokens", "D", "pass", "impl", "ms", "gbps",
           "pct_copy_bw", "pct_copy_next", "peak_mib", "samples", "calls_per_sample", "rel_err", "note"]
OVERHEAD_COLUMNS = ["machine", "dtype", "N", "tokens", "D", "requires_grad", "impl", "us_per_call",
                    "iqr_us", "min_us", "cpu_us_per_call", "cpu_iqr_us", "blocks", "calls_per_block", "git_head"]
IMPLS = ("attnres", "eager", "compile", "fla", "liger")
# Not run by default: attnres's kernels under a Python autograd.Function, the
# path the package used before autograd moved to C++ (--impls attnres,attnres_pyautograd
# compares the two autograd paths in one run); FLA's opt-in Gluon kernels;
# attnres_ring1: attnres with the CUDA kernels' cp.async rings on (off by
# default), run in a process of its own with ATTNRES_CUDA_RING=1 (the switch
# is read once per process; benchmarks/gpu_check.sh's A/B rows).
EXTRA_IMPLS = ("attnres_pyautograd", "fla_gluon", "attnres_ring1")
PEER_IMPLS = tuple(peers.PEERS)

# (dtype, N, tokens, D). CPU: the first row is the target configuration.
CPU_SHAPES = [
    ("float32", 16, 4096, 1024),
    ("bfloat16", 16, 4096, 1024),
    ("float32", 4, 4096, 4096),
    ("float32", 33, 2048, 1024),
    ("float32", 2, 8192, 7186),
]
CPU_QUICK = [("float32", 4, 256, 1000), ("bfloat16", 3, 128, 64)]

# CUDA, in the order measured (benchmarks/NOTES.md §7). Priority: bf16
# T=65536, N {9, 17, 33} x D {4096, 1024, 7168}, the headline N=9 D=4096
# first. Then the rest of the grid {bf16, fp32} x T {65536, 8192} x
# N {9, 17, 33, 65, 2} x D {4096, 1024, 7168, 2048}: large T first, bf16
# before fp32 at each T (a call that runs out of time has the large shapes).
CUDA_PRIORITY = [("bfloat16", n, 65536, d) for n in (9, 17, 33) for d in (4096, 1024, 7168)]


def cuda_shapes(which: str = "all"):
    """'priority', 'rest' or 'all' (priority first, then the rest)."""
    rest = [
        (dt, n, t, d)
        for t in (65536, 8192)
        for dt in ("bfloat16", "float32")
        for n in (9, 17, 33, 65, 2)
        for d in (4096, 1024, 7168, 2048)
        if (dt, n, t, d) not in CUDA_PRIORITY
    ]
    return {"priority": list(CUDA_PRIORITY), "rest": rest, "all": list(CUDA_PRIORITY) + rest}[which]


CUDA_SHAPES = cuda_shapes("all")
CUDA_QUICK = [(dt, n, 64, d) for dt in ("bfloat16", "float32") for n in (2, 3) for d in (64, 96)]

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32", "fp64": "float64", "double": "float64"}

OVERHEAD_NS = (3, 33, 121)
OVERHEAD_TOKENS, OVERHEAD_D = 1, 1024


# --------------------------------------------------------------------------- naming


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", re.sub(r"\((R|TM)\)", "", text)).strip("_")


def cpu_name() -> str:
    """CPU model and the number of torch threads, e.g.
    'Intel(R) Xeon(R) Processor (2 threads)'."""
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            if m:
                model = m.group(1)
    except OSError:
        pass
    return f"{model.strip()} ({torch.get_num_threads()} threads)"


def machine_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def file_stem(device: str, machine: str, quick: bool) -> str:
    kind = "gpu" if device.startswith("cuda") else "cpu"
    return f"{kind}_{'quick_' if quick else ''}{slug(machine)}"


def git_state() -> str:
    """HEAD and whether the code that is measured differs from it."""
    def git(*args):
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True,
                              timeout=20).stdout
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        changed = git("status", "--porcelain", "--", "python", "csrc", "setup.py", "CMakeLists.txt")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    if not head:
        return "unknown (not a git checkout)"
    if not changed:
        return f"{head} (python/, csrc/, setup.py, CMakeLists.txt as committed)"
    paths = [line[3:] for line in changed.splitlines() if line.strip()]
    shown = ", ".join(paths[:8]) + (f", ... ({len(paths)} paths)" if len(paths) > 8 else "")
    return f"{head} + uncommitted changes in {shown}"


def extension_file() -> str:
    """The compiled libraries next to the attnres package and when they were built."""
    import glob

    pkg = os.path.dirname(attnres.__file__)
    libs = sorted(glob.glob(os.path.join(pkg, "*.so")) + glob.glob(os.path.join(pkg, "*.pyd")))
    if not libs:
        return "unknown"
    names = ", ".join(os.path.relpath(p, ROOT) if p.startswith(ROOT + os.sep) else p for p in libs)
    newest = max(os.path.getmtime(p) for p in libs)
    return f"{names} (built {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(newest))})"


# --------------------------------------------------------------------------- output


class Output:
    """A CSV written row by row (flushed at once) and a markdown file
    rewritten on demand, in the output folder and, when $OUT is set, also
    there."""

    def __init__(self, out_dir: str, stem: str, columns, append: bool = False):
        self.dirs = [out_dir]
        out_env = os.environ.get("OUT")
        if out_env and os.path.abspath(out_env) != os.path.abspath(out_dir):
            self.dirs.append(out_env)
        self.columns = columns
        self.stem = stem
        self.files, self.writers = [], []
        # With append, the rows already in the first folder's CSV (same
        # columns) are kept, and returned by previous_rows for the .md.
        self.previous_rows = []
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, stem + ".csv")
            keep = append and self._same_columns(path, columns)
            if keep and d == self.dirs[0]:
                with open(path, newline="") as f:
                    self.previous_rows = list(csv.DictReader(f))
            f = open(path, "a" if keep else "w", newline="")
            w = csv.DictWriter(f, fieldnames=columns)
            if not keep:
                w.writeheader()
            f.flush()
            self.files.append(f)
            self.writers.append(w)

    @staticmethod
    def _same_columns(path: str, columns) -> bool:
        try:
            with open(path, newline="") as f:
                header = next(csv.reader(f), None)
        except OSError:
            return False
        return header == list(columns)

    @property
    def csv_path(self):
        return os.path.join(self.dirs[0], self.stem + ".csv")

    @property
    def md_path(self):
        return os.path.join(self.dirs[0], self.stem + ".md")

    def add(self, row: dict):
        row = {c: row.get(c, "") for c in self.columns}
        for f, w in zip(self.files, self.writers):
            w.writerow(row)
            f.flush()

    def write_md(self, text: str):
        for d in self.dirs:
            with open(os.path.join(d, self.stem + ".md"), "w") as f:
                f.write(text)

    def close(self):
        for f in self.files:
            f.close()


# --------------------------------------------------------------------------- timing


class DeviceTimer:
    SLEEP_CYCLES = 200_000_000  # about 0.1 s of busy-wait on the GPU

    def __init__(self, device: str, repeats: int, min_run_s: float, max_run_s: float,
                 flush_bytes: int = 0):
        self.cuda = device.startswith("cuda")
        self.repeats = repeats
        self.min_run_s = min_run_s
        self.max_run_s = max_run_s
        # CUDA: zeroed before every timed call (evicts the inputs from L2).
        self.flush_buf = (torch.empty(flush_bytes, dtype=torch.uint8, device=device)
                          if self.cuda and flush_bytes > 0 else None)

    def flush_l2(self):
        if self.flush_buf is not None:
            self.flush_buf.zero_()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, call, prepare=None):
        """Median seconds of call() (or call(prepare()), prepare untimed);
        returns (median_s, samples, calls_per_sample)."""
        if not self.cuda and prepare is None:
            timer = tbench.Timer(stmt="call()", globals={"call": call},
                                 num_threads=torch.get_num_threads())
            m = timer.adaptive_autorange(threshold=0.1, min_run_time=self.min_run_s,
                                         max_run_time=self.max_run_s)
            return m.median, len(m.raw_times), m.number_per_run
        if not self.cuda:
            times = []
            for _ in range(self.repeats):
                arg = prepare()
                t0 = time.perf_counter()
                call(arg)
                times.append(time.perf_counter() - t0)
                del arg
            return statistics.median(times), len(times), 1
        # CUDA: events around every call; the busy-wait kernel first lets the
        # host queue every call before the GPU reaches them. The L2 flush
        # runs after the untimed prepare() and before the start event.
        torch.cuda._sleep(self.SLEEP_CYCLES)
        events = []
        for _ in range(self.repeats):
            arg = prepare() if prepare is not None else None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.flush_l2()
            start.record()
            if prepare is not None:
                call(arg)
            else:
                call()
            end.record()
            events.append((start, end))
            del arg
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e-3, len(events), 1


def peak_bytes(device: str, call, arg=None, has_arg=False) -> int:
    """Most bytes held at once by tensors allocated during one call."""
    run = (lambda: call(arg)) if has_arg else call
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return max(peak, 0)
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = run()
        events = prof.profiler.kineto_results.events()
    del out
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, n in mem:
        live += n
        peak = max(peak, live)
    return peak


def copy_next_pct(timer: "DeviceTimer", n_bytes: int, seconds: float) -> str:
    """CPU: a tensor copy moving n_bytes (half read, half written), timed right
    after the row it is compared with; its time over that row's, in percent.
    On a shared machine the bandwidth drifts during a run, and the copy
    measured at the start can be far from the one a row met."""
    src = torch.empty(n_bytes // 2, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s, _, _ = timer.measure(lambda: dst.copy_(src))
    del src, dst
    return f"{100 * copy_s / seconds:.3g}"


def copy_bandwidth_gbps(device: str, timer: DeviceTimer, n_bytes: int) -> float:
    """Bytes read + written per second of a large tensor copy."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    timer.sync()
    if timer.cuda:
        old = timer.repeats
        timer.repeats = max(old, 20)
        seconds, _, _ = timer.measure(lambda: dst.copy_(src))
        timer.repeats = old
    else:
        t = tbench.Timer(stmt="dst.copy_(src)", globals={"dst": dst, "src": src},
                         num_threads=torch.get_num_threads())
        seconds = t.blocked_autorange(min_run_time=max(0.2, timer.min_run_s)).median
    del src, dst
    return 2 * n_bytes / seconds / 1e9


# --------------------------------------------------------------------------- inputs


def parse_shapes(text: str):
    shapes = []
    for item in text.split(","):
        dt, n, t, d = item.strip().split(":")
        dt = DTYPE_ALIASES.get(dt, dt)
        getattr(torch, dt)
        shapes.append((dt, int(n), int(t), int(d)))
    return shapes


def cache_bytes(device: str) -> int:
    """L2 (CUDA) or the largest CPU cache level; 32 MiB if unknown."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).L2_cache_size
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
            except OSError:
                continue
            m = re.match(r"(\d+)([KMG]?)", text)
            if m:
                best = max(best, int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])
    except OSError:
        pass
    return best or (32 << 20)


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"MemAvailable:\s*(\d+) kB", f.read())
            if m:
                return int(m.group(1)) << 10
    except OSError:
        pass
    return 8 << 30


def param_dtype(dtype):
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class _PythonAutogradDepthAttention(torch.autograd.Function):
    """attnres's forward and backward ops (below the Autograd key) with a
    Python autograd.Function around them, every gradient computed: what
    torch.library.register_autograd did before csrc/autograd.cpp."""

    @staticmethod
    def forward(ctx, query, gain, *sources):
        with torch._C._AutoDispatchBelowAutograd():
            h, rstd, weights, _, _, _ = torch.ops.attnres.depth_attention_fwd(list(sources), query, gain, 1e-6, 1.0)
        ctx.save_for_backward(*sources, query, gain, h, rstd, weights)
        return h

    @staticmethod
    def backward(ctx, grad_out):
        *sources, query, gain, h, rstd, weights = ctx.saved_tensors
        with torch._C._AutoDispatchBelowAutograd():
            grads, grad_query, grad_gain, _ = torch.ops.attnres.depth_attention_bwd(
                grad_out, None, sources, query, gain, h, rstd, weights, 1.0,
                [True] * (len(sources) + 2))
        return (grad_query, grad_gain, *grads)


def attnres_pyautograd(sources, query, gain):
    return _PythonAutogradDepthAttention.apply(query, gain, *sources)


def make_sets(n_sets, N, T, D, dtype, device):
    sets = []
    pd = param_dtype(dtype)
    for _ in range(n_sets):
        sources = [torch.randn(T, D, device=device, dtype=dtype) for _ in range(N)]
        query = (torch.randn(D, device=device, dtype=torch.float32) / math.sqrt(D)).to(pd)
        gain = (1 + 0.1 * torch.randn(D, device=device, dtype=torch.float32)).to(pd)
        grad = torch.randn(T, D, device=device, dtype=dtype)
        sets.append((sources, query, gain, grad))
    return sets


class Case:
    """One implementation on the rotated input sets (leaves that require grad)."""

    def __init__(self, fn, sets, stacked: bool):
        self.fn = fn
        self.items = []
        for srcs, q, g, dh in sets:
            qq, gg = q.detach().requires_grad_(True), g.detach().requires_grad_(True)
            if stacked:
                first = torch.stack(srcs).requires_grad_(True)
                leaves = [first, qq, gg]
            else:
                first = [s.detach().requires_grad_(True) for s in srcs]
                leaves = [*first, qq, gg]
            self.items.append((first, qq, gg, leaves, dh))
        self.k = 0

    def _next(self):
        self.k = (self.k + 1) % len(self.items)
        return self.items[self.k]

    def forward(self):
        first, q, g, _, _ = self._next()
        return self.fn(first, q, g)

    def record(self):
        first, q, g, leaves, dh = self._next()
        return self.fn(first, q, g), leaves, dh

    @staticmethod
    def backward(recorded):
        out, leaves, dh = recorded
        return torch.autograd.grad(out, leaves, dh)

    def forward_backward(self):
        return self.backward(self.record())


def floor_bytes(pass_name: str, N: int, T: int, D: int, elem: int, reads_h: bool = False) -> int:
    """Bytes the op's design moves (docs/design.md §5): forward N sources read + h written;
    backward N sources and dh read + N gradients written, plus the h row read where the
    backward is single-pass (reads_h: float32/float64, CPU and CUDA). The two-pass form
    (bf16/fp16) re-reads the sources from cache, so it moves the (2N+1) floor."""
    fwd = (N + 1) * T * D * elem
    bwd = (2 * N + 1 + int(reads_h)) * T * D * elem
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_name]


# --------------------------------------------------------------------------- markdown


def fmt_ms(ms: float) -> str:
    if ms >= 100:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.4f}"


def results_md(ctx: dict, rows, skipped, elapsed_s: float, done: bool) -> str:
    """rows: measured rows and note rows (empty ms, a note), in CSV form."""
    measured = [r for r in rows if r.get("ms")]
    present = [i for i in IMPLS + EXTRA_IMPLS if any(r["impl"] == i for r in rows)]
    others = [i for i in present if i != "attnres"]
    lines = [
        f"# attnres benchmark: {ctx['machine']}",
        "",
        f"- machine: {ctx['machine']}" + (f" (host CPU: {ctx['host']})" if ctx["host"] else ""),
        f"- torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if ctx["cuda"] else "")
        + f", Python {platform.python_version()}",
        f"- copy bandwidth (tensor copy of {ctx['copy_mib']:.0f} MiB, bytes read + written per second, "
        f"this run): **{ctx['copy_gbps']:.1f} GB/s**",
        f"- code: git {ctx['git']}; extension {ctx['ext']}",
        f"- command: `{ctx['command']}`; {'finished' if done else 'still running or stopped'} after "
        f"{elapsed_s:.0f} s",
        f"- timing: {ctx['timing']}; inputs rotated among up to 4 sets that together exceed 4x the "
        f"{'L2' if ctx['cuda'] else 'largest CPU'} cache ({ctx['cache_mib']:.0f} MiB) where memory allows",
        f"- compile: {ctx['compile']}",
    ]
    lines += [f"- {name}: {text}" for name, text in ctx.get("peers", {}).items()]
    lines += [
        "",
        "GB/s counts the bytes the op must move (docs/design.md §5; fwd: (N+1)·tokens·D elements, "
        "bwd: (2N+1)·tokens·D, (2N+2) where the CPU backward is single-pass and reads h (float32/float64), "
        "fwd+bwd: the sum); % is of the copy bandwidth above"
        + ("; \"% next copy\": a copy of the same bytes timed right after the row, its time over "
           "the row's (the machine's bandwidth drifts during a run on a shared machine). "
           if not ctx["cuda"] else ". ")
        + "fwd: forward alone, recording the graph; bwd: autograd.grad of a recorded forward (the forward "
        "not timed); fwd+bwd: both; inputs require grad in all passes. \"vs X\": X's time / attnres "
        "time (> 1: attnres faster). MiB: peak memory of one call, "
        + ("torch.cuda.max_memory_allocated() minus the bytes allocated before the call."
           if ctx["cuda"] else
           "the most bytes held at once by tensors allocated during the call (torch.profiler "
           "memory events, PyTorch CPU allocator only).")
        + " err: ||h - h_attnres|| / ||h_attnres|| of the forward output.",
        "",
        "| dtype | N | tokens | D | pass | attnres ms | GB/s | % copy | "
        + ("" if ctx["cuda"] else "% next copy | ")
        + "".join(f"{i} ms | " for i in others)
        + "".join(f"vs {i} | " for i in others)
        + "".join(f"{i} MiB | " for i in present)
        + "".join(f"{i} err | " for i in others),
        "|" + "---|" * (8 + (not ctx["cuda"]) + 2 * len(others) + len(present) + len(others)),
    ]
    by_key = {}
    for r in measured:
        by_key.setdefault((r["dtype"], str(r["N"]), str(r["tokens"]), str(r["D"]), r["pass"]), {})[r["impl"]] = r
    for (dt, n, t, d, p), impls in by_key.items():
        ours = impls.get("attnres")

        def ms(r):
            return fmt_ms(float(r["ms"])) if r else "–"

        def mib(r):
            return f"{float(r['peak_mib']):.1f}" if r and r.get("peak_mib") not in (None, "") else "–"

        def ratio(other):
            if ours is None or other is None:
                return "–"
            return f"{float(other['ms']) / float(ours['ms']):.2f}x"

        def err(r):
            return f"{float(r['rel_err']):.1e}" if r and r.get("rel_err") not in (None, "") else "–"

        cells = [dt, n, t, d, p, ms(ours), ours["gbps"] if ours else "–",
                 ours["pct_copy_bw"] + "%" if ours else "–"]
        if not ctx["cuda"]:
            cells.append(ours["pct_copy_next"] + "%" if ours and ours.get("pct_copy_next") else "–")
        cells += [ms(impls.get(i)) for i in others]
        cells += [ratio(impls.get(i)) for i in others]
        cells += [mib(impls.get(i)) for i in present]
        cells += [err(impls.get(i)) for i in others]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    notes = [(f"{r['dtype']} N={r['N']} tokens={r['tokens']} D={r['D']} {r['pass']} {r['impl']}", r["note"])
             for r in rows if r.get("note") and not r.get("ms")]
    if notes or skipped:
        lines += ["", "Not measured (also rows in the CSV with a note):", ""]
        lines += [f"- {tag}: {why}" for tag, why in notes + list(skipped)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main benchmark


def impl_function(impl: str, compile_mode: str, backend: str, compiled_dynamic):
    """(fn(sources, query, gain), stacked) for a non-peer implementation."""
    if impl in ("attnres", "attnres_ring1"):
        return attnres.depth_attention, False
    if impl == "attnres_pyautograd":
        return attnres_pyautograd, False
    if impl == "eager":
        return reference.depth_attention, False
    if compile_mode == "static":
        return torch.compile(reference.depth_attention, dynamic=False, backend=backend), False
    return compiled_dynamic, True


def relative_error(h: torch.Tensor, ref: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm((h.float() - ref.float()))
    return (diff / torch.linalg.vector_norm(ref.float()).clamp_min(1e-30)).item()


def run_benchmark(args) -> int:
    device = args.device
    cuda = device.startswith("cuda")
    if cuda and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
    torch.manual_seed(0)
    if args.shapes in ("priority", "rest", "all"):
        shapes = cuda_shapes(args.shapes) if cuda else (CPU_QUICK if args.quick else CPU_SHAPES)
    elif args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        shapes = ((CUDA_QUICK if args.quick else CUDA_SHAPES) if cuda
                  else (CPU_QUICK if args.quick else CPU_SHAPES))
    passes = args.passes.split(",") if args.passes else (["fwd", "bwd"] if cuda else ["fwd", "bwd", "fwd+bwd"])
    impls = args.impls.split(",")
    for p in passes:
        if p not in ("fwd", "bwd", "fwd+bwd"):
            sys.exit(f"bench.py: unknown pass {p!r} (fwd, bwd, fwd+bwd)")
    for i in impls:
        if i not in IMPLS + EXTRA_IMPLS:
            sys.exit(f"bench.py: unknown implementation {i!r} ({', '.join(IMPLS + EXTRA_IMPLS)})")
    # The ring switch is read once per process: its rows must say which it was.
    rings_on = os.environ.get("ATTNRES_CUDA_RING") == "1"
    if "attnres_ring1" in impls and not rings_on:
        sys.exit("bench.py: attnres_ring1 needs ATTNRES_CUDA_RING=1 in the environment")
    if "attnres" in impls and rings_on:
        sys.exit("bench.py: ATTNRES_CUDA_RING=1 is set: measure attnres_ring1, not attnres")
    budget = args.budget_s if args.budget_s is not None else (240.0 if cuda else 0.0)
    repeats = args.repeats or (2 if args.quick else (10 if cuda else 7))
    min_run = 0.01 if args.quick else args.min_run_s
    max_run = 0.2 if args.quick else args.max_run_s
    compile_mode = args.compile or ("dynamic" if cuda else "static")
    backend = args.compile_backend or ("eager" if args.quick and not cuda else "inductor")

    t_start = time.monotonic()
    machine = machine_name(device)
    cache = cache_bytes(device)
    flush = 0 if (args.no_flush or not cuda) else max(4 * cache, 64 << 20)
    timer = DeviceTimer(device, repeats, min_run, max_run, flush_bytes=flush)
    if cuda:
        copy_n = (64 << 20) if args.quick else (2 << 30)
    else:
        biggest = max(n * t * d * 4 for _, n, t, d in shapes)
        copy_n = min(max(biggest, 64 << 20), 1 << 30)
    copy_gbps = copy_bandwidth_gbps(device, timer, copy_n)
    print(f"machine: {machine}; torch {torch.__version__}; copy bandwidth {copy_gbps:.1f} GB/s "
          f"(read + write, {copy_n / 2**20:.0f} MiB)", flush=True)

    # The peers: why each cannot run here (None: it can), said once.
    peer_status = {i: peers.unavailable(i, device) for i in impls if i in PEER_IMPLS}
    for i, why in peer_status.items():
        print(f"{i}: {why or 'runnable'}; {peers.PEERS[i].describe()}", flush=True)

    out = Output(args.out_dir, file_stem(device, machine, args.quick), COLUMNS, append=args.append)
    ctx = dict(
        machine=machine, host=cpu_name() if cuda else "", cuda=cuda, copy_gbps=copy_gbps,
        copy_mib=copy_n / 2**20, cache_mib=cache / 2**20, git=git_state(), ext=extension_file(),
        command="python benchmarks/bench.py " + " ".join(args.argv),
        timing=("CUDA events per call after a busy-wait kernel, median of "
                f"{repeats} calls after warm-up, "
                + (f"L2 flushed before every timed call (a {flush / 2**20:.0f} MiB buffer zeroed, not timed)"
                   if flush else "L2 not flushed") if cuda else
                "fwd and fwd+bwd: torch.utils.benchmark Timer.adaptive_autorange (threshold 0.1, "
                f"min {min_run:g} s, max {max_run:g} s, at least 4 blocks), median per call; bwd: median of "
                f"{repeats} calls, each after an untimed forward"),
        compile=(f"torch.compile(reference, dynamic=False, backend={backend!r}) on the list of sources, "
                 "compiled for every shape (stacking timed)" if compile_mode == "static" else
                 f"torch.compile(reference, dynamic=True, backend={backend!r}) on a pre-stacked "
                 "[N, tokens, D] tensor, one compilation per dtype (stacking not timed)"),
        peers={i: f"{why or 'run'}; {peers.PEERS[i].describe()}" for i, why in peer_status.items()},
    )
    rows = list(out.previous_rows)
    out.write_md(results_md(ctx, rows, [], time.monotonic() - t_start, done=False))
    compiled_dynamic = (torch.compile(reference.depth_attention, dynamic=True, backend=backend)
                        if "compile" in impls and compile_mode == "dynamic" else None)

    def base_row(dtype_name, N, T, D, pass_name, impl):
        return {"machine": machine, "device": "cuda" if cuda else "cpu", "dtype": dtype_name,
                "N": N, "tokens": T, "D": D, "pass": pass_name, "impl": impl}

    def note_rows(dtype_name, N, T, D, impl, why, pass_names=None):
        for pass_name in pass_names or passes:
            row = {**base_row(dtype_name, N, T, D, pass_name, impl), "note": why}
            out.add(row)
            rows.append(row)
        print(f"not measured: {dtype_name} N={N} tokens={T} D={D} {impl}: {why}", flush=True)

    skipped, failures = [], 0
    for dtype_name, N, T, D in shapes:
        dtype = getattr(torch, dtype_name)
        tag = f"{dtype_name} N={N} tokens={T} D={D}"
        if budget and time.monotonic() - t_start > budget:
            skipped.append((tag, f"time budget of {budget:.0f} s spent"))
            continue
        elem = torch.tensor([], dtype=dtype).element_size()
        set_bytes = (N + 1) * T * D * elem
        need_one = 2 * set_bytes  # one set, and h + N grads while timing
        free = free_bytes(device)
        if need_one > 0.8 * free:
            skipped.append((tag, f"needs {need_one / 2**30:.1f} GiB for one input set, "
                                 f"{free / 2**30:.1f} GiB free"))
            print(f"skip {tag}: {skipped[-1][1]}", flush=True)
            continue
        n_sets = max(1, min(4, math.ceil(4 * cache / set_bytes)))
        while n_sets > 1 and n_sets * set_bytes + need_one > 0.6 * free:
            n_sets -= 1
        print(f"{tag} ({n_sets} input sets) ...", file=sys.stderr, flush=True)
        sets = make_sets(n_sets, N, T, D, dtype, device)
        if "compile" in impls and compile_mode == "static":
            torch._dynamo.reset()
        h_ours = None  # attnres's output on the first set, for rel_err
        for impl in impls:
            if budget and time.monotonic() - t_start > budget:
                note_rows(dtype_name, N, T, D, impl, f"time budget of {budget:.0f} s spent")
                continue
            if impl in PEER_IMPLS:
                if peer_status[impl]:
                    note_rows(dtype_name, N, T, D, impl, peer_status[impl])
                    continue
                try:
                    fn, stacked = peers.load(impl), False
                except Exception as exc:
                    peer_status[impl] = f"import failed ({type(exc).__name__}: {exc})"[:300]
                    note_rows(dtype_name, N, T, D, impl, peer_status[impl])
                    continue
            else:
                fn, stacked = impl_function(impl, compile_mode, backend, compiled_dynamic)
            try:
                case = Case(fn, sets, stacked)
            except torch.OutOfMemoryError:
                note_rows(dtype_name, N, T, D, impl, "out of memory preparing the inputs")
                continue
            rel_err = ""
            if impl != "attnres":
                try:
                    if h_ours is None:
                        srcs, q, g, _ = sets[0]
                        h_ours = attnres.depth_attention(srcs, q, g).detach()
                    # On the first set's leaves, as timed (inputs requiring
                    # grad: compile compiles the training graph only once).
                    first, q, g, _, _ = case.items[0]
                    h = fn(first, q, g).detach()
                    rel_err = f"{relative_error(h, h_ours):.3g}"
                    del h
                except peers.PeerUnsupported as exc:
                    note_rows(dtype_name, N, T, D, impl, f"not supported: {exc}"[:300])
                    continue
                except torch.OutOfMemoryError:
                    note_rows(dtype_name, N, T, D, impl, "out of memory")
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
                except Exception as exc:
                    failures += impl not in PEER_IMPLS  # a peer's failure is reported, not ours
                    msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    note_rows(dtype_name, N, T, D, impl, f"failed ({msg})")
                    traceback.print_exc()
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
            for pass_name in passes:
                call, prepare = {
                    "fwd": (case.forward, None),
                    "bwd": (Case.backward, case.record),
                    "fwd+bwd": (case.forward_backward, None),
                }[pass_name]
                try:
                    for _ in range(2 if impl == "compile" else 1):  # warm-up (and compilation)
                        call(prepare()) if prepare else call()
                    timer.sync()
                    if prepare:
                        peak = peak_bytes(device, call, prepare(), has_arg=True)
                    else:
                        peak = peak_bytes(device, call)
                    seconds, samples, per = timer.measure(call, prepare)
                except torch.OutOfMemoryError:
                    note_rows(dtype_name, N, T, D, impl, "out of memory", [pass_name])
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
                except peers.PeerUnsupported as exc:
                    note_rows(dtype_name, N, T, D, impl, f"not supported: {exc}"[:300], [pass_name])
                    continue
                except Exception as exc:  # keep measuring the rest; reported and counted
                    failures += impl not in PEER_IMPLS
                    msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    note_rows(dtype_name, N, T, D, impl, f"failed ({msg})", [pass_name])
                    print(f"FAILED {tag} {pass_name} {impl}:", file=sys.stderr)
                    traceback.print_exc()
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
                ms = seconds * 1e3
                reads_h = dtype in (torch.float32, torch.float64)
                n_floor = floor_bytes(pass_name, N, T, D, elem, reads_h)
                gbps = n_floor / seconds / 1e9
                pct_next = copy_next_pct(timer, n_floor, seconds) if impl == "attnres" and not cuda else ""
                row = {**base_row(dtype_name, N, T, D, pass_name, impl),
                       "ms": f"{ms:.6g}", "gbps": f"{gbps:.4g}", "pct_copy_bw": f"{100 * gbps / copy_gbps:.3g}",
                       "pct_copy_next": pct_next,
                       "peak_mib": f"{peak / 2**20:.2f}", "samples": samples, "calls_per_sample": per,
                       "rel_err": rel_err, "note": ""}
                out.add(row)
                rows.append(row)
                out.write_md(results_md(ctx, rows, skipped, time.monotonic() - t_start, done=False))
                print(f"{tag} {pass_name:7s} {impl:8s} {fmt_ms(ms):>9s} ms {gbps:8.1f} GB/s "
                      f"{100 * gbps / copy_gbps:5.1f}% of copy"
                      + (f" ({pct_next}% of the next copy)" if pct_next else "")
                      + f", peak {peak / 2**20:8.1f} MiB"
                      + (f", rel err {rel_err}" if rel_err else ""), flush=True)
            del case
        del sets, h_ours
        if cuda:
            torch.cuda.empty_cache()
        out.write_md(results_md(ctx, rows, skipped, time.monotonic() - t_start, done=False))

    md = results_md(ctx, rows, skipped, time.monotonic() - t_start, done=True)
    out.write_md(md)
    out.close()
    print(md)
    print(f"wrote {out.csv_path} and {out.md_path}")
    return 1 if failures else 0


# --------------------------------------------------------------------------- overhead


def run_overhead(args) -> int:
    if args.device != "cpu":
        print("--overhead measures on CPU (host overhead); ignoring --device", file=sys.stderr)
    machine = cpu_name()
    min_run = 0.02 if args.quick else args.overhead_min_run_s
    rounds = 1 if args.quick else args.rounds
    git = git_state()
    dtype = torch.float32
    D, T = OVERHEAD_D, OVERHEAD_TOKENS
    gen = torch.Generator().manual_seed(0)

    def raw_op(srcs, q, g):
        return torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 1.0)

    impls = {"attnres": attnres.depth_attention, "op": raw_op}
    clocks = {"wall": timeit.default_timer, "cpu": time.process_time}
    cells = {}
    for n in OVERHEAD_NS:
        for rg in (False, True):
            srcs = [torch.randn(T, D, generator=gen, dtype=dtype).requires_grad_(rg) for _ in range(n)]
            q = (torch.randn(D, generator=gen) / D**0.5).requires_grad_(rg)
            g = (torch.rand(D, generator=gen) + 0.5).requires_grad_(rg)
            for name, fn in impls.items():
                try:
                    fn(srcs, q, g)
                except Exception as exc:
                    print(f"skip {name} N={n}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    continue
                for clock, timer_fn in clocks.items():
                    cells[(n, rg, name, clock)] = dict(
                        timer=tbench.Timer(stmt="fn(srcs, q, g)", globals=dict(fn=fn, srcs=srcs, q=q, g=g),
                                           num_threads=torch.get_num_threads(), timer=timer_fn),
                        times=[], number=None)

    # Interleaved rounds, so that a noisy period spreads over every cell.
    for r in range(rounds):
        for cell in cells.values():
            m = cell["timer"].blocked_autorange(min_run_time=min_run)
            cell["times"] += [t / m.number_per_run for t in m.raw_times]
            cell["number"] = m.number_per_run
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)

    def stats(key):
        cell = cells.get(key)
        if cell is None:
            return None
        ts = sorted(cell["times"])
        quart = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
        return dict(median=statistics.median(ts) * 1e6, iqr=(quart[2] - quart[0]) * 1e6, min=ts[0] * 1e6,
                    blocks=len(ts), number=cell["number"])

    out = Output(args.out_dir, f"overhead_{'quick_' if args.quick else ''}{slug(machine)}", OVERHEAD_COLUMNS)
    results = {}
    for n in OVERHEAD_NS:
        for rg in (False, True):
            for name in impls:
                wall, cpu = stats((n, rg, name, "wall")), stats((n, rg, name, "cpu"))
                if wall is None:
                    continue
                results[(n, rg, name)] = (wall, cpu)
                out.add({"machine": machine, "dtype": "float32", "N": n, "tokens": T, "D": D,
                         "requires_grad": rg, "impl": name, "us_per_call": f"{wall['median']:.2f}",
                         "iqr_us": f"{wall['iqr']:.2f}", "min_us": f"{wall['min']:.2f}",
                         "cpu_us_per_call": f"{cpu['median']:.2f}", "cpu_iqr_us": f"{cpu['iqr']:.2f}",
                         "blocks": wall["blocks"], "calls_per_block": wall["number"], "git_head": git.split()[0]})

    lines = [
        f"# attnres per-call host overhead: {machine}",
        "",
        f"- machine: {machine}; torch {torch.__version__}, Python {platform.python_version()}",
        f"- code: git {git}; extension {extension_file()}",
        f"- command: `python benchmarks/bench.py {' '.join(args.argv)}`",
        f"- what: one eager forward call, tokens={T}, D={D}, float32, CPU, grad mode on; "
        "requires_grad False: no input requires grad (no graph); True: sources, query and gain "
        "require grad (the autograd node is recorded). attnres = attnres.depth_attention "
        "(the Python wrapper and the op); op = torch.ops.attnres.depth_attention_fwd called directly "
        "(no Python wrapper); wrapper = attnres - op.",
        f"- timing: torch.utils.benchmark Timer.blocked_autorange (min_run_time {min_run:g} s, "
        f"{torch.get_num_threads()} threads) per cell and clock, {rounds} interleaved round(s); "
        "µs per call = median over all blocks (each block is the mean of calls_per_block calls), "
        "IQR over the blocks. wall: wall-clock time (what a caller waits); CPU: process CPU time "
        "(time.process_time), which time spent descheduled by other load on the machine does not "
        "inflate: compare CPU columns across runs on a busy machine.",
        "",
        "| N | requires_grad | attnres µs wall (IQR) | attnres µs CPU | op µs wall (IQR) | op µs CPU "
        "| wrapper µs wall | wrapper µs CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in OVERHEAD_NS:
        for rg in (False, True):
            a, o = results.get((n, rg, "attnres")), results.get((n, rg, "op"))

            def wall(x):
                return f"{x[0]['median']:.2f} ({x[0]['iqr']:.2f})" if x else "–"

            def cpu(x):
                return f"{x[1]['median']:.2f}" if x else "–"

            wrap_wall = f"{a[0]['median'] - o[0]['median']:.2f}" if a and o else "–"
            wrap_cpu = f"{a[1]['median'] - o[1]['median']:.2f}" if a and o else "–"
            lines.append(f"| {n} | {rg} | {wall(a)} | {cpu(a)} | {wall(o)} | {cpu(o)} | {wrap_wall} | {wrap_cpu} |")
    md = "\n".join(lines) + "\n"
    out.write_md(md)
    out.close()
    print(md)
    print(f"wrote {out.csv_path} and {out.md_path}")
    return 0 if len(results) == len(OVERHEAD_NS) * 2 * len(impls) else 1


# --------------------------------------------------------------------------- entry


def parse_args(argv=None):
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=default_device,
                    help=f"cpu or cuda[:k] (default here: {default_device})")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes and short timing, to check the script end to end (seconds on CPU; "
                         "the CPU compile uses backend 'eager' unless --compile-backend is given)")
    ap.add_argument("--overhead", action="store_true",
                    help="per-call host overhead of attnres.depth_attention on CPU instead of the table")
    ap.add_argument("--out-dir", default=None,
                    help="folder for the csv and md files (default: benchmarks/results; "
                         "a temporary folder with --quick)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new shape after this many seconds (default: 240 on CUDA, none on CPU)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="calls per median where the calls are counted: CUDA (default 10) and the CPU bwd "
                         "pass (default 7)")
    ap.add_argument("--min-run-s", type=float, default=1.0,
                    help="CPU fwd and fwd+bwd: Timer.adaptive_autorange min_run_time (default 1)")
    ap.add_argument("--max-run-s", type=float, default=10.0,
                    help="CPU fwd and fwd+bwd: Timer.adaptive_autorange max_run_time (default 10)")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated subset of attnres,eager,compile,fla,liger (default: all of them; "
                         "also attnres_pyautograd: the kernels under a Python autograd.Function, and "
                         "fla_gluon: FLA's opt-in Gluon kernels)")
    ap.add_argument("--passes", default=None,
                    help="comma-separated subset of fwd,bwd,fwd+bwd (default: CPU all three, CUDA fwd,bwd)")
    ap.add_argument("--shapes", default=None,
                    help="override the shape list: dtype:N:tokens:D,... (e.g. bf16:9:65536:4096), or "
                         "priority / rest / all (CUDA: the priority shapes, the rest of the grid, both)")
    ap.add_argument("--append", action="store_true",
                    help="append to the CSV in the output folder if it has the same columns (the .md "
                         "then covers all its rows) instead of starting it afresh")
    ap.add_argument("--no-flush", action="store_true",
                    help="CUDA: do not flush L2 before every timed call")
    ap.add_argument("--compile", choices=("static", "dynamic"), default=None,
                    help="how the reference is compiled (default: static on CPU, dynamic on CUDA)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor)")
    ap.add_argument("--rounds", type=int, default=3, help="--overhead: interleaved rounds (default 3)")
    ap.add_argument("--overhead-min-run-s", type=float, default=0.5,
                    help="--overhead: blocked_autorange min_run_time per cell and round (default 0.5)")
    args = ap.parse_args(argv)
    # The command as recorded in the .md, with paths inside the repository made relative.
    args.argv = [a.replace(ROOT + os.sep, "") for a in (sys.argv[1:] if argv is None else argv)]
    if args.out_dir is None:
        args.out_dir = os.path.join(tempfile.gettempdir(), "attnres-bench-quick") if args.quick else RESULTS
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        ap.error(f"--device must be cpu or cuda[:k], got {args.device!r}")
    if args.device.startswith("cuda") and not args.overhead and not torch.cuda.is_available():
        ap.error("no CUDA device visible; use --device cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.overhead:
        return run_overhead(args)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
