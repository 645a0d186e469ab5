"""Activations kept once: a tensor that is cheap to compute again from tensors autograd keeps anyway is not kept
a second time.

Where a decoder layer is not checkpointed, autograd keeps the input of every product for backward. Some of those
inputs are one cheap pass away from tensors it keeps anyway: the gated MLP's product silu(gate) * up (down_proj's
input) from gate and up (kept by SiluMul, lean_mlp.py), an RMSNorm's output (the next products' input) from the
norm's input (kept by the norm, fused_norm.py), and padding-free attention's output (o_proj's input) from sdpa's
output for each sequence (kept by sdpa, attention.py). Under half precision the norm's fp32 copy of its input is
also kept as a recipe on the half input. On W1 (SmolLM2-135M) a token's layer keeps 22.8 KB instead of 35.5 in fp32,
11.5 instead of 20.1 in bf16 (docs/performance.md).

`remember(out, fn, *inputs)` marks `out` as `fn(*inputs)`. Inside `recomputing()` (the training forward), a saved
tensor that lies in a marked tensor's memory is stored as that recipe instead, and computed again (the same
operations on the same inputs: the same numbers bit for bit) when backward unpacks it. Checkpointed layers are
untouched: torch's checkpointing installs its own saved-tensor hooks inside them, and the innermost hooks apply.
A marked tensor changed in place before it is saved, or whose inputs change before backward, is kept as usual or
refused with an error, never recomputed from changed inputs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_marked: dict[int, _Recipe] = {}  # storage address -> how to compute the tensor living there again
_active = False


class _Recipe:
    """How to compute a marked tensor again; shared by every saved view of it, so backward computes it once."""

    def __init__(self, out: torch.Tensor, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                 forget: Callable[[weakref.ref], None]):
        self.ref = weakref.ref(out, forget)  # while the marked tensor lives, no other tensor takes its memory
        self.version = out._version
        self.fn, self.inputs = fn, inputs
        self.versions = tuple(t._version for t in inputs)
        self.pending = 0  # saved views not yet unpacked
        self.value: torch.Tensor | None = None

    def compute(self) -> torch.Tensor:
        if self.value is None:
            if tuple(t._version for t in self.inputs) != self.versions:
                raise RuntimeError("an input of a recomputed activation was changed in place after the forward; "
                                   "train with gradient checkpointing or without the in-place operation")
            with torch.no_grad():
                self.value = self.fn(*self.inputs)
        value = self.value
        self.pending -= 1
        if self.pending <= 0:  # the last saved view is unpacked: drop the value with it
            self.value = None
        return value


@dataclass(frozen=True)
class _SavedView:
    recipe: _Recipe
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def remember(out: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """Mark `out` (just computed as fn(*inputs)) as cheap to compute again; returns it."""
    if not (_active and torch.is_grad_enabled() and out.is_contiguous() and out.storage_offset() == 0):
        return out
    storage = out.untyped_storage()
    if storage.nbytes() != out.numel() * out.element_size():
        return out
    address = storage.data_ptr()

    def forget(ref: weakref.ref) -> None:
        if (recipe := _marked.get(address)) is not None and recipe.ref is ref:
            del _marked[address]

    _marked[address] = _Recipe(out, fn, inputs, forget)
    return out


def _pack(saved: torch.Tensor) -> Any:
    if not _marked or type(saved) is not torch.Tensor or saved.layout is not torch.strided:
        return saved  # parameters, subclasses, sparse tensors: never marked
    recipe = _marked.get(saved.untyped_storage().data_ptr())
    if recipe is None:
        return saved
    out = recipe.ref()
    if out is None or out._version != recipe.version or saved._version != recipe.version or saved.dtype != out.dtype:
        return saved
    recipe.pending += 1
    return _SavedView(recipe, tuple(saved.shape), saved.stride(), saved.storage_offset())


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, _SavedView):
        return packed
    return packed.recipe.compute().as_strided(packed.size, packed.stride, packed.offset)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Store marked activations as recipes while the block runs (one training forward)."""
    global _active
    previous, _active = _active, True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _active = previous
        if not _active:
            _marked.clear()
