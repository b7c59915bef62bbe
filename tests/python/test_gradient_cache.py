"""The CPU gradient cache (csrc/gradient_cache.cpp): the backward ops' large
CPU gradient outputs and the forward ops' read outputs come from kept blocks
once earlier ones were freed, the results are the same bits as without the
cache, the limit holds, and the API checks its arguments."""
import math
import os
import subprocess
import sys

import pytest
import torch

import attnres

MIB = 1 << 20
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def restore_limit():
    before = attnres.cpu_gradient_cache_stats()["limit_bytes"]
    yield
    attnres.set_cpu_gradient_cache_limit(before)


def _problem(dtype=torch.float32, n=3, tokens=1031, d=300, seed=0):
    # 1031 * 300 * 4 bytes = 1.18 MiB per fp32 gradient: above the cache's
    # 1 MiB floor (bf16/fp16 use more tokens to stay above it).
    tokens = tokens * max(1, 4 // torch.tensor([], dtype=dtype).element_size())
    gen = torch.Generator().manual_seed(seed)
    pd = torch.float64 if dtype == torch.float64 else torch.float32
    srcs = [torch.randn(tokens, d, generator=gen).to(dtype).requires_grad_() for _ in range(n)]
    q = (torch.randn(d, generator=gen) / math.sqrt(d)).to(pd).requires_grad_()
    g = (1 + 0.2 * torch.randn(d, generator=gen)).to(pd).requires_grad_()
    dh = torch.randn(tokens, d, generator=gen).to(dtype)
    return srcs, q, g, dh


def _grads(srcs, q, g, dh):
    h = attnres.depth_attention(srcs, q, g)
    return torch.autograd.grad(h, srcs + [q, g], dh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_are_the_same_bits_with_and_without_the_cache(dtype):
    problem = _problem(dtype)
    attnres.set_cpu_gradient_cache_limit(0)
    off = _grads(*problem)
    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    for _ in range(3):  # the second and third calls reuse freed blocks
        on = _grads(*problem)
        for a, b in zip(off, on):
            assert torch.equal(a, b)
        del on
    assert attnres.cpu_gradient_cache_stats()["hits"] > 0


def test_freed_gradients_are_reused_and_counted():
    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    attnres.empty_cpu_gradient_cache()
    problem = _problem()
    first = _grads(*problem)
    ptrs = {t.data_ptr() for t in first[:3]}
    s0 = attnres.cpu_gradient_cache_stats()
    assert s0["in_use_bytes"] >= 3 * first[0].numel() * 4
    del first
    s1 = attnres.cpu_gradient_cache_stats()
    # The three gradients and the forward's h (freed when _grads returned).
    assert s1["cached_blocks"] >= 4 and s1["in_use_bytes"] == s0["in_use_bytes"] - s1["cached_bytes"] + s0["cached_bytes"]
    second = _grads(*problem)
    s2 = attnres.cpu_gradient_cache_stats()
    # h takes the newest kept block (a gradient of the first call), the
    # gradients the other two and h's old block.
    assert len({t.data_ptr() for t in second[:3]} & ptrs) == 2
    assert s2["hits"] - s1["hits"] == 4 and s2["misses"] == s1["misses"]
    # Parameter gradients ([D]) are small: not from the cache.
    assert s2["in_use_bytes"] - s1["in_use_bytes"] == sum(
        math.ceil(t.numel() * t.element_size() / (64 << 10)) * (64 << 10) for t in second[:3])


def _forward_outputs(which, dtype):
    srcs, q, g, _ = _problem(dtype, n=4)
    srcs = [t.detach() for t in srcs]
    q, g = q.detach(), g.detach()
    w = 1 + 0.1 * torch.randn(q.shape[0], generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    if which == "depth_attention":
        return lambda: [attnres.depth_attention(srcs, q, g)]
    if which == "out_norm":
        return lambda: [attnres.depth_attention(srcs, q, g, out_weight=w)]
    queries, gains = torch.stack([q, -q]), torch.stack([g, g])
    if which == "block_reads":
        return lambda: list(attnres.block_reads(srcs, queries, gains)[0])
    outs, lse = attnres.block_reads(srcs, queries, gains)
    partial, lse1, block = outs[1].clone(), lse[1].clone(), srcs[0] + srcs[1]
    return lambda: [attnres.block_read_merge(partial, lse1, block, queries[1], gains[1])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["depth_attention", "out_norm", "block_reads", "block_read_merge"])
def test_forward_outputs_come_from_the_cache_with_the_same_bits(which, dtype):
    call = _forward_outputs(which, dtype)
    attnres.set_cpu_gradient_cache_limit(0)
    with torch.no_grad():
        off = call()
    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    attnres.empty_cpu_gradient_cache()
    with torch.no_grad():
        first = call()
        ptrs = {t.data_ptr() for t in first}
        del first  # kept by the cache
        s1 = attnres.cpu_gradient_cache_stats()
        second = call()
    s2 = attnres.cpu_gradient_cache_stats()
    assert s1["cached_blocks"] >= len(off)
    assert {t.data_ptr() for t in second} == ptrs
    assert s2["hits"] - s1["hits"] == len(off) and s2["misses"] == s1["misses"]
    for a, b in zip(off, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("out_norm", [False, True])
def test_training_forwards_take_their_outputs_from_the_cache_too(out_norm):
    # With autograd recording, the forward's outputs (h, and with the fused
    # norm y and the saved h) come from blocks freed by the previous step,
    # with the same values and gradients as without the cache.
    srcs, q, g, dh = _problem(n=4)
    w = (1 + 0.1 * torch.randn(q.shape[0], generator=torch.Generator().manual_seed(2))).requires_grad_()
    kwargs = {"out_weight": w} if out_norm else {}

    def step():
        h = attnres.depth_attention(srcs, q, g, **kwargs)
        return (h.detach().clone(), *torch.autograd.grad(h, srcs + [q, g], dh))

    attnres.set_cpu_gradient_cache_limit(0)
    off = step()
    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    attnres.empty_cpu_gradient_cache()
    step()  # fills the cache when its outputs are freed
    s1 = attnres.cpu_gradient_cache_stats()
    h = attnres.depth_attention(srcs, q, g, **kwargs)
    s2 = attnres.cpu_gradient_cache_stats()
    # The forward's [T, D] outputs: h (plain), or y and the kept h (fused norm).
    assert s2["hits"] - s1["hits"] == (2 if out_norm else 1) and s2["misses"] == s1["misses"]
    del h
    on = step()
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_the_limit_bounds_the_kept_bytes_and_zero_turns_it_off():
    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    problem = _problem(n=5)
    grads = _grads(*problem)
    block = math.ceil(grads[0].numel() * 4 / (64 << 10)) * (64 << 10)
    attnres.set_cpu_gradient_cache_limit(2 * block)  # room for two of the five
    del grads
    s = attnres.cpu_gradient_cache_stats()
    assert s["cached_blocks"] == 2 and s["cached_bytes"] == 2 * block
    attnres.set_cpu_gradient_cache_limit(block)  # lowering it frees the oldest now
    assert attnres.cpu_gradient_cache_stats()["cached_bytes"] == block
    attnres.set_cpu_gradient_cache_limit(0)
    s = attnres.cpu_gradient_cache_stats()
    assert s["cached_bytes"] == 0
    grads = _grads(*problem)
    s2 = attnres.cpu_gradient_cache_stats()
    assert s2["hits"] == s["hits"] and s2["misses"] == s["misses"] and s2["in_use_bytes"] == s["in_use_bytes"]
    del grads


def test_empty_returns_kept_blocks_and_gradients_in_use_stay_valid():
    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    problem = _problem()
    kept = _grads(*problem)
    copies = [t.clone() for t in kept]
    _grads(*problem)  # freed at once: kept
    assert attnres.cpu_gradient_cache_stats()["cached_bytes"] > 0
    attnres.empty_cpu_gradient_cache()
    assert attnres.cpu_gradient_cache_stats()["cached_bytes"] == 0
    for a, b in zip(kept, copies):
        assert torch.equal(a, b)


def test_block_read_backwards_use_it_too():
    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    srcs, q, g, dh = _problem(n=4)
    queries = torch.stack([q.detach(), -q.detach()]).requires_grad_()
    gains = torch.stack([g.detach(), g.detach()]).requires_grad_()

    def step():
        outs, lse = attnres.block_reads(srcs, queries, gains)
        merged = attnres.block_read_merge(outs[1], lse[1], srcs[0] + srcs[1], queries[1], gains[1])
        loss = (outs[0].float() * dh.float()).sum() + (merged.float() * dh.float()).sum()
        return torch.autograd.grad(loss, srcs + [queries, gains])

    expected = None
    for _ in range(3):
        got = step()
        if expected is None:
            expected = [t.clone() for t in got]
        for a, b in zip(expected, got):
            assert torch.equal(a, b)
        before = attnres.cpu_gradient_cache_stats()["hits"]
        del got
    got = step()
    assert attnres.cpu_gradient_cache_stats()["hits"] > before


def test_the_profiler_sees_cached_allocations():
    from torch.profiler import ProfilerActivity, profile

    attnres.set_cpu_gradient_cache_limit(256 * MIB)
    srcs, q, g, dh = _problem()
    _grads(srcs, q, g, dh)  # blocks now kept: the next call is served by hits
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grads = _grads(srcs, q, g, dh)
    events = prof.profiler.kineto_results.events()
    sizes = [e.nbytes() for e in events if e.name() == "[memory]"]
    block = math.ceil(grads[0].numel() * 4 / (64 << 10)) * (64 << 10)
    assert sizes.count(block) >= 3, sizes


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="must be >= 0"):
        attnres.set_cpu_gradient_cache_limit(-1)
    with pytest.raises(TypeError, match="must be an int"):
        attnres.set_cpu_gradient_cache_limit(True)
    with pytest.raises(TypeError, match="must be an int"):
        attnres.set_cpu_gradient_cache_limit(1.5)
    with pytest.raises(ValueError, match="limit must be >= 0 bytes"):
        torch.ops.attnres.set_cpu_gradient_cache_limit(-5)


@pytest.mark.parametrize("value, expect", [("0", "limit 0"), ("3", f"limit {3 * MIB}"),
                                           ("lots", "must be a whole number of MiB")])
def test_the_environment_variable_sets_the_first_limit(value, expect):
    code = ("import attnres, torch\n"
            "try:\n"
            "    print('limit', attnres.cpu_gradient_cache_stats()['limit_bytes'])\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = {**os.environ, "ATTNRES_CPU_GRAD_CACHE_MB": value}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert expect in proc.stdout
