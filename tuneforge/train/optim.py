"""Optimizer, parameter groups and learning-rate schedule.

Weight decay never applies to biases and norm weights (1-D tensors, or names containing "norm").
LoRA+ (loraplus_lr_ratio) trains lora_B with learning_rate x ratio and lora_embedding_B with
loraplus_lr_embedding. Every group carries a `name`, its `param_names`, and `lr_scale` (its lr relative
to learning_rate) so logs and tests can tell them apart.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers import get_scheduler

from tuneforge.config import RunConfig
from tuneforge.errors import ConfigError

logger = logging.getLogger(__name__)


def uses_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Matrices decay; biases and norm weights (1-D, or named *norm*) do not."""
    return param.ndim >= 2 and "norm" not in name.lower() and not name.endswith("bias")


def _group_of(name: str, cfg: RunConfig) -> tuple[str, float | None]:
    """(group name, learning rate or None for the base rate) of one trainable parameter."""
    method, lr = cfg.method, cfg.train.learning_rate
    if method.loraplus_lr_ratio is not None:
        if "lora_embedding_B" in name:
            return "lora_embedding_B", method.loraplus_lr_embedding
        if "lora_B" in name:
            return "lora_B", lr * method.loraplus_lr_ratio
    return "base", None


def param_groups(model: torch.nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """Trainable parameters split by (learning rate, weight decay), base groups first."""
    t = cfg.train
    groups: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        kind, lr = _group_of(name, cfg)
        decay = uses_weight_decay(name, param)
        key = kind if decay else f"{kind}_no_decay"
        if key not in groups:
            group_lr = t.learning_rate if lr is None else lr
            groups[key] = {
                "name": key,
                "params": [],
                "param_names": [],
                "lr": group_lr,
                "lr_scale": group_lr / t.learning_rate,
                "weight_decay": t.weight_decay if decay else 0.0,
            }
        groups[key]["params"].append(param)
        groups[key]["param_names"].append(name)
    if not groups:
        raise ConfigError(
            f"{cfg.source}: the model has no trainable parameters; check finetuning_type "
            f"('{cfg.method.finetuning_type}') and lora_target / freeze_trainable_layers"
        )
    order = [
        "base",
        "base_no_decay",
        "lora_B",
        "lora_B_no_decay",
        "lora_embedding_B",
        "lora_embedding_B_no_decay",
    ]
    return [groups[k] for k in order if k in groups]


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """adamw_torch | adamw_torch_fused | sgd over param_groups(model, cfg)."""
    t = cfg.train
    groups = param_groups(model, cfg)
    for g in groups:
        logger.debug(
            "param group %s: %d tensors, lr %.3g, weight decay %g",
            g["name"],
            len(g["params"]),
            g["lr"],
            g["weight_decay"],
        )
    if t.optim == "sgd":
        return torch.optim.SGD(groups, lr=t.learning_rate)
    return torch.optim.AdamW(
        groups,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        fused=True if t.optim == "adamw_torch_fused" else None,
    )


def total_training_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """max_steps when > 0, else ceil(num_train_epochs x steps_per_epoch) (fractional epochs allowed)."""
    t = cfg.train
    if t.max_steps > 0:
        return t.max_steps
    return max(1, math.ceil(t.num_train_epochs * steps_per_epoch))


def warmup_steps(cfg: RunConfig, total_steps: int) -> int:
    """warmup_steps when > 0, else ceil(warmup_ratio x total_steps)."""
    t = cfg.train
    return t.warmup_steps if t.warmup_steps > 0 else math.ceil(t.warmup_ratio * total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers.get_scheduler for lr_scheduler_type, with lr_scheduler_kwargs passed through."""
    t = cfg.train
    # lr_scheduler_kwargs were checked against the schedule's arguments when the config loaded
    return get_scheduler(
        t.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup_steps(cfg, total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=dict(t.lr_scheduler_kwargs) or None,
    )


def base_learning_rate(optimizer: torch.optim.Optimizer) -> float:
    """The current learning rate of the base groups (what the user set as learning_rate, scheduled)."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)
