"""The run's hooks: what a run tells the user (log lines or a progress bar, trainer_log.jsonl, loss plots,
TensorBoard, W&B, MLflow, SwanLab, trackio) and when it stops early (a signal, or a STOP file in output_dir).

The Trainer calls a list of `Callback`s at fixed points: on_begin, on_step (after every optimizer step),
on_log (a training log entry), on_evaluate (an evaluation's entry), on_save (a checkpoint written), on_end
(the results), and asks `should_stop()` once per optimizer step. The writers (ProgressCallback,
TrainerLogCallback, ReportersCallback, PlotsCallback) run on rank 0 only (the trainer does not build them
elsewhere); StopRequests runs on every rank, and the ranks agree on the step to stop at (the trainer sums the
flag with the step's other figures). trainer_log.jsonl has LlamaFactory's fields, so LlamaBoard-style tools
read it unchanged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TRAINER_LOG = "trainer_log.jsonl"
LOSS_PLOT = "training_loss.png"
EVAL_LOSS_PLOT = "training_eval_loss.png"
# plotted when logged, as LlamaFactory plots them: training_rewards_accuracies.png (preference stages),
# training_reward.png and training_eval_reward.png (the RL stages' mean reward)
METRIC_PLOTS = ("rewards/accuracies", "rewards/margins", "reward", "eval_reward")
# log_history keys that trainer_log.jsonl writes under LlamaFactory's names; every other key but these
# is an objective's metric (rewards/chosen, eval_rewards/accuracies, kl, ...) and is written as it is
STANDARD_KEYS = ("loss", "eval_loss", "learning_rate", "epoch", "grad_norm", "step", "perplexity")


def objective_metrics(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in STANDARD_KEYS}


def format_time(seconds: float) -> str:
    """H:MM:SS, as LlamaFactory writes elapsed_time / remaining_time."""
    return str(timedelta(seconds=int(seconds)))


class TrainerLog:
    """Appends one JSON line per logging step and per evaluation to output_dir/trainer_log.jsonl."""

    def __init__(self, output_dir: str | Path, total_steps: int) -> None:
        self.path = Path(output_dir) / TRAINER_LOG
        self.total_steps = total_steps

    def start(self, resumed_step: int | None) -> None:
        """A fresh run drops an old log; a resumed run keeps the lines up to its checkpoint's step."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_step is None or not self.path.exists():
            self.path.unlink(missing_ok=True)
            return
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("current_steps", 0) <= resumed_step
        ]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, step: int, entry: dict[str, Any], session: Session, total_tokens: int) -> dict[str, Any]:
        """One line from a log_history entry, appended to the file; returns it."""
        line = log_line(step, self.total_steps, entry, session, total_tokens)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return line


def log_line(step: int, total_steps: int, entry: dict[str, Any], session: Session, total_tokens: int) -> dict[str, Any]:
    """trainer_log.jsonl's line for a log_history entry; remaining time extrapolates this session's pace."""
    elapsed = session.elapsed()
    remaining = (total_steps - step) * elapsed / session.steps if session.steps else 0.0
    line = {
        "current_steps": step,
        "total_steps": total_steps,
        "loss": entry.get("loss"),
        "eval_loss": entry.get("eval_loss"),
        "lr": entry.get("learning_rate"),
        "epoch": entry.get("epoch"),
        "percentage": round(step / total_steps * 100, 2) if total_steps else 100,
        "elapsed_time": format_time(elapsed),
        "remaining_time": format_time(remaining),
        "throughput": round(session.tokens / elapsed, 2) if elapsed > 0 else None,
        "total_tokens": total_tokens,
        "grad_norm": entry.get("grad_norm"),
        **objective_metrics(entry),
    }
    return {k: v for k, v in line.items() if v is not None}


