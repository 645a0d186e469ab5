"""Gradient checkpointing per decoder layer, from a memory estimate.

A decoder layer keeps, for backward, the inputs of each of its operations (`none`); full checkpointing keeps only
the layer's input and runs its forward again in backward (`full`: a third more compute for the layer); selective
checkpointing (torch's create_selective_checkpoint_contexts) keeps the outputs of its large matrix products and of
attention, and recomputes only the cheap rest — norms, rotary, activations, the adapters' rank-sized products
(`selective`). Measured on W1 (SmolLM2-135M LoRA, 2 CPU cores, docs/performance.md): in bf16 none gave 1.30x the
tokens/s of full and selective 1.09x, at 1.4x and 1.3x full's peak memory; in fp32 none 1.40x, selective 1.19x
(selective's cost: every operation of the layer passes torch's Python dispatch mode that applies the policy).

`disable_gradient_checkpointing` left unset (null) chooses per layer, the fastest the memory budget holds: no
checkpointing on as many layers as it holds once every layer has at least selective, selective on as many as it
holds once every layer has at least full, full on the others (the first ones). The budget is half the memory this
process can still take (the device's free memory after the weights, less the gradients and optimizer states to
come; on a CPU the machine's available memory, shared by this machine's processes), for the largest possible
micro-batch (per_device_train_batch_size x cutoff_len tokens per sequence, times the sequences a sample holds: a
pair's two, an RL prompt's sampled answers). `false` checkpoints every layer fully, `true` none: the user's
setting always wins.

The plan at load is for the largest possible micro-batch; in training each micro-batch gets the plan for the tokens
it holds (`LayerModes.apply`), so a short one keeps more layers unchecked within the same budget. Its activations
are also capped (`LayerModes.choose_cap`): the peak of a run is set by its largest micro-batches, which are rare on
data of mixed lengths. From a sample of the epoch's micro-batches the trainer takes the smallest token count whose
cap costs at most RECOMPUTE_SHARE more compute: a micro-batch above it checkpoints as many layers as keep its
activations within what one of `cap` tokens keeps with none checkpointed (W1 in fp32: the peak from 2.5 to 2.1 GiB
for ~2 % of the time, docs/performance.md).

Under DeepSpeed, FSDP, sequence parallelism or torch_compile every layer keeps full checkpointing (`selective_fits`;
load.py).

The estimates, in bytes per token and layer under bf16 / fp16 autocast (twice that in fp32), for a Llama-style
layer (hidden h, key/value width kv, intermediate i): none ≈ 34h + 8i (the norms keep fp32 copies, the MLP four
intermediate-sized tensors); selective ≈ 10h + 4kv + 4i (the outputs of the seven products and of attention, the
layer's input); full ≈ 2h. On W1's 30 layers none measured ~35 KB per token in bf16 (before RMSNorm was fused and
the adapters' fp32 input copies went; the estimate gives 32) and ~49 KB in fp32 (the estimate: 64). A lean layer
(fused norms, lean MLP, frozen weights in the compute dtype: `keeps_lean`) keeps its input, q, k, v, attention's
output, the second norm's input, gate and up, the rest being recipes (recompute.py): none ≈ 10h + 4kv + 4i (8h on
padding-free batches), no more than selective, so its layers go from full straight to none. Measured on W1: 22.8 KB
per token in fp32, 11.5 in bf16 (the estimates: 25.3 and 12.7, before the margin).
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from tuneforge.batch import PAIRED_ROWS
from tuneforge.config.rl import resolved_rl
from tuneforge.model.fused_norm import is_fused
from tuneforge.model.lean_mlp import is_lean
from tuneforge.stages import stage_of

logger = logging.getLogger(__name__)
BUDGET_SHARE = 0.5  # of the memory still available: the rest is for the head's chunks, the data, the allocator
SAFETY = 1.25  # the estimates' margin (allocator fragmentation, family differences)
# products whose inner dimension is below this are recomputed (a LoRA adapter's second product: rank-sized inner
# dimension, output as large as the layer's); above it their outputs are kept
SAVED_INNER_DIM = 256
# the compute the activation cap may add, as a share of the sampled micro-batches' layer compute
RECOMPUTE_SHARE = 0.02
# what running a layer's forward again costs in backward, as a share of the layer's forward + backward (about a
# third under full checkpointing; selective recomputes only the cheap operations: measured about half of that)
RECOMPUTE_COST = {"full": 1 / 3, "selective": 1 / 6}


@dataclass(frozen=True)
class Plan:
    """The last `none` decoder layers keep every activation, the `selective` layers before them are selectively
    checkpointed, the first ones fully."""

    none: int
    selective: int
    layers: int
    none_bytes: float  # activations of one layer for the largest micro-batch under each mode
    selective_bytes: float
    full_bytes: float
    budget_bytes: float

    @property
    def full(self) -> int:
        return self.layers - self.selective - self.none

    def summary(self) -> str:
        counts = {"none": self.none, "selective": self.selective, "full": self.full}
        return ", ".join(f"{mode} on {count}" for mode, count in counts.items() if count) + f" of {self.layers} layers"

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.summary()} (none on all would keep ~{self.none_bytes * self.layers / gib:.2f} GiB of "
                f"activations, selective on all ~{self.selective_bytes * self.layers / gib:.2f} GiB; budget "
                f"{self.budget_bytes / gib:.2f} GiB)")


def _widths(config: Any) -> tuple[int, int, int]:
    """(hidden, key/value width, intermediate) of a decoder layer; a mixture of experts: its active experts'."""
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", None) or 1
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    experts, moe = getattr(config, "num_experts_per_tok", None), getattr(config, "moe_intermediate_size", None)
    if experts and moe:
        intermediate = experts * moe
    return hidden, kv, intermediate


