"""attnres._C's direct calls of the decode-step reads (depth_attention_fwd,
block_reads_fwd, block_read_merge_fwd, block_read_merge_inplace): the same op through the
same dispatcher as torch.ops.attnres, so the same results, gradients and
errors; NotImplemented for arguments __torch_function__ may handle, and
never used while torch.compile traces (python/attnres/ops.py _call)."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

import attnres
from attnres import _C
from attnres import ops as ops_mod

from helpers import param_dtype


def problem(dtype=torch.float32, T=3, D=40, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]
    pd = param_dtype(dtype)
    q = (torch.randn(D, generator=g, dtype=torch.float64) / D ** 0.5).to(pd)
    w = (torch.rand(D, generator=g, dtype=torch.float64) + 0.5).to(pd)
    return src, q, w


def merge_args(src, q, w):
    parts, lse = attnres.block_reads(src[:-1], torch.stack([q, 0.5 * q]), None)
    return parts[1], lse[1], src[-1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=str)
def test_direct_calls_equal_the_boxed_op(dtype):
    src, q, w = problem(dtype)
    delta = src[0].flip(0)
    for args in ([src, q, w, 1e-6, 0.7, None, None, False, None],
                 [src, q, None, 1e-6, 1.0, w, 1e-5, True, delta]):
        direct = _C.depth_attention_fwd(*args)
        boxed = torch.ops.attnres.depth_attention_fwd(*args)
        assert len(direct) == len(boxed) == 6
        for a, b in zip(direct, boxed):
            assert torch.equal(a, b) and a.dtype == b.dtype
    qs = torch.stack([q, -0.5 * q])
    for args in ([src, qs, None, 1e-6, 1.0, None, None, False],
                 [src, qs, torch.stack([w, w]), 1e-6, 0.5, w, 1e-5, True]):
        direct, boxed = _C.block_reads_fwd(*args), torch.ops.attnres.block_reads_fwd(*args)
        assert isinstance(direct[0], list) and len(direct) == len(boxed) == 6
        for a, b in zip([*direct[0], *direct[1:]], [*boxed[0], *boxed[1:]]):
            assert torch.equal(a, b)
    partial, lse, P = merge_args(src, q, w)
    for args in ([partial, lse, P, q, w, 1e-6, 1.0, None, None, False, None],
                 [partial, lse, P, q, None, 1e-6, 1.0, w, None, True, delta]):
        for a, b in zip(_C.block_read_merge_fwd(*args), torch.ops.attnres.block_read_merge_fwd(*args)):
            assert torch.equal(a, b)
    with torch.no_grad():
        y1, y2 = partial.clone(), partial.clone()
        s1 = _C.block_read_merge_inplace(y1, lse, P, q, w, 1e-6, 1.0, None, None, delta)
        s2 = torch.ops.attnres.block_read_merge_inplace(y2, lse, P, q, w, 1e-6, 1.0, None, None, delta)
    assert torch.equal(y1, y2) and torch.equal(s1, s2)


def test_parameters_take_the_direct_call_and_gradients_flow():
    src, q, w = problem(torch.float64)
    srcs = [s.clone().requires_grad_() for s in src]
    q, w = torch.nn.Parameter(q), torch.nn.Parameter(w)
    out = _C.depth_attention_fwd(srcs, q, w, 1e-6, 1.0, None, None, False, None)
    assert out is not NotImplemented
    grads = torch.autograd.grad(out[0].square().sum(), [*srcs, q, w])
    want = torch.autograd.grad(
        torch.ops.attnres.depth_attention_fwd(srcs, q, w, 1e-6, 1.0)[0].square().sum(),
        [*srcs, q, w])
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


class Recording(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Marked(torch.Tensor):
    """A tensor subclass with the default __torch_function__."""


def test_what_torch_function_may_handle_goes_through_torch_ops(monkeypatch):
    src, q, w = problem()
    args = [src, q, w, 1e-6, 1.0, None, None, False, None]
    assert _C.depth_attention_fwd(*args) is not NotImplemented
    assert _C.depth_attention_fwd(src[:2] + [src[2].as_subclass(Marked)], *args[1:]) \
        is NotImplemented
    assert _C.depth_attention_fwd(tuple(src), *args[1:]) is NotImplemented  # not a list
    assert _C.depth_attention_fwd(src, q, w, 1e-6, 1.0, None, 1, False, None) is NotImplemented
    assert _C.depth_attention_fwd(src, q, w, 1, 1.0, None, None, False, None) is NotImplemented
    assert _C.depth_attention_fwd(src, q, w, 1e-6, 1.0, None, None, 1, None) is NotImplemented
    with Recording() as mode:
        assert _C.depth_attention_fwd(*args) is NotImplemented
        h = attnres.depth_attention(src, q, w)
    assert any("depth_attention_fwd" in op for op in mode.ops), mode.ops
    torch.testing.assert_close(h, attnres.depth_attention(src, q, w), rtol=0, atol=0)
    # A subclass argument: the wrapper falls back and still computes the read.
    h_sub = attnres.depth_attention(src[:3] + [src[3].as_subclass(Marked)], q, w)
    torch.testing.assert_close(h_sub.as_subclass(torch.Tensor), h, rtol=0, atol=0)


def test_outputs_mask_returns_the_asked_results_only():
    """`outputs` (bit i: result i) leaves the others None; a tensor result
    ignores it; anything but an int mask, or another keyword, is refused."""
    src, q, w = problem()
    delta = src[0].flip(0)
    args = [src, q, w, 1e-6, 1.0, None, None, False, delta]
    full = _C.depth_attention_fwd(*args)
    for mask in (1, 1 | 4, 1 | 32, 63, 0):
        got = _C.depth_attention_fwd(*args, outputs=mask)
        assert len(got) == 6
        for i, (a, b) in enumerate(zip(got, full)):
            if (mask >> i) & 1:
                assert torch.equal(a, b)
            else:
                assert a is None
    parts = _C.block_reads_fwd(src, torch.stack([q, q]), None, 1e-6, 1.0, None, None, False,
                               outputs=3)
    assert isinstance(parts[0], list) and parts[1] is not None and parts[2:] == (None,) * 4
    partial, lse, P = merge_args(src, q, w)
    with torch.no_grad():
        s1 = _C.block_read_merge_inplace(partial.clone(), lse, P, q, w, 1e-6, 1.0, None, None,
                                         delta, outputs=0)
    assert isinstance(s1, torch.Tensor)
    for bad in ({"outputs": 1.0}, {"outputs": True}, {"wanted": 1}):
        with pytest.raises(TypeError, match="takes one keyword, outputs"):
            _C.depth_attention_fwd(*args, **bad)


def test_errors_are_the_boxed_ops_errors():
    src, q, w = problem()
    bad = [
        [src[:1] + [src[1][:2]], q, w, 1e-6, 1.0, None, None, False, None],  # shapes differ
        [src, q[:-1], w, 1e-6, 1.0, None, None, False, None],                # query shape
        [src, q, w, -1.0, 1.0, None, None, False, None],                     # negative eps
        [src, q, w, 1e-6, 1.0, None, None, False, src[0].double()],          # delta dtype
        [[], q, w, 1e-6, 1.0, None, None, False, None],                      # no sources
    ]
    for args in bad:
        with pytest.raises(Exception) as direct:
            _C.depth_attention_fwd(*args)
        with pytest.raises(Exception) as boxed:
            torch.ops.attnres.depth_attention_fwd(*args)
        assert type(direct.value) is type(boxed.value)
        assert str(direct.value).splitlines()[0] == str(boxed.value).splitlines()[0]


def test_compiled_calls_trace_the_op(monkeypatch):
    """Under torch.compile the wrapper calls torch.ops (a direct call would
    break the graph): fullgraph traces, and equals eager."""
    torch._dynamo.reset()
    src, q, w = problem()
    direct_calls = []
    real = ops_mod._C

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)

            def call(*a, **kw):
                result = fn(*a, **kw)
                assert result is not NotImplemented  # the wrapper's arguments are taken
                direct_calls.append(name)
                return result
            return call

    monkeypatch.setattr(ops_mod, "_C", Spy())
    fn = lambda *s: attnres.depth_attention(list(s), q, w, delta=s[0])  # noqa: E731
    eager = fn(*src)
    assert direct_calls == ["depth_attention_fwd"]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*src)
    assert direct_calls == ["depth_attention_fwd"]  # none while tracing or running compiled
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.7, 1 / 3])
@pytest.mark.parametrize("gain", [True, False], ids=["gain", "no_gain"])
def test_the_cpu_query_loop_equals_the_tensor_ops(dtype, scale, gain):
    """u = (query * scale) * gain: the host's loop for contiguous CPU
    parameters in the accumulation dtype and its tensor-op form for other
    layouts (a strided copy) give the same reads bit for bit."""
    src, q, w = problem(dtype, D=67, seed=3)
    w = w if gain else None
    q_strided = torch.stack([q, q], 1)[:, 0]
    w_strided = None if w is None else torch.stack([w, w], 1)[:, 0]
    assert not q_strided.is_contiguous()
    for a, b in zip(torch.ops.attnres.depth_attention_fwd(src, q, w, 1e-6, scale),
                    torch.ops.attnres.depth_attention_fwd(src, q_strided, w_strided, 1e-6, scale)):
        assert torch.equal(a, b)
    qs = torch.stack([q, -0.5 * q])
    ws = None if w is None else torch.stack([w, w.flip(0)])
    qs_strided = torch.stack([qs, qs], 2)[..., 0]
    ws_strided = None if ws is None else torch.stack([ws, ws], 2)[..., 0]
    got = torch.ops.attnres.block_reads_fwd(src, qs, ws, 1e-6, scale)
    want = torch.ops.attnres.block_reads_fwd(src, qs_strided, ws_strided, 1e-6, scale)
    for a, b in zip([*got[0], *got[1:]], [*want[0], *want[1:]]):
        assert torch.equal(a, b)
