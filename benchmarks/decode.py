"""Decode tokens/s of the example GPT at batch 1: a K3-style Block AttnRes
model (block size counted in layers, RMSNorm pre-norms fused into the reads)
against the same model with the standard residual and RMSNorm.

  python benchmarks/decode.py                    # CPU; writes benchmarks/results/decode_<cpu>.md
  python benchmarks/decode.py --device cuda      # also a CUDA graph of the decode step

Each variant prefills a prompt into a static KV cache (attnres.models.KVCache)
and then decodes one token per forward; the timed runs decode the same
tokens again after the prompt (its cache entries kept), each step a whole
forward with the cache that gives the new token's logits. Variants: the standard
residual, Block AttnRes, Block AttnRes with block_storage (the stream's block
sums written into one preallocated buffer), and on CUDA each of them captured
once in a CUDA graph and replayed. Before timing, every variant's logits for
the decoded tokens are checked against one forward over the whole sequence
(the replays too): a variant that disagrees is reported and the script exits
with 1. Variants run interleaved (a decode run each in turn), medians
compared in one run; tokens/s is 1 / (median seconds per decode step).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from attnres.models import GPT, GPTConfig, KVCache

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
import bench  # noqa: E402  (git_state)
import block_reads  # noqa: E402  (machine_name, write_results, load_footer)


def make_model(residual: str, args, device) -> GPT:
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.prompt + args.tokens, d_model=args.width,
                    n_layers=args.layers, n_heads=args.heads, residual=residual, norm="rmsnorm",
                    block_layers=args.block_layers if residual == "block" else None)
    torch.manual_seed(0)
    model = GPT(cfg)
    if residual == "block":
        with torch.no_grad():
            for r in model.readers():  # trained-like reads, not the uniform average
                r.query.normal_(0, 0.5)
    return model.to(device=device, dtype=args.dtype).eval()


class Decoder:
    """Prefill, then one token a step; `graph` replays a captured step."""

    def __init__(self, model: GPT, idx: torch.Tensor, prompt: int, storage: bool, graph: bool):
        self.model, self.idx, self.prompt, self.graph = model, idx, prompt, None
        cfg, device = model.cfg, idx.device
        self.cache = KVCache(cfg, 1, device=device, dtype=next(model.parameters()).dtype)
        self.storage = None
        if storage:
            self.storage = torch.empty(cfg.num_blocks, 1, 1, cfg.d_model, device=device,
                                       dtype=self.cache.keys[0].dtype)
        self.token = idx[:, prompt:prompt + 1].clone()
        if graph:
            self.capture()

    def step(self):
        return self.model(self.token, kv_cache=self.cache, block_storage=self.storage)[0]

    def capture(self):
        self.prefill()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up on a side stream, as capture needs
                self.step()
                self.cache.pos.sub_(1)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step()  # recorded, not run: pos stays at the prompt

    def prefill(self):
        self.cache.pos.zero_()
        self.model(self.idx[:, :self.prompt], kv_cache=self.cache)

    def run(self, tokens: int, keep: bool = False):
        """Decodes `tokens` tokens after the prompt (whose cache entries stay
        from the first prefill); the logits of each when `keep`."""
        if keep:
            self.prefill()
        else:
            self.cache.pos.fill_(self.prompt)
        out = []
        for t in range(self.prompt, self.prompt + tokens):
            self.token.copy_(self.idx[:, t:t + 1])
            if self.graph is None:
                logits = self.step()
            else:
                self.graph.replay()
                logits = self.logits
            if keep:
                out.append(logits.clone())
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-layers", type=int, default=4,
                    help="layers per block (K3: 12 of 93, at most 9 sources)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per run")
    ap.add_argument("--repeats", type=int, default=5, help="decode runs per variant")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args()
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    block_reads.DEV = device
    torch.manual_seed(1)
    idx = torch.randint(0, args.vocab, (1, args.prompt + args.tokens), device=device)
    models = {r: make_model(r, args, device) for r in ("standard", "block")}
    variants = {"standard + RMSNorm": (models["standard"], False),
                "Block AttnRes": (models["block"], False),
                "Block AttnRes, block_storage": (models["block"], True)}
    graphs = [False, True] if device.type == "cuda" else [False]
    decoders = {}
    bad = []
    with torch.no_grad():
        wants = {r: m(idx)[0][:, args.prompt:] for r, m in models.items()}
        for name, (model, storage) in variants.items():
            for graph in graphs:
                label = name + (", CUDA graph" if graph else "")
                dec = Decoder(model, idx, args.prompt, storage, graph)
                got = torch.cat(dec.run(args.tokens, keep=True), 1)
                want = wants[model.cfg.residual]
                err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                tol = 1e-4 if args.dtype == torch.float32 else 3e-2
                if not err <= tol:
                    bad.append(f"{label}: decoded logits differ from the full forward's "
                               f"(relative error {err:.2g} > {tol})")
                decoders[label] = dec
        fns = {label: (lambda d=dec: d.run(args.tokens)) for label, dec in decoders.items()}
        load_before = os.getloadavg()
        med = block_reads.interleaved(fns, args.repeats)
    for line in bad:
        print("FAIL", line)
    base = med["standard + RMSNorm"]
    blocks = -(-2 * args.layers // (2 * args.block_layers))
    machine = block_reads.machine_name()
    out = [
        "# Decode tokens/s of the example GPT at batch 1",
        "",
        f"Machine: {machine}; torch {torch.__version__}; {bench.git_state()}; command: "
        f"`python benchmarks/decode.py --device {args.device} --layers {args.layers} --width "
        f"{args.width} --heads {args.heads} --block-layers {args.block_layers} --prompt "
        f"{args.prompt} --tokens {args.tokens} --repeats {args.repeats} --dtype "
        f"{str(args.dtype).replace('torch.', '')}`",
        "",
        f"{args.layers} layers, width {args.width}, {args.heads} heads, vocabulary {args.vocab}, "
        f"{str(args.dtype).replace('torch.', '')}; Block AttnRes with blocks of "
        f"{args.block_layers} layers ({blocks} blocks: the final read sees {blocks + 1} sources), "
        f"the RMSNorm pre-norms fused into the reads. A {args.prompt}-token prompt prefilled, "
        f"then {args.tokens} tokens decoded one a step with a static KV cache; medians of "
        f"{args.repeats} interleaved runs. Every variant's decoded logits were checked against "
        f"one forward over the whole sequence: "
        + ("all agree." if not bad else "; ".join(bad)),
        "",
        "| variant | ms per token | tokens/s | time / standard |",
        "|---|---:|---:|---:|",
    ]
    for label, t in med.items():
        step = t / args.tokens
        out.append(f"| {label} | {1e3 * step:.2f} | {1 / step:.1f} | {t / base:.3f} |")
    if device.type == "cpu":
        out.append(block_reads.load_footer(load_before, os.getloadavg(),
                                           f"torch uses {torch.get_num_threads()} threads"))
    print("\n".join(out))
    block_reads.write_results(out, args.out_dir, "decode", machine)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
