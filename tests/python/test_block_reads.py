"""Two-phase Block reads (docs/design.md §10): the ops block_reads_fwd/bwd
and block_read_merge_fwd/bwd against a float64 reference, their autograd,
opcheck and torch.compile, and DepthStream/AttnResResidual using them in
place of one-call reads. (Their optional out_weight: test_out_norm.py.)"""
import re

import pytest
import torch
from torch.library import opcheck

import attnres
import attnres.modules as modules_mod
from attnres import reference
from attnres.ops import block_read_merge_inplace
from attnres.models import GPT, GPTConfig

from float64_reference import depth_attention_ref, rel_err
from helpers import (
    GRAD_REL_TOL,
    RANGE_MAGNITUDES,
    REL_TOL,
    STAT_REL_TOL,
    assert_rel_close,
    extreme_sources,
    make_stack,
    param_dtype,
    randomize_reads,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def problem(n, s, lead, d, dtype, seed=0, gain=True):
    g = torch.Generator().manual_seed(seed)
    sources = []
    for _ in range(n + 1):  # the last one is the partial block sum
        mag = 10.0 ** (torch.rand((), generator=g).item() * 2 - 1)
        sources.append((torch.randn(*lead, d, generator=g, dtype=torch.float64) * mag).to(dtype))
    pd = param_dtype(dtype)
    queries = (torch.randn(s, d, generator=g, dtype=torch.float64) * (2.0 / d ** 0.5)).to(pd)
    gains = (torch.rand(s, d, generator=g, dtype=torch.float64) + 0.5).to(pd) if gain else None
    return sources[:n], sources[n], queries, gains


def ref_read(sources, query, gain, eps=1e-6):
    """The float64 reference of one read: h and the weights (float64; the
    eager reference returns float32 weights)."""
    srcs = torch.stack([x.detach().double() for x in sources])
    u = query.detach().double() * (1.0 if gain is None else gain.detach().double())
    rstd = srcs.pow(2).mean(-1).add(eps).rsqrt()
    weights = torch.softmax(rstd * (srcs @ u), 0)
    return (weights.unsqueeze(-1) * srcs).sum(0), weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,s,lead,d", [(1, 1, (3,), 1), (2, 3, (2, 5), 7), (5, 6, (13,), 67),
                                        (3, 4, (1, 4), 1000)])
def test_forward_matches_float64_reference(dtype, n, s, lead, d):
    sources, block_sum, queries, gains = problem(n, s, lead, d, dtype)
    partial_outs, lse, rstd, weights, h0, out_rstd = torch.ops.attnres.block_reads_fwd(
        sources, queries, gains, 1e-6, 1.0)
    assert len(partial_outs) == s and lse.shape == (s, *lead) and weights.shape == (s, n, *lead)
    # No out_weight: the output norm's statistics are empty.
    assert h0.shape == (0,) and out_rstd.shape == (0,)
    ref_rstd = torch.stack([x.double().pow(2).mean(-1).add(1e-6).rsqrt() for x in sources])
    assert_rel_close(rstd, ref_rstd, STAT_REL_TOL[dtype], "rstd")
    for r in range(s):
        gain = None if gains is None else gains[r]
        h_ref, w_ref = ref_read(sources, queries[r], gain)
        assert partial_outs[r].dtype == dtype
        assert_rel_close(partial_outs[r], h_ref, REL_TOL[dtype], f"partial_outs[{r}]")
        assert_rel_close(weights[r], w_ref, STAT_REL_TOL[dtype], f"weights[{r}]")
        # lse: log sum exp of the float64 scores.
        q = queries[r].double() * (1.0 if gain is None else gain.double())
        scores = torch.stack([ref_rstd[i] * (sources[i].double() @ q) for i in range(n)])
        assert_rel_close(lse[r], torch.logsumexp(scores, 0), STAT_REL_TOL[dtype], "lse")
        # Phase 2 with the partial block sum: the one-call read over n + 1.
        h, rstd_p, a_p, h_kept, out_rstd_p, _ = torch.ops.attnres.block_read_merge_fwd(
            partial_outs[r], lse[r], block_sum, queries[r], gain, 1e-6, 1.0)
        assert h_kept.shape == (0,) and out_rstd_p.shape == (0,)
        h_ref, w_ref = ref_read([*sources, block_sum], queries[r], gain)
        assert_rel_close(h, h_ref, REL_TOL[dtype], f"merged h[{r}]")
        assert_rel_close(a_p, w_ref[-1], STAT_REL_TOL[dtype], "block_sum weight")


def read_all(sources, block_sum, queries, gains, dh, merge_from=1):
    """h of every reader: reader 0 (and those before merge_from) from phase 1
    alone, the others merged with block_sum; then backward of sum <dh_r, h_r>."""
    partial_outs, lse = attnres.block_reads(sources, queries, gains)
    hs = []
    for r in range(queries.shape[0]):
        gain = None if gains is None else gains[r]
        if r < merge_from:
            hs.append(partial_outs[r])
        else:
            hs.append(attnres.block_read_merge(partial_outs[r], lse[r], block_sum, queries[r], gain))
    loss = sum((h.double() * g).sum() for h, g in zip(hs, dh))
    loss.backward()
    return hs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gain", [True, False])
@pytest.mark.parametrize("n,s,lead,d", [(1, 2, (4,), 5), (3, 5, (2, 3), 33), (4, 3, (7,), 256),
                                        (3, 5, (3,), 1000)])  # D = 1000: an 8-element tail
def test_gradients_match_float64_reference(dtype, gain, n, s, lead, d):
    sources, block_sum, queries, gains = problem(n, s, lead, d, dtype, seed=1, gain=gain)
    g = torch.Generator().manual_seed(2)
    dh = [torch.randn(*lead, d, generator=g, dtype=torch.float64) for _ in range(s)]
    leaves = [x.clone().requires_grad_(True) for x in [*sources, block_sum, queries]]
    gains_leaf = gains.clone().requires_grad_(True) if gain else None
    read_all(leaves[:n], leaves[n], leaves[n + 1], gains_leaf, dh)
    # Reference: the same reads, one call each, in float64.
    ref = [x.detach().double().requires_grad_(True) for x in [*sources, block_sum, queries]]
    ref_gains = gains.detach().double().requires_grad_(True) if gain else None
    loss = 0
    for r in range(s):
        srcs = ref[:n] if r == 0 else [*ref[:n], ref[n]]
        h = reference.depth_attention(srcs, ref[n + 1][r], None if ref_gains is None else ref_gains[r])
        loss = loss + (h * dh[r]).sum()
    loss.backward()
    tol = GRAD_REL_TOL[dtype]
    for i in range(n):
        assert_rel_close(leaves[i].grad, ref[i].grad, tol, f"grad sources[{i}]")
    assert_rel_close(leaves[n].grad, ref[n].grad, tol, "grad block_sum")
    assert_rel_close(leaves[n + 1].grad, ref[n + 1].grad, tol, "grad queries")
    if gain:
        assert_rel_close(gains_leaf.grad, ref_gains.grad, tol, "grad norm_weights")


