"""The fused prefix add (docs/design.md §12): block_read_merge_fwd / _inplace
and the one-call depth_attention_fwd take ``delta`` and read over ``P' = P +
delta`` (P: the block sum, or the one-call read's last source), formed in the
read and returned; their backward ops add P''s own gradient to P's. A fused
read must equal ``torch.add`` followed by the plain read bit for bit (forward
and every gradient), in every dtype, and DepthStream with declared readers
must take it without changing a bit of its reads."""
import pytest
import torch
from torch.library import opcheck

import attnres
import attnres.modules as modules_mod
from attnres.ops import block_read_merge, block_read_merge_inplace, block_reads, depth_attention

from helpers import make_stack, param_dtype

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def merge_problem(dtype, lead=(3, 5), D=1000, n=3, seed=0, strided=False, gain=True):
    """A phase 1 over n completed sources for 2 readers, then reader 1's
    merge inputs: its partial output and lse, a block sum P and a delta
    (random, never zeros; strided views when asked)."""
    g = torch.Generator().manual_seed(seed)

    def rows(scale=1.0):
        if strided:  # every other row of a wider buffer: strides the ops take as given
            full = torch.randn(*lead[:-1], 2 * lead[-1], D + 3, generator=g, dtype=torch.float64)
            return (full[..., ::2, :D] * scale).to(dtype)
        return (torch.randn(*lead, D, generator=g, dtype=torch.float64) * scale).to(dtype)

    sources = [rows(10.0 ** (i % 3 - 1)) for i in range(n)]
    pd = param_dtype(dtype)
    queries = (torch.randn(2, D, generator=g, dtype=torch.float64) * (2.0 / D ** 0.5)).to(pd)
    gains = (torch.rand(2, D, generator=g, dtype=torch.float64) + 0.5).to(pd) if gain else None
    out_weight = (torch.rand(D, generator=g, dtype=torch.float64) + 0.5).to(pd)
    partials, lse = block_reads(sources, queries, gains)
    return dict(partial=partials[1].detach(), lse=lse[1].detach(), P=rows(2.0), delta=rows(),
                query=queries[1], gain=None if gains is None else gains[1], out_weight=out_weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("D", [67, 1000])
def test_fused_merge_is_add_then_merge_bit_for_bit(dtype, normed, strided, D):
    p = merge_problem(dtype, D=D, strided=strided, seed=D)
    w = p["out_weight"] if normed else None
    P_next = p["P"] + p["delta"]
    want = block_read_merge(p["partial"], p["lse"], P_next, p["query"], p["gain"], out_weight=w)
    out, P_out = block_read_merge(p["partial"], p["lse"], p["P"], p["query"], p["gain"],
                                  out_weight=w, delta=p["delta"])
    assert P_out.dtype == dtype and P_out.shape == p["P"].shape and P_out.is_contiguous()
    assert torch.equal(P_out, P_next)
    assert torch.equal(out, want)
    with torch.no_grad():  # in place: the read over the consumed partial output
        y = p["partial"].clone()
        got, P_in = block_read_merge_inplace(y, p["lse"], p["P"], p["query"], p["gain"],
                                             out_weight=w, delta=p["delta"])
    assert got is y and torch.equal(got, want) and torch.equal(P_in, P_next)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("gain", [True, False], ids=["gain", "no_gain"])
def test_fused_merge_gradients_are_add_then_merge_bit_for_bit(dtype, normed, gain):
    """Both outputs carry a gradient (the read's, and P''s from the later
    reads and adds it feeds): every input's gradient equals autograd's
    through torch.add and the plain merge, bit for bit."""
    p = merge_problem(dtype, D=259, seed=3, gain=gain)
    names = ["partial", "lse", "P", "delta", "query"] + (["gain"] if gain else [])
    if normed:
        names.append("out_weight")
    g = torch.Generator().manual_seed(4)
    w_out = torch.randn(p["P"].shape, generator=g, dtype=torch.float64).to(dtype)
    w_sum = torch.randn(p["P"].shape, generator=g, dtype=torch.float64).to(dtype)

    def run(fused):
        t = {k: (p[k].detach().clone().requires_grad_() if k in names else p[k]) for k in p}
        w = t["out_weight"] if normed else None
        if fused:
            out, P_next = block_read_merge(t["partial"], t["lse"], t["P"], t["query"], t["gain"],
                                           out_weight=w, delta=t["delta"])
        else:
            P_next = t["P"] + t["delta"]
            out = block_read_merge(t["partial"], t["lse"], P_next, t["query"], t["gain"],
                                   out_weight=w)
        loss = (out * w_out).sum() + (P_next * w_sum).sum()
        return torch.autograd.grad(loss, [t[k] for k in names])

    for name, got, want in zip(names, run(True), run(False)):
        assert torch.count_nonzero(want) > 0, name
        assert torch.equal(got, want), name


def test_only_the_block_sum_output_has_a_gradient():
    """A merge whose read is unused: P''s gradient is that of P and delta."""
    p = merge_problem(torch.float64, D=16, seed=5)
    P = p["P"].clone().requires_grad_()
    delta = p["delta"].clone().requires_grad_()
    _, P_next = block_read_merge(p["partial"], p["lse"], P, p["query"], p["gain"], delta=delta)
    upstream = torch.randn_like(P_next)
    gP, gd = torch.autograd.grad(P_next, [P, delta], upstream)
    assert torch.equal(gP, upstream) and torch.equal(gd, upstream)


def test_gradcheck_float64():
    p = merge_problem(torch.float64, lead=(3,), D=6, seed=6)
    args = [p[k].clone().requires_grad_() for k in ("partial", "lse", "P", "query", "gain",
                                                    "out_weight", "delta")]

    def fn(y, lse, P, q, g, w, d):
        out, P_next = block_read_merge(y, lse, P, q, g, out_weight=w, delta=d)
        return out, P_next

    assert torch.autograd.gradcheck(fn, tuple(args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    p = merge_problem(dtype, lead=(2, 3), D=8, seed=7)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items() if v is not None}
    for w in (None, leaves["out_weight"]):
        opcheck(torch.ops.attnres.block_read_merge_fwd.default,
                (leaves["partial"], leaves["lse"], leaves["P"], leaves["query"], leaves["gain"],
                 1e-6, 0.5, w, None, False, leaves["delta"]))
    out, rstd, weight, _, _, P_next = torch.ops.attnres.block_read_merge_fwd(
        p["partial"], p["lse"], p["P"], p["query"], p["gain"], 1e-6, 0.5, None, None, False,
        p["delta"])
    args = (torch.randn_like(out), p["partial"], P_next, p["query"], p["gain"], rstd, weight, 0.5)
    for mask in ([True] * 5, [False, False, True, False, False]):
        opcheck(torch.ops.attnres.block_read_merge_bwd.default,
                (*args, mask, None, None, None, torch.randn_like(P_next)))
    with_sum = torch.ops.attnres.block_read_merge_bwd(*args, [True] * 5, None, None, None,
                                                       torch.ones_like(P_next))
    without = torch.ops.attnres.block_read_merge_bwd(*args, [True] * 5)
    assert torch.equal(with_sum[2], without[2] + 1)  # P''s gradient joins the block sum's
    for a, b in zip(with_sum[:2] + with_sum[3:5], without[:2] + without[3:5]):
        assert torch.equal(a, b)
    opcheck(torch.ops.attnres.block_read_merge_inplace.default,
            (p["partial"].clone(), p["lse"], p["P"], p["query"], p["gain"], 1e-6, 0.5, None,
             None, p["delta"]))


@pytest.mark.parametrize("device", ["cpu", "meta"])  # the C++ checks and the fake kernel
def test_delta_that_shares_memory_with_the_in_place_output_is_refused(device):
    p = {k: v.to(device) for k, v in merge_problem(torch.float32, lead=(4,), D=8, seed=8).items()}
    buf = torch.randn(5 * 8).to(device)
    y = buf[:32].view(4, 8)

    def merge(delta):
        torch.ops.attnres.block_read_merge_inplace(y, p["lse"], p["P"], p["query"], p["gain"],
                                                   1e-6, 1.0, None, None, delta)

    with torch.no_grad():
        with pytest.raises(ValueError, match="partial_out and delta must be different tensors"):
            merge(y)
        with pytest.raises(RuntimeError, match="delta shares memory with partial_out"):
            merge(buf[8:].view(4, 8))  # rows 1.. of the output and one row past it
        merge(p["delta"])  # apart from it: fine


def test_torch_compile_fullgraph_fwd_and_bwd():
    torch._dynamo.reset()
    p = merge_problem(torch.float32, lead=(2, 5), D=16, seed=9)

    def step(y, lse, P, d, q, g):
        out, P_next = block_read_merge(y, lse, P, q, g, delta=d)
        return (out.square().sum() + (P_next * 0.5).sum())

    def grads(fn):
        leaves = [p[k].clone().requires_grad_() for k in ("partial", "lse", "P", "delta", "query",
                                                          "gain")]
        loss = fn(*leaves)
        return [loss, *torch.autograd.grad(loss, leaves)]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(grads(compiled), grads(step)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_vmap_over_the_sources():
    p = merge_problem(torch.float64, lead=(3, 4), D=8, seed=10)
    fn = lambda y, lse, P, d: block_read_merge(y, lse, P, p["query"], p["gain"], delta=d)  # noqa: E731
    out, P_next = torch.vmap(fn)(p["partial"], p["lse"], p["P"], p["delta"])
    want, want_P = fn(p["partial"], p["lse"], p["P"], p["delta"])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-14)
    assert torch.equal(P_next, want_P)


# ---- the one-call read: depth_attention(..., delta=) ----------------------------


def one_call_problem(dtype, lead=(3, 5), D=1000, n=3, seed=0, strided=False):
    """n sources (the last a block sum P), a delta, a query, gain and output
    weight, random (never zeros); strided rows when asked."""
    g = torch.Generator().manual_seed(seed)

    def rows(scale=1.0):
        if strided:
            full = torch.randn(*lead[:-1], 2 * lead[-1], D + 3, generator=g, dtype=torch.float64)
            return (full[..., ::2, :D] * scale).to(dtype)
        return (torch.randn(*lead, D, generator=g, dtype=torch.float64) * scale).to(dtype)

    pd = param_dtype(dtype)
    return dict(sources=[rows(10.0 ** (i % 3 - 1)) for i in range(n)], delta=rows(),
                query=(torch.randn(D, generator=g, dtype=torch.float64) * (2.0 / D ** 0.5)).to(pd),
                gain=(torch.rand(D, generator=g, dtype=torch.float64) + 0.5).to(pd),
                out_weight=(torch.rand(D, generator=g, dtype=torch.float64) + 0.5).to(pd))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("D", [67, 1000])
def test_fused_one_call_read_is_add_then_read_bit_for_bit(dtype, normed, strided, D):
    """Values, and the gradient of every input with both outputs carrying
    one, equal autograd's through torch.add and the plain one-call read."""
    p = one_call_problem(dtype, D=D, strided=strided, seed=D + strided)
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(p["delta"].shape, generator=g, dtype=torch.float64).to(dtype)
    w_sum = torch.randn(p["delta"].shape, generator=g, dtype=torch.float64).to(dtype)

    def run(fused):
        srcs = [s.detach().clone().requires_grad_() for s in p["sources"]]
        leaves = {k: p[k].detach().clone().requires_grad_()
                  for k in ("delta", "query", "gain", "out_weight")}
        w = leaves["out_weight"] if normed else None
        if fused:
            out, P_next = depth_attention(srcs, leaves["query"], leaves["gain"], out_weight=w,
                                          delta=leaves["delta"])
        else:
            P_next = srcs[-1] + leaves["delta"]
            out = depth_attention([*srcs[:-1], P_next], leaves["query"], leaves["gain"],
                                  out_weight=w)
        inputs = [*srcs, *(leaves[k] for k in ("delta", "query", "gain"))] + ([w] if normed else [])
        loss = (out * w_out).sum() + (P_next * w_sum).sum()
        return [out.detach(), P_next.detach(), *torch.autograd.grad(loss, inputs)]

    got, want = run(True), run(False)
    assert got[1].is_contiguous() and got[1].dtype == dtype
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.count_nonzero(b) > 0, i
        assert torch.equal(a, b), i
    with torch.inference_mode():  # the kernel alone, no autograd node
        out, P_next = depth_attention(p["sources"], p["query"], p["gain"], delta=p["delta"],
                                      out_weight=p["out_weight"] if normed else None)
    assert torch.equal(out, want[0]) and torch.equal(P_next, want[1])


def test_one_call_only_the_sum_output_has_a_gradient():
    p = one_call_problem(torch.float64, lead=(4,), D=16, seed=12)
    P = p["sources"][-1].clone().requires_grad_()
    delta = p["delta"].clone().requires_grad_()
    _, P_next = depth_attention([*p["sources"][:-1], P], p["query"], p["gain"], delta=delta)
    upstream = torch.randn_like(P_next)
    gP, gd = torch.autograd.grad(P_next, [P, delta], upstream)
    assert torch.equal(gP, upstream) and torch.equal(gd, upstream)
    q = p["query"].clone().requires_grad_()  # P and delta need no gradient: P' has none
    _, P_next = depth_attention(p["sources"], q, p["gain"], delta=p["delta"])
    assert not P_next.requires_grad


def test_one_call_gradcheck_and_opcheck():
    p = one_call_problem(torch.float64, lead=(3,), D=6, n=2, seed=13)
    args = [*p["sources"], p["delta"], p["query"], p["gain"], p["out_weight"]]
    args = tuple(a.clone().requires_grad_() for a in args)

    def fn(s0, s1, d, q, g, w):  # the op: its weights stay float64
        out, _, weights, _, _, P_next = torch.ops.attnres.depth_attention_fwd(
            [s0, s1], q, g, 1e-6, 0.5, w, None, False, d)
        return out, weights, P_next

    assert torch.autograd.gradcheck(fn, args)
    s = [a.detach().float().requires_grad_() for a in args]
    for w in (None, s[5]):
        opcheck(torch.ops.attnres.depth_attention_fwd.default,
                ([s[0], s[1]], s[3], s[4], 1e-6, 0.5, w, None, False, s[2]))
    out, rstd, weights, _, _, P_next = torch.ops.attnres.depth_attention_fwd(
        [s[0].detach(), s[1].detach()], s[3].detach(), s[4].detach(), 1e-6, 0.5, None, None,
        False, s[2].detach())
    bwd_args = (torch.randn_like(out), None, [s[0].detach(), P_next], s[3].detach(),
                s[4].detach(), out, rstd, weights, 0.5)
    for mask in ([True] * 4, [False, True, False, False]):
        opcheck(torch.ops.attnres.depth_attention_bwd.default,
                (*bwd_args, mask, None, None, torch.randn_like(P_next)))
    with_sum = torch.ops.attnres.depth_attention_bwd(*bwd_args, [True] * 4, None, None,
                                                      torch.ones_like(P_next))
    without = torch.ops.attnres.depth_attention_bwd(*bwd_args, [True] * 4)
    assert torch.equal(with_sum[0][1], without[0][1] + 1)  # P''s gradient joins the last source's
    assert torch.equal(with_sum[0][0], without[0][0]) and torch.equal(with_sum[1], without[1])


def test_one_call_vmap_over_the_sources():
    p = one_call_problem(torch.float64, lead=(3, 4), D=8, seed=14)
    fn = lambda a, b, c, d: depth_attention([a, b, c], p["query"], p["gain"], delta=d)  # noqa: E731
    out, P_next = torch.vmap(fn)(*p["sources"], p["delta"])
    want, want_P = fn(*p["sources"], p["delta"])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-14)
    assert torch.equal(P_next, want_P)
    out, P_next = torch.vmap(fn, in_dims=(0, 0, 0, None))(*p["sources"], p["delta"][0])
    assert torch.equal(P_next, p["sources"][2] + p["delta"][0])


# ---- DepthStream: the add deferred into the next read --------------------------


def run_stack(readers, weights, emb, S, modes=None, block_reads="two_phase", declared=True):
    """f_l = tanh(h_l @ W_l) read through `readers` (declared to the stream
    unless `declared` is False), then a final read; `modes` (optional) is
    the grad mode of each read."""
    stream = attnres.DepthStream(emb, block_size=S, block_reads=block_reads,
                                 readers=readers if declared else None)
    for l, (res, w) in enumerate(zip(readers[:-1], weights)):
        with torch.set_grad_enabled(modes[l] if modes else torch.is_grad_enabled()):
            h = res(stream)
        stream.append(torch.tanh(h @ w))
    return readers[-1](stream)


class MergeCalls:
    """Counts the stream's merges (or one-call reads) and those that took a
    delta."""

    def __init__(self, monkeypatch, names=("block_read_merge", "block_read_merge_inplace")):
        self.merges = self.fused = 0
        for name in names:
            real = getattr(modules_mod, name)

            def call(*a, _real=real, **k):
                self.merges += 1
                self.fused += k.get("delta") is not None
                return _real(*a, **k)

            monkeypatch.setattr(modules_mod, name, call)


def unfused(monkeypatch):
    """The stream with its deferred adds made before every read."""
    def take(self):
        self._settle()
        return None
    monkeypatch.setattr(modules_mod.DepthStream, "_take_pending", take)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S", [(9, 4), (7, 3), (6, 8)])
def test_stream_reads_with_the_fused_add_are_bit_for_bit_the_unfused(dtype, L, S, monkeypatch):
    readers, weights = make_stack(L, 24, dtype)
    emb = torch.randn(3, 5, 24, dtype=torch.float64).to(dtype).requires_grad_()
    params = [emb, *weights, *[p for r in readers for p in r.parameters()]]
    calls = MergeCalls(monkeypatch)
    out = run_stack(readers, weights, emb, S)
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    with torch.no_grad():
        inference = run_stack(readers, weights, emb, S)
    # Every merge whose block already holds a partial sum of 2+ outputs fuses.
    assert calls.fused > 0 and calls.fused <= calls.merges
    unfused(monkeypatch)
    want = run_stack(readers, weights, emb, S)
    want_grads = torch.autograd.grad(want.square().sum(), params, allow_unused=True)
    with torch.no_grad():
        want_inference = run_stack(readers, weights, emb, S)
    assert torch.equal(out, want) and torch.equal(inference, want_inference)
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        assert (g is None) == (w is None), i
        assert g is None or torch.equal(g, w), i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_reads", ["one_call", "auto", "undeclared"])
def test_one_call_stream_reads_fuse_bit_for_bit(dtype, block_reads, monkeypatch):
    """The stream's one-call reads (block_reads="one_call", "auto" below
    its two-phase threshold or in bf16/fp16 training, and every read of a
    stream without declared readers) take the deferred output as delta,
    and change no bit of the reads or gradients."""
    L, S = 9, 4
    readers, weights = make_stack(L, 24, dtype, seed=7)
    emb = torch.randn(3, 5, 24, dtype=torch.float64).to(dtype).requires_grad_()
    params = [emb, *weights, *[p for r in readers for p in r.parameters()]]
    declared = block_reads != "undeclared"
    mode = block_reads if declared else "auto"

    def run():
        out = run_stack(readers, weights, emb, S, block_reads=mode, declared=declared)
        grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        with torch.no_grad():
            inference = run_stack(readers, weights, emb, S, block_reads=mode, declared=declared)
        return [out, inference, *grads]

    calls = MergeCalls(monkeypatch, names=("depth_attention",))
    got = run()
    assert calls.fused > 0
    unfused(monkeypatch)
    for i, (g, w) in enumerate(zip(got, run())):
        assert (g is None) == (w is None), i
        assert g is None or torch.equal(g, w), i


def test_an_output_appended_with_grad_keeps_its_graph_through_a_no_grad_read(monkeypatch):
    """The deferred add runs in its append's modes: a read under no_grad
    between the append and a training read neither drops the output's graph
    nor fuses a graph-less sum into it."""
    L, S = 7, 4
    readers, weights = make_stack(L, 16, torch.float64, seed=2)
    emb = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    modes = [True, True, False, True, True, False, True]

    def loss_and_grads():
        out = run_stack(readers, weights, emb, S, modes)
        return [out, *torch.autograd.grad(out.sum(), [emb, *weights])]

    got = loss_and_grads()
    unfused(monkeypatch)
    want = loss_and_grads()
    for g, w in zip(got, want):
        assert torch.count_nonzero(w) > 0
        assert torch.equal(g, w)


def test_sources_and_clone_see_the_deferred_output():
    readers, weights = make_stack(3, 8, torch.float64, seed=3)
    emb = torch.randn(2, 8, dtype=torch.float64)
    stream = attnres.DepthStream(emb, block_size=4, block_reads="two_phase", readers=readers)
    f1, f2 = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    readers[0](stream)
    stream.append(f1)
    readers[1](stream)
    stream.append(f2)  # deferred: the next read would add it
    clone = stream.clone()
    assert torch.equal(stream.sources[-1], f1 + f2) and torch.equal(clone.sources[-1], f1 + f2)
    leaves, spec = stream.flatten()
    assert torch.equal(attnres.DepthStream.unflatten(leaves, spec).sources[-1], f1 + f2)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_the_stream_fuses_in_every_mode(mode, monkeypatch):
    readers, weights = make_stack(9, 16, torch.float32, seed=4)
    emb = torch.randn(2, 16)
    calls = MergeCalls(monkeypatch)
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
           "inference_mode": torch.inference_mode}[mode]
    with ctx():
        run_stack(readers, weights, emb, 4)
    # S = 4, 9 sublayers: the reads after the 2nd and 3rd output of each
    # block (the 1st starts the sum, the 4th completes it) fuse: 4 of 7 merges.
    assert (calls.merges, calls.fused) == (7, 4)


