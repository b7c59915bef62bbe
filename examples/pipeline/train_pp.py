"""Pipeline-parallel training of the example GPT (Block AttnRes) on the CPU.

    torchrun --nproc-per-node 2 examples/pipeline/train_pp.py [--steps 50] [--schedule 1F1B]
        [--residual block|full|standard] [--virtual-stages V] [--stream-cache] [--layers L] [--d-model D]

The transformer blocks are split evenly into ranks x V stages (stage i on rank
i % ranks; V > 1 runs ScheduleInterleaved1F1B), each an
attnres.pipelining.StreamStage (the first also the embeddings, the last the
final read, norm and head); the stream crosses each boundary as its tensors.
With --residual standard the same split carries the one hidden tensor (the
baseline of benchmarks/pipeline_step.py). With --stream-cache (V > 1) each
rank's stages share an attnres.pipelining.StreamCache (cross-stage caching): a
hop carries only the sources the receiving rank does not already hold. Rank 0 first computes the loss of the
unsplit model on the first batch, which the pipelined step must reproduce; the
last rank prints the loss as training goes and the mean time of the steps after
the first two. The corpus is the demo's (the Python standard library's source
files, as bytes).
"""
from __future__ import annotations

import argparse
import sys
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

import attnres
from attnres.demo import corpus_roots, sample_batch, source_corpus, split_corpus
from attnres.models import GPT, GPTConfig


class Embed(nn.Module):
    def __init__(self, model: GPT):
        super().__init__()
        self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb

    def forward(self, idx):
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, model: GPT):
        super().__init__()
        self.final_res = model.final_res if model.cfg.residual != "standard" else nn.Identity()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, stream):
        return self.head(self.ln_f(self.final_res(stream)))


class PlainStage(nn.Module):
    """A stage of the standard residual: one hidden tensor in and out."""

    def __init__(self, blocks, embed=None, head=None):
        super().__init__()
        self.blocks, self.embed, self.head = nn.ModuleList(blocks), embed, head

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def build(args) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model,
                          n_layers=args.layers, n_heads=4, residual=args.residual, block_size=3))
    # Stages cannot share a parameter: untie the head from the token embedding.
    model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    return model


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=("GPipe", "1F1B"), default="1F1B",
                        help="with one stage per rank")
    parser.add_argument("--residual", choices=("block", "full", "standard"), default="block")
    parser.add_argument("--virtual-stages", type=int, default=1, help="stages per rank")
    parser.add_argument("--stream-cache", action="store_true",
                        help="cross-stage caching of the stream's sources (V > 1, AttnRes)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    args = parser.parse_args()
    if args.stream_cache and (args.residual == "standard" or args.virtual_stages < 2):
        parser.error("--stream-cache caches an AttnRes stream across a rank's stages: it needs "
                     "--residual block or full and --virtual-stages >= 2")
    if args.virtual_stages > 1 and "--schedule" in sys.argv:
        parser.error("--schedule picks the one-stage-per-rank schedule; --virtual-stages > 1 runs "
                     "ScheduleInterleaved1F1B")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages = world * args.virtual_stages
    if world < 2 or args.layers % n_stages:
        raise SystemExit(f"run with torchrun --nproc-per-node >= 2, and --layers ({args.layers}) a "
                         f"multiple of ranks x --virtual-stages ({n_stages})")
    torch.set_num_threads(1)
    train, _ = split_corpus(source_corpus(corpus_roots("stdlib"), 2_000_000))
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(t.contiguous() for t in sample_batch(train, args.batch, args.seq_len, gen, "cpu"))
               for _ in range(args.steps)]

    model = build(args)
    if rank == 0:
        with torch.no_grad():
            x, y = batches[0]
            print(f"unsplit model, first batch: loss {model(x, y)[1].item():.6f}", flush=True)
    per_stage = args.layers // n_stages
    cache = None
    if args.stream_cache:
        boundaries = [2 * i * per_stage for i in range(n_stages + 1)]
        cache = attnres.pipelining.StreamCache(boundaries, num_ranks=world)
    modules = []
    for i in range(rank, n_stages, world):  # stage i on rank i % world
        blocks = model.blocks[i * per_stage:(i + 1) * per_stage]
        embed = Embed(model) if i == 0 else None
        head = Head(model) if i == n_stages - 1 else None
        if args.residual == "standard":
            modules.append(PlainStage(blocks, embed, head))
        else:
            # Each block appends 2 outputs (attention, MLP): with S = 3 some
            # boundaries fall inside a block.
            modules.append(attnres.pipelining.StreamStage(
                blocks, outputs_before=2 * i * per_stage, block_size=model.cfg.stream_block_size,
                embed=embed, head=head, cache=cache))
    stage_class = PipelineStage if cache is None else attnres.pipelining.StreamPipelineStage
    stages = [stage_class(m, i, n_stages, torch.device("cpu"))
              for m, i in zip(modules, range(rank, n_stages, world))]
    if args.virtual_stages > 1:
        schedule = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss_fn)
    else:
        schedule = (ScheduleGPipe if args.schedule == "GPipe" else Schedule1F1B)(
            stages[0], args.microbatches, loss_fn=loss_fn)
    stage_module = nn.ModuleList(modules)
    opt = torch.optim.AdamW(attnres.param_groups(stage_module, lr=3e-3, weight_decay=0.1))
    first, last = rank == 0, rank == (n_stages - 1) % world
    times = []
    for step, (x, y) in enumerate(batches):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses = []
        schedule.step(*([x] if first else []), **(dict(target=y, losses=losses) if last else {}))
        opt.step()
        times.append(time.perf_counter() - start)
        if last and (step == 0 or (step + 1) % 10 == 0):
            loss = torch.stack(losses).mean().item()
            print(f"step {step + 1:>4}: pipelined loss {loss:.6f}", flush=True)
    if last and len(times) > 2:
        print(f"mean step time after 2 steps: {1e3 * sum(times[2:]) / len(times[2:]):.2f} ms "
              f"({args.residual}{', stream cache' if cache is not None else ''}, {world} ranks x "
              f"{args.virtual_stages} stages, {args.layers} layers, "
              f"d_model {args.d_model}, batch {args.batch} x {args.seq_len}, "
              f"{args.microbatches} microbatches)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
