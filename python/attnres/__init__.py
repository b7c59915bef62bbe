"""attnres: fused Attention Residuals (depth attention) for PyTorch.

    h = attnres.depth_attention([emb, f1, f2], query, norm_weight)

    stream = attnres.DepthStream(emb, block_size=None)   # or S for Block AttnRes
    h = attnres.AttnResResidual(D)(stream)
"""
from ._version import __version__
from . import reference
from .ops import (block_read_merge, block_reads, cpu_gradient_cache_stats, depth_attention,
                  empty_cpu_gradient_cache, set_cpu_gradient_cache_limit)
from .modules import AttnResResidual, DepthStream, StreamSpec, checkpoint
from . import hf, models, pipelining
from .optim import param_groups

__all__ = ["depth_attention", "block_reads", "block_read_merge", "reference", "DepthStream", "AttnResResidual",
           "StreamSpec", "checkpoint",
           "hf", "models", "pipelining", "param_groups", "cpu_gradient_cache_stats", "set_cpu_gradient_cache_limit",
           "empty_cpu_gradient_cache"]
