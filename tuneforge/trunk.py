"""The trunk of a causal LM: the module that runs all of the model's inputs up to the last hidden states, below
the vocabulary head (a leaf module: the model and train packages both call it).

For a text model that is its decoder. For a vision- / audio-language model it is the whole multimodal base
model (media encoders, projector and language model): transformers' `get_decoder()` there returns the language
model alone, which would ignore the pixel values.
"""

from __future__ import annotations

from typing import Any


def unwrapped(model: Any) -> Any:
    """The transformers model inside a peft model (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def trunk(model: Any) -> Any:
    """model: a transformers causal / multimodal LM, or a peft model around one."""
    base = unwrapped(model)
    inner = getattr(base, "base_model", None)
    return inner if inner is not None and inner is not base else base.get_decoder()