def test_the_partial_sum_after_a_fused_read_is_the_merges_output():
    readers, _ = make_stack(3, 8, torch.float64, seed=6)
    f1, f2 = (torch.randn(2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    stream = attnres.DepthStream(torch.randn(2, 8, dtype=torch.float64), block_size=4,
                                 block_reads="two_phase", readers=readers)
    readers[0](stream)
    stream.append(f1 * 1.0)
    readers[1](stream)
    stream.append(f2 * 1.0)
    readers[2](stream)
    partial = stream.sources[-1]
    assert "MergeFunction" in partial.grad_fn.name()
    assert torch.equal(partial, f1 + f2)


def test_block_sum_output_needs_no_gradient_when_its_inputs_need_none():
    p = merge_problem(torch.float32, lead=(3,), D=8, seed=11)
    q = p["query"].clone().requires_grad_()
    _, P_next = block_read_merge(p["partial"], p["lse"], p["P"], q, p["gain"], delta=p["delta"])
    assert not P_next.requires_grad and P_next.grad_fn is None
    d = p["delta"].clone().requires_grad_()
    _, P_next = block_read_merge(p["partial"], p["lse"], p["P"], q, p["gain"], delta=d)
    assert P_next.requires_grad


@pytest.mark.parametrize("with_delta", [False, True], ids=["plain", "delta"])
def test_the_reads_statistics_carry_no_gradient(with_delta):
    """rstd, h (not kept), out_rstd (and the merge's weight) are never
    differentiable outputs, with or without the prefix add."""
    p = merge_problem(torch.float32, lead=(3,), D=8, seed=15)
    P = p["P"].clone().requires_grad_()
    d = p["delta"].clone().requires_grad_() if with_delta else None
    outs = torch.ops.attnres.block_read_merge_fwd(p["partial"], p["lse"], P, p["query"], p["gain"],
                                                  1e-6, 1.0, p["out_weight"], None, False, d)
    assert outs[0].requires_grad and outs[5].requires_grad == with_delta
    assert not any(t.requires_grad for t in outs[1:5])
    outs = torch.ops.attnres.depth_attention_fwd([p["partial"], P], p["query"], p["gain"], 1e-6,
                                                 1.0, p["out_weight"], None, False, d)
    assert outs[0].requires_grad and outs[2].requires_grad and outs[5].requires_grad == with_delta
    assert not any(t.requires_grad for t in (outs[1], outs[3], outs[4]))


def test_a_failed_merge_keeps_the_deferred_output(monkeypatch):
    readers, weights = make_stack(3, 8, torch.float64, seed=5)
    emb = torch.randn(2, 8, dtype=torch.float64)
    f1, f2 = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    stream = attnres.DepthStream(emb, block_size=4, block_reads="two_phase", readers=readers)
    readers[0](stream)
    stream.append(f1)
    readers[1](stream)
    stream.append(f2)
    real = modules_mod.block_read_merge

    def fail(*a, **k):
        raise RuntimeError("injected")
    monkeypatch.setattr(modules_mod, "block_read_merge", fail)
    with pytest.raises(RuntimeError, match="injected"):
        readers[2](stream)
    monkeypatch.setattr(modules_mod, "block_read_merge", real)
    assert torch.equal(stream.sources[-1], f1 + f2)


def test_a_failed_one_call_read_keeps_the_deferred_output(monkeypatch):
    readers, _ = make_stack(3, 8, torch.float64, seed=8)
    f1, f2 = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    stream = attnres.DepthStream(torch.randn(2, 8, dtype=torch.float64), block_size=4,
                                 block_reads="one_call", readers=readers)
    readers[0](stream)
    stream.append(f1)
    readers[1](stream)
    stream.append(f2)

    def fail(*a, **k):
        raise RuntimeError("injected")
    real = modules_mod.depth_attention
    monkeypatch.setattr(modules_mod, "depth_attention", fail)
    with pytest.raises(RuntimeError, match="injected"):
        readers[2](stream)
    monkeypatch.setattr(modules_mod, "depth_attention", real)
    assert torch.equal(stream.sources[-1], f1 + f2)


@pytest.mark.parametrize("block_reads", ["two_phase", "one_call"])
def test_compiled_block_gpt_fuses_without_graph_breaks(block_reads, monkeypatch):
    """A Block GPT with S = 4 (two deferred outputs a block) under
    torch.compile(fullgraph=True): the fused merges (or one-call reads) are
    traced, and the loss and gradients equal eager's."""
    from attnres.models import GPT, GPTConfig
    from helpers import randomize_reads
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_layers=4, n_heads=2,
                    residual="block", block_size=4, block_reads=block_reads)
    model = GPT(cfg)
    randomize_reads(model)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        _, loss = fn(idx, idx)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = loss_and_grads(model)
    calls = MergeCalls(monkeypatch, names=("block_read_merge", "block_read_merge_inplace",
                                           "depth_attention"))
    got = loss_and_grads(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert calls.fused > 0  # counted while tracing
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
