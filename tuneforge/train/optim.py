"""Optimizer, parameter groups and learning-rate schedule: the classes and schedules of transformers' names
(tuneforge/config/optimizers.py and schedules.py say which, and check a config's values when it loads).

Weight decay never applies to biases and norm weights (1-D tensors, or names containing "norm").
LoRA+ (loraplus_lr_ratio) trains lora_B with learning_rate x ratio and lora_embedding_B with
loraplus_lr_embedding. Every group carries a `name`, its `param_names`, and `lr_scale` (its lr relative
to learning_rate) so logs and tests can tell them apart.
"""

from __future__ import annotations

import importlib
import logging
import math
import warnings
from typing import Any

import torch
from transformers import get_scheduler

from tuneforge.config import RunConfig, schedules
from tuneforge.config.optimizers import OPTIMIZERS, parse_optim_args
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


def optimizer_class_and_kwargs(cfg: RunConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and keyword arguments of cfg's optim, as transformers' Trainer builds that name (the table in
    tuneforge/config/optimizers.py), with optim_args typed."""
    t = cfg.train
    spec = OPTIMIZERS[t.optim]
    module, _, name = spec.cls.partition(":")
    cls = getattr(importlib.import_module(module), name)
    options = parse_optim_args(t.optim_args, spec)
    kwargs: dict[str, Any] = {"lr": t.learning_rate}
    if spec.hyper == "adam":
        kwargs.update(betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon)
    elif spec.hyper == "betas":
        kwargs["betas"] = (t.adam_beta1, t.adam_beta2)
    elif spec.hyper == "ademamix":  # three betas and alpha; optim_args win over the adam keys
        betas = (options.pop("beta1", t.adam_beta1), options.pop("beta2", t.adam_beta2), options.pop("beta3", 0.9999))
        kwargs.update(betas=betas, alpha=options.pop("alpha", 5.0), eps=options.pop("eps", t.adam_epsilon))
    return cls, {**kwargs, **spec.fixed, **options}


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """cfg's optim over param_groups(model, cfg): each group keeps its own learning rate and weight decay; or the
    memory-efficient optimizer a use_* key asks for (train/low_memory_optim.py)."""
    from tuneforge.train.low_memory_optim import build_low_memory_optimizer  # it builds on this module

    low_memory = build_low_memory_optimizer(model, cfg)
    if low_memory is not None:
        return low_memory
    groups = param_groups(model, cfg)
    for g in groups:
        logger.debug(
            "param group %s: %d tensors, lr %.3g, weight decay %g",
            g["name"],
            len(g["params"]),
            g["lr"],
            g["weight_decay"],
        )
    cls, kwargs = optimizer_class_and_kwargs(cfg)
    device = groups[0]["params"][0].device
    if cfg.train.optim.startswith("paged_") and device.type != "cuda":
        logger.warning("optim %s: paging needs CUDA; on %s bitsandbytes runs it unpaged (the same updates)",
                       cfg.train.optim, device.type)
        # bitsandbytes says the same at the first step, from each of its state initializers
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    return cls(groups, **kwargs)


def total_training_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """max_steps when > 0, else ceil(num_train_epochs x steps_per_epoch) (fractional epochs allowed)."""
    t = cfg.train
    if t.max_steps > 0:
        return t.max_steps
    return max(1, math.ceil(t.num_train_epochs * steps_per_epoch))


def warmup_steps(cfg: RunConfig, total_steps: int) -> int:
    """warmup_steps when > 0, else ceil(warmup_ratio x total_steps)."""
    return schedules.warmup_steps(cfg.train, total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int) -> Any:
    """transformers.get_scheduler for lr_scheduler_type, with lr_scheduler_kwargs passed through (for
    warmup_stable_decay, the stable and decay phases LlamaFactory fills in when they are not given)."""
    t = cfg.train
    schedule = schedules.SCHEDULES[t.lr_scheduler_type]
    warmup = warmup_steps(cfg, total_steps)
    kwargs = dict(t.lr_scheduler_kwargs)  # checked against the schedule's arguments when the config loaded
    if warmup and not schedule.warmup:
        logger.warning("lr_scheduler_type %s has no warm-up (as in transformers): warmup_steps / warmup_ratio "
                       "change nothing", schedule.name)
    if schedule.name == "warmup_stable_decay":
        def fail(msg: str, key: Any = None) -> None:
            raise ConfigError(f"{cfg.source}: {msg}", key=key)

        schedules.check_stable_decay(kwargs, warmup, total_steps, fail)
        kwargs.update(schedules.stable_decay_steps(kwargs, warmup, total_steps))
    try:
        with warnings.catch_warnings():  # warmup_stable_decay: its phases are given, so the total is not needed
            warnings.filterwarnings("ignore", message="Both num_training_steps and num_stable_steps")
            return get_scheduler(
                t.lr_scheduler_type,
                optimizer,
                num_warmup_steps=warmup,
                num_training_steps=total_steps,
                scheduler_specific_kwargs=kwargs or None,
            )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{cfg.source}: lr_scheduler_type {t.lr_scheduler_type} with lr_scheduler_kwargs "
                          f"{t.lr_scheduler_kwargs}: {e}", key=("lr_scheduler_type", "lr_scheduler_kwargs")) from None


def base_learning_rate(optimizer: torch.optim.Optimizer) -> float:
    """The current learning rate of the base groups (what the user set as learning_rate, scheduled)."""
    group = optimizer.param_groups[0]
    return float(group["lr"]) / group.get("lr_scale", 1.0)  # float: torchao keeps it as a tensor
