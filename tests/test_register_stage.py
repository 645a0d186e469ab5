"""A new stage and a new preference loss, registered from this file alone, train end to end through workflow.run.

The stage "focal" reuses the supervised encoder and brings its own objective (focal cross-entropy); the loss
"toy_margin" is a reference-free hinge on length-normalized log-probs that takes simpo_gamma as its margin.
Nothing in tuneforge names either of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tuneforge.batch import Batch
from tuneforge.config import from_dict
from tuneforge.errors import ConfigError
from tuneforge.stages import (
    PREF_LOSSES,
    STAGES,
    PrefLoss,
    Stage,
    register_pref_loss,
    register_stage,
    unregister,
)
from tuneforge.train.objectives import OBJECTIVES, ObjectiveOutput, register_objective
from tuneforge.train.objectives.losses import PairLosses
from tuneforge.train.objectives.token_logps import supervised_positions, token_logps

REPO_DATA = Path(__file__).resolve().parents[1] / "data"


class FocalObjective:
    """Focal cross-entropy -(1 - p)^gamma log p over the supervised tokens; the unit is a supervised token."""

    name = "focal"
    reports_perplexity = False

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def count(self, batch: Batch) -> int:
        return int(supervised_positions(batch).sum())

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        logps = token_logps(model, batch)
        weights = (1 - logps.exp()).pow(self.gamma)
        return ObjectiveOutput(loss_sum=-(weights * logps).sum(),
                               metrics={"focal/weight": weights.detach().sum()})


def toy_margin_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, margin: float) -> PairLosses:
    """relu(margin - beta * (avg log pi_c - avg log pi_r)); rewards beta * avg log pi."""
    chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
    return PairLosses(torch.relu(margin - (chosen_rewards - rejected_rewards)), chosen_rewards.detach(),
                      rejected_rewards.detach())


@pytest.fixture
def toys():
    built = []

    def focal_factory(cfg, reference=None, generate=None):
        built.append((cfg.method.stage, reference, generate))
        return FocalObjective(gamma=2.0)

    register_stage(Stage("focal", encoder="supervised", dataset_kinds=("plain",), rows="plain", objective="focal",
                         summary="focal cross-entropy on the assistant turns"))
    register_objective("focal", focal_factory)
    register_pref_loss(PrefLoss("toy_margin", toy_margin_loss, needs_reference=False, length_normalized=True,
                                options={"simpo_gamma": "margin"}))
    yield built
    unregister("focal", STAGES)
    unregister("focal", OBJECTIVES)
    unregister("toy_margin", PREF_LOSSES)


def config(tmp_path, model_dir, **keys):
    raw = {
        "model_name_or_path": str(model_dir), "finetuning_type": "full", "dataset_dir": str(REPO_DATA),
        "output_dir": str(tmp_path / "out"), "max_samples": 8, "cutoff_len": 128, "max_steps": 3,
        "per_device_train_batch_size": 2, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no",
        "disable_tqdm": True, **keys,
    }
    return from_dict(raw, source="toy.yaml")


def logged(tmp_path) -> list[dict]:
    log = tmp_path / "out" / "trainer_log.jsonl"
    return [r for r in map(json.loads, log.read_text().splitlines()) if r.get("loss") is not None]


def test_a_registered_stage_trains_with_its_own_objective(tmp_path, tiny_model_dir, toys, monkeypatch):
    from tuneforge.workflow import run

    monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "home"))
    results = run(config(tmp_path, tiny_model_dir, stage="focal", dataset="alpaca_demo"))
    [(name, reference, generate)] = toys
    assert (name, reference) == ("focal", None)  # no reference for a stage whose row says never
    assert callable(generate)  # the workflow hands every objective the rollout generator (built on first use)
    assert results["global_step"] == 3
    rows = logged(tmp_path)
    assert len(rows) == 3 and all("focal/weight" in r and 0 < r["focal/weight"] < 1 for r in rows)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_a_registered_preference_loss_trains_as_stage_dpo(tmp_path, tiny_model_dir, toys, monkeypatch):
    from tuneforge.workflow import run

    monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "home"))
    cfg = config(tmp_path, tiny_model_dir, stage="dpo", pref_loss="toy_margin", simpo_gamma=0.25,
                 dataset="dpo_demo")
    results = run(cfg)
    assert results["global_step"] == 3
    rows = logged(tmp_path)
    # rewards are beta * the average log-probs (no reference); the tiny margins stay under 0.25, so the
    # hinge is active on every pair and the mean loss is 0.25 minus the mean margin
    assert all(r["loss"] == pytest.approx(0.25 - r["rewards/margins"], abs=1e-6) for r in rows)


def test_the_tables_drive_config_validation(tmp_path, tiny_model_dir, toys):
    with pytest.raises(ConfigError, match="pref_loss toy_margin uses no reference model"):
        config(tmp_path, tiny_model_dir, stage="dpo", pref_loss="toy_margin", dataset="dpo_demo", ref_model="m")
    with pytest.raises(ConfigError, match="applies to pref_loss sigmoid only"):
        config(tmp_path, tiny_model_dir, stage="dpo", pref_loss="toy_margin", dataset="dpo_demo",
               dpo_label_smoothing=0.1)
    with pytest.raises(ConfigError, match="ref_model is for stages sft, ppo, dpo, kto and grpo; stage focal"):
        config(tmp_path, tiny_model_dir, stage="focal", dataset="alpaca_demo", ref_model="m")
    unregister("focal", STAGES)
    with pytest.raises(ConfigError, match="stage"):
        config(tmp_path, tiny_model_dir, stage="focal", dataset="alpaca_demo")
