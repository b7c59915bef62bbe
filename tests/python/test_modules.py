"""DepthStream / AttnResResidual: the block rule, agreement with a network
written by hand on attnres.reference, and the errors for bad input."""
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import attnres
from attnres import AttnResResidual, DepthStream
from attnres import reference
from helpers import GRAD_REL_TOL, REL_TOL, rel_err

N_SUB = 11
D_BASIS = N_SUB + 1

# Which outputs each visible source holds after all 11 sublayers, written out
# by hand from docs/design.md §1 (0 is the embedding, j the output of sublayer j).
EXPECTED_AFTER_11 = {
    None: [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11]],
    1: [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11]],
    2: [[0], [1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11]],
    3: [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11]],
    5: [[0], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11]],
}


def _expected_groups(block_size, n_outputs):
    """Independent statement of the rule: the embedding, then the outputs
    1..n cut into consecutive chunks of S (Full: chunks of one); the last
    chunk may be short (the partial sum) and an empty one is not listed."""
    step = 1 if block_size is None else block_size
    outputs = list(range(1, n_outputs + 1))
    return [[0]] + [outputs[i : i + step] for i in range(0, n_outputs, step)]


def _basis_outputs(device):
    # Row r of source j is (j + 1) * (r + 1) * basis_j: every sum of distinct
    # outputs is a distinct tensor, and all sums are exact in float32.
    rows = torch.arange(1, 4, dtype=torch.float32, device=device).view(3, 1)
    eye = torch.eye(D_BASIS, device=device)
    return [(j + 1) * rows * eye[j] for j in range(D_BASIS)]


def _as_tensors(groups, basis):
    return [sum(basis[j] for j in group) for group in groups]


@pytest.mark.parametrize("block_size", [None, 1, 2, 3, 5])
def test_sources_follow_the_block_rule(block_size, device):
    basis = _basis_outputs(device)
    stream = DepthStream(basis[0], block_size=block_size)
    assert [s.tolist() for s in stream.sources] == [basis[0].tolist()]
    for j in range(1, N_SUB + 1):
        stream.append(basis[j])
        expected = _as_tensors(_expected_groups(block_size, j), basis)
        got = stream.sources
        assert len(got) == len(expected), f"after {j} outputs"
        for k, (g, e) in enumerate(zip(got, expected)):
            assert torch.equal(g, e), f"source {k} after {j} outputs"
        assert stream.num_sources == len(expected)
        assert stream.num_outputs == j
    final = _as_tensors(EXPECTED_AFTER_11[block_size], basis)
    assert len(stream.sources) == len(final)
    for g, e in zip(stream.sources, final):
        assert torch.equal(g, e)


def test_full_keeps_the_appended_tensors_themselves():
    emb = torch.randn(2, 4)
    outs = [torch.randn(2, 4) for _ in range(3)]
    stream = DepthStream(emb)
    for f in outs:
        stream.append(f)
    assert all(a is b for a, b in zip(stream.sources, [emb, *outs]))


def test_sources_is_a_fresh_list():
    stream = DepthStream(torch.randn(2, 4), block_size=2)
    stream.append(torch.randn(2, 4))
    listed = stream.sources
    listed.append(torch.randn(2, 4))
    assert stream.num_sources == 2 and len(stream.sources) == 2


def test_clone_is_independent_of_the_original():
    stream = DepthStream(torch.randn(2, 4), block_size=2)
    stream.append(torch.randn(2, 4))
    before = stream.sources
    copy = stream.clone()
    copy.append(torch.randn(2, 4))
    copy.append(torch.randn(2, 4))
    assert copy.num_sources == 3
    assert len(stream.sources) == 2
    assert all(a is b for a, b in zip(stream.sources, before))


# ---- a small network: modules vs hand-written reference ---------------------

D = 8
DEPTH = 7  # sublayers; 2 and 3 do not divide it


