"""One GGUF file (llama.cpp / Ollama) from a merged model, written with the `gguf` package.

Llama-architecture models (model_type llama: Llama 2 / 3 with default rope, SmolLM, TinyLlama, ...) with a
byte-level BPE tokenizer are supported. Tensors are named with gguf's tensor name map; matrices are
stored as f32, f16, bf16 or q8_0 (export_gguf_type), norms and other 1-D tensors stay f32, as llama.cpp
stores them. llama.cpp's llama graph applies rope to interleaved pairs of each head's dimensions where
transformers rotates its two halves, so q_proj and k_proj rows are permuted on the way in (transformers'
GGUF loader undoes it). The tokenizer travels as gpt2-style tokens, token types and merges, with the
special token ids, the add-bos flag and the chat template.

Tensors are converted and written one at a time (the tensor table is computed from shapes first), so
the export needs little memory beyond the model itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tuneforge.errors import ConfigError, ModelError
from tuneforge.export.gguf_vocab import check_tokenizer, gguf_package, write_tokenizer

__all__ = ["check_gguf_support", "check_tokenizer", "write_gguf"]

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ROPE = ("default", "linear")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope(config: Any) -> tuple[float, str, float | None]:
    """(theta, rope type, scaling factor) from rope_parameters (transformers 5) or rope_theta / rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None)) or 10000.0
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return float(theta), kind, params.get("factor")


def check_gguf_support(config: Any, source: str) -> None:
    """Raise ConfigError when this model cannot be written as GGUF (before any weight loads)."""
    gguf_package()
    config = _text_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: export_format gguf supports model_type {', '.join(SUPPORTED_MODEL_TYPES)} (Llama, SmolLM, "
            f"TinyLlama, ...), but this model's model_type is '{model_type}'. Export with export_format: "
            f"safetensors and convert that folder with llama.cpp's convert_hf_to_gguf.py"
        )
    _, kind, _ = _rope(config)
    if kind not in SUPPORTED_ROPE:
        raise ConfigError(f"{source}: export_format gguf: rope type '{kind}' is not supported (only "
                          f"{', '.join(SUPPORTED_ROPE)}); export with export_format: safetensors")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConfigError(f"{source}: export_format gguf: models with attention_bias / mlp_bias are not supported; "
                          f"export with export_format: safetensors")


def _interleave_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from transformers' (first half, second half) order to llama.cpp's pairs."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) for every weight the llama graph reads."""
    gguf = gguf_package()
    config = _text_config(model.config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the embedding matrix when there is no output.weight
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise ModelError(f"gguf: the model's tensor {hf_name} has no GGUF name in the llama architecture")
        if base.endswith("self_attn.q_proj"):
            tensor = _interleave_rope(tensor, heads)
        elif base.endswith("self_attn.k_proj"):
            tensor = _interleave_rope(tensor, kv_heads)
        yield f"{name}.{suffix}", tensor


def _storage(shape: tuple[int, ...], wanted: Any) -> Any:
    """The GGML type a tensor of this shape is stored in: 1-D stays f32; q8_0 needs rows of 32."""
    gguf = gguf_package()
    q = gguf.GGMLQuantizationType
    if len(shape) <= 1:
        return q.F32
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    return wanted if shape[-1] % block == 0 else q.F16


def _encode(tensor: torch.Tensor, qtype: Any) -> np.ndarray:
    gguf = gguf_package()
    q = gguf.GGMLQuantizationType
    data = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
    if qtype == q.F32:
        return data
    if qtype == q.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)  # bf16 and q8_0: uint8 rows of blocks


GGUF_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def write_gguf(model: Any, tokenizer: Any, chat_template: str | None, path: Path, gguf_type: str, *,
               name: str, eot_id: int | None = None) -> None:
    """Write the model, its tokenizer and chat template to one GGUF file at path."""
    gguf = gguf_package()
    config = _text_config(model.config)
    wanted = gguf.GGMLQuantizationType[GGUF_TYPES[gguf_type]]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    try:
        _write_metadata(writer, config, gguf_type, name)
        write_tokenizer(writer, tokenizer, chat_template, config.vocab_size, eot_id)
        tensors = list(gguf_tensors(model))
        for tensor_name, tensor in tensors:
            shape = tuple(tensor.shape)
            qtype = _storage(shape, wanted)
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
                writer.add_tensor_info(tensor_name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
                writer.add_tensor_info(tensor_name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                                       raw_dtype=qtype)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, tensor in tensors:
            writer.write_tensor_data(_encode(tensor, _storage(tuple(tensor.shape), wanted)))
    finally:
        writer.close()
    logger.info("wrote %s (%d tensors, %s)", path, len(tensors), gguf_type)


def _write_metadata(writer: Any, config: Any, gguf_type: str, name: str) -> None:
    gguf = gguf_package()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta, kind, factor = _rope(config)
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads or heads)
    writer.add_rope_freq_base(theta)
    if kind == "linear" and factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(factor))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(int(gguf.LlamaFileType[FILE_TYPES[gguf_type]]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
