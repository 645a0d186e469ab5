"""Checks of the memory-efficient optimizer keys (GaLore, APOLLO, BAdam, Adam-mini, Muon) and pure_bf16, when the
config loads: which of them, with which optim, finetuning_type and strategy, and whether the package is installed.
A leaf (no torch); tuneforge/train/low_memory_optim.py builds them.

Strategies: each runs on one process; GaLore, APOLLO (not layer-wise), Adam-mini and Muon also under DDP (they step
whole, all-reduced gradients). None of them steps FSDP2's sharded weights or DeepSpeed's flat partitions here, and
layer-wise GaLore / APOLLO step each weight inside the backward, so there is no accumulation, clipping or loss
scaling around them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from tuneforge.config.processes import planned_processes

if TYPE_CHECKING:
    from tuneforge.config.schema import RunConfig

INSTALL = "pip install 'tuneforge[low-memory]'"
# key -> (what it is, its module, its PyPI package)
METHODS = {
    "use_galore": ("GaLore", "galore_torch", "galore-torch"),
    "use_apollo": ("APOLLO", "apollo_torch", "apollo-torch"),
    "use_badam": ("BAdam", "badam", "badam"),
    "use_adam_mini": ("Adam-mini", "adam_mini", "adam-mini"),
    "use_muon": ("Muon", "torch.optim", "torch"),
}
# the optim values each one builds on (GaLore has an AdamW, an 8-bit AdamW and an Adafactor)
BASE_OPTIMS = {
    "use_galore": ("adamw_torch", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adafactor"),
    "use_apollo": ("adamw_torch",),
    "use_adam_mini": ("adamw_torch",),
    "use_muon": ("adamw_torch",),
}


def low_memory_method(cfg: RunConfig) -> str | None:
    """The use_* key that is on, or None."""
    return next((key for key in METHODS if getattr(cfg.memory, key)), None)


def layerwise(cfg: RunConfig) -> bool:
    """Whether the optimizer steps each weight inside the backward (layer-wise GaLore / APOLLO)."""
    m = cfg.memory
    return (m.use_galore and m.galore_layerwise) or (m.use_apollo and m.apollo_layerwise)


def check_low_memory(cfg: RunConfig, fail: Callable[..., None]) -> None:
    """The first combination that cannot work for training, as a ConfigError naming its keys."""
    m, t = cfg.memory, cfg.train
    _check_pure_bf16(cfg, fail)
    on = [key for key in METHODS if getattr(m, key)]
    if len(on) > 1:
        fail(f"{' and '.join(on)} are each an optimizer; choose one", key=tuple(on))
    if not on:
        return
    key = on[0]
    name, module, package = METHODS[key]
    if importlib.util.find_spec(module) is None:
        fail(f"{key} needs the {package} package: {INSTALL}", key=key)
    finetuning = cfg.method.finetuning_type
    if key == "use_badam" and finetuning != "full":
        fail(f"use_badam trains the full weights of one block at a time: it needs finetuning_type full (got "
             f"{finetuning})", key=(key, "finetuning_type"))
    if key in ("use_galore", "use_apollo") and finetuning not in ("full", "freeze"):
        fail(f"{key} projects the gradients of full weight matrices: it needs finetuning_type full or freeze, not "
             f"{finetuning} (an adapter is already low-rank)", key=(key, "finetuning_type"))
    if key == "use_badam" and m.badam_mode == "ratio":
        fail("badam_mode ratio is not supported yet: badam's ratio optimizer sparsifies each gradient inside the "
             "backward (before accumulation and clipping see it), its scatter masks reseed torch's global random "
             "generator, and its masks are not in its state, so a run could not resume exactly; use badam_mode: "
             "layer", key=("badam_mode",))
    allowed = BASE_OPTIMS.get(key)
    if allowed is not None and t.optim not in allowed:
        fail(f"{key}: {name} builds on optim {' / '.join(allowed)}, not {t.optim}", key=(key, "optim"))
    _check_values(cfg, key, fail)
    _check_strategy(cfg, key, fail)


def _check_values(cfg: RunConfig, key: str, fail: Callable[..., None]) -> None:
    m = cfg.memory
    prefix = {"use_galore": "galore", "use_apollo": "apollo"}.get(key)
    if prefix is not None:
        for suffix in ("rank", "update_interval"):
            if getattr(m, f"{prefix}_{suffix}") < 1:
                fail(f"{prefix}_{suffix} must be >= 1 (got {getattr(m, f'{prefix}_{suffix}')})",
                     key=f"{prefix}_{suffix}")
    if key == "use_badam":
        if m.badam_switch_interval is not None and m.badam_switch_interval < 1 and m.badam_switch_interval != -1:
            fail(f"badam_switch_interval must be >= 1, or -1 to keep the first block (got {m.badam_switch_interval})",
                 key="badam_switch_interval")
        if m.badam_start_block is not None and m.badam_start_block < 0:
            fail(f"badam_start_block must be >= 0 (got {m.badam_start_block})", key="badam_start_block")
        if not 0.0 < m.badam_update_ratio <= 1.0:
            fail(f"badam_update_ratio must be in (0, 1] (got {m.badam_update_ratio})", key="badam_update_ratio")


def _check_strategy(cfg: RunConfig, key: str, fail: Callable[..., None]) -> None:
    t = cfg.train
    name = METHODS[key][0]
    if t.deepspeed is not None or t.fsdp:
        which = "deepspeed" if t.deepspeed is not None else "fsdp"
        where = "one process" if key == "use_badam" or layerwise(cfg) else "one process or several (DDP)"
        fail(f"{key}: {name} needs whole weights and gradients on each process, which {which} shards; drop {which} "
             f"({name} runs on {where})", key=(key, which))
    processes = planned_processes(cfg)
    if layerwise(cfg):
        lw = "galore_layerwise" if cfg.memory.use_galore else "apollo_layerwise"
        how = f"{lw} steps each weight inside the backward, as soon as its gradient is ready"
        if t.gradient_accumulation_steps != 1:
            fail(f"{how}, so gradients cannot accumulate: set gradient_accumulation_steps: 1 (got "
                 f"{t.gradient_accumulation_steps}), or {lw}: false", key=(lw, "gradient_accumulation_steps"))
        if t.max_grad_norm > 0:
            fail(f"{how}, before the whole gradient's norm is known, so it cannot be clipped: set max_grad_norm: 0 "
                 f"(got {t.max_grad_norm:g}), or {lw}: false", key=(lw, "max_grad_norm"))
        if t.fp16:
            fail(f"{how}, before fp16's loss scale could be taken off: use bf16 or pure_bf16, or {lw}: false",
                 key=(lw, "fp16"))
        if processes != 1:
            fail(f"{how}, before DDP has averaged it over the processes: train on one process, or {lw}: false",
                 key=lw)
    if key == "use_badam":
        if processes != 1:
            fail("use_badam runs on one process here (BAdam's multi-GPU mode needs DeepSpeed ZeRO-3's internals); "
                 "train on one process, or use_galore / use_adam_mini for several", key="use_badam")
        if t.fp16:
            fail("use_badam keeps an fp32 copy of the active block only, outside fp16's loss scaling: use bf16 or "
                 "pure_bf16", key=("use_badam", "fp16"))


def _check_pure_bf16(cfg: RunConfig, fail: Callable[..., None]) -> None:
    t = cfg.train
    if not t.pure_bf16:
        return
    if t.fp16:
        fail("pure_bf16 and fp16 are both true; choose one", key=("pure_bf16", "fp16"))
    if t.deepspeed is not None:
        fail("pure_bf16: DeepSpeed keeps its own fp32 master weights; use bf16: true with deepspeed",
             key=("pure_bf16", "deepspeed"))
    if t.fsdp:
        fail("pure_bf16 is not supported with fsdp here; use bf16: true (FSDP2's bf16 compute, fp32 weights)",
             key=("pure_bf16", "fsdp"))
