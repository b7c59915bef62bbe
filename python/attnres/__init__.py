"""attnres: fused Attention Residuals (depth attention) for PyTorch.

    h = attnres.depth_attention([emb, f1, f2], query, norm_weight)
"""
from . import reference
from .ops import depth_attention

__all__ = ["depth_attention", "reference"]
__version__ = "0.1.0"
