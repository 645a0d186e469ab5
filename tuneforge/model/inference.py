"""Load a trained model to use it: chat, api, eval and export all start here.

The config is the training one: model_name_or_path plus adapter_name_or_path (the adapter folders a
lora / oft run saved). Adapters are merged into the base in memory (faster generation, and the same
numbers up to rounding), except over a quantized base, which cannot take a merge: there the model stays
a PeftModel. A reward model (an rm output folder: value_head.safetensors beside the adapter or model)
comes back wrapped in a ValueHeadModel.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuneforge.errors import ConfigError
from tuneforge.model.adapters import load_adapter
from tuneforge.model.hub import resolve_adapter
from tuneforge.model.load import (
    _from_pretrained,
    default_device,
    fit_vocabulary,
    load_config,
    model_config,
    quantization_config,
    resolve_model_path,
)
from tuneforge.model.prequantized import check_prequantized
from tuneforge.model.value_head import VALUE_HEAD_FILE, attach_value_head

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def inference_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    """infer_dtype, or for `auto`: on CUDA the checkpoint's own dtype (bf16 falls back to fp16 where the
    GPU lacks it), on CPU fp32 (bf16 / fp16 matmuls are emulated, and slow, on most CPUs)."""
    name = cfg.generate.infer_dtype
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    config = load_config(resolve_model_path(cfg.model), cfg.model)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    saved = DTYPES.get(saved, saved) if isinstance(saved, str) else saved
    if saved == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return saved if saved in DTYPES.values() else torch.float32


def use_trained_output(cfg: RunConfig) -> RunConfig:
    """The config pointed at what its own training run produced, so that chat / api / export / eval work on
    the training YAML as it is. When output_dir holds a finished run (all_results.json): lora / oft apply
    the adapter trained there on top of the adapters that run merged into its base (all of
    adapter_name_or_path with create_new_adapter, else all but the last, which it went on training);
    full / freeze load the model saved there. `output_dir=none` keeps the config's model and adapters."""
    out = Path(cfg.train.output_dir) if cfg.train.output_dir else None
    if out is None or not (out / "all_results.json").is_file():
        return cfg
    given = cfg.model.adapter_name_or_path or []
    if cfg.method.finetuning_type in ("lora", "oft") and (out / "adapter_config.json").is_file():
        if any(Path(a).resolve() == out.resolve() for a in given):
            return cfg
        merged = given if cfg.method.create_new_adapter else given[:-1]
        logger.info("using the adapter trained in output_dir %s (output_dir=none: the config's own adapters)", out)
        return replace(cfg, model=replace(cfg.model, adapter_name_or_path=[*merged, str(out)]))
    if cfg.method.finetuning_type in ("full", "freeze") and (out / "config.json").is_file():
        logger.info("using the model trained in output_dir %s (output_dir=none: model_name_or_path)", out)
        return replace(cfg, model=replace(cfg.model, model_name_or_path=str(out)))
    return cfg


def adapter_folders(cfg: RunConfig) -> list[Path]:
    m = cfg.model
    return [resolve_adapter(a, cache_dir=m.cache_dir, revision=m.model_revision,
                                 token=m.hf_hub_token) for a in m.adapter_name_or_path or []]


def value_head_folder(cfg: RunConfig) -> Path | None:
    """The folder whose value_head.safetensors makes this a reward model (the last adapter, else the model)."""
    adapters = adapter_folders(cfg)
    folder = adapters[-1] if adapters else resolve_model_path(cfg.model)
    return folder if (folder / VALUE_HEAD_FILE).is_file() else None


def load_inference_model(
    cfg: RunConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    merge: bool = True,
    value_head: bool | None = None,
):
    """The model of cfg in eval mode with its KV cache on, adapters merged (unless the base is quantized
    or merge=False). value_head: True = require one, False = never, None = attach it when the folder has one."""
    m = cfg.model
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = resolve_model_path(m)
    adapters = adapter_folders(cfg)  # a missing folder fails before the weights load
    head = value_head_folder(cfg)
    if value_head and head is None:
        where = adapters[-1] if adapters else path
        raise ConfigError(f"{where} has no {VALUE_HEAD_FILE}: point the config at the output folder of a stage rm "
                          f"run (adapter_name_or_path for lora / oft, model_name_or_path for full / freeze)")
    dtype = dtype or inference_dtype(cfg, device)
    config = model_config(path, cfg)  # rope_scaling: the base of an adapter gets the rope it was trained with
    saved = check_prequantized(config, path, device=device)
    quant = quantization_config(m, dtype) if saved is None else None
    if (quant is not None or saved is not None) and len(adapters) > 1:
        what = f"quantization_bit {m.quantization_bit}" if saved is None else f"{path} is saved quantized ({saved})"
        raise ConfigError(f"{what}: a quantized base cannot take merged adapters, so only one adapter can be applied "
                          f"(got {len(adapters)}); use the unquantized base")
    model = _from_pretrained(path, config, m, dtype=dtype, quant=quant, device=device)
    fit_vocabulary(model, m, cfg.train.seed)  # new tokens: the base grown to them before an adapter loads
    for folder in adapters:
        model = load_adapter(model, folder, trainable=False)
        if merge and quant is None and saved is None:
            model = model.merge_and_unload()
    model.requires_grad_(False)
    model.eval()
    model.config.use_cache = True
    if value_head is not False and head is not None:
        model = attach_value_head(model, head)
        model.eval()
    logger.info(
        "loaded %s%s for inference: dtype %s, device %s%s", path,
        "".join(f" + {a}" for a in adapters), str(dtype).removeprefix("torch."), device,
        ", value head" if head is not None and value_head is not False else "",
    )
    return model

