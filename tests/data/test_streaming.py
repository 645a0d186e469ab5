"""streaming: the training rows are read, shuffled, tokenized and packed while training; the same rows as a built
dataset when nothing is shuffled, and a resumed run continues at the exact row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneforge.config import from_dict
from tuneforge.errors import ConfigError
from tuneforge.workflow import run

REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def config(tmp_path, model_dir, out="out", **keys):
    return from_dict({
        "model_name_or_path": str(model_dir), "dataset": "alpaca_demo", "dataset_dir": str(REPO_DATA),
        "output_dir": str(tmp_path / out), "finetuning_type": "full", "cutoff_len": 64, "max_steps": 6,
        "per_device_train_batch_size": 2, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no",
        "disable_tqdm": True, "streaming": True, **keys}, source="stream.yaml")


def losses(tmp_path, out="out"):
    log = tmp_path / out / "trainer_log.jsonl"
    return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if r.get("loss") is not None]


def test_unshuffled_stream_trains_on_the_rows_a_built_dataset_gives(tmp_path, tiny_model_dir, home):
    run(config(tmp_path, tiny_model_dir, out="streamed", disable_shuffling=True))
    run(config(tmp_path, tiny_model_dir, out="built", disable_shuffling=True, streaming=False))
    assert losses(tmp_path, "streamed") == pytest.approx(losses(tmp_path, "built"), rel=1e-5)
    assert len(losses(tmp_path, "streamed")) == 6


@pytest.mark.parametrize("keys", [{}, {"stage": "pt", "dataset": "pt_demo"}, {"packing": True}],
                         ids=["sft-shuffled", "pt-packed", "sft-packed"])
def test_a_resumed_stream_continues_at_the_exact_row(tmp_path, tiny_model_dir, home, keys):
    run(config(tmp_path, tiny_model_dir, out="whole", buffer_size=16, save_strategy="steps", save_steps=3, **keys))
    run(config(tmp_path, tiny_model_dir, out="resumed", buffer_size=16,
               resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3"), **keys))
    assert losses(tmp_path, "resumed")[-3:] == pytest.approx(losses(tmp_path, "whole")[3:], rel=1e-5)


def test_a_short_stream_starts_a_new_pass(tmp_path, tiny_model_dir, home):
    result = run(config(tmp_path, tiny_model_dir, max_samples=4, max_steps=5))  # 4 rows, 10 asked for
    assert result["global_step"] == 5 and len(losses(tmp_path)) == 5


@pytest.mark.parametrize(("keys", "words"), [
    ({"max_steps": -1}, "streaming has no length to count epochs in: set max_steps"),
    ({"val_size": 0.1}, "name the evaluation data in eval_dataset"),
    ({"stage": "grpo", "cutoff_len": 512, "reward_funcs": "length"}, "stage grpo samples answers to prompts"),
])
def test_what_a_stream_cannot_do_is_refused_before_anything_runs(tmp_path, tiny_model_dir, keys, words):
    with pytest.raises(ConfigError, match=words):
        config(tmp_path, tiny_model_dir, **keys)
