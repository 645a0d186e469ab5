"""Swap a faster or leaner forward onto modules, class by class, only where a probe finds it gives the same numbers
(fused_norm.py's RMSNorm, lean_mlp.py's gated MLP)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType

from torch import nn

logger = logging.getLogger(__name__)


def swap_forwards(model: nn.Module, eligible: Callable[[nn.Module], bool], agrees: Callable[[nn.Module], bool],
                  forward: Callable, what: str) -> int:
    """Set `forward` on every module that `eligible` selects and whose class passed `agrees` (probed once per
    class, on its first module); how many were swapped."""
    verdicts: dict[type, bool] = {}
    count = 0
    for module in model.modules():
        if not eligible(module):
            continue
        cls = type(module)
        if cls not in verdicts:
            verdicts[cls] = agrees(module)
        if verdicts[cls]:
            module.forward = MethodType(forward, module)
            count += 1
    if verdicts:
        logger.debug("%s: %s", what, {c.__name__: v for c, v in verdicts.items()})
    return count


def swapped(module: nn.Module, forward: Callable) -> bool:
    """Whether `forward` runs on `module` or one of its submodules."""
    return any(getattr(m.forward, "__func__", None) is forward for m in module.modules())
