"""The example GPT and the demo: AttnRes with zero queries and unit gains is
the standard residual (same logits, same gradients, same training step);
the depth profile against a hand-written forward; the seed statistics; and
the command line end to end on a tiny configuration."""
import argparse
import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

import attnres
from attnres import demo
from attnres.__main__ import main as cli_main
from attnres.models import GPT, GPTConfig

ATTNRES = ["full", "block"]


def config(residual, **kw):
    # 3 layers = 6 sublayers; block size 4 does not divide them (a partial block at the end).
    base = dict(vocab_size=64, seq_len=16, d_model=24, n_layers=3, n_heads=2, residual=residual, block_size=4)
    return GPTConfig(**{**base, **kw})


def pair(residual, dtype, seed=0, **kw):
    """A standard model and an AttnRes model with the same shared parameters
    (zero queries, unit gains as initialised), both randomly perturbed so
    that no parameter is at a special value."""
    torch.manual_seed(seed)
    standard = GPT(config("standard", **kw)).to(dtype)
    with torch.no_grad():
        for p in standard.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other = GPT(config(residual, **kw)).to(dtype)
    result = other.load_state_dict(standard.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith((".query", ".norm_weight")) for k in result.missing_keys)
    return standard, other


def tokens(seed=1, batch=3, seq=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


# Relative error bounds: float64 shows the two are the same function (not
# merely close); float32 is the accumulated rounding of 6 sublayers.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("residual", ATTNRES)
def test_zero_queries_compute_the_standard_model(residual, dtype):
    standard, other = pair(residual, dtype)
    idx, _ = tokens()
    assert relative_error(other(idx)[0], standard(idx)[0]) < TOLERANCE[dtype]

    # The comparison has power: a non-zero query changes the function.
    with torch.no_grad():
        other.blocks[1].res_mlp.query.normal_()
    assert relative_error(other(idx)[0], standard(idx)[0]) > 1e3 * TOLERANCE[dtype]


@pytest.mark.parametrize("residual", ATTNRES)
def test_zero_queries_take_the_standard_training_step(residual):
    dtype = torch.float64
    standard, other = pair(residual, dtype)
    idx, targets = tokens()
    optimizers = [
        torch.optim.AdamW(attnres.param_groups(m, lr=1e-2, weight_decay=0.1, attnres_lr_scale=0.0))
        for m in (standard, other)
    ]
    losses = []
    for model, optimizer in zip((standard, other), optimizers):
        _, loss = model(idx, targets)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-13)
    shared = dict(standard.named_parameters())
    for name, p in other.named_parameters():
        if name in shared:
            assert relative_error(p.grad, shared[name].grad) < 1e-10, name
        else:  # the reads do learn: their gradients are not zero
            assert name.endswith((".query", ".norm_weight"))
    assert other.blocks[2].res_attn.query.grad.abs().max() > 0
    for optimizer in optimizers:
        optimizer.step()
    for name, p in other.named_parameters():
        if name in shared:
            assert relative_error(p, shared[name]) < 1e-10, name
    assert relative_error(other(idx)[0], standard(idx)[0]) < 1e-10


@pytest.mark.parametrize("residual,block_size", [("full", 4), ("block", 4), ("block", 1), ("block", 2)])
def test_sources_read_by_counts_what_the_reads_see(residual, block_size):
    # prenorm_eps relies on this count: it must be the number of sources each read really gets.
    model = GPT(config(residual, block_size=block_size))
    idx, _ = tokens()
    _, _, weights = model(idx, return_depth_weights=True)
    assert [w.shape[0] for w in weights] == [model.cfg.sources_read_by(j) for j in range(len(weights))]
    assert model.ln_f.eps == pytest.approx(model.cfg.norm_eps / weights[-1].shape[0] ** 2)
    assert GPT(config("standard")).blocks[2].ln2.eps == model.cfg.norm_eps


def test_config_errors():
    with pytest.raises(ValueError, match="norm_eps"):
        config("full", norm_eps=-1.0)
    with pytest.raises(ValueError, match="block_size"):
        config("block", block_size=0)


# ---- depth profile ---------------------------------------------------------------


