"""A run's state from its own files, and the lifecycle of a run the UI starts (a real `tuneforge train` process)."""

from __future__ import annotations

import json
import os
import time

from tuneforge.train.callbacks import STOP_FILE
from tuneforge.webui.process import CONFIG_FILE, Launcher
from tuneforge.webui.runs import LAUNCH_RECORD, find_runs, run_state


def _log(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"current_st')


def test_progress_curves_and_status_come_from_the_runs_files(tmp_path):
    run = tmp_path / "a"
    _log(run, [{"current_steps": 1, "total_steps": 4, "loss": 2.0, "percentage": 25.0, "elapsed_time": "0:00:01",
                "remaining_time": "0:00:03"},
               {"current_steps": 2, "total_steps": 4, "eval_loss": 1.9, "percentage": 50.0},
               {"current_steps": 2, "total_steps": 4, "loss": 1.5, "rewards/chosen": 0.25, "percentage": 50.0}])
    state = run_state(run)
    assert state.status == "unknown" and (state.step, state.total_steps, state.percentage) == (2, 4, 50.0)
    assert state.loss == [(1, 2.0), (2, 1.5)] and state.eval_loss == [(2, 1.9)] and state.rewards == [(2, 0.25)]
    (run / LAUNCH_RECORD).write_text(json.dumps({"pid": os.getpid(), "exit_code": None}))
    assert run_state(run).status == "running"  # its process is alive
    (run / "all_results.json").write_text(json.dumps({"train_loss": 1.7}))
    (run / LAUNCH_RECORD).write_text(json.dumps({"pid": os.getpid(), "exit_code": 0}))
    state = run_state(run)
    assert state.status == "finished" and state.step == 4 and state.results == {"train_loss": 1.7}
    (run / "all_results.json").write_text(json.dumps({"train_loss": 1.7, "status": "stopped"}))
    assert run_state(run).status == "stopped"
    (run / "all_results.json").unlink()
    (run / LAUNCH_RECORD).write_text(json.dumps({"pid": 2**22 + 12345, "exit_code": None}))  # gone, no results
    assert run_state(run).status == "failed"

    _log(tmp_path / "nested" / "b", [{"current_steps": 1, "total_steps": 1, "loss": 1.0}])
    _log(tmp_path / "nested" / "b" / "checkpoint-1", [])
    found = [s.output_dir.relative_to(tmp_path).as_posix() for s in find_runs(tmp_path)]
    assert sorted(found) == ["a", "nested/b"]


def test_a_run_the_ui_starts_is_the_clis_and_its_failure_is_read_back(tmp_path, home):
    launcher = Launcher()
    out = tmp_path / "run"
    yaml_text = "model_name_or_path: /nonexistent/model\ndataset: [identity]\ndataset_dir: data\n" \
                f"output_dir: {out}\n"
    config = launcher.start(out, yaml_text)
    assert config == out.resolve() / CONFIG_FILE and config.read_text() == yaml_text
    launcher.close(timeout=120)
    deadline = time.time() + 10
    while json.loads((out / LAUNCH_RECORD).read_text()).get("exit_code") is None and time.time() < deadline:
        time.sleep(0.1)
    state = run_state(out)
    assert state.status == "failed" and "/nonexistent/model" in state.error


def test_stop_asks_the_run_to_stop_as_the_cli_does(tmp_path):
    Launcher().stop(tmp_path)
    assert (tmp_path / STOP_FILE).is_file()
