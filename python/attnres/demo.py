"""`python -m attnres demo`: train the example GPT with the standard residual,
Full AttnRes and Block AttnRes on the same data, over several paired seeds
(for each seed every variant starts from the same shared parameters and sees
the same batches), then print a table (mean +- sd over seeds), measure the
depth profile (input/output magnitudes and gradients per sublayer) and write
plots and a JSON summary.

The corpus needs no download: the Python standard library's own source
files on this machine (with --corpus all, also every site-packages
directory), read as bytes (a byte-level "character" model).

Presets: "cpu" (the default, a few minutes on 2 cores) and "gpu" (16 layers,
sized for one large GPU, bf16 autocast, stops starting new runs when its time
budget would be exceeded). Any option given explicitly overrides the preset.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import site
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .models import GPT, GPTConfig
from .optim import param_groups

VARIANTS = ("standard", "full", "block")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_VALIDATION_SEED = 1_000_003  # validation batches are the same for every seed and variant

# One row per option, in --help order: (name, add_argument keywords, help, (cpu preset, gpu preset) or None).
# The preset values are used where an option is not given: "cpu" fits `make demo` in about 5 minutes on a
# 2-core machine; "gpu" is sized for about 30 minutes on one H200 (9 runs) and also has a hard budget (max_minutes).
OPTIONS = [
    ("preset", dict(choices=("cpu", "gpu"), default="cpu"),
     "defaults for every option below that is not given (default: %(default)s)", None),
    ("steps", dict(type=int), "training steps per run", (200, 3000)),
    ("d_model", dict(type=int), "model width D", (64, 384)),
    ("layers", dict(type=int), "transformer blocks; each has 2 sublayers", (8, 16)),
    ("heads", dict(type=int), "attention heads", (4, 6)),
    ("seq_len", dict(type=int), "context length in bytes", (128, 512)),
    ("batch", dict(type=int), "sequences per step", (16, 32)),
    ("block_size", dict(type=int), "sublayers per block for the 'block' variant", (4, 8)),
    ("lr", dict(type=float), "peak AdamW learning rate", (3e-3, 1.5e-3)),
    ("attnres_lr_scale", dict(type=float),
     "learning-rate factor of the AttnRes queries and key-norm gains; 0 freezes them", (0.1, 0.1)),
    ("weight_decay", dict(type=float), "AdamW weight decay of the weight matrices", (0.1, 0.1)),
    ("seeds", dict(type=int),
     "seeds per variant (paired: seed s is the same init and batches for every variant)", (3, 3)),
    ("seed", dict(type=int, default=0), "first seed; the runs use seed, seed+1, ... (default: %(default)s)", None),
    ("amp", dict(action=argparse.BooleanOptionalAction, default=None),
     "bf16 autocast for the sublayers (the residual stream stays fp32)", (False, True)),
    ("device", dict(choices=("cpu", "cuda")), "default: %(default)s", None),  # its default: add_arguments
    ("out", dict(type=Path), "output folder", (Path("demo_out"), Path("demo_out_gpu"))),
    ("corpus", dict(choices=("stdlib", "all")),
     "'stdlib': the standard library's .py files; 'all': also every site-packages directory", ("stdlib", "all")),
    ("corpus_bytes", dict(type=int), "bytes of source to use; 0 for all of it", (2_000_000, 0)),
    ("eval_batches", dict(type=int), "batches for each loss estimate", (8, 32)),
    ("profile_batches", dict(type=int), "batches for the depth profile; 0 skips it", (2, 4)),
    ("max_minutes", dict(type=float),
     "do not start a run that would end after this many minutes (none: no limit)", (None, 30.0)),
    ("variants", dict(nargs="+", choices=VARIANTS, default=list(VARIANTS)), "default: all three", None),
]
PRESETS: Dict[str, Dict] = {preset: {name: values[i] for name, _, _, values in OPTIONS if values is not None}
                            for i, preset in enumerate(("cpu", "gpu"))}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, keywords, text, presets in OPTIONS:
        if presets is not None:
            text += f" (cpu preset: {presets[0]}, gpu preset: {presets[1]})"
        parser.add_argument(_flag(name), help=text, **keywords)
    parser.set_defaults(device="cuda" if torch.cuda.is_available() else "cpu")  # looked up when the parser is made


def resolve_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every option left unset from the chosen preset (in place)."""
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def check_arguments(args) -> Optional[str]:
    """The first problem with ``args`` as a message, or None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda was asked for but torch sees no CUDA device"
    for name in ("steps", "d_model", "layers", "heads", "seq_len", "batch", "block_size", "seeds", "eval_batches"):
        if getattr(args, name) <= 0:
            return f"{_flag(name)} must be positive, got {getattr(args, name)}"
    if args.profile_batches < 0:
        return f"--profile-batches must be >= 0, got {args.profile_batches}"
    if args.corpus_bytes < 0:
        return f"--corpus-bytes must be >= 0 (0: all), got {args.corpus_bytes}"
    if args.d_model % args.heads:
        return f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})"
    for name in ("lr", "attnres_lr_scale", "weight_decay"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            return f"{_flag(name)} must be a finite number >= 0, got {getattr(args, name)}"
    if args.max_minutes is not None and not args.max_minutes > 0:
        return f"--max-minutes must be positive, got {args.max_minutes}"
    if len(set(args.variants)) != len(args.variants):
        return f"--variants lists a variant twice: {args.variants}"
    return None


# ---- data ---------------------------------------------------------------------------------------
def corpus_roots(kind: str) -> List[str]:
    """The stdlib folder, then (for ``kind='all'``) every site-packages folder of this interpreter."""
    roots = [os.path.dirname(os.__file__)]
    if kind == "all":
        for path in [*site.getsitepackages(), site.getusersitepackages()]:
            if os.path.isdir(path) and os.path.realpath(path) not in map(os.path.realpath, roots):
                roots.append(path)
    return roots


def source_corpus(roots: List[str], max_bytes: int) -> bytes:
    """The .py files under ``roots`` (in that order, each in sorted path order, site-packages folders
    skipped inside the stdlib walk), cut at ``max_bytes`` (0: no limit)."""
    chunks, total = [], 0
    for index, root in enumerate(roots):
        skip = _SKIP_DIRS if index == 0 else {"__pycache__"}  # installed packages are not the stdlib
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip)
            for name in sorted(n for n in filenames if n.endswith(".py")):
                try:
                    chunks.append(Path(dirpath, name).read_bytes())
                except OSError:  # a broken link or unreadable file is not worth stopping for
                    continue
                total += len(chunks[-1])
                if max_bytes and total >= max_bytes:
                    return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def split_corpus(data: bytes, val_fraction: float = 0.1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bytes as uint8 tensors (1 byte per token even for a 150 MB corpus); the last ``val_fraction`` is the
    validation split."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(len(tokens) * val_fraction)
    return tokens[:-n_val], tokens[-n_val:]


def sample_batch(tokens, batch, seq_len, generator, device):
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def fixed_batches(tokens, n, batch, seq_len, seed, device):
    g = torch.Generator().manual_seed(seed)
    return [sample_batch(tokens, batch, seq_len, g, device) for _ in range(n)]


# ---- training -----------------------------------------------------------------------------------
def lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine to 10%."""
    warmup = max(1, total // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _autocast(args):
    return torch.autocast(args.device, dtype=torch.bfloat16, enabled=bool(args.amp))


@torch.no_grad()
def mean_loss(model: GPT, batches, args) -> float:
    model.eval()
    with _autocast(args):
        losses = [model(x, y)[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def mean_depth_weights(model: GPT, batches, args) -> List[List[float]]:
    """Per read (destination), the depth weight of each source averaged over every token of ``batches``."""
    model.eval()
    with _autocast(args):
        per_batch = [[w.flatten(1).mean(1).double().cpu() for w in model(x, y, return_depth_weights=True)[2]]
                     for x, y in batches]
    model.train()
    return [(sum(read) / len(batches)).tolist() for read in zip(*per_batch)]


def depth_profile(model: GPT, batches, args) -> Dict[str, List[float]]:
    """Per sublayer (attn_0, mlp_0, ..., in order), over every token of ``batches``: ``input_rms``, the RMS of
    its input before the pre-norm (the residual stream x for the standard model, the depth read h for AttnRes);
    ``output_rms``, the RMS of its output f; ``grad_norm``, the L2 norm over D of d(loss summed over tokens)/d f
    averaged over tokens (so it does not depend on the batch size). Also ``final_input_rms``, the RMS of what
    enters the final norm. The model's parameters and gradients are left as they were."""
    n = 2 * model.cfg.n_layers
    # Slot n of the input sums is the final norm's input.
    sq_in, elements, sq_out, grad_sum, tokens = [0.0] * (n + 1), [0] * (n + 1), [0.0] * n, [0.0] * n, [0] * n

    def on_input(j, _module, inputs):
        x = inputs[0].detach().double()
        sq_in[j] += x.square().sum().item()
        elements[j] += x.numel()

    def on_output(j, _module, _inputs, out):
        sq_out[j] += out.detach().double().square().sum().item()
        tokens[j] += out[..., 0].numel()

        def on_grad(g):
            grad_sum[j] += g.double().norm(dim=-1).sum().item()
        out.register_hook(on_grad)

    handles = [model.ln_f.register_forward_pre_hook(partial(on_input, n))]
    for i, blk in enumerate(model.blocks):
        for j, norm, sublayer in ((2 * i, blk.ln1, blk.attn), (2 * i + 1, blk.ln2, blk.mlp)):
            handles += [norm.register_forward_pre_hook(partial(on_input, j)),
                        sublayer.register_forward_hook(partial(on_output, j))]
    saved_grads, was_training = {p: p.grad for p in model.parameters()}, model.training
    model.eval()
    try:
        for x, y in batches:
            with _autocast(args):
                logits, _ = model(x)
            F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in saved_grads.items():
            p.grad = g
        model.train(was_training)
    return {"input_rms": [math.sqrt(s / e) for s, e in zip(sq_in[:n], elements)],
            "output_rms": [math.sqrt(s / e) for s, e in zip(sq_out, elements)],
            "grad_norm": [g / t for g, t in zip(grad_sum, tokens)],
            "final_input_rms": math.sqrt(sq_in[n] / elements[n])}


def train_run(residual: str, seed: int, args, train_tokens, val_batches, train_eval_batches) -> Dict:
    """Train one variant from seed ``seed``; returns its losses, curves, speed, depth profile (at init and
    trained) and, for AttnRes, depth weights."""
    from tqdm.auto import tqdm

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads, residual=residual, block_size=args.block_size)
    # The same seed gives every variant identical shared parameters (the
    # AttnRes parameters draw no random numbers) and identical batches.
    torch.manual_seed(seed)
    model = GPT(cfg).to(args.device)
    profile_batches = val_batches[: args.profile_batches]
    profile_init = depth_profile(model, profile_batches, args) if profile_batches else None
    optimizer = torch.optim.AdamW(
        param_groups(model, lr=args.lr, weight_decay=args.weight_decay, attnres_lr_scale=args.attnres_lr_scale),
        betas=(0.9, 0.95), fused=args.device == "cuda")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.steps))
    data_gen = torch.Generator().manual_seed(seed)
    eval_every = max(1, args.steps // 10)
    label, tty = f"{residual} s{seed}", sys.stderr.isatty()
    bar = tqdm(total=args.steps, desc=f"{label:>12}", disable=not tty, leave=False, dynamic_ncols=True, file=sys.stderr)
    train_curve, val_curve = [], []
    train_seconds, tokens_seen, started = 0.0, 0, time.perf_counter()
    for step in range(args.steps):
        x, y = sample_batch(train_tokens, args.batch, args.seq_len, data_gen, args.device)
        t0 = time.perf_counter()
        with _autocast(args):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()  # also waits for the device, so the timing is honest
        if step > 0 or args.steps == 1:  # the first step pays one-off set-up costs
            train_seconds += time.perf_counter() - t0
            tokens_seen += x.numel()
        if not math.isfinite(loss_value):
            bar.close()
            raise FloatingPointError(f"{label}: training loss is {loss_value} at step {step + 1}")
        train_curve.append(loss_value)
        speed = tokens_seen / train_seconds if train_seconds else float("nan")
        if (step + 1) % eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step + 1, mean_loss(model, val_batches, args)))
            if not tty:  # a log line instead of a bar (unattended runs, CI)
                print(f"{label:>12} step {step + 1:>5}/{args.steps} train {loss_value:.3f} "
                      f"val {val_curve[-1][1]:.3f} {speed:7.0f} tok/s "
                      f"{time.perf_counter() - started:5.0f} s", file=sys.stderr, flush=True)
        bar.set_postfix_str(f"loss {loss_value:.3f} {speed:6.0f} tok/s", refresh=False)
        bar.update(1)
    bar.close()

    result = {"variant": residual, "seed": seed, "parameters": model.num_parameters(),
              "tokens_per_s": tokens_seen / train_seconds, "train_seconds": train_seconds,
              "final_train_loss": mean_loss(model, train_eval_batches, args), "val_loss": val_curve[-1][1],
              "train_curve": train_curve, "val_curve": val_curve}
    if profile_batches:
        result["depth_profile"] = {"init": profile_init, "trained": depth_profile(model, profile_batches, args)}
    if residual != "standard":
        result.update(block_size=cfg.stream_block_size, read_names=model.read_names(),
                      source_names=model.source_names(), depth_weights=mean_depth_weights(model, val_batches, args))
    print(f"{label:>12}: val {result['val_loss']:.4f} train {result['final_train_loss']:.4f} "
          f"({time.perf_counter() - started:.0f} s, {result['tokens_per_s']:.0f} tok/s)", file=sys.stderr, flush=True)
    return result


