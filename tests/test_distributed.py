"""Many processes through the CLI, as a user runs them: FORCE_TORCHRUN=1 NPROC_PER_NODE=2 on the CPU (gloo).

With the same global batch, two DDP processes must train exactly what one process does: the same logged
losses and metrics step by step, and the same final weights (fp32, 1e-4)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

FAST = ["max_steps=3", "cutoff_len=64", "logging_steps=1", "disable_tqdm=true", "bf16=false", "val_size=0",
        "eval_strategy=no", "save_strategy=no", "plot_loss=false", "learning_rate=1e-2"]


def train(config, out, model_dir, *overrides, processes=1):
    env = {**os.environ, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(processes)} if processes > 1 else None
    r = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "train", config, f"output_dir={out}",
         f"model_name_or_path={model_dir}", *FAST, *overrides],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def logged_steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def assert_same_run(one: Path, two: Path, keys: tuple[str, ...]) -> None:
    a, b = logged_steps(one), logged_steps(two)
    assert len(a) == len(b) == 3
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a["total_tokens"] == row_b["total_tokens"]  # every rank's tokens counted once
        for key in keys:
            assert row_b[key] == pytest.approx(row_a[key], abs=1e-4), key
    weights_a, weights_b = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], atol=1e-4, rtol=0)


def test_two_ddp_processes_train_what_one_process_trains(tmp_path, tiny_model_dir):
    one = tmp_path / "one"
    train("examples/sft_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4")
    two = tmp_path / "two"
    r = train("examples/sft_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2", processes=2)
    assert r.stdout.count("adapter saved in") == 1  # rank 0 reports for both
    assert_same_run(one, two, ("loss", "grad_norm"))


def test_kto_under_ddp_estimates_kl_over_all_ranks(tmp_path, tiny_model_dir):
    """KTO's KL estimate z is the whole batch's: its sum and count are all-reduced over the ranks."""
    one = tmp_path / "one"
    train("examples/kto_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4",
          "gradient_accumulation_steps=2")
    two = tmp_path / "two"
    train("examples/kto_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2",
          "gradient_accumulation_steps=2", processes=2)
    assert_same_run(one, two, ("loss", "kl", "rewards/chosen", "rewards/rejected"))


def test_a_malformed_launch_variable_stops_before_any_process_starts(tmp_path, tiny_model_dir):
    env = {**os.environ, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "two"}
    r = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "train", "examples/sft_lora.yaml", f"output_dir={tmp_path}",
         f"model_name_or_path={tiny_model_dir}"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )
    assert r.returncode == 2 and "NPROC_PER_NODE='two' must be a whole number" in r.stderr
