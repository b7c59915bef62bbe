"""DepthStream as a PyTorch value and its declared Block schedule: the pytree
form and its parts, reads whose path depends only on the configuration, the
grad mode and the inputs (no state carried across forward passes), grad mode
honoured per read, both checkpoint kinds, and torch.compile without
recompiles."""
import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

import attnres
import attnres.modules as modules_mod
from attnres.models import GPT, GPTConfig

from helpers import assert_rel_close, randomize_reads

D = 16


def make_readers(n, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    readers = [attnres.AttnResResidual(D, dtype=dtype) for _ in range(n)]
    with torch.no_grad():
        for r in readers:
            r.query.normal_(0, 1.0)
            r.norm_weight.uniform_(0.5, 1.5)
    return readers


class Calls:
    """Counts the two-phase ops the modules call (by appending, so that a
    compiled caller needs no guard on a count)."""

    def __init__(self, monkeypatch):
        self.log = []
        for name, field in (("block_reads", "phase1"), ("block_read_merge", "merge"),
                            ("block_read_merge_inplace", "merge")):
            real = getattr(modules_mod, name)

            def counted(*a, _real=real, _field=field, **k):
                self.log.append(_field)
                return _real(*a, **k)
            monkeypatch.setattr(modules_mod, name, counted)

    @property
    def phase1(self):
        return self.log.count("phase1")

    @property
    def merge(self):
        return self.log.count("merge")


def streams():
    """Full, and Block with and without a partial sum."""
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(2, 3, D, generator=gen, dtype=torch.float64)
    outs = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) for _ in range(5)]
    made = []
    for block_size, n in ((None, 3), (2, 5), (3, 3)):
        s = attnres.DepthStream(emb, block_size=block_size)
        for f in outs[:n]:
            s.append(f)
        made.append(s)
    return made


@pytest.mark.parametrize("index", range(3), ids=["full", "block-partial", "block-complete"])
def test_stream_is_a_pytree_of_its_sources(index):
    stream = streams()[index]
    leaves, spec = pytree.tree_flatten(stream)
    assert all(a is b for a, b in zip(leaves, stream.sources)) and len(leaves) == stream.num_sources
    assert stream.tensors() == leaves
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, attnres.DepthStream) and back is not stream
    assert (back.block_size, back.num_outputs, back.num_sources) == \
        (stream.block_size, stream.num_outputs, stream.num_sources)
    assert all(a is b for a, b in zip(back.sources, stream.sources))
    # tree_map may put any value in a leaf's place, and back.
    doubled = pytree.tree_map(lambda t: 2 * t, stream)
    assert all(torch.equal(a, 2 * b) for a, b in zip(doubled.sources, stream.sources))
    dtypes = pytree.tree_map(lambda t: t.dtype, stream)
    assert pytree.tree_leaves(dtypes) == [t.dtype for t in stream.sources]
    # The public flat form rebuilds the same stream, and appending continues it.
    tensors, flat_spec = stream.flatten()
    rebuilt = attnres.DepthStream.unflatten(tensors, flat_spec)
    f = torch.randn_like(stream.embedding)
    rebuilt.append(f)
    stream.clone().append(f)
    twin = stream.clone()
    twin.append(f)
    assert [torch.equal(a, b) for a, b in zip(rebuilt.sources, twin.sources)] == [True] * twin.num_sources
    with pytest.raises(ValueError, match=re.escape(
            f"DepthStream.unflatten: the spec needs {len(tensors)} tensors, got {len(tensors) + 1}")):
        attnres.DepthStream.unflatten([*tensors, f], flat_spec)


def test_from_sources_builds_a_stream_mid_block():
    """What a pipeline stage does: the stream from its parts, then the same
    reads as the stream that was never split."""
    readers = make_readers(6)
    gen = torch.Generator().manual_seed(4)
    emb = torch.randn(5, D, generator=gen, dtype=torch.float64)
    outs = [torch.randn(5, D, generator=gen, dtype=torch.float64) for _ in range(5)]
    whole = attnres.DepthStream(emb, block_size=3)
    for f in outs:
        whole.append(f)
    part = attnres.DepthStream.from_sources(emb, [sum(outs[:3])], outs[3] + outs[4], block_size=3,
                                            partial_count=2)
    assert part.num_outputs == 5
    torch.testing.assert_close(readers[5](part), readers[5](whole), rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="partial and partial_count go together"):
        attnres.DepthStream.from_sources(emb, [], outs[0], block_size=3)
    with pytest.raises(ValueError, match=re.escape("partial_count must be in [0, block_size) = [0, 3)")):
        attnres.DepthStream.from_sources(emb, [], outs[0], block_size=3, partial_count=3)
    with pytest.raises(ValueError, match="a Full stream"):
        attnres.DepthStream.from_sources(emb, [], outs[0], partial_count=1)
    with pytest.raises(ValueError, match="DepthStream.from_sources: output has shape"):
        attnres.DepthStream.from_sources(emb, [outs[0][:2]], block_size=None)