class TinyNet(nn.Module):
    """DEPTH sublayers f_l = tanh(W_l norm(h_l)), each read through its own
    AttnResResidual, plus the final read."""

    def __init__(self, block_size, dtype=torch.float64, device="cpu"):
        super().__init__()
        self.block_size = block_size
        self.layers = nn.ModuleList(nn.Linear(D, D, dtype=dtype, device=device) for _ in range(DEPTH))
        self.reads = nn.ModuleList(
            AttnResResidual(D, dtype=dtype, device=device) for _ in range(DEPTH + 1)
        )
        with torch.no_grad():  # non-trivial queries and gains
            for r in self.reads:
                r.query.normal_(0.0, 1.0)
                r.norm_weight.uniform_(0.5, 1.5)

    def sublayer(self, l, h):
        return torch.tanh(self.layers[l](nn.functional.rms_norm(h, (D,))))

    def forward(self, emb):
        stream = DepthStream(emb, block_size=self.block_size)
        for l in range(DEPTH):
            stream.append(self.sublayer(l, self.reads[l](stream)))
        return self.reads[DEPTH](stream)

    def forward_reference(self, emb):
        """Same network with the sources tracked by hand and read through
        attnres.reference (no DepthStream, no fused op)."""
        S = self.block_size or 1
        completed, partial, in_partial = [emb], None, 0

        def read(r):
            srcs = completed + ([partial] if partial is not None else [])
            return reference.depth_attention(srcs, r.query, r.norm_weight, eps=r.eps)

        for l in range(DEPTH):
            f = self.sublayer(l, read(self.reads[l]))
            partial = f if partial is None else partial + f
            in_partial += 1
            if in_partial == S:
                completed, partial, in_partial = completed + [partial], None, 0
        return read(self.reads[DEPTH])


def _grads(net, emb):
    return [emb.grad] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("block_size", [None, 1, 2, 3])
def test_network_matches_reference(block_size, device):
    torch.manual_seed(0)
    net = TinyNet(block_size, device=device)
    emb = torch.randn(3, 5, D, dtype=torch.float64, device=device, requires_grad=True)
    grad_out = torch.randn(3, 5, D, dtype=torch.float64, device=device)

    out = net(emb)
    out.backward(grad_out)
    grads = [g.clone() for g in _grads(net, emb)]
    net.zero_grad()
    emb.grad = None

    ref = net.forward_reference(emb)
    ref.backward(grad_out)
    ref_grads = _grads(net, emb)

    assert rel_err(out, ref) <= REL_TOL[torch.float64]
    assert len(grads) == len(ref_grads) == 1 + 2 * DEPTH + 2 * (DEPTH + 1)
    # The first read has one source (the embedding): its weight is 1 whatever
    # the query, so its query and gain gradients are exactly zero.
    first_read = {id(p) for p in net.reads[0].parameters()}
    params = [emb] + list(net.parameters())
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g is not None and r is not None, f"gradient {i} missing"
        if id(params[i]) in first_read:
            assert torch.count_nonzero(g) == 0 and torch.count_nonzero(r) == 0
            continue
        assert r.abs().max().item() > 0, f"gradient {i} is zero: test would be trivial"
        err = rel_err(g, r)
        assert err <= GRAD_REL_TOL[torch.float64], f"gradient {i}: relative error {err:.3g}"


def test_block_size_one_equals_full():
    torch.manual_seed(0)
    full = TinyNet(None)
    block = TinyNet(1)
    block.load_state_dict(full.state_dict())
    emb = torch.randn(4, D, dtype=torch.float64)
    grad_out = torch.randn(4, D, dtype=torch.float64)
    outs, grads = [], []
    for net in (full, block):
        e = emb.clone().requires_grad_(True)
        out = net(e)
        out.backward(grad_out)
        outs.append(out)
        grads.append(_grads(net, e))
    assert torch.equal(outs[0], outs[1])
    for g_full, g_block in zip(*grads):
        assert torch.equal(g_full, g_block)


