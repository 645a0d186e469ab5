"""A run as the web UI shows it, read from the run's own files (so a run started elsewhere, or before the UI was
restarted, shows the same): trainer_log.jsonl for progress and curves, all_results.json when it ended, and the
UI's launch record (webui_run.json: the process id, and its exit code once the UI saw it end) for runs it started.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.train.callbacks import TRAINER_LOG

LAUNCH_RECORD = "webui_run.json"
LOG_FILE = "webui_train.log"  # the training process's stdout and stderr
STATUSES = ("running", "finished", "stopped", "failed", "unknown")


@dataclass
class RunState:
    """What a run's folder says about it."""

    output_dir: Path
    status: str = "unknown"
    step: int = 0
    total_steps: int = 0
    percentage: float = 0.0
    elapsed: str = ""
    remaining: str = ""
    loss: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss)
    eval_loss: list[tuple[int, float]] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)  # preference / RL stages: (step, reward)
    results: dict[str, Any] = field(default_factory=dict)  # all_results.json once it ended
    error: str = ""  # the end of the log of a failed run

    @property
    def summary(self) -> str:
        done = f"step {self.step}/{self.total_steps} ({self.percentage:.0f}%)" if self.total_steps else "starting"
        eta = f", {self.elapsed} elapsed, {self.remaining} left" if self.status == "running" and self.elapsed else ""
        return f"{self.status}: {done}{eta}"


def read_log(path: Path) -> list[dict[str, Any]]:
    """trainer_log.jsonl's rows (a line still being written is left for the next read)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launch_record(output_dir: Path) -> dict[str, Any]:
    path = Path(output_dir) / LAUNCH_RECORD
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def log_tail(output_dir: Path, lines: int = 40) -> str:
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 64_000))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _status(output_dir: Path, results: dict[str, Any], record: dict[str, Any]) -> str:
    if record.get("pid") and record.get("exit_code") is None and _alive(int(record["pid"])):
        return "running"
    if results:
        return "stopped" if results.get("status") == "stopped" else "finished"
    if record.get("exit_code") not in (None, 0) or record.get("pid"):
        return "failed"  # it ended (or its process is gone) without results
    return "unknown"


def run_state(output_dir: str | Path) -> RunState:
    """The state of the run writing to output_dir."""
    root = Path(output_dir)
    rows = read_log(root / TRAINER_LOG)
    try:
        results = json.loads((root / "all_results.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        results = {}
    record = launch_record(root)
    state = RunState(root, status=_status(root, results, record), results=results)
    for row in rows:
        step = int(row.get("current_steps", 0))
        if "loss" in row:
            state.loss.append((step, float(row["loss"])))
        if "eval_loss" in row:
            state.eval_loss.append((step, float(row["eval_loss"])))
        reward = next((row[k] for k in ("rewards/chosen", "reward", "rewards/mean") if k in row), None)
        if reward is not None:
            state.rewards.append((step, float(reward)))
        if "total_steps" in row:
            state.step, state.total_steps = step, int(row["total_steps"])
            state.percentage = float(row.get("percentage", 0.0))
            state.elapsed, state.remaining = row.get("elapsed_time", ""), row.get("remaining_time", "")
    if state.status == "finished" and state.total_steps:
        state.step, state.percentage = state.total_steps, 100.0
    if state.status == "failed":
        state.error = log_tail(root, 15)
    return state


def find_runs(root: str | Path) -> list[RunState]:
    """The runs under root (folders holding a trainer_log.jsonl or a launch record), newest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    folders = {p.parent for name in (TRAINER_LOG, LAUNCH_RECORD) for p in base.glob(f"**/{name}")
               if "checkpoint-" not in p.parent.name}
    return [run_state(p) for p in sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True)]
