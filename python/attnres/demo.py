"""`python -m attnres demo`: train the example GPT with the standard residual,
Full AttnRes and Block AttnRes on the same data with the same seed, steps
and sizes, then print a table and write plots and a JSON summary.

The corpus needs no download: the Python standard library's own source
files on this machine, read as bytes (a byte-level "character" model).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .models import GPT, GPTConfig

VARIANTS = ("standard", "full", "block")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant (default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=128, help="model width D (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks; each has 2 sublayers (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="context length in bytes (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=4, help="sublayers per block for the 'block' variant (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder (default: %(default)s)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of stdlib source to use (default: %(default)s)")
    parser.add_argument("--eval-batches", type=int, default=16, help="batches for each validation estimate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="default: all three")


# ---- data ---------------------------------------------------------------------


def stdlib_corpus(max_bytes: int) -> tuple[bytes, str]:
    """The first ``max_bytes`` of the stdlib's .py files, in sorted path order."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as fh:
                data = fh.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes], root
    return b"".join(chunks), root


def split_corpus(data: bytes, val_fraction: float = 0.1):
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n_val = int(len(tokens) * val_fraction)
    return tokens[:-n_val], tokens[-n_val:]


def sample_batch(tokens, batch, seq_len, generator, device):
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts[:, None] + offsets]
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def fixed_batches(tokens, n, batch, seq_len, seed, device):
    g = torch.Generator().manual_seed(seed)
    return [sample_batch(tokens, batch, seq_len, g, device) for _ in range(n)]


# ---- progress ------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr; plain lines when it is not a terminal."""

    def __init__(self, label: str, total: int, width: int = 28):
        self.label, self.total, self.width = label, total, width
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last_decile = -1

    def update(self, step: int, info: str) -> None:
        done = step / self.total
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done - elapsed if done > 0 else float("nan")
        filled = int(self.width * done)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"{self.label:>9} |{bar}| {step}/{self.total} {info} {elapsed:4.0f}s eta {eta:4.0f}s"
        if self.tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif int(done * 10) > self.last_decile:
            self.last_decile = int(done * 10)
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---- training -----------------------------------------------------------------------------


def make_optimizer(model: GPT, lr: float):
    # Decay matrices only: norms, biases, AttnRes queries/gains keep their values.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )


def lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def mean_loss(model: GPT, batches) -> float:
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def mean_depth_weights(model: GPT, batches) -> List[List[float]]:
    """Per read (destination), the depth weight of each source averaged over
    every token of ``batches``."""
    model.eval()
    sums: Optional[List[torch.Tensor]] = None
    for x, y in batches:
        _, _, weights = model(x, y, return_depth_weights=True)
        means = [w.flatten(1).mean(1).double().cpu() for w in weights]
        sums = means if sums is None else [s + m for s, m in zip(sums, means)]
    model.train()
    return [(s / len(batches)).tolist() for s in sums]


def train_variant(residual: str, args, train_tokens, val_tokens) -> Dict:
    cfg = GPTConfig(
        vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
        n_heads=args.heads, residual=residual, block_size=args.block_size,
    )
    # Same seed for every variant: shared parameters start identical (the AttnRes
    # parameters draw no random numbers) and the batches are the same.
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(args.device)
    optimizer = make_optimizer(model, args.lr)
    data_gen = torch.Generator().manual_seed(args.seed)
    val_batches = fixed_batches(val_tokens, args.eval_batches, args.batch, args.seq_len, args.seed + 1, args.device)
    train_eval_batches = fixed_batches(train_tokens, args.eval_batches, args.batch, args.seq_len, args.seed + 2, args.device)
    eval_every = max(1, args.steps // 10)

    train_curve, val_curve = [], []
    progress = Progress(residual, args.steps)
    train_seconds, tokens_seen = 0.0, 0
    for step in range(args.steps):
        x, y = sample_batch(train_tokens, args.batch, args.seq_len, data_gen, args.device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        t0 = time.perf_counter()
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.item()  # also waits for the device, so the timing is honest
        if step > 0 or args.steps == 1:  # the first step pays one-off set-up costs
            train_seconds += time.perf_counter() - t0
            tokens_seen += x.numel()
        train_curve.append(loss_value)
        if (step + 1) % eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step + 1, mean_loss(model, val_batches)))
        speed = f"{tokens_seen / train_seconds:6.0f} tok/s" if train_seconds else ""
        progress.update(step + 1, f"loss {loss_value:.3f} {speed}")
    progress.close()

    result = {
        "variant": residual,
        "parameters": model.num_parameters(),
        "tokens_per_s": tokens_seen / train_seconds,
        "train_seconds": train_seconds,
        "final_train_loss": mean_loss(model, train_eval_batches),
        "val_loss": val_curve[-1][1],
        "train_curve": train_curve,
        "val_curve": val_curve,
    }
    if residual != "standard":
        result["block_size"] = cfg.stream_block_size
        result["read_names"] = model.read_names()
        result["source_names"] = model.source_names()
        result["depth_weights"] = mean_depth_weights(model, val_batches)
    return result