# ---- aggregation --------------------------------------------------------------------------------
def mean_sd(values: List[float]) -> Tuple[float, Optional[float]]:
    """Mean and sample standard deviation (None for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _mean_over_runs(values: List):
    """The mean of numbers, or the element-wise mean of equally long lists."""
    if isinstance(values[0], list):
        return [statistics.fmean(column) for column in zip(*values)]
    return statistics.fmean(values)


def aggregate(runs: List[Dict], variants: List[str]) -> List[Dict]:
    """Per variant, over the seeds it completed: mean and sd of the losses,
    and of the paired difference to the standard model (same seeds)."""
    standard_val = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == "standard"}
    rows = []
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        if not mine:
            continue
        row = {"variant": variant, "seeds": [r["seed"] for r in mine], "parameters": mine[0]["parameters"],
               "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in mine),
               "train_loss": mean_sd([r["final_train_loss"] for r in mine]),
               "val_loss": mean_sd([r["val_loss"] for r in mine])}
        paired = [(r["val_loss"] - standard_val[r["seed"]]) for r in mine if r["seed"] in standard_val]
        if variant != "standard" and paired:
            row["val_minus_standard"] = mean_sd(paired)
            row["lower_than_standard"] = f"{sum(d < 0 for d in paired)}/{len(paired)}"
        if all("depth_profile" in r for r in mine):
            row["depth_profile"] = {when: {key: _mean_over_runs([r["depth_profile"][when][key] for r in mine])
                                           for key in mine[0]["depth_profile"][when]}
                                    for when in ("init", "trained")}
        if "depth_weights" in mine[0]:
            row["depth_weights"] = [_mean_over_runs(list(read)) for read in zip(*(r["depth_weights"] for r in mine))]
            row.update({key: mine[0][key] for key in ("block_size", "read_names", "source_names")})
        rows.append(row)
    return rows


def _pm(value: Tuple[float, Optional[float]], digits: int = 4, sign: bool = False) -> str:
    mean, sd = value
    text = f"{mean:+.{digits}f}" if sign else f"{mean:.{digits}f}"
    return text if sd is None else f"{text} ± {sd:.{digits}f}"


def format_table(rows: List[Dict]) -> str:
    header = (f"{'variant':<9} {'seeds':>5} {'parameters':>10} {'tokens/s':>8}  {'train loss':<16} "
              f"{'val loss':<16} {'val - standard':<17} {'lower':>5}")
    lines = [header, "-" * len(header)]
    for r in rows:
        diff = _pm(r["val_minus_standard"], sign=True) if "val_minus_standard" in r else ""
        lines.append(f"{r['variant']:<9} {len(r['seeds']):>5} {r['parameters']:>10,} {r['tokens_per_s']:>8.0f}  "
                     f"{_pm(r['train_loss']):<16} {_pm(r['val_loss']):<16} {diff:<17} "
                     f"{r.get('lower_than_standard', ''):>5}")
    return "\n".join(lines)


# ---- plots --------------------------------------------------------------------------------------
def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss_curves(runs: List[Dict], rows: List[Dict], path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        mine = [r for r in runs if r["variant"] == row["variant"]]
        curve = torch.tensor(_mean_over_runs([r["train_curve"] for r in mine]))
        window = max(1, len(curve) // 25)
        smooth = curve.unfold(0, window, 1).mean(1) if window > 1 else curve
        (line,) = ax.plot(torch.arange(window, len(curve) + 1), smooth, alpha=0.8,
                          label=f"{row['variant']} train (mean of {window} steps, {len(mine)} seeds)")
        val_steps = [s for s, _ in mine[0]["val_curve"]]
        val = np.array([[v for _, v in r["val_curve"]] for r in mine])
        ax.plot(val_steps, val.mean(0), "o--", color=line.get_color(), label=f"{row['variant']} val (mean)")
        if len(mine) > 1:
            sd = val.std(0, ddof=1)
            ax.fill_between(val_steps, val.mean(0) - sd, val.mean(0) + sd, color=line.get_color(), alpha=0.15)
    ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)",
           title="Training on Python source (byte level); band: ± 1 sd over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_depth_weights(row: Dict, path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np
    reads, sources, full = row["read_names"], row["source_names"], row["block_size"] is None
    grid = np.full((len(reads), len(sources)), np.nan)
    for i, weights in enumerate(row["depth_weights"]):
        grid[i, : len(weights)] = weights  # source k is always slot k; later slots unseen yet
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 0.75 * len(sources)), 1.6 + 0.42 * len(reads)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    if len(sources) <= 40:
        for (i, j), weight in np.ndenumerate(grid):
            if not np.isnan(weight):
                ax.text(j, i, f"{weight:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if weight < 0.6 else "black")
    # Two-line block labels read better upright.
    ax.set_xticks(range(len(sources)), sources, **(dict(rotation=45, ha="right") if full else dict(fontsize=8)))
    ax.set_yticks(range(len(reads)), reads)
    ax.set(xlabel="source", ylabel="reading sublayer (destination)")
    mode = "Full AttnRes" if full else f"Block AttnRes, S = {row['block_size']}"
    note = "grey: not yet a source" if full else "a block is a partial sum while it runs; grey: not yet a source"
    ax.set_title(f"Mean depth-attention weight on validation data, {mode}, mean of {len(row['seeds'])} seeds\n({note})",
                 fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="weight")
    _save(fig, path)


def plot_depth_profile(rows: List[Dict], sublayer_names: List[str], path: Path) -> None:
    import matplotlib.pyplot as plt
    panels = {"input_rms": "RMS of the sublayer input (before its norm)", "output_rms": "RMS of the sublayer output",
              "share": "output RMS / input RMS (the sublayer's share)", "grad_norm": "|d loss / d output| per token"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    x = range(len(sublayer_names))
    for ax, (key, title) in zip(axes.flat, panels.items()):
        for row in rows:
            for when, style in (("trained", dict(ls="-", marker="o", ms=3)), ("init", dict(ls=":", lw=1))):
                prof = row["depth_profile"][when]
                ys = [o / i for o, i in zip(prof["output_rms"], prof["input_rms"])] if key == "share" else prof[key]
                color = {"standard": "C0", "full": "C1", "block": "C2"}[row["variant"]]
                ax.plot(x, ys, color=color, label=f"{row['variant']} ({when})", **style)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    step = max(1, len(sublayer_names) // 12)
    for ax in axes[1]:
        ax.set_xticks(list(x)[::step], sublayer_names[::step], rotation=45, ha="right", fontsize=8)
        ax.set_xlabel("sublayer")
    axes[0, 0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Depth profile on validation data (mean of {len(rows[0]['seeds'])} seeds): "
                 "solid trained, dotted at init", fontsize=10)
    _save(fig, path)


# ---- main ---------------------------------------------------------------------------------------
def _load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):  # not Linux, or no model name listed
        return platform.processor() or platform.machine()


def run(args) -> int:
    resolve_preset(args)
    problem = check_arguments(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.preset == "gpu" and args.device == "cpu":
        print("warning: the gpu preset's sizes on the CPU take many hours per run; "
              "pass smaller sizes (--steps, --d-model, --layers, ...) to run it here", file=sys.stderr, flush=True)
    import matplotlib
    matplotlib.use("Agg")

    roots = corpus_roots(args.corpus)
    data = source_corpus(roots, args.corpus_bytes)
    train_tokens, val_tokens = split_corpus(data)
    if len(val_tokens) <= args.seq_len + 1:
        print(f"the corpus ({len(data):,} bytes) is too small for --seq-len {args.seq_len}", file=sys.stderr)
        return 2
    cuda_name = torch.cuda.get_device_name() if args.device == "cuda" else None
    seeds = list(range(args.seed, args.seed + args.seeds))
    print(f"corpus: {len(data):,} bytes of .py files under {', '.join(roots)} "
          f"({len(train_tokens):,} train / {len(val_tokens):,} val)\n"
          f"model: d_model={args.d_model} layers={args.layers} ({2 * args.layers} sublayers) "
          f"heads={args.heads} seq_len={args.seq_len} batch={args.batch} steps={args.steps} "
          f"block_size={args.block_size} lr={args.lr} attnres_lr_scale={args.attnres_lr_scale} "
          f"amp={args.amp} seeds={seeds} preset={args.preset}\n"
          f"device={args.device} ({cuda_name or cpu_name()}, {torch.get_num_threads()} threads)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    context = {  # what summary.json says about the run besides its results
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "corpus": {"roots": roots, "bytes": len(data), "train": len(train_tokens), "val": len(val_tokens)},
        "machine": {"platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "load_average_1min_before": _load_average(),
                    "torch": torch.__version__, "cuda_device": cuda_name}}

    def write_summary(rows, table, wall, complete, note):
        summary = {"complete": complete, "note": note, **context,
                   "wall_seconds": wall, "table": table, "variants": rows, "runs": runs}
        tmp = summary_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(summary_path)  # a reader never sees half a file

    val_batches = fixed_batches(val_tokens, args.eval_batches, args.batch, args.seq_len, _VALIDATION_SEED, args.device)
    train_eval_batches = fixed_batches(train_tokens, args.eval_batches, args.batch, args.seq_len,
                                       _VALIDATION_SEED + 1, args.device)
    started, runs, note = time.perf_counter(), [], None
    # Seed-major order: a run cut short by --max-minutes leaves complete pairs.
    plan = [(seed, variant) for seed in seeds for variant in args.variants]
    for index, (seed, variant) in enumerate(plan):
        elapsed = time.perf_counter() - started
        projected = elapsed + elapsed / index if index else 0.0  # when the next run would end
        if args.max_minutes is not None and projected > 60 * args.max_minutes:
            note = (f"stopped after {index} of {len(plan)} runs: the next would end at about "
                    f"{projected / 60:.0f} min, past --max-minutes {args.max_minutes:g}")
            print(note, file=sys.stderr, flush=True)
            break
        runs.append(train_run(variant, seed, args, train_tokens, val_batches, train_eval_batches))
        if index == 0 and len(plan) > 1:
            per_run = time.perf_counter() - started
            print(f"first run took {per_run:.0f} s; all {len(plan)} runs: about "
                  f"{per_run * len(plan) / 60:.1f} min", file=sys.stderr, flush=True)
        rows = aggregate(runs, args.variants)
        write_summary(rows, format_table(rows), time.perf_counter() - started, complete=False, note="in progress")
    wall = time.perf_counter() - started
    context["machine"]["load_average_1min_after"] = load_after = _load_average()

    rows = aggregate(runs, args.variants)
    table = format_table(rows)
    print(f"\n{table}\n\n(mean ± sd over seeds; 'val - standard' is the paired difference, same seed; "
          f"'lower': seeds where the variant's val loss is below the standard model's)\nwall time: {wall:.0f} s")
    if load_after is not None and load_after > os.cpu_count():
        # tokens/s from a shared, busy machine are not comparable with other runs
        print(f"note: 1-minute load average {load_after:.1f} on {os.cpu_count()} CPUs: "
              "other work competed for the CPU, tokens/s are low and noisy")

    written = [args.out / "loss_curves.png"]
    plot_loss_curves(runs, rows, written[0])
    for row in rows:
        if row["variant"] != "standard":
            written.append(args.out / f"depth_weights_{row['variant']}.png")
            plot_depth_weights(row, written[-1])
    if rows and all("depth_profile" in row for row in rows):
        written.append(args.out / "depth_profile.png")
        plot_depth_profile(rows, [f"L{i}.{kind}" for i in range(args.layers) for kind in ("attn", "mlp")], written[-1])
    write_summary(rows, table, wall, complete=note is None, note=note)
    print("wrote " + ", ".join(str(p) for p in [*written, summary_path]))
    return 0
