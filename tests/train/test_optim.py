"""Parameter groups, LoRA+ learning rates, every schedule against hand-computed values, and every optimizer
against its own class built by hand."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from train_helpers import make_cfg
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.config.optimizers import OPTIMIZERS
from tuneforge.errors import ConfigError
from tuneforge.train.optim import (
    base_learning_rate,
    build_optimizer,
    build_scheduler,
    optimizer_class_and_kwargs,
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
    cfg = cfg_with(tmp_path, learning_rate=1.0, max_steps=total, **keys)
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


# ---- every schedule transformers has, against hand-computed learning rates (learning_rate 1.0, 10 steps) ----


def test_cosine_with_restarts(tmp_path):
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="cosine_with_restarts", warmup_steps=2,
                   lr_scheduler_kwargs={"num_cycles": 2})
    expected = [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * ((2 * (s - 2) / 8) % 1.0))) for s in range(2, 10)]
    assert lrs == pytest.approx(expected)
    assert lrs[6] == pytest.approx(1.0)  # the restart: half-way through the decay, back at the peak


def test_polynomial_decay_to_lr_end(tmp_path):
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="polynomial", warmup_steps=2,
                   lr_scheduler_kwargs={"lr_end": 0.1, "power": 2.0})
    expected = [0.0, 0.5] + [0.9 * (1 - (s - 2) / 8) ** 2 + 0.1 for s in range(2, 10)]
    assert lrs == pytest.approx(expected)


def test_constant_schedules(tmp_path):
    assert lrs_over(tmp_path, 5, lr_scheduler_type="constant") == pytest.approx([1.0] * 5)
    warm = lrs_over(tmp_path, 5, lr_scheduler_type="constant_with_warmup", warmup_steps=2)
    assert warm == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])


def test_inverse_sqrt(tmp_path):
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="inverse_sqrt", warmup_steps=2)  # timescale: the warm-up
    assert lrs == pytest.approx([0.0, 0.5] + [1 / math.sqrt(s / 2) for s in range(2, 10)])
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="inverse_sqrt", warmup_steps=2,
                   lr_scheduler_kwargs={"timescale": 4})
    assert lrs == pytest.approx([0.0, 0.5] + [1 / math.sqrt((s + 2) / 4) for s in range(2, 10)])


def test_cosine_warmup_with_min_lr(tmp_path):
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="cosine_warmup_with_min_lr", warmup_steps=3,
                   lr_scheduler_kwargs={"min_lr_rate": 0.1})
    # its warm-up starts at 1/warmup and reaches the peak on the last warm-up step; the decay counts from 1
    expected = [(s + 1) / 3 for s in range(3)] + [
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3 + 1) / 7)) for s in range(3, 10)
    ]
    assert lrs == pytest.approx(expected)


def test_warmup_stable_decay_fills_its_phases_as_llamafactory(tmp_path):
    # 1 warm-up step; the 9 after it: 9 // 3 = 3 stable, 6 decaying (cosine, to 0)
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="warmup_stable_decay", warmup_steps=1)
    assert lrs == pytest.approx([0.0, 1.0, 1.0, 1.0] + [0.5 * (1 + math.cos(math.pi * (s - 4) / 6))
                                                         for s in range(4, 10)])
    # a given decay (4 linear steps to 0.1): the stable phase is still a third of the rest, then the floor
    lrs = lrs_over(tmp_path, 10, lr_scheduler_type="warmup_stable_decay", warmup_steps=1,
                   lr_scheduler_kwargs={"num_decay_steps": 4, "decay_type": "linear", "min_lr_ratio": 0.1})
    assert lrs == pytest.approx([0.1, 1.0, 1.0, 1.0] + [0.1 + 0.9 * (1 - (s - 4) / 4) for s in range(4, 8)]
                                + [0.1, 0.1])


def test_warmup_stable_decay_that_does_not_fit_is_refused_before_training(tmp_path):
    cfg = cfg_with(tmp_path, lr_scheduler_type="warmup_stable_decay", max_steps=-1, num_train_epochs=1,
                   lr_scheduler_kwargs={"num_decay_steps": 20})
    with pytest.raises(ConfigError, match="more than the run's 10 steps") as raised:
        build_scheduler(build_optimizer(small_llama(), cfg), cfg, 10)
    assert "lr_scheduler_kwargs" in raised.value.keys


@pytest.mark.parametrize("kind", ["reduce_lr_on_plateau", "greedy"])
def test_metric_schedules_follow_the_metric(tmp_path, kind):
    kwargs = {"factor": 0.5, "patience": 1, "threshold": 0.0, "threshold_mode": "abs", "min_lr": 0.0, "mode": "min"}
    if kind == "greedy":
        kwargs["max_lr"] = 10.0  # its default caps the learning rate at 1
    cfg = cfg_with(tmp_path, learning_rate=1.0, lr_scheduler_type=kind, eval_strategy="steps",
                   lr_scheduler_kwargs=kwargs)
    optimizer = build_optimizer(small_llama(), cfg)
    scheduler = build_scheduler(optimizer, cfg, 10)
    lrs = []
    for metric in (3.0, 2.0, 2.5, 2.5, 2.5, 2.5):
        scheduler.step(metric)
        lrs.append(base_learning_rate(optimizer))
    if kind == "reduce_lr_on_plateau":  # halves after more than `patience` evaluations without a new best
        assert lrs == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 0.25])
    else:  # greedy also doubles after more than `patience` improvements in a row
        assert lrs == pytest.approx([1.0, 2.0, 2.0, 1.0, 1.0, 0.5])


# ---- optimizers: transformers' classes and arguments, and one step as the optimizer built by hand ----

LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.95), 1e-6, 0.1


def by_hand(name: str) -> Callable:
    """The optimizer each name means, built directly from its library's own class."""
    import bitsandbytes.optim as bnb
    from transformers.optimization import Adafactor

    adam = {"lr": LR, "betas": BETAS, "eps": EPS}
    ademamix = {"lr": LR, "betas": (*BETAS, 0.9999), "alpha": 5.0, "eps": EPS}
    if name.startswith("adamw_torch_") and name[-4:] in ("4bit", "8bit"):
        import torchao.optim

        cls = torchao.optim.AdamW4bit if name.endswith("4bit") else torchao.optim.AdamW8bit
        return lambda groups: cls(groups, block_size=256, **adam)
    table = {
        "adamw_torch": lambda g: torch.optim.AdamW(g, **adam),
        "adamw_torch_fused": lambda g: torch.optim.AdamW(g, fused=True, **adam),
        "adafactor": lambda g: Adafactor(g, lr=LR, scale_parameter=False, relative_step=False),
        "sgd": lambda g: torch.optim.SGD(g, lr=LR),
        "adagrad": lambda g: torch.optim.Adagrad(g, lr=LR),
        "rmsprop": lambda g: torch.optim.RMSprop(g, lr=LR),
        "adamw_bnb_8bit": lambda g: bnb.AdamW8bit(g, **adam),
        "adamw_8bit": lambda g: bnb.AdamW8bit(g, **adam),
        "paged_adamw_32bit": lambda g: bnb.PagedAdamW32bit(g, **adam),
        "paged_adamw_8bit": lambda g: bnb.PagedAdamW8bit(g, **adam),
        "lion_8bit": lambda g: bnb.Lion8bit(g, lr=LR, betas=BETAS),
        "lion_32bit": lambda g: bnb.Lion32bit(g, lr=LR, betas=BETAS),
        "paged_lion_32bit": lambda g: bnb.PagedLion32bit(g, lr=LR, betas=BETAS),
        "paged_lion_8bit": lambda g: bnb.PagedLion8bit(g, lr=LR, betas=BETAS),
        "rmsprop_bnb": lambda g: bnb.RMSprop32bit(g, lr=LR),
        "rmsprop_bnb_8bit": lambda g: bnb.RMSprop8bit(g, lr=LR),
        "rmsprop_bnb_32bit": lambda g: bnb.RMSprop32bit(g, lr=LR),
        # (bitsandbytes 0.50's AdEMAMix32bit class keeps one state instead of AdEMAMix's two and fails on the CPU;
        # transformers, and so tuneforge, build AdEMAMix with optim_bits=32)
        "ademamix": lambda g: bnb.AdEMAMix(g, optim_bits=32, **ademamix),
        "ademamix_8bit": lambda g: bnb.AdEMAMix8bit(g, **ademamix),
        "paged_ademamix_32bit": lambda g: bnb.PagedAdEMAMix(g, optim_bits=32, **ademamix),
        "paged_ademamix_8bit": lambda g: bnb.PagedAdEMAMix8bit(g, **ademamix),
    }
    return table[name]


