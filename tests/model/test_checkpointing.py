"""Gradient checkpointing per layer from a memory estimate (disable_gradient_checkpointing unset), and the
adapters' autocast inputs: each keeps the numbers of the plain path."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from model_helpers import loss_and_backward
from torch.utils._python_dispatch import TorchDispatchMode

from tuneforge.model import checkpointing, load_model
from tuneforge.model.mixed_precision import autocast_inputs, plain_lora_layers

SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536)


def test_the_estimate_per_token_and_layer_by_hand():
    # 34 bytes per hidden unit + 8 per intermediate unit under half precision, times the 1.25 margin
    assert checkpointing.activation_bytes_per_token(SMOLLM2, half=True) == (34 * 576 + 8 * 1536) * 1.25
    assert checkpointing.activation_bytes_per_token(SMOLLM2, half=False) == (34 * 576 + 8 * 1536) * 2.5
    moe = SimpleNamespace(hidden_size=64, intermediate_size=999, num_experts_per_tok=2, moe_intermediate_size=32)
    assert checkpointing.activation_bytes_per_token(moe, half=True) == (34 * 64 + 8 * 64) * 1.25


def test_the_plan_checkpoints_the_fewest_layers_that_fit():
    per_layer = checkpointing.activation_bytes_per_token(SMOLLM2, half=True) * 2048
    plenty = checkpointing.plan(SMOLLM2, 30, 2048, True, available=2 * 30 * per_layer)  # budget: half of it
    assert plenty.checkpointed == 0 and plenty.per_layer_bytes == per_layer
    ten_fit = checkpointing.plan(SMOLLM2, 30, 2048, True, available=2 * 10 * per_layer)
    assert ten_fit.checkpointed == 20
    a_bit_more = checkpointing.plan(SMOLLM2, 30, 2048, True, available=2 * 10.5 * per_layer)
    assert a_bit_more.checkpointed == 20  # 10.5 layers' worth of budget: 10 stay un-checkpointed, not 11
    none_fit = checkpointing.plan(SMOLLM2, 30, 2048, True, available=-1.0)
    assert none_fit.checkpointed == 30


def _first_mlp_calls(model, batch) -> list[int]:
    """Forward calls of each layer's MLP in one forward + backward (2 where the layer is recomputed)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    calls = [0] * len(base.model.layers)
    hooks = [layer.mlp.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(base.model.layers)]
    loss_and_backward(model, batch)
    for hook in hooks:
        hook.remove()
    return calls


@pytest.mark.parametrize("available, calls", [(1e12, [1, 1]), (0.0, [2, 2])])
def test_unset_checkpoints_by_memory_and_keeps_the_gradients(make_cfg, batch, monkeypatch, caplog, available,
                                                                calls):
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: available)
    grads = {}
    for key in (None, True):
        torch.manual_seed(0)
        with caplog.at_level(logging.INFO, logger="tuneforge"):
            model = load_model(make_cfg(finetuning_type="full", disable_gradient_checkpointing=key))
        if key is None:
            assert _first_mlp_calls(model, batch) == calls
            assert f"{calls.count(2)} of 2 decoder layers" in caplog.text
        else:
            loss_and_backward(model, batch)
        grads[key] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, grad in grads[True].items():
        torch.testing.assert_close(grads[None][name], grad, rtol=1e-5, atol=1e-7)


def test_one_layer_checkpointed_when_one_layer_fits(make_cfg, batch, monkeypatch):
    cfg = make_cfg(finetuning_type="lora", disable_gradient_checkpointing=None)
    model = load_model(cfg)  # the plan is redone below with a budget of one layer's activations
    tokens = cfg.train.per_device_train_batch_size * cfg.data.cutoff_len
    per_layer = checkpointing.activation_bytes_per_token(model.config, half=False) * tokens
    reserved = 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 2 * per_layer + reserved)
    model = load_model(cfg)
    assert _first_mlp_calls(model, batch) == [2, 1]


def test_an_explicit_setting_wins(make_cfg, batch, monkeypatch):
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 1e12)  # memory would allow none
    assert _first_mlp_calls(load_model(make_cfg(disable_gradient_checkpointing=False)), batch) == [2, 2]
    assert _first_mlp_calls(load_model(make_cfg(disable_gradient_checkpointing=True)), batch) == [1, 1]


# ---------------------------------------------------------------- adapters under autocast


class UpcastCopies(TorchDispatchMode):
    """Counts copies of bf16 activations (3-d) to fp32."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (func is torch.ops.aten._to_copy.default and isinstance(source, torch.Tensor) and source.dim() == 3
                and source.dtype == torch.bfloat16 and kwargs.get("dtype") == torch.float32):
            self.count += 1
        return func(*args, **kwargs)


def _lora_step(model, batch, skip_cast: bool):
    model.zero_grad()
    layers = plain_lora_layers(model) if skip_cast else []
    with autocast_inputs(layers):
        loss = loss_and_backward(model, batch, torch.bfloat16)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_under_autocast_without_the_fp32_input_copy_is_bit_identical(make_cfg, batch):
    torch.manual_seed(0)
    model = load_model(make_cfg(bf16=True, disable_gradient_checkpointing=True))
    for name, param in model.named_parameters():
        if ".lora_B." in name:  # B starts at zero, which would leave A without a gradient
            param.data.normal_(std=0.1)
    layers = plain_lora_layers(model)
    assert len(layers) == 14  # 7 linear layers x 2 decoder layers
    plain_loss, plain_grads = _lora_step(model, batch, skip_cast=False)
    with UpcastCopies() as with_cast:
        _lora_step(model, batch, skip_cast=False)
    with UpcastCopies() as without:
        loss, grads = _lora_step(model, batch, skip_cast=True)
    # gone: the fp32 copy of each adapted layer's input (14), and casts of its gradient in backward
    assert with_cast.count - without.count >= 14
    assert torch.equal(loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    assert all(layer.cast_input_dtype_enabled for layer in layers)  # restored on the way out


@pytest.mark.parametrize("keys", [{"lora_dropout": 0.1}, {"use_dora": True}])
def test_lora_with_dropout_or_a_variant_keeps_its_cast(make_cfg, keys):
    assert plain_lora_layers(load_model(make_cfg(bf16=True, **keys))) == []
