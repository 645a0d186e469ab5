"""Preference stages end to end through the CLI: rm, dpo (and its orpo / simpo losses), kto.

The built-in SmolLM2 runs the shipped examples for a few steps; the tiny random Llama runs LlamaFactory's
own dpo_en_demo / kto_en_demo files unchanged, and the precomputed reference against the on-the-fly one.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

FAST = ["max_steps=2", "cutoff_len=128", "per_device_train_batch_size=2", "logging_steps=1", "disable_tqdm=true",
        "save_steps=2", "bf16=false", "val_size=0", "eval_strategy=no"]
PAIR_METRICS = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"}


def tuneforge(*args, ok=True):
    r = subprocess.run([sys.executable, "-m", "tuneforge.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def train_rows(out: Path) -> list[dict]:
    return [row for row in map(json.loads, (out / "trainer_log.jsonl").read_text().splitlines()) if "loss" in row]


def test_dpo_example_logs_the_reward_metrics_and_saves_an_adapter(tmp_path):
    out = tmp_path / "dpo"
    r = tuneforge("train", "examples/dpo_lora.yaml", f"output_dir={out}", *FAST)
    assert f"adapter saved in {out}" in r.stdout and "rewards/accuracies" in r.stdout
    rows = train_rows(out)
    assert [row["current_steps"] for row in rows] == [1, 2]
    assert PAIR_METRICS <= set(rows[0])
    # the first step's policy is the reference (LoRA B starts at zero): every reward is exactly 0
    assert rows[0]["rewards/chosen"] == 0.0 and rows[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    assert (out / "adapter_model.safetensors").is_file() and (out / "checkpoint-2").is_dir()


@pytest.mark.parametrize("loss", ["orpo", "simpo"])
def test_reference_free_losses_train(tmp_path, loss):
    out = tmp_path / loss
    tuneforge("train", f"examples/{loss}_lora.yaml", f"output_dir={out}", *FAST)
    assert PAIR_METRICS <= set(train_rows(out)[0])


def test_reward_model_saves_a_value_head_that_scores_again(tmp_path, smol_dir):
    out = tmp_path / "rm"
    r = tuneforge("train", "examples/rm_lora.yaml", f"output_dir={out}", *FAST)
    assert f"adapter and value head saved in {out}" in r.stdout
    assert {"rewards/accuracies", "rewards/margins"} <= set(train_rows(out)[0])
    assert (out / "value_head.safetensors").is_file() and (out / "checkpoint-2" / "value_head.safetensors").is_file()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tuneforge.batch import Batch, Layout
    from tuneforge.model.value_head import attach_value_head

    model = attach_value_head(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smol_dir), out), out)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    scores = model.score(Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               {"sequence_ends": torch.tensor([3, 7])}, Layout(rows="pairwise")))
    assert scores.shape == (2,) and torch.isfinite(scores).all() and scores[0] != scores[1]


def test_kto_on_llamafactory_data_unchanged(tmp_path, lf_data_dir, tiny_model_dir):
    out = tmp_path / "kto"
    tuneforge("train", "examples/kto_lora.yaml", f"model_name_or_path={tiny_model_dir}", f"dataset_dir={lf_data_dir}",
              "dataset=kto_en_demo", "max_samples=16", f"output_dir={out}", *FAST)
    rows = train_rows(out)
    assert all("kl" in row and row["kl"] >= 0 for row in rows)
    # each is averaged over its own kind of sample, so it is logged for steps that had one
    assert any("rewards/chosen" in row for row in rows) and any("rewards/rejected" in row for row in rows)


def test_precomputed_reference_gives_the_same_losses_and_is_reused(tmp_path, lf_data_dir, tiny_model_dir):
    """fp32 full fine-tuning (a frozen reference model): the losses of the run that precomputes the
    reference log-probs equal those of the run that computes them on the fly; a third run reuses them."""
    common = ["examples/dpo_lora.yaml", f"model_name_or_path={tiny_model_dir}", f"dataset_dir={lf_data_dir}",
              "dataset=dpo_en_demo", "max_samples=8", "finetuning_type=full", "learning_rate=1e-3",
              *FAST[:-3], "bf16=false", "val_size=0", "eval_strategy=no", "max_steps=3"]
    tuneforge("train", *common, f"output_dir={tmp_path / 'live'}")
    first = tuneforge("train", *common, f"output_dir={tmp_path / 'pre'}", "precompute_ref_log_probs=true")
    assert "precomputing reference log-probs" in first.stderr
    live, pre = train_rows(tmp_path / "live"), train_rows(tmp_path / "pre")
    for a, b in zip(live, pre, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], abs=1e-5)
    again = tuneforge("train", *common, f"output_dir={tmp_path / 'again'}", "precompute_ref_log_probs=true")
    assert "reference log-probs (train" in again.stderr and "cache hit" in again.stderr
    assert "precomputing" not in again.stderr
    assert "reference model:" in first.stderr and "reference model:" not in again.stderr  # not even loaded


@pytest.mark.parametrize(
    ("stage", "dataset", "message"),
    [
        ("dpo", "identity", "needs a ranking dataset"),
        ("rm", "alpaca_demo", "needs a ranking dataset"),
        ("kto", "dpo_demo", "kto"),
    ],
)
def test_a_dataset_of_the_wrong_kind_stops_before_the_model_loads(tmp_path, stage, dataset, message):
    r = tuneforge("train", "examples/dpo_lora.yaml", f"stage={stage}", f"dataset={dataset}",
                  f"output_dir={tmp_path / 'o'}", ok=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message in r.stderr and dataset in r.stderr
    assert "loaded " not in r.stderr
