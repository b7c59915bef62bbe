"""Python side of the torch ops: fake (meta) kernels for torch.compile and
the public functional API (autograd is registered in C++, csrc/autograd/).

The kernels live in C++ (csrc/); importing this module loads them. The C++
checks (csrc/arguments.cpp) are the only checks of an eager call. While
tracing, the fake kernels check what a trace depends on, the tensors'
shapes, dtypes, devices and layouts, output_mask's length and the in-place
merge's memory overlap, with the C++ words for any one bad argument; the
numbers (eps, scale, out_eps) are checked by the real op when the traced
program runs.
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Union

import torch

from . import _C  # registers torch.ops.attnres.*; direct calls of four ops (_call)

_SUPPORTED = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_REDUCED = (torch.bfloat16, torch.float16)
# lse and its gradient are float64 for every source dtype (csrc/block_reads.cpp
# kLseDtype): the gradient the merge sends to phase 1 can exceed float32's range
# where the read's own gradients do not (docs/design.md §10, "Range").
_LSE_DTYPE = torch.float64


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- fake kernels: the trace's checks -----------------------------------------

def _check_dense(t: torch.Tensor, name: str) -> None:
    """csrc/arguments.cpp check_dense: nested and sparse tensors refused with
    the argument's name (not an internal error from their missing strides)."""
    if t.is_nested:
        raise ValueError(
            f"{name} is a nested tensor: depth_attention takes dense (strided) tensors; "
            "pass the components one by one or pad them"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}: depth_attention takes dense (strided) tensors")


def _expect(t, name: str, shape, dtype: torch.dtype, device: torch.device,
            owner: Optional[str] = None) -> None:
    """The one tensor check, csrc/arguments.cpp check_stat (owner None) and
    check_like (owner "the sources'" / "block_sum's": the shape, dtype and
    device of that tensor)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor")
    _check_dense(t, name)
    of = f"{owner} " if owner else ""
    if list(t.shape) != list(shape):
        raise ValueError(f"{name} must have {of}shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have {of}dtype {dtype}, got {t.dtype}")
    if t.device != device:
        where = owner or "the sources'"
        raise ValueError(f"{name} must be on {where} device")


def _check_parameter(p, name: str, src0: torch.Tensor, D: int) -> None:
    """query, norm_weight, out_weight: [D], the sources' dtype or float32 with
    bf16/fp16 sources, the sources' device (csrc/arguments.cpp check_parameter)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape [D] = [{D}], got {type(p).__name__}")
    _check_dense(p, name)
    if p.dim() != 1 or p.shape[0] != D:
        raise ValueError(f"{name} must have shape [D] = [{D}], got {list(p.shape)}")
    if not (p.dtype == src0.dtype or (p.dtype == torch.float32 and src0.dtype in _REDUCED)):
        raise TypeError(
            f"{name} must have the sources' dtype ({src0.dtype}) or float32 when the sources "
            f"are bfloat16/float16, got {p.dtype}"
        )
    if p.device != src0.device:
        raise ValueError(f"{name} is on device {p.device} but the sources are on device {src0.device}")


def check_args(sources, query, norm_weight, out_weight=None) -> torch.Tensor:
    """The sources and parameters, as csrc/arguments.cpp check_forward_args
    and check_out_norm_args (without their numbers); returns sources[0]."""
    if len(sources) == 0:
        raise ValueError("sources must be a non-empty list of tensors [..., D]")
    src0 = sources[0]
    _check_dense(src0, "sources[0]")
    if src0.dim() < 1:
        raise ValueError("sources must have at least one dimension [..., D], got a 0-dim tensor")
    if src0.dtype not in _SUPPORTED:
        raise TypeError(f"sources must be float64, float32, bfloat16 or float16, got {src0.dtype}")
    D = src0.shape[-1]
    if D == 0:
        raise ValueError(f"sources must have a non-zero last dimension D, got shape {list(src0.shape)}")
    for i, s in enumerate(sources[1:], start=1):
        _check_dense(s, f"sources[{i}]")
        if s.shape != src0.shape:
            raise ValueError(
                f"sources[{i}] has shape {list(s.shape)} but sources[0] has shape "
                f"{list(src0.shape)}: all sources must have the same shape"
            )
        if s.dtype != src0.dtype:
            raise TypeError(
                f"sources[{i}] has dtype {s.dtype} but sources[0] has dtype {src0.dtype}: "
                "all sources must have the same dtype"
            )
        if s.device != src0.device:
            raise ValueError(
                f"sources[{i}] is on device {s.device} but sources[0] is on device "
                f"{src0.device}: all sources must be on the same device"
            )
    _check_parameter(query, "query", src0, D)
    if norm_weight is not None:
        _check_parameter(norm_weight, "norm_weight", src0, D)
    if out_weight is not None:
        _check_parameter(out_weight, "out_weight", src0, D)
    return src0


