"""The op family's surface: one schema per computation with the output norm
as an optional part, its statistics always returned, out_eps following eps,
and the checks the optional parts bring (devices, in-place aliasing)."""

import pytest
import torch

import attnres
from attnres import reference

OP_SCHEMAS = {
    "depth_attention_fwd", "depth_attention_bwd",
    "block_reads_fwd", "block_reads_bwd",
    "block_read_merge_fwd", "block_read_merge_bwd", "block_read_merge_inplace",
}
ALLOCATOR_KNOBS = {
    "cpu_gradient_cache_stats", "set_cpu_gradient_cache_limit", "empty_cpu_gradient_cache",
}

T, D, N = 5, 24, 3


def _problem(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(T, D, generator=gen, dtype=dtype) for _ in range(N)]
    query = torch.randn(D, generator=gen, dtype=dtype)
    norm_weight = torch.rand(D, generator=gen, dtype=dtype) + 0.5
    out_weight = torch.rand(D, generator=gen, dtype=dtype) + 0.5
    return sources, query, norm_weight, out_weight


def _rms_norm(h, weight, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_one_schema_per_computation():
    registered = {
        schema.name.split("::", 1)[1]
        for schema in torch._C._jit_get_all_schemas()
        if schema.name.startswith("attnres::")
    }
    assert registered == OP_SCHEMAS | ALLOCATOR_KNOBS


@pytest.mark.parametrize("with_out_weight", [False, True])
def test_forward_always_returns_the_norm_statistics(with_out_weight):
    sources, query, norm_weight, out_weight = _problem()
    out, rstd, weights, h, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0, out_weight if with_out_weight else None, None, True)
    ref_h = reference.depth_attention(sources, query, norm_weight)
    if with_out_weight:
        torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out, _rms_norm(ref_h, out_weight, 1e-6), rtol=1e-12, atol=1e-12)
        assert out_rstd.shape == (T,)
    else:
        # as native_layer_norm's statistics: empty where the part is absent
        torch.testing.assert_close(out, ref_h, rtol=1e-12, atol=1e-12)
        assert h.numel() == 0 and out_rstd.numel() == 0


@pytest.mark.parametrize("read", ["depth_attention", "block_reads", "block_read_merge"])
def test_out_eps_follows_eps(read):
    # FLA's fused_attnres(..., rms_eps=e) maps to eps=e: the output norm must
    # use e as well unless out_eps is given.
    sources, query, norm_weight, out_weight = _problem()
    sources = [0.05 * s for s in sources]  # small rows, where eps matters
    eps = 1e-2
    h = reference.depth_attention(sources, query, norm_weight, eps=eps)
    expected = _rms_norm(h, out_weight, eps)
    if read == "depth_attention":
        def run(**kw):
            return attnres.depth_attention(sources, query, norm_weight, eps=eps, out_weight=out_weight, **kw)
    elif read == "block_reads":
        def run(**kw):
            partial_outs, _ = attnres.block_reads(
                sources, query.unsqueeze(0), norm_weight.unsqueeze(0), eps=eps, scale=1.0,
                out_weight=out_weight, **kw)
            return partial_outs[0]
    else:
        partial_outs, lse = attnres.block_reads(
            sources[:-1], query.unsqueeze(0), norm_weight.unsqueeze(0), eps=eps, scale=1.0)

        def run(**kw):
            return attnres.block_read_merge(
                partial_outs[0], lse[0], sources[-1], query, norm_weight, eps=eps, scale=1.0,
                out_weight=out_weight, **kw)
    torch.testing.assert_close(run(), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(run(out_eps=eps), expected, rtol=1e-12, atol=1e-12)
    other = run(out_eps=1e-6)
    assert (other - expected).abs().max() > 1e-3  # out_eps, when given, is used


@pytest.mark.parametrize("on_meta", ["h", "out_rstd", "out_weight"])
def test_backward_refuses_a_meta_tensor_among_cpu_tensors(on_meta):
    # The norm's saved tensors are checked like every other input: one on the
    # meta device must raise, never return uninitialized memory.
    sources, query, norm_weight, out_weight = _problem()
    _, rstd, weights, h, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0, out_weight, None, True)
    saved = {"h": h, "out_rstd": out_rstd, "out_weight": out_weight}
    saved[on_meta] = saved[on_meta].to("meta")
    grad = torch.randn(T, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"{on_meta}.*(on the sources' device|but the sources are on)"):
        torch.ops.attnres.depth_attention_bwd(
            grad, None, sources, query, norm_weight, saved["h"], rstd, weights, 1.0,
            [True] * (N + 3), saved["out_weight"], saved["out_rstd"])


