"""Every example config in examples/ loads: its keys exist and its values pass every check that runs before a model
or dataset loads (a renamed or removed key, or a new rule, shows up here before a user meets it)."""

from pathlib import Path

import pytest
import torch

from tuneforge.config import load
from tuneforge.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FOR_USE = ("eval_mc.yaml", "export_lora.yaml")  # configs of tuneforge eval / export, not train
CUDA_ONLY = ("sft_full_fp8_liger.yaml",)  # refused on a machine without CUDA, naming why
NOT_CONFIGS = ("new_special_tokens.yaml",)  # the token descriptions sft_new_tokens.yaml reads
LAUNCH = {"sft_sequence_parallel.yaml": {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "3"}}  # as its comment says


@pytest.mark.parametrize("path", sorted(p for p in EXAMPLES.rglob("*.yaml") if p.name not in NOT_CONFIGS),
                         ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_loads(path, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)  # relative dataset_dir / output_dir, as a user runs them
    for name, value in LAUNCH.get(path.name, {}).items():
        monkeypatch.setenv(name, value)
    if path.name in CUDA_ONLY and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            load(str(path), [])
        return
    cfg = load(str(path), [], for_training=path.name not in FOR_USE)
    assert cfg.model.model_name_or_path