def test_gradcheck_float64():
    sources, block_sum, queries, gains = problem(3, 3, (2, 3), 6, torch.float64, seed=3)
    inputs = [x.clone().requires_grad_(True) for x in [*sources, block_sum, queries, gains]]

    def phase1(a, b, c, q, g):
        partial_outs, lse = attnres.block_reads([a, b, c], q, g, eps=1e-3, scale=0.7)
        return (*partial_outs, lse)

    assert torch.autograd.gradcheck(phase1, (*inputs[:3], inputs[4], inputs[5]))

    def merge(y, lse, p, q, g):
        return attnres.block_read_merge(y, lse, p, q, g, eps=1e-3, scale=0.7)

    y = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    lse = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    q, g = inputs[4][1].detach().requires_grad_(True), inputs[5][1].detach().requires_grad_(True)
    assert torch.autograd.gradcheck(merge, (y, lse, inputs[3], q, g))

    def composed(a, b, c, p, q, g):
        partial_outs, lse = attnres.block_reads([a, b, c], q, g)
        return (partial_outs[0],
                *(attnres.block_read_merge(partial_outs[r], lse[r], p, q[r], g[r]) for r in (1, 2)))

    assert torch.autograd.gradcheck(composed, tuple(inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_gain", [True, False])
def test_opcheck(dtype, with_gain):
    sources, block_sum, queries, gains = problem(3, 2, (2, 3), 8, dtype, seed=4, gain=with_gain)
    opcheck(torch.ops.attnres.block_reads_fwd.default, (sources, queries, gains, 1e-6, 0.5))
    partial_outs, lse, rstd, weights, _, _ = torch.ops.attnres.block_reads_fwd(
        sources, queries, gains, 1e-6, 0.5)
    dy = [torch.randn_like(y) for y in partial_outs]
    dlse = torch.randn_like(lse)
    opcheck(torch.ops.attnres.block_reads_bwd.default,
            (dy, dlse, sources, queries, gains, rstd, weights, 0.5, [True] * 5))
    gain = None if gains is None else gains[1]
    merge_args = (partial_outs[1], lse[1], block_sum, queries[1], gain, 1e-6, 0.5)
    opcheck(torch.ops.attnres.block_read_merge_fwd.default, merge_args)
    h, rstd_p, a_p, _, _, _ = torch.ops.attnres.block_read_merge_fwd(*merge_args)
    opcheck(torch.ops.attnres.block_read_merge_bwd.default,
            (torch.randn_like(h), partial_outs[1], block_sum, queries[1], gain, rstd_p, a_p, 0.5,
             [True] * 5))


def test_strided_inputs_used_as_given():
    sources, block_sum, queries, gains = problem(3, 3, (4, 5), 9, torch.float32, seed=5)
    strided = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in sources]  # leading dims swapped
    wide = torch.randn(4, 5, 20)
    wide[..., 3:12] = block_sum
    block_view = wide[..., 3:12]  # row stride 20
    assert not block_view.is_contiguous() and not strided[0].is_contiguous()
    partial_outs, lse = attnres.block_reads(strided, queries.t().contiguous().t(), gains)
    want, want_lse = attnres.block_reads(sources, queries, gains)
    for a, b in zip(partial_outs, want):
        assert torch.equal(a, b)
    assert torch.equal(lse, want_lse)
    y_view = torch.stack(partial_outs, -1)[..., 1]  # a strided partial output
    h = attnres.block_read_merge(y_view, lse[1], block_view, queries[1], gains[1])
    assert torch.equal(h, attnres.block_read_merge(partial_outs[1], lse[1], block_sum, queries[1],
                                                   gains[1]))


@pytest.mark.parametrize("rare_rows", [False, True])
def test_parameter_gradients_deterministic_across_threads(rare_rows):
    sources, block_sum, queries, gains = problem(4, 3, (300,), 64, torch.float32, seed=6)
    if rare_rows:  # every 7th token near the maximum: recomputed in the wide type
        big = torch.finfo(torch.float32).max / 4
        sources = [x.clone() for x in sources]
        block_sum = block_sum.clone()
        for x in [*sources, block_sum]:
            x[::7] = torch.rand(x[::7].shape, generator=torch.Generator().manual_seed(8)) * big
    g = torch.Generator().manual_seed(7)
    dh = [torch.randn(300, 64, generator=g, dtype=torch.float64) for _ in range(3)]
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q = queries.clone().requires_grad_(True)
            gn = gains.clone().requires_grad_(True)
            read_all(sources, block_sum, q, gn, dh)
            results.append((q.grad, gn.grad))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_bad_arguments_name_what_is_wrong():
    sources, block_sum, queries, gains = problem(2, 3, (4,), 8, torch.float32)
    with pytest.raises(ValueError, match=r"queries must have shape \[S, D\]"):
        attnres.block_reads(sources, queries[0], None)
    with pytest.raises(ValueError, match=r"queries must have shape \[S, D\] = \[3, 8\]"):
        attnres.block_reads(sources, queries[:, :5], None)
    with pytest.raises(ValueError, match="norm_weights must have the queries' shape"):
        attnres.block_reads(sources, queries, gains[:2])
    partial_outs, lse = attnres.block_reads(sources, queries, gains)
    assert lse.dtype == torch.float64  # for every source dtype (design §10, "Range")
    with pytest.raises(TypeError, match="lse must have dtype torch.float64"):
        attnres.block_read_merge(partial_outs[0], lse[0].float(), block_sum, queries[0])
    with pytest.raises(ValueError, match="partial_out must have block_sum's shape"):
        attnres.block_read_merge(partial_outs[0][:2], lse[0], block_sum, queries[0])


def test_fake_kernels_raise_the_same_words():
    sources, block_sum, queries, gains = problem(2, 3, (4,), 8, torch.float32)
    meta = [x.to("meta") for x in sources]
    with pytest.raises(ValueError, match=r"queries must have shape \[S, D\] = \[3, 8\]"):
        torch.ops.attnres.block_reads_fwd(meta, queries[:, :5].to("meta"), None, 1e-6, 1.0)
    parts, lse, rstd, w, h, out_rstd = torch.ops.attnres.block_reads_fwd(
        meta, queries.to("meta"), None, 1e-6, 1.0)
    assert [tuple(p.shape) for p in parts] == [(4, 8)] * 3 and lse.shape == (3, 4)
    assert lse.dtype == torch.float64
    assert rstd.shape == (2, 4) and w.shape == (3, 2, 4) and w.dtype == torch.float32
    assert h.shape == (0,) and out_rstd.shape == (0,)
    for device in ("cpu", "meta"):  # the C++ checks and the fake kernel: the same words
        y, p, q = torch.zeros(4, 8, device=device), block_sum.to(device), queries[0].to(device)
        lse0 = torch.zeros(4, device=device, dtype=torch.float64)
        with pytest.raises(ValueError, match="partial_out must have block_sum's shape"):
            torch.ops.attnres.block_read_merge_fwd(y[:2], lse0, p, q, None, 1e-6, 1.0)
        with pytest.raises(TypeError, match="lse must have dtype torch.float64, got torch.float32"):
            torch.ops.attnres.block_read_merge_fwd(y, lse0.float(), p, q, None, 1e-6, 1.0)


def test_torch_compile_fullgraph_of_the_ops():
    torch._dynamo.reset()
    sources, block_sum, queries, gains = problem(3, 3, (2, 5), 16, torch.float32, seed=8)

    def reads(a, b, c, p, q, g):
        partial_outs, lse = attnres.block_reads([a, b, c], q, g)
        h1 = attnres.block_read_merge(partial_outs[1], lse[1], p, q[1], g[1])
        return (partial_outs[0] * h1).sum()

    leaves = [x.clone().requires_grad_(True) for x in [*sources, block_sum, queries, gains]]
    eager = reads(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(reads, fullgraph=True, backend="aot_eager", dynamic=True)
    got = compiled(*leaves)
    got_grads = torch.autograd.grad(got, leaves)
    assert torch.allclose(got, eager, rtol=1e-6)
    for a, b in zip(got_grads, eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


# ---- the modules ---------------------------------------------------------------------


class CountingOps:
    """Counts the two-phase op calls the modules make."""

    def __init__(self, monkeypatch):
        self.phase1 = self.merge = 0
        real_reads, real_merge = modules_mod.block_reads, modules_mod.block_read_merge
        real_inplace = modules_mod.block_read_merge_inplace

        def reads(*a, **k):
            self.phase1 += 1
            return real_reads(*a, **k)

        def merge(*a, **k):
            self.merge += 1
            return real_merge(*a, **k)

        def inplace(*a, **k):
            self.merge += 1
            return real_inplace(*a, **k)

        monkeypatch.setattr(modules_mod, "block_reads", reads)
        monkeypatch.setattr(modules_mod, "block_read_merge", merge)
        monkeypatch.setattr(modules_mod, "block_read_merge_inplace", inplace)


def run_stack(readers, weights, emb, block_size, block_reads):
    """A stack of sublayers f_l = tanh(h_l @ W_l) read through `readers`,
    then a final read: what a PreNorm model does."""
    stream = attnres.DepthStream(emb, block_size=block_size, block_reads=block_reads, readers=readers)
    for res, w in zip(readers[:-1], weights):
        stream.append(torch.tanh(res(stream) @ w))
    return readers[-1](stream)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(7, 2), (9, 4), (8, 4), (5, 8)])
def test_stream_two_phase_equals_one_call(dtype, L, S, monkeypatch):
    D = 24
    readers, weights = make_stack(L, D, dtype)
    emb = torch.randn(3, 5, D, dtype=torch.float64).to(dtype).requires_grad_(True)
    params = [emb, *weights, *[p for r in readers for p in r.parameters()]]

    def loss_grads(mode):
        out = run_stack(readers, weights, emb, S, mode)
        grads = torch.autograd.grad(out.double().pow(2).sum(), params)
        return out, grads

    counts = CountingOps(monkeypatch)
    want, want_grads = loss_grads("one_call")
    assert counts.phase1 == 0 and counts.merge == 0
    got, got_grads = loss_grads("two_phase")  # the declared readers: two-phase from the first pass
    blocks = -(-(L + 1) // S)
    assert counts.phase1 == blocks  # once per block
    assert counts.merge == L + 1 - blocks  # every read but the first of each block
    assert_rel_close(got, want, REL_TOL[dtype], "h")
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert_rel_close(a, b, GRAD_REL_TOL[dtype], f"grad {i}")


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
def test_auto_uses_two_phase_from_the_third_completed_source(grad, monkeypatch):
    """Under "auto" the reads of blocks with n >= 3 completed sources are
    two-phase, also those autograd records (with the one-call gradients);
    without grad mode only for sources of more than 2^18 elements."""
    D, L, S = 16, 8, 2
    readers, weights = make_stack(L, D, torch.float32)
    rows = 4 if grad else (1 << 18) // D + 1
    emb = torch.randn(rows, D, requires_grad=grad)
    params = [emb, *weights, *[p for r in readers for p in r.parameters()]]
    with torch.set_grad_enabled(grad):
        want = run_stack(readers, weights, emb, S, "one_call")
        counts = CountingOps(monkeypatch)
        got = run_stack(readers, weights, emb, S, "auto")
    # Blocks with n = 1, 2 completed sources read one-call; blocks 3..5 two-phase.
    assert counts.phase1 == 3 and counts.merge == 2
    assert_rel_close(got, want, REL_TOL[torch.float32])
    if grad:
        want_grads = torch.autograd.grad(want.pow(2).sum(), params)
        got_grads = torch.autograd.grad(got.pow(2).sum(), params)
        for i, (a, b) in enumerate(zip(got_grads, want_grads)):
            assert_rel_close(a, b, GRAD_REL_TOL[torch.float32], f"grad {i}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_auto_reads_decode_sized_inference_one_call(dtype, monkeypatch):
    """Without grad mode "auto" reads one-call while a source holds at most
    2^18 elements (decode sizes: host work outweighs the bytes two-phase
    saves), under no_grad and inference mode; two-phase from one more."""
    D, L, S = 64, 8, 2
    readers, weights = make_stack(L, D, dtype)
    counts = CountingOps(monkeypatch)
    for rows, phase1 in ((1, 0), ((1 << 18) // D, 0), ((1 << 18) // D + 1, 3)):
        emb = torch.randn(rows, D).to(dtype)
        for mode in (torch.no_grad, torch.inference_mode):
            before = counts.phase1
            with mode():
                want = run_stack(readers, weights, emb, S, "one_call")
                got = run_stack(readers, weights, emb, S, "auto")
            assert counts.phase1 - before == phase1, (rows, mode)
            assert_rel_close(got, want, 2 * REL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_auto_keeps_bf16_and_fp16_training_reads_one_call(dtype, monkeypatch):
    """Their merge backward would take <dh, P - y> from the partial output
    rounded to 8/11 bits (docs/design.md §10); inference reads are
    two-phase, and "two_phase" forces training reads."""
    D, L, S = 16, 8, 2
    readers, weights = make_stack(L, D, dtype)
    emb = torch.randn(4, D).to(dtype).requires_grad_(True)
    counts = CountingOps(monkeypatch)
    run_stack(readers, weights, emb, S, "auto")
    assert counts.phase1 == 0 and counts.merge == 0
    with torch.no_grad():
        # Sources above the decode size (2^18 elements) read two-phase.
        run_stack(readers, weights, torch.randn((1 << 18) // D + 1, D).to(dtype), S, "auto")
    assert counts.phase1 == 3 and counts.merge == 2
    run_stack(readers, weights, emb, S, "two_phase")
    assert counts.phase1 == 3 + 5 and counts.merge == 2 + 4


def test_reads_follow_the_declared_readers_or_read_one_call(monkeypatch):
    """The declared order is checked at every read; without readers a Block
    stream reads one call (the same result), and "two_phase" needs them."""
    D, L, S = 16, 6, 3
    readers, weights = make_stack(L, D, torch.float64)
    emb = torch.randn(4, D, dtype=torch.float64)
    order = [readers[1], readers[0], *readers[2:]]  # the first block's readers swapped
    with torch.no_grad():
        want = run_stack(readers, weights, emb, S, "one_call")
        stream = attnres.DepthStream(emb, block_size=S, block_reads="auto", readers=order)
        with pytest.raises(ValueError, match=re.escape(
                "DepthStream: the read after 0 outputs is not the one the stream's readers "
                "declare there (reader 0 of the declared list)")):
            readers[0](stream)
        counts = CountingOps(monkeypatch)
        plain = attnres.DepthStream(emb, block_size=S)
        for res, w in zip(readers[:-1], weights):
            plain.append(torch.tanh(res(plain) @ w))
        assert counts.phase1 == 0 and counts.merge == 0
        assert torch.equal(readers[-1](plain), want)
        stream = attnres.DepthStream(emb, block_size=S, readers=readers[:2])
        stream.append(torch.tanh(readers[0](stream) @ weights[0]))
        stream.append(torch.tanh(readers[1](stream) @ weights[1]))
        with pytest.raises(ValueError, match=re.escape("declare there (none)")):
            readers[2](stream)
    with pytest.raises(ValueError, match=re.escape("block_reads='two_phase' needs the stream's readers")):
        attnres.DepthStream(emb, block_size=S, block_reads="two_phase")
    with pytest.raises(TypeError, match="readers must be AttnResResidual modules in read order"):
        attnres.DepthStream(emb, block_size=S, readers=[torch.nn.Linear(D, D)])


def test_return_weights_and_cuda_streams_read_one_call(monkeypatch):
    D = 8
    readers, weights = make_stack(4, D, torch.float32)
    emb = torch.randn(2, D)
    counts = CountingOps(monkeypatch)
    stream = attnres.DepthStream(emb, block_size=2, block_reads="two_phase", readers=readers)
    stream.append(torch.tanh(readers[0](stream) @ weights[0]))
    h, w = readers[1](stream, return_weights=True)
    assert w.shape == (2, 2) and counts.merge == 0
    with pytest.raises(ValueError, match="block_reads must be one of"):
        attnres.DepthStream(emb, block_size=2, block_reads="fast")


def gpt(block_reads, **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_layers=4, n_heads=2, residual="block",
                    block_size=2, block_reads=block_reads, **kw)
    model = GPT(cfg)
    randomize_reads(model)
    return model


def gpt_loss_grads(model, idx):
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointed_gpt_two_phase_matches_one_call(monkeypatch):
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    want_loss, want = gpt_loss_grads(gpt("one_call"), idx)
    model = gpt("two_phase", checkpoint_blocks=True)
    counts = CountingOps(monkeypatch)
    loss, got = gpt_loss_grads(model, idx)
    assert counts.merge > 0
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    for name in want:
        assert_rel_close(got[name], want[name], 1e-4, name)


@pytest.mark.parametrize("checkpoint_blocks", [False, True], ids=["plain", "checkpointed"])
def test_block_gpt_trains_alike_under_auto_and_one_call(checkpoint_blocks, monkeypatch):
    """AdamW steps of a Block GPT (4 layers, S = 2: the reads of blocks 3 and
    4 are two-phase under "auto"): the loss trajectory of "one_call"."""
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 32, (4, 8), generator=gen) for _ in range(8)]
    losses, merges = {}, {}
    for mode in ("one_call", "auto"):
        model = gpt(mode, checkpoint_blocks=checkpoint_blocks)
        opt = torch.optim.AdamW(attnres.param_groups(model, lr=3e-3, weight_decay=0.1),
                                betas=(0.9, 0.95))
        counts = CountingOps(monkeypatch)
        losses[mode] = []
        for idx in batches:
            opt.zero_grad(set_to_none=True)
            _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
        merges[mode] = counts.merge
    assert merges["one_call"] == 0 and merges["auto"] > 0
    torch.testing.assert_close(torch.tensor(losses["auto"]), torch.tensor(losses["one_call"]),
                               rtol=1e-5, atol=0)
    assert losses["auto"][-1] < losses["auto"][0]


def test_compiled_block_gpt_two_phase_matches_one_call(monkeypatch):
    torch._dynamo.reset()
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    want_loss, want = gpt_loss_grads(gpt("one_call"), idx)
    model = gpt("two_phase")
    counts = CountingOps(monkeypatch)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, got = gpt_loss_grads(compiled, idx)
    assert counts.merge > 0  # traced through the two-phase ops
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    for name in want:
        assert_rel_close(got[name], want[name], 1e-4, name)


def test_nan_poisons_only_its_token():
    sources, block_sum, queries, gains = problem(3, 2, (5,), 16, torch.float32, seed=9)
    sources[1] = sources[1].clone()
    sources[1][2, 3] = float("nan")
    partial_outs, lse = attnres.block_reads(sources, queries, gains)
    for y in partial_outs:
        assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4]]).all()
    assert torch.isnan(lse[:, 2]).all()
    block_sum = block_sum.clone()
    block_sum[4, 0] = float("nan")
    clean = [x.clone() for x in sources]
    clean[1][2, 3] = 0.0
    clean_outs, clean_lse = attnres.block_reads(clean, queries, gains)
    h = attnres.block_read_merge(clean_outs[1], clean_lse[1], block_sum, queries[1], gains[1])
    assert torch.isnan(h[4]).all() and torch.isfinite(h[:4]).all()


@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
def test_rows_near_the_float32_limits_are_rescued(magnitude):
    # Sums of squares over/underflow float32: the forward's rescaled path
    # (depth_math.h) must give the float64 result.
    sources, block_sum, queries, gains = problem(3, 2, (4,), 64, torch.float32, seed=10)
    sources = [x * magnitude for x in sources]
    block_sum = block_sum * magnitude
    partial_outs, lse = attnres.block_reads(sources, queries, gains, eps=0.0)
    for r in range(2):
        h_ref, _ = ref_read(sources, queries[r], gains[r], eps=0.0)
        assert_rel_close(partial_outs[r], h_ref, REL_TOL[torch.float32], "partial")
    h = attnres.block_read_merge(partial_outs[1], lse[1], block_sum, queries[1], gains[1], eps=0.0)
    h_ref, _ = ref_read([*sources, block_sum], queries[1], gains[1], eps=0.0)
    assert_rel_close(h, h_ref, REL_TOL[torch.float32], "merged")


# ---- rows near the dtype's limits (docs/design.md §8, §10) ----------------------------
# The one-call op's range test (test_reliability.py, _check_against_ref) for the two-phase
# ops: finite inputs anywhere in the dtype's range, ground truth
# tests/python/float64_reference.py (right for any finite input).


def assert_grad_close(a, b, dtype, what, terms=()):
    """Gradient a (ours) against b (float64), where the true gradient and
    every term autograd sums into it (terms: one per read) are representable
    in a's dtype (below half its maximum: within the tolerance of the
    maximum, an accurate result may round to inf): finite there, and rel_err
    within the dtype's gradient tolerance plus a slack of the dtype's
    smallest normal number per element (a true gradient below it, e.g. the
    query gradient of rows of 1e-30 with eps 1e-6, ~1e-58, has no relative
    precision in that dtype)."""
    limit, tiny = torch.finfo(a.dtype).max / 2, torch.finfo(a.dtype).tiny
    representable = b.abs() <= limit
    for term in terms:
        representable &= term.abs() <= limit
    assert torch.isfinite(a[representable]).all(), f"{what} not finite"
    a, b = a[representable].double(), b[representable]
    m = b.abs().max().item() if b.numel() else 1.0
    m = m if 0 < m < float("inf") else 1.0
    err, size = ((a - b) / m).norm().item(), (b / m).norm().item()
    slack = tiny / m * b.numel() ** 0.5
    assert err <= GRAD_REL_TOL[dtype] * size + slack, f"{what}: {err / max(size, 1e-300):.3g}"


def parameter_grad_near_its_maximum(b, like):
    """Query/gain gradients near the maximum are not checked: their
    per-token terms may exceed it although the sum does not (§8's limit)."""
    return bool((b.abs() > torch.finfo(like.dtype).max / 8).any())


def leaves_of(*tensors):
    return [None if x is None else x.detach().clone().requires_grad_(True) for x in tensors]


def check_phase_one_near_the_limits(sources, queries, gains, dtype, *, eps, scale, gen, what,
                                    dy=None, dlse_scale=1.0):
    """block_reads alone: partial_outs, lse and the gradients of the
    sources, queries and gains for random dy (unless given) and dlse
    (times dlse_scale)."""
    S, n = queries.shape[0], len(sources)
    if dy is None:
        dy = [torch.randn(sources[0].shape, generator=gen, dtype=torch.float64).to(dtype)
              for _ in range(S)]
    dlse = torch.randn(S, *sources[0].shape[:-1], generator=gen, dtype=torch.float64) * dlse_scale
    *srcs, q, g = leaves_of(*sources, queries, gains)
    wrt = [*srcs, q] + ([] if g is None else [g])
    partial_outs, lse = attnres.block_reads(srcs, q, g, eps=eps, scale=scale)
    grads = torch.autograd.grad([*partial_outs, lse], wrt, [*dy, dlse.to(lse.dtype)])

    ref = [x.detach().double().requires_grad_(True) for x in wrt]
    ref_g = ref[n + 1] if g is not None else None
    ref_out, ref_lse = [], []
    for r in range(S):
        h, _, scores, _ = depth_attention_ref(ref[:n], ref[n][r], None if ref_g is None else ref_g[r],
                                              eps=eps, scale=scale, return_parts=True)
        ref_out.append(h)
        ref_lse.append(torch.logsumexp(scores, 0))
    ref_grads = torch.autograd.grad([*ref_out, *ref_lse], ref,
                                    [*(x.double() for x in dy), *dlse])
    for r in range(S):
        assert torch.isfinite(partial_outs[r]).all(), f"{what} partial_outs[{r}] not finite"
        err = rel_err(partial_outs[r], ref_out[r])
        assert err <= REL_TOL[dtype], f"{what} partial_outs[{r}]: {err:.3g}"
    err = rel_err(lse, torch.stack(ref_lse))
    assert err <= STAT_REL_TOL[dtype], f"{what} lse: {err:.3g}"
    names = [f"sources[{i}]" for i in range(n)] + ["queries", "norm_weights"]
    for name, a, b in zip(names, grads, ref_grads):
        if name in ("queries", "norm_weights") and parameter_grad_near_its_maximum(b, a):
            continue
        assert_grad_close(a, b, dtype, f"{what} grad {name}")


def check_merge_near_the_limits(partial_out, lse, block_sum, query, gain, dtype, *, eps, scale,
                                gen, what):
    """block_read_merge alone: h and the gradients of partial_out, lse,
    block_sum, query and gain, against h = (1 - a) y + a P with
    a = sigmoid(s_P - lse) in float64 (s_P from the reference)."""
    dh = torch.randn(block_sum.shape, generator=gen, dtype=torch.float64).to(dtype)
    y, l, P, q, g = leaves_of(partial_out, lse, block_sum, query, gain)
    wrt = [y, l, P, q] + ([] if g is None else [g])
    h = attnres.block_read_merge(y, l, P, q, g, eps=eps, scale=scale)
    grads = torch.autograd.grad(h, wrt, dh)

    ref = [x.detach().double().requires_grad_(True) for x in wrt]
    ry, rl, rP, rq = ref[:4]
    _, _, s_P, _ = depth_attention_ref([rP], rq, ref[4] if g is not None else None, eps=eps,
                                       scale=scale, return_parts=True)
    a = torch.sigmoid(s_P[0] - rl).unsqueeze(-1)
    ref_h = (1 - a) * ry + a * rP
    ref_grads = torch.autograd.grad(ref_h, ref, dh.double())
    assert torch.isfinite(h).all(), f"{what} h not finite"
    err = rel_err(h, ref_h)
    assert err <= REL_TOL[dtype], f"{what} h: {err:.3g}"
    # The float64 evaluation of the reference's own backward overflows for
    # float64 rows near 1e308 (NaN there): such entries are not representable
    # and are left out by assert_grad_close.
    for name, a_, b in zip(["partial_out", "lse", "block_sum", "query", "norm_weight"], grads,
                           ref_grads):
        if name in ("query", "norm_weight") and parameter_grad_near_its_maximum(b, a_):
            continue
        assert_grad_close(a_, b, dtype, f"{what} grad {name}")


def lse_gradient(h_ref, y_ref, a_P, block_sum, dh):
    """The true gradient that block_read_merge sends to lse,
    -a_P (1 - a_P) <dh, P - y>, in float64 without overflow on the way
    (inf where it exceeds float64)."""
    half = block_sum.double() / 2 - y_ref / 2
    m = half.abs().amax(-1).clamp_min(1e-300)
    dot = (dh.double() * (half / m.unsqueeze(-1))).sum(-1)
    return -(a_P * (1 - a_P)) * dot * m * 2


def check_reads_near_the_limits(sources, block_sum, queries, gains, dtype, *, eps, scale, seed,
                                what):
    """A block's S reads chained as DepthStream runs them (reader 0 from
    phase 1 alone, the others merged with block_sum): h and the gradients of
    the sources, block_sum, queries and gains for random dh of every reader,
    against one float64 read per reader. Each read's own gradient term must
    be representable (autograd sums them in the dtype, as for one-call
    reads). The gradient the merge sends to lse, -a_P (1 - a_P) <dh, P - y>,
    is a float64 tensor for every dtype (docs/design.md §10, "Range"): where
    its true value is beyond float32's maximum (fp32/bf16 rows near that
    maximum, D >= 33) the phase-1 gradients must still be finite and right
    (before lse was float64 they were not finite); where it is beyond
    float64's (fp64 rows near that maximum) they are not finite (checked),
    never finite and wrong. Returns how many (reader, token) pairs have an
    lse gradient beyond float32's maximum."""
    S, n = queries.shape[0], len(sources)
    gen = torch.Generator().manual_seed(seed)
    dh = [torch.randn(block_sum.shape, generator=gen, dtype=torch.float64).to(dtype)
          for _ in range(S)]
    *srcs, P, q, g = leaves_of(*sources, block_sum, queries, gains)
    wrt = [*srcs, P, q] + ([] if g is None else [g])
    partial_outs, lse = attnres.block_reads(srcs, q, g, eps=eps, scale=scale)
    hs = [partial_outs[0]] + [
        attnres.block_read_merge(partial_outs[r], lse[r], P, q[r], None if g is None else g[r],
                                 eps=eps, scale=scale)
        for r in range(1, S)]
    grads = torch.autograd.grad(hs, wrt, dh)

    ref = [x.detach().double().requires_grad_(True) for x in wrt]
    ref_g = ref[n + 2] if g is not None else None
    ref_hs, terms = [], []
    lse_max = torch.finfo(torch.float64).max  # the lse gradient's dtype
    beyond = torch.zeros(S, *block_sum.shape[:-1], dtype=torch.bool)
    beyond_float32 = 0
    for r in range(S):
        gain_r = None if ref_g is None else ref_g[r]
        h, w = depth_attention_ref(ref[:n] + ([ref[n]] if r > 0 else []), ref[n + 1][r], gain_r,
                                   eps=eps, scale=scale)
        ref_hs.append(h)
        term = torch.autograd.grad(h, ref, dh[r].double(), retain_graph=True, allow_unused=True)
        terms.append([torch.zeros_like(x) if t is None else t for x, t in zip(ref, term)])
        if r > 0:
            with torch.no_grad():
                y_ref, _ = depth_attention_ref(ref[:n], ref[n + 1][r], gain_r, eps=eps, scale=scale)
                dlse = lse_gradient(h, y_ref, w[-1], block_sum, dh[r])
            beyond[r] = ~(dlse.abs() <= lse_max)
            beyond_float32 += int((dlse.abs() > torch.finfo(torch.float32).max).sum())
    ref_grads = [sum(t[k] for t in terms) for k in range(len(ref))]
    for r in range(S):
        assert torch.isfinite(hs[r]).all(), f"{what} h[{r}] not finite"
        err = rel_err(hs[r], ref_hs[r])
        assert err <= REL_TOL[dtype], f"{what} h[{r}]: {err:.3g}"
    tokens_beyond = beyond.any(0)
    for i in range(n):
        a, b = grads[i], ref_grads[i]
        assert not torch.isfinite(a[tokens_beyond]).all(dim=-1).any(), (
            f"{what} grad sources[{i}] finite where the lse gradient is beyond the maximum")
        assert_grad_close(a[~tokens_beyond], b[~tokens_beyond], dtype, f"{what} grad sources[{i}]",
                          [t[i][~tokens_beyond] for t in terms])
    assert_grad_close(grads[n], ref_grads[n], dtype, f"{what} grad block_sum", [t[n] for t in terms])
    for k, name in ((n + 1, "queries"), (n + 2, "norm_weights")):
        if k >= len(ref):
            continue
        for r in range(S):
            if beyond[r].any() or parameter_grad_near_its_maximum(ref_grads[k][r], grads[k]):
                continue
            assert_grad_close(grads[k][r], ref_grads[k][r], dtype, f"{what} grad {name}[{r}]",
                              [t[k][r] for t in terms])
    return beyond_float32


RANGE_SHAPES = ((2, 2, (3,), 4), (4, 3, (2, 3), 33), (3, 4, (4,), 256))  # N, S, lead, D


def range_problems(dtype, with_gain, seed):
    """(magnitude, sources, block_sum, queries, gains) over RANGE_MAGNITUDES
    and RANGE_SHAPES."""
    gen = torch.Generator().manual_seed(seed)
    pd = param_dtype(dtype)
    for mag in RANGE_MAGNITUDES[dtype]:
        for n, s, lead, d in RANGE_SHAPES:
            *sources, block_sum = extreme_sources(n + 1, lead, d, dtype, mag, "cpu", gen)
            queries = (torch.randn(s, d, generator=gen, dtype=torch.float64) * 2 / d ** 0.5).to(pd)
            gains = ((1 + 0.3 * torch.rand(s, d, generator=gen, dtype=torch.float64)).to(pd)
                     if with_gain else None)
            yield mag, sources, block_sum, queries, gains


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_gain", [True, False])
def test_block_reads_gradients_near_the_dtype_limits(dtype, with_gain):
    """Phase 1 alone, rows anywhere in the dtype's range (RANGE_MAGNITUDES,
    the one-call op's range test's), eps 1e-6 and 0: the rows whose backward
    sums or coefficients leave the accumulation dtype's range are recomputed
    in a wider type (docs/design.md §8, §10)."""
    gen = torch.Generator().manual_seed(16)
    for mag, sources, _, queries, gains in range_problems(dtype, with_gain, seed=12):
        for eps in (1e-6, 0.0):
            check_phase_one_near_the_limits(
                sources, queries, gains, dtype, eps=eps, scale=0.9, gen=gen,
                what=f"{dtype} mag={mag:g} N={len(sources)} S={len(queries)} "
                     f"D={queries.shape[1]} eps={eps}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_gain", [True, False])
def test_block_read_merge_gradients_near_the_dtype_limits(dtype, with_gain):
    """Phase 2 alone: a partial output and a block sum anywhere in the
    dtype's range (the partial output from phase 1 over the same rows)."""
    gen = torch.Generator().manual_seed(17)
    for mag, sources, block_sum, queries, gains in range_problems(dtype, with_gain, seed=18):
        for eps in (1e-6, 0.0):
            partial_outs, lse = attnres.block_reads(sources, queries, gains, eps=eps, scale=0.9)
            check_merge_near_the_limits(
                partial_outs[1], lse[1], block_sum, queries[1], None if gains is None else gains[1],
                dtype, eps=eps, scale=0.9, gen=gen,
                what=f"{dtype} mag={mag:g} D={queries.shape[1]} eps={eps}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_gain", [True, False])
def test_chained_reads_near_the_dtype_limits_match_float64(dtype, with_gain):
    """A block of reads, phase 1 then the merges, against one float64 read
    per reader, rows anywhere in the dtype's range. For fp32/bf16 some
    tokens' lse gradient must be beyond float32's maximum (the case float64
    lse exists for; checked, so the test cannot lose it silently)."""
    beyond_float32 = 0
    for mag, sources, block_sum, queries, gains in range_problems(dtype, with_gain, seed=12):
        for eps in (1e-6, 0.0):
            beyond_float32 += check_reads_near_the_limits(
                sources, block_sum, queries, gains, dtype, eps=eps, scale=0.9, seed=13,
                what=f"{dtype} mag={mag:g} N={len(sources)} S={len(queries)} "
                     f"D={queries.shape[1]} eps={eps}")
    if dtype in (torch.float32, torch.bfloat16):
        assert beyond_float32 > 0, "no lse gradient beyond float32: the case is not covered"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_magnitudes_and_saturated_weights_near_the_limits(dtype):
    """Huge, normal and tiny rows in one token, among the completed sources
    and as the block sum (the rescued and the plain path side by side); with
    the larger queries the weights saturate on one row. Each op on its own
    for both dtypes; the chain for float32 only: in bfloat16 the merge's
    <dh, P - y> takes y rounded to 8 bits, which next to a block sum 1e68
    times smaller puts the block sum's gradient at 3% (one-call: 0.2%;
    docs/design.md §10), a precision limit of bf16 partial outputs, not a
    range one."""
    gen = torch.Generator().manual_seed(14)
    d = 64
    for mags in ((1e38, 1.0, 1e-30), (3e19, 1e-20, 1e30, 1.0), (1.0, 1e-30, 1e38),
                 (1e-30, 1e-30, 1e-30)):
        *sources, block_sum = [
            ((torch.rand(5, d, generator=gen, dtype=torch.float64) * 2 - 1) * m).to(dtype)
            for m in mags]
        for qscale in (0.0, 0.3, 3.0):
            queries = (torch.randn(3, d, generator=gen, dtype=torch.float64) * qscale / d ** 0.5).float()
            for eps in (1e-6, 0.0):
                what = f"{mags} q*{qscale} eps={eps}"
                check_phase_one_near_the_limits(sources, queries, None, dtype, eps=eps,
                                                scale=1.0, gen=gen, what=what)
                partial_outs, lse = attnres.block_reads(sources, queries, None, eps=eps)
                for r in (1, 2):
                    check_merge_near_the_limits(partial_outs[r], lse[r], block_sum, queries[r],
                                                None, dtype, eps=eps, scale=1.0, gen=gen,
                                                what=f"{what} reader {r}")
                if dtype == torch.float32:
                    check_reads_near_the_limits(sources, block_sum, queries, None, dtype,
                                                eps=eps, scale=1.0, seed=15, what=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_readers_betas_that_overflow_only_when_summed(dtype):
    """Phase 1's backward adds the S readers' beta coefficients of a source
    row before it scales the row (dv = sum_s (a_s dy_s + alpha_s u_s) +
    (sum_s beta_s) v). Each beta = -alpha r s / D is formed through alpha r s, so a
    beta in range is at most the maximum / D, and a sum of S of them can
    overflow only when S > D: here D = 2, S = 3, each beta of the tiny row
    v0 is about -1.65e38 and their sum -4.95e38 is not a float32; the
    token must take the wide path (design §10, "Range"), its true gradient
    is ~1e27. Constructed: rows c * 1 (rstd 1/c, eps 0) and (1/2, -1/2)
    (<dy, v1> = 0 for a constant dy), nearly equal scores ~1 (weights ~1/2),
    dy = K: alpha r s = a0 a1 (2 c K) r^2 s = K / (2 c)."""
    c, K = 1e-12, 6.6e26
    v0 = torch.full((3, 2), c, dtype=torch.float64).to(dtype)
    v1 = torch.tensor([[0.5, -0.5]] * 3, dtype=torch.float64).to(dtype)
    queries = torch.tensor([[1.0, 0.0], [1.0, 1e-3], [1.0, -1e-3]])  # three different readers
    dy = [torch.full((3, 2), K, dtype=torch.float64).to(dtype) for _ in range(3)]
    check_phase_one_near_the_limits([v0, v1], queries, None, dtype, eps=0.0, scale=1.0,
                                    gen=torch.Generator().manual_seed(16),
                                    what="summed betas", dy=dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phase_one_takes_an_lse_gradient_beyond_float32(dtype):
    """lse is float64 for every dtype, so its gradient can exceed float32's
    range (in a chain of reads the merge sends -a_P (1 - a_P) <dh, P - y>,
    which does near float32's maximum: test_chained_reads_near_the_dtype_
    limits_match_float64). Phase 1 alone with dlse ~1e40 on rows of ~1e36:
    the token's sum over the weights overflows float32 and it must take the
    wide path, where alpha = ds r ~ 1e4 and every source gradient is finite
    and right (the queries' gradient, ~1e40, is not representable and not
    checked)."""
    gen = torch.Generator().manual_seed(17)
    sources = [((torch.rand(5, 64, generator=gen, dtype=torch.float64) * 2 - 1) * 1e36).to(dtype)
               for _ in range(3)]
    queries = torch.randn(3, 64, generator=gen) / 8
    check_phase_one_near_the_limits(sources, queries, None, dtype, eps=1e-6, scale=1.0, gen=gen,
                                    what="dlse 1e40", dlse_scale=1e40)


def test_inplace_merge_equals_the_merge_and_refuses_gradients():
    sources, block_sum, queries, gains = problem(3, 2, (3, 5), 19, torch.float32, seed=11)
    partial_outs, lse = attnres.block_reads(sources, queries, gains)
    want = attnres.block_read_merge(partial_outs[1], lse[1], block_sum, queries[1], gains[1])
    y = partial_outs[1].clone()
    got = attnres.ops.block_read_merge_inplace(y, lse[1], block_sum, queries[1], gains[1])
    assert got is y and torch.equal(got, want)
    opcheck(torch.ops.attnres.block_read_merge_inplace.default,
            (partial_outs[1].clone(), lse[1], block_sum, queries[1], gains[1], 1e-6, 1.0))
    q = queries[1].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="attnres::block_read_merge_inplace has no derivative"):
        attnres.ops.block_read_merge_inplace(partial_outs[1].clone(), lse[1], block_sum, q)
    with pytest.raises(ValueError, match=re.escape(
            "partial_out must be contiguous for block_read_merge_inplace (the read is written "
            "into it)")):
        attnres.ops.block_read_merge_inplace(torch.stack(partial_outs, -1)[..., 0], lse[0],
                                             block_sum, queries[0])


def test_inference_reads_merge_in_place_and_a_second_read_is_one_call(monkeypatch):
    D, L, S = 16, 5, 3
    readers, weights = make_stack(L, D, torch.float64)
    emb = torch.randn(4, D, dtype=torch.float64)
    with torch.no_grad():
        want = run_stack(readers, weights, emb, S, "one_call")
        stream = attnres.DepthStream(emb, block_size=S, block_reads="two_phase", readers=readers)
        stream.append(torch.tanh(readers[0](stream) @ weights[0]))
        h1 = readers[1](stream)
        again = readers[1](stream)  # the partial output was consumed: one-call
        ref = attnres.depth_attention(stream.sources, readers[1].query, readers[1].norm_weight)
        got = run_stack(readers, weights, emb, S, "two_phase")
    assert torch.allclose(h1, ref, rtol=1e-12, atol=1e-14)
    assert torch.allclose(again, ref, rtol=1e-12, atol=1e-14)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)


def test_compiled_inference_of_a_block_gpt(monkeypatch):
    torch._dynamo.reset()
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = gpt("one_call").eval()(idx)[0]
        model = gpt("two_phase").eval()
        counts = CountingOps(monkeypatch)
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(idx)[0]
    assert counts.merge > 0
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("out_weight", [False, True], ids=["plain", "normed"])
def test_inplace_merge_refuses_a_block_sum_that_overlaps_the_partial_output(out_weight):
    """h is written over partial_out while block_sum is read: the same
    tensor, or a view sharing some of its memory, is refused."""
    D, T = 8, 4
    buf = torch.randn((T + 1) * D)
    partial, lse = buf[:T * D].view(T, D), torch.zeros(T, dtype=torch.float64)
    query = torch.randn(D)
    w = torch.ones(D) if out_weight else None
    with torch.no_grad():
        with pytest.raises(ValueError, match="partial_out and block_sum must be different tensors"):
            block_read_merge_inplace(partial, lse, partial, query, out_weight=w)
        with pytest.raises(RuntimeError, match=re.escape(
                "block_sum shares memory with partial_out (some of their elements refer to a "
                "single memory location)")):
            block_read_merge_inplace(partial, lse, buf[D:].view(T, D), query, out_weight=w)
        block_read_merge_inplace(partial, lse, torch.randn(T, D), query, out_weight=w)  # disjoint: fine


@pytest.mark.parametrize("device", ["cpu", "meta"])  # the C++ checks and the fake kernel
@pytest.mark.parametrize("name", ["lse", "query", "norm_weight", "out_weight"])
def test_inplace_merge_refuses_any_input_that_overlaps_the_partial_output(name, device):
    """Every input is read while h (or y) is written over partial_out: lse,
    the query and both gains too are refused when they share memory with
    it, and (query, gains, which can have its shape) when they are it."""
    D, T = 8, 4
    dtype = torch.float64  # so that lse can be a view of partial_out's storage
    buf = torch.randn(T * D + D, dtype=dtype).to(device)
    partial = buf[:T * D].view(T, D)
    inputs = dict(lse=torch.zeros(T, dtype=dtype, device=device),
                  query=torch.randn(D, dtype=dtype).to(device),
                  norm_weight=torch.ones(D, dtype=dtype, device=device),
                  out_weight=torch.ones(D, dtype=dtype, device=device))
    block_sum = torch.randn(T, D, dtype=dtype).to(device)

    def merge(target, **kw):
        args = {**inputs, **kw}
        torch.ops.attnres.block_read_merge_inplace(
            target, args["lse"], block_sum, args["query"], args["norm_weight"], 1e-6, 1.0,
            args["out_weight"], None)

    # One element in common: the last of partial_out.
    overlap = buf[T * D - 1:T * D - 1 + (T if name == "lse" else D)]
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=re.escape(
                f"{name} shares memory with partial_out (some of their elements refer to a "
                f"single memory location), which block_read_merge_inplace overwrites while it "
                f"reads {name}")):
            merge(partial, **{name: overlap})
        if name != "lse":  # a 1-token partial_out [D] can be the [D] parameter itself
            row = buf[:D]
            with pytest.raises(ValueError, match=f"partial_out and {name} must be different tensors"):
                torch.ops.attnres.block_read_merge_inplace(
                    row, torch.zeros((), dtype=dtype, device=device), block_sum[0],
                    *[row if n == name else inputs[n] for n in ("query", "norm_weight")],
                    1e-6, 1.0, row if name == "out_weight" else inputs["out_weight"], None)
        merge(partial, **{name: buf[T * D:T * D + (T if name == "lse" else D)]})  # disjoint: fine