def reference_profile(model, batches):
    """The same measures from an explicit forward that keeps every tensor."""
    sq_in, sq_out, grad_sum, count = None, None, None, 0
    for x, y in batches:
        h = model.embed(x)
        stream = attnres.DepthStream(h, block_size=model.cfg.stream_block_size)
        ins, outs = [], []
        for blk in model.blocks:
            for res, ln, f in (("res_attn", blk.ln1, blk.attn), ("res_mlp", blk.ln2, blk.mlp)):
                a = getattr(blk, res)(stream) if model.cfg.residual != "standard" else h
                out = f(ln(a))
                out.retain_grad()
                ins.append(a)
                outs.append(out)
                if model.cfg.residual == "standard":
                    h = h + out
                else:
                    stream.append(out)
        final = model.final_res(stream) if model.cfg.residual != "standard" else h
        logits = model.head(model.ln_f(final))
        F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").backward()
        si = torch.stack([a.detach().square().sum() for a in ins])
        so = torch.stack([o.detach().square().sum() for o in outs])
        gs = torch.stack([o.grad.norm(dim=-1).sum() for o in outs])
        sq_in, sq_out, grad_sum = (si, so, gs) if sq_in is None else (sq_in + si, sq_out + so, grad_sum + gs)
        count += x.numel()
    model.zero_grad(set_to_none=True)
    d = model.cfg.d_model
    return {
        "input_rms": (sq_in / (count * d)).sqrt().tolist(),
        "output_rms": (sq_out / (count * d)).sqrt().tolist(),
        "grad_norm": (grad_sum / count).tolist(),
    }


@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_depth_profile_matches_an_explicit_forward(residual):
    torch.manual_seed(0)
    model = GPT(config(residual)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():  # random reads, not plain averages
            p.add_(0.3 * torch.randn_like(p) if name.endswith(".query") else 0.02 * torch.randn_like(p))
    batches = [tokens(seed) for seed in (1, 2)]
    args = demo.resolve_preset(argparse.Namespace(preset="cpu", amp=False, device="cpu"))
    got = demo.depth_profile(model, batches, args)
    assert all(p.grad is None for p in model.parameters()), "the profile must not leave gradients"
    want = reference_profile(model, batches)
    for key in want:
        assert len(got[key]) == 2 * model.cfg.n_layers
        # In float64: torch.tensor of Python floats rounds to float32, where two
        # values 1e-9 apart can land an ulp apart (CI failed so once). The demo's
        # profile and this explicit forward of the float64 model differ by
        # 1e-9 to 6e-9 relative (measured; cause not established), which the
        # float32 comparison hid: rtol 1e-7 bounds that, float32's precision.
        torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                   torch.tensor(want[key], dtype=torch.float64), rtol=1e-7, atol=0)
    if residual == "standard":
        # The plain residual stream only grows, sublayer after sublayer: x_j = emb + f_0 + ... + f_{j-1}
        # (what the demo's plot shows as PreNorm dilution). The reference above is independent of it.
        assert got["final_input_rms"] > got["input_rms"][0]


# ---- statistics over seeds -------------------------------------------------------


def fake_run(variant, seed, val, train=None):
    return {"variant": variant, "seed": seed, "parameters": 10, "tokens_per_s": 100.0 + seed,
            "final_train_loss": val if train is None else train, "val_loss": val}


def test_aggregate_pairs_seeds_and_reports_mean_and_sd():
    std = [2.0, 2.5, 3.1]
    full = [2.1, 2.4, 3.3]
    runs = [fake_run("standard", s, v) for s, v in enumerate(std)]
    runs += [fake_run("full", s, v) for s, v in zip((2, 0, 1), (full[2], full[0], full[1]))]  # any order
    runs.append(fake_run("block", 0, 1.9))
    rows = {r["variant"]: r for r in demo.aggregate(runs, ["standard", "full", "block"])}
    assert rows["standard"]["val_loss"] == pytest.approx((statistics.mean(std), statistics.stdev(std)))
    diffs = [f - s for f, s in zip(full, std)]
    assert rows["full"]["val_minus_standard"] == pytest.approx((statistics.mean(diffs), statistics.stdev(diffs)))
    assert rows["full"]["lower_than_standard"] == "1/3"
    assert rows["block"]["val_loss"] == (1.9, None)  # one seed: no sd
    assert rows["block"]["val_minus_standard"] == (pytest.approx(-0.1), None)
    table = demo.format_table(list(rows.values()))
    assert f"{statistics.mean(std):.4f} ± {statistics.stdev(std):.4f}" in table
    assert f"{statistics.mean(diffs):+.4f} ± {statistics.stdev(diffs):.4f}" in table
    block_line = table.splitlines()[-1]
    assert block_line.startswith("block") and "±" not in block_line and "-0.1000" in block_line


