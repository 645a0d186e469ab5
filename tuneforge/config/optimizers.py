"""The `optim` values: every name transformers' OptimizerNames has, which of them tuneforge builds (with the same
class and arguments as transformers' Trainer), what each reads from `optim_args`, and why the others are refused.
Checked when the config loads (a leaf: no torch); tuneforge.train.optim builds them.

`optim_args` is transformers' "key=value,key2=value2" string. Each optimizer reads the keys transformers reads for it,
typed (transformers hands a few of them on as strings); a key the optimizer does not read is refused rather than
ignored. `weight_decay` is never one: the parameter groups carry the weight_decay key, so it would be overridden.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tuneforge.flags import parse_flag

if TYPE_CHECKING:
    from tuneforge.config.schema import RunConfig

BNB = ("bitsandbytes", "pip install 'tuneforge[optim]' (bitsandbytes)")
TORCHAO = ("torchao", "pip install 'tuneforge[optim]' (torchao >= 0.16)")


@dataclass(frozen=True)
class OptimizerSpec:
    """name: the optim value. cls: "module:Class" of the optimizer. hyper: which config keys it takes besides
    learning_rate: "adam" (betas from adam_beta1 / adam_beta2, eps from adam_epsilon), "betas" (the betas only),
    "ademamix" (three betas, alpha and eps: optim_args, else adam_beta1 / adam_beta2 / adam_epsilon) or "" (none).
    fixed: constructor arguments the name implies (bnb's optim_bits / is_paged, fused, Adafactor's external schedule).
    options: the optim_args keys it reads -> their type. needs: (module, how to install it) for a package beyond torch
    and transformers. sharded: it steps FSDP2's sharded weights (DTensors); measured on 2 CPU processes: torch's and
    torchao's optimizers do, bitsandbytes' kernels and Adafactor's factored moments do not (DeepSpeed ZeRO hands the
    optimizer plain flat partitions: bitsandbytes', Adafactor and torchao's ran there)."""

    name: str
    cls: str
    hyper: str = ""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, type] = field(default_factory=dict)
    needs: tuple[str, str] | None = None
    sharded: bool = True


def _bnb(name: str, cls: str, hyper: str, options: Mapping[str, type] | None = None) -> OptimizerSpec:
    """A bitsandbytes optimizer: 8-bit states when the name says 8bit, paged when it says paged (transformers'
    reading of the names; RMSprop has no paged variant)."""
    fixed: dict[str, Any] = {"optim_bits": 8 if "8bit" in name else 32}
    if cls != "RMSprop":
        fixed["is_paged"] = "paged" in name
    return OptimizerSpec(name, f"bitsandbytes.optim:{cls}", hyper, fixed, options or {}, BNB, sharded=False)


RMSPROP_OPTIONS = {"momentum": float, "alpha": float, "eps": float}
ADEMAMIX_OPTIONS = {"beta1": float, "beta2": float, "beta3": float, "alpha": float, "eps": float, "t_alpha": int,
                    "t_beta3": int}
TORCHAO_DEFAULTS = {"block_size": 256, "bf16_stochastic_round": False}  # transformers' (also for 4-bit)
TORCHAO_OPTIONS = {"block_size": int, "bf16_stochastic_round": bool}

OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adamw_torch", "torch.optim:AdamW", "adam"),
    OptimizerSpec("adamw_torch_fused", "torch.optim:AdamW", "adam", {"fused": True}),
    OptimizerSpec("adamw_torch_4bit", "torchao.optim:AdamW4bit", "adam", TORCHAO_DEFAULTS, TORCHAO_OPTIONS, TORCHAO),
    OptimizerSpec("adamw_torch_8bit", "torchao.optim:AdamW8bit", "adam", TORCHAO_DEFAULTS, TORCHAO_OPTIONS, TORCHAO),
    OptimizerSpec("adafactor", "transformers.optimization:Adafactor", "",
                  {"scale_parameter": False, "relative_step": False},  # the learning rate comes from the schedule
                  sharded=False),
    OptimizerSpec("sgd", "torch.optim:SGD", options={"momentum": float, "dampening": float, "nesterov": bool}),
    OptimizerSpec("adagrad", "torch.optim:Adagrad", options={"lr_decay": float, "eps": float}),
    OptimizerSpec("rmsprop", "torch.optim:RMSprop", options={**RMSPROP_OPTIONS, "centered": bool}),
    *(_bnb(n, "AdamW", "adam") for n in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit")),
    *(_bnb(n, "Lion", "betas") for n in ("lion_8bit", "lion_32bit", "paged_lion_32bit", "paged_lion_8bit")),
    *(_bnb(n, "RMSprop", "", RMSPROP_OPTIONS) for n in ("rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")),
    *(_bnb(n, "AdEMAMix", "ademamix", ADEMAMIX_OPTIONS)
      for n in ("ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit")),
)}
OPTIMIZER_CHOICES = tuple(OPTIMIZERS)

_NOT_YET = "is not supported by tuneforge yet"


def _low_rank_name(name: str, method: str) -> str:
    """Where transformers' galore_* / apollo_* optim names went: LlamaFactory's keys, with the plain base optim."""
    base = name.removeprefix(f"{method}_").removesuffix("_layerwise")
    base = {"adamw": "adamw_torch"}.get(base, base)
    layerwise = f", {method}_layerwise: true" if name.endswith("_layerwise") else ""
    return (f"is transformers' name; tuneforge spells it as LlamaFactory does: use_{method}: true{layerwise} with "
            f"optim: {base} ({method}_target picks the layers, as transformers' optim_target_modules)")
# transformers' other optimizer names -> why tuneforge does not build them
REFUSED: dict[str, str] = {
    "adamw_torch_xla": "is for TPUs (torch_xla); tuneforge runs on CUDA or the CPU: use adamw_torch",
    "adamw_torch_npu_fused": "is for Ascend NPUs (torch_npu); tuneforge runs on CUDA or the CPU: use "
                             "adamw_torch_fused",
    "adamw_anyprecision": "needs torchdistx, which is no longer maintained nor built for current torch: use "
                          "adamw_torch, or adamw_torch_8bit / adamw_8bit for low-memory states",
    # transformers' GaLore / APOLLO names: tuneforge spells them as LlamaFactory does (use_galore / use_apollo keys)
    **{name: _low_rank_name(name, "galore") for name in ("galore_adamw", "galore_adamw_8bit", "galore_adafactor",
                                                          "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
                                                          "galore_adafactor_layerwise")},
    **{name: _low_rank_name(name, "apollo") for name in ("apollo_adamw", "apollo_adamw_layerwise")},
    "lomo": f"{_NOT_YET} (LOMO fuses the update into the backward pass); use adamw_torch or sgd",
    "adalomo": f"{_NOT_YET} (AdaLomo fuses the update into the backward pass); use adamw_torch or adafactor",
    "grokadamw": f"{_NOT_YET}; use adamw_torch",
    "stable_adamw": f"{_NOT_YET}; use adamw_torch",
    **{name: f"{_NOT_YET} (schedule-free optimizers switch the weights between train and eval mode); use "
             f"adamw_torch with a schedule" for name in ("schedule_free_radam", "schedule_free_adamw",
                                                          "schedule_free_sgd")},
}


def parse_optim_args(text: str | None, spec: OptimizerSpec) -> dict[str, Any]:
    """transformers' "key=value,key2=value2" (spaces dropped) as the optimizer's typed keyword arguments; raises
    ValueError saying what is wrong."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for item in text.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep or not key or "=" in value:
            raise ValueError(f"{item!r} is not key=value (write e.g. \"momentum=0.9,nesterov=true\")")
        if key == "weight_decay":
            raise ValueError("weight_decay is its own key (weight_decay: 0.01); the parameter groups carry it, so "
                             "it would be overridden here (transformers ignores it too)")
        if key not in spec.options:
            reads = ", ".join(spec.options) or "none (transformers passes it no optim_args)"
            raise ValueError(f"{spec.name} does not read {key!r} (it reads: {reads})")
        kind = spec.options[key]
        try:
            if kind is bool:
                flag = parse_flag(value)
                if flag is None:
                    raise ValueError
                out[key] = flag
            else:
                out[key] = kind(value)
        except ValueError:
            wanted = {bool: "true or false", int: "a whole number", float: "a number"}[kind]
            raise ValueError(f"{key}={value} is not {wanted}") from None
    return out


