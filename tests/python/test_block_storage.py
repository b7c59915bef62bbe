"""DepthStream(block_storage=...): a Block stream that builds its block sums
in the rows of one preallocated buffer (for inference and CUDA graphs). The
reads and outputs must equal those of a stream without storage bit for bit,
the sources must be views of the buffer, and misuse must be refused."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnres
from attnres.models import GPT, GPTConfig, KVCache

from helpers import randomize_reads

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def make_readers(n, D, dtype, out_norm=None, seed=0):
    torch.manual_seed(seed)
    param_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    readers = [attnres.AttnResResidual(D, dtype=param_dtype, out_norm=out_norm) for _ in range(n)]
    with torch.no_grad():
        for r in readers:
            r.query.normal_(0, 1.0)
            r.norm_weight.uniform_(0.5, 1.5)
            if r.out_weight is not None:
                r.out_weight.uniform_(0.5, 1.5)
    return readers


def run_stream(emb, outputs, readers, block_size, block_reads, storage=None):
    """Reads in front of each output and the final read, as a model runs them."""
    stream = attnres.DepthStream(emb, block_size, block_reads=block_reads, readers=readers,
                                 block_storage=storage)
    reads = []
    for i, f in enumerate(outputs):
        reads.append(readers[i](stream))
        stream.append(f * (1 + reads[-1].tanh()))  # each output depends on its read
    reads.append(readers[len(outputs)](stream))
    return stream, reads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_reads", ["auto", "two_phase", "one_call"])
@pytest.mark.parametrize("out_norm", [None, "rmsnorm"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_reads_equal_a_stream_without_storage_bit_for_bit(dtype, block_reads, out_norm, mode):
    D, L, S = 67, 11, 4
    gen = torch.Generator().manual_seed(1)
    emb = torch.randn(2, 3, D, generator=gen).to(dtype)
    outputs = [torch.randn(2, 3, D, generator=gen).to(dtype) for _ in range(L)]
    readers = make_readers(L + 1, D, dtype, out_norm)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        storage = torch.full((math.ceil(L / S), 2, 3, D), float("nan"), dtype=dtype)
        _, plain = run_stream(emb, outputs, readers, S, block_reads)
        stream, stored = run_stream(emb, outputs, readers, S, block_reads, storage)
    for a, b in zip(plain, stored):
        assert torch.equal(a, b)
    # The completed blocks' sums live in the buffer's rows, the sources are
    # its views; the partial sum of the block in progress is not written.
    sources = stream.sources
    assert len(sources) == 1 + math.ceil(L / S)
    for k, src in enumerate(sources[1:-1]):
        assert src.data_ptr() == storage[k].data_ptr()
        assert src.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    assert sources[-1].untyped_storage().data_ptr() != storage.untyped_storage().data_ptr()
    assert storage[-1].isnan().all()


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block_reads", ["auto", "two_phase", "one_call"])
def test_storage_reads_fuse_the_adds_and_write_each_block_once(block_reads):
    """With block storage the outputs inside a block join the partial sum in
    the next read (the fused prefix add: an append runs no op of its own),
    and a block's sum is written into its row once, when it completes."""
    D, L, S = 16, 8, 4
    readers = make_readers(L + 1, D, torch.float32)
    emb, outputs = torch.randn(3, D), [torch.randn(3, D) for _ in range(L)]
    with torch.no_grad():
        storage = torch.full((2, 3, D), float("nan"))
        stream = attnres.DepthStream(emb, S, block_reads=block_reads, readers=readers,
                                     block_storage=storage)
        for i, f in enumerate(outputs):
            with _RecordOps() as read_ops:
                readers[i](stream)
            with _RecordOps() as append_ops:
                stream.append(f)
            assert sum(name.startswith("attnres.") for name in read_ops.names) == 1, read_ops.names
            assert not any("add" in name or "copy" in name for name in read_ops.names)
            assert append_ops.names == (["aten.add"] if (i + 1) % S == 0 else []), (i, append_ops.names)
            if (i + 1) % S == 0:
                torch.testing.assert_close(storage[i // S], sum(outputs[i + 1 - S:i + 1]))


def test_strided_embedding_and_one_row_per_block_reused_across_passes():
    """The same buffer serves pass after pass (a decode loop); the embedding
    may be any strided tensor."""
    D, L, S = 33, 6, 3
    gen = torch.Generator().manual_seed(2)
    readers = make_readers(L + 1, D, torch.float32)
    storage = torch.empty(2, 5, D)
    with torch.no_grad():
        for step in range(3):
            emb = torch.randn(D, 5, generator=gen).t()  # strided
            outputs = [torch.randn(5, D, generator=gen) for _ in range(L)]
            _, plain = run_stream(emb, outputs, readers, S, "auto")
            _, stored = run_stream(emb, outputs, readers, S, "auto", storage)
            for a, b in zip(plain, stored):
                assert torch.equal(a, b)


def test_clones_share_the_rows_and_only_one_may_go_on():
    D = 8
    readers = make_readers(5, D, torch.float64)
    storage = torch.empty(2, 3, D, dtype=torch.float64)
    with torch.no_grad():
        stream = attnres.DepthStream(torch.randn(3, D, dtype=torch.float64), 2,
                                     block_storage=storage)
        stream.append(torch.randn(3, D, dtype=torch.float64))
        clone = stream.clone()
        assert clone.block_storage is storage
        clone.append(torch.randn(3, D, dtype=torch.float64))
        readers[0](clone)  # the clone goes on
        for use in (lambda: stream.sources, lambda: readers[0](stream),
                    lambda: stream.append(torch.randn(3, D, dtype=torch.float64)),
                    lambda: stream.clone()):
            with pytest.raises(ValueError, match="another stream sharing this stream's block_storage"):
                use()
        # flatten/unflatten rebuilds a stream without storage
        tensors, spec = clone.flatten()
        rebuilt = attnres.DepthStream.unflatten(tensors, spec)
        assert rebuilt.block_storage is None


def bad_storage_cases():
    emb = torch.randn(2, 4)
    return [
        (dict(block_size=None, block_storage=torch.empty(1, 2, 4)), ValueError,
         "block_storage is for Block streams"),
        (dict(block_size=2, block_storage=[torch.empty(2, 4)]), TypeError,
         "block_storage must be a tensor"),
        (dict(block_size=2, block_storage=torch.empty(2, 2, 5)), ValueError,
         r"block_storage must have shape \[R, 2, 4\] \(rows, then the embedding's shape\) with R >= 1, got \[2, 2, 5\]"),
        (dict(block_size=2, block_storage=torch.empty(0, 2, 4)), ValueError,
         "with R >= 1, got"),
        (dict(block_size=2, block_storage=torch.empty(2, 2, 4, dtype=torch.float64)), TypeError,
         "block_storage has dtype torch.float64 but the stream's dtype"),
        (dict(block_size=2, block_storage=torch.empty(2, 2, 4, device="meta")), ValueError,
         "block_storage is on device meta but the stream is on device cpu"),
        (dict(block_size=2, block_storage=torch.empty(2, 4, 2).transpose(1, 2)), ValueError,
         "block_storage must be contiguous"),
        (dict(block_size=2, block_storage=torch.empty(2, 2, 4, requires_grad=True)), ValueError,
         "block_storage must not require grad"),
    ], emb


def test_bad_storage_is_refused_with_its_reason():
    cases, emb = bad_storage_cases()
    for kwargs, exc, words in cases:
        with pytest.raises(exc, match=words):
            attnres.DepthStream(emb, **kwargs)
    buf = torch.empty(3, 2, 4)
    with pytest.raises(ValueError, match="must not share memory with the embedding"):
        attnres.DepthStream(buf[1], 2, block_storage=buf)
    with torch.inference_mode():
        made_in_inference = torch.empty(2, 2, 4)
        attnres.DepthStream(emb, 2, block_storage=made_in_inference)  # fine in inference mode
    with pytest.raises(ValueError, match="block_storage is an inference tensor"):
        attnres.DepthStream(emb, 2, block_storage=made_in_inference)
    # The embedding in a row of its own next to the storage's rows is fine.
    attnres.DepthStream(buf[0], 2, block_storage=buf[1:])


def test_too_few_rows_and_outputs_that_need_a_gradient_are_refused():
    D = 4
    stream = attnres.DepthStream(torch.randn(2, D), 2, block_storage=torch.empty(1, 2, D))
    with torch.no_grad():
        stream.append(torch.randn(2, D))
        stream.append(torch.randn(2, D))
        with pytest.raises(ValueError, match="block_storage has 1 rows but output 3 belongs to block 2"):
            stream.append(torch.randn(2, D))
    assert stream.num_outputs == 2 and stream.num_sources == 2  # unchanged by the refusal
    w = torch.randn(2, D, requires_grad=True)
    stream = attnres.DepthStream(torch.randn(2, D), 2, block_storage=torch.empty(1, 2, D))
    with pytest.raises(ValueError, match="writes its blocks in place and is for inference"):
        stream.append(w * 2)
    with torch.no_grad():
        stream.append(w * 2)  # the same under no_grad is fine
    # Under grad mode with nothing that needs a gradient the stream works too.
    stream.append(torch.randn(2, D))
    assert stream.num_sources == 2
    # A read whose parameters need a gradient would save views of the rows.
    read = attnres.AttnResResidual(D)
    with pytest.raises(ValueError, match="a read of a stream with block_storage under grad mode"):
        read(stream)
    with pytest.raises(ValueError, match="a read of a stream with block_storage under grad mode"):
        read(stream, return_weights=True)
    read.requires_grad_(False)
    read(stream)  # frozen reads under grad mode record nothing


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_gpt_block_inference_with_storage_equals_without(norm):
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=5, n_heads=4,
                    residual="block", block_layers=2, norm=norm)
    torch.manual_seed(0)
    model = randomize_reads(GPT(cfg).eval())
    idx = torch.randint(0, 64, (2, 9))
    storage = torch.full((cfg.num_blocks, 2, 9, 32), float("nan"))
    with torch.no_grad():
        plain, _ = model(idx)
        stored, _ = model(idx, block_storage=storage)
    assert cfg.num_blocks == 3
    assert torch.equal(plain, stored)
    # The completed blocks' rows were written (the storage was used); the
    # last block (one layer of two) is a partial sum, never written.
    assert not storage[:2].isnan().any() and storage[2].isnan().all()
    with pytest.raises(ValueError, match="block_storage is for Block streams"):
        GPT(GPTConfig(residual="full", n_layers=1))(idx, block_storage=storage)
    with pytest.raises(ValueError, match="block_storage needs residual='block'"):
        GPT(GPTConfig(residual="standard", n_layers=1))(idx, block_storage=storage)


@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_kv_cache_decoding_equals_the_full_forward(residual):
    """Token by token with a KVCache (and, for Block, block storage) gives
    the logits of one forward over the whole sequence."""
    cfg = GPTConfig(vocab_size=64, seq_len=12, d_model=32, n_layers=3, n_heads=4,
                    residual=residual, block_layers=1 if residual == "block" else None,
                    norm="rmsnorm")
    torch.manual_seed(1)
    model = GPT(cfg).eval()
    if residual != "standard":
        randomize_reads(model)
    idx = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(cfg, batch=2)
        prompt, _ = model(idx[:, :4], kv_cache=cache)  # prefill of 4 tokens
        chunk, _ = model(idx[:, 4:7], kv_cache=cache)  # 3 more at position 4
        steps = [prompt, chunk]
        storage = None
        if residual == "block":
            storage = torch.full((cfg.num_blocks, 2, 1, 32), float("nan"))
        for t in range(7, 10):
            logits, _ = model(idx[:, t:t + 1], kv_cache=cache, block_storage=storage)
            steps.append(logits)
    assert int(cache.pos) == 10
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert storage is None or not storage.isnan().any()
    with pytest.raises(ValueError, match=r"max_len must be an int in \[1, cfg.seq_len = 12\]"):
        KVCache(cfg, batch=1, max_len=13)


def test_compiled_block_gpt_with_storage_traces_in_one_graph():
    """torch.compile(fullgraph=True) of a Block GPT's inference with
    block_storage: one graph, the eager logits, the rows written."""
    torch._dynamo.reset()
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=3, n_heads=2,
                    residual="block", block_size=2, norm="rmsnorm", block_reads="two_phase")
    torch.manual_seed(2)
    model = randomize_reads(GPT(cfg).eval())
    idx = torch.randint(0, 32, (2, 8))
    storage = torch.full((cfg.num_blocks, 2, 8, 16), float("nan"))
    compiled = torch.compile(lambda i, s: model(i, block_storage=s)[0], fullgraph=True,
                             backend="aot_eager")
    with torch.no_grad():
        want, _ = model(idx)
        got = compiled(idx, storage)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not storage.isnan().any()


def test_a_block_completed_under_grad_mode_after_a_graph_forming_read_is_written():
    """An output that needs a gradient appended under no_grad, then a frozen
    read under grad mode (its P' then has a graph), then the block's last
    output under grad mode: the row is written (no graph through the rows)."""
    D = 8
    read = attnres.AttnResResidual(D).requires_grad_(False)
    storage = torch.full((1, 2, D), float("nan"))
    stream = attnres.DepthStream(torch.randn(2, D), 3, block_storage=storage)
    first = torch.randn(2, D, requires_grad=True) * 2
    with torch.no_grad():
        stream.append(first)
    stream.append(torch.randn(2, D))
    read(stream)  # forms P' with a graph back to w
    last = torch.randn(2, D)
    stream.append(last)
    assert stream.sources[1].data_ptr() == storage[0].data_ptr()
    assert not storage.isnan().any()