def test_block_rule_when_block_size_does_not_divide_depth():
    # 7 sublayers, S = 3: the final read sees e, f1+f2+f3, f4+f5+f6, f7.
    torch.manual_seed(1)
    emb = torch.randn(2, 3, D, dtype=torch.float64)
    outs = [torch.randn(2, 3, D, dtype=torch.float64) for _ in range(DEPTH)]
    stream = DepthStream(emb, block_size=3)
    for f in outs:
        stream.append(f)
    read = AttnResResidual(D, dtype=torch.float64)
    with torch.no_grad():
        read.query.normal_()
        read.norm_weight.uniform_(0.5, 1.5)
    expected_sources = [emb, outs[0] + outs[1] + outs[2], outs[3] + outs[4] + outs[5], outs[6]]
    ref = reference.depth_attention(expected_sources, read.query, read.norm_weight)
    got = read(stream)
    assert stream.num_sources == 4
    assert rel_err(got, ref) <= REL_TOL[torch.float64]


@pytest.mark.parametrize("block_size", [None, 2])
def test_zero_query_reads_the_mean_of_the_sources(block_size, device):
    torch.manual_seed(2)
    stream = DepthStream(torch.randn(4, 6, D, device=device), block_size=block_size)
    for _ in range(5):
        stream.append(torch.randn(4, 6, D, device=device))
    read = AttnResResidual(D, device=device)
    assert torch.count_nonzero(read.query) == 0
    assert torch.equal(read.norm_weight, torch.ones(D, device=device))
    expected = torch.stack(stream.sources).mean(0)
    got = read(stream)
    assert rel_err(got, expected) <= REL_TOL[torch.float32]


def test_worked_example_from_the_design():
    """The worked example (docs/design.md §1), read through the modules."""
    e = torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64)
    stream = DepthStream(e)
    stream.append(torch.tensor([0.0, 4.0, 0.0], dtype=torch.float64))
    stream.append(torch.tensor([0.0, 0.0, 6.0], dtype=torch.float64))
    read = AttnResResidual(3, eps=0.0, dtype=torch.float64)
    with torch.no_grad():
        read.query.copy_(torch.tensor([0.0, math.log(2) / math.sqrt(3), 0.0]))
    h, weights = read(stream, return_weights=True)
    assert torch.allclose(weights, torch.tensor([0.25, 0.5, 0.25]), atol=1e-12)
    assert torch.allclose(h, torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64), atol=1e-12)


def test_width_is_the_last_dimension():
    stream = DepthStream(torch.randn(2, 5, D), block_size=2)
    assert stream.width == D
    assert stream.shape == (2, 5, D)


def test_dim_is_a_deprecated_alias_of_width():
    stream = DepthStream(torch.randn(2, 5, D))
    with pytest.warns(DeprecationWarning, match=r"DepthStream\.dim is deprecated; use DepthStream\.width"):
        dim = stream.dim
    assert dim == stream.width == D


def test_return_weights_shape_and_sum():
    torch.manual_seed(3)
    stream = DepthStream(torch.randn(2, 5, D), block_size=3)
    for _ in range(4):
        stream.append(torch.randn(2, 5, D))
    read = AttnResResidual(D)
    with torch.no_grad():
        read.query.normal_()
    h, w = read(stream, return_weights=True)
    assert w.shape == (3, 2, 5) and w.dtype == torch.float32
    assert torch.allclose(w.sum(0), torch.ones(2, 5), atol=1e-6)
    assert torch.allclose(h, (w.unsqueeze(-1) * torch.stack(stream.sources)).sum(0), atol=1e-5)


def test_no_gain_when_key_norm_affine_is_false():
    torch.manual_seed(4)
    read = AttnResResidual(D, key_norm_affine=False)
    assert read.norm_weight is None
    assert [n for n, _ in read.named_parameters()] == ["query"]
    with torch.no_grad():
        read.query.normal_()
    stream = DepthStream(torch.randn(3, D))
    stream.append(torch.randn(3, D))
    ref = reference.depth_attention(stream.sources, read.query, None)
    assert rel_err(read(stream), ref) <= REL_TOL[torch.float32]


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_read_uses_the_fused_op_on_the_list_without_stacking():
    torch.manual_seed(5)
    stream = DepthStream(torch.randn(2, D), block_size=2)
    for _ in range(3):
        stream.append(torch.randn(2, D))
    read = AttnResResidual(D)
    with _OpRecorder() as rec:
        read(stream)
    assert "attnres.depth_attention_fwd" in rec.ops
    assert not {"aten.stack", "aten.cat"} & set(rec.ops), rec.ops


