"""PPO through the CLI, as a LlamaFactory user runs it: a stage rm output is the reward model (reward_model_type
lora), LlamaFactory's ppo keys, the tiny model. The output is a policy adapter that peft loads as it is (the critic
beside it in critic_head.safetensors, no reward-model value head); two DDP processes end with the weights one
process trains, and a killed run resumed from its checkpoint ends where the uninterrupted one did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

PROMPTS = [{"instruction": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(8)]
FAST = ["logging_steps=1", "disable_tqdm=true", "bf16=false", "plot_loss=false", "learning_rate=1e-2"]


def cli(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "tuneforge.cli", *args], capture_output=True, text=True, cwd=ROOT,
                       env=env or os.environ, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tiny_model_dir):
    """A LoRA reward model trained one step on the tiny model (stage rm), as LlamaFactory's ppo expects."""
    out = tmp_path_factory.mktemp("rm")
    cli("train", "examples/rm_lora.yaml", f"output_dir={out}", f"model_name_or_path={tiny_model_dir}", "max_steps=1",
        "cutoff_len=64", "bf16=false", "disable_tqdm=true", "val_size=0", "eval_strategy=no", "save_strategy=no",
        "plot_loss=false")
    return out


@pytest.fixture
def ppo_config(tmp_path, reward_model):
    data = tmp_path / "data"
    data.mkdir()
    (data / "sums.json").write_text(json.dumps(PROMPTS))
    (data / "dataset_info.json").write_text(json.dumps({"sums": {"file_name": "sums.json"}}))
    config = {  # LlamaFactory's ppo keys, as its example files carry them
        "stage": "ppo", "do_train": True, "finetuning_type": "lora", "lora_rank": 4, "lora_target": "all",
        "reward_model": str(reward_model), "reward_model_type": "lora", "dataset": "sums", "dataset_dir": str(data),
        "cutoff_len": 96, "max_new_tokens": 8, "top_k": 0, "top_p": 0.9, "temperature": 1.0,
        "ppo_epochs": 2, "ppo_buffer_size": 1, "ppo_score_norm": True, "ppo_whiten_rewards": True, "ppo_target": 6.0,
        "per_device_train_batch_size": 2, "seed": 7, "report_to": "none",
        # the critic starts at zero, so some LoRA gradients of this tiny model are ~1e-8, AdamW's default epsilon,
        # where AdamW turns the rounding differences of 1 and 2 processes into 1e-4 steps at lr 1e-2
        "adam_epsilon": 1e-6,
    }
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config, out, model_dir, *overrides, processes=1):
    env = {**os.environ}
    if processes > 1:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
    return cli("train", str(config), f"output_dir={out}", f"model_name_or_path={model_dir}", *FAST, *overrides, env=env)


def logged_steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def assert_same_run(one: Path, two: Path) -> None:
    """The same logged rollouts and losses, the same adapter and critic (fp32, 2 processes against 1)."""
    for row_a, row_b in zip(logged_steps(one), logged_steps(two), strict=True):
        for key in ("reward", "kl", "kl_coef", "completions/mean_length"):
            assert row_b[key] == pytest.approx(row_a[key], abs=1e-5), key
        assert row_b["loss"] == pytest.approx(row_a["loss"], abs=1e-4)
    for name in ("adapter_model.safetensors", "critic_head.safetensors"):
        expected = load_file(one / name)
        for key, weight in load_file(two / name).items():
            # the critic's bias learns the returns' mean, which whitened scores make zero but for rounding: AdamW
            # turns that rounding into steps of ~1e-5 (as it would a reward model's bias, which stays frozen)
            atol = 1e-4 if key == "v_head.bias" else 1e-5
            torch.testing.assert_close(weight, expected[key], atol=atol, rtol=0,
                                       msg=lambda m, name=name, key=key: f"{name}: {key}: {m}")


def test_ppo_trains_against_a_reward_model_and_saves_a_policy(tmp_path, ppo_config, tiny_model_dir):
    out = tmp_path / "ppo"
    r = train(ppo_config, out, tiny_model_dir, "max_steps=4", "save_strategy=no")
    steps = logged_steps(out)
    assert [s["current_steps"] for s in steps] == [1, 2, 3, 4]
    assert {"reward", "rewards/reward_model/mean", "kl", "kl_coef", "policy_loss", "value_loss", "clip_ratio",
            "value_clip_ratio", "completions/mean_length"} <= set(steps[0])
    assert steps[0]["clip_ratio"] == 0 and steps[0]["completions/mean_length"] <= 8
    assert steps[1]["reward"] == steps[0]["reward"]  # ppo_epochs 2: step 2 is the second pass over step 1's samples
    assert "adapter and critic head saved" in r.stdout
    assert (out / "adapter_model.safetensors").is_file() and (out / "critic_head.safetensors").is_file()
    assert not (out / "value_head.safetensors").exists()  # a policy, not a reward model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    trained = load_file(out / "adapter_model.safetensors")
    assert any(w.abs().max() > 0 for n, w in trained.items() if "lora_B" in n)
    assert policy.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


def test_two_processes_train_what_one_trains_and_a_resumed_run_ends_the_same(tmp_path, ppo_config, tiny_model_dir):
    one = tmp_path / "one"
    train(ppo_config, one, tiny_model_dir, "per_device_train_batch_size=4", "max_steps=4", "save_strategy=no")
    two = tmp_path / "two"
    train(ppo_config, two, tiny_model_dir, "per_device_train_batch_size=2", "max_steps=4", "save_strategy=steps",
          "save_steps=2", processes=2)
    assert_same_run(one, two)

    resumed = tmp_path / "resumed"
    train(ppo_config, resumed, tiny_model_dir, "per_device_train_batch_size=2", "max_steps=4",
          f"resume_from_checkpoint={two / 'checkpoint-2'}", processes=2)
    assert [row["current_steps"] for row in logged_steps(resumed)] == [3, 4]
    final, expected = load_file(resumed / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-6, rtol=0)
    critic, expected = load_file(resumed / "critic_head.safetensors"), load_file(two / "critic_head.safetensors")
    torch.testing.assert_close(critic["v_head.weight"], expected["v_head.weight"], atol=1e-6, rtol=0)


def test_fsdp_processes_train_what_one_process_trains(tmp_path, ppo_config, tiny_model_dir):
    one = tmp_path / "one"
    train(ppo_config, one, tiny_model_dir, "per_device_train_batch_size=4", "max_steps=2", "save_strategy=no")
    two = tmp_path / "two"
    train(ppo_config, two, tiny_model_dir, "per_device_train_batch_size=2", "max_steps=2", "save_strategy=no",
          "fsdp=full_shard", processes=2)
    assert_same_run(one, two)


def test_zero3_processes_train_what_one_process_trains(tmp_path, ppo_config, tiny_model_dir):
    pytest.importorskip("deepspeed")
    one = tmp_path / "one"
    train(ppo_config, one, tiny_model_dir, "per_device_train_batch_size=4", "max_steps=2", "save_strategy=no")
    two = tmp_path / "two"
    r = train(ppo_config, two, tiny_model_dir, "per_device_train_batch_size=2", "max_steps=2", "save_strategy=no",
              "deepspeed=examples/deepspeed/ds_z3_config.json", processes=2)
    assert "ZeRO stage 3 over 2 processes" in r.stderr
    assert_same_run(one, two)