def _check_mask(output_mask, expected: int, what: str) -> None:
    if len(output_mask) != expected:
        raise ValueError(f"output_mask must have {expected} entries ({what}), got {len(output_mask)}")


def _empty_like_rows(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _out_norm_outputs(out_weight, keep_h, like: torch.Tensor):
    """The output norm's statistics a forward returns (h, out_rstd): empty
    tensors without out_weight, as the C++ host sequence allocates them."""
    if out_weight is None:
        return like.new_empty((0,)), like.new_empty((0,), dtype=_acc_dtype(like.dtype))
    h = _empty_like_rows(like) if keep_h else like.new_empty((0,))
    return h, like.new_empty(like.shape[:-1], dtype=_acc_dtype(like.dtype))


def _parameter_grads(output_mask, n, query, norm_weight, out_weight):
    """The query, gain and out_weight gradients a backward fake returns."""
    gain_dtype = norm_weight.dtype if norm_weight is not None else query.dtype
    grad_query = torch.empty_like(query) if output_mask[n] else None
    grad_gain = query.new_empty(query.shape, dtype=gain_dtype) if output_mask[n + 1] else None
    grad_out_weight = (torch.empty_like(out_weight)
                       if out_weight is not None and output_mask[n + 2] else None)
    return grad_query, grad_gain, grad_out_weight


def _source_grads(sources, output_mask):
    """The wanted source gradients only, in source order."""
    return [_empty_like_rows(s) for i, s in enumerate(sources) if output_mask[i]]


def _prefix_sum_output(delta, like, owner: str) -> torch.Tensor:
    """The fused prefix add's P' output (csrc: check_like of delta): the rows
    of ``like`` (the sum P), or an empty tensor without delta."""
    if delta is None:
        return like.new_empty((0,))
    _expect(delta, "delta", like.shape, like.dtype, like.device, owner)
    return _empty_like_rows(like)


@torch.library.register_fake("attnres::depth_attention_fwd")
def _depth_attention_fwd_fake(sources, query, norm_weight, eps, scale, out_weight=None,
                              out_eps=None, keep_h=False, delta=None):
    src0 = check_args(sources, query, norm_weight, out_weight)
    sum_out = _prefix_sum_output(delta, sources[-1], "the last source's")
    stat_shape, acc = (len(sources), *src0.shape[:-1]), _acc_dtype(src0.dtype)
    return (_empty_like_rows(src0), src0.new_empty(stat_shape, dtype=acc),
            src0.new_empty(stat_shape, dtype=acc), *_out_norm_outputs(out_weight, keep_h, src0),
            sum_out)


@torch.library.register_fake("attnres::depth_attention_bwd")
def _depth_attention_bwd_fake(grad_out, grad_weights, sources, query, norm_weight, h, rstd,
                              weights, scale, output_mask, out_weight=None, out_rstd=None,
                              grad_prefix_out=None):
    # csrc/arguments.cpp check_backward_args's order.
    src0 = check_args(sources, query, norm_weight)
    N, lead, acc = len(sources), list(src0.shape[:-1]), _acc_dtype(src0.dtype)
    rows = (src0.shape, src0.dtype, src0.device, "the sources'")
    if grad_out is not None:
        _expect(grad_out, "grad_out", *rows)
    _expect(h, "h (the forward's read)", *rows)
    for name, t in (("rstd", rstd), ("weights", weights), ("grad_weights", grad_weights)):
        if t is not None or name != "grad_weights":
            _expect(t, name, [N, *lead], acc, src0.device)
    extra = 3 if out_weight is not None else 2
    if len(output_mask) != N + extra:
        what = "query, norm_weight, out_weight" if out_weight is not None else "query, norm_weight"
        raise ValueError(
            f"output_mask must have N + {extra} = {N + extra} entries (each source, "
            f"{what}), got {len(output_mask)}"
        )
    if out_weight is not None:
        _check_parameter(out_weight, "out_weight", src0, src0.shape[-1])
        _expect(out_rstd, "out_rstd", lead, acc, src0.device)
    if grad_prefix_out is not None:
        _expect(grad_prefix_out, "grad_prefix_out", *rows[:3], "the last source's")
    return (_source_grads(sources, output_mask),
            *_parameter_grads(output_mask, N, query, norm_weight, out_weight))


def _check_block_reads_args(sources, queries, norm_weights) -> torch.Tensor:
    """csrc/block_reads.cpp check_block_reads_args: queries [S, D],
    norm_weights of their shape, then the sources and reader 0's parameters."""
    if not isinstance(queries, torch.Tensor):
        raise ValueError("queries must be a tensor [S, D]")
    _check_dense(queries, "queries")
    if queries.dim() != 2 or queries.shape[0] < 1:
        raise ValueError(
            f"queries must have shape [S, D] (one query per reader, S >= 1), got {list(queries.shape)}"
        )
    if len(sources) > 0 and sources[0].dim() >= 1 and queries.shape[1] != sources[0].shape[-1]:
        raise ValueError(f"queries must have shape [S, D] = [{queries.shape[0]}, "
                         f"{sources[0].shape[-1]}], got {list(queries.shape)}")
    if norm_weights is not None:
        _check_dense(norm_weights, "norm_weights")
        if norm_weights.shape != queries.shape:
            raise ValueError(f"norm_weights must have the queries' shape {list(queries.shape)}, "
                             f"got {list(norm_weights.shape)}")
    return check_args(sources, queries[0], None if norm_weights is None else norm_weights[0])


def _check_out_norm_bwd(out_weight, h, out_rstd, like, owner) -> None:
    """csrc/block_reads.cpp check_out_norm_bwd_args."""
    _check_parameter(out_weight, "out_weight", like, like.shape[-1])
    _expect(h, "h (the forward's read before the output norm)", like.shape, like.dtype,
            like.device, owner)
    _expect(out_rstd, "out_rstd", like.shape[:-1], _acc_dtype(like.dtype), like.device)


@torch.library.register_fake("attnres::block_reads_fwd")
def _block_reads_fwd_fake(sources, queries, norm_weights, eps, scale, out_weight=None,
                          out_eps=None, keep_h=False):
    src0 = _check_block_reads_args(sources, queries, norm_weights)
    if out_weight is not None:
        _check_parameter(out_weight, "out_weight", src0, src0.shape[-1])
    S, N, lead, acc = queries.shape[0], len(sources), tuple(src0.shape[:-1]), _acc_dtype(src0.dtype)
    return ([_empty_like_rows(src0) for _ in range(S)], src0.new_empty((S, *lead), dtype=_LSE_DTYPE),
            src0.new_empty((N, *lead), dtype=acc), src0.new_empty((S, N, *lead), dtype=acc),
            *_out_norm_outputs(out_weight, keep_h, src0))


@torch.library.register_fake("attnres::block_reads_bwd")
def _block_reads_bwd_fake(grad_partial_outs, grad_lse, sources, queries, norm_weights, rstd,
                          weights, scale, output_mask, out_weight=None, h=None, out_rstd=None):
    # csrc/block_reads.cpp run_block_reads_bwd's order.
    src0 = _check_block_reads_args(sources, queries, norm_weights)
    S, N, lead, acc = queries.shape[0], len(sources), list(src0.shape[:-1]), _acc_dtype(src0.dtype)
    if len(grad_partial_outs) not in (0, S):
        raise ValueError(
            f"grad_partial_outs must hold S = {S} tensors (or none), got {len(grad_partial_outs)}"
        )
    for g in grad_partial_outs:
        _expect(g, "grad_partial_outs", src0.shape, src0.dtype, src0.device, "the sources'")
    if grad_lse is not None:
        _expect(grad_lse, "grad_lse", [S, *lead], _LSE_DTYPE, src0.device)
    _expect(rstd, "rstd", [N, *lead], acc, src0.device)
    _expect(weights, "weights", [S, N, *lead], acc, src0.device)
    if out_weight is not None:
        _check_out_norm_bwd(out_weight, h, out_rstd, src0, "the sources'")
        _check_mask(output_mask, N + 3, "each source, queries, norm_weights, out_weight")
    else:
        _check_mask(output_mask, N + 2, "each source, queries, norm_weights")
    return (_source_grads(sources, output_mask),
            *_parameter_grads(output_mask, N, queries, norm_weights, out_weight))


def _check_merge_args(partial_out, lse, block_sum, query, norm_weight, out_weight) -> None:
    """csrc/block_reads.cpp check_merge_args, then the output norm's weight."""
    if not isinstance(block_sum, torch.Tensor):
        raise ValueError("block_sum must be a tensor [..., D]")
    check_args([block_sum], query, norm_weight)
    _expect(partial_out, "partial_out", block_sum.shape, block_sum.dtype, block_sum.device,
            "block_sum's")
    _expect(lse, "lse", block_sum.shape[:-1], _LSE_DTYPE, block_sum.device)
    if out_weight is not None:
        _check_parameter(out_weight, "out_weight", block_sum, block_sum.shape[-1])


@torch.library.register_fake("attnres::block_read_merge_fwd")
def _block_read_merge_fwd_fake(partial_out, lse, block_sum, query, norm_weight, eps, scale,
                               out_weight=None, out_eps=None, keep_h=False, delta=None):
    _check_merge_args(partial_out, lse, block_sum, query, norm_weight, out_weight)
    sum_out = _prefix_sum_output(delta, block_sum, "block_sum's")
    lead, acc = block_sum.shape[:-1], _acc_dtype(block_sum.dtype)
    return (_empty_like_rows(block_sum), block_sum.new_empty(lead, dtype=acc),
            block_sum.new_empty(lead, dtype=acc), *_out_norm_outputs(out_weight, keep_h, block_sum),
            sum_out)


@torch.library.register_fake("attnres::block_read_merge_bwd")
def _block_read_merge_bwd_fake(grad_out, partial_out, block_sum, query, norm_weight, rstd, weight,
                               scale, output_mask, out_weight=None, h=None, out_rstd=None,
                               grad_block_sum_out=None):
    # csrc/block_reads.cpp run_block_read_merge_bwd's order.
    if not isinstance(block_sum, torch.Tensor):
        raise ValueError("block_sum must be a tensor [..., D]")
    check_args([block_sum], query, norm_weight)
    rows = (block_sum.shape, block_sum.dtype, block_sum.device, "block_sum's")
    _expect(grad_out, "grad_out", *rows)
    _expect(partial_out, "partial_out", *rows)
    if grad_block_sum_out is not None:
        _expect(grad_block_sum_out, "grad_block_sum_out", *rows)
    if out_weight is not None:
        _check_out_norm_bwd(out_weight, h, out_rstd, block_sum, "block_sum's")
    lead, acc = block_sum.shape[:-1], _acc_dtype(block_sum.dtype)
    _expect(rstd, "rstd", lead, acc, block_sum.device)
    _expect(weight, "weight", lead, acc, block_sum.device)
    if out_weight is not None:
        _check_mask(output_mask, 6, "partial_out, lse, block_sum, query, norm_weight, out_weight")
    else:
        _check_mask(output_mask, 5, "partial_out, lse, block_sum, query, norm_weight")
    return (
        _empty_like_rows(block_sum) if output_mask[0] else None,
        block_sum.new_empty(lead, dtype=_LSE_DTYPE) if output_mask[1] else None,
        _empty_like_rows(block_sum) if output_mask[2] else None,
        *_parameter_grads([*output_mask[3:]], 0, query, norm_weight, out_weight),
    )


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte spans in one storage intersect (csrc/block_reads.cpp
    shares_memory)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    a0 = a.storage_offset() * a.element_size()
    b0 = b.storage_offset() * b.element_size()
    extent = 1 + sum((n - 1) * st for n, st in zip(b.shape, b.stride()))
    return a0 < b0 + extent * b.element_size() and b0 < a0 + a.numel() * a.element_size()


@torch.library.register_fake("attnres::block_read_merge_inplace")
def _block_read_merge_inplace_fake(partial_out, lse, block_sum, query, norm_weight, eps, scale,
                                   out_weight=None, out_eps=None, delta=None):
    # The memory checks too (csrc/block_reads.cpp check_merge_in_place): a
    # functionalized trace runs the op on a copy of partial_out, where an
    # input that overlaps it would no longer be seen.
    _check_merge_args(partial_out, lse, block_sum, query, norm_weight, out_weight)
    sum_out = _prefix_sum_output(delta, block_sum, "block_sum's")
    if not partial_out.is_contiguous():
        raise ValueError("partial_out must be contiguous for block_read_merge_inplace (the read is "
                         "written into it)")
    for name, t in (("block_sum", block_sum), ("lse", lse), ("query", query),
                    ("norm_weight", norm_weight), ("out_weight", out_weight), ("delta", delta)):
        if t is None:
            continue
        if t is partial_out:
            raise ValueError(f"partial_out and {name} must be different tensors")
        if _shares_memory(partial_out, t):
            raise RuntimeError(
                f"{name} shares memory with partial_out (some of their elements refer to a single "
                f"memory location), which block_read_merge_inplace overwrites while it reads "
                f"{name}: pass a tensor apart from it")
    return sum_out


# ---- the functional API ---------------------------------------------------------
# Autograd of these ops is registered in C++ (csrc/autograd/), so C++ callers
# get gradients too.


# ---- vmap (torch.vmap / torch.func) -------------------------------------------
# The ops treat every leading dimension as tokens, so a read vmapped over its
# sources alone is the same read with the batch as one more token dimension:
# one call. Anything else batched (a query, a gain, a backward's inputs) runs
# the op once per batch element and stacks the results.


def _slice(arg, dim, b):
    if dim is None:
        return arg
    if isinstance(arg, (list, tuple)):
        return [_slice(a, d, b) for a, d in zip(arg, dim)]
    return arg.select(dim, b)


def _vmap_by_elements(op):
    def rule(info, in_dims, *args, **kwargs):
        results = [op(*(_slice(a, d, b) for a, d in zip(args, in_dims)), **kwargs)
                   for b in range(info.batch_size)]
        stacked = torch.utils._pytree.tree_map(
            lambda *xs: None if xs[0] is None else torch.stack(xs), *results)
        return stacked, torch.utils._pytree.tree_map(lambda x: None if x is None else 0, stacked)
    return rule


def _depth_attention_fwd_vmap(info, in_dims, sources, query, norm_weight, eps, scale,
                              out_weight=None, out_eps=None, keep_h=False, delta=None):
    args = (sources, query, norm_weight, eps, scale, out_weight, out_eps, keep_h, delta)
    if any(d is not None for d in torch.utils._pytree.tree_leaves(in_dims[1:])):
        return _vmap_by_elements(torch.ops.attnres.depth_attention_fwd.default)(
            info, (*in_dims, *[None] * (len(args) - len(in_dims))), *args)
    B = info.batch_size
    sources = [s.expand(B, *s.shape) if d is None else s.movedim(d, 0)
               for s, d in zip(sources, in_dims[0] or [None] * len(sources))]
    if delta is not None:  # unbatched here: the batched sources' P' is batched
        delta = delta.expand(B, *delta.shape)
    outs = torch.ops.attnres.depth_attention_fwd(sources, *args[1:-1], delta)
    # out [B, ...]; rstd and weights [N, B, ...]; h and out_rstd are empty ([0])
    # unless the output norm produces them, P' unless delta is given.
    normed = out_weight is not None
    return outs, (0, 1, 1, 0 if normed and keep_h else None, 0 if normed else None,
                  0 if delta is not None else None)


def _merge_inplace_vmap(info, in_dims, partial_out, *rest):
    # Each batch element's read is written into its own slice of partial_out.
    if in_dims[0] is None:
        raise ValueError("block_read_merge_inplace under vmap: partial_out must be batched "
                         "(each batch element's read is written into it)")
    sums = [torch.ops.attnres.block_read_merge_inplace(
                partial_out.select(in_dims[0], b),
                *(_slice(a, d, b) for a, d in zip(rest, in_dims[1:])))
            for b in range(info.batch_size)]
    if sums[0].numel() == 0:  # no delta: the empty P'
        return sums[0], None
    return torch.stack(sums), 0


torch.library.register_vmap("attnres::depth_attention_fwd", _depth_attention_fwd_vmap)
torch.library.register_vmap("attnres::block_read_merge_inplace", _merge_inplace_vmap)
for _name in ("depth_attention_bwd", "block_reads_fwd", "block_reads_bwd", "block_read_merge_fwd",
              "block_read_merge_bwd"):
    torch.library.register_vmap(f"attnres::{_name}",
                                _vmap_by_elements(getattr(torch.ops.attnres, _name).default))


def _as_float(value, name: str) -> float:
    """eps/scale as the op's float, or a TypeError that names the argument
    (None, a string, a tensor: never a bare comparison error later)."""
    if type(value) is float:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _as_floats(eps, scale, out_eps) -> tuple:
    """eps, scale and out_eps (the op's ``float?``: None follows eps) as the
    op's floats; one test in the common case (a decode-sized read is
    host-bound)."""
    if type(eps) is float and type(scale) is float and (out_eps is None or type(out_eps) is float):
        return eps, scale, out_eps
    return (_as_float(eps, "eps"), _as_float(scale, "scale"),
            None if out_eps is None else _as_float(out_eps, "out_eps"))


_is_compiling = torch.compiler.is_compiling


def _call(name: str, outputs: int, *args):
    """torch.ops.attnres.<name>(*args), through _C's direct call of the op
    where it takes the arguments as they are (plain tensors, no torch
    function mode; it returns NotImplemented otherwise), outside
    torch.compile: the op and the dispatcher are the same, without the
    boxed call's argument parsing (about as long as a T = 1 read, §12).
    ``outputs``: a bit mask of the results the caller uses (bit i: result
    i); the direct call returns None for the others."""
    if not _is_compiling():
        result = getattr(_C, name)(*args, outputs=outputs)
        if result is not NotImplemented:
            return result
    return getattr(torch.ops.attnres, name)(*args)


def _explain_not_implemented(sources, query, norm_weight, out_weight, delta) -> None:
    for i, s in enumerate(sources):
        if isinstance(s, torch.Tensor):
            _check_dense(s, f"sources[{i}]")
    for name, t in (("query", query), ("norm_weight", norm_weight), ("out_weight", out_weight),
                    ("delta", delta)):
        if isinstance(t, torch.Tensor):
            _check_dense(t, name)


def depth_attention(
    sources: Union[Sequence[torch.Tensor], torch.Tensor],
    query: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    return_weights: bool = False,
    out_weight: Optional[torch.Tensor] = None,
    out_eps: Optional[float] = None,
    delta: Optional[torch.Tensor] = None,
):
    """Fused depth attention over ``sources`` (docs/design.md §1).

    sources: a sequence of N >= 1 tensors [..., D] (same shape, dtype and
    device; never copied into a stack), or one tensor [N, ..., D].
    query: [D]; norm_weight: [D] or None (no gain). With bf16/fp16 sources the
    query and gain may be fp32. Returns h [..., D] in the sources' dtype, and
    with ``return_weights`` also the softmax weights [N, ...] as float32
    (differentiable: a loss on them reaches the sources, query and gain
    through the same fused backward).

    With ``out_weight`` ([D], like the query) the read returns
    ``RMSNorm(h) * out_weight`` (eps ``out_eps``, which is ``eps`` unless
    given) instead of h, the norm fused into the read's kernels
    (docs/design.md §11): the sublayer after it needs no pre-norm of its
    own.

    With ``delta`` (the fused prefix add, §12) the last source is a partial
    block sum P and the read is over ``P + delta`` (rounded as
    ``torch.add``), formed in the read; ``block_sum + delta`` is then
    returned last (``(out, P')`` or ``(out, weights, P')``), and its gradient
    reaches P and ``delta``.
    """
    if type(sources) is not list:
        if isinstance(sources, torch.Tensor):
            if sources.dim() < 2:
                raise ValueError("a stacked sources tensor must have shape [N, ..., D], got "
                                 f"{list(sources.shape)}")
            sources = sources.unbind(0)
        sources = list(sources)
    eps, scale, out_eps = _as_floats(eps, scale, out_eps)
    # The op checks everything else, once, in C++.
    try:
        # With out_weight, h is kept for the backward by the op's autograd
        # when it records. outputs: results 0 (out), 2 (weights) and 5 (P')
        # as used.
        result = _call("depth_attention_fwd",
                       1 | (4 if return_weights else 0) | (0 if delta is None else 32),
                       sources, query, norm_weight, eps, scale, out_weight, out_eps, False, delta)
    except NotImplementedError:
        # No kernel for this kind of tensor (sparse, jagged nested, another
        # subclass): name the argument. Only on this failure path.
        _explain_not_implemented(sources, query, norm_weight, out_weight, delta)
        raise
    if return_weights:
        weights = result[2].to(torch.float32)
        return (result[0], weights) if delta is None else (result[0], weights, result[5])
    return result[0] if delta is None else (result[0], result[5])


# ---- two-phase Block reads (docs/design.md §10) ------------------------------
# CPU kernels (csrc/cpu/block_reads_cpu.cpp) and CUDA kernels
# (csrc/cuda/block_kernels.cuh) for all of them. Autograd in C++
# (csrc/autograd/block_reads.cpp), like the ops above.


def block_read_merge_inplace(partial_out: torch.Tensor, lse: torch.Tensor,
                             block_sum: torch.Tensor, query: torch.Tensor,
                             norm_weight: Optional[torch.Tensor] = None, *, eps: float = 1e-6,
                             scale: float = 1.0, out_weight: Optional[torch.Tensor] = None,
                             out_eps: Optional[float] = None,
                             delta: Optional[torch.Tensor] = None):
    """Phase 2 without autograd (inference, docs/design.md §10): h is written
    into ``partial_out`` (contiguous; the phase-1 output this read consumes)
    and returned, so the read allocates no new output. With ``out_weight``
    it is ``RMSNorm(h) * out_weight`` (eps ``out_eps``, which is ``eps``
    unless given; fused, §11) that is written. With ``delta`` (the fused
    prefix add, §12) the read's block sum is ``block_sum + delta``, formed
    in the read, and ``(partial_out, block_sum + delta)`` is returned. No
    input may share memory with ``partial_out``. Raises when a gradient is
    wanted. CPU and CUDA."""
    eps, scale, out_eps = _as_floats(eps, scale, out_eps)
    new_sum = _call("block_read_merge_inplace", 1, partial_out, lse, block_sum, query, norm_weight,
                    eps, scale, out_weight, out_eps, delta)
    return partial_out if delta is None else (partial_out, new_sum)


def block_reads(sources: Sequence[torch.Tensor], queries: torch.Tensor,
                norm_weights: Optional[torch.Tensor] = None, *, eps: float = 1e-6,
                scale: float = 1.0, out_weight: Optional[torch.Tensor] = None,
                out_eps: Optional[float] = None):
    """Phase 1 of a two-phase Block read (docs/design.md §10): the completed
    ``sources`` read once for the S readers of a block (``queries`` [S, D],
    ``norm_weights`` [S, D] or None). Returns ``(partial_outs, lse)``: S
    tensors [..., D] (each reader's softmax-weighted average over the
    sources, its h when the block has no partial sum yet) and the
    log-sum-exp of each reader's scores [S, ...] (float64 for every source
    dtype: its gradient can exceed float32's range, docs/design.md §10).
    With ``out_weight`` (reader 0's output norm, §11) ``partial_outs[0]`` is
    ``RMSNorm(h_0) * out_weight`` (eps ``out_eps``, which is ``eps`` unless
    given): reader 0's read, which has no partial sum to merge.
    Differentiable on CPU and CUDA."""
    # With out_weight, h_0 is kept for the backward by the op's autograd
    # when it records.
    eps, scale, out_eps = _as_floats(eps, scale, out_eps)
    partial_outs, lse, _rstd, _weights, _h, _out_rstd = _call(
        "block_reads_fwd", 3, list(sources), queries, norm_weights,  # results 0 and 1
        eps, scale, out_weight, out_eps, False)
    return list(partial_outs), lse


def block_read_merge(partial_out: torch.Tensor, lse: torch.Tensor, block_sum: torch.Tensor,
                     query: torch.Tensor, norm_weight: Optional[torch.Tensor] = None, *,
                     eps: float = 1e-6, scale: float = 1.0,
                     out_weight: Optional[torch.Tensor] = None,
                     out_eps: Optional[float] = None, delta: Optional[torch.Tensor] = None):
    """Phase 2 (docs/design.md §10): one reader's h from its phase-1
    ``partial_out`` and ``lse`` and the partial ``block_sum``; equal to
    :func:`depth_attention` over the completed sources and ``block_sum``.
    With ``out_weight`` it returns ``RMSNorm(h) * out_weight`` (eps
    ``out_eps``, which is ``eps`` unless given), the norm fused into the
    merge (§11), as :func:`depth_attention` does with ``out_weight``.
    With ``delta`` (the fused prefix add, §12) the read's block sum is
    ``block_sum + delta`` (rounded as ``torch.add``), formed in the read,
    and ``(out, block_sum + delta)`` is returned; its gradient reaches
    ``block_sum`` and ``delta``. Differentiable on CPU and CUDA."""
    # With out_weight, h is kept for the backward by the op's autograd when
    # it records.
    eps, scale, out_eps = _as_floats(eps, scale, out_eps)
    result = _call("block_read_merge_fwd", 1 if delta is None else 33,  # out and P'
                   partial_out, lse, block_sum, query, norm_weight, eps, scale, out_weight, out_eps,
                   False, delta)
    return result[0] if delta is None else (result[0], result[5])


# --------------------------------------------------------------------------- CPU gradient cache

_CACHE_STAT_NAMES = ("limit_bytes", "cached_bytes", "cached_blocks", "in_use_bytes", "hits",
                     "misses")


def cpu_gradient_cache_stats() -> dict:
    """The CPU gradient cache's state: ``limit_bytes`` (most bytes of freed
    gradient blocks kept), ``cached_bytes`` / ``cached_blocks`` (kept now),
    ``in_use_bytes`` (handed out, not freed yet), ``hits`` / ``misses``
    (allocations served by a kept block / by the system allocator).

    The backward ops take their large (>= 1 MiB) CPU gradient outputs from
    this cache, and the forward ops their read outputs (h, y, partial
    outputs), so a loop does not fault them in from the OS every
    step (glibc returns freed blocks of many MiB to it). Default limit 1 GiB,
    ``ATTNRES_CPU_GRAD_CACHE_MB`` at the first use; 0 turns it off."""
    return dict(zip(_CACHE_STAT_NAMES, torch.ops.attnres.cpu_gradient_cache_stats()))


def set_cpu_gradient_cache_limit(limit_bytes: int) -> None:
    """Keep at most ``limit_bytes`` of freed CPU gradient blocks (0: off);
    blocks beyond the new limit are returned to the system now."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, numbers.Integral):
        raise TypeError(f"limit_bytes must be an int, got {type(limit_bytes).__name__}")
    if limit_bytes < 0:
        raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
    torch.ops.attnres.set_cpu_gradient_cache_limit(int(limit_bytes))


def empty_cpu_gradient_cache() -> None:
    """Return every kept (freed) CPU gradient block to the system; gradients
    in use are not affected."""
    torch.ops.attnres.empty_cpu_gradient_cache()
