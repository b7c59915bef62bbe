"""Two-phase vs one-call Block reads on CPU or CUDA (issue 9; docs/design.md §10).

  python benchmarks/block_reads.py            # writes benchmarks/results/block_reads_<cpu>.md
  python benchmarks/block_reads.py --quick    # small T and few repeats (a dry run)
  python benchmarks/block_reads.py --tokens 8192 --reads-only
      # part 1 at 8192 tokens (sources beyond a large L3) and phase 1 alone
      # against S one-call reads of the same 9 sources: block_reads_<cpu>_reads_T8192.md
  python benchmarks/block_reads.py --device cuda --tokens 8192 --reads-only --out-dir DIR
      # the same on the current GPU (gpu_check.sh's block_reads stage):
      # block_reads_<gpu>_CUDA_<version>_reads_T8192.md; every timed call is synchronized
  python benchmarks/block_reads.py --gpt-only [--gpt LAYERS,D,B,T,S] [--device cuda]
      # part 2 alone (gpu_check.sh's block_gpt stage on CUDA): block_reads_<machine>_gpt[_sizes].md

Part 1, the reads of a Block model: L reads (one per sublayer) over the
sources a Block stream holds (embedding, completed block sums, partial
sum), fp32, D = 1024, T tokens, under torch.no_grad. The sources are made
once; only the reads are timed: one-call (attnres.depth_attention on each
read's sources) against two-phase (attnres.block_reads once per block for
its readers, then at every later read of the block the merge in place,
attnres.ops.block_read_merge_inplace, as DepthStream does under no_grad;
and, for comparison, attnres.block_read_merge into a new tensor).
Bytes per token are counted from the ops' inputs and outputs (rows of D
values read or written, plus the statistics: float32, lse float64), not measured with
hardware counters: the accounting of docs/design.md §10.

Part 2, the example GPT (python/attnres/models.py) inference forward under
torch.no_grad: standard residual, Full, Block with one-call reads and Block
with block_reads="auto" and "two_phase" (LayerNorm pre-norms), and the
standard residual with RMSNorm against Block "auto" with the RMSNorm fused
into its reads (norm="rmsnorm"). Each Block model runs once before timing,
so its readers have learned their order. Every call's minor page faults
are counted: glibc's malloc returns freed heap memory to the system by
default and the next allocation faults it in again, so on CPU the GPT
parts run twice, the second time after keep_freed_memory() (mallopt), and
that second pair of tables has the ratios of the work alone.

Part 3, training: the same reads with autograd (sources, queries and gains
requiring grad; one forward and torch.autograd.grad of every read's output,
one-call reads against block_reads + block_read_merge as DepthStream runs
them under grad mode), and a training step (forward, loss.backward()) of
the example GPT: standard residual, Block one-call, Block "auto" and
"two_phase".

Timing: the variants of one configuration run interleaved, one call each in
turn, repeated; the medians are compared as ratios to the baseline measured
in the same run (the VM is shared and noisy: absolute times, printed where
useful, are not comparable across runs). No timing is a pass/fail criterion.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

import attnres
from attnres.models import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
DEV = torch.device("cpu")  # --device: where the sources, parameters and models live
sys.path.insert(0, str(RESULTS.parent))
import bench  # noqa: E402  (git_state: the measured code's commit, shared with bench.py)


def machine_name() -> str:
    if DEV.type == "cuda":
        return f"{torch.cuda.get_device_name(DEV)} (CUDA {torch.version.cuda})"
    return cpu_name()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            model = m.group(1) if m else "unknown CPU"
    except OSError:
        model = "unknown CPU"
    return f"{model.strip()} ({torch.get_num_threads()} threads)"


def load_footer(before, after, busy: str) -> str:
    """The load averages at a run's start and end; `busy`: what the script
    itself keeps busy (more load than that means other jobs ran)."""
    def fmt(load):
        return ", ".join(f"{x:.1f}" for x in load)
    return (f"\nLoad average (1, 5, 15 min) at the start: {fmt(before)}; at the end: "
            f"{fmt(after)} ({busy}; more means other jobs shared the machine).")


def write_results(lines, out_dir, name: str, machine: str, suffix: str = "") -> None:
    """benchmarks/results-style file <name>_<machine>[suffix].md in out_dir."""
    stem = re.sub(r"[^A-Za-z0-9]+", "_", machine.replace("(R)", "")).strip("_")
    path = Path(out_dir) / f"{name}_{stem}{suffix}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}", file=sys.stderr)


# ---- part 1: the reads of a Block model ------------------------------------------


def schedule(L, S):
    """(block k, position j) of each of the L reads."""
    return [divmod(l, S) for l in range(L)]


def row_counts(L, S, D):
    """Per token: (one-call bytes, two-phase bytes) of the L reads, fp32.
    Rows of D values read/written plus the statistics: float32, but lse
    float64 (docs/design.md §10)."""
    e, st, lse = 4, 4, 8
    one = two = 0
    for l, (k, j) in enumerate(schedule(L, S)):
        n = k + 1
        N = n + (j > 0)
        one += (N + 1) * D * e + 2 * N * st  # sources, h; rstd + weights
        if j == 0:
            readers = min(S, L - k * S)
            two += (n + readers) * D * e + readers * lse + (n + readers * n) * st  # rstd, weights
        else:
            two += 3 * D * e + lse + 2 * st  # y_j, P read, h written; lse read, rstd + weight
    return one, two


class BlockReads:
    """Sources and parameters of a Block model's L reads (no sublayers: the
    outputs are random, the block sums formed once)."""

    def __init__(self, L, S, T, D, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.L, self.S = L, S
        outputs = [torch.randn(T, D, generator=g) for _ in range(L)]
        self.completed = [torch.randn(T, D, generator=g)]  # the embedding, then block sums
        self.partial = {}  # (k, j) -> partial sum the read at (k, j) sees
        for k in range(-(-L // S)):
            acc = None
            for j in range(S):
                l = k * S + j
                if l >= L:
                    break
                if acc is not None:
                    self.partial[(k, j)] = acc
                acc = outputs[l] if acc is None else acc + outputs[l]
            if (k + 1) * S <= L:
                self.completed.append(acc)
        self.queries = torch.randn(L, D, generator=g) / D ** 0.5
        self.gains = torch.rand(L, D, generator=g) + 0.5
        if DEV.type != "cpu":
            self.completed = [x.to(DEV) for x in self.completed]
            self.partial = {key: x.to(DEV) for key, x in self.partial.items()}
            self.queries, self.gains = self.queries.to(DEV), self.gains.to(DEV)

    def one_call(self):
        out = None
        for l, (k, j) in enumerate(schedule(self.L, self.S)):
            sources = self.completed[: k + 1]
            if j > 0:
                sources = [*sources, self.partial[(k, j)]]
            out = attnres.depth_attention(sources, self.queries[l], self.gains[l])
        return out

    def two_phase(self, in_place=True):
        """As DepthStream reads under torch.no_grad: phase 2 writes h into the
        consumed partial output (in_place), or into a new tensor."""
        merge = attnres.ops.block_read_merge_inplace if in_place else attnres.block_read_merge
        out = None
        for l, (k, j) in enumerate(schedule(self.L, self.S)):
            if j == 0:
                last = min(self.L, (k + 1) * self.S)
                partials, lse = attnres.block_reads(self.completed[: k + 1], self.queries[l:last],
                                                    self.gains[l:last])
                out = partials[0]
            else:
                out = merge(partials[j], lse[j], self.partial[(k, j)], self.queries[l],
                            self.gains[l])
        return out


    def leaves(self):
        """The reads' inputs as leaves that require grad (for part 3)."""
        self.completed = [x.requires_grad_(True) for x in self.completed]
        self.partial = {key: x.requires_grad_(True) for key, x in self.partial.items()}
        self.queries.requires_grad_(True)
        self.gains.requires_grad_(True)
        return [*self.completed, *self.partial.values(), self.queries, self.gains]

    def train_step(self, reads, grad_out, inputs):
        """Every read's h (one_call or two_phase_train) and the gradients of
        sum_l <grad_out, h_l> with respect to every input."""
        hs = reads()  # the last block's sum, when complete, is read by no one
        return torch.autograd.grad(hs, inputs, [grad_out] * len(hs), allow_unused=True)

    def one_call_train(self):
        hs = []
        for l, (k, j) in enumerate(schedule(self.L, self.S)):
            sources = self.completed[: k + 1]
            if j > 0:
                sources = [*sources, self.partial[(k, j)]]
            hs.append(attnres.depth_attention(sources, self.queries[l], self.gains[l]))
        return hs

    def two_phase_train(self):
        """As DepthStream reads under grad mode: the merge into a new tensor."""
        hs = []
        for l, (k, j) in enumerate(schedule(self.L, self.S)):
            if j == 0:
                last = min(self.L, (k + 1) * self.S)
                partials, lse = attnres.block_reads(self.completed[: k + 1], self.queries[l:last],
                                                    self.gains[l:last])
                hs.append(partials[0])
            else:
                hs.append(attnres.block_read_merge(partials[j], lse[j], self.partial[(k, j)],
                                                   self.queries[l], self.gains[l]))
        return hs


