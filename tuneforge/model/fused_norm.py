"""RMSNorm through torch's own fused kernel (torch.nn.functional.rms_norm), where it gives the same output.

transformers' RMSNorm of most families upcasts the input to fp32, normalizes, casts back and scales: four
elementwise passes in eager mode, each keeping an fp32 tensor for backward. torch.nn.functional.rms_norm runs
the same computation (fp32 accumulation, result in the input's dtype) as one kernel. On W1 (SmolLM2-135M LoRA,
bf16, no gradient checkpointing) it made training 1.14x faster (docs/performance.md).

Families differ (Gemma scales by 1 + weight, some norms have no weight, liger replaces them on CUDA), so each
norm class is swapped only after a probe: its own forward and the fused one on the same random input, in the
norm's dtype, must agree exactly. A class that does not is left as it is.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tuneforge.model.probed_swap import swap_forwards, swapped
from tuneforge.model.recompute import remember


def _normed(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    if hidden_states.dtype in (torch.float16, torch.bfloat16) and hidden_states.device.type == "cpu":
        # on a CPU rms_norm upcasts a half input and keeps the fp32 copy for backward (on CUDA it is one kernel that
        # keeps the half input): the copy is kept as a recipe on the half input instead, half the bytes; rms_norm of
        # the fp32 copy, cast back, is what it computes for the half input
        upcast = remember(hidden_states.float(), _to_float, hidden_states)
        normed = F.rms_norm(upcast, (hidden_states.shape[-1],), eps=eps).to(hidden_states.dtype)
    else:
        normed = F.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=eps)
    return weight * normed


def _to_float(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float()


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = _eps(self)
    # the next products' input is kept as a recipe on the norm's input, which the norm keeps anyway (recompute.py)
    return remember(_normed(hidden_states, self.weight, eps), partial(_normed, eps=eps), hidden_states, self.weight)


def _eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


@torch.no_grad()
def _agrees(module: nn.Module) -> bool:
    """The module's own forward and the fused one give the same output on a random input in its dtype."""
    weight = module.weight
    probe = torch.randn(2, 3, weight.shape[-1], generator=torch.Generator().manual_seed(0))
    probe = probe.to(device=weight.device, dtype=weight.dtype) * 3
    try:
        return torch.equal(module(probe), _fused_forward(module, probe))
    except (RuntimeError, TypeError, ValueError):
        return False


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and bool(weight.numel()) and weight.is_floating_point() and _eps(module) is not None)


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap in the fused forward on every RMSNorm whose class passes the probe; how many were swapped."""
    return swap_forwards(model, _is_rms_norm, _agrees, _fused_forward, "fused RMSNorm")


def is_fused(module: nn.Module) -> bool:
    """Whether an RMSNorm in module runs the fused forward."""
    return swapped(module, _fused_forward)
