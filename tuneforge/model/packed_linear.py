"""Batched generation on a CPU with fp32 weights: the linear layers' weights packed once in oneDNN's own layout.

A decode step multiplies a few rows (one per answer being written) by every weight matrix. torch's fp32 `linear`
packs the weight again on every call for such products (MKL's gemm; a single row takes its gemv instead), which
costs more than the product: on 2 cores a (4 x 576) @ (576 x 1536) product takes 256 us, with the weight packed once
for oneDNN 116 us, and the 49k-word head's (4 x 576) @ (576 x 49152) 18.2 ms against 5.4 ms. A whole batch's
prefill (~1000 rows) runs at about the same speed either way.

`pack_for_generation(model)` swaps the decoder layers' `nn.Linear` modules and the output head for `PackedLinear`,
which keeps only the packed weight; the dense weights are freed (a head tied to the input embeddings keeps a packed
copy of them), and their pages of a memory-mapped checkpoint are given back as each layer is packed
(mapped_pages.py). The products are oneDNN's instead of MKL's: the same up to rounding, not bit for bit (the greedy
answers of `benchmarks/predict_throughput.py` are identical). It is for models loaded to generate in batches
(predict, eval's rewards): a packed layer has no gradient, and it refuses an input that needs one.

`packed_while_generating(model)` does the same for a model in training (GRPO / PPO rollouts): for the block, the
layers are swapped for packed copies of their current weights, each LoRA layer's active adapters merged into its copy
(one product instead of three), and put back afterwards; the model's own weights and adapters are never touched. The
copies live only during the block (fp32 SmolLM2-135M: ~0.54 GB) and take ~0.3 s to make.

TUNEFORGE_PACKED_LINEAR=0 turns both off.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
from torch import nn

from tuneforge.errors import ModelError, TuneforgeError
from tuneforge.flags import env_switch
from tuneforge.model import mapped_pages

logger = logging.getLogger(__name__)

ENV = "TUNEFORGE_PACKED_LINEAR"
ROWS_HINT = 16  # oneDNN picks the packed layout for this many rows: a decode step's (measured: 4 to 16 rows gain most)


class PackedLinear(nn.Module):
    """An inference-only linear layer whose weight (out x in, fp32) lives in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # a plain attribute, not a buffer: module-wide conversions (.to, .half) must not meet an opaque tensor
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("a PackedLinear is for generation only (no gradients); load the model without "
                               "pack_for_generation to train or differentiate it")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _why_not(model: nn.Module, *, adapters: bool) -> str | None:
    """Why the model's linear layers stay as they are (None: they can be packed). adapters: whether unmerged
    adapters may be merged into the packed copies."""
    if not env_switch(ENV, TuneforgeError):
        return f"{ENV}=0"
    if hasattr(model, "peft_config") and not adapters:
        return "its adapters are not merged"
    weight = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return "only fp32 weights on a CPU are packed"
    if torch.is_autocast_enabled("cpu"):  # the packed op has no autocast rule: it would meet half-precision inputs
        return "autocast is on"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch has no oneDNN linear"
    if not _works():
        return "this torch's oneDNN linear did not match F.linear"
    return None


def _packable(module: nn.Module) -> bool:
    """A plain nn.Linear (not bitsandbytes' subclasses) with fp32 weights held whole (not sharded by FSDP or ZeRO-3)
    on a CPU, without hooks (accelerate's offload)."""
    return (type(module) is nn.Linear and type(module.weight.data) is torch.Tensor and not hasattr(module.weight, "ds_id")
            and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
            and not module._forward_hooks and not module._forward_pre_hooks)


def _mergeable(layer: nn.Module) -> bool:
    """A peft LoRA linear layer that computes its base product plus its active adapters' products: not a variant such
    as DoRA (which reads the base weight), adapters neither disabled nor already merged, fp32 adapters, no hooks."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(layer) is not LoraLinear or not _packable(layer.base_layer) or layer.disable_adapters or layer.merged:
        return False
    if layer._forward_hooks or layer._forward_pre_hooks:
        return False
    variants = getattr(layer, "lora_variant", {})
    return not any(a in variants or layer.use_dora.get(a) or layer.lora_B[a].weight.dtype != torch.float32
                   for a in _active(layer))


def _active(layer: nn.Module) -> list[str]:
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _merged_weight(layer: nn.Module) -> torch.Tensor:
    """A mergeable LoRA layer's base weight plus its active adapters' updates (peft's own get_delta_weight: scaling,
    rsLoRA), as a new tensor: the layer is untouched."""
    weight = layer.base_layer.weight.detach()
    for adapter in _active(layer):
        weight = weight + layer.get_delta_weight(adapter)
    return weight


@functools.cache
def _works() -> bool:
    """One small product checked against F.linear: a torch whose private oneDNN ops changed is left alone. Once per
    process (each rollout asks)."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # the run's random state stays as it was
            probe, x = nn.Linear(8, 4), torch.randn(3, 8)
            return torch.allclose(PackedLinear(probe.weight, probe.bias)(x), probe(x), atol=1e-5)
    except (RuntimeError, TypeError, AttributeError):
        return False