def activation_bytes_per_token(config: Any, half: bool, mode: str = "none", lean: bool = False) -> float:
    """What one decoder layer keeps for backward per token under `mode` (none, selective, full), in bytes. lean:
    the layer's norms and MLP keep what recompute.py spares them (`keeps_lean`)."""
    hidden, kv, intermediate = _widths(config)
    selective = 10 * hidden + 4 * kv + 4 * intermediate
    none = selective if lean else 34 * hidden + 8 * intermediate  # a lean layer keeps what selective keeps
    per_token = {"none": none, "selective": selective, "full": 2 * hidden}[mode]
    return per_token * (1 if half else 2) * SAFETY


def keeps_lean(layer: nn.Module, half: bool) -> bool:
    """The layer's RMSNorms are fused and its gated MLP lean (their outputs kept as recipes, recompute.py), and under
    half precision its frozen weights are half too (else autocast keeps a half copy of each product's input)."""
    frozen = [p for p in layer.parameters() if not p.requires_grad]
    half_weights = bool(frozen) and all(p.dtype in (torch.bfloat16, torch.float16) for p in frozen)
    return is_fused(layer) and is_lean(layer) and (half_weights or not half)


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


def plan(config: Any, layers: int, max_tokens: int, half: bool, available: float, lean: bool = False,
         cap_tokens: int | None = None) -> Plan:
    """The fastest modes the budget holds for a micro-batch of max_tokens: every layer costs `full` at least;
    layers are made selective while the budget holds, and once all are, made `none` while it still holds. Where
    none keeps no more than selective (lean layers), layers go from full straight to none. cap_tokens: the budget
    is at most what a micro-batch of that many tokens keeps with no layer checkpointed."""
    none, selective, full = (activation_bytes_per_token(config, half, mode, lean) * max_tokens
                             for mode in ("none", "selective", "full"))
    budget = available * BUDGET_SHARE
    if cap_tokens is not None:
        budget = min(budget, activation_bytes_per_token(config, half, "none", lean) * cap_tokens * layers)

    def upgrades(spare: float, step: float) -> int:
        return 0 if spare <= 0 else min(layers, math.floor(spare / step))

    spare = budget - full * layers
    if none <= selective:
        return Plan(upgrades(spare, none - full), 0, layers, none, selective, full, budget)
    chosen_selective = upgrades(spare, selective - full)
    chosen_none = upgrades(spare - (selective - full) * layers, none - selective) if chosen_selective == layers else 0
    return Plan(chosen_none, chosen_selective - chosen_none, layers, none, selective, full, budget)


def sequences_per_sample(cfg: Any) -> int:
    """Sequences one training sample puts in a micro-batch: a pair's two (chosen and rejected; a judged answer
    and its KL pair), an RL prompt's sampled answers, else one."""
    rows = stage_of(cfg.method.stage).rows
    if rows in PAIRED_ROWS:
        return 2
    if rows == "prompt":
        return max(resolved_rl(cfg).num_generations or 1, 1)
    return 1


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing's policy: keep the outputs of attention and of large matrix products."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        first = args[1] if op is aten.addmm.default else args[0]
        if first.shape[-1] >= SAVED_INNER_DIM:
            return CheckpointPolicy.MUST_SAVE
    elif op in _attention_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _attention_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


def selective_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint of function under the keep-the-products policy."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _keep_products), **kwargs)


