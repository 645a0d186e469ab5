"""`tuneforge export cfg.yaml`: merge the adapters into the base and write a model others can load.

export_format safetensors: a plain Hugging Face folder (safetensors shards + index, or pytorch_model.bin
with export_legacy_format), the tokenizer with the chat template training used, a generation_config.json
that stops at the template's end of turn, an Ollama Modelfile, and value_head.safetensors for a reward
model. export_format gguf: one GGUF file (llama-architecture models) and a Modelfile that points at it.

Every check that can fail runs before the weights load; export_dir is written atomically (atomic.py).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tuneforge.errors import ConfigError

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["export_dtype", "export_model"]

EXPORT_MARKERS = ("config.json", "Modelfile")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(cfg: RunConfig) -> torch.dtype:
    """infer_dtype when set; for auto the checkpoint's saved dtype (config dtype / torch_dtype), else fp32.

    (inference_dtype picks fp32 on a CPU for speed; an export keeps the precision the model was saved in.)
    """
    name = cfg.generate.infer_dtype
    if name != "auto":
        return DTYPES[name]
    from tuneforge.model.load import load_config, resolve_model_path

    config = load_config(resolve_model_path(cfg.model), cfg.model)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    saved = DTYPES.get(saved) if isinstance(saved, str) else saved
    return saved if saved in DTYPES.values() else torch.float32


def _device(cfg: RunConfig) -> torch.device:
    if cfg.export.export_device == "auto":
        from tuneforge.model.load import default_device

        return default_device()
    return torch.device("cpu")


def _check(cfg: RunConfig) -> tuple[Path, list[Path], Path | None]:
    """The checks that need no weights; returns export_dir, the source folders and the value head folder."""
    e, src = cfg.export, cfg.source
    if not e.export_dir:
        raise ConfigError(f"{src}: export_dir is required (the folder the exported model goes to)")
    if e.export_size < 1:
        raise ConfigError(f"{src}: export_size must be >= 1 (the largest shard, in GB; got {e.export_size})")
    from tuneforge.model.inference import adapter_folders, value_head_folder
    from tuneforge.model.load import load_config, resolve_model_path
    from tuneforge.model.prequantized import quant_method, saved_quantization

    sources = [resolve_model_path(cfg.model), *adapter_folders(cfg)]
    saved = saved_quantization(load_config(sources[0], cfg.model))
    if saved is not None and len(sources) > 1:
        raise ConfigError(f"{src}: {sources[0]} is saved quantized ({quant_method(saved)}), and an adapter cannot be "
                          f"merged into quantized weights; set model_name_or_path to the unquantized model the "
                          f"quantized one was made from (the adapter applies to it)", key="model_name_or_path")
    head = value_head_folder(cfg)
    if head is not None and e.export_format == "gguf":
        raise ConfigError(f"{src}: {head} is a reward model (it has a value head), which a GGUF file cannot carry; "
                          f"use export_format: safetensors")
    target = Path(e.export_dir).expanduser().resolve()
    for folder in sources:
        folder = folder.resolve()
        if folder == target or target in folder.parents:
            raise ConfigError(f"{src}: export_dir {e.export_dir} holds the model being exported ({folder}), and "
                              f"would replace it; choose another export_dir")
    if target.exists():
        if not target.is_dir():
            raise ConfigError(f"{src}: export_dir {e.export_dir} is a file; choose a folder")
        names = [p.name for p in target.iterdir() if p.name != "README.md"]  # a card of the user's is kept
        looks_exported = any(n in EXPORT_MARKERS or n.endswith(".gguf") for n in names)
        if names and not looks_exported:
            raise ConfigError(f"{src}: export_dir {e.export_dir} holds other files (not an exported model), which "
                              f"an export would replace; choose an empty or new folder")
    if cfg.hub.export_hub_model_id:  # the hub reachable and the token able to write, before the weights load
        from tuneforge.hub import check_access

        check_access(cfg.model.hf_hub_token or cfg.hub.hub_token, "export_hub_model_id", "hf_hub_token", src)
    return target, sources, head


def export_model(cfg: RunConfig) -> dict[str, Any]:
    """Merge and write cfg.export.export_dir; returns the paths and a `summary` (lines for the CLI)."""
    from tuneforge.atomic import atomic_folder
    from tuneforge.export.turns import derive_turns
    from tuneforge.infer.generation import chat_template, end_of_turn
    from tuneforge.model.inference import load_inference_model
    from tuneforge.model.load import load_model_processor, load_tokenizer, model_config

    e = cfg.export
    if cfg.model.quantization_bit is not None:
        # a QLoRA run's config, as it is: its adapter applies to the full-precision base, which takes the merge
        logger.info("quantization_bit %s: merging into the full-precision base (a quantized base cannot take a "
                    "merge); quantize the merged model afterwards, e.g. export_format: gguf with export_gguf_type: "
                    "q8_0", cfg.model.quantization_bit)
        cfg = replace(cfg, model=replace(cfg.model, quantization_bit=None))
    target, sources, head = _check(cfg)
    processor = load_model_processor(cfg.model)  # a vision- / audio-language model's, written beside it
    if e.export_format == "gguf":
        from tuneforge.export.gguf import check_gguf_support, check_tokenizer

        if processor is not None:
            raise ConfigError(f"{cfg.source}: export_format gguf writes text models; a vision-language model's GGUF "
                              f"is the language model plus a projector file (mmproj): export safetensors and "
                              f"convert that folder with llama.cpp's convert_hf_to_gguf.py (--mmproj)")
        check_gguf_support(model_config(sources[0], cfg), cfg.source)  # the rope the export will carry
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(cfg.model)
    if e.export_format == "gguf":
        check_tokenizer(tokenizer, cfg.source)
    template = chat_template(cfg, processor or tokenizer)  # a bad template name fails here, before the weights load
    stops = end_of_turn(tokenizer, template, processor)
    turns = derive_turns(tokenizer, template.saved_text(tokenizer)) if processor is None else None
    dtype, device = export_dtype(cfg), _device(cfg)

    model = load_inference_model(cfg, device=device, dtype=dtype, merge=True, value_head=False)
    result: dict[str, Any] = {"export_dir": str(target), "format": e.export_format,
                              "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
    with atomic_folder(target) as tmp:
        if e.export_format == "gguf":
            notes = _write_gguf(cfg, model, tokenizer, template, stops, turns, target, tmp, result)
        else:
            notes = _write_hf(cfg, model, tokenizer, template, stops, turns, head, tmp, result, processor)
        _write_card(cfg, target, tmp, sources[1:], result)
    result["summary"] = _summary(cfg, sources, result, notes)
    if cfg.hub.export_hub_model_id:
        result["summary"].append(_push(cfg, target))
    return result


def _write_card(cfg: RunConfig, target: Path, folder: Path, adapters: list[Path], result: dict) -> None:
    """README.md: tuneforge's model card, or the one a user put in export_dir before (kept)."""
    from tuneforge.export import card

    if not card.is_ours(target):
        shutil.copyfile(target / card.CARD, folder / card.CARD)
        return
    gguf = Path(result["gguf_file"]).name if "gguf_file" in result else None
    card.save(card.export_card(cfg, target, adapters, gguf_file=gguf, repo_id=cfg.hub.export_hub_model_id,
                                files=folder), folder)
    result["model_card"] = str(target / card.CARD)


