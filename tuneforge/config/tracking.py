"""The experiment trackers (report_to, use_swanlab) and the hub keys: which trackers a run feeds, and the checks of
their values that need no network (before anything loads). The hub's reachability and the token's rights are
checked by tuneforge/hub.py when a run or an export starts, before the model loads."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from tuneforge.config.schema import RunConfig

# report_to name -> (the module it imports, what to pip install)
REPORTERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "swanlab": ("swanlab", "swanlab"),
    "trackio": ("trackio", "trackio"),
}
REPORT_TO_WORDS = ("none", "all", *REPORTERS)


def installed(name: str) -> bool:
    return importlib.util.find_spec(REPORTERS[name][0]) is not None


def requested_reporters(cfg: RunConfig) -> list[str]:
    """The trackers this run feeds, in report_to's order: the named ones, every installed one for `all` (as in
    transformers), and swanlab for use_swanlab (LlamaFactory's switch; once, when report_to names it too)."""
    report_to = cfg.train.report_to
    wanted = [r for r in report_to if r not in ("none", "all")]
    if "all" in report_to:  # an installed MLflow whose store cannot open here is left out (named: refused)
        wanted += [r for r in REPORTERS if installed(r) and not (r == "mlflow" and mlflow_store_problem())]
    if cfg.tracking.use_swanlab:
        wanted.append("swanlab")
    return list(dict.fromkeys(wanted))


def reporter_problem(cfg: RunConfig) -> tuple[str, str] | None:
    """(message, key) for a tracker that cannot run here, or None."""
    bad = [r for r in cfg.train.report_to if r not in REPORT_TO_WORDS]
    if bad:
        return f"report_to: {bad[0]!r} is not one of {', '.join(REPORT_TO_WORDS)}", "report_to"
    for name in requested_reporters(cfg):
        key = "use_swanlab" if name == "swanlab" and name not in cfg.train.report_to else "report_to"
        if not installed(name):
            return (f"{key}: {name} needs the {REPORTERS[name][1]} package: pip install {REPORTERS[name][1]} (or "
                    f"pip install 'tuneforge[tracking]'), or drop {name} from {key}"), key
    wanted = requested_reporters(cfg)
    if "mlflow" in wanted and mlflow_store_problem():
        return f"report_to: mlflow {mlflow_store_problem()}", "report_to"
    t = cfg.tracking
    if "swanlab" in wanted:
        if t.swanlab_mode == "local" and importlib.util.find_spec("swanboard") is None:
            return ("swanlab_mode: local needs SwanLab's local board: pip install 'swanlab[dashboard]', or use "
                    "swanlab_mode: offline (run files in swanlab_logdir, `swanlab sync` uploads them later)",
                    "swanlab_mode")
        if t.swanlab_lark_secret and not t.swanlab_lark_webhook_url:
            return "swanlab_lark_secret signs the Lark webhook: set swanlab_lark_webhook_url too", "swanlab_lark_secret"
    return None


def mlflow_store_problem() -> str | None:
    """Why MLflow's store cannot open here: a database store (its default) without the full mlflow package."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if (not uri or uri.startswith("sqlite")) and importlib.util.find_spec("sqlalchemy") is None:
        return ("writes to MLFLOW_TRACKING_URI, whose default (sqlite:///mlflow.db) needs the full mlflow package: "
                "pip install mlflow, or set MLFLOW_TRACKING_URI to your tracking server (http://host:5000)")
    return None


def default_repo_name(output_dir: str | None) -> str:
    """transformers' default hub_model_id: the output folder's name (in the token owner's namespace)."""
    return Path(output_dir or ".").resolve().name


def check_tracking(cfg: RunConfig, fail: Callable[..., None], for_training: bool) -> None:
    problem = reporter_problem(cfg)
    if problem:
        fail(problem[0], key=problem[1])
    h = cfg.hub
    repos = [("export_hub_model_id", h.export_hub_model_id)]
    if h.push_to_hub and for_training:
        repos.append(("hub_model_id", h.hub_model_id or default_repo_name(cfg.train.output_dir)))
    for key, repo in repos:
        if repo is None:
            continue
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo)
        except HFValidationError as e:
            given = "" if key != "hub_model_id" or h.hub_model_id else f" (output_dir's name: set {key})"
            fail(f"{key}: {repo!r} is not a hub repository name{given}: {e}", key=key)
