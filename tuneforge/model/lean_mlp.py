"""The gated MLP's activation, silu(gate) * up, keeping only gate and up for backward.

Autograd keeps three intermediate-sized tensors for `act_fn(gate_proj(x)) * up_proj(x)`: gate (for silu's
backward), silu(gate) and up (for the product's). silu(gate) is one cheap pass to compute again, so SiluMul keeps
gate and up and recomputes it in backward: a quarter less of what a Llama-style MLP keeps (the fourth tensor is
the product, down_proj's input), with the same operations, so the same numbers bit for bit. It matters where a
layer is not checkpointed (the default when memory allows, model/checkpointing.py): for SmolLM2-135M in fp32 a
1,500-token micro-batch keeps 264 MiB less (30 layers x 1,500 x 1,536 x 4 bytes); measured on W1, 180 MiB less
peak memory (docs/performance.md).

Each MLP class is swapped only after a probe: its own forward and the lean one, on the same random input, must
give the same output and the same input gradient, exactly. A class with another activation (gelu), another shape
(a fused gate_up_proj, experts) or extra work fails it and is left as it is.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from tuneforge.model.probed_swap import swap_forwards, swapped
from tuneforge.model.recompute import remember


class SiluMul(torch.autograd.Function):
    """silu(gate) * up; backward runs the same operations autograd would, from gate and up alone."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up  # SiluMul's forward: the product computed again is the same bit for bit


def _lean_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    # down_proj's input is kept as a recipe on gate and up, which SiluMul keeps anyway (recompute.py)
    return self.down_proj(remember(SiluMul.apply(gate, up), _silu_mul, gate, up))


def _agrees(module: nn.Module) -> bool:
    """The module's own forward and the lean one give the same output and input gradient on a random input."""
    params = [p for p in module.parameters() if p.is_floating_point()]  # a 4-bit layer's weight is not
    dtype, device = (params[0].dtype, params[0].device) if params else (torch.float32, None)
    try:
        probe = torch.randn(2, 3, module.gate_proj.in_features, generator=torch.Generator().manual_seed(0))
        results = []
        for forward in (module.forward, MethodType(_lean_forward, module)):
            x = probe.to(device=device, dtype=dtype).requires_grad_(True)
            with torch.enable_grad():
                out = forward(x)
                (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
            results.append((out.detach(), grad))
        (out, grad), (lean_out, lean_grad) = results
        return torch.equal(out, lean_out) and torch.equal(grad, lean_grad)
    except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError):
        return False


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module)
               for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def lean_gated_mlps(model: nn.Module) -> int:
    """Swap in the lean forward on every gated MLP whose class passes the probe; how many were swapped."""
    return swap_forwards(model, _is_gated_mlp, _agrees, _lean_forward, "lean gated MLP")


def is_lean(module: nn.Module) -> bool:
    """Whether a gated MLP in module runs the lean forward."""
    return swapped(module, _lean_forward)