# ---- grad mode per read, with a declared schedule -------------------------------------------


def block_reads_of(readers, emb, outs, grads):
    """The 6 reads of a Block(S=3) stream of 5 appended outputs; grads[j]
    is the grad mode of read j."""
    stream = attnres.DepthStream(emb, block_size=3, block_reads="two_phase", readers=readers)
    hs = []
    for j, grad in enumerate(grads):
        with torch.set_grad_enabled(grad):
            hs.append(readers[j](stream))
        if j < len(outs):
            stream.append(outs[j])
    return hs


def one_call_reads(readers, emb, outs):
    stream = attnres.DepthStream(emb, block_size=3)
    hs = []
    for j, r in enumerate(readers):
        hs.append(r(stream))
        if j < len(outs):
            stream.append(outs[j])
    return hs


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-first-readers"])
@pytest.mark.parametrize("grads", [(True, False, True, False, True, True),
                                   (False, True, True, False, False, True),
                                   (True, True, False, True, True, False)],
                         ids=["first-with-grad", "first-no-grad", "mixed"])
def test_grad_mode_is_honoured_per_read(grads, frozen, monkeypatch):
    """A read has a graph if and only if it was made with grad, and its
    gradients are the one-call read's, whatever grad mode the block's other
    reads (the one that ran phase 1 among them) had, and with the readers
    that run phase 1 frozen."""
    readers = make_readers(6)
    for r in (readers[0], readers[3]) if frozen else ():
        r.requires_grad_(False)
    gen = torch.Generator().manual_seed(5)
    # 2 completed block sums before the block the reads 3 .. 5 share.
    emb = torch.randn(4, D, generator=gen, dtype=torch.float64, requires_grad=True)
    outs = [torch.randn(4, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(5)]
    calls = Calls(monkeypatch)
    got = block_reads_of(readers, emb, outs, grads)
    assert calls.phase1 == 2  # the declared readers: two-phase from the first pass
    # Reads 1, 2 and 4, 5 merge, except a read with grad after a phase 1 without.
    assert calls.merge == sum(not (grads[j] and not grads[first])
                              for first in (0, 3) for j in (first + 1, first + 2))
    want = one_call_reads(readers, emb, outs)
    params = [emb, *outs, *[p for r in readers for p in r.parameters() if p.requires_grad]]
    for j, (h, ref) in enumerate(zip(got, want)):
        assert (h.grad_fn is not None) == grads[j] and h.requires_grad == grads[j], j
        torch.testing.assert_close(h, ref, rtol=1e-12, atol=1e-14)
        if grads[j]:
            g = torch.autograd.grad(h.pow(2).sum(), params, allow_unused=True, retain_graph=True)
            # retain_graph: a read and the partial sum it forms (fused add,
            # docs/design.md §12) share one node that later reads go through.
            w = torch.autograd.grad(ref.pow(2).sum(), params, allow_unused=True, retain_graph=True)
            for i, (a, b, p) in enumerate(zip(g, w, params)):
                # Phase 1 takes every reader of the block: zeros where one call has None.
                a = torch.zeros_like(p) if a is None else a
                b = torch.zeros_like(p) if b is None else b
                torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13, msg=f"read {j} grad {i}")


def test_a_block_begun_in_inference_mode_reads_later_with_grad():
    readers = make_readers(6)
    gen = torch.Generator().manual_seed(6)
    emb = torch.randn(4, D, generator=gen, dtype=torch.float64)
    outs = [torch.randn(4, D, generator=gen, dtype=torch.float64) for _ in range(5)]
    stream = attnres.DepthStream(emb, block_size=3, block_reads="two_phase", readers=readers)
    for j in range(3):
        readers[j](stream)
        stream.append(outs[j])
    with torch.inference_mode():
        readers[3](stream)  # phase 1 of the second block, without a graph
    stream.append(outs[3])
    h = readers[4](stream)
    assert h.requires_grad
    h.pow(2).sum().backward()
    assert readers[4].query.grad.abs().sum() > 0


