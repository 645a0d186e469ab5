"""The stage and preference-loss tables: a light leaf module whose rows every layer can resolve."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tuneforge.stages import PREF_LOSSES, STAGES, Stage, preference_problem, uses_reference


def test_reading_the_tables_and_validating_a_config_import_no_torch():
    code = ("import sys, tuneforge.stages, tuneforge.config.validate; "
            "sys.exit(1 if {'torch', 'datasets', 'transformers'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_every_built_row_resolves_in_its_registry():
    from tuneforge.data.encoders import ENCODERS
    from tuneforge.train.objectives import OBJECTIVES

    for stage in STAGES.values():
        if not stage.planned:
            assert stage.encoder in ENCODERS and stage.objective in OBJECTIVES, stage.name
            assert set(stage.dataset_kinds) <= {"plain", "pairwise", "feedback"}
    for loss in PREF_LOSSES.values():
        assert callable(loss.resolve()), loss.name


def test_the_reference_follows_the_rows():
    assert [s for s in STAGES if not STAGES[s].planned and uses_reference(s, "sigmoid")] == ["ppo", "dpo", "kto"]
    assert not uses_reference("dpo", "orpo") and not uses_reference("dpo", "simpo") and uses_reference("dpo", "ipo")


def test_rules_of_the_preference_keys():
    assert preference_problem(pref_loss="sigmoid", pref_beta=0.1, dpo_label_smoothing=0.49) is None
    assert "[0, 0.5)" in preference_problem(dpo_label_smoothing=0.5)
    assert "sigmoid only" in preference_problem(pref_loss="simpo", dpo_label_smoothing=0.1)
    assert "must be > 0" in preference_problem(kto_chosen_weight=0.0)


def test_a_row_is_checked_when_made():
    with pytest.raises(ValueError, match="reference"):
        Stage("x", "supervised", ("plain",), "plain", "lm", reference="sometimes")
    with pytest.raises(ValueError, match="encoder and an objective"):
        Stage("x", None, ("plain",), "plain", None)


def test_a_planned_stage_is_refused_before_anything_loads():
    from tuneforge.config import from_dict
    from tuneforge.errors import ConfigError
    from tuneforge.stages import Stage, register_stage, unregister

    register_stage(Stage("later", None, ("plain",), "plain", None, planned=True))
    try:
        with pytest.raises(ConfigError, match="stage 'later' is not implemented yet"):
            from_dict({"model_name_or_path": "m", "stage": "later", "dataset": "d"})
    finally:
        unregister("later", STAGES)