# ---- autocast dtype rule ------------------------------------------------------


def test_autocast_outputs_are_cast_to_the_stream_dtype():
    torch.manual_seed(6)
    emb = torch.randn(3, D)
    lin = nn.Linear(D, D)
    stream = DepthStream(emb, block_size=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f = lin(emb)
        assert f.dtype == torch.bfloat16
        stream.append(f)
        stream.append(f)
        h = AttnResResidual(D)(stream)
    assert all(s.dtype == torch.float32 for s in stream.sources)
    assert torch.equal(stream.sources[1], f.float() + f.float())
    assert h.dtype == torch.float32


def test_bf16_stream_keeps_bf16_with_fp32_query():
    torch.manual_seed(7)
    stream = DepthStream(torch.randn(3, D, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stream.append(nn.Linear(D, D)(torch.randn(3, D)))
    read = AttnResResidual(D)  # fp32 query and gain
    h = read(stream)
    assert h.dtype == torch.bfloat16
    ref = reference.depth_attention(stream.sources, read.query, read.norm_weight)
    assert rel_err(h, ref) <= REL_TOL[torch.bfloat16]


# ---- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3])
def test_block_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="block_size must be None .* or a positive int"):
        DepthStream(torch.randn(2, D), block_size=bad)


@pytest.mark.parametrize("bad", [2.0, "2", True])
def test_block_size_must_be_an_int(bad):
    with pytest.raises(TypeError, match="block_size must be None .* got (float|str|bool)"):
        DepthStream(torch.randn(2, D), block_size=bad)


def test_append_of_another_shape_is_an_error():
    stream = DepthStream(torch.randn(2, D))
    with pytest.raises(ValueError, match=r"output has shape \[2, 9\] .* shape \[2, 8\]"):
        stream.append(torch.randn(2, D + 1))
    with pytest.raises(ValueError, match=r"output has shape \[1, 2, 8\]"):
        stream.append(torch.randn(1, 2, D))


def test_append_of_another_dtype_outside_autocast_is_an_error():
    stream = DepthStream(torch.randn(2, D))
    with pytest.raises(TypeError, match="output has dtype torch.float64 but the stream's dtype"):
        stream.append(torch.randn(2, D, dtype=torch.float64))
    with pytest.raises(TypeError, match="output has dtype torch.bfloat16"):
        stream.append(torch.randn(2, D, dtype=torch.bfloat16))
    assert stream.num_outputs == 0


def test_append_on_another_device_is_an_error():
    stream = DepthStream(torch.randn(2, D))
    with pytest.raises(ValueError, match="output is on device meta but the stream is on device cpu"):
        stream.append(torch.empty(2, D, device="meta"))


def test_append_of_a_non_tensor_is_an_error():
    stream = DepthStream(torch.randn(2, D))
    with pytest.raises(TypeError, match="expects a tensor, got list"):
        stream.append([0.0] * D)


def test_bad_embedding_is_an_error():
    with pytest.raises(TypeError, match="embedding must be a tensor"):
        DepthStream([1.0, 2.0])
    with pytest.raises(ValueError, match="D > 0"):
        DepthStream(torch.randn(2, 0))
    with pytest.raises(TypeError, match="floating-point"):
        DepthStream(torch.ones(2, D, dtype=torch.long))


def test_residual_of_another_width_is_an_error():
    stream = DepthStream(torch.randn(2, D))
    with pytest.raises(ValueError, match=r"AttnResResidual has width dim = 16 but the DepthStream has width D = 8"):
        AttnResResidual(2 * D)(stream)


def test_residual_needs_a_stream():
    with pytest.raises(TypeError, match="expects an attnres.DepthStream, got Tensor"):
        AttnResResidual(D)(torch.randn(2, D))


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_residual_dim_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="dim must be a positive int"):
        AttnResResidual(bad)


def test_residual_eps_must_be_non_negative():
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        AttnResResidual(D, eps=-1e-6)


def test_public_names():
    assert attnres.DepthStream is DepthStream
    assert attnres.AttnResResidual is AttnResResidual
    assert attnres.models.GPT is not None