def test_inference_mode_and_no_grad_reads_of_one_block():
    """Phase 1 under inference_mode, later reads under no_grad (its partials
    cannot be written outside inference mode: merged out of place), and the
    other way round."""
    readers = make_readers(6)
    gen = torch.Generator().manual_seed(7)
    emb = torch.randn(4, D, generator=gen, dtype=torch.float64)
    outs = [torch.randn(4, D, generator=gen, dtype=torch.float64) for _ in range(5)]
    want = one_call_reads(readers, emb, outs)
    for first, later in ((torch.inference_mode, torch.no_grad), (torch.no_grad, torch.inference_mode)):
        stream = attnres.DepthStream(emb, block_size=3, block_reads="two_phase", readers=readers)
        for j, r in enumerate(readers):
            with (first if j % 3 == 0 else later)():
                torch.testing.assert_close(r(stream), want[j], rtol=1e-12, atol=1e-14)
            if j < len(outs):
                stream.append(outs[j])


def test_an_empty_readers_list_declares_nothing():
    emb = torch.randn(3, D)
    assert attnres.DepthStream(emb, block_size=2, readers=[]).readers is None
    with pytest.raises(ValueError, match="block_reads='two_phase' needs the stream's readers"):
        attnres.DepthStream(emb, block_size=2, block_reads="two_phase", readers=[])


def test_vmap_of_a_model_with_declared_readers(monkeypatch):
    """Two-phase reads under vmap, with grad and under no_grad (whose merges
    write in place, per batch element)."""
    readers = make_readers(7)
    gen = torch.Generator().manual_seed(8)
    B = 3
    emb = torch.randn(B, 4, D, generator=gen, dtype=torch.float64)
    outs = [torch.randn(B, 4, D, generator=gen, dtype=torch.float64) for _ in range(6)]

    def model(e, *o, declared=True):
        stream = attnres.DepthStream(e, block_size=3, block_reads="two_phase" if declared else "auto",
                                     readers=readers if declared else None)
        hs = []
        for j, r in enumerate(readers):
            hs.append(r(stream))
            if j < len(o):
                stream.append(o[j])
        return torch.stack(hs)

    want = torch.stack([model(emb[b], *(o[b] for o in outs), declared=False) for b in range(B)])
    calls = Calls(monkeypatch)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            got = torch.vmap(model)(emb, *outs)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert calls.merge > 0


# ---- checkpointing ----------------------------------------------------------------------------


class Layer(torch.nn.Module):
    """A layer of the documented contract: takes a stream, returns a new one."""

    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.res = attnres.AttnResResidual(D, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.randn(D, D, generator=gen, dtype=torch.float64) / D ** 0.5)
        with torch.no_grad():
            self.res.query.normal_(generator=gen)

    def forward(self, stream):
        stream = stream.clone()
        stream.append(torch.tanh(self.res(stream) @ self.w))
        return stream


def run_layers(layers, final, emb, block_size, wrap):
    stream = attnres.DepthStream(emb, block_size=block_size,
                                 readers=[*(l.res for l in layers), final])
    for layer in layers:
        stream = wrap(layer, stream)
    return final(stream)


@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize("kind", ["non-reentrant", "reentrant"])
def test_attnres_checkpoint_gives_every_parameter_its_gradient(kind, block_size):
    layers = [Layer(s) for s in range(5)]
    final = attnres.AttnResResidual(D, dtype=torch.float64)
    emb = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    params = [emb, *[p for m in (*layers, final) for p in m.parameters()]]

    def grads(wrap):
        for p in params:
            p.grad = None
        run_layers(layers, final, emb, block_size, wrap).pow(2).sum().backward()
        return [p.grad for p in params]

    want = grads(lambda l, s: l(s))
    reentrant = kind == "reentrant"
    got = grads(lambda l, s: attnres.checkpoint(l, s, use_reentrant=reentrant))
    # A layer that rebuilds the stream through the pytree (as hooks do).
    rebuilt = grads(lambda l, s: attnres.checkpoint(lambda x: l(pytree.tree_map(lambda t: t.to(t.dtype), x)),
                                                    s, use_reentrant=reentrant))
    for a, b in zip(rebuilt, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"grad {i}")