def _swap_in(model: nn.Module, *, adapters: bool, release: bool = False
             ) -> tuple[list[tuple[nn.Module, str, nn.Module]], int]:
    """Swap the decoder layers' linear layers and the output head for PackedLinear; returns (parent, name, the
    layer swapped out) of each, and the bytes of mapped pages given back. adapters: a LoRA layer is packed with its
    adapters merged into the copy; any other adapter layer (and everything inside one) stays as it is. release: the
    layers swapped out are dropped; each one's dense weight goes as soon as its copy is made, and its pages of a
    memory-mapped checkpoint that nothing kept shares are given back (mapped_pages.py)."""
    from tuneforge.model.adapters import decoder_layers

    why = _why_not(model, adapters=adapters)
    if why is None:
        try:
            _, decoder = decoder_layers(model)
        except ModelError as e:  # a wrapper (a reward model's value head) or an architecture without one list of layers
            why = str(e)
    if why is not None:
        logger.debug("linear layers not packed for generation: %s", why)
        return [], 0
    candidates = [m for layer in decoder for m in layer.modules()]
    head = model.get_output_embeddings()
    if isinstance(head, nn.Module):
        candidates.append(head)
    chosen: set[int] = set()
    inside_adapters: set[int] = set()
    for module in candidates:  # modules() lists a layer before what it holds
        if id(module) in inside_adapters:
            continue
        if _packable(module):
            chosen.add(id(module))
        elif adapters and hasattr(module, "base_layer"):  # peft's layers hold the base layer they adapt
            inside_adapters.update(id(m) for m in module.modules())
            if _mergeable(module):
                chosen.add(id(module))
    kept = _kept_spans(model, chosen) if release else []
    mappings = mapped_pages.file_mappings() if release else []
    swapped, released = [], 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in chosen:
                chosen.discard(id(child))  # a layer held twice (a tied module) is packed once
                plain = type(child) is nn.Linear
                weight = child.weight if plain else _merged_weight(child)  # merged one layer at a time
                setattr(parent, name, PackedLinear(weight, child.bias if plain else child.base_layer.bias))
                swapped.append((parent, name, child))
                if release and plain:  # its dense weight goes now, not once every layer is packed
                    released += mapped_pages.release(child.weight, kept, mappings)
                    child.weight = None
    if released:
        logger.debug("generation: %.0f MiB of the checkpoint's mapped pages given back", released / 2**20)
    return swapped, released


def _kept_spans(model: nn.Module, chosen: set[int]) -> list[mapped_pages.Span]:
    """The memory of every tensor that stays in use once the chosen layers are packed: those of the layers left as
    they are, and a weight that two chosen layers share (the second is packed after the first is dropped)."""
    left = [m for m in model.modules() if id(m) not in chosen]
    packed = [m for m in model.modules() if id(m) in chosen]
    tensors = [t for m in left for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    holders = collections.Counter(id(m.weight) for m in packed)
    tensors += [m.weight for m in packed if holders[id(m.weight)] > 1]
    return [mapped_pages.span(t) for t in tensors]


def _own_memory(model: nn.Module) -> None:
    """Copy the weights left dense (embeddings, norms) out of the checkpoint's memory map, so that the map goes. The
    map lives while any tensor in it does, and the pages the packing read stay resident with it: where they could not
    be given back one weight at a time, the dense weights would stay in the RSS beside the packed."""
    for tensor in [*model.parameters(), *model.buffers()]:  # each shared (tied) tensor once
        tensor.data = tensor.data.clone()


def pack_for_generation(model: nn.Module) -> int:
    """Pack the decoder layers' linear layers and the output head of `model` (a transformers causal LM loaded for
    inference, adapters merged) for batched generation on a CPU; returns how many were packed (0 when it does not
    apply: see _why_not). The head gains at every row count (1 row: 1.75x, 200 rows: 1.18x); the layers gain at 2 to
    16 rows (a batched decode step: 2.2x at 4 rows) but lose at 1 row and between ~20 and ~200 (64 rows: 1.6 ms
    against 0.9), where a short prompt's prefill lies: the API server measured no gain, and keeps dense layers."""
    swapped, released = _swap_in(model, adapters=False, release=True)
    if swapped:
        if not released:  # else the map keeps only the pages of the weights left dense, which are needed anyway
            _own_memory(model)
        logger.info("generation: %d linear layers packed for oneDNN (%s=0 keeps them as they are)", len(swapped), ENV)
    return len(swapped)


@contextlib.contextmanager
def packed_while_generating(model: nn.Module) -> Iterator[int]:
    """Within the block, `model` (in training: its weights change between blocks) generates with packed copies of its
    current linear weights, LoRA adapters merged into them; the layers swapped out come back afterwards, untouched.
    Yields how many layers were packed (0 where packing does not apply). The copies are built under no_grad and
    refuse inputs that need a gradient."""
    with torch.no_grad():
        swapped, _ = _swap_in(model, adapters=True)
    if swapped:
        logger.debug("generation: %d linear layers packed for this block", len(swapped))
    try:
        yield len(swapped)
    finally:
        for parent, name, layer in reversed(swapped):
            setattr(parent, name, layer)
