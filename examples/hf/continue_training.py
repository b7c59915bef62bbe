"""Continued training of a transformers decoder converted to Attention Residuals.

    python examples/hf/continue_training.py                   # a tiny Llama, byte-level, CPU
    python examples/hf/continue_training.py --model NAME_OR_PATH --block-size 8

A copy of the model is converted with attnres.hf.convert (zero queries, unit
gains: the original function), then both copies train on the same batches of
the demo's corpus (the Python standard library's source files). Step 0 prints
both losses (equal for a model without dropout, such as the tiny Llama; in
training mode two copies draw different dropout masks), then the curves every
--every steps. Without --model the
model is a tiny random Llama over bytes; with it, a pretrained model and its
tokenizer (transformers downloads them unless given a local path).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import attnres
from attnres.demo import corpus_roots, source_corpus, split_corpus


def tiny_llama() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a transformers causal LM (default: a tiny random Llama)")
    parser.add_argument("--block-size", type=int, default=None, help="sublayers per block (default: Full)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    data = source_corpus(corpus_roots("stdlib"), 2_000_000)
    if args.model:
        original = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        tokens = torch.tensor(tokenizer(data.decode("utf-8", "replace"))["input_ids"])
    else:
        original = tiny_llama()
        tokens, _ = split_corpus(data)
        tokens = tokens.long()
    converted = attnres.hf.convert(copy.deepcopy(original), block_size=args.block_size)

    gen = torch.Generator().manual_seed(1)
    runs = {"original": original, "attnres": converted}
    optimizers = {name: torch.optim.AdamW(attnres.param_groups(m, lr=args.lr, weight_decay=0.1))
                  for name, m in runs.items()}
    print(f"model: {type(original).__name__}, {sum(p.numel() for p in original.parameters()):,} "
          f"parameters; attnres block_size={args.block_size}; {len(tokens):,} tokens", flush=True)
    started = time.perf_counter()
    for step in range(args.steps + 1):
        starts = torch.randint(0, len(tokens) - args.seq_len, (args.batch,), generator=gen)
        idx = tokens[starts[:, None] + torch.arange(args.seq_len)]
        losses = {}
        for name, model in runs.items():
            model.train()
            optimizers[name].zero_grad(set_to_none=True)
            loss = model(idx, labels=idx).loss
            if step < args.steps:  # the last batch is only measured
                loss.backward()
                optimizers[name].step()
            losses[name] = loss.item()
        if step == 0 or step % args.every == 0 or step == args.steps:
            print(f"step {step:>5}: original {losses['original']:.6f}  attnres {losses['attnres']:.6f}"
                  f"  ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