@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize("kind", ["non-reentrant", "reentrant"])
def test_attnres_checkpoint_under_torch_compile(kind, block_size):
    """Dynamo's checkpoint region takes and returns tensors only: the stream
    crosses it as its tensors, in one graph, with the eager gradients."""
    torch._dynamo.reset()
    layers = [Layer(s) for s in range(5)]
    final = attnres.AttnResResidual(D, dtype=torch.float64)
    emb = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    params = [emb, *[p for m in (*layers, final) for p in m.parameters()]]
    reentrant = kind == "reentrant"

    def step(wrap):
        return run_layers(layers, final, emb, block_size, wrap).pow(2).sum()

    def grads(run):
        for p in params:
            p.grad = None
        run().backward()
        return [p.grad for p in params]

    want = grads(lambda: step(lambda l, s: l(s)))
    compiled = torch.compile(lambda: step(lambda l, s: attnres.checkpoint(l, s, use_reentrant=reentrant)),
                             backend="aot_eager", fullgraph=True)
    for i, (a, b) in enumerate(zip(grads(compiled), want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"grad {i}")
    with pytest.raises(Exception, match="fn must return one DepthStream"):
        torch.compile(lambda: attnres.checkpoint(lambda s: layers[0].res(s), attnres.DepthStream(emb)),
                      backend="aot_eager", fullgraph=True)()

def test_a_no_grad_layer_between_checkpointed_layers():
    """A frozen layer that starts a block (its phase 1 made under no_grad) must
    not drop the phase-1 results that checkpointed layers recompute from."""
    layers = [Layer(s) for s in range(6)]
    final = attnres.AttnResResidual(D, dtype=torch.float64)
    emb = torch.randn(4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def grads(checkpointed):
        e = emb.clone().requires_grad_()
        stream = attnres.DepthStream(e, block_size=3, block_reads="two_phase",
                                     readers=[*(l.res for l in layers), final])
        for i, layer in enumerate(layers):
            if i == 3:
                with torch.no_grad():
                    stream = layer(stream)
            elif checkpointed:
                stream = attnres.checkpoint(layer, stream)
            else:
                stream = layer(stream)
        final(stream).pow(2).sum().backward()
        return e.grad

    torch.testing.assert_close(grads(True), grads(False), rtol=1e-12, atol=1e-14)


def test_plain_reentrant_checkpoint_of_a_stream_layer_raises():
    """torch.utils.checkpoint(..., use_reentrant=True) gives gradients only to
    top-level tensor arguments: a stream's sources would get none."""
    layers = [Layer(s) for s in range(2)]
    final = attnres.AttnResResidual(D, dtype=torch.float64)
    emb = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=re.escape(
            "a DepthStream read inside torch.utils.checkpoint(..., use_reentrant=True)")):
        run_layers(layers, final, emb, 2, lambda l, s: checkpoint(l, s, use_reentrant=True))
    # Without anything that needs a gradient nothing is lost: no error.
    with torch.no_grad():
        run_layers(layers, final, emb.detach(), 2, lambda l, s: checkpoint(l, s, use_reentrant=True))
    # A function of the stream's tensors (the flat form) gives them their
    # gradients: no error, the same gradients.
    spec = attnres.StreamSpec(block_size=2, num_outputs=1, block_reads="auto", readers=None)

    def stage(*tensors):
        return final(attnres.DepthStream.unflatten(tensors, spec))

    checkpoint(stage, emb, torch.tanh(emb), use_reentrant=True).pow(2).sum().backward()
    got, emb.grad = emb.grad, None  # (no autograd.grad() with that form)
    stage(emb, torch.tanh(emb)).pow(2).sum().backward()
    torch.testing.assert_close(got, emb.grad, rtol=1e-12, atol=1e-14)


# ---- torch.compile ------------------------------------------------------------------------------


def test_compiled_block_gpt_step_never_recompiles():
    """The path of every read is fixed by the configuration and the inputs,
    so nothing in a guard changes between steps."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import make_boxed_func

    traced_ops = []

    def record(gm, _inputs):
        traced_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_layers=4, n_heads=2, residual="block",
                    block_size=2, block_reads="auto")
    model = GPT(cfg)
    randomize_reads(model)
    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=record))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        idx = torch.randint(0, 32, (2, 8), generator=gen)
        opt.zero_grad(set_to_none=True)
        compiled(idx, idx)[1].backward()
        opt.step()
    # Traced through the two-phase ops (blocks 3 and 4 under "auto").
    assert any("block_reads_fwd" in t for t in traced_ops), sorted(set(traced_ops))
    assert any("block_read_merge_fwd" in t for t in traced_ops), sorted(set(traced_ops))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])
