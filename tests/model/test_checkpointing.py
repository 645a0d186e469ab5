"""Gradient checkpointing per layer from a memory estimate (disable_gradient_checkpointing unset: none, selective
or full), and the adapters' autocast inputs: each keeps the numbers of the plain path."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from model_helpers import loss_and_backward
from torch.utils._python_dispatch import TorchDispatchMode

from tuneforge.model import checkpointing, load_model
from tuneforge.model.mixed_precision import autocast_inputs, plain_lora_layers

SMOLLM2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)


def test_the_estimates_per_token_and_layer_by_hand():
    # half precision, times the 1.25 margin; kv = 3 heads x 64
    per = checkpointing.activation_bytes_per_token
    assert per(SMOLLM2, half=True) == (34 * 576 + 8 * 1536) * 1.25
    assert per(SMOLLM2, half=True, mode="selective") == (10 * 576 + 4 * 192 + 4 * 1536) * 1.25
    assert per(SMOLLM2, half=True, mode="full") == 2 * 576 * 1.25
    assert per(SMOLLM2, half=False, mode="selective") == (10 * 576 + 4 * 192 + 4 * 1536) * 2.5
    moe = SimpleNamespace(hidden_size=64, num_attention_heads=4, intermediate_size=999, num_experts_per_tok=2,
                          moe_intermediate_size=32)
    assert per(moe, half=True) == (34 * 64 + 8 * 64) * 1.25
    # a lean layer keeps its input, q, k, v, attention's output (twice on padded batches), the second norm's input,
    # gate and up: no more than selective keeps
    assert per(SMOLLM2, half=True, lean=True) == (10 * 576 + 4 * 192 + 4 * 1536) * 1.25


def test_the_plan_picks_the_fastest_mode_each_layer_can_have_within_the_budget():
    tokens = 2048
    none, selective, full = (checkpointing.activation_bytes_per_token(SMOLLM2, True, mode) * tokens
                             for mode in ("none", "selective", "full"))

    def chosen(budget: float) -> tuple[int, int, int]:
        p = checkpointing.plan(SMOLLM2, 30, tokens, True, available=2 * budget)  # half is the budget
        return p.none, p.selective, p.full

    assert chosen(30 * none) == (30, 0, 0)
    # selective on every layer first; what is left makes layers none
    assert chosen(30 * selective + 7.5 * (none - selective)) == (7, 23, 0)
    assert chosen(30 * selective) == (0, 30, 0)
    assert chosen(30 * full + 10 * (selective - full)) == (0, 10, 20)
    assert chosen(30 * full + 10.5 * (selective - full)) == (0, 10, 20)
    assert chosen(30 * full) == (0, 0, 30) and chosen(0.0) == (0, 0, 30)
    assert checkpointing.plan(SMOLLM2, 30, tokens, True, 2 * (30 * selective + 7 * (none - selective))).summary() \
        == "none on 7, selective on 23 of 30 layers"


def test_lean_layers_go_from_full_straight_to_none():
    tokens = 2048
    none, full = (checkpointing.activation_bytes_per_token(SMOLLM2, True, mode, lean=True) * tokens
                  for mode in ("none", "full"))

    def chosen(budget: float) -> tuple[int, int, int]:
        p = checkpointing.plan(SMOLLM2, 30, tokens, True, available=2 * budget, lean=True)
        return p.none, p.selective, p.full

    assert chosen(30 * none) == (30, 0, 0)
    assert chosen(30 * full + 12.5 * (none - full)) == (12, 0, 18)
    assert chosen(30 * full) == (0, 0, 30)


def test_the_largest_micro_batch_counts_every_sequence_a_sample_holds(make_cfg):
    cfg = make_cfg()
    assert checkpointing.sequences_per_sample(cfg) == 1
    cfg.method.stage = "dpo"
    assert checkpointing.sequences_per_sample(cfg) == 2  # chosen and rejected
    cfg.method.stage = "grpo"
    assert checkpointing.sequences_per_sample(cfg) == 8  # grpo's default group
    cfg.rl.num_generations = 4
    assert checkpointing.sequences_per_sample(cfg) == 4


def _layer_modes(available: float = 1e12, layers: int = 30) -> checkpointing.LayerModes:
    """LayerModes for SmolLM2's lean layers in fp32 (per token: none 31,680 bytes, full 2,880, with the margin)."""
    stack = torch.nn.ModuleList(torch.nn.Module() for _ in range(layers))
    for layer in stack:
        layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, _full_checkpoint
    return checkpointing.LayerModes(stack, SMOLLM2, half=False, available=available, lean=True)


def _full_checkpoint(function, *args, **kwargs):
    return function(*args, **kwargs)


