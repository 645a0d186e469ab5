"""Training runs as processes of their own: `tuneforge train` on the YAML the form wrote (the CLI's own function,
so a crash cannot take the UI down and two runs can go side by side), stopped as the CLI stops, through
output_dir/STOP (after the current optimizer step, with a checkpoint to resume from).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tuneforge.train.callbacks import STOP_FILE
from tuneforge.webui.runs import LAUNCH_RECORD, LOG_FILE

CONFIG_FILE = "webui_config.yaml"  # the YAML a run started from the UI runs, kept in its output_dir


class Launcher:
    """Starts and stops training processes and records each one in its output_dir (webui_run.json)."""

    def __init__(self) -> None:
        self.processes: dict[Path, subprocess.Popen] = {}

    def start(self, output_dir: str | Path, yaml_text: str, env: dict[str, str] | None = None) -> Path:
        """Write the config into output_dir and run `tuneforge train` on it; return the config's path."""
        root = Path(output_dir).resolve()
        if root in self.processes and self.processes[root].poll() is None:
            raise RuntimeError(f"a run is already writing to {root}")
        root.mkdir(parents=True, exist_ok=True)
        (root / STOP_FILE).unlink(missing_ok=True)
        config = root / CONFIG_FILE
        config.write_text(yaml_text, encoding="utf-8")
        log = (root / LOG_FILE).open("wb")
        process = subprocess.Popen([sys.executable, "-m", "tuneforge.cli", "train", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                   start_new_session=True)  # the UI's own Ctrl-C does not reach the run
        log.close()
        self.processes[root] = process
        _write_record(root, {"pid": process.pid, "started": time.time(), "config": str(config), "exit_code": None})
        threading.Thread(target=self._wait, args=(root, process), daemon=True).start()
        return config

    def _wait(self, root: Path, process: subprocess.Popen) -> None:
        code = process.wait()
        record = json.loads((root / LAUNCH_RECORD).read_text(encoding="utf-8"))
        if record.get("pid") == process.pid:
            _write_record(root, {**record, "exit_code": code, "ended": time.time()})

    def stop(self, output_dir: str | Path) -> None:
        """Ask the run to stop after its current optimizer step (it saves a checkpoint first)."""
        root = Path(output_dir).resolve()
        if root.is_dir():
            (root / STOP_FILE).touch()

    def running(self) -> list[Path]:
        return [root for root, p in self.processes.items() if p.poll() is None]

    def close(self, timeout: float = 30.0) -> None:
        """Stop every run this launcher started and wait for them (the UI is shutting down)."""
        for root in self.running():
            self.stop(root)
        deadline = time.time() + timeout
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                process.kill()


def _write_record(root: Path, record: dict) -> None:
    tmp = root / (LAUNCH_RECORD + ".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(root / LAUNCH_RECORD)
