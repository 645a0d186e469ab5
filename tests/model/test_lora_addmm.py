"""LoRA's update added by its own product (torch.addmm): the numbers of peft's forward, and peft's forward wherever
the case is not the plain one."""

from __future__ import annotations

import pytest
import torch
from model_helpers import loss_and_grads, nonzero_lora_b
from peft import LoraConfig, get_peft_model
from torch import nn

from tuneforge.model import load_model
from tuneforge.model.lora_addmm import _addmm_forward, add_lora_by_addmm, runs_addmm


def _loaded_pair(make_cfg, monkeypatch, **keys):
    cfg = make_cfg(finetuning_type="lora", disable_gradient_checkpointing=True, **keys)
    torch.manual_seed(0)
    fused = load_model(cfg)
    monkeypatch.setattr("tuneforge.model.load.add_lora_by_addmm", lambda model: 0)
    torch.manual_seed(0)
    plain = load_model(cfg)
    assert runs_addmm(fused) and not runs_addmm(plain)
    nonzero_lora_b(fused)
    nonzero_lora_b(plain)
    return fused, plain


def test_fp32_training_is_bit_identical_to_pefts_forward(make_cfg, batch, monkeypatch):
    fused, plain = _loaded_pair(make_cfg, monkeypatch)
    (loss, grads), (plain_loss, plain_grads) = loss_and_grads(fused, batch), loss_and_grads(plain, batch)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and any(".lora_A." in n for n in grads)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


def test_bf16_is_within_bf16s_rounding_of_fp32(make_cfg, batch, monkeypatch):
    """Under bf16 autocast the sum is rounded once where peft rounds twice: both are within bf16's rounding of the
    fp32 numbers (a wrong scaling or a lost term would be off by the update itself)."""
    fused, plain = _loaded_pair(make_cfg, monkeypatch, bf16=True)
    exact_loss, exact_grads = loss_and_grads(plain, batch)
    loss, grads = loss_and_grads(fused, batch, torch.bfloat16)
    plain_loss, plain_grads = loss_and_grads(plain, batch, torch.bfloat16)
    errors = {}
    for name, exact in exact_grads.items():
        errors[name] = [float((g[name] - exact).norm() / exact.norm()) for g in (grads, plain_grads)]
    assert abs(loss - exact_loss) < 1e-3 and abs(plain_loss - exact_loss) < 1e-3
    assert len(errors) == 28 and max(ours for ours, _ in errors.values()) < 0.1  # bf16: up to ~4 % on this model
    mean_ours, mean_peft = (sum(e[i] for e in errors.values()) / len(errors) for i in (0, 1))
    assert mean_ours < 1.5 * mean_peft


def _layer(**lora):
    torch.manual_seed(0)
    model = get_peft_model(nn.Sequential(nn.Linear(16, 12, bias=False)),
                           LoraConfig(**{"r": 4, "lora_alpha": 8, **lora}, target_modules=["0"]))
    nonzero_lora_b(model)
    return model, model.base_model.model[0]


@pytest.mark.parametrize("lora", [{"lora_dropout": 0.5}, {"use_dora": True}, {"lora_bias": True}],
                         ids=["dropout", "dora", "bias"])
def test_other_variants_run_pefts_forward(lora):
    model, layer = _layer(**lora)
    x = torch.randn(3, 16)
    torch.manual_seed(1)
    expected = model(x)
    assert add_lora_by_addmm(model) == 1 and layer.forward.__func__ is _addmm_forward
    torch.manual_seed(1)  # dropout draws the same mask
    assert torch.equal(model(x), expected)


def test_disabled_or_merged_adapters_give_the_base_layers_output():
    model, layer = _layer()
    add_lora_by_addmm(model)
    x = torch.randn(3, 16)
    base = layer.base_layer(x)
    with_update = model(x)
    assert not torch.allclose(with_update, base)  # the update is there
    with model.disable_adapter():  # a DPO / KTO reference pass
        assert torch.equal(model(x), base)
    assert torch.allclose(model(x), with_update)
    layer.merge()
    assert torch.allclose(model(x), with_update, atol=1e-6)


def test_mixed_dtypes_without_autocast_run_pefts_forward():
    """A bf16 base with fp32 adapters outside autocast: peft sums in fp32 and casts back, and so does the swap."""
    model, layer = _layer()
    layer.base_layer.to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    expected = model(x)
    add_lora_by_addmm(model)
    assert torch.equal(model(x), expected) and expected.dtype == torch.bfloat16


@pytest.mark.parametrize(("r", "alpha", "exact"), [(4, 8, True), (4, 4, True), (3, 8, False), (16, 24, False)])
def test_fp32_outputs_are_pefts_up_to_its_last_bit(r, alpha, exact):
    """A power-of-two scaling is bit-identical; another differs by the rounding of peft's scaled copy."""
    model, layer = _layer(r=r, lora_alpha=alpha)
    x = torch.randn(5, 16)
    expected = model(x)
    add_lora_by_addmm(model)
    if exact:
        assert torch.equal(model(x), expected)
    torch.testing.assert_close(model(x), expected, rtol=1e-6, atol=1e-6)