def _merge_inputs():
    sources, query, norm_weight, out_weight = _problem(seed=1)
    partial_outs, lse = attnres.block_reads(
        sources[:-1], query.unsqueeze(0), norm_weight.unsqueeze(0), eps=1e-6, scale=1.0)
    return partial_outs[0].clone(), lse[0].clone(), sources[-1], query, norm_weight, out_weight


@pytest.mark.parametrize("aliased", ["lse", "block_sum", "query", "norm_weight", "out_weight"])
def test_inplace_merge_refuses_any_input_viewing_its_output(aliased):
    partial_out, lse, block_sum, query, norm_weight, out_weight = _merge_inputs()
    inputs = {"lse": lse, "block_sum": block_sum, "query": query,
              "norm_weight": norm_weight, "out_weight": out_weight}
    view = {"lse": partial_out[:, 0], "block_sum": partial_out, "query": partial_out[0],
            "norm_weight": partial_out[1], "out_weight": partial_out[2]}[aliased]
    inputs[aliased] = view
    before = partial_out.clone()
    # block_sum *is* partial_out (same tensor); the others view part of it
    error = ValueError if aliased == "block_sum" else RuntimeError
    words = ("partial_out and block_sum must be different tensors" if aliased == "block_sum"
             else f"{aliased} shares memory with partial_out")
    with pytest.raises(error, match=words):
        torch.ops.attnres.block_read_merge_inplace(
            partial_out, inputs["lse"], inputs["block_sum"], inputs["query"],
            inputs["norm_weight"], 1e-6, 1.0, inputs["out_weight"], None)
    assert torch.equal(partial_out, before)  # refused before writing


def test_inplace_merge_matches_the_out_of_place_merge():
    partial_out, lse, block_sum, query, norm_weight, out_weight = _merge_inputs()
    expected = attnres.block_read_merge(
        partial_out, lse, block_sum, query, norm_weight, eps=1e-6, scale=1.0, out_weight=out_weight)
    torch.ops.attnres.block_read_merge_inplace(
        partial_out, lse, block_sum, query, norm_weight, 1e-6, 1.0, out_weight, None)
    torch.testing.assert_close(partial_out, expected, rtol=0, atol=0)


# ---- every C++ check against the fake kernels ------------------------------
# Each case: a name and a function of a namespace of valid inputs returning
# (op, args) with one argument broken. The C++ checks (csrc/arguments.cpp,
# csrc/block_reads.cpp) are the source of truth; the fake kernels that
# torch.compile/export trace with must refuse the same input with the same
# exception type and the same first line.
def _valid():
    gen = torch.Generator().manual_seed(3)
    f32 = dict(dtype=torch.float32)
    ns = type("Inputs", (), {})()
    ns.src = [torch.randn(T, D, generator=gen, **f32) for _ in range(N)]
    ns.q = torch.randn(D, generator=gen, **f32)
    ns.w = torch.rand(D, generator=gen, **f32) + 0.5
    ns.ow = torch.rand(D, generator=gen, **f32) + 0.5
    ns.qs = torch.randn(2, D, generator=gen, **f32)
    out, rstd, weights, h, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        ns.src, ns.q, ns.w, 1e-6, 1.0, ns.ow, 1e-5, True)
    ns.y, ns.rstd, ns.weights, ns.h, ns.out_rstd = out, rstd, weights, h, out_rstd
    ns.dh = torch.randn(T, D, generator=gen, **f32)
    parts, lse, r1, a1, _, _ = torch.ops.attnres.block_reads_fwd(ns.src, ns.qs, None, 1e-6, 1.0)
    ns.parts, ns.lse, ns.r1, ns.a1 = parts, lse, r1, a1
    _, ns.rm, ns.am, _, _, _ = torch.ops.attnres.block_read_merge_fwd(
        parts[1], lse[1], ns.src[0], ns.qs[1], None, 1e-6, 1.0)
    return ns


def _lse_viewing_the_output(v):
    out = v.parts[1].clone()
    lse = out.view(torch.float64)[:, 0]  # [T] float64 over the output's first columns
    return ops.block_read_merge_inplace, (out, lse, v.src[0], v.qs[1], None, 1e-6, 1.0)


