"""Parameter groups, LoRA+ learning rates, and schedules against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import make_cfg
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.errors import ConfigError
from tuneforge.train.optim import (
    base_learning_rate,
    build_optimizer,
    build_scheduler,
    param_groups,
    total_training_steps,
    warmup_steps,
)


def small_llama(**extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            **extra,
        )
    )


def cfg_with(tmp_path, **keys):
    return make_cfg(tmp_path / "out", tmp_path, **keys)


def test_weight_decay_skips_norms_and_biases(tmp_path):
    model = small_llama(attention_bias=True)
    groups = {g["name"]: g for g in param_groups(model, cfg_with(tmp_path, weight_decay=0.1))}
    no_decay = {"model.norm.weight"}
    for i in range(2):
        no_decay |= {
            f"model.layers.{i}.input_layernorm.weight",
            f"model.layers.{i}.post_attention_layernorm.weight",
        }
        no_decay |= {f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkvo"}
    assert set(groups["base_no_decay"]["param_names"]) == no_decay
    assert groups["base_no_decay"]["weight_decay"] == 0.0
    everything = {n for n, _ in model.named_parameters()}
    assert set(groups["base"]["param_names"]) == everything - no_decay
    assert groups["base"]["weight_decay"] == 0.1


def test_loraplus_learning_rates(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        small_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj", "embed_tokens"])
    )
    cfg = cfg_with(
        tmp_path,
        finetuning_type="lora",
        learning_rate=1e-4,
        loraplus_lr_ratio=16.0,
        loraplus_lr_embedding=1e-6,
    )
    optimizer = build_optimizer(model, cfg)
    by_name = {g["name"]: g for g in optimizer.param_groups}
    assert set(by_name) == {"base", "lora_B", "lora_embedding_B"}
    assert by_name["base"]["lr"] == pytest.approx(1e-4)
    assert by_name["lora_B"]["lr"] == pytest.approx(1.6e-3)
    assert by_name["lora_embedding_B"]["lr"] == pytest.approx(1e-6)
    assert all("lora_A" in n or "lora_embedding_A" in n for n in by_name["base"]["param_names"])
    assert (
        all(".lora_B." in n for n in by_name["lora_B"]["param_names"])
        and len(by_name["lora_B"]["params"]) == 4
    )
    assert [n for n in by_name["lora_embedding_B"]["param_names"]] == [
        "base_model.model.model.embed_tokens.lora_embedding_B.default"
    ]
    assert base_learning_rate(optimizer) == pytest.approx(1e-4)


def test_optimizer_choices(tmp_path):
    model = small_llama()
    assert isinstance(build_optimizer(model, cfg_with(tmp_path, optim="sgd")), torch.optim.SGD)
    fused = build_optimizer(model, cfg_with(tmp_path, optim="adamw_torch_fused", adam_beta2=0.95))
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    assert fused.defaults["betas"] == (0.9, 0.95)


def test_no_trainable_parameters_is_a_config_error(tmp_path):
    model = small_llama().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(model, cfg_with(tmp_path))


def lrs_over(tmp_path, total: int, **keys) -> list[float]:
    cfg = cfg_with(tmp_path, learning_rate=1.0, **keys)
    optimizer = build_optimizer(small_llama(), cfg)
    scheduler = build_scheduler(optimizer, cfg, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_linear_schedule_with_warmup(tmp_path):
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="linear", warmup_steps=2)
    assert lrs == pytest.approx([0.0, 0.5, 1.0] + [(10 - s) / 8 for s in range(3, 10)])


def test_cosine_schedule_with_warmup_ratio(tmp_path):
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="cosine", warmup_ratio=0.25)  # ceil(2.5) = 3 warm-up steps
    expected = [s / 3 for s in range(3)] + [0.5 * (1 + math.cos(math.pi * (s - 3) / 7)) for s in range(3, 10)]
    assert lrs == pytest.approx(expected)


def test_cosine_with_min_lr(tmp_path):
    lrs = lrs_over(
        tmp_path,
        10,
        lr_scheduler_type="cosine_with_min_lr",
        warmup_steps=2,
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
    )
    expected = [0.0, 0.5] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)]
    assert lrs == pytest.approx(expected)


def test_cosine_with_min_lr_needs_its_kwargs(tmp_path):
    # refused when the config loads, before any tokenizing or weight loading
    with pytest.raises(ConfigError, match="min_lr_rate") as raised:
        cfg_with(tmp_path, lr_scheduler_type="cosine_with_min_lr")
    assert raised.value.keys == ("lr_scheduler_type", "lr_scheduler_kwargs")


def test_total_and_warmup_steps(tmp_path):
    assert total_training_steps(cfg_with(tmp_path, max_steps=7), steps_per_epoch=3) == 7
    assert (
        total_training_steps(cfg_with(tmp_path, max_steps=-1, num_train_epochs=1.5), steps_per_epoch=3) == 5
    )
    assert warmup_steps(cfg_with(tmp_path, warmup_ratio=0.1), 25) == 3
    assert warmup_steps(cfg_with(tmp_path, warmup_ratio=0.1, warmup_steps=1), 25) == 1
