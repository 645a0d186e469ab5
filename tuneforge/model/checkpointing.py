"""Gradient checkpointing per decoder layer, from a memory estimate.

Checkpointing a layer keeps only its input for backward and runs its forward again there: a third more compute
for the layer (measured on W1, all 30 layers of SmolLM2-135M: 1.5x the tokens/s without it, docs/performance.md).
`disable_gradient_checkpointing` left unset (null) checkpoints only as many layers as the memory needs: the
activations of the largest possible micro-batch (per_device_train_batch_size x cutoff_len tokens) are estimated
per layer and compared with a budget, half the memory this process can still take (the device's free memory,
or the machine's available memory on a CPU, shared by the processes of this machine). The first layers are
checkpointed until the rest fit. `false` checkpoints every layer, `true` none: the user's setting always wins.

The estimate, per token and layer, of what autograd keeps of a decoder layer under bf16 / fp16 autocast:
two norms (their fp32 input and output, and the half-precision result: 10 bytes per hidden unit each),
attention (projections, rotary, output: ~14 bytes per hidden unit) and the gated MLP (four intermediate-sized
tensors: 8 bytes per unit); twice that in fp32. On W1 it gives 32 KB per token and layer, where 30 layers
without checkpointing measured ~35 KB (740 MiB more peak memory for a 708-token micro-batch).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)
BUDGET_SHARE = 0.5  # of the memory still available: the rest is for the optimizer, the head's chunks, the data
SAFETY = 1.25  # the estimate's margin (allocator fragmentation, family differences)


@dataclass(frozen=True)
class Plan:
    checkpointed: int  # the first `checkpointed` decoder layers
    layers: int
    per_layer_bytes: float  # activations of one layer for the largest micro-batch
    budget_bytes: float

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.checkpointed} of {self.layers} decoder layers (activations ~"
                f"{self.per_layer_bytes * self.layers / gib:.2f} GiB without checkpointing, budget "
                f"{self.budget_bytes / gib:.2f} GiB)")


def activation_bytes_per_token(config: Any, half: bool) -> float:
    """What one decoder layer keeps for backward per token (see the module docstring), in bytes."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    experts = getattr(config, "num_experts_per_tok", None)
    moe = getattr(config, "moe_intermediate_size", None)
    if experts and moe:  # a mixture of experts: the active experts' intermediate tensors
        intermediate = experts * moe
    per_token = 34 * hidden + 8 * intermediate  # bytes under half-precision autocast
    return per_token * (1 if half else 2) * SAFETY


def available_bytes(device: torch.device) -> float:
    """Memory this process may still take: the device's free memory, or the machine's available memory (shared
    by this machine's processes) on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        free = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return free / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def plan(config: Any, layers: int, max_tokens: int, half: bool, available: float) -> Plan:
    """How many of the first layers to checkpoint so that the others' activations fit the budget."""
    per_layer = activation_bytes_per_token(config, half) * max_tokens
    budget = available * BUDGET_SHARE
    needed = 0 if per_layer * layers <= budget else math.ceil((per_layer * layers - budget) / per_layer)
    return Plan(min(needed, layers), layers, per_layer, budget)


def checkpoint_by_memory(model: nn.Module, layers: nn.ModuleList, cfg: Any, device: torch.device,
                         reserved: float = 0.0) -> Plan | None:
    """Leave checkpointing on for the first layers the plan needs, off for the others (checkpointing already
    enabled on every layer by transformers). reserved: bytes still to come outside the activations (gradients and
    optimizer states). None when the layers do not take per-layer checkpointing."""
    if not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    t = cfg.train
    max_tokens = t.per_device_train_batch_size * cfg.data.cutoff_len
    chosen = plan(config, len(layers), max_tokens, t.bf16 or t.fp16 or t.pure_bf16,
                  available_bytes(device) - reserved)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < chosen.checkpointed
    logger.info("gradient checkpointing (from the memory estimate): %s", chosen.describe())
    return chosen
