"""attnres.param_groups: which parameter lands in which optimizer group, and
that AdamW then applies the intended learning rate and weight decay to each
(checked against Adam's known first step on random gradients)."""
import math

import pytest
import torch
from torch import nn

import attnres
from attnres.models import GPT, GPTConfig


def tiny_gpt(residual, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=2, n_heads=2,
                         residual=residual, block_size=3, **kw))


def attnres_params(model):
    return {id(p) for m in model.modules() if isinstance(m, attnres.AttnResResidual)
            for p in m.parameters()}


def by_name(groups):
    return {g["name"]: g for g in groups}


@pytest.mark.parametrize("residual", ["full", "block"])
def test_every_parameter_in_exactly_the_right_group(residual):
    model = tiny_gpt(residual)
    groups = by_name(attnres.param_groups(model, lr=1e-3, weight_decay=0.1, attnres_lr_scale=0.25))
    assert set(groups) == {"decay", "no_decay", "attnres"}
    ids = [id(p) for g in groups.values() for p in g["params"]]
    assert len(ids) == len(set(ids)), "a parameter appears twice (the tied head?)"
    assert set(ids) == {id(p) for p in model.parameters()}

    expected_attnres = attnres_params(model)
    # 2 layers x 2 sublayers + final read, each a query and a gain
    assert len(expected_attnres) == 2 * (2 * 2 + 1)
    assert {id(p) for p in groups["attnres"]["params"]} == expected_attnres
    assert all(p.dim() >= 2 for p in groups["decay"]["params"])
    assert all(p.dim() < 2 and id(p) not in expected_attnres for p in groups["no_decay"]["params"])
    assert model.tok_emb.weight in groups["decay"]["params"]

    assert groups["decay"]["weight_decay"] == 0.1 and groups["decay"]["lr"] == 1e-3
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["no_decay"]["lr"] == 1e-3
    assert groups["attnres"]["weight_decay"] == 0.0
    assert groups["attnres"]["lr"] == pytest.approx(0.25e-3)


def test_standard_model_has_no_attnres_group_and_frozen_parameters_are_left_out():
    model = tiny_gpt("standard")
    model.pos_emb.weight.requires_grad_(False)
    groups = attnres.param_groups(model, lr=1e-3, weight_decay=0.1)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    listed = {id(p) for g in groups for p in g["params"]}
    assert id(model.pos_emb.weight) not in listed
    assert listed == {id(p) for p in model.parameters() if p.requires_grad}


def test_reads_without_key_norm_gain_contribute_their_queries():
    model = nn.ModuleList([attnres.AttnResResidual(8, key_norm_affine=False), nn.Linear(8, 8)])
    groups = by_name(attnres.param_groups(model, lr=1.0, weight_decay=0.0))
    assert [p is model[0].query for p in groups["attnres"]["params"]] == [True]
    assert groups["attnres"]["lr"] == pytest.approx(0.1)  # the default scale


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_invalid_numbers_are_refused(bad):
    model = tiny_gpt("full")
    for key in ("lr", "weight_decay", "attnres_lr_scale"):
        kwargs = {"lr": 1e-3, "weight_decay": 0.1, "attnres_lr_scale": 0.1, key: bad}
        with pytest.raises(ValueError, match=key):
            attnres.param_groups(model, **kwargs)


def test_not_a_module_is_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        attnres.param_groups([torch.zeros(3, requires_grad=True)], lr=1e-3, weight_decay=0.0)


def test_adamw_first_step_matches_the_groups_settings():
    """Adam's first step from zero state moves every element by lr * g / (|g| + eps')
    = lr * sign(g) (bias correction makes m / sqrt(v) = g / |g|), after AdamW
    has multiplied the parameter by (1 - lr * weight_decay)."""
    model = tiny_gpt("full")
    with torch.no_grad():  # non-trivial values, so decay and no decay differ visibly
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    lr, wd, scale = 1e-2, 0.3, 0.1
    optimizer = torch.optim.AdamW(attnres.param_groups(model, lr=lr, weight_decay=wd, attnres_lr_scale=scale),
                                  eps=1e-30)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {id(p): p.grad.clone() for p in model.parameters()}
    optimizer.step()

    names = by_name(optimizer.param_groups)
    for group, (group_lr, group_wd) in {"decay": (lr, wd), "no_decay": (lr, 0.0),
                                       "attnres": (lr * scale, 0.0)}.items():
        for p in names[group]["params"]:
            expected = before[id(p)] * (1 - group_lr * group_wd) - group_lr * grads[id(p)].sign()
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


def test_lr_scheduler_keeps_the_ratio_and_zero_scale_freezes_the_reads():
    model = tiny_gpt("block")
    optimizer = torch.optim.AdamW(attnres.param_groups(model, lr=1e-3, weight_decay=0.1, attnres_lr_scale=0.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    frozen = {id(p) for p in by_name(optimizer.param_groups)["attnres"]["params"]}
    before = {id(p): p.detach().clone() for p in model.parameters()}
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        _, loss = model(idx, idx)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    groups = by_name(optimizer.param_groups)
    assert groups["decay"]["lr"] == pytest.approx(1e-3 / 4) and groups["attnres"]["lr"] == 0.0
    for p in model.parameters():
        moved = not torch.equal(p.detach(), before[id(p)])
        assert moved == (id(p) not in frozen), "only the AttnRes parameters stay put"

    ratio_model = tiny_gpt("full")
    opt = torch.optim.SGD(attnres.param_groups(ratio_model, lr=0.5, weight_decay=0.0, attnres_lr_scale=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: math.cos(step / 10))
    for _ in range(4):
        opt.step()
        sched.step()
    g = by_name(opt.param_groups)
    assert g["attnres"]["lr"] / g["decay"]["lr"] == pytest.approx(0.1)


def test_a_fused_pre_norm_gain_stays_with_the_norm_gains():
    """out_weight is the sublayer's pre-norm gain moved into the read: the
    no_decay group at the full rate, not the reads' scaled group."""
    read = attnres.AttnResResidual(8, out_norm="rmsnorm")
    groups = {g["name"]: g["params"] for g in attnres.param_groups(read, lr=1.0, weight_decay=0.1)}
    assert [id(p) for p in groups["no_decay"]] == [id(read.out_weight)]
    assert {id(p) for p in groups["attnres"]} == {id(read.query), id(read.norm_weight)}