def selective_fits(cfg: Any) -> bool:
    """Selective checkpointing replays a layer's operations against what its forward stored, so the layer must run
    the same operations both times: not so where parameters are gathered inside the layer and released again
    (DeepSpeed ZeRO, FSDP: the recompute gathers anew), nor across the all-to-alls of sequence parallelism. Those
    keep full checkpointing."""
    t = cfg.train
    return not (t.deepspeed or t.fsdp or t.sequence_parallel_size > 1)


class LayerModes:
    """The checkpointing mode of each decoder layer, chosen again for each micro-batch's token count within the
    memory budget (`available`: what this process may take for activations, before BUDGET_SHARE) and, once set,
    the activation cap."""

    def __init__(self, layers: nn.ModuleList, config: Any, half: bool, available: float, lean: bool) -> None:
        self.layers, self.config, self.half, self.available, self.lean = layers, config, half, available, lean
        self.cap: int | None = None
        # each layer's full checkpointing, as transformers set it up (a GradientCheckpointingLayer's function)
        self._full = [layer._gradient_checkpointing_func for layer in layers]
        self._applied: tuple[int, int] | None = None

    def for_tokens(self, tokens: int, cap: int | None = None) -> Plan:
        """The modes for a micro-batch of `tokens` under this cap (None: none)."""
        return plan(self.config, len(self.layers), tokens, self.half, self.available, self.lean, cap)

    def apply(self, tokens: int) -> Plan:
        """Set the layers' modes for a micro-batch of `tokens` under the cap: full on the first, then selective,
        then none."""
        chosen = self.for_tokens(tokens, self.cap)
        if self._applied != (chosen.none, chosen.selective):
            for i, (layer, full) in enumerate(zip(self.layers, self._full, strict=True)):
                selective = chosen.full <= i < chosen.full + chosen.selective
                layer.gradient_checkpointing = i < chosen.full + chosen.selective
                layer._gradient_checkpointing_func = selective_checkpoint if selective else full
            self._applied = (chosen.none, chosen.selective)
        return chosen

    def recompute_share(self, tokens: int, cap: int | None) -> float:
        """The share of a micro-batch's layer compute that its checkpointed layers run again."""
        chosen = self.for_tokens(tokens, cap)
        return (RECOMPUTE_COST["full"] * chosen.full + RECOMPUTE_COST["selective"] * chosen.selective) / chosen.layers

    def extra_compute(self, held: Sequence[int], cap: int) -> float:
        """The share of these micro-batches' layer compute that a cap adds (the layers it has them recompute)."""
        counts = Counter(held)
        extra = sum((self.recompute_share(tokens, cap) - self.recompute_share(tokens, None)) * tokens * n
                    for tokens, n in counts.items() if tokens > cap)
        return extra / max(sum(held), 1)

    def choose_cap(self, held: Sequence[int]) -> int | None:
        """Set and return the smallest cap, among the token counts of these micro-batches (a sample of the run's),
        whose extra compute over them stays within RECOMPUTE_SHARE; None when they are empty."""
        self.cap = None
        for cap in sorted(set(held), reverse=True):
            if self.extra_compute(held, cap) > RECOMPUTE_SHARE:
                break
            self.cap = cap
        return self.cap


_MODES: weakref.WeakKeyDictionary[nn.Module, LayerModes] = weakref.WeakKeyDictionary()


def layer_modes(model: nn.Module) -> LayerModes | None:
    """The model's per-micro-batch checkpointing (set up by checkpoint_by_memory), or None."""
    return next((modes for module in model.modules() if (modes := _MODES.get(module)) is not None), None)


def held_tokens(batch: Any) -> int | None:
    """Tokens a collated batch holds, padding included (what its activations scale with); None without input_ids."""
    ids = batch.model_inputs.get("input_ids")
    return int(ids.numel()) if ids is not None else None


def checkpoint_by_memory(model: nn.Module, layers: nn.ModuleList, cfg: Any, device: torch.device,
                         reserved: float = 0.0) -> Plan | None:
    """The plan for the largest micro-batch on the layers (full checkpointing already enabled on every layer by
    transformers): no checkpointing on the last layers it holds, selective on the ones before them, full on the
    first. reserved: bytes still to come outside the activations (gradients and optimizer states). The layers'
    LayerModes is kept for the trainer (layer_modes). None when the layers do not take per-layer checkpointing."""
    if not all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers) or not selective_fits(cfg):
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    t = cfg.train
    max_tokens = t.per_device_train_batch_size * cfg.data.cutoff_len * sequences_per_sample(cfg)
    half = t.bf16 or t.fp16 or t.pure_bf16
    modes = LayerModes(layers, config, half, available_bytes(device) - reserved, lean=keeps_lean(layers[0], half))
    _MODES[layers] = modes
    chosen = modes.apply(max_tokens)
    logger.info("gradient checkpointing (from the memory estimate): %s", chosen.describe())
    return chosen
