"""A small PreNorm GPT with a switchable residual: the plain sum ("standard"),
Full AttnRes ("full") or Block AttnRes ("block"). Everything else is the
same in all three, so they can be compared like for like; at zero queries
(as initialised) the AttnRes models compute the standard model's function
(see GPTConfig.prenorm_eps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .modules import AttnResResidual, DepthStream

RESIDUALS = ("standard", "full", "block")
NORMS = ("layernorm", "rmsnorm")


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    residual: str = "standard"
    block_size: int = 2  # sublayers per block; used by residual="block" only
    # The block size counted in layers (Kimi K3's attn_res_block_size): sets
    # block_size = 2 * block_layers (two sublayers a layer).
    block_layers: Optional[int] = None
    # How Block reads run: "auto" | "two_phase" | "one_call" (DepthStream,
    # docs/design.md §10).
    block_reads: str = "auto"
    eps: float = 1e-6  # AttnRes key-norm eps
    # LayerNorm eps, relative to the standard residual sum (see prenorm_eps).
    norm_eps: float = 1e-5
    # Recompute each transformer block in backward (torch.utils.checkpoint).
    checkpoint_blocks: bool = False
    # The pre-norms (and the final norm): "layernorm" or "rmsnorm". With
    # AttnRes and "rmsnorm" each read returns its sublayer's pre-norm itself
    # (AttnResResidual(out_norm="rmsnorm"): the norm fused into the read,
    # docs/design.md §11), so the sublayers have no norm module of their own.
    norm: str = "layernorm"

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {self.residual!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not (0.0 <= self.norm_eps < float("inf")):
            raise ValueError(f"norm_eps must be a finite number >= 0, got {self.norm_eps}")
        if self.block_layers is not None:
            if (self.residual != "block" or isinstance(self.block_layers, bool)
                    or not isinstance(self.block_layers, int) or self.block_layers <= 0):
                raise ValueError(f"block_layers must be a positive int, with residual='block'; got "
                                 f"{self.block_layers!r} with residual={self.residual!r}")
            if self.block_size not in (2, 2 * self.block_layers):  # 2: the default
                raise ValueError(f"block_layers={self.block_layers} means block_size="
                                 f"{2 * self.block_layers}, got block_size={self.block_size}")
            self.block_size = 2 * self.block_layers
        if self.residual == "block" and (
            isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0
        ):
            raise ValueError(
                f"block_size must be a positive int for residual='block', got {self.block_size!r}"
            )

    @property
    def stream_block_size(self) -> Optional[int]:
        return self.block_size if self.residual == "block" else None

    @property
    def num_blocks(self) -> int:
        """Blocks of a Block model's stream: the rows its ``block_storage`` needs."""
        if self.residual != "block":
            raise ValueError("num_blocks is for residual='block'")
        return -(-2 * self.n_layers // self.block_size)

    def sources_read_by(self, sublayer: int) -> int:
        """How many sources the read in front of sublayer ``sublayer`` sees
        (``2 * n_layers`` is the final read); 1 for the standard residual."""
        if self.residual == "standard":
            return 1
        if self.residual == "full":
            return 1 + sublayer
        return 1 + -(-sublayer // self.block_size)  # embedding, block sums, partial sum

    def prenorm_eps(self, sublayer: int) -> float:
        """The LayerNorm eps in front of sublayer ``sublayer`` (``2 * n_layers``:
        the final norm).

        With zero queries a read is the mean of its N sources, and those sum
        to the standard residual stream x (Full: every output; Block: the block
        sums partition them), so the read is x / N. LayerNorm(x / N, eps / N^2)
        equals LayerNorm(x, eps) exactly, so at zero queries Full and Block
        compute the standard model's function. With one eps for all norms, an
        eps of 1e-5 against a read of variance ~5e-6 (0.02-std embeddings
        averaged over 13 sources) would shrink the deep reads instead.
        """
        return self.norm_eps / self.sources_read_by(sublayer) ** 2

    @property
    def fused_norm(self) -> bool:
        """Whether the reads carry the pre-norms (AttnRes with "rmsnorm")."""
        return self.norm == "rmsnorm" and self.residual != "standard"

    def make_prenorm(self, sublayer: int) -> nn.Module:
        """The norm module in front of sublayer ``sublayer`` (``2 * n_layers``:
        the final norm): Identity where the read carries it."""
        eps = self.prenorm_eps(sublayer)
        if self.fused_norm:
            return nn.Identity()
        if self.norm == "rmsnorm":
            return nn.RMSNorm(self.d_model, eps=eps)
        return nn.LayerNorm(self.d_model, eps=eps)

    def make_read(self, sublayer: int) -> AttnResResidual:
        """The AttnRes read in front of sublayer ``sublayer`` (``2 * n_layers``:
        the final read), with the pre-norm fused in when ``fused_norm``."""
        if self.fused_norm:
            return AttnResResidual(self.d_model, eps=self.eps, out_norm="rmsnorm",
                                   out_eps=self.prenorm_eps(sublayer))
        return AttnResResidual(self.d_model, eps=self.eps)


class KVCache:
    """A static key/value cache for decoding: per layer ``[B, H, max_len,
    D / H]`` keys and values (``dtype``: pass the model's; default float32),
    and ``pos`` (an int64 tensor: the tokens seen so far). A forward with the
    cache writes its T tokens at ``pos``, attends to everything before them
    and advances ``pos``: no Python int and no allocation depends on the
    position, so a decode step can be captured in a CUDA graph and replayed.
    The caller keeps ``pos + T <= max_len`` (``pos`` lives on the device:
    checking it would synchronize)."""

    def __init__(self, cfg: "GPTConfig", batch: int, max_len: Optional[int] = None,
                 device=None, dtype=None):
        max_len = cfg.seq_len if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 0 < max_len <= cfg.seq_len:
            raise ValueError(f"max_len must be an int in [1, cfg.seq_len = {cfg.seq_len}] (the "
                             f"position embedding's length), got {max_len!r}")
        shape = (batch, cfg.n_heads, max_len, cfg.d_model // cfg.n_heads)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.max_len = max_len

    def positions(self, T: int) -> torch.Tensor:
        return self.pos + torch.arange(T, device=self.pos.device)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: Optional[tuple] = None) -> torch.Tensor:
        """``cache``: (keys, values, positions of x's tokens) of a KVCache."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys, values, positions = cache
            keys.index_copy_(2, positions, k.to(keys.dtype))
            values.index_copy_(2, positions, v.to(values.dtype))
            # Token i sees cache slots 0 .. positions[i].
            seen = torch.arange(keys.shape[2], device=x.device) <= positions[:, None]
            y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                               attn_mask=seen)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TransformerBlock(nn.Module):
    """Two sublayers (attention, MLP), each with its own pre-norm and, for
    AttnRes, its own depth read in front of that pre-norm."""

    def __init__(self, cfg: GPTConfig, index: int = 0):
        super().__init__()
        self.ln1 = cfg.make_prenorm(2 * index)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = cfg.make_prenorm(2 * index + 1)
        self.mlp = MLP(cfg)
        self.uses_attnres = cfg.residual != "standard"
        if self.uses_attnres:
            self.res_attn = cfg.make_read(2 * index)
            self.res_mlp = cfg.make_read(2 * index + 1)

    def forward(self, x, weights: Optional[list] = None, cache: Optional[tuple] = None):
        """Standard: ``x -> x + attn(...) + mlp(...)``. AttnRes: ``x`` is a
        DepthStream; returns a new stream with this block's two outputs
        appended, leaving ``x`` as it was (the layer contract: wrappers may
        hand the layer a rebuilt stream, checkpointing reruns it on the same
        one); with ``weights`` a list, also appends the depth weights of both
        reads. One entry point, so module hooks (FSDP, ...) see every call.
        ``cache``: this layer's part of a :class:`KVCache` (decoding)."""
        if not self.uses_attnres:
            x = x + self.attn(self.ln1(x), cache)
            return x + self.mlp(self.ln2(x))
        stream = x.clone()
        if weights is None:
            attn_out = self.attn(self.ln1(self.res_attn(stream)), cache)
            stream.append(attn_out)
            mlp_out = self.mlp(self.ln2(self.res_mlp(stream)))
        else:
            h, w = self.res_attn(stream, return_weights=True)
            weights.append(w)
            attn_out = self.attn(self.ln1(h), cache)
            stream.append(attn_out)
            h, w = self.res_mlp(stream, return_weights=True)
            weights.append(w)
            mlp_out = self.mlp(self.ln2(h))
        stream.append(mlp_out)
        return stream


class GPT(nn.Module):
    """Token + position embedding, n_layers PreNorm blocks, final norm, tied head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        if cfg.residual != "standard":
            self.final_res = cfg.make_read(2 * cfg.n_layers)
        self.ln_f = cfg.make_prenorm(2 * cfg.n_layers)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style; AttnRes queries/gains keep their own init (zeros/ones).
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=out_std)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied head counted once

    def embed(self, idx: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(positions)

    def forward(
        self,
        idx: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        return_depth_weights: bool = False,
        *,
        kv_cache: Optional[KVCache] = None,
        block_storage: Optional[torch.Tensor] = None,
    ):
        """Returns ``(logits, loss)`` (loss None without targets). With
        ``return_depth_weights`` (AttnRes only) returns ``(logits, loss,
        weights)``: one float32 tensor [num_sources, B, T] per read, in
        order attn_0, mlp_0, ..., attn_{L-1}, mlp_{L-1}, final.

        ``kv_cache`` (decoding): ``idx`` holds the next tokens after the
        cache's ``pos``; their keys and values join the cache and ``pos``
        advances. ``block_storage`` (Block, inference): the stream's
        completed block sums are written into its rows (DepthStream's
        block_storage; shape ``[cfg.num_blocks, B, T, d_model]``)."""
        positions = None if kv_cache is None else kv_cache.positions(idx.shape[1])
        x = self.embed(idx, positions)
        weights: Optional[List[torch.Tensor]] = None
        caches = [None] * len(self.blocks)
        if kv_cache is not None:
            caches = [(k, v, positions) for k, v in zip(kv_cache.keys, kv_cache.values)]
        if self.cfg.residual == "standard":
            if return_depth_weights:
                raise ValueError("return_depth_weights needs residual='full' or 'block'")
            if block_storage is not None:
                raise ValueError("block_storage needs residual='block'")
            for blk, cache in zip(self.blocks, caches):
                if self.cfg.checkpoint_blocks and self.training and cache is None:
                    x = checkpoint(blk, x, use_reentrant=False)
                else:
                    x = blk(x, cache=cache)
        else:
            readers = self.readers()
            if not all(isinstance(r, AttnResResidual) for r in readers):
                readers = None  # reads swapped for other modules: each reads on its own
            stream = DepthStream(x, block_size=self.cfg.stream_block_size,
                                 block_reads=self.cfg.block_reads, readers=readers,
                                 block_storage=block_storage)
            weights = [] if return_depth_weights else None
            for blk, cache in zip(self.blocks, caches):
                if (self.cfg.checkpoint_blocks and self.training and weights is None
                        and cache is None):
                    stream = checkpoint(blk, stream, use_reentrant=False)
                else:
                    stream = blk(stream, weights, cache)
            if weights is None:
                x = self.final_res(stream)
            else:
                x, w = self.final_res(stream, return_weights=True)
                weights.append(w)
        logits = self.head(self.ln_f(x))
        if kv_cache is not None:
            kv_cache.pos.add_(idx.shape[1])
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if return_depth_weights:
            return logits, loss, weights
        return logits, loss

    def readers(self) -> List[nn.Module]:
        """The depth reads in forward order (what the stream's ``readers``
        declares): attn_0, mlp_0, ..., attn_{L-1}, mlp_{L-1}, final."""
        reads = [r for blk in self.blocks for r in (blk.res_attn, blk.res_mlp)]
        return reads + [self.final_res]

    def read_names(self) -> List[str]:
        """Names of the depth reads, in the order of the returned weights."""
        names = []
        for i in range(self.cfg.n_layers):
            names += [f"L{i}.attn", f"L{i}.mlp"]
        return names + ["final"]

    def source_names(self) -> List[str]:
        """Names of the source slots (source i is always slot i)."""
        sublayers = self.read_names()[:-1]
        if self.cfg.residual != "block":
            return ["emb"] + sublayers
        S = self.cfg.block_size
        names = ["emb"]
        for b, first in enumerate(range(0, len(sublayers), S)):
            members = sublayers[first : first + S]
            span = members[0] if len(members) == 1 else f"{members[0]}..{members[-1]}"
            names.append(f"block {b + 1}\n{span}")
        return names

