"""The read with a fused output norm (docs/design.md §11):
depth_attention(..., out_weight=w, out_eps=e) = RMSNorm(h, e) * w, the ops
depth_attention_normed_fwd/bwd, AttnResResidual(out_norm="rmsnorm") and the
example GPT with norm="rmsnorm"."""
import functools

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
        y, _h, _rstd, weights, _out_rstd = torch.ops.attnres.depth_attention_normed_fwd(
            list(xs[:4]), xs[4], gain, xs[5], 1e-6, 0.8, 1e-4, False)
        return y, weights

    args = (*srcs, q, w, g) if with_gain else (*srcs, q, w)
    assert torch.autograd.gradcheck(fwd, args)


def test_opcheck():
    """torch.library.opcheck on both ops: schema, fake kernel, autograd
    registration (the backward op through its own node)."""
    gen = torch.Generator().manual_seed(5)
    srcs = make_sources(3, (4,), 10, torch.float32, "cpu", gen, requires_grad=True)
    q, g = make_params(10, torch.float32, "cpu", gen, requires_grad=True)
    w = make_out_weight(10, torch.float32, "cpu", gen).requires_grad_()
    for keep_h in (False, True):
        torch.library.opcheck(torch.ops.attnres.depth_attention_normed_fwd,
                              (srcs, q, g, w, 1e-6, 1.0, 1e-5, keep_h))
    y, h, rstd, weights, out_rstd = torch.ops.attnres.depth_attention_normed_fwd(
        [s.detach() for s in srcs], q.detach(), g.detach(), w.detach(), 1e-6, 1.0, 1e-5, True)
    dy = torch.randn_like(y)
    for mask in ([True] * 6, [False, True, False, True, False, True], [True, False, False, False, True, False]):
        torch.library.opcheck(torch.ops.attnres.depth_attention_normed_bwd,
                              (dy, None, [s.detach() for s in srcs], q.detach(), g.detach(),
                               w.detach(), h, rstd, weights, out_rstd, 1.0, mask))


def test_kept_h_is_the_plain_reads_h_and_y_its_norm():
    """keep_h returns the plain op's h bit for bit, and y is RMSNorm of the
    unrounded h (fp64: equal to the composite to rounding)."""
    gen = torch.Generator().manual_seed(9)
    for dtype in DTYPES:
        srcs = make_sources(6, (4, 3), 200, dtype, "cpu", gen)
        q, g = make_params(200, dtype, "cpu", gen)
        w = make_out_weight(200, dtype, "cpu", gen)
        y, h, rstd, weights, out_rstd = torch.ops.attnres.depth_attention_normed_fwd(
            srcs, q, g, w, 1e-6, 1.0, 1e-5, True)
        h_plain, rstd_plain, weights_plain = torch.ops.attnres.depth_attention_fwd(
            srcs, q, g, 1e-6, 1.0)
        assert torch.equal(h, h_plain) and torch.equal(weights, weights_plain), dtype
        assert torch.equal(rstd, rstd_plain), dtype
        assert out_rstd.shape == (4, 3) and out_rstd.dtype == weights.dtype
        y_none, h_none, *_ = torch.ops.attnres.depth_attention_normed_fwd(
            srcs, q, g, w, 1e-6, 1.0, 1e-5, False)
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
    y, h, *_ = torch.ops.attnres.depth_attention_normed_fwd(srcs, q, g, w, 1e-6, 1.0, 1e-6, False)
    assert h.numel() == 0 and y.requires_grad and not h.requires_grad
    y.sum().backward()
    assert all(s.grad is not None for s in srcs) and w.grad is not None
    with torch.no_grad():
        y2, h2, *_ = torch.ops.attnres.depth_attention_normed_fwd(srcs, q, g, w, 1e-6, 1.0,
                                                                   1e-6, False)
    assert h2.numel() == 0 and torch.equal(y2, y.detach())


def test_backward_op_computes_only_what_the_mask_asks():
    gen = torch.Generator().manual_seed(4)
    srcs = make_sources(3, (5,), 16, torch.float64, "cpu", gen)
    q, g = make_params(16, torch.float64, "cpu", gen)
    w = make_out_weight(16, torch.float64, "cpu", gen)
    y, h, rstd, weights, out_rstd = torch.ops.attnres.depth_attention_normed_fwd(
        srcs, q, g, w, 1e-6, 1.0, 1e-6, True)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    args = (dy, None, srcs, q, g, w, h, rstd, weights, out_rstd, 1.0)
    all_grads = torch.ops.attnres.depth_attention_normed_bwd(*args, [True] * 6)
    some = torch.ops.attnres.depth_attention_normed_bwd(*args, [False, True, False, False, False, True])
    assert len(some[0]) == 1 and some[1] is None and some[2] is None
    assert torch.equal(some[0][0], all_grads[0][1]) and torch.equal(some[3], all_grads[3])
    only_w = torch.ops.attnres.depth_attention_normed_bwd(*args, [False] * 5 + [True])
    assert only_w[0] == [] and torch.equal(only_w[3], all_grads[3])


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
    with FakeTensorMode():  # the fake kernels say the same
        fsrc = [torch.empty(2, 8)]
        with pytest.raises(ValueError, match=r"out_weight must have shape \[D\] = \[8\]"):
            torch.ops.attnres.depth_attention_normed_fwd(fsrc, torch.empty(8), None,
                                                         torch.empty(7), 1e-6, 1.0, 1e-6, False)
        with pytest.raises(ValueError, match="out_eps must be a finite number >= 0"):
            torch.ops.attnres.depth_attention_normed_fwd(fsrc, torch.empty(8), None,
                                                         torch.empty(8), 1e-6, 1.0, -1.0, False)


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
    with pytest.raises(RuntimeError, match="second derivatives"):
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
            s1 = attnres.DepthStream(outputs[0], block_size=block_size, block_reads=block_reads)
            s2 = attnres.DepthStream(outputs[0], block_size=block_size, block_reads=block_reads)
            for step in range(2):  # the second pass uses the learned reader order
                s1 = attnres.DepthStream(outputs[0], block_size=block_size,
                                         block_reads=block_reads)
                s2 = attnres.DepthStream(outputs[0], block_size=block_size,
                                         block_reads=block_reads)
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
