"""LoRA's update added by its own product: one torch.addmm writes base + scaling * h @ B^T, h = A x.

peft's LoRA forward computes B's product, scales it and adds it to the base layer's output: three output-sized
tensors written, two of them by elementwise passes, and backward scales the gradient in one more. With the update
added by the product itself (the product's beta = 1, alpha = scaling) the scaled copy and the sum are never written.
In fp32 the result is bit-identical when the scaling is a power of two (the default lora_alpha = 2 x rank), else
within fp32's last bit; under bf16 autocast the sum is rounded once, where peft rounds B's product and then the sum
(docs/performance.md: W1 in bf16 ~6 % faster).

Only the plain case takes it (one active adapter, no dropout, no DoRA or other variant, no bias on B, not merged
or disabled, no per-row adapter names, weights that are plain tensors); anything else, and every call that is not
that case (a reference pass with adapters disabled), runs peft's own forward.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn
from torch.distributed.tensor import DTensor  # imported by transformers and peft already

from tuneforge.model.probed_swap import swapped


def _addmm_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    own = type(self).forward  # peft's
    if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
        return own(self, x, *args, **kwargs)
    name = self.active_adapters[0]
    if name not in self.lora_A or name in self.lora_variant or not isinstance(self.lora_dropout[name], nn.Identity):
        return own(self, x)
    lora_A, lora_B = self.lora_A[name], self.lora_B[name]
    if lora_B.bias is not None or not _plain(lora_B.weight):
        return own(self, x)
    lora_dtype = lora_A.weight.dtype if self.cast_input_dtype_enabled else x.dtype  # what _cast_input_dtype gives
    if not torch.is_autocast_enabled(x.device.type) and not x.dtype == lora_dtype == lora_B.weight.dtype:
        return own(self, x)  # peft sums mixed dtypes in the wider one
    # in peft's order (the base first), so backward sums the input's gradients in the same order
    result = self.base_layer(x)
    h = lora_A(self._cast_input_dtype(x, lora_A.weight.dtype))
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), lora_B.weight.t(),
                      alpha=self.scaling[name])
    return out.view(result.shape).to(result.dtype)


def _plain(weight: torch.Tensor) -> bool:
    """A weight the product can read as it is: not a ZeRO-3 partition (gathered only inside lora_B's own call) nor
    a DTensor shard."""
    return not hasattr(weight, "ds_id") and not isinstance(weight, DTensor)


def _lora_linears(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import Linear

    return [m for m in model.modules() if type(m) is Linear]


def add_lora_by_addmm(model: nn.Module) -> int:
    """Run every peft LoRA Linear of model through _addmm_forward; how many."""
    layers = _lora_linears(model)
    for layer in layers:
        layer.forward = MethodType(_addmm_forward, layer)
    return len(layers)


def runs_addmm(module: nn.Module) -> bool:
    return swapped(module, _addmm_forward)
