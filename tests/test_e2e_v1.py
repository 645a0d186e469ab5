"""LlamaFactory's v1 LoRA SFT example config (nested model / peft_config / dist_config, train_dataset naming its
dataset-spec YAML) runs with `tuneforge train`: only the model is changed (to the built-in one), and where it goes
and how long it runs are given on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]

# examples/v1/train_lora/train_lora_sft.yaml, its keys and values (model: Qwen/Qwen3-4B -> the built-in model)
TRAIN_LORA_SFT = {
    "model": "smollm2-135m-instruct", "model_class": "llm",
    "peft_config": {"name": "lora", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all"},
    "kernel_config": {"name": "auto"}, "dist_config": {"name": "fsdp2", "dcp_path": None},
    "train_dataset": "data/v1_sft_demo.yaml", "output_dir": "./outputs/test_lora", "micro_batch_size": 1,
    "cutoff_len": 2048, "learning_rate": 1.0e-4, "max_steps": 10, "sample_backend": "hf", "max_new_tokens": 128,
}


def run_v1(tmp_path: Path, lf_data_dir: Path, config: dict, *overrides: str) -> subprocess.CompletedProcess:
    """`tuneforge train` on the config in a LlamaFactory-like working folder (data/ = the shared demo files)."""
    (tmp_path / "data").symlink_to(lf_data_dir)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "tuneforge.cli", "train", str(path), *overrides],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)


def test_lora_sft_v1_example_config_trains(tmp_path, smol_dir, lf_data_dir):
    r = run_v1(tmp_path, lf_data_dir, TRAIN_LORA_SFT, "max_steps=2", "cutoff_len=64")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "outputs" / "test_lora"
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (16, 32, 0.05)
    assert (out / "adapter_model.safetensors").is_file() and "finished 2 steps" in r.stderr


def test_lora_dpo_v1_example_config_trains_dpo(tmp_path, smol_dir, lf_data_dir):
    # examples/v1/train_lora/train_lora_dpo.yaml; its spec names a hub dataset, so the data path is the local
    # v1 pairs (chosen_messages / rejected_messages), from which the stage is dpo
    config = {**TRAIN_LORA_SFT, "train_dataset": "data/v1_dpo_demo.jsonl", "learning_rate": 1.0e-5}
    r = run_v1(tmp_path, lf_data_dir, config, "max_steps=2", "cutoff_len=96")
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "outputs" / "test_lora" / "trainer_log.jsonl").open()]
    assert any("rewards/accuracies" in entry for entry in log), log[:2]
