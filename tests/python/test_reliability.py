"""Regression tests of the red-team findings: each was a silently wrong
answer (second derivatives of zero, garbage from a meta tensor among CPU
tensors, an unchecked scale, uniform weights for rows whose sum of squares
overflows, N = 1 ignoring a NaN score, internal-error messages). The ground
truth at extreme magnitudes is tests/python/float64_reference.py (not
attnres.reference, whose float32 evaluation overflows the same way)."""
import math
import warnings

import pytest
import torch

import attnres
from attnres import ops
from float64_reference import depth_attention_ref, forward_and_grads
from float64_reference import rel_err
from helpers import (CUDA_SKIP_REASON, DEVICES, GRAD_REL_TOL, RANGE_MAGNITUDES, REL_TOL, STAT_REL_TOL,
                     backward_op, extreme_sources, param_dtype)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _problem(n=3, lead=(4,), d=8, dtype=torch.float32, device="cpu", seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(*lead, d, generator=gen).to(dtype).to(device).requires_grad_(requires_grad)
            for _ in range(n)]
    pd = param_dtype(dtype)
    q = (torch.randn(d, generator=gen) / math.sqrt(d)).to(pd).to(device).requires_grad_(requires_grad)
    g = (1 + 0.2 * torch.randn(d, generator=gen)).to(pd).to(device).requires_grad_(requires_grad)
    return srcs, q, g


# ---- 1. second derivatives raise, never silently zero -------------------------------------

SECOND_ORDER_MATCH = "second derivatives of depth_attention are not implemented"


def test_double_backward_through_create_graph_raises():
    srcs, q, g = _problem(dtype=torch.float64, requires_grad=True)
    h = attnres.depth_attention(srcs, q, g)
    grads = torch.autograd.grad(h.pow(2).sum(), [*srcs, q, g], create_graph=True)
    for gr in grads:
        with pytest.raises(RuntimeError, match=SECOND_ORDER_MATCH):
            torch.autograd.grad(gr.sum(), [*srcs, q, g], allow_unused=True)


def test_hessian_raises():
    srcs, q, g = _problem(dtype=torch.float64)
    with pytest.raises(RuntimeError, match=SECOND_ORDER_MATCH):
        torch.autograd.functional.hessian(lambda qq: attnres.depth_attention(srcs, qq, g).sum(), q)
    with pytest.raises(RuntimeError, match=SECOND_ORDER_MATCH):
        torch.autograd.functional.hessian(
            lambda s0: attnres.depth_attention([s0, *srcs[1:]], q, g).sum(), srcs[0])


def test_gradient_penalty_raises():
    """A WGAN-GP style penalty on the input gradient: must raise, not train
    on a zero second-order term."""
    srcs, q, g = _problem(dtype=torch.float64, requires_grad=True)
    h = attnres.depth_attention(srcs, q, g)
    (gs,) = torch.autograd.grad(h.sum(), [srcs[1]], create_graph=True)
    penalty = (gs.norm(dim=-1) - 1).pow(2).mean()
    with pytest.raises(RuntimeError, match=SECOND_ORDER_MATCH):
        penalty.backward()


def test_weights_gradient_penalty_raises():
    srcs, q, g = _problem(dtype=torch.float64, requires_grad=True)
    _, w = attnres.depth_attention(srcs, q, g, return_weights=True)
    (gq,) = torch.autograd.grad(w[0].sum(), [q], create_graph=True)
    with pytest.raises(RuntimeError, match=SECOND_ORDER_MATCH):
        gq.pow(2).sum().backward()



