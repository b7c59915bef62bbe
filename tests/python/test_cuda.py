"""CUDA kernels of attnres: agreement with the float64 reference and the CPU
kernels, gradcheck, opcheck, torch.compile, CUDA graphs, determinism, 64-bit
indexing, strided sources, NaN isolation and the few-token kernels. Skips where
no GPU is visible."""
import os
import subprocess
import sys

import pytest
import torch

import attnres
from attnres import reference
from attnres.ops import block_read_merge_inplace
from helpers import (
    backward_op,
    CUDA_SKIP_REASON,
    GRAD_REL_TOL,
    REL_TOL,
    STAT_REL_TOL,
    assert_rel_close,
    forward_backward,
    param_dtype,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def make_problem(N, lead, D, dtype, device="cuda", *, gain=True, seed=0):
    """Sources of different scales, a query giving O(1) scores, a gain near 1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pd = param_dtype(dtype)
    sources = [
        (torch.randn(*lead, D, generator=g, dtype=torch.float64) * (1 + i % 3)).to(dtype).to(device)
        for i in range(N)
    ]
    query = (torch.randn(D, generator=g, dtype=torch.float64) / D**0.5).to(pd).to(device)
    norm_weight = None
    if gain:
        norm_weight = (1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)).to(pd).to(device)
    grad_out = torch.randn(*lead, D, generator=g, dtype=torch.float64).to(dtype).to(device)
    return sources, query, norm_weight, grad_out


def reference_fwd_bwd(sources, query, norm_weight, grad_out, *, eps, scale):
    """The eager reference in float64 on the same (rounded) inputs."""
    return forward_backward(
        reference.depth_attention, sources, query, norm_weight, grad_out, eps=eps, scale=scale, to=torch.float64
    )


def ours_fwd_bwd(sources, query, norm_weight, grad_out, *, eps, scale):
    return forward_backward(attnres.depth_attention, sources, query, norm_weight, grad_out, eps=eps, scale=scale)


def assert_close_rel(out, ref, dtype, what):
    """The output column of the tolerance table (also used for gradients
    here: the CUDA kernels meet it)."""
    assert_rel_close(out, ref, REL_TOL[dtype], what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [1, 3, 64, 1000, 7186, 16384])
@pytest.mark.parametrize("N", [1, 2, 3, 7, 17, 33, 65])
def test_matches_reference(N, D, dtype):
    lead = (2, 3) if D <= 1000 else (3,)
    sources, query, norm_weight, grad_out = make_problem(N, lead, D, dtype, seed=N * 7919 + D)
    eps, scale = 1e-6, 0.8
    h, w, gs, gq, gw = ours_fwd_bwd(sources, query, norm_weight, grad_out, eps=eps, scale=scale)
    rh, rw, rgs, rgq, rgw = reference_fwd_bwd(sources, query, norm_weight, grad_out, eps=eps, scale=scale)
    assert h.dtype == dtype and h.shape == sources[0].shape and h.is_contiguous()
    assert w.shape == (N, *lead)
    assert_close_rel(h, rh, dtype, "h")
    # weights: computed in float32 (float64 for float64 sources) from the same inputs
    assert_rel_close(w, rw, STAT_REL_TOL[dtype], "weights")
    for i, (g, rg) in enumerate(zip(gs, rgs)):
        assert g.dtype == dtype
        assert_close_rel(g, rg, dtype, f"grad of sources[{i}]")
    assert_close_rel(gq, rgq, dtype, "grad_query")
    assert_close_rel(gw, rgw, dtype, "grad_norm_weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,lead,D", [(1, (4,), 8), (5, (2, 3), 3), (9, (33,), 1000), (70, (5,), 256), (130, (3,), 64)])
def test_cpu_and_cuda_agree(N, lead, D, dtype):
    sources, query, norm_weight, grad_out = make_problem(N, lead, D, dtype, device="cpu", seed=N + D)
    eps, scale = 1e-5, 1.3
    fwd_cpu = torch.ops.attnres.depth_attention_fwd(sources, query, norm_weight, eps, scale)
    cuda_args = lambda xs: [x.cuda() for x in xs]  # noqa: E731
    fwd_gpu = torch.ops.attnres.depth_attention_fwd(
        cuda_args(sources), query.cuda(), norm_weight.cuda(), eps, scale
    )
    for name, a, b, tol in zip(
        ("out", "rstd", "weights"), fwd_cpu, fwd_gpu, (REL_TOL[dtype], STAT_REL_TOL[dtype], STAT_REL_TOL[dtype])
    ):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_rel_close(b, a, tol, name)
    # Without out_weight the output norm's statistics are empty on both.
    for name, a, b in zip(("h", "out_rstd"), fwd_cpu[3:], fwd_gpu[3:]):
        assert a.shape == b.shape == (0,) and a.dtype == b.dtype and b.is_cuda, name
    bwd_cpu = backward_op(
        grad_out, sources, query, norm_weight, *fwd_cpu[:3], scale
    )
    bwd_gpu = backward_op(
        grad_out.cuda(), cuda_args(sources), query.cuda(), norm_weight.cuda(),
        *fwd_gpu[:3], scale,
    )
    for i, (a, b) in enumerate(zip(bwd_cpu[0], bwd_gpu[0])):
        assert_close_rel(b, a, dtype, f"grad of sources[{i}]")
    assert_close_rel(bwd_gpu[1], bwd_cpu[1], dtype, "grad_query")
    assert_close_rel(bwd_gpu[2], bwd_cpu[2], dtype, "grad_norm_weight")


@pytest.mark.parametrize("gain", [True, False], ids=["gain", "no_gain"])
@pytest.mark.parametrize("D", [5, 8])  # scalar path and 16-byte path
def test_gradcheck_float64(gain, D):
    sources, query, norm_weight, _ = make_problem(3, (2, 2), D, torch.float64, gain=gain, seed=D)
    inputs = [s.requires_grad_(True) for s in sources] + [query.requires_grad_(True)]
    if gain:
        inputs.append(norm_weight.requires_grad_(True))

    def fn(*xs):
        w = xs[4] if gain else None
        return attnres.depth_attention(list(xs[:3]), xs[3], w, eps=1e-6, scale=0.7)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gain", [True, False], ids=["gain", "no_gain"])
def test_opcheck(dtype, gain):
    sources, query, norm_weight, grad_out = make_problem(3, (2, 5), 64, dtype, gain=gain)
    # The forward with leaves that require grad (autograd registration is
    # checked); the backward op itself is called on plain tensors.
    srcs = [s.detach().clone().requires_grad_(True) for s in sources]
    q = query.detach().clone().requires_grad_(True)
    w = norm_weight.detach().clone().requires_grad_(True) if gain else None
    torch.library.opcheck(torch.ops.attnres.depth_attention_fwd.default, (srcs, q, w, 1e-6, 0.9))
    h, rstd, weights, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 0.9)
    torch.library.opcheck(
        torch.ops.attnres.depth_attention_bwd.default,
        (grad_out, None, sources, query, norm_weight, h, rstd, weights, 0.9, [True] * (len(sources) + 2)),
    )


def test_torch_compile_fullgraph_forward_backward():
    sources, query, norm_weight, grad_out = make_problem(4, (3, 7), 96, torch.float32)

    def fn(a, b, c, d, q, w):
        return attnres.depth_attention([a, b, c, d], q, w, eps=1e-6, scale=1.1)

    compiled = torch.compile(fn, fullgraph=True)

    def run(f):
        xs = [s.detach().clone().requires_grad_(True) for s in sources]
        q = query.detach().clone().requires_grad_(True)
        w = norm_weight.detach().clone().requires_grad_(True)
        h = f(*xs, q, w)
        h.backward(grad_out)
        return [h] + [x.grad for x in xs] + [q.grad, w.grad]

    for got, want in zip(run(compiled), run(fn)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_cuda_graph_capture_and_replay():
    # 70 sources: more than the kernel-parameter table holds, so the
    # device-side table fill is captured too.
    N, lead, D, dtype, eps, scale = 70, (16,), 1000, torch.bfloat16, 1e-6, 0.9
    static_src, static_q, static_w, static_dh = make_problem(N, lead, D, dtype, seed=1)

    def step():
        out, rstd, weights, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
            static_src, static_q, static_w, eps, scale)
        grads, gq, gw = backward_op(
            static_dh, static_src, static_q, static_w, out, rstd, weights, scale
        )[:3]
        return [out, rstd, weights, *grads, gq, gw]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for seed in (2, 3):
        src, q, w, dh = make_problem(N, lead, D, dtype, seed=seed)
        for dst, new in zip(static_src + [static_q, static_w, static_dh], src + [q, w, dh]):
            dst.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for i, (a, b) in enumerate(zip(static_out, eager)):
            assert torch.equal(a, b), f"replayed output {i} differs from an eager run"


@pytest.mark.parametrize("block_reads", ["auto", "two_phase"])
def test_cuda_graph_replays_a_block_decode_step(block_reads):
    """A K3-style Block GPT's decode step (one token, a static KV cache,
    block_storage, the RMSNorm pre-norms fused into the reads) captured once
    in a CUDA graph and replayed token by token gives the logits of eager
    decoding and of one forward over the whole sequence."""
    from attnres.models import GPT, GPTConfig, KVCache

    cfg = GPTConfig(vocab_size=128, seq_len=24, d_model=128, n_layers=6, n_heads=4,
                    residual="block", block_layers=2, norm="rmsnorm", block_reads=block_reads)
    torch.manual_seed(0)
    model = GPT(cfg).cuda().eval()
    with torch.no_grad():
        for r in model.readers():
            r.query.normal_(0, 0.5)
    prompt, total = 4, 20
    idx = torch.randint(0, cfg.vocab_size, (1, total), device="cuda")
    with torch.no_grad():
        full = model(idx)[0][:, prompt:]
        eager_cache = KVCache(cfg, 1, device="cuda")
        model(idx[:, :prompt], kv_cache=eager_cache)
        eager = torch.cat([model(idx[:, t:t + 1], kv_cache=eager_cache)[0]
                           for t in range(prompt, total)], 1)
        cache = KVCache(cfg, 1, device="cuda")
        model(idx[:, :prompt], kv_cache=cache)
        storage = torch.full((cfg.num_blocks, 1, 1, cfg.d_model), float("nan"), device="cuda")
        token = idx[:, prompt:prompt + 1].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(token, kv_cache=cache, block_storage=storage)
                cache.pos.sub_(1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(token, kv_cache=cache, block_storage=storage)[0]
        replayed = []
        for t in range(prompt, total):
            token.copy_(idx[:, t:t + 1])
            graph.replay()
            replayed.append(logits.clone())
    torch.cuda.synchronize()
    assert int(cache.pos) == total
    replayed = torch.cat(replayed, 1)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(replayed, full, rtol=1e-4, atol=1e-4)
    assert not storage.isnan().any()  # the replayed step builds its blocks in the storage


def test_more_than_2_31_elements():
    # Two sources of [2^21 + 3, 1024] bf16: each holds more than 2^31 elements,
    # so row offsets need 64 bits. Tokens are independent: check the first
    # and last rows against the reference on those rows only.
    T, D, N = 2**21 + 3, 1024, 2
    elems = T * D
    assert elems > 2**31
    bytes_needed = elems * 2 * (N + 1 + 1 + N) + (1 << 30)  # sources, dh, out, grads, slack
    free, _total = torch.cuda.mem_get_info()
    if free < bytes_needed:
        pytest.skip(f"needs {bytes_needed / 2**30:.1f} GiB of free device memory, {free / 2**30:.1f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    sources = [torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(N)]
    query = torch.randn(D, device="cuda", generator=gen) / D**0.5
    norm_weight = 1 + 0.1 * torch.randn(D, device="cuda", generator=gen)
    grad_out = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, rstd, weights, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0)
    grads = backward_op(grad_out, sources, query, norm_weight, out, rstd, weights, 1.0)[0]
    for rows in (slice(0, 4), slice(T - 4, T)):
        sub = [s[rows] for s in sources]
        rh, _, rgs, _, _ = reference_fwd_bwd(sub, query, norm_weight, grad_out[rows], eps=1e-6, scale=1.0)
        assert_close_rel(out[rows], rh, torch.bfloat16, f"h rows {rows}")
        for i in range(N):
            assert_close_rel(grads[i][rows], rgs[i], torch.bfloat16, f"grad of sources[{i}] rows {rows}")


@pytest.mark.parametrize("N,lead,D,dtype", [
    (9, (4096,), 1000, torch.bfloat16),   # warp per token, 16-byte path
    (3, (2048,), 64, torch.float32),      # several tokens per warp
    (65, (512,), 7186, torch.bfloat16),   # block per token, scalar path, no staging
    (5, (1000,), 4096, torch.float16),    # block per token, 16-byte path
    (4, (16384,), 1024, torch.float32),   # single pass, a grid of several waves
])
def test_backward_is_bitwise_deterministic(N, lead, D, dtype):
    sources, query, norm_weight, grad_out = make_problem(N, lead, D, dtype)
    h, rstd, weights, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0)
    runs = [
        backward_op(grad_out, sources, query, norm_weight, h, rstd, weights, 1.0)[:3]
        for _ in range(2)
    ]
    (g1, q1, w1), (g2, q2, w2) = runs
    assert torch.equal(q1, q2) and torch.equal(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_reads_h_only_in_single_pass(dtype):
    """float32/float64 take sum_j a_j dp_j from the forward's h (single pass),
    bfloat16/float16 from the saved weights (two passes): a changed h changes
    only the former's gradients. A misaligned h (16-byte loads impossible:
    the scalar path) gives the same gradients within the tolerance."""
    sources, query, norm_weight, grad_out = make_problem(5, (33,), 64, dtype)
    h, rstd, weights, _h, _out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0)
    base = backward_op(grad_out, sources, query, norm_weight, h, rstd, weights, 1.0)
    bumped = backward_op(grad_out, sources, query, norm_weight, h * 2 + 1, rstd, weights, 1.0)
    single_pass = dtype in (torch.float32, torch.float64)
    assert (not torch.equal(base[0][0], bumped[0][0])) == single_pass
    assert (not torch.equal(base[1], bumped[1])) == single_pass
    buf = torch.empty(h.numel() + 1, dtype=dtype, device=h.device)
    misaligned = buf[1:].view_as(h)
    misaligned.copy_(h)
    got = backward_op(grad_out, sources, query, norm_weight, misaligned, rstd, weights, 1.0)
    for a, b in zip(got[0], base[0]):
        assert_rel_close(a, b, REL_TOL[dtype], "source gradient with a misaligned h")
    assert_rel_close(got[1], base[1], REL_TOL[dtype], "query gradient with a misaligned h")


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_sources(dtype, aligned):
    lead, D = (2, 12), 256
    gen = torch.Generator(device="cpu").manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).cuda()

    if aligned:
        # Row strides that keep 16-byte alignment: read in place, packed loads.
        sources = [rand(2, 12, 2 * D)[..., D:], rand(2, 12, 4 * D)[..., :D], rand(2, 12, D)]
    else:
        # Rows 3D+1 apart (used in place, scalar loads), a misaligned start,
        # and layouts whose leading dims don't collapse (copied once).
        wide = rand(2, 12, 3 * D + 1)
        sources = [
            wide[..., :D],
            wide[..., D + 1 : 2 * D + 1],
            rand(D, 2, 12).permute(1, 2, 0),
            rand(4, 12, D)[::2],
        ]
    query = (torch.randn(D, generator=gen) / D**0.5).cuda()
    norm_weight = (1 + 0.2 * torch.randn(D, generator=gen)).cuda()
    grad_out = rand(*lead, D)
    h, w, gs, gq, gw = ours_fwd_bwd(sources, query, norm_weight, grad_out, eps=1e-6, scale=1.0)
    rh, rw, rgs, rgq, rgw = reference_fwd_bwd(sources, query, norm_weight, grad_out, eps=1e-6, scale=1.0)
    assert_close_rel(h, rh, dtype, "h")
    for i, (g, rg) in enumerate(zip(gs, rgs)):
        assert g.is_contiguous()
        assert_close_rel(g, rg, dtype, f"grad of sources[{i}]")
    assert_close_rel(gq, rgq, dtype, "grad_query")
    assert_close_rel(gw, rgw, dtype, "grad_norm_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nan_poisons_only_its_token(dtype):
    sources, query, norm_weight, grad_out = make_problem(4, (8,), 1000, dtype)
    bad = 5
    sources[2][bad, 17] = float("nan")
    h, w, gs, _, _ = ours_fwd_bwd(sources, query, norm_weight, grad_out, eps=1e-6, scale=1.0)
    good = [t for t in range(8) if t != bad]
    assert torch.isnan(h[bad]).all()
    assert torch.isfinite(h[good]).all() and torch.isfinite(w[:, good]).all()
    assert all(torch.isfinite(g[good]).all() for g in gs)
    rh = reference.depth_attention([s[good] for s in sources], query, norm_weight)
    assert_close_rel(h[good], rh, dtype, "h of the clean tokens")


def test_width_above_limit_is_rejected():
    sources = [torch.randn(2, 16385, device="cuda") for _ in range(2)]
    query = torch.zeros(16385, device="cuda")
    with pytest.raises(ValueError, match="D <= 16384"):
        torch.ops.attnres.depth_attention_fwd(sources, query, None, 1e-6, 1.0)


def test_empty_token_dimension():
    sources = [torch.randn(0, 3, 32, device="cuda") for _ in range(3)]
    query = torch.randn(32, device="cuda", requires_grad=True)
    xs = [s.requires_grad_(True) for s in sources]
    h = attnres.depth_attention(xs, query)
    assert h.shape == (0, 3, 32)
    h.sum().backward()
    assert torch.equal(query.grad, torch.zeros_like(query))


# ---- the fused output norm (depth_attention_fwd/bwd with out_weight) ----------------
# Through the ops themselves (test_out_norm.py runs the functional and its
# autograd on CUDA too, at D = 1 among others); the reference composes the
# float64 depth attention with a float64 RMSNorm, differentiated by autograd.


def out_norm_reference(sources, query, norm_weight, out_weight, grad_out, *, eps, scale, out_eps):
    """float64: y = RMSNorm(h) * out_weight, h the eager reference read
    rounded to the sources' dtype (straight through: the model of
    docs/design.md §11), and the gradients of <y, grad_out> (sources, query,
    gain, out_weight)."""
    xs = [s.detach().double().requires_grad_(True) for s in sources]
    q = query.detach().double().requires_grad_(True)
    g = norm_weight.detach().double().requires_grad_(True)
    w = out_weight.detach().double().requires_grad_(True)
    h = reference.depth_attention(xs, q, g, eps=eps, scale=scale)
    h = h + (h.to(sources[0].dtype).double() - h).detach()
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + out_eps)
    y = h * r * w
    grads = torch.autograd.grad(y, xs + [q, g, w], grad_out.double())
    return y.detach(), h.detach(), r.squeeze(-1).detach(), grads


def out_norm_ops(sources, query, norm_weight, out_weight, grad_out, *, eps, scale, out_eps,
                 keep_h=True, want_out_weight=True):
    y, rstd, weights, h, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, eps, scale, out_weight, out_eps, keep_h)
    if not keep_h:
        assert h.numel() == 0
        _, _, _, h, _, _ = torch.ops.attnres.depth_attention_fwd(
            sources, query, norm_weight, eps, scale, out_weight, out_eps, True)
    mask = [True] * (len(sources) + 2) + [want_out_weight]
    gs, gq, gg, gw = torch.ops.attnres.depth_attention_bwd(
        grad_out, None, sources, query, norm_weight, h, rstd, weights, scale, mask, out_weight,
        out_rstd)
    return y, h, out_rstd, (gs, gq, gg, gw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [3, 64, 1000, 7186, 16384])
@pytest.mark.parametrize("N", [1, 3, 17, 65])
def test_out_norm_matches_reference(N, D, dtype):
    lead = (2, 3) if D <= 1000 else (3,)
    sources, query, norm_weight, grad_out = make_problem(N, lead, D, dtype, seed=N * 104729 + D)
    g = torch.Generator(device="cpu").manual_seed(D)
    out_weight = (1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)).to(param_dtype(dtype)).cuda()
    kw = dict(eps=1e-6, scale=0.8, out_eps=1e-5)
    y, h, out_rstd, (gs, gq, gg, gw) = out_norm_ops(sources, query, norm_weight, out_weight, grad_out, **kw)
    ry, rh, rr, rgrads = out_norm_reference(sources, query, norm_weight, out_weight, grad_out, **kw)
    assert y.dtype == dtype and y.shape == sources[0].shape and h.shape == sources[0].shape
    assert_close_rel(y, ry, dtype, "y")
    assert_close_rel(h, rh, dtype, "h")
    assert_rel_close(out_rstd, rr, STAT_REL_TOL[dtype], "out_rstd")
    for i, (a, b) in enumerate(zip(gs, rgrads[:N])):
        assert_rel_close(a, b, GRAD_REL_TOL[dtype], f"grad of sources[{i}]")
    assert_rel_close(gq, rgrads[N], GRAD_REL_TOL[dtype], "grad_query")
    assert_rel_close(gg, rgrads[N + 1], GRAD_REL_TOL[dtype], "grad_norm_weight")
    assert gw.dtype == out_weight.dtype
    assert_rel_close(gw, rgrads[N + 2], GRAD_REL_TOL[dtype], "grad_out_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_out_norm_keep_h_and_unwanted_weight_gradient(dtype):
    """keep_h=False returns an empty h and the same y; a weight gradient not
    asked for is undefined and changes nothing else (the source gradients
    bitwise; the query gradient up to its summation order, as the plan may
    then give the CTAs more tokens)."""
    sources, query, norm_weight, grad_out = make_problem(9, (33,), 1000, dtype)
    out_weight = torch.linspace(0.5, 1.5, 1000, device="cuda", dtype=param_dtype(dtype))
    kw = dict(eps=1e-6, scale=1.0, out_eps=1e-5)
    y1, _, r1, (gs1, gq1, gg1, gw1) = out_norm_ops(sources, query, norm_weight, out_weight, grad_out, **kw)
    y2, _, r2, (gs2, gq2, gg2, gw2) = out_norm_ops(sources, query, norm_weight, out_weight, grad_out,
                                                  keep_h=False, want_out_weight=False, **kw)
    assert torch.equal(y1, y2) and torch.equal(r1, r2)
    assert gw1 is not None and gw2 is None
    assert all(torch.equal(a, b) for a, b in zip(gs1, gs2))
    assert_rel_close(gq2, gq1, 1e-6, "query gradient without the weight gradient")


@pytest.mark.parametrize("N,lead,D,dtype", [
    (9, (4096,), 1000, torch.bfloat16),   # staged two-pass
    (65, (512,), 7186, torch.bfloat16),   # block per token, scalar path
    (4, (16384,), 1024, torch.float32),   # single pass, a grid of several waves
    (3, (64,), 16384, torch.float32),     # widest rows
])
def test_out_norm_backward_is_bitwise_deterministic(N, lead, D, dtype):
    sources, query, norm_weight, grad_out = make_problem(N, lead, D, dtype)
    out_weight = torch.linspace(0.5, 1.5, D, device="cuda", dtype=param_dtype(dtype))
    runs = [out_norm_ops(sources, query, norm_weight, out_weight, grad_out, eps=1e-6, scale=1.0,
                       out_eps=1e-5)[3] for _ in range(2)]
    (gs1, gq1, gg1, gw1), (gs2, gq2, gg2, gw2) = runs
    assert torch.equal(gq1, gq2) and torch.equal(gw1, gw2)
    assert all(torch.equal(a, b) for a, b in zip(gs1, gs2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_out_norm_misaligned_out_weight_and_h(dtype):
    """An out_weight view at an odd offset (copied to 16-byte alignment by
    the host code) and a misaligned h (scalar path) give the same results
    within the tolerance."""
    D = 1024
    sources, query, norm_weight, grad_out = make_problem(5, (33,), D, dtype)
    pd = param_dtype(dtype)
    w = torch.linspace(0.5, 1.5, D, device="cuda", dtype=pd)
    buf = torch.empty(D + 1, device="cuda", dtype=pd)
    w_odd = buf[1:]
    w_odd.copy_(w)
    kw = dict(eps=1e-6, scale=1.0, out_eps=1e-5)
    y, h, out_rstd, base = out_norm_ops(sources, query, norm_weight, w, grad_out, **kw)
    y2, _, _, _ = out_norm_ops(sources, query, norm_weight, w_odd, grad_out, **kw)
    assert torch.equal(y, y2)
    _, rstd, weights, _, _, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0, w, 1e-5, True)
    hbuf = torch.empty(h.numel() + 1, dtype=dtype, device="cuda")
    h_odd = hbuf[1:].view_as(h)
    h_odd.copy_(h)
    got = torch.ops.attnres.depth_attention_bwd(
        grad_out, None, sources, query, norm_weight, h_odd, rstd, weights, 1.0,
        [True] * (len(sources) + 3), w, out_rstd)
    for a, b in zip(got[0], base[0]):
        assert_rel_close(a, b, REL_TOL[dtype], "source gradient with a misaligned h")
    assert_rel_close(got[3], base[3], REL_TOL[dtype], "out_weight gradient with a misaligned h")


# ---- two-phase Block reads: the forward ops' and phase 2's backward CUDA kernels
# (docs/design.md §10)


def block_problem(n, s, lead, d, dtype, seed=0):
    """n completed sources, the partial block sum, S queries and gains, an out weight."""
    g = torch.Generator().manual_seed(seed)
    pd = param_dtype(dtype)
    src = [(torch.randn(*lead, d, generator=g, dtype=torch.float64) * (1 + i % 3)).to(dtype)
           for i in range(n + 1)]
    queries = (torch.randn(s, d, generator=g, dtype=torch.float64) * (2.0 / d**0.5)).to(pd)
    gains = (torch.rand(s, d, generator=g, dtype=torch.float64) + 0.5).to(pd)
    out_w = (1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)).to(pd)
    return src[:n], src[n], queries, gains, out_w


def one_call_f64(sources, query, gain, out_weight=None):
    """The read over `sources` in float64 on the CPU (the reference)."""
    return attnres.depth_attention([x.double() for x in sources], query.double(), gain.double(),
                                   out_weight=None if out_weight is None else out_weight.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,s,d", [(1, 1, 64), (3, 4, 1000), (5, 6, 7186), (9, 4, 1024), (2, 18, 40),
                                   (67, 2, 24), (4, 3, 3)])
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "out_norm"])
def test_block_read_forward_kernels_match_the_one_call_read(dtype, n, s, d, out_norm):
    sources, block_sum, queries, gains, out_w = block_problem(n, s, (3, 5), d, dtype, seed=n + s + d)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    ow = out_w if out_norm else None
    with torch.no_grad():
        partials, lse = attnres.block_reads([x.cuda() for x in sources], queries.cuda(), gains.cuda(),
                                            out_weight=cuda(ow))
        for j in range(s):
            want = one_call_f64(sources, queries[j], gains[j], ow if j == 0 else None)
            assert_rel_close(partials[j].cpu().double(), want, REL_TOL[dtype], f"partial {j}")
        # Phase 2 of reader 1 (reader 0 when S = 1), out of place and in place.
        j = 1 if s > 1 else 0
        if out_norm and j == 0:
            return
        want = one_call_f64(sources + [block_sum], queries[j], gains[j], ow)
        got = attnres.block_read_merge(partials[j], lse[j], block_sum.cuda(), queries[j].cuda(),
                                       gains[j].cuda(), out_weight=cuda(ow))
        assert_rel_close(got.cpu().double(), want, REL_TOL[dtype], "merge")
        in_place = block_read_merge_inplace(partials[j].clone(), lse[j], block_sum.cuda(),
                                                    queries[j].cuda(), gains[j].cuda(),
                                                    out_weight=cuda(ow))
        assert torch.equal(in_place, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,strided", [(64, False), (1000, True), (7186, False), (3, False)])
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "out_norm"])
def test_block_read_merge_backward_kernel_matches_float64(dtype, d, strided, out_norm):
    """Phase 2's backward on CUDA (block_read_merge_bwd, with and without out_weight)
    through autograd: every gradient against the float64 CPU op, and the
    same bits on a second run (the query and out-weight gradients are fixed-
    order sums of per-warp partial rows)."""
    sources, block_sum, queries, gains, out_w = block_problem(3, 2, (3, 5), d, dtype, seed=d + 7)
    with torch.no_grad():
        partials, lse = attnres.block_reads(sources, queries, gains)
    grad = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)

    def leaf(t, device, cast):
        return cast(t).to(device, copy=True).requires_grad_(True)

    def run(device, cast):
        leaves = [leaf(t, device, cast) for t in (partials[1], lse[1], block_sum, queries[1], gains[1])]
        if strided:  # block sum rows d + 5 apart, made on the device (a copy is contiguous)
            wide = torch.randn(3, 5, d + 5, dtype=torch.float64, device=device).to(leaves[2].dtype)
            wide[..., :d] = leaves[2].detach()
            leaves[2] = wide[..., :d].detach().requires_grad_(True)
            assert not leaves[2].is_contiguous()
        ow = leaf(out_w, device, cast) if out_norm else None
        out = attnres.block_read_merge(*leaves, out_weight=ow)
        out.backward(cast(grad.to(dtype)).to(device))
        return [x.grad for x in leaves] + ([ow.grad] if out_norm else [])

    want = run("cpu", lambda t: t.double())
    got = run("cuda", lambda t: t)
    again = run("cuda", lambda t: t)
    names = ["partial_out", "lse", "block_sum", "query", "gain", "out_weight"]
    for g, w, a, name in zip(got, want, again, names):
        assert g.is_cuda
        assert_rel_close(g.cpu().double(), w, GRAD_REL_TOL[dtype], f"gradient of {name}")
        assert torch.equal(g, a), f"gradient of {name} differs between two runs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,s,d", [(1, 1, 64), (3, 4, 1000), (5, 6, 7186), (2, 18, 40), (67, 2, 24),
                                   (4, 3, 3)])
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "out_norm"])
def test_block_reads_backward_kernel_matches_float64(dtype, n, s, d, out_norm):
    """Phase 1's backward on CUDA (block_reads_bwd, with and without out_weight)
    through autograd, the lse's gradient included: every gradient against
    the float64 CPU op, and the same bits on a second run."""
    sources, _, queries, gains, out_w = block_problem(n, s, (3, 5), d, dtype, seed=n + s + d)
    g = torch.Generator().manual_seed(d)
    grads = [torch.randn(3, 5, d, generator=g, dtype=torch.float64) for _ in range(s)]
    lse_grad = torch.randn(s, 3, 5, generator=g, dtype=torch.float64)

    def run(device, cast):
        leaves = [cast(t).to(device, copy=True).requires_grad_(True) for t in (*sources, queries, gains)]
        ow = cast(out_w).to(device, copy=True).requires_grad_(True) if out_norm else None
        partials, lse = attnres.block_reads(leaves[:n], leaves[n], leaves[n + 1], out_weight=ow)
        outs = [*partials, lse]
        outs_grad = [cast(x.to(dtype)).to(device) for x in grads] + [lse_grad.to(device, lse.dtype)]
        torch.autograd.backward(outs, outs_grad)
        return [x.grad for x in leaves] + ([ow.grad] if out_norm else [])

    want = run("cpu", lambda t: t.double())
    got = run("cuda", lambda t: t)
    again = run("cuda", lambda t: t)
    names = [f"source {i}" for i in range(n)] + ["queries", "gains", "out_weight"]
    for gg, w, a, name in zip(got, want, again, names):
        assert gg.is_cuda
        assert_rel_close(gg.cpu().double(), w, GRAD_REL_TOL[dtype], f"gradient of {name}")
        assert torch.equal(gg, a), f"gradient of {name} differs between two runs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_block_stream_reads_two_phase_when_asked(dtype, monkeypatch):
    """A CUDA Block stream asked for "two_phase" reads two-phase, under
    no_grad and in training, with the one-call result and gradients; "auto"
    reads one-call on CUDA (docs/design.md §10)."""
    import attnres.modules as modules_mod

    calls = {"phase1": 0}
    real = modules_mod.block_reads

    def counting(*a, **k):
        calls["phase1"] += 1
        return real(*a, **k)

    monkeypatch.setattr(modules_mod, "block_reads", counting)
    torch.manual_seed(0)
    D, L, S = 64, 12, 4
    readers = [attnres.AttnResResidual(D, dtype=param_dtype(dtype), out_norm="rmsnorm" if i % 3 == 0
                                       else None).cuda() for i in range(L + 1)]
    with torch.no_grad():
        for r in readers:
            r.query.normal_(0, 1.0 / D**0.5)
    weights = [(torch.randn(D, D, dtype=torch.float64) / D**0.5).to(dtype).cuda() for _ in range(L)]
    emb = torch.randn(2, 7, D, dtype=torch.float64).to(dtype).cuda()

    def run(mode):
        stream = attnres.DepthStream(emb, block_size=S, block_reads=mode, readers=readers)
        for res, w in zip(readers[:-1], weights):
            stream.append(torch.tanh(res(stream) @ w))
        return readers[-1](stream)

    with torch.no_grad():
        want = run("one_call")
        calls["phase1"] = 0
        got = run("two_phase")
        assert calls["phase1"] > 0
        calls["phase1"] = 0
        run("auto")
        assert calls["phase1"] == 0
    assert_rel_close(got.double(), want.double(), 4 * REL_TOL[dtype], "two-phase vs one-call")
    params = [r.query for r in readers]

    def train_grads(mode):
        out = run(mode)
        return torch.autograd.grad(out.float().pow(2).sum(), params, allow_unused=True)

    want_grads = train_grads("one_call")
    calls["phase1"] = 0
    got_grads = train_grads("two_phase")
    assert calls["phase1"] > 0
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        if w is None or not w.any():
            continue
        # This 12-layer tanh chain is ill-conditioned (it amplifies rounding
        # ~1e6 times: in fp32 one-call's own query gradients are 4-9% from
        # fp64's, in fp64 the two paths differ by ~3e-10; measured on the
        # CPU), so the two read paths are compared in fp64 at 1000x the
        # gradient tolerance; the kernels' accuracy in every dtype is
        # test_block_reads_backward_kernel_matches_float64's.
        if dtype == torch.float64:
            assert_rel_close(g, w, 1e3 * GRAD_REL_TOL[dtype], f"query {i} gradient")
        else:
            assert torch.isfinite(g).all(), f"query {i} gradient"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "out_norm"])
@pytest.mark.parametrize("shape", [(4, (5, 7), 1000, "contiguous"), (4, (5, 7), 1000, "strided"),
                                   (4, (5, 7), 1000, "misaligned"), (10, (1,), 7168, "contiguous"),
                                   (1, (3,), 64, "contiguous")],
                         ids=lambda s: f"N{s[0]}-T{s[1]}-D{s[2]}-{s[3]}")
def test_one_call_prefix_add_is_add_then_read_bit_for_bit(dtype, out_norm, shape):
    """The one-call read's delta on CUDA (added to P in the read kernel as it
    loads P, P' stored): values and every gradient equal torch.add then the
    plain read; delta contiguous, strided rows, and one element past an
    aligned address (the scalar path); a K3 decode read (9 blocks and P at
    D = 7168, one token) and P alone."""
    N, lead, D, layout = shape
    src, q, w, dh = make_problem(N, lead, D, dtype, seed=11)
    delta = dh.flip(0)
    if layout == "strided":
        delta = torch.cat([delta, delta[..., :8]], dim=-1)[..., :D]
    elif layout == "misaligned":
        delta = torch.cat([delta.new_zeros(1), delta.flatten()])[1:].view_as(delta)
    ow = (torch.rand(D, device="cuda", dtype=q.dtype) + 0.5) if out_norm else None

    def run(fused):
        leaves = [t.detach().clone().requires_grad_() for t in (*src, q, w)]
        d = delta.detach().clone() if layout == "contiguous" else delta.detach()
        d.requires_grad_()
        *s, q_, w_ = leaves
        if fused:
            out, P_next = attnres.depth_attention(s, q_, w_, out_weight=ow, delta=d)
        else:
            P_next = s[-1] + d
            out = attnres.depth_attention([*s[:-1], P_next], q_, w_, out_weight=ow)
        loss = (out.float() * dh.float()).sum() + (P_next.float() * 0.5).sum()
        return [out, P_next, *torch.autograd.grad(loss, [*leaves, d])]

    for i, (a, b) in enumerate(zip(run(True), run(False))):
        assert torch.equal(a, b), i


# The few-token kernels (docs/design.md §7) at K3's decode read: bf16, N = 10
# (the last source the partial sum P, read with delta), D = 7168, with and
# without the fused norm. ATTNRES_CUDA_FEW_TOKENS is read once per process:
# the tiled kernel's results come from a subprocess with it set to 0.
few_tokens_on = pytest.mark.skipif(os.environ.get("ATTNRES_CUDA_FEW_TOKENS") == "0",
                                   reason="ATTNRES_CUDA_FEW_TOKENS=0 turns the few-token kernels off")


def k3_decode_read(T, seed):
    sources, query, norm_weight, _ = make_problem(10, (T,), 7168, torch.bfloat16, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    delta = (torch.randn(T, 7168, generator=g, dtype=torch.float64) * 0.5).to(torch.bfloat16).cuda()
    out_weight = (1 + 0.3 * torch.randn(7168, generator=g, dtype=torch.float64)).float().cuda()
    return sources, query, norm_weight, delta, out_weight


def k3_decode_ops(sources, query, norm_weight, delta, out_weight):
    """[h, rstd, weights, P'] of the plain read, then [y, h, out_rstd] of the normed one."""
    h, rstd, weights, _, _, p_next = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0, None, None, False, delta)
    y, _, _, h_kept, out_rstd, _ = torch.ops.attnres.depth_attention_fwd(
        sources, query, norm_weight, 1e-6, 1.0, out_weight, 1e-5, True, delta)
    return [h, rstd, weights, p_next, y, h_kept, out_rstd]