def _push(cfg: RunConfig, target: Path) -> str:
    """export_dir to export_hub_model_id (public unless hub_private_repo); a failure keeps the export."""
    from tuneforge.hub import Repo

    h = cfg.hub
    repo = Repo(cfg.hub.export_hub_model_id, token=cfg.model.hf_hub_token or h.hub_token, private=h.hub_private_repo,
                revision=h.hub_revision)
    try:
        repo.create()
        repo.upload(target, "Upload model exported by tuneforge")
    except Exception as e:
        raise repo.failed("the export", target, e) from e
    return f"uploaded to {repo.url}"


def _stop_texts(tokenizer: Any, stops: Any) -> list[str]:
    return [tokenizer.decode([i]) for i in stops.token_ids] + list(stops.strings)


def _write_hf(cfg, model, tokenizer, template, stops, turns, head, folder: Path, result: dict,
              processor: Any = None) -> list[str]:
    from tuneforge.data.template import record_thinking
    from tuneforge.export.hf import generation_config, save_tokenizer, save_weights
    from tuneforge.export.modelfile import modelfile
    from tuneforge.model.value_head import VALUE_HEAD_FILE

    e = cfg.export
    model.generation_config = generation_config(model.config, tokenizer, stops.token_ids, cfg.generate)
    result["weights"] = save_weights(model, folder, max_shard_size=f"{e.export_size}GB",
                                     legacy=e.export_legacy_format)
    if processor is not None:  # the processor files, its tokenizer and chat template included
        record_thinking(processor, template.thinking)
        processor.save_pretrained(folder)
        return ["no Modelfile: Ollama imports vision-language models from GGUF with a projector file"]
    save_tokenizer(tokenizer, template.saved_text(tokenizer), folder)
    text, notes = modelfile(".", turns, system=cfg.data.default_system, stops=_stop_texts(tokenizer, stops),
                            gen=cfg.generate)
    (folder / "Modelfile").write_text(text, encoding="utf-8")
    if head is not None:
        shutil.copyfile(head / VALUE_HEAD_FILE, folder / VALUE_HEAD_FILE)
        result["value_head"] = str(Path(result["export_dir"]) / VALUE_HEAD_FILE)
    return notes


def _write_gguf(cfg, model, tokenizer, template, stops, turns, target: Path, folder: Path, result: dict) -> list[str]:
    from tuneforge.export.gguf import write_gguf
    from tuneforge.export.modelfile import modelfile

    e = cfg.export
    name = f"{target.name}-{e.export_gguf_type}.gguf"
    eot = next((i for i in stops.token_ids if i != tokenizer.eos_token_id), None)
    write_gguf(model, tokenizer, template.saved_text(tokenizer), folder / name, e.export_gguf_type, name=target.name, eot_id=eot)
    text, notes = modelfile(f"./{name}", turns, system=cfg.data.default_system,
                            stops=_stop_texts(tokenizer, stops), gen=cfg.generate)
    (folder / "Modelfile").write_text(text, encoding="utf-8")
    result["gguf_file"] = str(target / name)
    return notes


def _summary(cfg: RunConfig, sources: list[Path], result: dict, notes: list[str]) -> list[str]:
    base, adapters = sources[0], sources[1:]
    merged = f"merged {len(adapters)} adapter(s) into {base}" if adapters else f"exported {base} (no adapter)"
    lines = [f"{merged}: {result['dtype']}, on {result['device']}"]
    if result["format"] == "gguf":
        lines.append(f"GGUF ({cfg.export.export_gguf_type}) saved in {result['gguf_file']}")
    else:
        kind = "pytorch_model.bin" if cfg.export.export_legacy_format else "safetensors"
        lines.append(f"model saved in {result['export_dir']} ({kind}, {len(result['weights'])} weight file(s))")
    if "value_head" in result:
        lines.append(f"value head: {result['value_head']}")
    modelfile_path = Path(result["export_dir"]) / "Modelfile"
    if modelfile_path.is_file():  # a vision- / audio-language model's export writes none
        lines.append(f"Ollama: ollama create NAME -f {modelfile_path}")
    return lines + notes