def wide_llama() -> LlamaForCausalLM:
    """Matrices of 4096+ values (a multiple of 256): 8-bit / 4-bit optimizers quantize their states."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def two_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_step_is_the_optimizers_own(tmp_path, name):
    cfg = cfg_with(tmp_path, optim=name, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                   adam_epsilon=EPS, weight_decay=DECAY)
    ours, theirs = wide_llama(), wide_llama()
    initial = {n: p.detach().clone() for n, p in ours.named_parameters()}
    optimizer = build_optimizer(ours, cfg)
    two_steps(ours, optimizer)
    # by hand: matrices decay, the 1-D norm weights do not
    params = list(theirs.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    reference = by_hand(name)(groups)
    two_steps(theirs, reference)
    for (key, mine), other in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(mine, other, rtol=0, atol=0, msg=key)
    assert not torch.equal(initial["model.layers.0.self_attn.q_proj.weight"], ours.model.layers[0].self_attn.q_proj.weight)
    if "8bit" in name or "4bit" in name:  # the large matrices' states really are low-bit
        state = optimizer.state[ours.model.layers[0].self_attn.q_proj.weight]
        assert any(v.element_size() == 1 or "OptimState" in type(v).__name__
                   for v in state.values() if torch.is_tensor(v))


def test_mapping_is_transformers_own(tmp_path):
    """Each name's class and arguments are what transformers' Trainer builds for it (optim_args typed)."""
    from accelerate.state import PartialState
    from transformers import Trainer, TrainingArguments

    cases = [(name, None) for name in OPTIMIZERS] + [
        ("sgd", "momentum=0.9,nesterov=true,dampening=0"), ("adagrad", "lr_decay=0.01,eps=1e-9"),
        ("rmsprop", "momentum=0.5,alpha=0.9,centered=true"),
        ("ademamix_8bit", "beta3=0.999,alpha=8,t_alpha=100,eps=1e-7"),
    ]
    try:
        for name, optim_args in cases:
            cfg = cfg_with(tmp_path, optim=name, optim_args=optim_args, adam_beta2=0.95, adam_epsilon=1e-6)
            args = TrainingArguments(output_dir=str(tmp_path), optim=name, optim_args=optim_args, learning_rate=1e-3,
                                     adam_beta2=0.95, adam_epsilon=1e-6, report_to="none")
            assert optimizer_class_and_kwargs(cfg) == Trainer.get_optimizer_cls_and_kwargs(args), name
    finally:
        PartialState._reset_state()  # TrainingArguments sets up accelerate's process state


def test_optim_args_reach_the_optimizer_typed(tmp_path):
    model = small_llama()
    sgd = build_optimizer(model, cfg_with(tmp_path, optim="sgd", optim_args="momentum=0.9, nesterov=true"))
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True
    # transformers hands these on as strings; the optimizers get numbers
    rms = build_optimizer(model, cfg_with(tmp_path, optim="rmsprop_bnb_8bit", optim_args="alpha=0.9,momentum=0.5"))
    assert rms.defaults["betas"] == (0.9, 0.5)  # bitsandbytes keeps (alpha, momentum) as its betas
    cls, kwargs = optimizer_class_and_kwargs(cfg_with(tmp_path, optim="adamw_torch_8bit", optim_args="block_size=128"))
    assert kwargs["block_size"] == 128 and cls.__name__ == "AdamW8bit"
