"""The read with a fused output norm (docs/design.md §11):
depth_attention(..., out_weight=w, out_eps=e) = RMSNorm(h, e) * w, the ops
depth_attention_fwd/bwd, block_reads_fwd/bwd, block_read_merge_fwd/bwd and
block_read_merge_inplace with their optional out_weight,
AttnResResidual(out_norm="rmsnorm") and the example GPT with
norm="rmsnorm"."""
import functools
import re

import pytest
import torch
import torch.nn.functional as F

import attnres
from attnres import reference
from attnres.models import GPT, GPTConfig
from helpers import (
    DEVICES,
    GRAD_REL_TOL,
    REL_TOL,
    STAT_REL_TOL,
    assert_rel_close,
    assert_within_eager,
    backward_op,
    make_params,
    make_sources,
    param_dtype,
    randomize_reads,
    rel_err,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def eager_normed(sources, query, gain, out_weight, *, eps, scale, out_eps, return_weights=False,
                 round_h=None):
    """The unfused composite in plain PyTorch: reference read, then RMSNorm.
    round_h: the float64 reference of the model both the composite and the
    fused read compute for a narrower dtype, whose h is rounded to that dtype
    before the norm (straight through: the rounding is a constant offset)."""
    h, weights = reference.depth_attention(sources, query, gain, eps=eps, scale=scale,
                                           return_weights=True)
    if round_h is not None:
        h = h + (h.to(round_h).to(h.dtype) - h).detach()
    y = F.rms_norm(h, (h.shape[-1],), out_weight.to(h.dtype), out_eps)
    return (y, weights) if return_weights else y


def ours_normed(sources, query, gain, out_weight, *, eps, scale, out_eps, return_weights=False):
    return attnres.depth_attention(sources, query, gain, eps=eps, scale=scale,
                                   return_weights=return_weights, out_weight=out_weight,
                                   out_eps=out_eps)


def make_out_weight(d, dtype, device, gen):
    w = torch.rand(d, generator=gen, dtype=torch.float64) + 0.5
    return w.to(param_dtype(dtype)).to(device)


def run(fn, sources, query, gain, out_weight, dy, gw, *, to=None, **kw):
    """y, weights and the gradients of sources, query, gain, out_weight, on
    fresh leaves (converted to ``to``), from a loss on y and the weights."""
    def leaf(t):
        t = t.detach()
        return (t.to(to) if to is not None else t).clone().requires_grad_(True)

    srcs = [leaf(s) for s in sources]
    q, g, w = leaf(query), leaf(gain), leaf(out_weight)
    y, weights = fn(srcs, q, g, w, return_weights=True, **kw)
    cast = (lambda t: t.to(to)) if to is not None else (lambda t: t)
    grads = torch.autograd.grad([y, weights], srcs + [q, g, w],
                                [cast(dy), gw.to(weights.dtype)])
    return y, weights, grads


CASES = [  # (N, lead, D)
    (1, (5,), 1000),
    (2, (3, 4), 1),
    (5, (7,), 1000),
    (17, (9,), 129),
    (65, (2,), 64),
    (3, (2,), 7186),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_float64_reference(device, dtype, case):
    """y, the weights and every gradient (sources, query, gain, out_weight)
    against float64, within the eager-relative rule of the one-call op: at
    most eager_k x the error of the unfused composite run in the same dtype."""
    n, lead, d = case
    gen = torch.Generator().manual_seed(7 + n + d)
    srcs = make_sources(n, lead, d, dtype, device, gen)
    q, g = make_params(d, dtype, device, gen)
    w = make_out_weight(d, dtype, device, gen)
    dy = torch.randn(*lead, d, generator=gen, dtype=torch.float64).to(dtype).to(device)
    gw = torch.randn(n, *lead, generator=gen, dtype=torch.float64).to(device)
    kw = dict(eps=1e-6, scale=0.9, out_eps=1e-5)
    y, weights, grads = run(ours_normed, srcs, q, g, w, dy, gw, **kw)
    y_e, weights_e, grads_e = run(eager_normed, srcs, q, g, w, dy, gw, **kw)
    y_r, weights_r, grads_r = run(functools.partial(eager_normed, round_h=dtype), srcs, q, g, w,
                                  dy, gw, to=torch.float64, **kw)
    assert y.dtype == dtype and y.shape == srcs[0].shape
    names = [f"grad sources[{i}]" for i in range(n)] + ["grad query", "grad gain",
                                                         "grad out_weight"]
    if dtype == torch.float64:
        # The composite in fp64 is the reference itself: the table's bounds.
        # (D = 1: the norm's output is ~sign(h), its gradient a cancellation.)
        assert_rel_close(y, y_r, REL_TOL[dtype], "y")
        assert_rel_close(weights, weights_r, STAT_REL_TOL[dtype], "weights")
        for ours, ref, name in zip(grads, grads_r, names):
            assert ours.dtype == ref.dtype, name
            assert_rel_close(ours, ref, GRAD_REL_TOL[dtype], name)
        return
    assert_within_eager(y, y_e, y_r, dtype, "output", "y")
    assert_within_eager(weights, weights_e, weights_r, dtype, "stats", "weights")
    for ours, eager, ref, name in zip(grads, grads_e, grads_r, names):
        assert ours.dtype == eager.dtype, name
        assert_within_eager(ours, eager, ref, dtype, "grad", name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs(device, dtype):
    """Transposed sources and a strided incoming gradient read in place give
    what contiguous copies give."""
    gen = torch.Generator().manual_seed(11)
    d = 96
    base = [torch.randn(d, 6, 5, generator=gen).to(dtype).to(device) for _ in range(4)]
    srcs = [b.permute(2, 1, 0) for b in base]  # [5, 6, d], last dim strided
    q, g = make_params(d, dtype, device, gen)
    w = make_out_weight(d, dtype, device, gen)
    dy = torch.randn(6, 5, d, generator=gen).to(dtype).to(device).transpose(0, 1)
    gw = torch.randn(4, 5, 6, generator=gen).to(device)
    kw = dict(eps=1e-6, scale=1.0, out_eps=1e-6)
    y, weights, grads = run(ours_normed, srcs, q, g, w, dy, gw, **kw)
    y_c, weights_c, grads_c = run(ours_normed, [s.contiguous() for s in srcs], q, g, w,
                                  dy.contiguous(), gw, **kw)
    torch.testing.assert_close(y, y_c, rtol=0, atol=0)
    for a, b in zip(grads, grads_c):
        torch.testing.assert_close(a, b, rtol=REL_TOL[dtype], atol=REL_TOL[dtype])


@pytest.mark.parametrize("with_gain", [True, False])
def test_gradcheck_fp64(with_gain):
    """fp64 gradcheck through y and the weights, out_weight included."""
    gen = torch.Generator().manual_seed(3)
    srcs = make_sources(4, (3,), 6, torch.float64, "cpu", gen, requires_grad=True)
    q, g = make_params(6, torch.float64, "cpu", gen, requires_grad=True)
    w = make_out_weight(6, torch.float64, "cpu", gen).requires_grad_()

    def fwd(*xs):
        gain = xs[6] if with_gain else None
        y, _rstd, weights, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
            list(xs[:4]), xs[4], gain, 1e-6, 0.8, xs[5], 1e-4, False)
        return y, weights

    args = (*srcs, q, w, g) if with_gain else (*srcs, q, w)
    assert torch.autograd.gradcheck(fwd, args)


def test_opcheck():
    """torch.library.opcheck on both ops with out_weight: schema, fake
    kernel, autograd registration (the backward op through its own node)."""
    gen = torch.Generator().manual_seed(5)
    srcs = make_sources(3, (4,), 10, torch.float32, "cpu", gen, requires_grad=True)
    q, g = make_params(10, torch.float32, "cpu", gen, requires_grad=True)
    w = make_out_weight(10, torch.float32, "cpu", gen).requires_grad_()
    for keep_h in (False, True):
        torch.library.opcheck(torch.ops.attnres.depth_attention_fwd,
                              (srcs, q, g, 1e-6, 1.0, w, 1e-5, keep_h))
    torch.library.opcheck(torch.ops.attnres.depth_attention_fwd,
                          (srcs, q, g, 1e-6, 1.0, w, None, True))  # out_eps follows eps
    y, rstd, weights, h, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        [s.detach() for s in srcs], q.detach(), g.detach(), 1e-6, 1.0, w.detach(), 1e-5, True)
    dy = torch.randn_like(y)
    for mask in ([True] * 6, [False, True, False, True, False, True], [True, False, False, False, True, False]):
        torch.library.opcheck(torch.ops.attnres.depth_attention_bwd,
                              (dy, None, [s.detach() for s in srcs], q.detach(), g.detach(),
                               h, rstd, weights, 1.0, mask, w.detach(), out_rstd))


def test_kept_h_is_the_plain_reads_h_and_y_its_norm():
    """keep_h returns the plain op's h bit for bit, and y is RMSNorm of the
    unrounded h (fp64: equal to the composite to rounding)."""
    gen = torch.Generator().manual_seed(9)
    for dtype in DTYPES:
        srcs = make_sources(6, (4, 3), 200, dtype, "cpu", gen)
        q, g = make_params(200, dtype, "cpu", gen)
        w = make_out_weight(200, dtype, "cpu", gen)
        y, rstd, weights, h, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
            srcs, q, g, 1e-6, 1.0, w, 1e-5, True)
        h_plain, rstd_plain, weights_plain, h_empty, out_rstd_empty, _ = (
            torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 1.0))
        assert torch.equal(h, h_plain) and torch.equal(weights, weights_plain), dtype
        assert torch.equal(rstd, rstd_plain), dtype
        assert out_rstd.shape == (4, 3) and out_rstd.dtype == weights.dtype
        # Without out_weight the norm's statistics are empty tensors.
        assert h_empty.shape == (0,) and h_empty.dtype == dtype, dtype
        assert out_rstd_empty.shape == (0,) and out_rstd_empty.dtype == weights.dtype, dtype
        y_none, _, _, h_none, _, _ = torch.ops.attnres.depth_attention_fwd(
            srcs, q, g, 1e-6, 1.0, w, 1e-5, False)
        assert h_none.numel() == 0 and torch.equal(y_none, y), dtype
    h64 = h_plain.double()
    expected = F.rms_norm(h64, (200,), w.double(), 1e-5)
    assert rel_err(y, expected) <= REL_TOL[dtype]