def test_forward_mode_ad_raises_never_drops_the_tangent():
    """Forward-mode AD (dual tensors, torch.func.jvp) is not implemented: each
    forward op refuses it, also when nothing records a backward (no_grad, no
    input requiring grad), where the op otherwise runs its kernel alone."""
    import torch.autograd.forward_ad as fwAD

    srcs, q, g = _problem(dtype=torch.float64)
    ops = torch.ops.attnres
    calls = {
        "depth_attention": lambda qq, s0: attnres.depth_attention([s0, *srcs[1:]], qq, g),
        "block_reads": lambda qq, s0: ops.block_reads_fwd([s0, *srcs[1:]], torch.stack([qq, q]), None,
                                                          1e-6, 1.0)[0],
        "block_read_merge": lambda qq, s0: ops.block_read_merge_fwd(
            s0, torch.zeros(4, dtype=torch.float64), srcs[1], qq, g, 1e-6, 1.0)[0],
    }
    for name, call in calls.items():
        for grad_mode in (True, False):
            for dual_query in (True, False):
                with fwAD.dual_level(), torch.set_grad_enabled(grad_mode):
                    tangent = torch.randn_like(q if dual_query else srcs[0])
                    qq = fwAD.make_dual(q, tangent) if dual_query else q
                    s0 = srcs[0] if dual_query else fwAD.make_dual(srcs[0], tangent)
                    with pytest.raises(RuntimeError):
                        call(qq, s0)
                        pytest.fail(f"{name}: a forward-mode tangent was dropped "
                                    f"(grad mode {grad_mode}, dual {'query' if dual_query else 'source'})")
        with pytest.raises(RuntimeError):
            torch.func.jvp(lambda qq: call(qq, srcs[0]), (q,), (torch.randn_like(q),))

# ---- 2. a meta tensor among CPU tensors: a clear ValueError in every position ---------------


def _fwd_args(srcs, q, g):
    return [list(srcs), q, g, 1e-6, 1.0]


FWD_POSITIONS = ["source0", "source1", "query", "norm_weight"]


@pytest.mark.parametrize("position", FWD_POSITIONS)
def test_forward_meta_tensor_among_cpu_tensors_raises(position):
    srcs, q, g = _problem()
    if position == "source0":
        srcs[0] = srcs[0].to("meta")
    elif position == "source1":
        srcs[1] = srcs[1].to("meta")
    elif position == "query":
        q = q.to("meta")
    else:
        g = g.to("meta")
    with pytest.raises(ValueError, match="device"):
        torch.ops.attnres.depth_attention_fwd(*_fwd_args(srcs, q, g))
    with pytest.raises(ValueError, match="device"):
        attnres.depth_attention(srcs, q, g)


BWD_POSITIONS = ["h", "rstd", "weights", "grad_out", "grad_weights", "query", "norm_weight", "source0",
                 "source2"]


@pytest.mark.parametrize("position", BWD_POSITIONS)
def test_backward_meta_tensor_among_cpu_tensors_raises(position):
    srcs, q, g = _problem()
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(*_fwd_args(srcs, q, g))
    dh = torch.randn_like(srcs[0])
    gw = torch.randn_like(w)
    meta = lambda t: t.to("meta")  # noqa: E731
    if position == "h":
        h = meta(h)
    elif position == "rstd":
        rstd = meta(rstd)
    elif position == "weights":
        w = meta(w)
    elif position == "grad_out":
        dh = meta(dh)
    elif position == "grad_weights":
        gw = meta(gw)
    elif position == "query":
        q = meta(q)
    elif position == "norm_weight":
        g = meta(g)
    elif position == "source0":
        srcs[0] = meta(srcs[0])
    else:
        srcs[2] = meta(srcs[2])
    with pytest.raises(ValueError, match="device") as info:
        backward_op(dh, srcs, q, g, h, rstd, w, 1.0, grad_weights=gw)
    assert "must be on the sources' device" in str(info.value) or "is on device" in str(info.value)


def test_all_meta_backward_still_traces():
    """All-meta arguments are what the fake kernel is for: shapes, no error."""
    srcs, q, g = _problem()
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(*_fwd_args(srcs, q, g))
    m = lambda t: t.to("meta")  # noqa: E731
    grads, gq, gg = backward_op(m(torch.randn_like(srcs[0])), [m(s) for s in srcs], m(q), m(g), m(h),
                                m(rstd), m(w), 1.0)[:3]
    assert [x.shape for x in grads] == [s.shape for s in srcs] and gq.shape == q.shape
    assert all(x.device.type == "meta" for x in [*grads, gq, gg])


