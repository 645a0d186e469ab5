"""Optimizers' and schedules' state through a checkpoint: a run resumed from its middle ends where the uninterrupted one
did (weights, losses, learning rates), low-bit optimizer states and metric-driven schedules included; and the
trainer steps reduce_lr_on_plateau / greedy on its evaluations, as transformers' Trainer does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from train_helpers import collate, load_model, make_cfg, random_dataset, trainable_state

from tuneforge.train import Trainer

LENGTHS = [5, 8, 6, 9, 4, 7, 10, 6, 5, 8]  # 10 rows: 5 micro-batches of 2, 3 steps per epoch (the last short)
EVAL = random_dataset([6, 7, 5, 8], seed=9)
PLATEAU = {"mode": "min", "factor": 0.5, "patience": 0, "threshold": 10.0, "threshold_mode": "abs", "min_lr": 0.0}


def run_cfg(out, model_dir, **keys):
    base = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=7, save_steps=2,
                save_strategy="steps", learning_rate=1e-2)
    return make_cfg(out, model_dir, **{**base, **keys})


def log_of(output_dir) -> list[dict]:
    return json.loads((output_dir / "trainer_state.json").read_text())["log_history"]


# the embeddings (49152 x 32 values) get 8-bit / 4-bit states; the small matrices 32-bit ones
CASES = {
    "adamw_8bit+cosine_with_restarts": dict(optim="adamw_8bit", lr_scheduler_type="cosine_with_restarts",
                                            lr_scheduler_kwargs={"num_cycles": 2}, warmup_steps=1),
    "paged_lion_8bit+polynomial": dict(optim="paged_lion_8bit", lr_scheduler_type="polynomial", learning_rate=1e-3,
                                       lr_scheduler_kwargs={"lr_end": 1e-4, "power": 2.0}),
    "adafactor+warmup_stable_decay": dict(optim="adafactor", lr_scheduler_type="warmup_stable_decay", warmup_steps=1),
    "rmsprop_bnb_8bit+inverse_sqrt": dict(optim="rmsprop_bnb_8bit", lr_scheduler_type="inverse_sqrt", warmup_steps=2,
                                          learning_rate=1e-3, optim_args="momentum=0.5"),
    "adamw_torch_8bit+cosine_warmup_with_min_lr": dict(optim="adamw_torch_8bit", warmup_steps=2,
                                                       lr_scheduler_type="cosine_warmup_with_min_lr",
                                                       lr_scheduler_kwargs={"min_lr_rate": 0.1}),
    "sgd+reduce_lr_on_plateau": dict(optim="sgd", optim_args="momentum=0.9", lr_scheduler_type="reduce_lr_on_plateau",
                                     lr_scheduler_kwargs=PLATEAU, eval_strategy="steps", eval_steps=2),
}


@pytest.mark.parametrize("keys", list(CASES.values()), ids=list(CASES))
def test_resume_in_the_middle_is_exact(tmp_path, tiny_model_dir, keys):
    data = random_dataset(LENGTHS)
    evaluation = EVAL if "eval_strategy" in keys else None
    first = load_model(tiny_model_dir, seed=0)
    Trainer(run_cfg(tmp_path / "a", tiny_model_dir, **keys), first, None, data, evaluation, collate).train()
    expected = trainable_state(first)
    # resume from step 4 (mid-epoch 1) into a model that starts from other weights: all must be restored
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    second = load_model(tiny_model_dir, seed=1)
    cfg = run_cfg(tmp_path / "b", tiny_model_dir, resume_from_checkpoint=True, **keys)
    Trainer(cfg, second, None, data, evaluation, collate).train()
    for name, weight in trainable_state(second).items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-6, msg=name)
    a, b = log_of(tmp_path / "a"), log_of(tmp_path / "b")
    for key in ("loss", "learning_rate", "eval_loss"):
        assert [e[key] for e in b if key in e] == pytest.approx([e[key] for e in a if key in e], abs=1e-6), key
    rates = [e["learning_rate"] for e in a if "learning_rate" in e]
    assert len(set(rates)) > 1  # the schedule moved


@pytest.mark.parametrize("kind", ["reduce_lr_on_plateau", "greedy"])
def test_metric_schedules_step_on_each_evaluation(tmp_path, tiny_model_dir, kind):
    """A tiny learning rate keeps eval_loss flat, so (threshold 10) only the first evaluation counts as a new best:
    plateau halves the rate after each later one; greedy first doubles it (an improvement), then halves it."""
    data = random_dataset(LENGTHS)
    kwargs = {**PLATEAU, **({"max_lr": 1.0} if kind == "greedy" else {})}
    cfg = run_cfg(tmp_path, tiny_model_dir, learning_rate=1e-6, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs,
                  eval_strategy="steps", eval_steps=1, eval_on_start=True, max_steps=4, save_strategy="no",
                  warmup_steps=2)  # no warm-up for these schedules (a warning says so)
    Trainer(cfg, load_model(tiny_model_dir), None, data, EVAL, collate).train()
    log = log_of(tmp_path)
    assert len([e for e in log if "eval_loss" in e]) == 5  # on start (does not step the schedule), then each step
    rates = [e["learning_rate"] for e in log if "loss" in e]  # logged before the step's evaluation
    if kind == "reduce_lr_on_plateau":
        assert rates == pytest.approx([1e-6, 1e-6, 5e-7, 2.5e-7], rel=1e-9)
    else:
        assert rates == pytest.approx([1e-6, 2e-6, 1e-6, 5e-7], rel=1e-9)