def k3_decode_outputs(*args):
    """k3_decode_ops' results, and whether a few-token kernel ran (the profiler's kernel names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = k3_decode_ops(*args)
        torch.cuda.synchronize()
    return outs, any("few_tokens_finish_kernel" in e.name for e in prof.events())


@few_tokens_on
@pytest.mark.parametrize("T", [1, 16])
def test_few_tokens_read_matches_the_tiled_kernel_and_float64(T, tmp_path):
    if torch.cuda.get_device_properties(0).multi_processor_count // T < 2:
        pytest.skip(f"fewer than {2 * T} SMs: plan_few_tokens leaves T = {T} to the tiled kernel")
    args = k3_decode_read(T, seed=21 + T)
    got, few = k3_decode_outputs(*args)
    torch.save([[x.cpu() for x in args[0]], *[x.cpu() for x in args[1:]]], tmp_path / "in.pt")
    code = (f"import sys, torch\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "from test_cuda import k3_decode_outputs\n"
            "srcs, *rest = torch.load(sys.argv[1])\n"
            "outs, few = k3_decode_outputs([s.cuda() for s in srcs], *[x.cuda() for x in rest])\n"
            "torch.save(([o.cpu() for o in outs], few), sys.argv[2])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          env={**os.environ, "ATTNRES_CUDA_FEW_TOKENS": "0"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    tiled, tiled_few = torch.load(tmp_path / "out.pt")
    assert few and not tiled_few, "few-token kernels in the wrong process (or no kernels profiled)"
    h, rstd, weights, p_next, y, h_kept, out_rstd = got
    sources, query, norm_weight, delta, out_weight = args
    # P' rounded as torch.add, both paths; the normed read's h is the plain one's.
    assert torch.equal(p_next, sources[-1] + delta) and torch.equal(p_next, tiled[3].cuda())
    assert torch.equal(h_kept, h)
    for name, a, b, tol in [("h", h, tiled[0], REL_TOL), ("rstd", rstd, tiled[1], STAT_REL_TOL),
                            ("weights", weights, tiled[2], STAT_REL_TOL), ("y", y, tiled[4], REL_TOL),
                            ("out_rstd", out_rstd, tiled[6], STAT_REL_TOL)]:
        assert_rel_close(a.cpu().double(), b.double(), tol[torch.bfloat16], f"{name} vs the tiled kernel")
    # Against float64 over P'.
    xs = [x.double() for x in sources[:-1]] + [p_next.double()]
    ref_h, ref_w = reference.depth_attention(xs, query.double(), norm_weight.double(), eps=1e-6,
                                             return_weights=True)
    ref_r = torch.rsqrt(h.double().pow(2).mean(-1) + 1e-5)  # of the rounded h (§11)
    assert_rel_close(h.double(), ref_h, REL_TOL[torch.bfloat16], "h")
    assert_rel_close(weights.double(), ref_w.double(), STAT_REL_TOL[torch.bfloat16], "weights")
    assert_rel_close(out_rstd.double(), ref_r, STAT_REL_TOL[torch.bfloat16], "out_rstd")
    assert_rel_close(y.double(), h.double() * ref_r.unsqueeze(-1) * out_weight.double(),
                     REL_TOL[torch.bfloat16], "y")


@few_tokens_on
def test_cuda_graph_replays_a_few_token_read():
    """The few-token kernels' scratch comes from the caching allocator and
    nothing waits on the host: a captured K3 decode read replays the eager bits."""
    static = k3_decode_read(1, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            k3_decode_ops(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = k3_decode_ops(*static)
    for seed in (4, 5):
        new = k3_decode_read(1, seed=seed)
        for dst, src in zip([*static[0], *static[1:]], [*new[0], *new[1:]]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(replayed, k3_decode_ops(*static))):
            assert torch.equal(a, b), f"replayed output {i} differs from an eager run"


@pytest.mark.parametrize("T", [1, 64], ids=["few_tokens", "tiled"])
def test_a_query_view_off_16_bytes_reads_as_an_aligned_copy(T):
    """Without a gain at scale 1 the effective query is the query itself; the
    kernels load it in 16-byte packs, so a view off that alignment must be
    copied first (the host does), not read misaligned."""
    sources, query, _, grad_out = make_problem(4, (T,), 1024, torch.float32, gain=False, seed=31)
    buf = torch.empty(query.numel() + 1, device="cuda", dtype=query.dtype)
    buf[1:].copy_(query)
    off = buf[1:]
    assert off.data_ptr() % 16 != 0
    want = attnres.depth_attention(sources, query.clone())
    got = attnres.depth_attention(sources, off)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
