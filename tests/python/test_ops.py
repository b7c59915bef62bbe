"""The fused depth-attention ops against the float64 reference, on every
device present (CUDA cases skip with the reason when no GPU is visible)."""
import math

import pytest
import torch
from torch.library import opcheck

import attnres
from attnres import reference
from helpers import (
    backward_op,
    DEVICES,
    GRAD_REL_TOL,
    REL_TOL,
    TOLERANCES,
    assert_rel_close,
    assert_within_eager,
    forward_backward,
    fp64_leaf,
    make_params,
    make_sources,
    param_dtype,
    rel_err,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
NS = [1, 2, 3, 7, 17, 33, 65]
DS = [1, 3, 64, 1000, 7186]
LEAD_SHAPES = [(2, 3), (5,), ()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("n", NS)
def test_matches_fp64_reference_forward_and_backward(device, dtype, d, n):
    """The op, the eager reference in the same dtype and the float64
    reference on the same inputs: the op's errors must be within the table's
    columns and within the eager-relative rule (helpers.py)."""
    gen = torch.Generator().manual_seed(1000 * n + d)
    lead = LEAD_SHAPES[(n + d) % len(LEAD_SHAPES)]
    srcs = make_sources(n, lead, d, dtype, device, gen)
    q, g = make_params(d, dtype, device, gen)
    dh = torch.randn(srcs[0].shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    # At D = 1 a tiny eps makes the key sign(v) (1 - O(eps / v^2)): the query
    # and gain gradients are then O(eps) cancellations that no evaluation gets
    # to a relative tolerance (not even float64 to 1e-10). eps = 1 keeps every
    # term O(1) there; the other widths use the usual tiny eps.
    kw = dict(eps=1.0 if d == 1 else 1e-6, scale=1.0)

    h, w, gs, gq, gg = forward_backward(attnres.depth_attention, srcs, q, g, dh, **kw)
    assert h.dtype == dtype and h.shape == srcs[0].shape
    assert w.dtype == torch.float32 and w.shape == (n, *lead)
    assert all(gi.dtype == dtype for gi in gs) and gq.dtype == q.dtype and gg.dtype == g.dtype
    eh, ew, egs, egq, egg = forward_backward(reference.depth_attention, srcs, q, g, dh, **kw)
    rh, rw, rgs, rgq, rgg = forward_backward(
        reference.depth_attention, srcs, q, g, dh, to=torch.float64, **kw
    )

    checks = [(h, eh, rh, "output", "h"), (w, ew, rw, "stats", "weights")]
    checks += [(gs[i], egs[i], rgs[i], "grad", f"grad of sources[{i}]") for i in range(n)]
    if n > 1:  # with one source the query and gain gradients are exactly zero
        checks += [(gq, egq, rgq, "grad", "grad of query"), (gg, egg, rgg, "grad", "grad of norm_weight")]
    for ours, eager, ref, kind, what in checks:
        assert_rel_close(ours, ref, TOLERANCES[dtype][kind], what)
        assert_within_eager(ours, eager, ref, dtype, kind, what)


@pytest.mark.parametrize("device", DEVICES)
def test_seed_worked_example(device):
    """The worked example (docs/design.md §1), to 1e-12."""
    e = torch.tensor([2.0, 0, 0], dtype=torch.float64, device=device)
    f1 = torch.tensor([0.0, 4, 0], dtype=torch.float64, device=device)
    f2 = torch.tensor([0.0, 0, 6], dtype=torch.float64, device=device)
    c = math.log(2) / math.sqrt(3)
    cases = [
        ([0.0, c, 0.0], [0.25, 0.5, 0.25], [0.5, 2.0, 1.5]),
        ([c, 0.0, 0.0], [0.5, 0.25, 0.25], [1.0, 1.0, 1.5]),
    ]
    for w, weights, expected in cases:
        query = torch.tensor(w, dtype=torch.float64, device=device)
        h, a = attnres.depth_attention([e, f1, f2], query, eps=0.0, return_weights=True)
        torch.testing.assert_close(h.cpu(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(a.cpu(), torch.tensor(weights), rtol=0, atol=1e-7)
    # The uniform read is an average, not the residual sum [2, 4, 6].
    h0 = attnres.depth_attention([e, f1, f2], torch.zeros(3, dtype=torch.float64, device=device), eps=0.0)
    torch.testing.assert_close(h0.cpu(), torch.tensor([2 / 3, 4 / 3, 2.0], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_query_is_mean_of_sources(device, dtype):
    gen = torch.Generator().manual_seed(7)
    srcs = make_sources(5, (4,), 37, dtype, device, gen)
    q = torch.zeros(37, dtype=param_dtype(dtype), device=device)
    h, w = attnres.depth_attention(srcs, q, return_weights=True)
    mean = torch.stack([s.double() for s in srcs]).mean(0)
    assert rel_err(h, mean) < REL_TOL[dtype]
    torch.testing.assert_close(w.cpu(), torch.full((5, 4), 0.2), rtol=0, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_source_is_identity_with_zero_query_grad(device, dtype):
    gen = torch.Generator().manual_seed(8)
    (src,) = make_sources(1, (3, 5), 64, dtype, device, gen, requires_grad=True)
    q, g = make_params(64, dtype, device, gen, requires_grad=True)
    h = attnres.depth_attention([src], q, g)
    assert torch.equal(h, src)
    dh = torch.randn(h.shape, generator=gen).to(dtype).to(device)
    h.backward(dh)
    assert torch.count_nonzero(q.grad) == 0 and torch.count_nonzero(g.grad) == 0
    assert torch.equal(src.grad, dh)  # weight 1, no key-path term


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_gradcheck_fp64(device, with_gain, scale):
    gen = torch.Generator().manual_seed(11)
    srcs = make_sources(4, (3,), 9, torch.float64, device, gen, requires_grad=True)
    q, g = make_params(9, torch.float64, device, gen, requires_grad=True)
    q = (q.detach() * 3).requires_grad_(True)  # sharper softmax: larger key-path gradients

    def fn(*args):
        return attnres.depth_attention(list(args[:4]), args[4], args[5] if with_gain else None, scale=scale)

    assert torch.autograd.gradcheck(fn, (*srcs, q, g), eps=1e-6, atol=1e-8, rtol=1e-6)


def _op_args(device, dtype=torch.float64, with_gain=True, n=3):
    gen = torch.Generator().manual_seed(12)
    srcs = make_sources(n, (2, 3), 10, dtype, device, gen, requires_grad=True)
    q, g = make_params(10, dtype, device, gen, requires_grad=True)
    return srcs, q, (g if with_gain else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_gain", [False, True])
def test_opcheck_forward(device, dtype, with_gain):
    srcs, q, g = _op_args(device, dtype, with_gain)
    opcheck(torch.ops.attnres.depth_attention_fwd.default, (srcs, q, g, 1e-6, 0.5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_gain", [False, True])
def test_opcheck_backward(device, dtype, with_gain):
    srcs, q, g = _op_args(device, dtype, with_gain)
    srcs = [s.detach() for s in srcs]
    q = q.detach()
    g = g.detach() if g is not None else None
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 0.5)
    dh = torch.randn_like(srcs[0])
    n = len(srcs)
    bwd = torch.ops.attnres.depth_attention_bwd.default
    opcheck(bwd, (dh, None, srcs, q, g, h, rstd, w, 0.5, [True] * (n + 2)))
    # With a gradient of the weights, and only some gradients wanted.
    gw = torch.randn_like(w)
    opcheck(bwd, (dh, gw, srcs, q, g, h, rstd, w, 0.5, [False, True] + [True] * (n - 2) + [True, False]))
    opcheck(bwd, (None, gw, srcs, q, g, h, rstd, w, 0.5, [True] * n + [False, False]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(device, dynamic):
    torch._dynamo.reset()

    def step(srcs, q, g):
        return (attnres.depth_attention(srcs, q, g, eps=1e-5, scale=0.5) ** 2).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for tokens in (5, 9):  # a second shape exercises recompilation / dynamic shapes
        gen = torch.Generator().manual_seed(tokens)
        srcs = make_sources(4, (tokens,), 24, torch.float32, device, gen, requires_grad=True)
        q, g = make_params(24, torch.float32, device, gen, requires_grad=True)
        loss = compiled(srcs, q, g)
        grads = torch.autograd.grad(loss, [*srcs, q, g])
        eager_srcs = [s.detach().requires_grad_(True) for s in srcs]
        eq, eg = q.detach().requires_grad_(True), g.detach().requires_grad_(True)
        eager_loss = step(eager_srcs, eq, eg)
        eager_grads = torch.autograd.grad(eager_loss, [*eager_srcs, eq, eg])
        torch.testing.assert_close(loss, eager_loss)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_stacked_tensor_equals_list(device):
    gen = torch.Generator().manual_seed(13)
    srcs = make_sources(6, (4, 3), 33, torch.float32, device, gen)
    q, g = make_params(33, torch.float32, device, gen)
    stacked = torch.stack(srcs)
    h_list, w_list = attnres.depth_attention(srcs, q, g, return_weights=True)
    h_stack, w_stack = attnres.depth_attention(stacked, q, g, return_weights=True)
    assert torch.equal(h_list, h_stack) and torch.equal(w_list, w_stack)
    assert torch.equal(attnres.depth_attention(tuple(srcs), q, g), h_list)


def _strided_views(leaves, d):
    """Transposed, sliced (row stride 4d), expanded (row stride 0) and
    permuted (D not innermost) views of the leaves, all [5, 6, d]."""
    return [
        leaves[0].transpose(0, 1),
        leaves[1][:, ::2, :d],
        leaves[2].expand(5, 6, d),
        leaves[3].permute(1, 2, 0),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_sources(device, dtype):
    gen = torch.Generator().manual_seed(14)
    d = 40
    shapes = [(6, 5, d), (5, 12, 2 * d), (5, 1, d), (d, 5, 6)]
    leaves = [torch.randn(*sh, generator=gen).to(dtype).to(device).requires_grad_(True) for sh in shapes]
    views = _strided_views(leaves, d)
    assert not any(v.is_contiguous() for v in views)
    q, g = make_params(d, dtype, device, gen)

    h = attnres.depth_attention(views, q, g)
    assert torch.equal(h, attnres.depth_attention([v.detach().contiguous() for v in views], q, g))

    dh = torch.randn(6, 5, d, generator=gen).to(dtype).to(device).transpose(0, 1)  # strided grad_out
    h.backward(dh)
    ref_leaves = [fp64_leaf(x) for x in leaves]
    ref_h = reference.depth_attention(_strided_views(ref_leaves, d), q.double().cpu(), g.double().cpu())
    ref_h.backward(dh.double().cpu())
    assert rel_err(h, ref_h) < REL_TOL[dtype]
    for a, b in zip(leaves, ref_leaves):
        assert rel_err(a.grad, b.grad) < GRAD_REL_TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(device):
    srcs = [torch.randn(0, 16, device=device, requires_grad=True) for _ in range(3)]
    q = torch.randn(16, device=device, requires_grad=True)
    h, w = attnres.depth_attention(srcs, q, return_weights=True)
    assert h.shape == (0, 16) and w.shape == (3, 0)
    h.sum().backward()
    assert srcs[0].grad.shape == (0, 16)
    assert torch.count_nonzero(q.grad) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_poisons_only_its_token(device, dtype):
    gen = torch.Generator().manual_seed(15)
    srcs = make_sources(5, (7,), 50, dtype, device, gen, requires_grad=True)
    q, g = make_params(50, dtype, device, gen, requires_grad=True)
    with torch.no_grad():
        srcs[2][3, 17] = float("nan")
    h, w = attnres.depth_attention(srcs, q, g, return_weights=True)
    assert torch.isnan(h[3]).all() and torch.isnan(w[:, 3]).all()
    keep = [t for t in range(7) if t != 3]
    assert torch.isfinite(h[keep]).all() and torch.isfinite(w[:, keep]).all()
    h.sum().backward()
    for s in srcs:
        assert torch.isfinite(s.grad[keep]).all()
    ref = reference.depth_attention([s.detach().double() for s in srcs], q.double(), g.double())
    assert rel_err(h[keep], ref[keep]) < REL_TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_magnitudes_stay_finite(device, dtype):
    """Sources near 1e3 (fp16) / 1e15 (others) and a query that saturates
    the softmax: results stay finite and match the reference."""
    gen = torch.Generator().manual_seed(16)
    big = 1e3 if dtype == torch.float16 else 1e15  # fp16 tops out at 65504
    srcs = [
        (torch.randn(9, 300, generator=gen, dtype=torch.float64) * big * (i + 1) / 3).to(dtype).to(device)
        for i in range(6)
    ]
    q = (torch.randn(300, generator=gen, dtype=torch.float64) * 50).to(param_dtype(dtype)).to(device)
    srcs = [s.requires_grad_(True) for s in srcs]
    h, w = attnres.depth_attention(srcs, q, return_weights=True)
    assert torch.isfinite(h).all() and torch.isfinite(w).all()
    ref_srcs = [fp64_leaf(s) for s in srcs]
    ref_h, ref_w = reference.depth_attention(ref_srcs, q.double().cpu(), return_weights=True)
    assert rel_err(h, ref_h) < REL_TOL[dtype]
    assert rel_err(w, ref_w) < max(REL_TOL[dtype], 1e-5)
    dh = torch.randn(h.shape, generator=gen, dtype=torch.float64)
    h.backward(dh.to(dtype).to(device))
    ref_h.backward(dh.to(dtype).double())
    assert all(torch.isfinite(s.grad).all() for s in srcs)
    # Saturated weights leave some sources with denormal gradients: compare
    # all source gradients together, relative to their joint size.
    grads = torch.cat([s.grad.flatten().double().cpu() for s in srcs])
    ref_grads = torch.cat([rs.grad.flatten() for rs in ref_srcs])
    assert rel_err(grads, ref_grads) < GRAD_REL_TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_grads_bitwise_deterministic_across_threads(device):
    gen = torch.Generator().manual_seed(17)
    srcs = make_sources(9, (257, 3), 130, torch.float32, device, gen)
    q, g = make_params(130, torch.float32, device, gen)
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 1.0)
    dh = torch.randn(srcs[0].shape, generator=gen).to(device)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, max(2, before), 1):
            torch.set_num_threads(threads)
            results.append(backward_op(dh, srcs, q, g, h, rstd, w, 1.0))
    finally:
        torch.set_num_threads(before)
    first = results[0]
    for other in results[1:]:
        assert torch.equal(first[1], other[1]) and torch.equal(first[2], other[2])
        assert all(torch.equal(a, b) for a, b in zip(first[0], other[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_params_with_reduced_sources_match_same_dtype_params(device):
    """bf16 sources accept an fp32 query/gain; a bf16 query is accepted too."""
    gen = torch.Generator().manual_seed(18)
    srcs = make_sources(4, (6,), 64, torch.bfloat16, device, gen)
    q, g = make_params(64, torch.bfloat16, device, gen)  # fp32
    h32 = attnres.depth_attention(srcs, q, g)
    h16 = attnres.depth_attention(srcs, q.bfloat16(), g.bfloat16())
    ref = reference.depth_attention([s.double() for s in srcs], q.double(), g.double())
    assert rel_err(h32, ref) < REL_TOL[torch.bfloat16]
    assert rel_err(h16, ref) < 2 * REL_TOL[torch.bfloat16]


# Each bad input, with the words the error must contain.
def _bad_inputs(device):
    x = torch.randn(3, 8, device=device)
    q = torch.randn(8, device=device)
    return [
        ("empty", lambda: attnres.depth_attention([], q), ValueError, "non-empty"),
        ("shape", lambda: attnres.depth_attention([x, torch.randn(3, 9, device=device)], q), ValueError,
         r"sources\[1\] has shape \[3, 9\]"),
        ("dtype", lambda: attnres.depth_attention([x, x.double()], q), TypeError, r"sources\[1\] has dtype"),
        ("query_shape", lambda: attnres.depth_attention([x, x], torch.randn(7, device=device)), ValueError,
         r"query must have shape \[D\] = \[8\]"),
        ("query_2d", lambda: attnres.depth_attention([x, x], torch.randn(1, 8, device=device)), ValueError,
         r"query must have shape \[D\]"),
        ("gain_shape", lambda: attnres.depth_attention([x, x], q, torch.randn(9, device=device)), ValueError,
         r"norm_weight must have shape \[D\] = \[8\]"),
        ("query_dtype", lambda: attnres.depth_attention([x, x], q.double()), TypeError, "query must have the sources' dtype"),
        ("eps", lambda: attnres.depth_attention([x, x], q, eps=-1e-3), ValueError, "eps must be a finite number >= 0"),
        ("int", lambda: attnres.depth_attention([x.int(), x.int()], q), TypeError,
         "sources must be float64, float32, bfloat16 or float16"),
        ("d0", lambda: attnres.depth_attention([torch.randn(3, 0, device=device)], torch.randn(0, device=device)),
         ValueError, "non-zero last dimension"),
        ("0dim", lambda: attnres.depth_attention([torch.tensor(1.0, device=device)], q), ValueError,
         "at least one dimension"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(11))
def test_bad_input_python_and_op(device, case):
    name, call, exc, words = _bad_inputs(device)[case]
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("case", ["shape", "dtype", "query", "gain", "eps", "int", "empty"])
def test_bad_input_reaches_the_cpp_checks(case):
    """Calling the op directly (no Python wrapper) hits the C++ TORCH_CHECKs."""
    x = torch.randn(3, 8)
    q = torch.randn(8)
    fwd = torch.ops.attnres.depth_attention_fwd
    calls = {
        "shape": (lambda: fwd([x, torch.randn(3, 9)], q, None, 1e-6, 1.0), r"sources\[1\] has shape"),
        "dtype": (lambda: fwd([x, x.double()], q, None, 1e-6, 1.0), r"sources\[1\] has dtype"),
        "query": (lambda: fwd([x], torch.randn(5), None, 1e-6, 1.0), r"query must have shape \[D\] = \[8\]"),
        "gain": (lambda: fwd([x], q, torch.randn(2), 1e-6, 1.0), r"norm_weight must have shape"),
        "eps": (lambda: fwd([x], q, None, -1.0, 1.0), "eps must be a finite number >= 0"),
        "int": (lambda: fwd([x.long()], q, None, 1e-6, 1.0), "sources must be float64"),
        "empty": (lambda: fwd([], q, None, 1e-6, 1.0), "non-empty"),
    }
    call, words = calls[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=words):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to put a source on another device")
def test_bad_input_device_mismatch():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"sources\[1\] is on device"):
        attnres.depth_attention([x, x.cuda()], torch.randn(8))
    with pytest.raises(ValueError, match="query is on device"):
        attnres.depth_attention([x, x], torch.randn(8, device="cuda"))


# ---- vmap -----------------------------------------------------------------------------------------


def test_vmap_over_a_read():
    """torch.vmap over sources only is one call (the batch is one more token
    dimension); a batched query, gain or backward input runs the op per
    batch element. Autograd through the vmapped read and batched gradients
    (is_grads_batched) give the per-element results."""
    gen = torch.Generator().manual_seed(31)
    D, B = 12, 3
    srcs = [torch.randn(B, 4, D, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2)]
    shared = torch.randn(4, D, generator=gen, dtype=torch.float64)  # unbatched source
    query = torch.randn(D, generator=gen, dtype=torch.float64, requires_grad=True)
    gain = torch.rand(D, generator=gen, dtype=torch.float64) + 0.5
    out_weight = torch.rand(D, generator=gen, dtype=torch.float64) + 0.5

    def read(a, b, q=query):
        return attnres.depth_attention([a, b, shared], q, gain, out_weight=out_weight)

    got = torch.vmap(read)(*srcs)
    want = torch.stack([read(srcs[0][i], srcs[1][i]) for i in range(B)])
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    g_got = torch.autograd.grad(got.pow(2).sum(), [*srcs, query])
    g_want = torch.autograd.grad(want.pow(2).sum(), [*srcs, query])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    queries = torch.randn(B, D, generator=gen, dtype=torch.float64)
    got = torch.vmap(lambda q: read(srcs[0][0], srcs[1][0], q))(queries)
    want = torch.stack([read(srcs[0][0], srcs[1][0], q) for q in queries])
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    # The backward op under vmap (batched incoming gradients): per element.
    plain = [srcs[0][0].detach(), srcs[1][0].detach(), shared]
    h, rstd, weights, _, _, _ = torch.ops.attnres.depth_attention_fwd(plain, query.detach(), gain,
                                                                   1e-6, 1.0)
    dhs = torch.randn(B, *h.shape, generator=gen, dtype=torch.float64)
    def bwd(dh):  # the defined gradients
        grads = backward_op(dh, plain, query.detach(), gain, h, rstd, weights, 1.0)
        return [g for g in torch.utils._pytree.tree_leaves(grads) if g is not None]

    got = torch.vmap(bwd)(dhs)
    assert len(got) == 5  # 3 sources, query, gain
    for i, dh in enumerate(dhs):
        for a, b in zip(got, bwd(dh)):
            torch.testing.assert_close(a[i], b, rtol=1e-13, atol=0)
    # Phase 1 of a Block read, vmapped over its sources.
    queries2 = torch.randn(2, D, generator=gen, dtype=torch.float64)
    partials = torch.vmap(lambda a, b: attnres.block_reads([a, b], queries2)[0][1])(*srcs)
    want = torch.stack([attnres.block_reads([srcs[0][i], srcs[1][i]], queries2)[0][1] for i in range(B)])
    torch.testing.assert_close(partials, want, rtol=1e-13, atol=0)