class Progress:
    """A tqdm bar when stderr is a terminal (and disable_tqdm is off); otherwise an INFO line per log."""

    def __init__(self, total_steps: int, disable_tqdm: bool) -> None:
        self.total_steps = total_steps
        self.bar = None
        self._redirect = None
        if not disable_tqdm and sys.stderr.isatty():
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
            # log records (evaluations, saves) print above the bar instead of through it
            self._redirect = logging_redirect_tqdm(loggers=[logging.root, logging.getLogger("tuneforge")])
            self._redirect.__enter__()

    def start(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def step(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def log(self, line: dict[str, Any]) -> None:
        accuracy = line.get("rewards/accuracies")
        if self.bar is not None:
            extra = {"acc": f"{accuracy:.2f}"} if accuracy is not None else {}
            self.bar.set_postfix(
                loss=f"{line.get('loss', float('nan')):.4f}",
                lr=f"{line.get('lr', 0):.2e}",
                tok_s=f"{line.get('throughput', 0):.0f}",
                **extra,
                refresh=False,
            )
            return
        grad = f" | grad_norm {line['grad_norm']:.3f}" if "grad_norm" in line else ""
        metrics = "".join(f" | {k} {v:.4f}" for k, v in line.items()
                          if ("/" in k or k in ("kl", "reward")) and isinstance(v, (int, float)))
        logger.info(
            "step %d/%d (%.0f%%) | epoch %.2f | loss %.4f | lr %.3e%s%s | %.0f tokens/s | elapsed %s | eta %s",
            line["current_steps"],
            self.total_steps,
            line["percentage"],
            line.get("epoch", 0.0),
            line.get("loss", float("nan")),
            line.get("lr", 0.0),
            grad,
            metrics,
            line.get("throughput", 0.0),
            line["elapsed_time"],
            line["remaining_time"],
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def smooth(values: list[float]) -> list[float]:
    """Exponential moving average; heavier smoothing for longer curves (as LlamaFactory's plots)."""
    if not values:
        return []
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    out, last = [], values[0]
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out


def plot_losses(log_history: list[dict[str, Any]], output_dir: str | Path) -> list[Path]:
    """training_loss.png (raw + smoothed), training_eval_loss.png when there were evaluations, and
    training_rewards_accuracies.png / training_rewards_margins.png for the preference stages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    metric_plots = [(key, f"training_{key.replace('/', '_')}.png") for key in METRIC_PLOTS]
    for key, filename in (("loss", LOSS_PLOT), ("eval_loss", EVAL_LOSS_PLOT), *metric_plots):
        points = [(e["step"], e[key]) for e in log_history if key in e]
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        fig, ax = plt.subplots()
        ax.plot(steps, values, color="#1f77b4", alpha=0.4, label="original")
        ax.plot(steps, smooth(list(values)), color="#1f77b4", label="smoothed")
        ax.set_title(f"{key} of {Path(output_dir).name}")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.legend()
        path = Path(output_dir) / filename
        fig.savefig(path, format="png", dpi=100)
        plt.close(fig)
        written.append(path)
    return written


@dataclass
class Session:
    """This process's part of the run (a resumed run counts from its own start): for speeds and the ETA."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    samples: int = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def restart(self) -> None:
        self.start = time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring this process's peak memory afresh (so loading the weights does not count)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the resident set's high-water mark (VmHWM) to the current size
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float | None:
    """The peak since reset_peak_memory: allocated device memory on CUDA, the resident set (RSS) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None



# ---- the hooks the Trainer calls ----------------------------------------------------------------------------

STOP_FILE = "STOP"  # output_dir/STOP: stop after the current optimizer step, with a checkpoint to resume from


class Callback:
    """One run hook; override what you need. `state` is the trainer's TrainerState (global_step, log_history,
    ...); entries are the log_history entries (loss, learning_rate, grad_norm, epoch, step, metrics)."""

    def on_begin(self, state: Any, resumed_from: Path | None) -> None:
        """Training starts (after a resume restored the state)."""

    def on_step(self, state: Any) -> None:
        """An optimizer step finished (and was logged, evaluated and saved as due)."""

    def on_log(self, state: Any, entry: dict[str, Any]) -> None:
        """A training log entry (every logging_steps steps, and the last steps at the end)."""

    def on_evaluate(self, state: Any, entry: dict[str, Any]) -> None:
        """An evaluation's entry (eval_loss, perplexity, eval_ metrics, epoch, step)."""

    def on_save(self, state: Any, path: Path) -> None:
        """A checkpoint was written to path (called on every rank that builds this callback)."""

    def should_stop(self) -> str | None:
        """Why training should stop after the current optimizer step, or None. Asked once per step, on every
        rank; the ranks agree (one stops, all stop at the same step)."""
        return None

    def on_end(self, state: Any, results: dict[str, Any]) -> None:
        """Training ended (completed or stopped); results are all_results.json's (status included)."""


class Callbacks(Callback):
    """Calls each callback in order."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_begin(self, state: Any, resumed_from: Path | None) -> None:
        for c in self.callbacks:
            c.on_begin(state, resumed_from)

    def on_step(self, state: Any) -> None:
        for c in self.callbacks:
            c.on_step(state)

    def on_log(self, state: Any, entry: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_log(state, entry)

    def on_evaluate(self, state: Any, entry: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_evaluate(state, entry)

    def on_save(self, state: Any, path: Path) -> None:
        for c in self.callbacks:
            c.on_save(state, path)

    def should_stop(self) -> str | None:
        for c in self.callbacks:
            reason = c.should_stop()
            if reason:
                return reason
        return None

    def on_end(self, state: Any, results: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_end(state, results)


class TrainerLogCallback(Callback):
    """output_dir/trainer_log.jsonl: a line per training log and per evaluation."""

    def __init__(self, output_dir: Path, total_steps: int, session: Session) -> None:
        self.log, self.session = TrainerLog(output_dir, total_steps), session

    def on_begin(self, state: Any, resumed_from: Path | None) -> None:
        self.log.start(state.global_step if resumed_from is not None else None)

    def on_log(self, state: Any, entry: dict[str, Any]) -> None:
        self.log.write(state.global_step, entry, self.session, state.total_tokens)

    on_evaluate = on_log


class ProgressCallback(Callback):
    """The tqdm bar, or an INFO line per training log (see Progress)."""

    def __init__(self, total_steps: int, disable_tqdm: bool, session: Session) -> None:
        self.progress, self.session, self.total_steps = Progress(total_steps, disable_tqdm), session, total_steps

    def on_begin(self, state: Any, resumed_from: Path | None) -> None:
        self.progress.start(state.global_step)

    def on_step(self, state: Any) -> None:
        self.progress.step(state.global_step)

    def on_log(self, state: Any, entry: dict[str, Any]) -> None:
        self.progress.log(log_line(state.global_step, self.total_steps, entry, self.session, state.total_tokens))

    def on_end(self, state: Any, results: dict[str, Any]) -> None:
        self.progress.close()


class ReportersCallback(Callback):
    """The trackers of report_to (train/reporters.py), fed every log and evaluation entry."""

    def __init__(self, names: list[str], cfg: Any, output_dir: Path) -> None:
        from tuneforge.train.reporters import Reporters

        self.reporters = Reporters(names, cfg, output_dir)

    def on_log(self, state: Any, entry: dict[str, Any]) -> None:
        self.reporters.log(state.global_step, entry)

    on_evaluate = on_log

    def on_end(self, state: Any, results: dict[str, Any]) -> None:
        self.reporters.close()


class PlotsCallback(Callback):
    """training_loss.png and the other plots (plot_loss), from the run's log history at its end."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir

    def on_end(self, state: Any, results: dict[str, Any]) -> None:
        plot_losses(state.log_history, self.output_dir)


class StopRequests(Callback):
    """SIGINT / SIGTERM, or output_dir/STOP: stop after the current optimizer step (the trainer saves a checkpoint
    there and writes its results with status "stopped"). The same signal a second time stops at once, as without
    this hook (a different one is ignored: torchrun sends SIGTERM to workers that a Ctrl-C already reached).

    install() puts the signal handlers in place (in the main thread only; elsewhere, e.g. in a Ray worker's
    thread, only the stop file works) and restore() puts the previous ones back."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, output_dir: Path) -> None:
        self.stop_file = Path(output_dir) / STOP_FILE
        self.received: str | None = None
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            number = getattr(signal, name)
            self.previous[number] = signal.signal(number, self._handle)

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def _handle(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.received == name:  # the same signal twice (Ctrl-C twice): stop now, as the previous handler would
            self.restore()
            signal.raise_signal(number)
            return
        if self.received is not None:  # another one: torchrun answers a Ctrl-C with SIGTERM to its workers
            return
        self.received = name
        logger.warning("%s received: stopping after this optimizer step, with a checkpoint (send it again to "
                       "stop at once, without one)", self.received)

    def should_stop(self) -> str | None:
        if self.received is not None:
            return f"{self.received} received"
        if self.stop_file.exists():
            return f"{self.stop_file} found"
        return None

    def honoured(self) -> None:
        """The stop happened: the stop file is removed, so the next run (a resume) does not stop at once."""
        self.stop_file.unlink(missing_ok=True)
