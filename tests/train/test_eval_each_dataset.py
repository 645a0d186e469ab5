"""eval_on_each_dataset: every eval dataset gets its own figures (eval_<name>_loss, ...), in training's evaluations
and in `tuneforge eval`, and the overall eval_loss stays the token-weighted mean of all of them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tuneforge.config import from_dict
from tuneforge.eval import evaluate
from tuneforge.model.inference import use_trained_output
from tuneforge.workflow import run

REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def config(tmp_path, model_dir, **keys):
    return from_dict({
        "model_name_or_path": str(model_dir), "dataset": "alpaca_demo", "eval_dataset": "alpaca_demo,identity",
        "eval_on_each_dataset": True, "dataset_dir": str(REPO_DATA), "output_dir": str(tmp_path / "out"),
        "max_samples": 6, "cutoff_len": 96, "max_steps": 2, "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 4, "learning_rate": 1e-3, "save_strategy": "no", "disable_tqdm": True,
        "metric_for_best_model": "eval_identity_loss", **keys}, source="each.yaml")


def test_each_eval_dataset_is_measured_apart_and_together(tmp_path, tiny_model_dir, home):
    cfg = config(tmp_path, tiny_model_dir)
    trained = run(cfg)
    assert {"eval_loss", "eval_alpaca_demo_loss", "eval_identity_loss", "eval_identity_perplexity"} <= set(trained)

    measured = evaluate(use_trained_output(replace(cfg, train=replace(cfg.train, do_train=False))))
    for name in ("alpaca_demo", "identity"):  # the same figures from `tuneforge eval`, on the trained adapter
        assert measured[f"eval_{name}_loss"] == pytest.approx(trained[f"eval_{name}_loss"], rel=1e-5)
    tokens = {name: measured[f"eval_{name}_tokens"] for name in ("alpaca_demo", "identity")}
    weighted = sum(measured[f"eval_{n}_loss"] * t for n, t in tokens.items()) / sum(tokens.values())
    assert measured["eval_loss"] == pytest.approx(weighted, rel=1e-6)
    assert trained["eval_loss"] == pytest.approx(weighted, rel=1e-5)

    alone = evaluate(use_trained_output(config(tmp_path, tiny_model_dir, do_train=False, eval_dataset="identity",
                                               eval_on_each_dataset=False, metric_for_best_model=None)))
    assert alone["eval_loss"] == pytest.approx(measured["eval_identity_loss"], rel=1e-6)


def test_each_eval_dataset_is_packed_apart_and_its_rows_named(tmp_path, tiny_model_dir, home, tokenizer):
    from tuneforge.data import build

    splits = build(config(tmp_path, tiny_model_dir, stage="pt", dataset="pt_demo", eval_dataset="pt_demo,identity",
                          packing=True, metric_for_best_model=None), tokenizer)
    parts = splits.stats["eval_parts"]
    assert list(parts) == ["pt_demo", "identity"] and parts["identity"][1] == len(splits.eval)
    assert parts["pt_demo"] == [0, parts["identity"][0]] and parts["identity"][0] > 0


def test_compute_accuracy_in_training_and_in_tuneforge_eval(tmp_path, tiny_model_dir, home):
    cfg = config(tmp_path, tiny_model_dir, compute_accuracy=True, metric_for_best_model="accuracy")
    trained = run(cfg)
    for key in ("eval_accuracy", "eval_alpaca_demo_accuracy", "eval_identity_accuracy"):
        assert 0.0 <= trained[key] <= 1.0
    measured = evaluate(use_trained_output(replace(cfg, train=replace(cfg.train, do_train=False))))
    for key in ("eval_accuracy", "eval_alpaca_demo_accuracy", "eval_identity_accuracy"):
        assert measured[key] == pytest.approx(trained[key], abs=1e-6)