# ---- output ------------------------------------------------------------------------------------


def format_table(results: List[Dict]) -> str:
    header = f"{'variant':<10} {'parameters':>10} {'tokens/s':>9} {'train loss':>10} {'val loss':>9}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['variant']:<10} {r['parameters']:>10,} {r['tokens_per_s']:>9.0f} "
            f"{r['final_train_loss']:>10.4f} {r['val_loss']:>9.4f}"
        )
    return "\n".join(lines)


def plot_loss_curves(results: List[Dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        curve = torch.tensor(r["train_curve"])
        window = max(1, len(curve) // 25)
        smooth = curve.unfold(0, window, 1).mean(1) if window > 1 else curve
        steps = torch.arange(window, len(curve) + 1)
        (line,) = ax.plot(steps, smooth, label=f"{r['variant']} train (mean of {window})", alpha=0.8)
        vs, vl = zip(*r["val_curve"])
        ax.plot(vs, vl, "o--", color=line.get_color(), label=f"{r['variant']} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("Training on Python stdlib source (byte level)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_depth_weights(result: Dict, path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    reads, sources = result["read_names"], result["source_names"]
    grid = np.full((len(reads), len(sources)), np.nan)
    for i, row in enumerate(result["depth_weights"]):
        grid[i, : len(row)] = row  # source k is always slot k; later slots unseen yet
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 0.75 * len(sources)), 1.6 + 0.42 * len(reads)))
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if grid[i, j] < 0.6 else "black")
    if result["block_size"] is None:
        ax.set_xticks(range(len(sources)), sources, rotation=45, ha="right")
    else:  # two-line block labels read better upright
        ax.set_xticks(range(len(sources)), sources, fontsize=8)
    ax.set_yticks(range(len(reads)), reads)
    ax.set_xlabel("source")
    ax.set_ylabel("reading sublayer (destination)")
    mode = "Full AttnRes" if result["block_size"] is None else f"Block AttnRes, S = {result['block_size']}"
    note = "grey: not yet a source" if result["block_size"] is None else "a block is a partial sum while it runs; grey: not yet a source"
    ax.set_title(f"Mean depth-attention weight on validation data, {mode}\n({note})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="weight")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda was asked for but torch sees no CUDA device", file=sys.stderr)
        return 2
    if min(args.steps, args.d_model, args.layers, args.heads, args.seq_len, args.batch, args.block_size) <= 0:
        print("steps, sizes and --block-size must be positive", file=sys.stderr)
        return 2
    if args.d_model % args.heads:
        print(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")

    data, root = stdlib_corpus(args.corpus_bytes)
    train_tokens, val_tokens = split_corpus(data)
    print(
        f"corpus: {len(data):,} bytes of .py files under {root} "
        f"({len(train_tokens):,} train / {len(val_tokens):,} val)\n"
        f"model: d_model={args.d_model} layers={args.layers} ({2 * args.layers} sublayers) "
        f"heads={args.heads} seq_len={args.seq_len} batch={args.batch} steps={args.steps} "
        f"block_size={args.block_size} device={args.device} ({cpu_name() if args.device == 'cpu' else torch.cuda.get_device_name()}, "
        f"{torch.get_num_threads()} threads)",
        flush=True,
    )
    load_before = _load_average()
    started = time.perf_counter()
    results = [train_variant(v, args, train_tokens, val_tokens) for v in args.variants]
    wall = time.perf_counter() - started
    load_after = _load_average()

    table = format_table(results)
    print()
    print(table)
    print(f"\nwall time: {wall:.0f} s")
    if load_after is not None and load_after > os.cpu_count():
        # tokens/s from a shared, busy machine are not comparable with other runs
        print(f"note: 1-minute load average {load_after:.1f} on {os.cpu_count()} CPUs: "
              "other work competed for the CPU, tokens/s are low and noisy")

    args.out.mkdir(parents=True, exist_ok=True)
    written = [args.out / "loss_curves.png"]
    plot_loss_curves(results, written[0])
    for r in results:
        if r["variant"] != "standard":
            written.append(args.out / f"depth_weights_{r['variant']}.png")
            plot_depth_weights(r, written[-1])
    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "corpus": {"root": root, "bytes": len(data), "train": len(train_tokens), "val": len(val_tokens)},
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1min_before": load_before,
            "load_average_1min_after": load_after,
            "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name() if args.device == "cuda" else None,
        },
        "wall_seconds": wall,
        "table": table,
        "results": results,
    }
    written.append(args.out / "summary.json")
    written[-1].write_text(json.dumps(summary, indent=1))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
