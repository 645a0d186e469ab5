"""A config as LlamaBoard saves it (training_args.yaml: every key its Train tab writes, at the values a new user's
form holds) runs with `tuneforge train` unchanged; only where it goes and how long it runs are given on the
command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]

LLAMABOARD_ARGS = {
    "stage": "sft", "do_train": True, "model_name_or_path": "smollm2-135m-instruct", "preprocessing_num_workers": 16,
    "finetuning_type": "lora", "template": "default", "rope_scaling": None, "flash_attn": "auto",
    "use_unsloth": False, "enable_liger_kernel": False, "dataset_dir": "data", "dataset": "identity",
    "cutoff_len": 2048, "learning_rate": 5.0e-05, "num_train_epochs": 3.0, "max_samples": 100000, "seed": 42,
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8, "lr_scheduler_type": "cosine",
    "max_grad_norm": 1.0, "logging_steps": 5, "save_steps": 100, "warmup_steps": 0, "neftune_noise_alpha": None,
    "packing": False, "neat_packing": False, "train_on_prompt": False, "mask_history": False, "resize_vocab": False,
    "use_llama_pro": False, "enable_thinking": True, "report_to": "none", "use_galore": False, "use_apollo": False,
    "use_badam": False, "use_swanlab": False, "fp16": False, "bf16": False, "pure_bf16": False, "plot_loss": True,
    "trust_remote_code": True, "ddp_timeout": 180000000, "include_num_input_tokens_seen": True, "optim": "adamw_torch",
    "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0, "lora_target": "all", "use_rslora": False,
    "use_dora": False, "pissa_init": False, "create_new_adapter": False,
    "output_dir": "saves/SmolLM2-135M-Instruct/lora/train_2026-12-04-19-30-00",
}


def test_a_llamaboard_training_args_file_runs_unchanged(tmp_path, smol_dir):
    saved = tmp_path / "training_args.yaml"
    saved.write_text(yaml.safe_dump(LLAMABOARD_ARGS))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tuneforge.cli", "train", str(saved), f"output_dir={out}", "max_steps=2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file() and "finished 2 steps" in r.stderr
