"""Models: resolve a name, load tokenizer and model ready to train (dtype, attention, quantization, adapters)."""

from tuneforge.model.hub import resolve, resolve_adapter
from tuneforge.model.load import (
    describe_trainable,
    load_model,
    load_model_processor,
    load_reference,
    load_tokenizer,
    reference_identity,
)

__all__ = ["describe_trainable", "load_model", "load_model_processor", "load_reference", "load_tokenizer", "reference_identity", "resolve", "resolve_adapter"]
