"""Checkpoints saved quantized: their config.json carries a quantization_config (GPTQ, AWQ, AQLM, FP8, MXFP4,
bitsandbytes, ...), which transformers loads through its own quantizer for that method.

Adapters (lora, oft) train on such a base; its own weights cannot train. Whether the method's backend package is
installed and runs on this device is transformers' own check (`validate_environment`), asked here before any data
is tokenized or any weight loads, and turned into an error that names the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tuneforge.errors import ConfigError, ModelError

ADAPTER_METHODS = ("lora", "oft")


def saved_quantization(config: Any) -> dict[str, Any] | None:
    """The quantization_config a checkpoint was saved with (as a dict), None for a plain one."""
    found = getattr(config, "quantization_config", None)
    if found is None and hasattr(config, "get_text_config"):
        found = getattr(config.get_text_config(decoder=True), "quantization_config", None)
    if found is None:
        return None
    return found if isinstance(found, dict) else found.to_dict()


def quant_method(found: dict[str, Any]) -> str:
    method = found.get("quant_method")
    if found.get("load_in_4bit") or found.get("load_in_8bit"):
        return f"bitsandbytes {'4' if found.get('load_in_4bit') else '8'}-bit"
    return str(getattr(method, "value", method) or "unknown")


def check_prequantized(config: Any, path: Path, finetuning_type: str | None = None, quantization_bit: int | None = None,
                       device: torch.device | None = None) -> str | None:
    """The quantization method of a checkpoint saved quantized (None for a plain one), after checking that its
    backend is installed and works here and, for training (finetuning_type given), that the run can train on it:
    adapters only, no second quantization."""
    found = saved_quantization(config)
    if found is None:
        return None
    method = quant_method(found)
    if finetuning_type is None:
        pass
    elif quantization_bit is not None:
        raise ConfigError(f"{path} is already quantized ({method}); quantization_bit {quantization_bit} would "
                          f"quantize it again: drop quantization_bit", key="quantization_bit")
    elif finetuning_type not in ADAPTER_METHODS:
        raise ConfigError(f"{path} is saved quantized ({method}): its weights cannot train, so finetuning_type "
                          f"{finetuning_type} cannot work; train adapters on it (finetuning_type: lora or oft), or "
                          f"start from the unquantized model", key="finetuning_type")
    from transformers.quantizers import AutoHfQuantizer

    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    try:
        quantizer = AutoHfQuantizer.from_config(found, pre_quantized=True)
        quantizer.validate_environment(device_map={"": str(device)}, weights_only=True)
    except (ImportError, RuntimeError, ValueError, TypeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path} is saved quantized ({method}), and transformers cannot load it on {device.type} "
                         f"here: {reason}. Install the package it names (on a device that method supports), or "
                         f"train on the unquantized model with quantization_bit: 4 (QLoRA)") from None
    return method
