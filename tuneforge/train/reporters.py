"""The experiment trackers of report_to (and use_swanlab): TensorBoard, Weights & Biases, MLflow, SwanLab and trackio.

Each is fed the same numbers as trainer_log.jsonl, under the same names: train/loss, train/learning_rate,
train/grad_norm, train/epoch and the objective's metrics for a training log; eval/loss, eval/perplexity and the
eval_ metrics for an evaluation (`scalars`). Each gets the run's config once at the start, without its secrets
(tokens, API keys, webhooks: `public_config`). Which trackers run, and whether their packages are installed, is
decided before training (tuneforge/config/tracking.py); a tracker that fails to start stops the run with its name.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from tuneforge.config import RunConfig
from tuneforge.config.tracking import reporter_problem, requested_reporters
from tuneforge.errors import ConfigError, TrainingError

logger = logging.getLogger(__name__)

SECRET_PARTS = ("token", "api_key", "secret", "webhook")


def requested(cfg: RunConfig) -> list[str]:
    """The trackers to start; a ConfigError when one cannot run here (also for a RunConfig built in code)."""
    problem = reporter_problem(cfg)
    if problem:
        raise ConfigError(f"{cfg.source}: {problem[0]}", key=problem[1])
    return requested_reporters(cfg)


def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The flat config without the values no tracker should store (hub_token, swanlab_api_key, ...)."""
    return {k: v for k, v in cfg.to_dict().items() if not any(part in k for part in SECRET_PARTS)}


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """A log_history entry's numbers under the trackers' names: eval/... for an evaluation's, train/... else."""
    out = {}
    for key, value in values.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        evaluated = key.startswith("eval_") or key == "perplexity"
        out[("eval/" if evaluated else "train/") + key.removeprefix("eval_")] = float(value)
    return out


class TensorBoard:
    def __init__(self, cfg: RunConfig, output_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "runs"))
        self.writer.add_text("config", "\n".join(f"    {k}: {v!r}" for k, v in config.items()))

    def log(self, step: int, numbers: dict[str, float]) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, cfg: RunConfig, output_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.run or wandb.init(project=os.environ.get("WANDB_PROJECT", "tuneforge"), config=config,
                                           name=cfg.tracking.run_name, dir=str(output_dir))

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.wandb.finish()


class MLflow:
    """The run goes to MLFLOW_TRACKING_URI (experiment MLFLOW_EXPERIMENT_NAME), as transformers' integration does; an
    active run (started by the caller) is logged into and left open."""

    def __init__(self, cfg: RunConfig, output_dir: Path, config: dict[str, Any]) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.mlflow = mlflow
        self.own_run = mlflow.active_run() is None
        if self.own_run:
            mlflow.start_run(run_name=cfg.tracking.run_name)
        params = [(k, v) for k, v in config.items() if len(str(v)) <= MAX_PARAM_VAL_LENGTH]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(params[i : i + MAX_PARAMS_TAGS_PER_BATCH]))
        mlflow.set_tag("tuneforge.output_dir", str(output_dir.resolve()))

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        if self.own_run:
            self.mlflow.end_run()


class SwanLab:
    """LlamaFactory's swanlab_* keys; swanlab_mode cloud is SwanLab's online mode."""

    def __init__(self, cfg: RunConfig, output_dir: Path, config: dict[str, Any]) -> None:
        import swanlab

        t = cfg.tracking
        mode = "online" if t.swanlab_mode == "cloud" else t.swanlab_mode  # SwanLab's word for LlamaFactory's
        if t.swanlab_api_key and mode == "online":
            swanlab.login(api_key=t.swanlab_api_key)
        callbacks = []
        if t.swanlab_lark_webhook_url:
            from swanlab.plugin.notification import LarkCallback

            callbacks.append(LarkCallback(webhook_url=t.swanlab_lark_webhook_url, secret=t.swanlab_lark_secret))
        self.swanlab = swanlab
        self.run = swanlab.init(project=t.swanlab_project, workspace=t.swanlab_workspace,
                                name=t.swanlab_run_name or t.run_name, mode=mode, log_dir=t.swanlab_logdir,
                                config=config, tags=["tuneforge"], callbacks=callbacks or None)

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.swanlab.log(numbers, step=step)

    def close(self) -> None:
        self.swanlab.finish()


class Trackio:
    """transformers' project / run_name / trackio_* keys: logged locally (TRACKIO_DIR) unless trackio_space_id names
    a Space; a resumed run with the same run_name continues its run."""

    def __init__(self, cfg: RunConfig, output_dir: Path, config: dict[str, Any]) -> None:
        import trackio

        t = cfg.tracking
        self.trackio = trackio
        trackio.init(project=t.project, name=t.run_name, space_id=t.trackio_space_id, bucket_id=t.trackio_bucket_id,
                     private=cfg.hub.hub_private_repo, config=config, resume="allow" if t.run_name else "never")

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.trackio.log(numbers, step=step)

    def close(self) -> None:
        self.trackio.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow, "swanlab": SwanLab, "trackio": Trackio}


class Reporters:
    """The run's trackers, started in report_to's order, fed every log and evaluation entry."""

    def __init__(self, names: list[str], cfg: RunConfig, output_dir: str | Path) -> None:
        config, self.trackers = public_config(cfg), []
        for name in names:
            try:
                self.trackers.append(TRACKERS[name](cfg, Path(output_dir), config))
            except Exception as e:  # the tracker's own error (a store it cannot open, a login it lacks)
                self.close()
                raise TrainingError(f"{cfg.source}: report_to {name} could not start: {type(e).__name__}: {e}") from e
            logger.info("reporting to %s", name)

    def log(self, step: int, values: dict[str, Any]) -> None:
        numbers = scalars(values)
        for tracker in self.trackers:
            tracker.log(step, numbers)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