# ---- 3. scale must be finite ---------------------------------------------------------------------

BAD_SCALES = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", BAD_SCALES, ids=str)
def test_non_finite_scale_raises(device, scale):
    srcs, q, g = _problem(device=device)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        attnres.depth_attention(srcs, q, g, scale=scale)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        torch.ops.attnres.depth_attention_fwd(list(srcs), q, g, 1e-6, scale)
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(list(srcs), q, g, 1e-6, 1.0)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        backward_op(torch.randn_like(srcs[0]), srcs, q, g, h, rstd, w, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eps_and_scale_beyond_float32_raise_for_float32_accumulation(dtype):
    """eps and scale enter the kernels in float32 for these sources: 1e39
    would be inf there (u = inf * 0 = NaN for a zero query)."""
    srcs, q, g = _problem(dtype=dtype)
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        attnres.depth_attention(srcs, q, g, scale=1e39)
    with pytest.raises(ValueError, match="eps must be finite in float32"):
        attnres.depth_attention(srcs, q, g, eps=1e39)
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        torch.ops.attnres.depth_attention_fwd(list(srcs), q, g, 1e-6, -1e39)
    # float64 sources accumulate in float64: fine there.
    srcs64 = [s.double() for s in srcs]
    h = attnres.depth_attention(srcs64, q.double(), g.double(), scale=1e39)
    assert h.shape == srcs[0].shape


# ---- 4. sums of squares that overflow / underflow ------------------------------------------------


def _check_against_ref(srcs, q, g, dtype, *, eps=1e-6, scale=1.0, seed=0, grad_weights=True, what=""):
    gen = torch.Generator().manual_seed(seed)
    dh = torch.randn(srcs[0].shape, generator=gen, dtype=torch.float64).to(dtype)
    gw = torch.randn((len(srcs), *srcs[0].shape[:-1]), generator=gen) if grad_weights else None
    device = srcs[0].device
    ours = forward_and_grads(
        lambda s, qq, gg, **kw: attnres.depth_attention(s, qq, gg, return_weights=True, **kw),
        srcs, q, g, dh.to(device), None if gw is None else gw.to(device), eps=eps, scale=scale)
    ref = forward_and_grads(depth_attention_ref, [s.double().cpu() for s in srcs], q.double().cpu(),
                            None if g is None else g.double().cpu(), dh.double(), gw, eps=eps, scale=scale)
    assert torch.isfinite(ours[0]).all() and torch.isfinite(ours[1]).all(), what
    assert rel_err(ours[0], ref[0]) <= REL_TOL[dtype], f"{what} h: {rel_err(ours[0], ref[0]):.3g}"
    assert rel_err(ours[1], ref[1]) <= max(STAT_REL_TOL[dtype], 1e-5), f"{what} weights"
    n = len(srcs)
    for k, (a, b) in enumerate(zip(ours[2], ref[2])):
        if b is None:
            continue
        # A true gradient beyond the dtype's maximum is inf (or NaN). The
        # query/gain gradients are scale * gain * Z with Z summed over tokens
        # in the accumulation dtype: when they come near the maximum, the
        # per-token terms of Z can exceed it although the sum would not
        # (docs/design.md §8's limit), so they are not checked there.
        limit = torch.finfo(a.dtype).max
        if k >= n and (b.abs() > limit / 8).any():
            continue
        representable = b.abs() <= limit
        assert torch.isfinite(a.cpu()[representable]).all(), f"{what} grad {k} not finite"
        err = rel_err(a.cpu()[representable], b[representable])
        assert err <= GRAD_REL_TOL[dtype], f"{what} grad {k}: {err:.3g}"


@pytest.mark.parametrize("device", DEVICES)
def test_issue_example_rows_of_3e19(device):
    """N = 2, D = 4, rows of +-3e19: weights were [0.5, 0.5] (sum of squares
    inf, r = 0, score 0); correct is [0.982, 0.018]."""
    v0 = torch.full((1, 4), 3e19, device=device)
    v1 = torch.tensor([[3e19, -3e19, 3e19, -3e19]], device=device)
    q = torch.ones(4, device=device)
    h, w = attnres.depth_attention([v0, v1], q, return_weights=True)
    ref_h, ref_w = depth_attention_ref([v0.double().cpu(), v1.double().cpu()], q.double().cpu())
    torch.testing.assert_close(w.cpu().double(), ref_w, rtol=1e-6, atol=0)
    assert abs(w[0, 0].item() - 0.98201379) < 1e-6
    assert rel_err(h, ref_h) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_gain", [True, False])
def test_extreme_magnitudes_forward_and_gradients(device, dtype, with_gain):
    """Finite inputs anywhere in the dtype's range: h, the weights and every
    gradient match the float64 reference (CPU; CUDA where a GPU is visible,
    except float64 backward on CUDA beyond |v| ~ 1e150, or below ~ 1e-150 with
    eps = 0, docs/design.md §8)."""
    gen = torch.Generator().manual_seed(1)
    for mag in RANGE_MAGNITUDES[dtype]:
        for n, lead, d in ((2, (3,), 4), (5, (2, 3), 33), (3, (4,), 256)):
            srcs = extreme_sources(n, lead, d, dtype, mag, device, gen)
            q = (torch.randn(d, generator=gen, dtype=torch.float64) * 2 / math.sqrt(d)).to(
                param_dtype(dtype)).to(device)
            g = (1 + 0.3 * torch.rand(d, generator=gen, dtype=torch.float64)).to(
                param_dtype(dtype)).to(device) if with_gain else None
            if device == "cuda" and dtype == torch.float64 and mag > 1e150:
                continue
            for eps in (1e-6, 0.0):
                if device == "cuda" and dtype == torch.float64 and mag < 1e-150 and eps == 0.0:
                    continue  # r^2 overflows: the same limit for tiny rows when eps does not dominate
                _check_against_ref(srcs, q, g, dtype, eps=eps, scale=0.9,
                                   what=f"{dtype} mag={mag:g} N={n} D={d} eps={eps}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_magnitudes_in_one_token(device, dtype):
    """A huge, a normal and a tiny source in the same token (the rescued and
    the plain path side by side; the weights saturate on the huge row or
    not, depending on the query)."""
    gen = torch.Generator().manual_seed(2)
    d = 64
    for mags in ((1e38, 1.0, 1e-30), (3e19, 1e-20, 1e30, 1.0), (1e-30, 1e-30)):
        srcs = [((torch.rand(5, d, generator=gen, dtype=torch.float64) * 2 - 1) * m).to(dtype).to(device)
                for m in mags]
        for qscale in (0.0, 0.3, 3.0):
            q = (torch.randn(d, generator=gen, dtype=torch.float64) * qscale / math.sqrt(d)).float().to(device)
            for eps in (1e-6, 0.0):
                _check_against_ref(srcs, q, None, dtype, eps=eps, what=f"{mags} q*{qscale} eps={eps}")


@pytest.mark.parametrize("device", DEVICES)
def test_float16_sum_of_squares_cannot_overflow(device):
    """fp16 maxes out at 65504: the float32 sum of squares of even 16384
    such elements is 7e13, far from float32's limit."""
    v = torch.full((2, 16384), 65504.0, dtype=torch.float16, device=device)
    w = torch.full((2, 16384), -65504.0, dtype=torch.float16, device=device)
    q = torch.full((16384,), 1e-3, device=device)
    h, wt = attnres.depth_attention([v, w], q, return_weights=True)
    _, ref_w = depth_attention_ref([v.double().cpu(), w.double().cpu()], q.double().cpu())
    assert torch.isfinite(h).all()
    torch.testing.assert_close(wt.cpu().double(), ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_values_at_the_maximum_average_without_overflow(device):
    """h is a weighted average, never above max|v|: sources all at the
    dtype's maximum give h at the maximum, not inf (an un-normalized online
    sum would overflow)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        big = torch.finfo(dtype).max
        srcs = [torch.full((3, 8), big, dtype=dtype, device=device) for _ in range(4)]
        h = attnres.depth_attention(srcs, torch.zeros(8, dtype=param_dtype(dtype), device=device))
        assert torch.isfinite(h).all(), dtype
        assert rel_err(h, torch.full((3, 8), big, dtype=torch.float64)) < REL_TOL[dtype]


# The weights of a token sum to 1 only up to rounding: at the dtype's maximum
# a sum of weights a little above 1 overflowed to inf (the one-call read for
# N >= 6, the merge for n = 3, 6, 10, ...). h is a weighted average, so
# |h| <= max|v|; tokens whose rows took the range rescue keep it finite
# (docs/design.md §8).
MAX_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


def _at_the_maximum(dtype, n, device="cpu", d=8, tokens=3):
    big = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(n)
    # Columns at +max, at -max, and a random mix of max and max / 2; token 0
    # at +max throughout.
    srcs = []
    for i in range(n):
        col = torch.where(torch.rand(tokens, d, generator=gen) < 0.5, 1.0, 0.5).double() * big
        col[:, 1] = -big
        col[:, 0] = big
        col[0] = big
        srcs.append(col.to(dtype).to(device))
    return srcs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MAX_DTYPES, ids=str)
def test_one_call_read_at_the_maximum_stays_finite(device, dtype):
    for n in range(1, 14):
        srcs = _at_the_maximum(dtype, n, device)
        d = srcs[0].shape[-1]
        for q in (torch.zeros(d), torch.linspace(-1, 1, d)):
            q = q.to(param_dtype(dtype)).to(device)
            h = attnres.depth_attention(srcs, q)
            hd = h.double().cpu()
            assert torch.isfinite(hd).all(), (dtype, n)
            _, ref_w = depth_attention_ref([s.double().cpu() for s in srcs], q.double().cpu())
            # Compared in units of the maximum (fp64's norms would overflow).
            big = torch.finfo(dtype).max
            ref_h = sum(w[..., None] * (s.double().cpu() / big) for w, s in zip(ref_w, srcs))
            assert rel_err(hd / big, ref_h) < REL_TOL[dtype], (dtype, n)
            # The fused output norm reads the same h.
            y = attnres.depth_attention(srcs, q, out_weight=torch.ones(d, dtype=param_dtype(dtype),
                                                                      device=device))
            assert torch.isfinite(y).all(), (dtype, n)


@pytest.mark.parametrize("dtype", MAX_DTYPES, ids=str)
def test_block_reads_at_the_maximum_stay_finite(dtype):
    d = 8
    pd = param_dtype(dtype)
    queries = torch.stack([torch.zeros(d), torch.linspace(-1, 1, d)]).to(pd)
    for n in range(1, 14):
        srcs = _at_the_maximum(dtype, n)
        outs, lse = attnres.block_reads(srcs, queries)
        big = torch.finfo(dtype).max
        for s, y in enumerate(outs):
            assert torch.isfinite(y).all(), (dtype, n)
            one_call = attnres.depth_attention(srcs, queries[s]).double()
            assert rel_err(y.double() / big, one_call / big) < REL_TOL[dtype], (dtype, n, s)
        # Phase 2 with a block sum at the maximum too: equal to the one-call
        # read over the n sources and the block sum.
        block = _at_the_maximum(dtype, n + 1)[-1]
        for s in range(2):
            for h in (attnres.block_read_merge(outs[s], lse[s], block, queries[s]),
                      attnres.block_read_merge(outs[s], lse[s], block, queries[s],
                                               out_weight=torch.ones(d, dtype=pd))):
                assert torch.isfinite(h).all(), (dtype, n, s)
            h = attnres.block_read_merge(outs[s], lse[s], block, queries[s]).double()
            one_call = attnres.depth_attention(srcs + [block], queries[s]).double()
            assert rel_err(h / big, one_call / big) < REL_TOL[dtype], (dtype, n, s)


# ---- 5. N = 1 with a NaN score agrees with softmax (NaN) -----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["nan_query", "inf_source", "neg_inf_source", "nan_source"])
@pytest.mark.parametrize("n", [1, 2])
def test_nan_score_gives_nan_like_softmax(device, dtype, case, n):
    srcs, q, g = _problem(n=n, lead=(3,), d=8, dtype=dtype, device=device)
    with torch.no_grad():
        if case == "nan_query":
            q = q.clone()
            q[2] = float("nan")
        else:
            value = {"inf_source": float("inf"), "neg_inf_source": float("-inf"), "nan_source": float("nan")}[case]
            srcs[0][1, 5] = value
    srcs = [s.requires_grad_(True) for s in srcs]
    h, w = attnres.depth_attention(srcs, q, g, return_weights=True)
    ref_h, ref_w = attnres.reference.depth_attention([s.detach().double() for s in srcs], q.double(),
                                                    g.double(), return_weights=True)
    poisoned = [0, 1, 2] if case == "nan_query" else [1]
    # softmax says NaN for these tokens; the op must not return the source.
    assert torch.isnan(ref_h[poisoned]).all() and torch.isnan(ref_w[:, poisoned]).all()
    assert torch.isnan(h[poisoned]).all(), h
    assert torch.isnan(w[:, poisoned]).all(), w
    keep = [t for t in range(3) if t not in poisoned]
    assert torch.isfinite(h[keep]).all() and torch.isfinite(w[:, keep]).all()
    h.sum().backward()
    for s in srcs:
        assert torch.isnan(s.grad[poisoned]).all()
        assert torch.isfinite(s.grad[keep]).all()


# ---- 6. messages that name the argument -------------------------------------------------------


@pytest.fixture
def quiet_nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        yield


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided_nested", "jagged"])
@pytest.mark.parametrize("position", [0, 1])
def test_nested_source_names_the_argument(quiet_nested, layout, position):
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout)
    srcs = [torch.randn(2, 4), torch.randn(2, 4)]
    srcs[position] = nt
    with pytest.raises(ValueError, match=rf"sources\[{position}\] is a nested tensor"):
        attnres.depth_attention(srcs, torch.zeros(4))
    if layout == torch.strided:
        with pytest.raises(ValueError, match=rf"sources\[{position}\] is a nested tensor"):
            torch.ops.attnres.depth_attention_fwd(srcs, torch.zeros(4), None, 1e-6, 1.0)


def test_nested_query_and_backward_arguments_name_the_argument(quiet_nested):
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="query is a nested tensor"):
        torch.ops.attnres.depth_attention_fwd([x], torch.nested.nested_tensor([torch.zeros(4)]), None, 1e-6, 1.0)
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd([x, x], torch.zeros(4), None, 1e-6,
                                                                   1.0)
    nt = torch.nested.nested_tensor([torch.randn(4), torch.randn(4)])
    with pytest.raises(ValueError, match="grad_out is a nested tensor"):
        backward_op(nt, [x, x], torch.zeros(4), None, h, rstd, w, 1.0)
    with pytest.raises(ValueError, match="h is a nested tensor"):
        backward_op(torch.randn(2, 4), [x, x], torch.zeros(4), None, nt, rstd, w, 1.0)


@pytest.mark.parametrize("position", ["source", "query", "norm_weight"])
def test_sparse_tensor_names_the_argument(position):
    srcs = [torch.randn(2, 4), torch.randn(2, 4)]
    q, g = torch.zeros(4), torch.ones(4)
    if position == "source":
        srcs[1] = srcs[1].to_sparse()
        words = r"sources\[1\] has layout"
    elif position == "query":
        q = q.to_sparse()
        words = "query has layout"
    else:
        g = g.to_sparse()
        words = "norm_weight has layout"
    with pytest.raises(ValueError, match=words):
        attnres.depth_attention(srcs, q, g)
    with pytest.raises(ValueError, match=words):
        ops.check_args(srcs, q, g)


@pytest.mark.parametrize("name", ["eps", "scale"])
@pytest.mark.parametrize("value", ["1e-6", None, torch.tensor(1e-6), [1e-6], True])
def test_eps_and_scale_of_the_wrong_type_name_the_argument(name, value):
    srcs, q, g = _problem()
    with pytest.raises(TypeError, match=f"{name} must be a number"):
        attnres.depth_attention(srcs, q, g, **{name: value})


def test_numpy_and_int_eps_scale_are_numbers():
    np = pytest.importorskip("numpy")
    srcs, q, g = _problem()
    ref = attnres.depth_attention(srcs, q, g, eps=1e-6, scale=2.0)
    torch.testing.assert_close(attnres.depth_attention(srcs, q, g, eps=np.float32(1e-6), scale=np.int64(2)), ref)
    torch.testing.assert_close(attnres.depth_attention(srcs, q, g, eps=1e-6, scale=2), ref)


@pytest.mark.parametrize("value", ["1e-6", None, torch.tensor(1e-6)])
def test_module_eps_of_the_wrong_type_names_the_argument(value):
    with pytest.raises(TypeError, match="eps must be a number"):
        attnres.AttnResResidual(8, eps=value)
    assert attnres.AttnResResidual(8, eps=1).eps == 1.0  # an int is a number


# ---- saturated depth softmax feeding an RMSNorm -----------------------------
# One source aligned with the query (median 1 - a_max 5.5e-5, 1.7e-6 and 0
# in float64 at |q| = 1.5, 2, 3), the read's gradient coming through an
# RMSNorm (a separate F.rms_norm, or the fused out_weight): dh is then
# orthogonal to h, and the query/gain gradients are a small difference. The
# single-pass backward's <dh, h - v_p> from the rounded h lost ~2^-24 /
# (1 - a_max) of it (fp32 query/gain gradients 6.8e-5 to 1.6e-3 against
# eager's ~3e-7 before Pivot::saturated, on the CPU).
def _saturated_case(dtype, qnorm, device, fused, T=512, D=256, N=4):
    from attnres import reference

    gen = torch.Generator().manual_seed(11)
    src = [torch.randn(T, D, generator=gen, dtype=torch.float64) for _ in range(N)]
    q = torch.randn(D, generator=gen, dtype=torch.float64)
    q = q / q.norm()
    src[1] = src[1] + 9 * q
    q = q * qnorm
    w = 1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    ow = 1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    pd = param_dtype(dtype)

    def grads(fn, dt, pdt):
        s = [x.to(dt).to(device).requires_grad_() for x in src]
        qq, ww, oww = (x.to(pdt).to(device).requires_grad_() for x in (q, w, ow))
        if fused and fn is attnres.depth_attention:
            y = fn(s, qq, ww, out_weight=oww, out_eps=1e-6)
        else:
            h = fn(s, qq, ww)
            y = torch.nn.functional.rms_norm(h, (D,), oww.to(h.dtype), eps=1e-6)
        loss = (y.double() * torch.linspace(-1, 1, D, dtype=torch.float64, device=device)).sum()
        return [g.double().cpu() for g in torch.autograd.grad(loss, s + [qq, ww])]

    return (grads(attnres.depth_attention, dtype, pd), grads(reference.depth_attention, dtype, pd),
            grads(reference.depth_attention, torch.float64, torch.float64))


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason=CUDA_SKIP_REASON)),
])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "out_weight"])
def test_saturated_read_feeding_a_norm_keeps_eager_accuracy(device, dtype, fused):
    from helpers import assert_within_eager

    for qnorm in (1.5, 2.0, 3.0):
        ours, eager, ref = _saturated_case(dtype, qnorm, device, fused)
        names = [f"grad sources[{i}]" for i in range(len(ours) - 2)] + ["grad query", "grad gain"]
        for o, e, r, name in zip(ours, eager, ref, names):
            what = f"|q| = {qnorm}: {name}"
            if dtype == torch.float64:
                # Eager in fp64 is the reference itself; the table's 1e-10 let
                # the h-based form's 1e-11 through, fp64 rounding gives ~1e-15.
                assert rel_err(o, r) <= 1e-13, f"{what}: {rel_err(o, r):.3g}"
            else:
                assert_within_eager(o, e, r, dtype, "grad", what)
