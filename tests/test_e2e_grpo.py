"""GRPO through the CLI, as a user runs it: one YAML, a reward function from a file, the tiny model.

Sampling is seeded per prompt, so the completions do not depend on how prompts are split over micro-batches or
processes: two DDP processes (and two FSDP2 processes) end with the weights one process trains with the same
global batch, and a run resumed from a checkpoint ends where the uninterrupted one did. A reward server
(`tuneforge api` on an rm output) scores the completions over HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

REWARD = '''
def characters(completions, answer, **kwargs):
    """A reward that varies between random completions: a seventh of the characters' code sum modulo 7."""
    return [sum(map(ord, c)) % 7 / 7 if a is not None else None for c, a in zip(completions, answer)]
'''
PROMPTS = [{"instruction": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(8)]
FAST = ["max_steps=3", "logging_steps=1", "disable_tqdm=true", "bf16=false", "plot_loss=false",
        "learning_rate=1e-2", "save_strategy=no"]


@pytest.fixture
def run_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "sums.json").write_text(json.dumps(PROMPTS))
    (data / "dataset_info.json").write_text(json.dumps({"sums": {"file_name": "sums.json"}}))
    reward = tmp_path / "my_rewards.py"
    reward.write_text(REWARD)
    config = {
        "stage": "grpo", "finetuning_type": "lora", "lora_rank": 4, "lora_target": "all", "dataset": "sums",
        "dataset_dir": str(data), "cutoff_len": 96, "num_generations": 4, "max_completion_length": 8,
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "reward_funcs": [f"{reward}:characters", "length"],
        "reward_weights": [1.0, 0.1], "per_device_train_batch_size": 2, "seed": 7, "report_to": "none",
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config, out, model_dir, *overrides, processes=1, fsdp=False):
    env = {**os.environ}
    if processes > 1:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
    r = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "train", str(config), f"output_dir={out}",
         f"model_name_or_path={model_dir}", *FAST, *(["fsdp=full_shard"] if fsdp else []), *overrides],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def logged_steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def assert_same_run(one: Path, two: Path, atol: float) -> None:
    a, b = logged_steps(one), logged_steps(two)
    assert [r["current_steps"] for r in a] == [r["current_steps"] for r in b]
    for row_a, row_b in zip(a, b, strict=True):
        for key in ("reward", "rewards/characters/mean", "completions/mean_length"):
            assert row_b[key] == pytest.approx(row_a[key], abs=1e-6), key
        assert row_b["loss"] == pytest.approx(row_a["loss"], abs=atol)
    weights_a, weights_b = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], atol=atol, rtol=0)


def test_grpo_trains_logs_and_saves_an_adapter(tmp_path, run_files, tiny_model_dir):
    out = tmp_path / "one"
    r = train(run_files, out, tiny_model_dir, "eval_dataset=sums", "eval_strategy=steps", "eval_steps=3",
              "per_device_eval_batch_size=4")
    steps = logged_steps(out)
    assert [s["current_steps"] for s in steps] == [1, 2, 3]
    first = steps[0]
    assert {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "clip_ratio"} <= set(first)
    assert "rewards/characters/mean" in first and first["rewards/characters/std"] > 0
    assert "rewards/length/mean" in first and "rewards/length/std" in first
    assert len(first["samples"]) == 2 and {"prompt", "completion", "reward"} <= set(first["samples"][0])
    assert first["completions/mean_length"] <= 8
    evals = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert evals and "eval_reward" in evals[-1]
    assert (out / "adapter_model.safetensors").is_file() and "reward" in r.stdout
    assert any(w.abs().max() > 0 for n, w in load_file(out / "adapter_model.safetensors").items() if "lora_B" in n)


def test_two_processes_train_what_one_trains_and_a_resumed_run_ends_the_same(tmp_path, run_files, tiny_model_dir):
    one = tmp_path / "one"
    train(run_files, one, tiny_model_dir, "per_device_train_batch_size=4", "scale_rewards=batch")
    two = tmp_path / "two"
    train(run_files, two, tiny_model_dir, "per_device_train_batch_size=2", "scale_rewards=batch",
          "save_strategy=steps", "save_steps=2", processes=2)
    assert_same_run(one, two, atol=1e-5)

    resumed = tmp_path / "resumed"
    train(run_files, resumed, tiny_model_dir, "per_device_train_batch_size=2", "scale_rewards=batch",
          f"resume_from_checkpoint={two / 'checkpoint-2'}", processes=2)
    assert [row["current_steps"] for row in logged_steps(resumed)] == [3]
    assert logged_steps(resumed)[0]["reward"] == pytest.approx(logged_steps(two)[2]["reward"], abs=1e-6)
    final, expected = load_file(resumed / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-6, rtol=0)


def test_fsdp_processes_sample_and_train_what_one_process_does(tmp_path, run_files, tiny_model_dir):
    one = tmp_path / "one"
    train(run_files, one, tiny_model_dir, "per_device_train_batch_size=4", "beta=0.05")
    two = tmp_path / "two"
    train(run_files, two, tiny_model_dir, "per_device_train_batch_size=2", "beta=0.05", processes=2, fsdp=True)
    assert_same_run(one, two, atol=1e-5)
    assert logged_steps(one)[-1]["kl"] >= 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_reward_server_scores_over_http(tmp_path, run_files, tiny_model_dir):
    """An rm output served by `tuneforge api` is the reward model of a grpo run (reward_model_type: api)."""
    rm = tmp_path / "rm"
    subprocess.run([sys.executable, "-m", "tuneforge.cli", "train", "examples/rm_lora.yaml", f"output_dir={rm}",
                    f"model_name_or_path={tiny_model_dir}", "max_steps=1", "cutoff_len=64", "bf16=false",
                    "disable_tqdm=true", "val_size=0", "eval_strategy=no", "save_strategy=no", "plot_loss=false"],
                   check=True, capture_output=True, cwd=ROOT, timeout=600)
    port = free_port()
    serve = tmp_path / "serve.yaml"
    serve.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "adapter_name_or_path": str(rm)}))
    server = subprocess.Popen(
        [sys.executable, "-m", "tuneforge.cli", "api", str(serve)],
        cwd=ROOT, env={**os.environ, "API_PORT": str(port), "API_HOST": "127.0.0.1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=1)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-3000:]
                time.sleep(0.5)
        out = tmp_path / "served"
        train(run_files, out, tiny_model_dir, "reward_funcs=length", "reward_weights=0.1,1.0",
              f"reward_model={url}", "reward_model_type=api", "max_steps=1")
        step = logged_steps(out)[0]
        assert "rewards/reward_model/mean" in step and step["rewards/reward_model/std"] > 0
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_zero3_processes_sample_and_train_what_one_process_does(tmp_path, run_files, tiny_model_dir):
    pytest.importorskip("deepspeed")
    one = tmp_path / "one"
    train(run_files, one, tiny_model_dir, "per_device_train_batch_size=4", "beta=0.05")
    two = tmp_path / "two"
    train(run_files, two, tiny_model_dir, "per_device_train_batch_size=2", "beta=0.05",
          "deepspeed=examples/deepspeed/ds_z3_config.json", processes=2)
    assert_same_run(one, two, atol=1e-5)
