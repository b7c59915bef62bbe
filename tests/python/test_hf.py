"""attnres.hf.convert on tiny random transformers decoders: the converted model
computes the original function (logits with padding, the loss with labels,
KV-cached greedy generation, hidden states), trains on the fused reads, and
families it cannot convert exactly are refused."""
import pytest
import torch

import attnres
import attnres.modules as modules_mod

transformers = pytest.importorskip(
    "transformers", reason="attnres.hf needs transformers (pip install 'attnres[hf]'; make test installs it)")
from attnres import hf  # noqa: E402

VOCAB = 97  # odd
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig, LLAMA_LIKE),
    "mistral": (transformers.MistralConfig, LLAMA_LIKE),
    "qwen2": (transformers.Qwen2Config, LLAMA_LIKE),
    "qwen3": (transformers.Qwen3Config, LLAMA_LIKE),
    "gemma": (transformers.GemmaConfig, LLAMA_LIKE),
    "gemma2": (transformers.Gemma2Config, LLAMA_LIKE),
    "gemma3": (transformers.Gemma3TextConfig, LLAMA_LIKE),
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_head=4, n_positions=64)),
}


def tiny(family, dtype, layers=3, seed=0):
    torch.manual_seed(seed)
    config_class, kw = FAMILIES[family]
    layer_key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    cfg = config_class(vocab_size=VOCAB, **{layer_key: layers}, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():  # norm gains away from their init, so the converted norms' gains matter
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight") and ("norm" in name or ".ln" in name):
                p.uniform_(0.5, 1.5)
    return model


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return idx, mask


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# transformers' RMSNorm computes in float32 whatever the model dtype, so the
# original and the converted model each round there: float64 models as shipped
# agree to float32 rounding (test_conversion_is_exact_in_float64 removes that
# cast and asserts 1e-12).
TOL = {torch.float32: 1e-5, torch.float64: 1e-6}


@pytest.mark.parametrize("block", [None, 2, 3, "layers=1"], ids=["full", "S2", "S3", "K3-style"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_model_computes_the_original_function(family, block):
    dtype = torch.float32
    model = tiny(family, dtype)
    idx, mask = batch()
    with torch.no_grad():
        want = model(idx, attention_mask=mask, labels=idx, output_hidden_states=True)
        want_tokens = model.generate(idx, attention_mask=mask, max_new_tokens=20, do_sample=False)
        want_unmasked = model(idx[:1]).logits  # no attention mask at all
        want_unmasked_tokens = model.generate(idx[:1], max_new_tokens=20, do_sample=False)
    kw = dict(block_layers=1) if block == "layers=1" else dict(block_size=block)
    assert hf.convert(model, **kw) is model
    with torch.no_grad():
        got = model(idx, attention_mask=mask, labels=idx, output_hidden_states=True)
        tokens = model.generate(idx, attention_mask=mask, max_new_tokens=20, do_sample=False)
        assert rel(model(idx[:1]).logits, want_unmasked) < TOL[dtype]
        assert torch.equal(model.generate(idx[:1], max_new_tokens=20, do_sample=False), want_unmasked_tokens)
    assert rel(got.logits, want.logits) < TOL[dtype]
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=TOL[dtype])
    assert torch.equal(tokens, want_tokens)  # KV-cached greedy decoding, token for token
    assert len(got.hidden_states) == len(want.hidden_states)
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert isinstance(a, torch.Tensor)  # the residual stream, as the API promises
        assert rel(a, b) < TOL[dtype]
    # The comparison has power: a non-zero query changes the function.
    with torch.no_grad():
        hf._base_model(model).get_submodule(
            "h.1" if family == "gpt2" else "layers.1").attnres_mlp.query.normal_()
        assert rel(model(idx, attention_mask=mask).logits, want.logits) > 1e-3


@pytest.mark.parametrize("block_size", [None, 2], ids=["full", "S2"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_pre_norms_compute_the_original_function(family, block_size):
    """out_norm='rmsnorm': every pre-norm (and the final norm) moves into its
    read; the gains are the same Parameters, in the optimizer's norm group."""
    model = tiny(family, torch.float32)
    idx, mask = batch()
    gains = {id(p) for n, p in model.named_parameters()
             if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight"))}
    with torch.no_grad():
        want = model(idx, attention_mask=mask).logits
        want_tokens = model.generate(idx, attention_mask=mask, max_new_tokens=20, do_sample=False)
        hf.convert(model, block_size=block_size, out_norm="rmsnorm")
        assert rel(model(idx, attention_mask=mask).logits, want) < TOL[torch.float32]
        assert torch.equal(model.generate(idx, attention_mask=mask, max_new_tokens=20, do_sample=False),
                           want_tokens)
    base = model.model
    assert isinstance(base.norm, torch.nn.Identity) and isinstance(base.layers[0].input_layernorm,
                                                                   torch.nn.Identity)
    assert {id(r.out_weight) for r in base.modules() if isinstance(r, attnres.AttnResResidual)} == gains
    groups = {g["name"]: {id(p) for p in g["params"]} for g in attnres.param_groups(model, lr=1.0,
                                                                                    weight_decay=0.1)}
    assert gains <= groups["no_decay"] and not gains & groups["attnres"]


def _float64_rmsnorm(self, x):
    """transformers' RMSNorm forward without its float32 cast (the same formula
    in the input's dtype; Gemma's is (1 + w) * norm(x))."""
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1 + self.weight) if type(self).__name__.startswith("Gemma") else self.weight * y


@pytest.mark.parametrize("kw", [dict(), dict(block_size=2), dict(block_size=3), dict(block_layers=1),
                                dict(block_size=2, out_norm="rmsnorm")],
                         ids=["full", "S2", "S3", "K3-style", "S2-fused-norms"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_conversion_is_exact_in_float64(family, kw, monkeypatch):
    """The conversion itself is exact: with every norm computing in float64
    (a test-only patch of the RMSNorm classes' float32 cast, on both models;
    GPT-2's LayerNorm needs none) the converted model's logits, hidden states,
    loss and greedy tokens equal the original's to float64 rounding."""
    if kw.get("out_norm") and family in ("gemma", "gemma2", "gemma3", "gpt2"):
        pytest.skip("out_norm='rmsnorm' is refused for (1 + w) norms and LayerNorm (test_refusals)")
    model = tiny(family, torch.float64)
    for cls in {type(m) for m in model.modules() if type(m).__name__.endswith("RMSNorm")}:
        monkeypatch.setattr(cls, "forward", _float64_rmsnorm)
    idx, mask = batch()
    if family == "gemma2":  # its eager attention turns a fully masked float64 row into NaN
        mask = torch.ones_like(mask)
    keep = mask.bool()
    with torch.no_grad():
        want = model(idx, attention_mask=mask, labels=idx, output_hidden_states=True)
        want_tokens = model.generate(idx, attention_mask=mask, max_new_tokens=20, do_sample=False)
        hf.convert(model, **kw)
        got = model(idx, attention_mask=mask, labels=idx, output_hidden_states=True)
        tokens = model.generate(idx, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert rel(got.logits[keep], want.logits[keep]) <= 1e-12
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-12)
    assert torch.equal(tokens, want_tokens)
    for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
        assert rel(a[keep], b[keep]) <= 1e-12


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float64_models_agree_to_float32_rounding(family):
    """As people run them (transformers' RMSNorm computes in float32 in every
    dtype), float64 models agree to float32 rounding."""
    model = tiny(family, torch.float64)
    idx, mask = batch()
    with torch.no_grad():
        want = model(idx, attention_mask=mask).logits
        hf.convert(model, block_size=2)
        assert model.model.attnres_final.query.dtype == torch.float64
        assert rel(model(idx, attention_mask=mask).logits, want) < TOL[torch.float64]


def train_steps(model, lr, steps):
    """AdamW steps on one batch (param_groups); the losses."""
    opt = torch.optim.AdamW(attnres.param_groups(model, lr=lr, weight_decay=0.0))
    idx, mask = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(idx, attention_mask=mask, labels=idx).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_converted_llama_trains_on_the_fused_reads(monkeypatch):
    calls = []
    for name in ("depth_attention", "block_reads", "block_read_merge"):
        real = getattr(modules_mod, name)
        monkeypatch.setattr(modules_mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    model = hf.convert(tiny("llama", torch.float32, layers=4).train(), block_size=2)
    losses = train_steps(model, lr=3e-3, steps=8)
    assert losses[-1] < losses[0]
    assert "depth_attention" in calls
    assert model.model.layers[2].attnres_attn.query.grad.abs().sum() > 0


def test_refusals():
    torch.manual_seed(0)
    gptj = transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64))
    with pytest.raises(ValueError, match="cannot convert GPTJBlock exactly: attention and MLP run in parallel"):
        hf.convert(gptj)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96))
    with pytest.raises(ValueError, match="no decoder layer of a known PreNorm family"):
        hf.convert(bert)
    with pytest.raises(ValueError, match="GPT2Block's are not: convert it with out_norm=None"):
        hf.convert(tiny("gpt2", torch.float32), out_norm="rmsnorm")
    with pytest.raises(ValueError, match="GemmaDecoderLayer's are not"):
        hf.convert(tiny("gemma", torch.float32), out_norm="rmsnorm")
    with pytest.raises(ValueError, match="block_size .sublayers. or block_layers, not both"):
        hf.convert(tiny("llama", torch.float32), block_size=2, block_layers=1)
    model = hf.convert(tiny("llama", torch.float32))
    with pytest.raises(ValueError, match="already converted"):
        hf.convert(model)


def test_save_pretrained_and_from_pretrained_round_trip_bit_for_bit(tmp_path):
    model = hf.convert(tiny("qwen3", torch.float32), block_size=2, out_norm="rmsnorm")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attnres_" in name:
                p.normal_()
    idx, mask = batch()
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(tmp_path).eval()
    assert loaded.config.attnres == {"block_size": 2, "out_norm": "rmsnorm"}
    assert list(loaded.state_dict()) == list(model.state_dict())
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(loaded(idx, attention_mask=mask).logits, model(idx, attention_mask=mask).logits)
    plain = tiny("llama", torch.float32)
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="holds no converted model"):
        hf.from_pretrained(tmp_path / "plain")


def gradients(model, idx):
    model.zero_grad(set_to_none=True)
    model(idx, labels=idx).loss.backward()
    return {n.removeprefix("_orig_mod."): p.grad.clone()
            for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_and_compile_give_the_same_gradients():
    model = hf.convert(tiny("llama", torch.float32).train(), block_size=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attnres_" in name:
                p.normal_(0, 0.1)
    idx, _ = batch()
    want = gradients(model, idx)
    reads = []
    model.model.layers[1].attnres_attn.register_forward_hook(lambda *_: reads.append(1))
    model.activation_checkpointing_enable()
    got = gradients(model, idx)
    assert len(reads) == 2  # the layer ran again in backward: checkpointing is active
    model.activation_checkpointing_disable()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # no graph break anywhere
    got = gradients(compiled, idx)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_autocast_stays_close_to_float32():
    model = hf.convert(tiny("mistral", torch.float32), block_size=2)
    idx, mask = batch()
    with torch.no_grad():
        want = model(idx, attention_mask=mask).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(idx, attention_mask=mask).logits
    assert rel(got.float(), want) < 2e-2


def test_the_continued_training_example_starts_from_the_original_loss():
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "hf" / "continue_training.py"
    run = subprocess.run([sys.executable, str(example), "--steps", "2", "--every", "1", "--seq-len", "32",
                          "--block-size", "4"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    first = re.search(r"step +0: original (\S+)  attnres (\S+)", run.stdout)
    assert first, run.stdout
    assert float(first.group(2)) == pytest.approx(float(first.group(1)), rel=1e-5)


def _ddp_worker(rank, port, out_path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = hf.convert(tiny("qwen2", torch.float32).train(), block_size=2)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        idx, mask = batch()
        rows = slice(rank, rank + 1)
        ddp(idx[rows], attention_mask=mask[rows], labels=idx[rows]).loss.backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in model.named_parameters()}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_of_a_converted_model_matches_one_process(tmp_path):
    """2 gloo ranks, one sequence each: the averaged gradients are those of
    the mean of the two sequences' losses in one process."""
    import torch.multiprocessing as mp

    from helpers import distributed_skip_reason, free_port

    skip = distributed_skip_reason("torch.nn.parallel", "DistributedDataParallel")
    if skip:
        pytest.skip(skip)
    out_path = tmp_path / "grads.pt"
    mp.spawn(_ddp_worker, args=(free_port(), str(out_path)), nprocs=2)
    got = torch.load(out_path)
    model = hf.convert(tiny("qwen2", torch.float32).train(), block_size=2)
    idx, mask = batch()
    losses = [model(idx[r:r + 1], attention_mask=mask[r:r + 1], labels=idx[r:r + 1]).loss for r in range(2)]
    (sum(losses) / 2).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_converted_model_deepcopies_and_pickles():
    """Copies (EMA, averaged models, reference models) read with their own
    reads, and the run-time layer subclasses pickle through the original."""
    import copy
    import pickle

    for block_size in (None, 2):
        model = hf.convert(tiny("llama", torch.float32), block_size=block_size)
        idx, mask = batch()
        with torch.no_grad():
            want = model(idx, attention_mask=mask).logits
            twin = copy.deepcopy(model)
            thawed = pickle.loads(pickle.dumps(model))
            for other in (twin, thawed):
                assert type(other.model.layers[0]) is type(model.model.layers[0])
                assert torch.equal(other(idx, attention_mask=mask).logits, want)
            model.model.attnres_final.query.normal_()  # the copies have reads of their own
            assert torch.equal(twin(idx, attention_mask=mask).logits, want)
    names = model._no_split_modules
    assert "LlamaDecoderLayer" in names and "AttnResLlamaDecoderLayer" in names


def test_tuple_outputs_and_dtypes():
    model = hf.convert(tiny("qwen2", torch.float32), block_size=2)
    idx, mask = batch()
    with torch.no_grad():
        states = model.model(idx, attention_mask=mask, output_hidden_states=True, return_dict=False)[-1]
    assert all(isinstance(s, torch.Tensor) for s in states)
    with pytest.raises(ValueError, match="leave dtype=None"):
        hf.convert(tiny("llama", torch.float32), out_norm="rmsnorm", dtype=torch.float64)
    with pytest.raises(ValueError, match="needs the stream's readers declared"):
        attnres.pipelining.StreamStage([], outputs_before=0, block_size=2, block_reads="two_phase")


def test_from_pretrained_in_another_dtype(tmp_path):
    model = hf.convert(tiny("llama", torch.bfloat16), block_size=2)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.model.attnres_final.query.dtype == torch.float32
    idx, mask = batch()
    with torch.no_grad():
        loaded(idx, attention_mask=mask)


def test_a_peft_lora_adapter_on_a_converted_model():
    """LoRA on the attention projections: at init the adapted model is the
    original function; the reads are frozen with the base model unless the
    user unfreezes them, and then they train with the adapter."""
    peft = pytest.importorskip("peft", reason="the LoRA test needs peft (make test installs it)")
    model = tiny("llama", torch.float32).train()
    idx, mask = batch()
    with torch.no_grad():
        want = model(idx, attention_mask=mask).logits
    hf.convert(model, block_size=2)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        assert rel(adapted(idx, attention_mask=mask).logits, want) < TOL[torch.float32]
    reads = [m for m in adapted.modules() if isinstance(m, attnres.AttnResResidual)]
    assert reads and not any(p.requires_grad for r in reads for p in r.parameters())
    for r in reads:  # the user's choice: train the reads too
        r.requires_grad_(True)
    losses = train_steps(adapted, lr=1e-2, steps=5)
    assert losses[-1] < losses[0]
    assert reads[3].query.grad.abs().sum() > 0
    assert all(p.grad is not None for n, p in adapted.named_parameters() if "lora_" in n)