def test_lr_factor_warms_up_then_decays_to_a_tenth():
    total = 200
    factors = [demo.lr_factor(s, total) for s in range(total)]
    warmup = total // 20
    assert factors[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert factors[warmup] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1:]))
    assert factors[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (total - 1 - warmup) / (total - warmup))))


# ---- command line ------------------------------------------------------------------

TINY = ["--steps", "3", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16",
        "--batch", "2", "--block-size", "2", "--corpus-bytes", "60000", "--eval-batches", "2",
        "--profile-batches", "1", "--device", "cpu"]


def test_cli_runs_every_variant_for_every_seed(tmp_path, capsys):
    assert cli_main(["demo", *TINY, "--seeds", "2", "--seed", "5", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] is True
    assert [(r["variant"], r["seed"]) for r in summary["runs"]] == [
        (v, s) for s in (5, 6) for v in ("standard", "full", "block")]
    rows = {r["variant"]: r for r in summary["variants"]}
    standard_val = {r["seed"]: r["val_loss"] for r in summary["runs"] if r["variant"] == "standard"}
    full_diffs = [r["val_loss"] - standard_val[r["seed"]] for r in summary["runs"] if r["variant"] == "full"]
    assert rows["full"]["val_minus_standard"][0] == pytest.approx(statistics.mean(full_diffs))
    for row in rows.values():
        for when in ("init", "trained"):
            assert len(row["depth_profile"][when]["input_rms"]) == 4
    # At init the three variants are the same function, so the same gradients reach every sublayer.
    for variant in ("full", "block"):
        assert rows[variant]["depth_profile"]["init"]["grad_norm"] == pytest.approx(
            rows["standard"]["depth_profile"]["init"]["grad_norm"], rel=1e-4)
    for name in ("loss_curves.png", "depth_profile.png", "depth_weights_full.png", "depth_weights_block.png"):
        assert (tmp_path / name).stat().st_size > 1000
    out = capsys.readouterr().out
    assert summary["table"] in out and "val - standard" in out


def test_cli_gpu_preset_path_on_cpu_with_small_overrides(tmp_path):
    # The preset's own sizes need a GPU; its code path (bf16 autocast, the
    # stdlib + site-packages corpus) is exercised here with tiny overrides.
    assert cli_main(["demo", "--preset", "gpu", *TINY, "--seeds", "1", "--variants", "full",
                     "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["amp"] is True and summary["config"]["corpus"] == "all"
    assert summary["config"]["layers"] == 2  # the explicit option wins over the preset
    assert math.isfinite(summary["runs"][0]["val_loss"])


def test_max_minutes_stops_between_runs_and_keeps_what_finished(tmp_path):
    assert cli_main(["demo", *TINY, "--seeds", "2", "--max-minutes", "1e-6", "--variants", "standard",
                     "full", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] is False and "stopped after 1 of 4 runs" in summary["note"]
    assert len(summary["runs"]) == 1


def test_presets_and_errors(capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    gpu = demo.resolve_preset(parser.parse_args(["--preset", "gpu", "--steps", "7"]))
    assert gpu.steps == 7 and gpu.layers >= 16 and gpu.corpus == "all"
    cpu = demo.resolve_preset(parser.parse_args([]))
    assert {k: getattr(cpu, k) for k in demo.PRESETS["cpu"]} == demo.PRESETS["cpu"]

    for argv, message in [(["--seeds", "0"], "--seeds must be positive"),
                          (["--d-model", "10", "--heads", "4"], "divisible"),
                          (["--attnres-lr-scale", "-1"], "--attnres-lr-scale"),
                          (["--max-minutes", "0"], "--max-minutes")]:
        assert cli_main(["demo", *argv, "--device", "cpu"]) == 2
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli_main(["demo", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_corpus_roots_and_byte_limit():
    stdlib = demo.corpus_roots("stdlib")
    everything = demo.corpus_roots("all")
    assert everything[0] == stdlib[0] and len(stdlib) == 1
    assert any("site-packages" in r for r in everything[1:])
    data = demo.source_corpus(stdlib, 10_000)
    assert len(data) == 10_000
    train, val = demo.split_corpus(data)
    assert train.dtype == torch.uint8 and len(val) == 1_000
    assert bytes(train.tolist()) + bytes(val.tolist()) == data
