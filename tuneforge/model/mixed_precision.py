"""Mixed precision around adapters: skip the dtype round trips autocast makes redundant.

peft keeps LoRA weights in fp32 (upcast_trainable) and casts each adapted layer's input to them: under bf16
autocast that is a copy of the activation to fp32, which autocast's matrix product at once copies back to bf16
(and the same two copies again for its gradient) — lossless both ways, so pure waste. On SmolLM2-135M LoRA (W1)
they were ~1,400 copies of a (tokens, 576..1536) tensor per step (docs/performance.md). Inside `autocast_inputs`
plain LoRA layers take their input as it comes. Only where that is exact: no variant (DoRA and others compute
outside matrix products) and no dropout (its mask is drawn in the input's dtype).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def plain_lora_layers(model: nn.Module) -> list[nn.Module]:
    """peft LoRA layers whose adapters are all plain (no variant) and without dropout."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, LoraLayer) and hasattr(m, "cast_input_dtype_enabled")
            and not m.lora_variant and all(isinstance(d, nn.Identity) for d in m.lora_dropout.values())]


@contextlib.contextmanager
def autocast_inputs(layers: list[nn.Module]) -> Iterator[None]:
    """Within: the layers do not cast their input to the adapters' dtype. Enter it only around autocast work: the
    forward, and the backward (its checkpointed layers recompute under the forward's autocast, and must run the
    same operations)."""
    before = [layer.cast_input_dtype_enabled for layer in layers]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            layer.cast_input_dtype_enabled = value