def _checkpointed(modes: checkpointing.LayerModes) -> list[str]:
    return ["selective" if layer._gradient_checkpointing_func is checkpointing.selective_checkpoint else "full"
            if layer.gradient_checkpointing else "none" for layer in modes.layers]


def test_a_shorter_micro_batch_keeps_more_layers_unchecked_within_the_same_budget():
    none, full = 31680, 2880
    assert checkpointing.activation_bytes_per_token(SMOLLM2, False, "none", lean=True) == none
    # the budget (half the memory available) holds 10 unchecked layers at 2,048 tokens
    modes = _layer_modes(available=2 * (30 * full * 2048 + 10 * (none - full) * 2048))
    assert modes.apply(2048).none == 10 and _checkpointed(modes) == ["full"] * 20 + ["none"] * 10
    # at 1,024 tokens: (30 full + 10 (none - full)) x 2048 / ((none - full) x 1024) - 30 full / (none - full) = 23
    assert modes.apply(1024).none == 23 and _checkpointed(modes) == ["full"] * 7 + ["none"] * 23
    assert modes.apply(128).none == 30 and _checkpointed(modes) == ["none"] * 30


def test_the_cap_is_the_smallest_whose_recompute_costs_at_most_its_share():
    modes = _layer_modes()
    held = [500] * 40 + [1000] * 8 + [1200]  # 29,200 tokens: 2 % is 584 token-layers' worth
    # cap 1,000: the 1,200-token batch keeps floor((30 none 1000 - 30 full 1200) / ((none - full) 1200)) = 24 layers
    # unchecked, recomputes 6 (a third each): 6 / 90 of 1,200 = 80 <= 584. Cap 500: the 1,000-token batches keep
    # 13 (17 / 90 of 8 x 1,000 = 1,511 already > 584)
    assert modes.choose_cap(held) == 1000
    assert modes.extra_compute(held, 1000) == pytest.approx(80 / 29200)
    assert modes.for_tokens(1200, 1000).summary() == "none on 24, full on 6 of 30 layers"
    assert modes.for_tokens(1000, 500).summary() == "none on 13, full on 17 of 30 layers"
    assert modes.apply(1200).full == 6 and _checkpointed(modes) == ["full"] * 6 + ["none"] * 24
    assert modes.apply(1000).full == 0 and _checkpointed(modes) == ["none"] * 30
    # micro-batches of one length: nothing to cap below it
    assert modes.choose_cap([700] * 9) == 700 and modes.apply(700).none == 30
    assert modes.choose_cap([]) is None and modes.apply(5000).none == 30


def test_selective_layers_come_back_to_full_checkpointing():
    modes = _layer_modes(layers=3)
    modes.config = SimpleNamespace(**vars(SMOLLM2))
    modes.lean = False  # selective keeps less than none here
    selective = checkpointing.activation_bytes_per_token(SMOLLM2, False, "selective") * 100
    full = checkpointing.activation_bytes_per_token(SMOLLM2, False, "full") * 100
    modes.available = 2 * (3 * full + 2 * (selective - full))
    modes.apply(100)
    assert _checkpointed(modes) == ["full", "selective", "selective"]
    modes.apply(1000)
    assert _checkpointed(modes) == ["full"] * 3
    assert all(layer._gradient_checkpointing_func is _full_checkpoint for layer in modes.layers)


