"""rope_scaling: stretch a RoPE model's context to model_max_length through transformers' own rope parameters.

The scaled settings go into the model config's `rope_parameters` before the weights load, so transformers builds
the scaled rotary embedding itself, and the config a full run saves (or an export merges) carries them: plain
transformers reloads the model with the same scaling. A LoRA adapter's base gets the same settings wherever
tuneforge loads it (train, chat, api, eval, export), from the same keys.

The factor follows LlamaFactory: ceil(model_max_length / the model's pretrained length), where the pretrained
length is `original_max_position_embeddings` when the model already scales its rope, else max_position_embeddings;
no scaling when model_max_length fits in it. max_position_embeddings grows by the factor, except for dynamic NTK,
which transformers scales from max_position_embeddings (raising it would leave it idle up to model_max_length).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from tuneforge.errors import ConfigError

logger = logging.getLogger(__name__)

ROPE_SCALING = ("linear", "dynamic", "yarn", "llama3")
LLAMA3_FREQ_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}  # Llama 3.1's values, as LlamaFactory


def scaled_rope(config: Any, rope_type: str, max_length: int) -> dict[str, Any] | None:
    """The rope_parameters that stretch config's model to max_length with rope_type (None: it already fits).
    config: a text model's config (transformers 5: rope settings in `rope_parameters`)."""
    if rope_type not in ROPE_SCALING:
        raise ConfigError(f"rope_scaling '{rope_type}' is not one of {', '.join(ROPE_SCALING)}", key="rope_scaling")
    current = getattr(config, "rope_parameters", None)
    if not current or "rope_theta" not in _flat(config, current):
        raise ConfigError(f"rope_scaling: {config.model_type} models have no rotary position embeddings (RoPE) to "
                          f"scale; remove rope_scaling", key="rope_scaling")
    pretrained = current.get("original_max_position_embeddings") or config.max_position_embeddings
    if max_length <= pretrained:
        logger.warning("rope_scaling %s: model_max_length %d fits in the model's %d positions; rope is not scaled",
                       rope_type, max_length, pretrained)
        return None
    factor = float(math.ceil(max_length / pretrained))
    scaled = {"rope_type": rope_type, "rope_theta": current["rope_theta"], "factor": factor}
    if "partial_rotary_factor" in current:
        scaled["partial_rotary_factor"] = current["partial_rotary_factor"]
    if rope_type != "linear":
        scaled["original_max_position_embeddings"] = pretrained
    if rope_type == "llama3":
        scaled.update(LLAMA3_FREQ_FACTORS)
    return scaled


def apply_rope_scaling(config: Any, rope_type: str | None, max_length: int) -> None:
    """Set config's (text) rope parameters to rope_type scaled for max_length; nothing when rope_type is None."""
    if rope_type is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scaled = scaled_rope(text, rope_type, max_length)
    if scaled is None:
        return
    pretrained = scaled.get("original_max_position_embeddings", text.max_position_embeddings)
    text.rope_parameters = scaled
    if rope_type != "dynamic":
        text.max_position_embeddings = int(pretrained * scaled["factor"])
    text.validate_rope()
    logger.info("rope_scaling %s: factor %g (%d -> %d positions)", rope_type, scaled["factor"], pretrained,
                int(pretrained * scaled["factor"]))
    if rope_type == "dynamic":
        logger.warning("rope_scaling dynamic: dynamic NTK changes the rope with the sequence length, which may not "
                       "suit fine-tuning (see transformers PR 24653); linear or yarn are the usual choices")


def _flat(config: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    """parameters when they are one global rope; a clear error when they differ per layer type (Gemma 3)."""
    nested = config.nested_rope_parameter_keys(parameters) if hasattr(config, "nested_rope_parameter_keys") else []
    if nested:
        raise ConfigError(f"rope_scaling: {config.model_type} models set their rope per layer type ({', '.join(nested)}"
                          f"); tuneforge scales one global rope, so remove rope_scaling", key="rope_scaling")
    return parameters
