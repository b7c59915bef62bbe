"""Pipeline-parallel training of the example GPT (Block AttnRes) on the CPU.

    torchrun --nproc-per-node 2 examples/pipeline/train_pp.py [--steps 50] [--schedule 1F1B]

Each rank holds half of the transformer blocks as an attnres.pipelining.StreamStage
(the first stage also the embeddings, the last the final read, norm and head);
the stream crosses the stage boundary as its tensors. Rank 0 first computes the
loss of the unsplit model on the first batch, which the pipelined step must
reproduce; the last rank prints the loss as training goes. The corpus is the
demo's (the Python standard library's source files, as bytes).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

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
        self.final_res, self.ln_f, self.head = model.final_res, model.ln_f, model.head

    def forward(self, stream):
        return self.head(self.ln_f(self.final_res(stream)))


def build(args) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=64, n_layers=4, n_heads=4,
                          residual="block", block_size=3))
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
    parser.add_argument("--schedule", choices=("GPipe", "1F1B"), default="1F1B")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2")
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
    half = len(model.blocks) // 2
    # Each block appends 2 outputs (attention, MLP); the boundary falls inside
    # a block of S = 3 sublayers.
    if rank == 0:
        stage_module = attnres.pipelining.StreamStage(model.blocks[:half], outputs_before=0,
                                                      block_size=3, embed=Embed(model))
    else:
        stage_module = attnres.pipelining.StreamStage(model.blocks[half:], outputs_before=2 * half,
                                                      block_size=3, head=Head(model))
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = (ScheduleGPipe if args.schedule == "GPipe" else Schedule1F1B)(
        stage, args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(attnres.param_groups(stage_module, lr=3e-3, weight_decay=0.1))
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
            loss = torch.stack(losses).mean().item()
            if step == 0 or (step + 1) % 10 == 0:
                print(f"step {step + 1:>4}: pipelined loss {loss:.6f}", flush=True)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