def minor_faults() -> int:
    """Minor page faults of this process so far (memory the kernel maps in
    on first touch: here, heap memory malloc had returned to the system)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(fns, repeats, faults=None):
    """Median seconds of each function, run in turn `repeats` times (the
    order rotated each round, so no variant always runs first). `faults`: a
    dict that gets each function's median minor page faults per call."""
    times = {name: [] for name in fns}
    counts = {name: [] for name in fns}
    names = list(fns)
    sync = torch.cuda.synchronize if DEV.type == "cuda" else (lambda: None)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = fns[name]
            sync()
            f0 = minor_faults()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
            counts[name].append(minor_faults() - f0)
    if faults is not None:
        faults.update({name: statistics.median(c) for name, c in counts.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def keep_freed_memory():
    """Make glibc's malloc keep freed memory for reuse in this process (no
    trimming of the heap, a fixed 32 MiB mmap threshold: allocations under
    32 MiB come from the heap and are never handed back), as jemalloc and
    tcmalloc do. By default glibc hands freed heap memory back to the system
    and the next allocation page-faults it in again, so a whole-model timing
    depends on where each model's allocations happen to fall (measured:
    docs/design.md §10). Larger allocations are still mapped afresh: the
    page-fault column shows it. Returns what was set, or None (not glibc)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    mallopt = ctypes.CDLL(None).mallopt
    for option, value in ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 2**31 - 1)):
        if mallopt(option, value) != 1:
            raise RuntimeError(f"glibc mallopt({option}, {value}) failed")
    return "mallopt(M_MMAP_THRESHOLD, 32 MiB) and mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)"


def parse_gpt_size(text):
    """--gpt LAYERS,D,B,T,S as a tuple of ints; ValueError when malformed (the
    example GPT takes max(1, D // 64) heads, which must divide D)."""
    try:
        size = tuple(int(x) for x in text.split(","))
    except ValueError:
        size = ()
    if len(size) != 5 or min(size) < 1:
        raise ValueError(f"--gpt takes LAYERS,D,B,T,S (5 positive integers), got {text!r}")
    D = size[1]
    if D % max(1, D // 64):
        raise ValueError(f"--gpt: D = {D} is not divisible by the example GPT's "
                         f"{max(1, D // 64)} heads (D // 64)")
    return size


def results_suffix(gpt_only, reads_only, T, gpt_size=None, train=False):
    """The results file's suffix: one per kind of run, so no run overwrites
    another kind's file (gpt_size: the --gpt size, when given)."""
    sizes = "_" + "_".join(map(str, gpt_size)) if gpt_size else ""
    if gpt_only:
        return "_gpt" + sizes + ("_train" if train else "")
    if reads_only:
        return f"_reads_T{T}"
    return ("" if T == 2048 else f"_T{T}") + ("_model" + sizes if sizes else "")


def part_reads(T, D, repeats, out):
    out.append(f"## Reads of a Block model: fp32, D = {D}, T = {T} tokens, torch.no_grad\n")
    print(out[-1], flush=True)
    out.append("Bytes per token counted from the ops' inputs and outputs (docs/design.md §10); "
               "time as the ratio of medians over interleaved runs. Copy: a tensor copy of "
               "the completed sources (read and written: as far from the cores as the reads' "
               "sources), interleaved with the reads; a variant's speed is its counted bytes "
               "over its time. Least ratio at copy speed: two-phase's bytes moved at the "
               "copy's speed, over the one-call time (what a two-phase kernel as fast as a "
               "copy would reach).\n")
    out.append("| L | S | one-call KiB/token | two-phase KiB/token | bytes ratio | time ratio "
               "(two-phase / one-call) | time ratio, merge into a new tensor | "
               "one-call speed / copy speed | two-phase speed / copy speed | "
               "least ratio at copy speed | max abs diff of the last h |")
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for L in (12, 32, 64):
            for S in (2, 4, 8):
                model = BlockReads(L, S, T, D)
                diff = (model.one_call() - model.two_phase()).abs().max().item()
                copies = [torch.empty_like(x) for x in model.completed]

                def copy():
                    for dst, src in zip(copies, model.completed):
                        dst.copy_(src)

                med = interleaved({"one": model.one_call, "two": model.two_phase,
                                   "two_new": lambda: model.two_phase(in_place=False),
                                   "copy": copy}, repeats)
                one_b, two_b = row_counts(L, S, D)
                copy_speed = 2 * sum(x.numel() * x.element_size() for x in model.completed) / med["copy"]
                one_speed, two_speed = one_b * T / med["one"], two_b * T / med["two"]
                out.append(f"| {L} | {S} | {one_b / 1024:.1f} | {two_b / 1024:.1f} | "
                           f"{two_b / one_b:.3f} | {med['two'] / med['one']:.3f} | "
                           f"{med['two_new'] / med['one']:.3f} | {one_speed / copy_speed:.2f} | "
                           f"{two_speed / copy_speed:.2f} | "
                           f"{two_b * T / copy_speed / med['one']:.3f} | {diff:.1e} |")
                print(out[-1], flush=True)
                del model, copies


def part_phase1(T, D, repeats, out, n=9):
    """Phase 1 alone against S one-call reads of the same n sources (no
    merges): how its time grows with the readers it serves."""
    out.append(f"\n## Phase 1 alone: n = {n} sources, fp32, D = {D}, T = {T} tokens, torch.no_grad\n")
    print(out[-1], flush=True)
    out.append("| S | phase 1 ms | S one-call reads ms | ratio | phase 1 GB/s (n + S rows) | "
               "copy of the same bytes ms | phase 1 speed / copy speed |")
    out.append("|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(T, D, generator=g).to(DEV) for _ in range(n)]
    with torch.no_grad():
        for S in (1, 4, 8):
            q = (torch.randn(S, D, generator=g) / D ** 0.5).to(DEV)
            w = (torch.rand(S, D, generator=g) + 0.5).to(DEV)
            # Phase 1 reads n source rows and writes S partial outputs a token;
            # a tensor copy that reads and writes (n + S) / 2 rows a token
            # moves the same bytes: the machine's copy speed, in this run.
            copy_src = torch.randn((n + S) * T * D // 2, generator=g).to(DEV)
            copy_dst = torch.empty_like(copy_src)

            def one_call():
                for s in range(S):
                    attnres.depth_attention(sources, q[s], w[s])

            def phase1():
                attnres.block_reads(sources, q, w)

            def copy():
                copy_dst.copy_(copy_src)

            one_call(), phase1(), copy()  # first touch of the outputs' memory, untimed
            med = interleaved({"one": one_call, "p1": phase1, "copy": copy}, repeats)
            gbs = (n + S) * T * D * 4 / med["p1"] / 1e9
            out.append(f"| {S} | {1e3 * med['p1']:.1f} | {1e3 * med['one']:.1f} | "
                       f"{med['p1'] / med['one']:.3f} | {gbs:.1f} | {1e3 * med['copy']:.1f} | "
                       f"{med['copy'] / med['p1']:.2f} |")
            print(out[-1], flush=True)


# ---- part 2: the example GPT's inference forward ---------------------------------------


GPT_VARIANTS = {  # name -> GPTConfig fields; "standard" is every table's baseline
    "standard": dict(residual="standard"),
    "full": dict(residual="full"),
    "block one-call": dict(residual="block", block_reads="one_call"),
    "block auto": dict(residual="block", block_reads="auto"),
    "block two-phase": dict(residual="block", block_reads="two_phase"),
    "standard, RMSNorm": dict(residual="standard", norm="rmsnorm"),
    "block auto, fused RMSNorm": dict(residual="block", block_reads="auto", norm="rmsnorm"),
    # On CUDA "auto" reads one-call (design §10): the two-phase fused row.
    "block two-phase, fused RMSNorm": dict(residual="block", block_reads="two_phase",
                                           norm="rmsnorm"),
    # The same Block models with every partial sum formed by its own add
    # before the read (the stream without the fused prefix add, design §12).
    "block auto, add unfused": dict(residual="block", block_reads="auto", unfused_add=True),
    "block two-phase, add unfused": dict(residual="block", block_reads="two_phase",
                                         unfused_add=True),
    "block two-phase, fused RMSNorm, add unfused": dict(residual="block", block_reads="two_phase",
                                                        norm="rmsnorm", unfused_add=True),
}


class unfused_adds:
    """DepthStream as it reads without the fused prefix add: a deferred
    output is added to the partial sum before every read."""

    def __enter__(self):
        self.saved = attnres.DepthStream._take_pending

        def take(stream):
            stream._settle()
            return None
        attnres.DepthStream._take_pending = take

    def __exit__(self, *exc):
        attnres.DepthStream._take_pending = self.saved


def gpt_call(name, fn):
    """fn, run without the fused add for the "add unfused" variants."""
    if not GPT_VARIANTS[name].get("unfused_add"):
        return fn

    def call():
        with unfused_adds():
            return fn()
    return call


def gpt_models(names, n_layers, D, T, S, train):
    models = {}
    for name in names:
        torch.manual_seed(0)
        fields = {k: v for k, v in GPT_VARIANTS[name].items() if k != "unfused_add"}
        cfg = GPTConfig(vocab_size=256, seq_len=T, d_model=D, n_layers=n_layers,
                        n_heads=max(1, D // 64), block_size=S, **fields)
        with DEV:  # built on the device (a GPU's models are 0.8 GB each)
            models[name] = GPT(cfg).to(DEV).train(train)
    return models


def fused_ratios(med):
    """time with the fused add / time with the add unfused, per Block variant."""
    pairs = [(n, f"{n}, add unfused") for n in med if f"{n}, add unfused" in med]
    return "fused add / unfused add: " + ", ".join(
        f"{n} {med[n] / med[u]:.3f}" for n, u in pairs)


def gpt_table(out, med, faults):
    """Rows of time / standard, time / the standard residual with the same
    norm, and page faults per call."""
    out.append("| variant | time / standard | time / standard with the same norm | "
               "time / Block one-call | minor page faults per call |")
    out.append("|---|---:|---:|---:|---:|")
    for name in med:
        same = "standard, RMSNorm" if "RMSNorm" in name else "standard"
        out.append(f"| {name} | {med[name] / med['standard']:.3f} | {med[name] / med[same]:.3f} | "
                   f"{med[name] / med['block one-call']:.3f} | {faults[name]:.0f} |")


def part_gpt(n_layers, D, B, T, S, repeats, out, malloc):
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0)).to(DEV)
    models = gpt_models(GPT_VARIANTS, n_layers, D, T, S, train=False)
    logits = {}
    with torch.no_grad():
        fns = {name: gpt_call(name, lambda m=m: m(idx)) for name, m in models.items()}
        for name, fn in fns.items():
            logits[name] = fn()[0]
        faults = {}
        med = interleaved(fns, repeats, faults)
    diff = (logits["block two-phase"] - logits["block one-call"]).abs().max().item()
    fused_bits = torch.equal(logits["block two-phase"], logits["block two-phase, add unfused"])
    out.append(f"\n## Example GPT inference forward (torch.no_grad), {malloc}: {n_layers} layers "
               f"({2 * n_layers} sublayers), D = {D}, B = {B}, T = {T}, Block S = {S}, fp32\n")
    gpt_table(out, med, faults)
    out.append(f"\nmax |logits(two-phase) - logits(one-call)| = {diff:.1e}; logits with the fused "
               f"add {'equal' if fused_bits else 'NOT equal'} bit for bit to the unfused add's; "
               f"{fused_ratios(med)}; {repeats} interleaved repeats, medians.")
    print("\n".join(out[-len(models) - 4:]), flush=True)


# ---- part 3: training ----------------------------------------------------------------


def part_train_reads(T, D, repeats, configs, out):
    out.append(f"\n## Training reads of a Block model: fp32, D = {D}, T = {T} tokens, forward + "
               "backward\n")
    out.append("The L reads with autograd: forward, then torch.autograd.grad of every read's "
               "output with respect to the sources, partial sums, queries and gains; time as the "
               "ratio of medians over interleaved runs.\n")
    out.append("| L | S | time ratio fwd+bwd (two-phase / one-call) | one-call ms | two-phase ms | "
               "max rel diff of the gradients |")
    out.append("|---:|---:|---:|---:|---:|---:|")
    for L, S in configs:
        model = BlockReads(L, S, T, D)
        inputs = model.leaves()
        grad_out = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(DEV)
        one = model.train_step(model.one_call_train, grad_out, inputs)
        two = model.train_step(model.two_phase_train, grad_out, inputs)
        diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(two, one) if b is not None)
        del one, two
        med = interleaved({"one": lambda: model.train_step(model.one_call_train, grad_out, inputs),
                           "two": lambda: model.train_step(model.two_phase_train, grad_out, inputs)},
                          repeats)
        out.append(f"| {L} | {S} | {med['two'] / med['one']:.3f} | {1e3 * med['one']:.1f} | "
                   f"{1e3 * med['two']:.1f} | {diff:.1e} |")
        print(out[-1], flush=True)
        del model, inputs


def part_gpt_train(n_layers, D, B, T, S, repeats, out, malloc):
    # Every variant but the two-phase fused row, which only CUDA (whose "auto"
    # reads one-call) needs, and only at inference (gpu_check.sh).
    names = [name for name in GPT_VARIANTS if "two-phase, fused RMSNorm" not in name]
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0)).to(DEV)
    models = gpt_models(names, n_layers, D, T, S, train=True)

    def step(m):
        m.zero_grad(set_to_none=True)
        _, loss = m(idx, idx)
        loss.backward()
        return loss.detach()

    fns = {name: gpt_call(name, lambda m=m: step(m)) for name, m in models.items()}
    losses = {name: fn().item() for name, fn in fns.items()}
    faults = {}
    med = interleaved(fns, repeats, faults)
    out.append(f"\n## Example GPT training step (forward + backward), {malloc}: {n_layers} layers "
               f"({2 * n_layers} sublayers), D = {D}, B = {B}, T = {T}, Block S = {S}, fp32\n")
    gpt_table(out, med, faults)
    out.append(f"\nFirst-step loss: Block one-call {losses['block one-call']:.6f}, auto "
               f"{losses['block auto']:.6f}, two-phase {losses['block two-phase']:.6f} (add "
               f"unfused {losses['block two-phase, add unfused']:.6f}); {fused_ratios(med)}; "
               f"{repeats} interleaved repeats, medians.")
    print("\n".join(out[-len(models) - 4:]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (dry run)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens of part 1's and part 3's reads (default 2048; --quick 128): "
                         "more than the last-level cache holds shows the memory-bound case")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--reads-only", action="store_true",
                      help="part 1 only (the inference reads), and phase 1 alone against S "
                           "one-call reads; results file suffixed _reads_T<tokens>")
    only.add_argument("--gpt-only", action="store_true",
                      help="part 2 only (the example GPT's inference forward; on CUDA 16 "
                           "layers, D = 1024, B = 8, T = 1024); results file suffixed _gpt")
    ap.add_argument("--gpt", default=None, metavar="LAYERS,D,B,T,S",
                    help="the example GPT's size (default 16,512,4,256,4; with --gpt-only on "
                         "CUDA 16,1024,8,1024,4); a results file suffixed with it")
    ap.add_argument("--gpt-train", action="store_true",
                    help="with --gpt-only: the training step too")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the current GPU (on CUDA, Block \"auto\" reads one-call)")
    ap.add_argument("--out-dir", default=str(RESULTS), help="where the results file goes")
    args = ap.parse_args()
    global DEV
    DEV = torch.device(args.device)
    machine = machine_name()
    T = args.tokens or (128 if args.quick else 2048)
    repeats = 2 if args.quick else args.repeats
    command = " ".join(["python benchmarks/block_reads.py", *sys.argv[1:]])
    out = [f"# Two-phase vs one-call Block reads, {'CUDA' if DEV.type == 'cuda' else 'CPU'}\n",
           f"Machine: {machine}; torch {torch.__version__}; git {bench.git_state()}; "
           f"command: `{command}`\n"]
    load_before = os.getloadavg()
    # (layers, D, B, T, S) of the example GPT. A GPU runs the CPU-sized model
    # launch-bound, so --gpt-only there takes a model of the size the paper's
    # < 2% inference claim is about.
    gpt = ((2, 64, 2, 32, 2) if args.quick else
           (16, 1024, 8, 1024, 4) if args.gpt_only and DEV.type == "cuda" else (16, 512, 4, 256, 4))
    if args.gpt:
        try:
            gpt = parse_gpt_size(args.gpt)
        except ValueError as e:
            ap.error(str(e))
    if args.gpt_train and not args.gpt_only:
        ap.error("--gpt-train goes with --gpt-only (a full run times the training step anyway)")
    gpt_repeats = repeats if args.quick else 2 * repeats + 1
    default = "glibc malloc as configured by default" if DEV.type == "cpu" else "CUDA"
    if args.gpt_only:
        part_gpt(*gpt, gpt_repeats, out, default)
        if args.gpt_train:
            part_gpt_train(*gpt, gpt_repeats, out, default)
    else:
        part_reads(T, 1024, repeats, out)
    if args.reads_only:
        part_phase1(T, 1024, repeats, out)
    elif not args.gpt_only:
        # the reads' (L, S) of part 3
        train_configs = ([(12, 4)] if args.quick else
                         [(12, 2), (12, 4), (32, 2), (32, 4), (32, 8), (64, 2), (64, 4)])
        part_gpt(*gpt, gpt_repeats, out, default)
        part_train_reads(T, 1024, repeats, train_configs, out)
        part_gpt_train(*gpt, gpt_repeats, out, default)
    if not args.reads_only:
        # The same models once the host's malloc keeps freed memory: no page
        # faults, so the ratios show the work each residual adds.
        kept = keep_freed_memory() if DEV.type == "cpu" else None
        if kept:
            part_gpt(*gpt, gpt_repeats, out, f"malloc keeping freed memory ({kept})")
            if not args.gpt_only or args.gpt_train:
                part_gpt_train(*gpt, gpt_repeats, out, f"malloc keeping freed memory ({kept})")
    out.append(load_footer(load_before, os.getloadavg(), "this script keeps ~2 threads busy"))
    if not args.quick:
        suffix = results_suffix(args.gpt_only, args.reads_only, T, gpt if args.gpt else None,
                                args.gpt_train)
        write_results(out, args.out_dir, "block_reads", machine, suffix)


if __name__ == "__main__":
    main()
