"""The example GPT in Kimi K3's configuration (Block AttnRes with the block
size counted in layers, RMSNorm pre-norms fused into the reads, the final
read over the blocks) against an independent eager implementation of the
Block AttnRes residual rules written from their definition (the paper's
Eq. 8-10), sharing only the model's weights and eps settings:

* b_0 is the embedding; b_n is the sum of the outputs of block n (S
  sublayers: 2 per layer);
* the read in front of a sublayer is a softmax over [b_0, ..., b_{n-1}] and,
  once the current block holds an output, its partial sum; each score is the
  read's pseudo-query dotted with the RMS-normalized source times its key
  gain; the read is the weighted sum of the sources, then the sublayer's
  RMSNorm (here fused into the read: its gain is the read's out_weight);
* the final read is over every completed block (and the last partial sum),
  then the final norm and the head.

No DepthStream, attnres op or reference helper is used on the eager side."""
import pytest
import torch

from attnres.models import GPT, GPTConfig


def rms_normalized(v, eps):
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def eager_read(res, sources):
    v = torch.stack(sources)  # [N, B, T, D]
    keys = rms_normalized(v, res.eps) * res.norm_weight
    a = torch.softmax((keys * res.query).sum(-1), dim=0)
    h = (a.unsqueeze(-1) * v).sum(0)
    return rms_normalized(h, res.out_eps) * res.out_weight


def eager_k3_forward(model, idx, layers_per_block):
    S = 2 * layers_per_block
    blocks = [model.embed(idx)]  # b_0
    partial, held = None, 0  # the current block's sum, and how many outputs it holds
    for blk in model.blocks:
        for res, sublayer in ((blk.res_attn, blk.attn), (blk.res_mlp, blk.mlp)):
            h = eager_read(res, blocks + ([partial] if held else []))
            f = sublayer(h)
            partial, held = (f, 1) if held == 0 else (partial + f, held + 1)
            if held == S:  # block n complete: b_n joins the sources
                blocks.append(partial)
                partial, held = None, 0
    h = eager_read(model.final_res, blocks + ([partial] if held else []))
    return model.head(model.ln_f(h))


@pytest.mark.parametrize("n_layers,layers_per_block", [(4, 2), (5, 2), (3, 1), (4, 4)],
                         ids=["2-blocks", "ends-mid-block", "1-layer-blocks", "1-block"])
@pytest.mark.parametrize("block_reads", ["one_call", "two_phase"])
def test_k3_style_gpt_matches_the_residual_rules(n_layers, layers_per_block, block_reads):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, seq_len=16, d_model=64, n_layers=n_layers, n_heads=4,
                    residual="block", block_layers=layers_per_block, norm="rmsnorm",
                    block_reads=block_reads)
    assert cfg.block_size == 2 * layers_per_block and cfg.fused_norm
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # away from the init, where every read is a plain mean
        for r in model.readers():
            r.query.normal_(0, 0.5)
            r.norm_weight.uniform_(0.5, 1.5)
            r.out_weight.uniform_(0.5, 1.5)
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    want = eager_k3_forward(model, idx, layers_per_block)
    logits, _ = model(idx)
    torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)
    # The rules have power: counting the block in sublayers instead of layers
    # (S = layers_per_block) gives another function.
    other = eager_k3_forward(model, idx, max(layers_per_block // 2, 1)) if layers_per_block > 1 \
        else None
    if other is not None:
        assert (other - want).abs().max() > 1e-6


def test_block_layers_is_block_size_in_layers():
    assert GPTConfig(residual="block", block_layers=12).block_size == 24
    assert GPTConfig(residual="block", block_layers=3, block_size=6).block_size == 6
    with pytest.raises(ValueError, match="block_layers"):
        GPTConfig(residual="block", block_layers=2, block_size=6)
    with pytest.raises(ValueError, match="block_layers"):
        GPTConfig(residual="full", block_layers=2)
    with pytest.raises(ValueError, match="block_layers"):
        GPTConfig(residual="block", block_layers=0)