def test_h_is_kept_for_the_backward_only_when_autograd_records():
    """keep_h=False still trains (the autograd kernel keeps h itself), and
    under no_grad nothing but y is written."""
    gen = torch.Generator().manual_seed(2)
    srcs = make_sources(3, (5,), 16, torch.float32, "cpu", gen, requires_grad=True)
    q, g = make_params(16, torch.float32, "cpu", gen, requires_grad=True)
    w = make_out_weight(16, torch.float32, "cpu", gen).requires_grad_()
    y, _, _, h, _, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 1.0, w, 1e-6, False)
    assert h.numel() == 0 and y.requires_grad and not h.requires_grad
    y.sum().backward()
    assert all(s.grad is not None for s in srcs) and w.grad is not None
    with torch.no_grad():
        y2, _, _, h2, _, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 1.0, w, 1e-6,
                                                                False)
    assert h2.numel() == 0 and torch.equal(y2, y.detach())


def test_backward_op_computes_only_what_the_mask_asks():
    gen = torch.Generator().manual_seed(4)
    srcs = make_sources(3, (5,), 16, torch.float64, "cpu", gen)
    q, g = make_params(16, torch.float64, "cpu", gen)
    w = make_out_weight(16, torch.float64, "cpu", gen)
    y, rstd, weights, h, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        srcs, q, g, 1e-6, 1.0, w, 1e-6, True)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    args = (dy, None, srcs, q, g, h, rstd, weights, 1.0)

    def bwd(mask):
        return torch.ops.attnres.depth_attention_bwd(*args, mask, w, out_rstd)

    all_grads = bwd([True] * 6)
    some = bwd([False, True, False, False, False, True])
    assert len(some[0]) == 1 and some[1] is None and some[2] is None
    assert torch.equal(some[0][0], all_grads[0][1]) and torch.equal(some[3], all_grads[3])
    only_w = bwd([False] * 5 + [True])
    assert only_w[0] == [] and torch.equal(only_w[3], all_grads[3])
    # The helper passes out_weight through with every gradient wanted.
    via_helper = backward_op(dy, srcs, q, g, h, rstd, weights, 1.0, out_weight=w,
                             out_rstd=out_rstd)
    for a, b in zip([*via_helper[0], *via_helper[1:]], [*all_grads[0], *all_grads[1:]]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=re.escape(
            "output_mask must have N + 3 = 6 entries (each source, query, norm_weight, "
            "out_weight), got 5")):
        bwd([True] * 5)
    with pytest.raises(ValueError, match=re.escape(
            "output_mask must have N + 2 = 5 entries (each source, query, norm_weight), got 6")):
        torch.ops.attnres.depth_attention_bwd(*args, [True] * 6)
    with pytest.raises(ValueError, match=re.escape("h (the forward's read) must have the "
                                                   "sources' shape")):
        # keep_h=False's empty h is no h for the backward.
        torch.ops.attnres.depth_attention_bwd(dy, None, srcs, q, g, h.new_empty(0), rstd,
                                              weights, 1.0, [True] * 6, w, out_rstd)
    with pytest.raises(ValueError, match="out_rstd must have shape"):
        torch.ops.attnres.depth_attention_bwd(*args, [True] * 6, w, out_rstd[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_out_weight_grad_has_the_same_bits_on_any_thread_count(dtype):
    gen = torch.Generator().manual_seed(8)
    srcs = make_sources(4, (300,), 128, dtype, "cpu", gen)
    q, g = make_params(128, dtype, "cpu", gen)
    w = make_out_weight(128, dtype, "cpu", gen)
    dy = torch.randn(300, 128, generator=gen).to(dtype)
    gw = torch.zeros(4, 300)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            results.append(run(ours_normed, srcs, q, g, w, dy, gw, eps=1e-6, scale=1.0,
                               out_eps=1e-6)[2])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_rows_near_the_limits(dtype):
    """Rows whose sum of squares overflows (huge) or underflows (tiny, out_eps
    0) still give the normalized read: y does not depend on h's scale."""
    gen = torch.Generator().manual_seed(1)
    d = 256
    # Powers of two, so the scaled sources are exactly the unit ones scaled.
    big = 2.0**996 if dtype == torch.float64 else 2.0**100
    tiny = 2.0**-996 if dtype == torch.float64 else 2.0**-100
    base = make_sources(3, (4,), d, torch.float64, "cpu", gen)
    q, g = make_params(d, dtype, "cpu", gen)
    w = make_out_weight(d, dtype, "cpu", gen)
    # eps 0 in both norms: the read's weights and y do not depend on the
    # scale c of the sources, and the sources' gradients scale as 1/c.
    dy = torch.randn(4, d, generator=gen, dtype=torch.float64).to(dtype)

    def read(factor):
        srcs = [(s * factor).to(dtype).requires_grad_() for s in base]
        y = attnres.depth_attention(srcs, q, g, eps=0.0, out_weight=w, out_eps=0.0)
        grads = torch.autograd.grad(y, srcs, dy)
        return y, [gr.double() * factor for gr in grads]

    unit, unit_grads = read(1.0)
    for factor in (big, tiny):
        y, grads = read(factor)
        assert torch.isfinite(y).all(), factor
        assert rel_err(y, unit) <= 5 * REL_TOL[dtype], factor
        for a, b in zip(grads, unit_grads):
            assert rel_err(a, b) <= 5 * GRAD_REL_TOL[dtype], factor


def test_argument_errors_name_the_argument():
    src = [torch.randn(2, 8)]
    q = torch.zeros(8)
    with pytest.raises(ValueError, match=r"out_weight must have shape \[D\] = \[8\]"):
        attnres.depth_attention(src, q, out_weight=torch.ones(7))
    with pytest.raises(TypeError, match="out_weight must have the sources' dtype"):
        attnres.depth_attention(src, q, out_weight=torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out_eps must be a finite number >= 0"):
        attnres.depth_attention(src, q, out_weight=torch.ones(8), out_eps=-1.0)
    with pytest.raises(TypeError, match="out_eps must be a number"):
        attnres.depth_attention(src, q, out_weight=torch.ones(8), out_eps="1e-6")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():  # the fake kernels say the same of the shape (out_eps: at run time)
        fsrc = [torch.empty(2, 8)]
        with pytest.raises(ValueError, match=r"out_weight must have shape \[D\] = \[8\]"):
            torch.ops.attnres.depth_attention_fwd(fsrc, torch.empty(8), None, 1e-6, 1.0,
                                                  torch.empty(7), 1e-6, False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_out_eps_none_follows_eps(dtype):
    """out_eps=None is eps (the mapping of FLA's rms_eps): the same bits as
    passing it, in every op that takes out_weight, and different from
    another out_eps."""
    gen = torch.Generator().manual_seed(21)
    srcs = make_sources(3, (4,), 16, dtype, "cpu", gen)
    q, g = make_params(16, dtype, "cpu", gen)
    w = make_out_weight(16, dtype, "cpu", gen)
    eps = 0.25  # large, so that another out_eps shows
    kw = dict(eps=eps, scale=1.0)
    y = attnres.depth_attention(srcs, q, g, out_weight=w, **kw)
    assert torch.equal(y, attnres.depth_attention(srcs, q, g, out_weight=w, out_eps=eps, **kw))
    assert not torch.equal(y, attnres.depth_attention(srcs, q, g, out_weight=w, out_eps=1e-6,
                                                      **kw))
    qs, gs = torch.stack([q, q.flip(0)]), torch.stack([g, g.flip(0)])
    p0 = attnres.block_reads(srcs[:2], qs, gs, out_weight=w, **kw)[0][0]
    assert torch.equal(p0, attnres.block_reads(srcs[:2], qs, gs, out_weight=w, out_eps=eps,
                                               **kw)[0][0])
    partials, lse = attnres.block_reads(srcs[:2], qs, gs, **kw)
    m = attnres.block_read_merge(partials[1], lse[1], srcs[2], qs[1], gs[1], out_weight=w, **kw)
    assert torch.equal(m, attnres.block_read_merge(partials[1], lse[1], srcs[2], qs[1], gs[1],
                                                   out_weight=w, out_eps=eps, **kw))
    target = partials[1].clone()
    attnres.ops.block_read_merge_inplace(target, lse[1], srcs[2], qs[1], gs[1], out_weight=w,
                                         **kw)
    assert torch.equal(target, m)


def test_zero_tokens_and_second_derivatives():
    srcs = [torch.randn(0, 8, requires_grad=True) for _ in range(2)]
    w = torch.ones(8, requires_grad=True)
    y = attnres.depth_attention(srcs, torch.zeros(8, requires_grad=True), out_weight=w)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8))
    src = [torch.randn(3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    w = torch.ones(8, dtype=torch.float64, requires_grad=True)
    y = attnres.depth_attention(src, torch.zeros(8, dtype=torch.float64), out_weight=w)
    (g,) = torch.autograd.grad(y.pow(2).sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives of depth_attention"):
        g.sum().backward()


@pytest.mark.slow
def test_compiles_fullgraph_train_and_inference():
    gen = torch.Generator().manual_seed(6)
    srcs = make_sources(4, (3, 5), 32, torch.float32, "cpu", gen, requires_grad=True)
    q, g = make_params(32, torch.float32, "cpu", gen, requires_grad=True)
    w = make_out_weight(32, torch.float32, "cpu", gen).requires_grad_()

    def fn(srcs, q, g, w):
        return attnres.depth_attention(srcs, q, g, out_weight=w, out_eps=1e-5).square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    loss = compiled(srcs, q, g, w)
    grads = torch.autograd.grad(loss, srcs + [q, g, w])
    loss_e = fn(srcs, q, g, w)
    grads_e = torch.autograd.grad(loss_e, srcs + [q, g, w])
    torch.testing.assert_close(loss, loss_e)
    for a, b in zip(grads, grads_e):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(compiled(srcs, q, g, w), loss_e.detach())


# ---- modules and the example GPT -------------------------------------------------------


def test_module_out_norm_parameters_and_repr():
    res = attnres.AttnResResidual(16, out_norm="rmsnorm", out_eps=1e-5)
    assert torch.equal(res.out_weight, torch.ones(16)) and res.out_eps == 1e-5
    assert "out_norm='rmsnorm'" in repr(res)
    assert attnres.AttnResResidual(16).out_weight is None
    with pytest.raises(ValueError, match="out_norm must be None or 'rmsnorm'"):
        attnres.AttnResResidual(16, out_norm="layernorm")
    with pytest.raises(ValueError, match="out_eps must be a finite number >= 0"):
        attnres.AttnResResidual(16, out_norm="rmsnorm", out_eps=float("inf"))


@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("block_reads", ["auto", "two_phase"])
def test_module_read_is_the_norm_of_the_plain_read(block_size, block_reads):
    """Full and Block (two-phase forced or not), train and inference: the
    normed read equals RMSNorm of the plain read with the same parameters."""
    if block_size is None and block_reads == "two_phase":
        pytest.skip("two-phase reads are for Block streams")
    gen = torch.Generator().manual_seed(12)
    d = 24
    plain = [attnres.AttnResResidual(d, dtype=torch.float64) for _ in range(9)]
    normed = [attnres.AttnResResidual(d, out_norm="rmsnorm", out_eps=1e-5,
                                      dtype=torch.float64) for _ in range(9)]
    with torch.no_grad():
        for a, b in zip(plain, normed):
            a.query.normal_(generator=gen)
            b.query.copy_(a.query)
            b.out_weight.uniform_(0.5, 1.5, generator=gen)
    outputs = [torch.randn(2, 5, d, generator=gen, dtype=torch.float64) for _ in range(9)]
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            s1 = attnres.DepthStream(outputs[0], block_size=block_size, block_reads=block_reads,
                                     readers=plain)
            s2 = attnres.DepthStream(outputs[0], block_size=block_size, block_reads=block_reads,
                                     readers=normed)
            for i in range(9):
                h = plain[i](s1)
                y = normed[i](s2)
                expected = F.rms_norm(h, (d,), normed[i].out_weight, 1e-5)
                torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
                s1.append(outputs[i] * 0.5 + h * 0.1)
                s2.append(outputs[i] * 0.5 + h * 0.1)


@pytest.mark.parametrize("residual", ["full", "block"])
def test_gpt_rmsnorm_reads_carry_the_prenorms(residual):
    """norm="rmsnorm": the AttnRes GPT's reads carry the pre-norms (no norm
    modules left), it computes the standard RMSNorm model's function at zero
    queries (prenorm_eps), and trains."""
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    std = GPT(GPTConfig(residual="standard", norm="rmsnorm", n_layers=3, seq_len=16))
    torch.manual_seed(1)
    model = GPT(GPTConfig(residual=residual, norm="rmsnorm", n_layers=3, seq_len=16))
    assert not any(isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) for m in model.modules())
    assert all(r.out_weight is not None for r in model.modules()
               if isinstance(r, attnres.AttnResResidual))
    torch.testing.assert_close(model(idx)[0], std(idx)[0], rtol=1e-5, atol=1e-5)
    randomize_reads(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        _logits, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.final_res.out_weight.grad is not None


def test_gpt_config_checks_norm():
    with pytest.raises(ValueError, match="norm must be one of"):
        GPTConfig(norm="batchnorm")


# ---- the normed two-phase merge (docs/design.md §10, §11) ----------------------------


def merge_inputs(n, lead, d, dtype, gen, *, gain=True):
    """A phase-1 state (partial_out, lse) of one reader over n sources, the
    partial block sum, the reader's parameters and an out_weight."""
    srcs = make_sources(n + 1, lead, d, dtype, "cpu", gen)
    q, g = make_params(d, dtype, "cpu", gen)
    w = make_out_weight(d, dtype, "cpu", gen)
    partials, lse = attnres.block_reads(srcs[:n], q.unsqueeze(0),
                                        g.unsqueeze(0) if gain else None, eps=1e-6, scale=0.9)
    return partials[0], lse[0], srcs[n], q, (g if gain else None), w


def merge_normed_ref(y, lse, P, q, g, w, *, eps, scale, out_eps, round_h):
    """The float64 model of the normed merge: h = (1 - a) y + a P with
    a = sigmoid(s_P - lse), rounded to round_h straight through, then RMSNorm."""
    u = q * (1.0 if g is None else g)
    r = P.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
    s = scale * (r * P * u).sum(-1)
    a = torch.sigmoid(s - lse).unsqueeze(-1)
    h = (1 - a) * y + a * P
    if round_h is not None:
        h = h + (h.to(round_h).to(h.dtype) - h).detach()
    return F.rms_norm(h, (h.shape[-1],), w, out_eps)


def merge_normed_grads(fn, inputs, dy, *, to=None, **kw):
    """y and the gradients of partial_out, lse, block_sum, query, gain (when
    given), out_weight on fresh leaves (converted to ``to``)."""
    leaves = [None if t is None else (t.detach().to(to) if to is not None else t.detach())
              .clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves, **kw)
    wrt = [t for t in leaves if t is not None]
    return y, torch.autograd.grad(y, wrt, dy.to(y.dtype))


def ours_merge_normed(y, lse, P, q, g, w, *, eps, scale, out_eps):
    return attnres.block_read_merge(y, lse, P, q, g, eps=eps, scale=scale, out_weight=w,
                                    out_eps=out_eps)


def eager_merge_normed(y, lse, P, q, g, w, *, eps, scale, out_eps):
    """The unfused composite in the inputs' dtype: the plain merge op, then
    RMSNorm."""
    h = attnres.block_read_merge(y, lse, P, q, g, eps=eps, scale=scale)
    return F.rms_norm(h, (h.shape[-1],), w.to(h.dtype), out_eps)


# No D = 1: there the norm's gradient is the cancellation 1 - n^2 = eps / (h^2 + eps)
# (fp32 and bf16 gradients off by ~0.5% for the fused and the unfused merge alike).
MERGE_CASES = [  # (N, lead, D)
    (1, (5,), 3),
    (3, (3, 4), 7),
    (4, (9,), 129),
    (2, (2,), 1000),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MERGE_CASES, ids=str)
@pytest.mark.parametrize("gain", [True, False])
def test_merge_normed_matches_the_float64_reference(dtype, case, gain):
    """y and the gradients of every input against the float64 model (h
    rounded to the dtype before the norm), within the eager-relative rule:
    at most eager_k x the error of the plain merge + RMSNorm in the same
    dtype (fp64: the tables' bounds)."""
    n, lead, d = case
    gen = torch.Generator().manual_seed(31 + n + d)
    inputs = merge_inputs(n, lead, d, dtype, gen, gain=gain)
    dy = torch.randn(*lead, d, generator=gen, dtype=torch.float64).to(dtype)
    kw = dict(eps=1e-6, scale=0.9, out_eps=1e-5)
    y, grads = merge_normed_grads(ours_merge_normed, inputs, dy, **kw)
    y_e, grads_e = merge_normed_grads(eager_merge_normed, inputs, dy, **kw)
    y_r, grads_r = merge_normed_grads(functools.partial(merge_normed_ref, round_h=dtype), inputs,
                                      dy, to=torch.float64, **kw)
    assert y.dtype == dtype and y.shape == inputs[0].shape
    names = ["partial_out", "lse", "block_sum", "query"] + (["gain"] if gain else []) + [
        "out_weight"]
    if dtype == torch.float64:
        assert_rel_close(y, y_r, REL_TOL[dtype], "y")
        for ours, ref, name in zip(grads, grads_r, names):
            assert ours.dtype == ref.dtype, name
            assert_rel_close(ours, ref, GRAD_REL_TOL[dtype], f"grad {name}")
        return
    assert_within_eager(y, y_e, y_r, dtype, "output", "y")
    for ours, eager, ref, name in zip(grads, grads_e, grads_r, names):
        assert ours.dtype == eager.dtype, name
        assert_within_eager(ours, eager, ref, dtype, "grad", f"grad {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_normed_h_is_the_plain_merge_and_inplace_equals_it(dtype):
    """keep_h returns the plain merge's h bit for bit (rstd, weight too), y
    does not depend on keep_h, and the in-place variant writes the same y
    into partial_out; it refuses gradients."""
    gen = torch.Generator().manual_seed(13)
    y0, lse, P, q, g, w = merge_inputs(3, (4, 3), 67, dtype, gen)
    y, rstd, weight, h, out_rstd, _ = torch.ops.attnres.block_read_merge_fwd(
        y0, lse, P, q, g, 1e-6, 1.0, w, 1e-5, True)
    h_plain, rstd_plain, weight_plain, h_empty, out_rstd_empty, _ = (
        torch.ops.attnres.block_read_merge_fwd(y0, lse, P, q, g, 1e-6, 1.0))
    assert torch.equal(h, h_plain) and torch.equal(rstd, rstd_plain)
    assert torch.equal(weight, weight_plain)
    assert out_rstd.shape == (4, 3) and out_rstd.dtype == rstd.dtype
    # Without out_weight the norm's statistics are empty tensors.
    assert h_empty.shape == (0,) and h_empty.dtype == dtype
    assert out_rstd_empty.shape == (0,) and out_rstd_empty.dtype == rstd.dtype
    y_none, _, _, h_none, _, _ = torch.ops.attnres.block_read_merge_fwd(
        y0, lse, P, q, g, 1e-6, 1.0, w, 1e-5, False)
    assert h_none.numel() == 0 and torch.equal(y_none, y)
    target = y0.clone()
    out = attnres.ops.block_read_merge_inplace(target, lse, P, q, g, out_weight=w, out_eps=1e-5)
    assert out is target and torch.equal(target, y)
    with pytest.raises(RuntimeError, match="attnres::block_read_merge_inplace has no derivative"):
        attnres.ops.block_read_merge_inplace(y0.clone(), lse, P, q, g,
                                             out_weight=w.clone().requires_grad_(),
                                             out_eps=1e-5)


def test_merge_normed_strided_inputs():
    """A transposed partial output and block sum and a strided dy give what
    contiguous copies give."""
    gen = torch.Generator().manual_seed(17)
    d = 40
    y0, lse, P, q, g, w = merge_inputs(2, (6, 5), d, torch.float32, gen)
    y_t = y0.transpose(0, 1).contiguous().transpose(0, 1)
    P_t = P.transpose(0, 1).contiguous().transpose(0, 1)
    assert not y_t.is_contiguous() and not P_t.is_contiguous()
    dy = torch.randn(5, 6, d, generator=gen).transpose(0, 1)
    kw = dict(eps=1e-6, scale=1.0, out_eps=1e-6)
    out, grads = merge_normed_grads(ours_merge_normed, (y_t, lse, P_t, q, g, w), dy, **kw)
    out_c, grads_c = merge_normed_grads(ours_merge_normed, (y0, lse, P, q, g, w),
                                        dy.contiguous(), **kw)
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)
    for a, b in zip(grads, grads_c):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("with_gain", [True, False])
def test_merge_normed_gradcheck_fp64(with_gain):
    gen = torch.Generator().manual_seed(19)
    y0, lse, P, q, g, w = merge_inputs(3, (3,), 6, torch.float64, gen, gain=with_gain)
    args = [t.detach().clone().requires_grad_() for t in (y0, lse, P, q, w)]
    if with_gain:
        args.append(g.detach().clone().requires_grad_())

    def fwd(y, l, p, qq, ww, gg=None):
        return torch.ops.attnres.block_read_merge_fwd(y, l, p, qq, gg, 1e-6, 0.8, ww, 1e-4,
                                                      False)[0]

    assert torch.autograd.gradcheck(fwd, tuple(args))


def test_merge_normed_opcheck_and_mask():
    """opcheck on the three ops (schema, fake kernel, autograd); the
    backward computes only what its mask asks, and second derivatives raise."""
    gen = torch.Generator().manual_seed(23)
    y0, lse, P, q, g, w = merge_inputs(3, (4,), 10, torch.float32, gen)
    leaves = [t.clone().requires_grad_() for t in (y0, lse, P, q, g, w)]
    for keep_h in (False, True):
        torch.library.opcheck(torch.ops.attnres.block_read_merge_fwd,
                              (*leaves[:5], 1e-6, 1.0, leaves[5], 1e-5, keep_h))
    torch.library.opcheck(torch.ops.attnres.block_read_merge_inplace,
                          (y0.clone(), lse, P, q, g, 1e-6, 1.0, w, 1e-5))
    y, rstd, weight, h, out_rstd, _ = torch.ops.attnres.block_read_merge_fwd(
        y0, lse, P, q, g, 1e-6, 1.0, w, 1e-5, True)
    dy = torch.randn(y.shape, generator=gen)
    args = (dy, y0, P, q, g, rstd, weight, 1.0)
    tail = (w, h, out_rstd)
    for mask in ([True] * 6, [False, True, False, True, False, True], [False] * 5 + [True]):
        torch.library.opcheck(torch.ops.attnres.block_read_merge_bwd, (*args, mask, *tail))
    every = torch.ops.attnres.block_read_merge_bwd(*args, [True] * 6, *tail)
    some = torch.ops.attnres.block_read_merge_bwd(*args, [False, True, False, False, False, True],
                                                  *tail)
    assert some[0] is None and some[2] is None and some[3] is None and some[4] is None
    assert torch.equal(some[1], every[1]) and torch.equal(some[5], every[5])
    with pytest.raises(ValueError, match=re.escape(
            "output_mask must have 6 entries (partial_out, lse, block_sum, query, norm_weight, "
            "out_weight), got 5")):
        torch.ops.attnres.block_read_merge_bwd(*args, [True] * 5, *tail)
    with pytest.raises(ValueError, match=re.escape(
            "output_mask must have 5 entries (partial_out, lse, block_sum, query, norm_weight), "
            "got 6")):
        torch.ops.attnres.block_read_merge_bwd(*args, [True] * 6)
    with pytest.raises(ValueError, match=re.escape(
            "h (the forward's read before the output norm) must have block_sum's shape")):
        # keep_h=False's empty h is no h for the backward.
        torch.ops.attnres.block_read_merge_bwd(*args, [True] * 6, w, h.new_empty(0), out_rstd)
    with pytest.raises(ValueError, match="out_weight must have shape"):
        torch.ops.attnres.block_read_merge_fwd(y0, lse, P, q, g, 1e-6, 1.0, w[:3], 1e-5, False)
    out = attnres.block_read_merge(*leaves[:5], out_weight=leaves[5])
    (gy,) = torch.autograd.grad(out.sum(), leaves[2], create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives of block_read_merge"):
        gy.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_normed_out_weight_grad_has_the_same_bits_on_any_thread_count(dtype):
    gen = torch.Generator().manual_seed(29)
    inputs = merge_inputs(3, (700,), 128, dtype, gen)
    dy = torch.randn(700, 128, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            results.append(merge_normed_grads(ours_merge_normed, inputs, dy, eps=1e-6, scale=1.0,
                                              out_eps=1e-6)[1])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_merge_normed_rows_near_the_limits():
    """Partial outputs and block sums scaled by 2^±100 (fp32, eps 0 in both
    norms): y and the scaled gradients equal the unit-scale ones (the norm's
    sum of squares rescued as in the one-call read)."""
    gen = torch.Generator().manual_seed(37)
    y0, lse, P, q, g, w = merge_inputs(2, (5,), 33, torch.float32, gen)
    dy = torch.randn(5, 33, generator=gen)
    kw = dict(eps=0.0, scale=1.0, out_eps=0.0)
    y1, g1 = merge_normed_grads(ours_merge_normed, (y0, lse, P, q, g, w), dy, **kw)
    for k in (100, -100):
        c = 2.0 ** k
        # Scaling the rows scales h; the block sum's score is scale-free (eps 0).
        yk, gk = merge_normed_grads(ours_merge_normed, (y0 * c, lse, P * c, q, g, w), dy, **kw)
        torch.testing.assert_close(yk, y1, rtol=1e-5, atol=1e-6)
        for name, a, b, f in zip(["partial_out", "lse", "block_sum", "query", "gain",
                                  "out_weight"], gk, g1, [c, 1, c, 1, 1, 1]):
            torch.testing.assert_close(a * f, b, rtol=1e-4, atol=1e-5, msg=name)


# ---- phase 1 with reader 0's output norm ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [(1, 2, (5,), 1), (3, 3, (3, 4), 7), (4, 5, (9,), 129)], ids=str)
def test_block_reads_normed_matches_the_float64_reference(dtype, case):
    """partial_outs[0] = RMSNorm(h_0) * w against the float64 model (h_0
    rounded to the dtype), the other partial outputs and lse equal to the
    plain op's bit for bit; every gradient (a loss on all partial outputs)
    within the eager-relative rule against phase 1 + RMSNorm in the dtype."""
    n, S, lead, d = case
    gen = torch.Generator().manual_seed(41 + n + d)
    srcs = make_sources(n, lead, d, dtype, "cpu", gen)
    q = torch.stack([make_params(d, dtype, "cpu", gen)[0] for _ in range(S)])
    g = torch.stack([make_params(d, dtype, "cpu", gen)[1] for _ in range(S)])
    w = make_out_weight(d, dtype, "cpu", gen)
    dys = [torch.randn(*lead, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(S)]
    kw = dict(eps=1e-6, scale=0.9)

    def ours(srcs, q, g, w):
        return attnres.block_reads(srcs, q, g, out_weight=w, out_eps=1e-5, **kw)[0]

    def eager(srcs, q, g, w, round_h=None):
        if round_h is None:
            partials = attnres.block_reads(srcs, q, g, **kw)[0]
            h0 = partials[0]
        else:  # float64 reference reads, h_0 rounded straight through
            partials = [reference.depth_attention(srcs, q[s], g[s], **kw) for s in range(S)]
            h0 = partials[0] + (partials[0].to(round_h).to(torch.float64) - partials[0]).detach()
        return [F.rms_norm(h0, (d,), w.to(h0.dtype), 1e-5), *partials[1:]]

    def grads_of(fn, to=None):
        leaves = [(t.detach().to(to) if to is not None else t.detach()).clone().requires_grad_()
                  for t in (*srcs, q, g, w)]
        outs = fn(leaves[:n], leaves[n], leaves[n + 1], leaves[n + 2])
        return outs, torch.autograd.grad(outs, leaves, [dy.to(outs[0].dtype) for dy in dys])

    outs, grads = grads_of(ours)
    outs_e, grads_e = grads_of(eager)
    outs_r, grads_r = grads_of(functools.partial(eager, round_h=dtype), to=torch.float64)
    plain, lse_plain = attnres.block_reads(srcs, q, g, **kw)
    for s in range(1, S):
        assert torch.equal(outs[s], plain[s])
    names = [f"sources[{i}]" for i in range(n)] + ["queries", "gains", "out_weight"]
    if dtype == torch.float64:
        assert_rel_close(outs[0], outs_r[0], REL_TOL[dtype], "y_0")
        for ours_g, ref, name in zip(grads, grads_r, names):
            assert_rel_close(ours_g, ref, GRAD_REL_TOL[dtype], f"grad {name}")
        return
    assert_within_eager(outs[0], outs_e[0], outs_r[0], dtype, "output", "y_0")
    for ours_g, eager_g, ref, name in zip(grads, grads_e, grads_r, names):
        assert ours_g.dtype == eager_g.dtype, name
        assert_within_eager(ours_g, eager_g, ref, dtype, "grad", f"grad {name}")


def test_block_reads_normed_ops_gradcheck_opcheck_and_determinism():
    gen = torch.Generator().manual_seed(43)
    srcs = make_sources(3, (3,), 6, torch.float64, "cpu", gen, requires_grad=True)
    q = torch.randn(2, 6, generator=gen, dtype=torch.float64).requires_grad_()
    g = (torch.rand(2, 6, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    w = make_out_weight(6, torch.float64, "cpu", gen).requires_grad_()

    def fwd(*xs):
        partials, lse, *_ = torch.ops.attnres.block_reads_fwd(
            list(xs[:3]), xs[3], xs[4], 1e-6, 0.8, xs[5], 1e-4, False)
        return (*partials, lse)

    assert torch.autograd.gradcheck(fwd, (*srcs, q, g, w))
    gen32 = torch.Generator().manual_seed(47)
    s32 = make_sources(3, (4,), 10, torch.float32, "cpu", gen32, requires_grad=True)
    q32 = torch.randn(3, 10, generator=gen32).requires_grad_()
    w32 = make_out_weight(10, torch.float32, "cpu", gen32).requires_grad_()
    for keep_h in (False, True):
        torch.library.opcheck(torch.ops.attnres.block_reads_fwd,
                              (s32, q32, None, 1e-6, 1.0, w32, 1e-5, keep_h))
    det = [s.detach() for s in s32]
    partials, lse, rstd, weights, h, out_rstd = torch.ops.attnres.block_reads_fwd(
        det, q32.detach(), None, 1e-6, 1.0, w32.detach(), 1e-5, True)
    plain = attnres.block_reads(det, q32.detach())[0]
    assert torch.equal(h, plain[0])
    assert all(torch.equal(a, b) for a, b in zip(partials[1:], plain[1:]))
    assert out_rstd.shape == (4,) and out_rstd.dtype == torch.float32
    _, _, _, _, h_empty, out_rstd_empty = torch.ops.attnres.block_reads_fwd(
        det, q32.detach(), None, 1e-6, 1.0)
    assert h_empty.shape == (0,) and out_rstd_empty.shape == (0,)
    dys = [torch.randn(p.shape, generator=gen32) for p in partials]
    bwd_args = (dys, lse, det, q32.detach(), None, rstd, weights, 1.0)
    tail = (w32.detach(), h, out_rstd)
    for mask in ([True] * 6, [False, True, False, True, False, True], [False] * 5 + [True]):
        torch.library.opcheck(torch.ops.attnres.block_reads_bwd, (*bwd_args, mask, *tail))
    with pytest.raises(ValueError, match=re.escape(
            "output_mask must have 6 entries (each source, queries, norm_weights, out_weight), "
            "got 5")):
        torch.ops.attnres.block_reads_bwd(*bwd_args, [True] * 5, *tail)
    with pytest.raises(ValueError, match=re.escape(
            "output_mask must have 5 entries (each source, queries, norm_weights), got 6")):
        torch.ops.attnres.block_reads_bwd(*bwd_args, [True] * 6)
    with pytest.raises(ValueError, match=re.escape(
            "h (the forward's read before the output norm) must have the sources' shape")):
        torch.ops.attnres.block_reads_bwd(*bwd_args, [True] * 6, w32.detach(), h.new_empty(0),
                                          out_rstd)
    # The out_weight gradient: same bits on any thread count.
    big = make_sources(3, (700,), 128, torch.bfloat16, "cpu", gen32)
    qb = torch.randn(2, 128, generator=gen32)
    wb = make_out_weight(128, torch.bfloat16, "cpu", gen32)
    dyb = [torch.randn(700, 128, generator=gen32).to(torch.bfloat16) for _ in range(2)]
    threads, results = torch.get_num_threads(), []
    try:
        for nt in (1, max(2, threads)):
            torch.set_num_threads(nt)
            leaves = [t.clone().requires_grad_() for t in (*big, qb, wb)]
            outs = attnres.block_reads(leaves[:3], leaves[3], out_weight=leaves[4])[0]
            results.append(torch.autograd.grad(outs, leaves, dyb))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---- modules: two-phase reads with the fused norm ------------------------------------


class NormedCalls:
    """Counts the two-phase op calls the modules make with an output norm."""

    def __init__(self, monkeypatch):
        import attnres.modules as modules_mod

        self.phase1 = self.merge = 0
        for name in ("block_reads", "block_read_merge", "block_read_merge_inplace"):
            real = getattr(modules_mod, name)

            def counted(*a, _real=real, _name=name, **k):
                if k.get("out_weight") is not None:
                    if _name == "block_reads":
                        self.phase1 += 1
                    else:
                        self.merge += 1
                return _real(*a, **k)

            monkeypatch.setattr(modules_mod, name, counted)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S", [2, 3])
def test_module_two_phase_normed_reads_equal_one_call_reads(dtype, S, monkeypatch):
    """A stack of normed readers in a Block stream: two-phase reads (norm
    fused into phase 1's reader 0 and into the merges) give the one-call
    normed reads' outputs and gradients, training and inference."""
    d, L = 24, 7
    gen = torch.Generator().manual_seed(53)
    pd = param_dtype(dtype)
    readers = [attnres.AttnResResidual(d, out_norm="rmsnorm", out_eps=1e-5, dtype=pd)
               for _ in range(L + 1)]
    with torch.no_grad():
        for r in readers:
            r.query.normal_(0, d ** -0.5, generator=gen)
            r.out_weight.uniform_(0.5, 1.5, generator=gen)
    mats = [(torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5).to(dtype)
            for _ in range(L)]
    emb = torch.randn(3, 5, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    params = [emb, *[p for r in readers for p in r.parameters()]]

    def run(mode, grad=True):
        with torch.set_grad_enabled(grad):
            stream = attnres.DepthStream(emb, block_size=S, block_reads=mode, readers=readers)
            for res, m in zip(readers[:-1], mats):
                stream.append(torch.tanh(res(stream) @ m))
            out = readers[-1](stream)
        if not grad:
            return out, None
        return out, torch.autograd.grad(out.double().pow(2).sum(), params)

    want, want_grads = run("one_call")
    calls = NormedCalls(monkeypatch)
    got, got_grads = run("two_phase")
    blocks = -(-(L + 1) // S)
    assert calls.phase1 == blocks and calls.merge == L + 1 - blocks
    # Two computations in the dtype, each within the tables' bounds of the
    # truth: twice the bound between them.
    assert_rel_close(got, want, 2 * REL_TOL[dtype], "y")
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert_rel_close(a, b, 2 * GRAD_REL_TOL[dtype], f"grad {i}")
    want_inf, _ = run("one_call", grad=False)
    got_inf, _ = run("two_phase", grad=False)
    assert calls.phase1 == 2 * blocks and calls.merge == 2 * (L + 1 - blocks)
    assert_rel_close(got_inf, want_inf, 2 * REL_TOL[dtype], "inference y")


def test_auto_reads_normed_readers_two_phase(monkeypatch):
    """"auto" treats a normed reader like a plain one: two-phase from the
    third completed source on (fp32 training)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_layers=4, n_heads=2,
                    residual="block", block_size=2, norm="rmsnorm", block_reads="auto")
    model = GPT(cfg)
    randomize_reads(model)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    calls = NormedCalls(monkeypatch)
    model(idx, idx)[1].backward()
    assert calls.phase1 > 0 and calls.merge > 0


def test_block_gpt_rmsnorm_trains_alike_under_two_phase_and_one_call(monkeypatch):
    """AdamW steps of a Block GPT with norm="rmsnorm" (every read normed):
    the loss trajectory of "one_call" under "two_phase"."""
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 32, (4, 8), generator=gen) for _ in range(6)]
    losses = {}
    for mode in ("one_call", "two_phase"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_layers=4, n_heads=2,
                              residual="block", block_size=2, norm="rmsnorm", block_reads=mode))
        randomize_reads(model)
        opt = torch.optim.AdamW(attnres.param_groups(model, lr=3e-3, weight_decay=0.1))
        calls = NormedCalls(monkeypatch)
        losses[mode] = []
        for idx in batches:
            opt.zero_grad(set_to_none=True)
            _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
        assert (calls.merge > 0) == (mode == "two_phase")
    torch.testing.assert_close(torch.tensor(losses["two_phase"]),
                               torch.tensor(losses["one_call"]), rtol=1e-5, atol=0)
    assert losses["two_phase"][-1] < losses["two_phase"][0]