ops = torch.ops.attnres
BAD_INPUTS = {
    # depth_attention_fwd (check_forward_args, check_out_norm_args)
    "fwd: no sources": lambda v: (ops.depth_attention_fwd, ([], v.q, None, 1e-6, 1.0)),
    "fwd: 0-dim source": lambda v: (ops.depth_attention_fwd, ([torch.tensor(1.0)], v.q, None, 1e-6, 1.0)),
    "fwd: int sources": lambda v: (ops.depth_attention_fwd, ([s.int() for s in v.src], v.q, None, 1e-6, 1.0)),
    "fwd: D = 0": lambda v: (ops.depth_attention_fwd, ([torch.randn(3, 0)], torch.randn(0), None, 1e-6, 1.0)),
    "fwd: shapes differ": lambda v: (ops.depth_attention_fwd, ([v.src[0], v.src[1][:2]], v.q, None, 1e-6, 1.0)),
    "fwd: dtypes differ": lambda v: (ops.depth_attention_fwd, ([v.src[0], v.src[1].double()], v.q, None, 1e-6, 1.0)),
    "fwd: sparse source": lambda v: (ops.depth_attention_fwd, ([v.src[0].to_sparse()], v.q, None, 1e-6, 1.0)),
    "fwd: query shape": lambda v: (ops.depth_attention_fwd, (v.src, v.q[:-1], None, 1e-6, 1.0)),
    "fwd: query dtype": lambda v: (ops.depth_attention_fwd, (v.src, v.q.double(), None, 1e-6, 1.0)),
    "fwd: gain shape": lambda v: (ops.depth_attention_fwd, (v.src, v.q, v.w[:3], 1e-6, 1.0)),
    "fwd: negative eps": lambda v: (ops.depth_attention_fwd, (v.src, v.q, None, -1e-3, 1.0)),
    "fwd: eps beyond float32": lambda v: (ops.depth_attention_fwd, (v.src, v.q, None, 1e39, 1.0)),
    "fwd: NaN scale": lambda v: (ops.depth_attention_fwd, (v.src, v.q, None, 1e-6, float("nan"))),
    "fwd: scale beyond float32": lambda v: (ops.depth_attention_fwd, (v.src, v.q, None, 1e-6, 1e39)),
    "fwd: out_weight shape": lambda v: (ops.depth_attention_fwd, (v.src, v.q, None, 1e-6, 1.0, v.ow[:2], 1e-5)),
    "fwd: out_weight dtype": lambda v: (ops.depth_attention_fwd, (v.src, v.q, None, 1e-6, 1.0, v.ow.double(), 1e-5)),
    "fwd: negative out_eps": lambda v: (ops.depth_attention_fwd, (v.src, v.q, None, 1e-6, 1.0, v.ow, -1.0)),
    # depth_attention_bwd (check_backward_args)
    "bwd: grad_out shape": lambda v: (ops.depth_attention_bwd, (
        v.dh[:2], None, v.src, v.q, v.w, v.h, v.rstd, v.weights, 1.0, [True] * (N + 2))),
    "bwd: grad_out dtype": lambda v: (ops.depth_attention_bwd, (
        v.dh.double(), None, v.src, v.q, v.w, v.h, v.rstd, v.weights, 1.0, [True] * (N + 2))),
    "bwd: h shape": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h[:2], v.rstd, v.weights, 1.0, [True] * (N + 2))),
    "bwd: rstd dtype": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h, v.rstd.double(), v.weights, 1.0, [True] * (N + 2))),
    "bwd: weights shape": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h, v.rstd, v.weights[:1], 1.0, [True] * (N + 2))),
    "bwd: grad_weights shape": lambda v: (ops.depth_attention_bwd, (
        v.dh, v.weights[:1], v.src, v.q, v.w, v.h, v.rstd, v.weights, 1.0, [True] * (N + 2))),
    "bwd: output_mask length": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h, v.rstd, v.weights, 1.0, [True] * (N + 1))),
    "bwd: out_weight without out_rstd": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h, v.rstd, v.weights, 1.0, [True] * (N + 3), v.ow, None)),
    "bwd: out_rstd shape": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h, v.rstd, v.weights, 1.0, [True] * (N + 3), v.ow, v.out_rstd[:2])),
    # block_reads_fwd / _bwd
    "reads: queries 1-d": lambda v: (ops.block_reads_fwd, (v.src, v.q, None, 1e-6, 1.0)),
    "reads: queries width": lambda v: (ops.block_reads_fwd, (v.src, v.qs[:, :-1], None, 1e-6, 1.0)),
    "reads: norm_weights shape": lambda v: (ops.block_reads_fwd, (v.src, v.qs, v.qs[:1], 1e-6, 1.0)),
    "reads: queries dtype": lambda v: (ops.block_reads_fwd, (v.src, v.qs.double(), None, 1e-6, 1.0)),
    "reads bwd: output_mask length": lambda v: (ops.block_reads_bwd, (
        list(v.parts), None, v.src, v.qs, None, v.r1, v.a1, 1.0, [True] * (N + 1))),
    "reads bwd: grad_lse dtype": lambda v: (ops.block_reads_bwd, (
        list(v.parts), v.lse.float(), v.src, v.qs, None, v.r1, v.a1, 1.0, [True] * (N + 2))),
    # block_read_merge_fwd / _bwd
    "merge: lse dtype": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1].float(), v.src[0], v.qs[1], None, 1e-6, 1.0)),
    "merge: lse shape": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1][:2], v.src[0], v.qs[1], None, 1e-6, 1.0)),
    "merge: block_sum shape": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1], v.src[0][:2], v.qs[1], None, 1e-6, 1.0)),
    "merge: block_sum dtype": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1], v.src[0].double(), v.qs[1], None, 1e-6, 1.0)),
    "merge: query shape": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1], v.src[0], v.qs, None, 1e-6, 1.0)),
    "merge bwd: output_mask length": lambda v: (ops.block_read_merge_bwd, (
        v.dh, v.parts[1], v.src[0], v.qs[1], None, v.rm, v.am, 1.0, [True] * 4)),
    "merge bwd: rstd shape": lambda v: (ops.block_read_merge_bwd, (
        v.dh, v.parts[1], v.src[0], v.qs[1], None, v.rm[:2], v.am, 1.0, [True] * 5)),
    "merge: partial_out dtype": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1].double(), v.lse[1], v.src[0], v.qs[1], None, 1e-6, 1.0)),
    "merge: out_weight shape": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1], v.src[0], v.qs[1], None, 1e-6, 1.0, v.ow[:3], None)),
    "merge bwd: grad_out shape": lambda v: (ops.block_read_merge_bwd, (
        v.dh[:2], v.parts[1], v.src[0], v.qs[1], None, v.rm, v.am, 1.0, [True] * 5)),
    "merge bwd: weight dtype": lambda v: (ops.block_read_merge_bwd, (
        v.dh, v.parts[1], v.src[0], v.qs[1], None, v.rm, v.am.double(), 1.0, [True] * 5)),
    "merge bwd: out_weight without h": lambda v: (ops.block_read_merge_bwd, (
        v.dh, v.parts[1], v.src[0], v.qs[1], None, v.rm, v.am, 1.0, [True] * 6, v.ow, None,
        v.out_rstd)),
    "bwd: h dtype": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h.double(), v.rstd, v.weights, 1.0, [True] * (N + 2))),
    "bwd: norm_weight dtype": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w.double(), v.h, v.rstd, v.weights, 1.0, [True] * (N + 2))),
    "bwd: NaN scale": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h, v.rstd, v.weights, float("nan"), [True] * (N + 2))),
    "reads bwd: grad_partial_outs count": lambda v: (ops.block_reads_bwd, (
        list(v.parts)[:1], None, v.src, v.qs, None, v.r1, v.a1, 1.0, [True] * (N + 2))),
    "reads bwd: grad_partial_outs shape": lambda v: (ops.block_reads_bwd, (
        [p[:2] for p in v.parts], None, v.src, v.qs, None, v.r1, v.a1, 1.0, [True] * (N + 2))),
    "reads bwd: weights shape": lambda v: (ops.block_reads_bwd, (
        list(v.parts), None, v.src, v.qs, None, v.r1, v.a1[:1], 1.0, [True] * (N + 2))),
    "reads bwd: out_rstd dtype": lambda v: (ops.block_reads_bwd, (
        list(v.parts), None, v.src, v.qs, None, v.r1, v.a1, 1.0, [True] * (N + 3), v.ow, v.h,
        v.out_rstd.double())),
    "reads: negative out_eps": lambda v: (ops.block_reads_fwd, (
        v.src, v.qs, None, 1e-6, 1.0, v.ow, -1.0)),
    "merge in place: block_sum is the output": lambda v: (ops.block_read_merge_inplace, (
        v.parts[1], v.lse[1], v.parts[1], v.qs[1], None, 1e-6, 1.0)),
    "merge in place: lse views the output": lambda v: _lse_viewing_the_output(v),
    "merge in place: strided output": lambda v: (ops.block_read_merge_inplace, (
        v.parts[1].t().contiguous().t(), v.lse[1], v.src[0], v.qs[1], None, 1e-6, 1.0)),
    # the fused prefix add (delta, and its P' output's gradient)
    "merge: delta shape": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1], v.src[0], v.qs[1], None, 1e-6, 1.0, None, None, False, v.src[1][:2])),
    "merge: delta dtype": lambda v: (ops.block_read_merge_fwd, (
        v.parts[1], v.lse[1], v.src[0], v.qs[1], None, 1e-6, 1.0, None, None, False,
        v.src[1].double())),
    "merge bwd: grad_block_sum_out shape": lambda v: (ops.block_read_merge_bwd, (
        v.dh, v.parts[1], v.src[0], v.qs[1], None, v.rm, v.am, 1.0, [True] * 5, None, None, None,
        v.dh[:2])),
    "fwd: delta shape": lambda v: (ops.depth_attention_fwd, (
        v.src, v.q, None, 1e-6, 1.0, None, None, False, v.src[1][:2])),
    "fwd: delta dtype": lambda v: (ops.depth_attention_fwd, (
        v.src, v.q, None, 1e-6, 1.0, None, None, False, v.src[1].double())),
    "bwd: grad_prefix_out shape": lambda v: (ops.depth_attention_bwd, (
        v.dh, None, v.src, v.q, v.w, v.h, v.rstd, v.weights, 1.0, [True] * (N + 3), v.ow,
        v.out_rstd, v.dh[:2])),
    "merge in place: delta is the output": lambda v: (ops.block_read_merge_inplace, (
        v.parts[1], v.lse[1], v.src[0], v.qs[1], None, 1e-6, 1.0, None, None, v.parts[1])),
    "merge in place: delta dtype": lambda v: (ops.block_read_merge_inplace, (
        v.parts[1].clone(), v.lse[1], v.src[0], v.qs[1], None, 1e-6, 1.0, None, None,
        v.src[1].half())),
}
# The checks of numbers (eps, scale, out_eps) are the real op's: a trace
# accepts them, the traced program raises them when it runs
# (test_eager_op_and_compiled_call_refuse_alike).
RUN_TIME_CHECKS = {
    "fwd: negative eps", "fwd: eps beyond float32", "fwd: NaN scale", "fwd: scale beyond float32",
    "fwd: negative out_eps", "bwd: NaN scale", "reads: negative out_eps",
}