class ProductCount(TorchDispatchMode):
    """Counts matrix products run inside it."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _products_and_grads(model, batch) -> tuple[int, dict]:
    with ProductCount() as products:
        loss_and_backward(model, batch)
    return products.count, {n: p.grad.clone() for n, p in model.named_parameters()}


def _layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def test_selective_recomputes_no_large_product_and_keeps_the_gradients(make_cfg, batch, monkeypatch,
                                                                     selective_everywhere):
    monkeypatch.setattr(checkpointing, "SAVED_INNER_DIM", 16)  # the tiny model's products are 32 wide
    runs = {}
    for mode, key in (("none", True), ("full", False), ("selective", None)):
        torch.manual_seed(0)
        model = load_model(make_cfg(finetuning_type="full", disable_gradient_checkpointing=key))
        selective = [getattr(layer, "_gradient_checkpointing_func", None) is checkpointing.selective_checkpoint
                     for layer in _layers(model)]
        assert selective == [mode == "selective"] * 2
        runs[mode] = _products_and_grads(model, batch)
    # the recompute runs q, k, v, o, gate, up again; not down (torch's recompute stops after the last tensor backward
    # needs, down's input)
    assert runs["full"][0] == runs["none"][0] + 2 * 6
    assert runs["selective"][0] == runs["none"][0]  # selective keeps them
    for mode in ("full", "selective"):
        for name, grad in runs["none"][1].items():
            torch.testing.assert_close(runs[mode][1][name], grad, rtol=1e-5, atol=1e-7)


def _load_within(cfg, monkeypatch, caplog, budget, lean=True):
    """The layers of cfg's model loaded where the plan's budget (half the memory available after the optimizer's
    reserve) is budget(per_layer), per_layer: each mode's activations of one layer for cfg's largest micro-batch.
    lean=False: the MLPs keep their own forward (so their layers are not lean)."""
    if not lean:
        monkeypatch.setattr("tuneforge.model.load.lean_gated_mlps", lambda model: 0)
    model = load_model(cfg)
    assert checkpointing.keeps_lean(_layers(model)[0], half=False) == lean
    tokens = cfg.train.per_device_train_batch_size * cfg.data.cutoff_len
    per_layer = {mode: checkpointing.activation_bytes_per_token(model.config, False, mode, lean) * tokens
                 for mode in ("none", "selective", "full")}
    reserved = 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 2 * budget(per_layer) + reserved)
    with caplog.at_level(logging.INFO, logger="tuneforge"):
        return _layers(load_model(cfg))


def test_full_checkpointing_on_the_first_layers_when_the_budget_holds_one(make_cfg, monkeypatch, caplog):
    cfg = make_cfg(finetuning_type="lora", disable_gradient_checkpointing=None)
    layers = _load_within(cfg, monkeypatch, caplog, lambda b: 2 * b["full"] + (b["selective"] - b["full"]),
                          lean=False)
    funcs = [layer._gradient_checkpointing_func for layer in layers]
    assert funcs[0] is not checkpointing.selective_checkpoint and funcs[1] is checkpointing.selective_checkpoint
    assert all(layer.gradient_checkpointing for layer in layers)
    assert "selective on 1, full on 1 of 2 layers" in caplog.text


def test_no_checkpointing_on_the_last_layers_when_the_budget_holds_them(make_cfg, monkeypatch, caplog):
    cfg = make_cfg(finetuning_type="lora", disable_gradient_checkpointing=None)
    layers = _load_within(cfg, monkeypatch, caplog, lambda b: 2 * b["selective"] + (b["none"] - b["selective"]),
                          lean=False)
    assert layers[0].gradient_checkpointing
    assert layers[0]._gradient_checkpointing_func is checkpointing.selective_checkpoint
    assert not layers[1].gradient_checkpointing
    assert "none on 1, selective on 1 of 2 layers" in caplog.text
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 1e12)
    assert not any(layer.gradient_checkpointing for layer in _layers(load_model(cfg)))


def test_lean_layers_skip_selective_checkpointing(make_cfg, monkeypatch, caplog):
    cfg = make_cfg(finetuning_type="lora", disable_gradient_checkpointing=None)
    layers = _load_within(cfg, monkeypatch, caplog, lambda b: 2 * b["full"] + (b["none"] - b["full"]))
    assert layers[0].gradient_checkpointing
    assert layers[0]._gradient_checkpointing_func is not checkpointing.selective_checkpoint
    assert not layers[1].gradient_checkpointing
    assert "none on 1, full on 1 of 2 layers" in caplog.text


def test_an_explicit_setting_wins(make_cfg, monkeypatch):
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 1e12)  # memory would allow selective
    full = _layers(load_model(make_cfg(disable_gradient_checkpointing=False)))
    assert all(layer.gradient_checkpointing and layer._gradient_checkpointing_func
               is not checkpointing.selective_checkpoint for layer in full)
    assert not any(layer.gradient_checkpointing for layer in _layers(load_model(make_cfg(
        disable_gradient_checkpointing=True))))


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


def test_torch_compile_keeps_full_checkpointing_on_every_layer(make_cfg, monkeypatch):
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 1e12)  # selective would fit everywhere
    layers = _layers(load_model(make_cfg(torch_compile=True, torch_compile_backend="aot_eager")))
    assert all(layer.gradient_checkpointing for layer in layers)
    assert not any(layer._gradient_checkpointing_func is checkpointing.selective_checkpoint for layer in layers)


@pytest.mark.parametrize("keys", [{"deepspeed": "examples/deepspeed/ds_z3_config.json"}, {"fsdp": "full_shard"},
                                  {"sequence_parallel_size": 2}])
def test_sharded_or_split_runs_keep_full_checkpointing(make_cfg, keys):
    # ZeRO / FSDP gather parameters inside a layer and release them: selective's replay would find other operations
    cfg = make_cfg()
    for key, value in keys.items():
        setattr(cfg.train, key, value)
    assert not checkpointing.selective_fits(cfg)
    assert checkpointing.selective_fits(make_cfg())