def check_optimizer(cfg: RunConfig, fail: Callable[..., None]) -> None:
    """optim is one tuneforge builds, its package is installed, and optim_args are keys it reads."""
    t = cfg.train
    if t.optim in REFUSED:  # a RunConfig built in code skips the loader's choices check
        fail(f"optim {t.optim} {REFUSED[t.optim]}", key="optim")
    spec = OPTIMIZERS.get(t.optim)
    if spec is None:
        fail(f"optim {t.optim!r} is not an optimizer name; available: {', '.join(OPTIMIZERS)}", key="optim")
    if spec.needs is not None and importlib.util.find_spec(spec.needs[0]) is None:
        fail(f"optim {t.optim} needs {spec.needs[0]}: {spec.needs[1]}, or choose adamw_torch", key="optim")
    try:
        options = parse_optim_args(t.optim_args, spec)
    except ValueError as e:
        fail(f"optim_args: {e}", key=("optim_args", "optim"))
    if options.get("block_size", 1) < 1:
        fail("optim_args block_size must be >= 1", key="optim_args")
    if spec.needs == TORCHAO and t.lr_scheduler_type == "greedy":  # torchao keeps lr as a tensor; GreedyLR sets floats
        fail(f"lr_scheduler_type greedy cannot drive optim {t.optim} (torchao's optimizers keep the learning rate as "
             f"a tensor, which greedy replaces by a number); use reduce_lr_on_plateau, or optim adamw_8bit",
             key=("lr_scheduler_type", "optim"))