def _outcome(op, args, below_autograd=False):
    # The fake kernel is called below autograd: the C++ autograd kernels
    # check some arguments first (dense inputs, output_mask) and would
    # otherwise answer for it. The eager op is called as users call it.
    try:
        if below_autograd:
            with torch._C._AutoDispatchBelowAutograd():
                op(*args)
        else:
            op(*args)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        return type(exc), str(exc).strip().splitlines()[0]
    return None, "no error"


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_eager_op_and_fake_kernel_refuse_alike(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args = BAD_INPUTS[case](_valid())
    eager = _outcome(op, args)
    assert eager[0] is not None, f"{case}: the eager op accepted it"
    mode = FakeTensorMode(allow_non_fake_inputs=False)

    def fake(x):
        if isinstance(x, torch.Tensor):
            return mode.from_tensor(x)
        if isinstance(x, (list, tuple)):
            return type(x)(fake(y) for y in x)
        return x

    fake_args = fake(args)
    with mode:
        traced = _outcome(op, fake_args, below_autograd=True)
    if case in RUN_TIME_CHECKS:
        assert traced == (None, "no error"), f"{case}: a number or memory check in the fake: {traced}"
    else:
        assert traced == eager, f"{case}: eager {eager} vs fake {traced}"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])  # aot_eager: functionalized
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_eager_op_and_compiled_call_refuse_alike(case, backend):
    """torch.compile (the fake kernels while tracing, the op when the program
    runs) refuses every bad input with the eager op's words."""
    op, args = BAD_INPUTS[case](_valid())
    eager = _outcome(op, args)
    assert eager[0] is not None, f"{case}: the eager op accepted it"
    if case == "fwd: sparse source":
        pytest.skip("dynamo does not trace sparse tensors: it refuses the input itself")
    torch.compiler.reset()  # a fresh trace per case, never a cached or eager fallback
    compiled = torch.compile(lambda *a: op(*a), backend=backend, fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(*args)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any(eager[1] in text for text in chain), f"{case}: eager said {eager[1]!r}, compiled {chain}"
