"""The files of a Hugging Face model folder: weights (safetensors shards + index, or pytorch_model.bin),
the tokenizer with the chat template training used, and a generation_config.json that stops at the
template's end of turn."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tuneforge.config import GenerateArgs

logger = logging.getLogger(__name__)

SAFE_INDEX = "model.safetensors.index.json"
LEGACY_INDEX = "pytorch_model.bin.index.json"


def _legacy_name(name: str) -> str:
    """model.safetensors -> pytorch_model.bin; model-00001-of-00002.safetensors -> pytorch_model-00001-of-00002.bin"""
    return "pytorch_model" + name.removeprefix("model").removesuffix(".safetensors") + ".bin"


def save_weights(model: Any, folder: Path, *, max_shard_size: int | str, legacy: bool = False) -> list[str]:
    """config.json + the weights in folder; returns the weight files written.

    transformers 5 writes safetensors only (save_pretrained has no safe_serialization), so the legacy
    format is made from its output: each shard is re-saved with torch.save under the pytorch_model name,
    and the index points at the new files. Tied weights, dtype and renamed keys are save_pretrained's.
    """
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    files = sorted(p.name for p in folder.glob("model*.safetensors"))
    if not legacy:
        return files
    from safetensors.torch import load_file

    for name in files:
        torch.save(load_file(str(folder / name)), folder / _legacy_name(name))
        (folder / name).unlink()
    index = folder / SAFE_INDEX
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"] = {k: _legacy_name(v) for k, v in data["weight_map"].items()}
        (folder / LEGACY_INDEX).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        index.unlink()
    return [_legacy_name(name) for name in files]


def save_tokenizer(tokenizer: Any, template_source: str | None, folder: Path) -> None:
    """The tokenizer files; `template_source` (ChatTemplate.saved_text) becomes its chat_template."""
    if template_source is not None:
        tokenizer.chat_template = template_source
    tokenizer.save_pretrained(folder)


def generation_config(
    model_config: Any, tokenizer: Any, stop_ids: tuple[int, ...], gen: GenerateArgs
) -> Any:
    """A GenerationConfig with eos = eos + the template's end-of-turn tokens and the generation keys."""
    from transformers import GenerationConfig

    sample = gen.do_sample and gen.temperature > 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else None)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else getattr(model_config, "bos_token_id", None)
    kwargs: dict[str, Any] = dict(
        bos_token_id=bos, eos_token_id=list(stop_ids), pad_token_id=pad,
        do_sample=sample, repetition_penalty=gen.repetition_penalty, max_new_tokens=gen.max_new_tokens,
    )
    if sample:
        kwargs.update(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
    if gen.num_beams > 1:
        kwargs.update(num_beams=gen.num_beams, length_penalty=gen.length_penalty)
    return GenerationConfig(**kwargs)
