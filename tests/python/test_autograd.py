"""Autograd of the ops, registered in C++ (csrc/autograd.cpp): gradients of
the depth weights, only the gradients that are needed, and a clear error for
second derivatives."""
import pytest
import torch

import attnres
from attnres import reference
from helpers import (
    DEVICES,
    GRAD_REL_TOL,
    backward_op,
    fp64_leaf,
    make_params,
    make_sources,
    rel_err,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def test_autograd_is_registered_in_cpp_not_python():
    """The forward's grad_fn is a C++ node, and no Python autograd kernel is
    registered for the op (C++ callers get the same derivative)."""
    src = [torch.randn(2, 5, requires_grad=True) for _ in range(2)]
    h = attnres.depth_attention(src, torch.zeros(5, requires_grad=True))
    assert type(h.grad_fn).__name__ == "CppFunction"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("attnres::depth_attention_fwd", "Autograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("attnres::depth_attention_bwd", "Autograd")


@pytest.mark.parametrize("with_gain", [True, False])
def test_gradcheck_through_output_and_weights_fp64(with_gain):
    """A loss on h and on the weights: fp64 gradcheck of the fused backward."""
    gen = torch.Generator().manual_seed(3)
    srcs = make_sources(4, (3,), 6, torch.float64, "cpu", gen, requires_grad=True)
    q, g = make_params(6, torch.float64, "cpu", gen, requires_grad=True)
    args = (*srcs, q, g) if with_gain else (*srcs, q)

    def fwd(*xs):
        gain = xs[5] if with_gain else None
        h, _rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
            list(xs[:4]), xs[4], gain, 1e-6, 0.8)
        return h, w

    assert torch.autograd.gradcheck(fwd, args)

    def weights_only(*xs):
        gain = xs[5] if with_gain else None
        return torch.ops.attnres.depth_attention_fwd(list(xs[:4]), xs[4], gain, 1e-6, 0.8)[2]

    assert torch.autograd.gradcheck(weights_only, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_return_weights_are_differentiable(device, dtype):
    """return_weights=True gives weights a loss can use: its gradients match
    the fp64 reference's, for every source, the query and the gain."""
    gen = torch.Generator().manual_seed(5)
    srcs = make_sources(5, (7,), 64, dtype, device, gen, requires_grad=True)
    q, g = make_params(64, dtype, device, gen, requires_grad=True)
    h, w = attnres.depth_attention(srcs, q, g, return_weights=True)
    assert w.requires_grad
    coef = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(h.shape, generator=gen, dtype=torch.float64)
    loss = (w.double().cpu() * coef).sum() + (h.double().cpu() * dh).sum()
    loss.backward()

    ref_srcs = [fp64_leaf(s) for s in srcs]
    ref_q, ref_g = fp64_leaf(q), fp64_leaf(g)
    ref_h, ref_w = reference.depth_attention(ref_srcs, ref_q, ref_g, return_weights=True)
    ((ref_w.double() * coef).sum() + (ref_h * dh.to(dtype).double()).sum()).backward()
    # fp32 weights for every dtype: their gradient is at fp32 precision.
    tol = max(GRAD_REL_TOL[dtype], GRAD_REL_TOL[torch.float32])
    for i, (s, rs) in enumerate(zip(srcs, ref_srcs)):
        assert rel_err(s.grad, rs.grad) < tol, f"sources[{i}]"
    assert rel_err(q.grad, ref_q.grad) < tol
    assert rel_err(g.grad, ref_g.grad) < tol


@pytest.mark.parametrize("device", DEVICES)
def test_loss_on_weights_alone(device):
    """No gradient reaches h: the backward runs from the weights' gradient."""
    gen = torch.Generator().manual_seed(6)
    srcs = make_sources(3, (4,), 16, torch.float64, device, gen, requires_grad=True)
    q, g = make_params(16, torch.float64, device, gen, requires_grad=True)
    _out, _rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 1.0)
    (w[0] * w[2]).sum().backward()
    ref_srcs = [fp64_leaf(s) for s in srcs]
    ref_q, ref_g = fp64_leaf(q), fp64_leaf(g)
    # The reference returns fp32 weights: the fp64 weights written out here.
    v = torch.stack(ref_srcs)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * ref_g
    ref_w = torch.softmax((keys * ref_q).sum(-1), dim=0)
    (ref_w[0] * ref_w[2]).sum().backward()
    for s, rs in zip(srcs, ref_srcs):
        assert rel_err(s.grad, rs.grad) < 1e-10
    assert rel_err(q.grad, ref_q.grad) < 1e-10
    assert rel_err(g.grad, ref_g.grad) < 1e-10


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_inputs_get_no_gradient_and_others_are_unchanged(device):
    gen = torch.Generator().manual_seed(7)
    srcs = make_sources(4, (5,), 32, torch.float64, device, gen, requires_grad=True)
    q, g = make_params(32, torch.float64, device, gen, requires_grad=True)
    attnres.depth_attention(srcs, q, g).pow(2).sum().backward()
    full = [s.grad.clone() for s in srcs], q.grad.clone(), g.grad.clone()

    frozen = [s.detach().clone().requires_grad_(i % 2 == 1) for i, s in enumerate(srcs)]
    q2, g2 = q.detach().clone(), g.detach().clone().requires_grad_(True)
    attnres.depth_attention(frozen, q2, g2).pow(2).sum().backward()
    for i, s in enumerate(frozen):
        if i % 2 == 1:
            torch.testing.assert_close(s.grad, full[0][i], rtol=0, atol=0)
        else:
            assert s.grad is None
    assert q2.grad is None
    torch.testing.assert_close(g2.grad, full[2], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_computes_only_what_the_mask_asks(device):
    """output_mask: grad_sources lists the wanted source gradients only; an
    unwanted query/gain gradient is None; the values equal the full call's."""
    gen = torch.Generator().manual_seed(8)
    srcs = make_sources(4, (3, 2), 24, torch.float32, device, gen)
    q, g = make_params(24, torch.float32, device, gen)
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 0.9)
    dh = torch.randn(srcs[0].shape, generator=gen).to(device)
    gw = torch.randn(w.shape, generator=gen).to(device)
    full_s, full_q, full_g = backward_op(dh, srcs, q, g, h, rstd, w, 0.9, grad_weights=gw)[:3]
    mask = [False, True, False, True, False, True]
    part_s, part_q, part_g = backward_op(dh, srcs, q, g, h, rstd, w, 0.9, grad_weights=gw,
                                         output_mask=mask)[:3]
    assert len(part_s) == 2 and part_q is None
    torch.testing.assert_close(part_s[0], full_s[1], rtol=0, atol=0)
    torch.testing.assert_close(part_s[1], full_s[3], rtol=0, atol=0)
    torch.testing.assert_close(part_g, full_g, rtol=0, atol=0)
    none = backward_op(dh, srcs, q, g, h, rstd, w, 0.9, output_mask=[False] * 6)
    none_s, none_q, none_g = none[:3]
    assert none_s == [] and none_q is None and none_g is None
    # Without out_weight there is no out_weight gradient.
    assert all(r is None for r in none[3:])
    with pytest.raises(ValueError, match=r"output_mask must have N \+ 2 = 6 entries"):
        backward_op(dh, srcs, q, g, h, rstd, w, 0.9, output_mask=[True] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_source_grads_have_the_same_bits_whatever_else_is_asked(device, dtype):
    """A source gradient does not depend on which other gradients the call
    wants: the kernels' variants with and without the query/gain partials
    must round alike (the compiler once fused a*b + c into FMAs differently
    in them: fp16 D=1000 had elements 1 ulp apart)."""
    gen = torch.Generator().manual_seed(21)
    n, d = 9, 1000
    srcs = make_sources(n, (33,), d, dtype, device, gen)
    q, g = make_params(d, dtype, device, gen)
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 0.7)
    dh = torch.randn(h.shape, generator=gen).to(device=device, dtype=dtype)
    all_s = backward_op(dh, srcs, q, g, h, rstd, w, 0.7)[0]
    only_s, none_q, none_g = backward_op(dh, srcs, q, g, h, rstd, w, 0.7,
                                         output_mask=[True] * n + [False, False])[:3]
    assert none_q is None and none_g is None
    for a, b in zip(all_s, only_s):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_checks_the_saved_output(device):
    """The forward's h (read by the single-pass backward for <dh, h>) must
    have the sources' shape, dtype and device: the op and its fake kernel
    (meta tensors, torch.compile) raise the same words."""
    gen = torch.Generator().manual_seed(10)
    srcs = make_sources(3, (4,), 16, torch.float32, device, gen)
    q, g = make_params(16, torch.float32, device, gen)
    h, rstd, w, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(srcs, q, g, 1e-6, 1.0)
    dh = torch.randn(h.shape, generator=gen).to(device)
    meta = lambda t: t.to("meta")  # noqa: E731
    for to in (lambda t: t, meta):
        args = (to(dh), [to(s) for s in srcs], to(q), to(g))
        stats = (to(rstd), to(w), 1.0)
        with pytest.raises(ValueError, match=r"h \(the forward's read\) must have the sources' shape"):
            backward_op(*args, to(h[:2]), *stats)
        with pytest.raises(TypeError, match=r"h \(the forward's read\) must have the sources' dtype"):
            backward_op(*args, to(h.double()), *stats)
    with pytest.raises(ValueError, match=r"h \(the forward's read\) must be on the sources' device"):
        backward_op(dh, srcs, q, g, meta(h), rstd, w, 1.0)


def test_in_place_change_of_h_before_backward_raises():
    """h is saved for the backward as an output of the forward's node: an
    in-place change is caught by its version counter, not silently used."""
    srcs = [torch.randn(3, 8, requires_grad=True) for _ in range(3)]
    q = torch.randn(8, requires_grad=True)
    h = attnres.depth_attention(srcs, q)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


def test_second_derivatives_raise_a_clear_error():
    gen = torch.Generator().manual_seed(9)
    srcs = make_sources(3, (2,), 8, torch.float64, "cpu", gen, requires_grad=True)
    q, g = make_params(8, torch.float64, "cpu", gen, requires_grad=True)
    h = attnres.depth_attention(srcs, q, g)
    (grad_q,) = torch.autograd.grad(h.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives of depth_attention are not implemented"):
        grad_q.sum().backward()
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.functional.hessian(lambda qq: attnres.depth_attention(srcs, qq, g).sum(), q)


def test_block_reads_first_derivatives_agree_with_and_without_create_graph():
    """Phase 1's and the merge's gradients: a plain backward (the backward
    op alone) and one with create_graph=True (through the refusing node)
    give the same bits, and differentiating the latter again raises."""
    gen = torch.Generator().manual_seed(11)
    srcs = make_sources(3, (2,), 8, torch.float64, "cpu", gen, requires_grad=True)
    qs = torch.randn(2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    partials, lse = attnres.block_reads(srcs, qs)
    P = torch.randn(2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    h = attnres.block_read_merge(partials[1], lse[1], P, qs[1])
    loss = partials[0].pow(2).sum() + h.pow(2).sum()
    plain = torch.autograd.grad(loss, [qs, P], retain_graph=True)
    assert all(g.grad_fn is None for g in plain)
    grad_q, grad_p = torch.autograd.grad(loss, [qs, P], create_graph=True)
    torch.testing.assert_close(grad_q, plain[0], rtol=0, atol=0)
    torch.testing.assert_close(grad_p, plain[1], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second derivatives of block_read_merge"):
        torch.autograd.grad(grad_p.sum(), P, retain_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives of block_reads"):
        torch.autograd.grad(grad_q[0].sum(), qs)


@pytest.mark.parametrize("read", ["one_call", "merge"])
def test_a_backward_with_a_dual_gradient_raises_instead_of_dropping_its_tangent(read):
    """Forward-mode AD through the backward ops is not implemented: a
    backward whose incoming gradient is a dual tensor raises, as it does
    with create_graph, instead of returning gradients without tangents."""
    import torch.autograd.forward_ad as fwAD
    gen = torch.Generator().manual_seed(12)
    srcs = make_sources(3, (2,), 8, torch.float64, "cpu", gen, requires_grad=True)
    q, g = make_params(8, torch.float64, "cpu", gen, requires_grad=True)
    if read == "one_call":
        h = attnres.depth_attention(srcs, q, g)
    else:
        partials, lse = attnres.block_reads(srcs[:2], q.unsqueeze(0), g.unsqueeze(0))
        h = attnres.block_read_merge(partials[0], lse[0], srcs[2], q, g)
    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.randn_like(h), torch.randn_like(h))
        with pytest.raises(RuntimeError, match="jvp|forward AD|forward-mode"):
            torch.autograd.grad(h, q, grad_outputs=dual)


def test_backward_with_create_graph_still_gives_first_derivatives():
    """create_graph=True alone (as torch.compile and gradient-penalty code
    paths do) is fine; only differentiating the gradient again raises."""
    gen = torch.Generator().manual_seed(10)
    srcs = make_sources(3, (2,), 8, torch.float64, "cpu", gen, requires_grad=True)
    q, g = make_params(8, torch.float64, "cpu", gen, requires_grad=True)
    h = attnres.depth_attention(srcs, q, g)
    grads = torch.autograd.grad(h.sum(), [*srcs, q, g], create_graph=True)
    ref = torch.autograd.grad(attnres.depth_attention(srcs, q, g).sum(), [*srcs, q, g])
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
