"""workflow.train owns a run: the rules beyond the config, where the run goes, and leaving the process group."""

from __future__ import annotations

import pytest
import yaml

from tuneforge import workflow
from tuneforge.config import from_dict
from tuneforge.errors import ConfigError


def cfg(tmp_path, **keys):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **keys})


@pytest.mark.parametrize(
    ("keys", "ask", "message", "fields"),
    [
        ({"stage": "rm"}, "Who are you?", "--ask needs a model that writes answers; stage rm trains a reward model", ("stage",)),
        ({"do_train": False}, None, "nothing to do", ("do_train", "do_eval", "do_predict")),
    ],
)
def test_requests_that_cannot_work_stop_before_anything_starts(tmp_path, monkeypatch, keys, ask, message, fields):
    monkeypatch.setattr(workflow, "run", lambda *a, **k: pytest.fail("the run must not start"))
    with pytest.raises(ConfigError, match=message) as raised:
        workflow.train(cfg(tmp_path, **keys), ask=ask)
    assert raised.value.keys == fields


def test_a_failed_run_leaves_the_process_group_without_waiting_for_the_others(tmp_path, monkeypatch):
    from tuneforge.train import dist

    left = []
    monkeypatch.setattr(dist, "setup", lambda *a, **k: True)
    monkeypatch.setattr(dist, "teardown", lambda wait_for_others=True: left.append(wait_for_others))

    def broken(cfg, ask):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(workflow, "_run", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        workflow.run(cfg(tmp_path))
    assert left == [False]  # the others never reach the barrier of a clean teardown
    monkeypatch.setattr(workflow, "_run", lambda cfg, ask: {"done": True})
    assert workflow.run(cfg(tmp_path)) == {"done": True}
    assert left == [False, True]


def test_torchrun_relaunch_from_python_carries_the_config(tmp_path, monkeypatch):
    """A caller without a command line (a UI, a script) still gets the same run on every process."""
    from tuneforge.train import launch

    seen = {}

    def relaunch(plan, argv):
        seen["argv"] = argv
        seen["keys"] = yaml.safe_load(open(argv[1], encoding="utf-8"))

    monkeypatch.setattr(launch, "launch_plan", lambda: object())
    monkeypatch.setattr(launch, "relaunch", relaunch)
    config = cfg(tmp_path, learning_rate=3e-4, lora_target="q_proj,v_proj")
    assert workflow.train(config, ask="Who are you?") is None  # rank 0 of the relaunched run reports
    assert seen["argv"][0] == "train" and seen["argv"][2:] == ["--ask", "Who are you?"]
    relaunched = from_dict(seen["keys"])
    assert relaunched.to_dict() == config.to_dict()


def test_a_reward_column_the_data_lacks_stops_before_the_weights_load(tmp_path, monkeypatch, home, smol_dir):
    import json

    from tuneforge import model
    from tuneforge.errors import DataError

    (tmp_path / "q.json").write_text(json.dumps([{"instruction": "What is 2 + 2?", "solved": "4"}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"q": {"file_name": "q.json"}}))
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the weights must not load"))
    config = from_dict({"model_name_or_path": str(smol_dir), "stage": "grpo", "dataset": "q",
                        "dataset_dir": str(tmp_path), "output_dir": str(tmp_path / "out"),
                        "reward_funcs": ["accuracy"], "temperature": 1.0})
    with pytest.raises(DataError, match=r"dataset 'q': .*answer.*instruction, solved.*reward_answer_column"):
        workflow.run(config)
