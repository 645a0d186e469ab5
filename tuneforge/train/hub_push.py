"""push_to_hub for a training run (rank 0 only): the hub_strategy uploads at each checkpoint, in the background, and
the final upload of output_dir (model or adapter, model card, results, logs) once the run's outputs are complete.

hub_strategy, as transformers defines it: end uploads once, at the end; every_save also uploads the model files of
each checkpoint to the repository's root ("Training in progress, step N"); checkpoint does that and uploads the whole
latest checkpoint into last-checkpoint/ (to resume from); all_checkpoints uploads each checkpoint-N folder as it is
written, and the final upload keeps them. A checkpoint's upload is skipped while the previous one still runs, unless
hub_always_push. What a background upload reads is hard-linked into a hidden folder first, so rotating
checkpoints (save_total_limit) cannot pull files from under it.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tuneforge.atomic import partial_folder
from tuneforge.config import RunConfig
from tuneforge.config.deepspeed import DEEPSPEED_CHECKPOINT, DEEPSPEED_LAYOUT
from tuneforge.config.fsdp import SHARDED_CHECKPOINT
from tuneforge.config.tracking import default_repo_name
from tuneforge.errors import HubError
from tuneforge.hub import Repo, wait
from tuneforge.train import checkpoint
from tuneforge.train.callbacks import STOP_FILE, Callback

logger = logging.getLogger(__name__)

# what a checkpoint holds only to resume training: not part of the model pushed at every save
TRAINING_STATE = (checkpoint.OPTIMIZER, checkpoint.SCHEDULER, checkpoint.SCALER, checkpoint.RNG_STATE,
                  checkpoint.TRAINER_STATE, DEEPSPEED_CHECKPOINT, DEEPSPEED_LAYOUT, SHARDED_CHECKPOINT)
LAST_CHECKPOINT = "last-checkpoint"
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
CARD = "README.md"  # the model card (written after training, uploaded with the output)


def training_repo(cfg: RunConfig) -> Repo:
    h = cfg.hub
    return Repo(h.hub_model_id or default_repo_name(cfg.train.output_dir), token=h.hub_token or cfg.model.hf_hub_token,
                private=h.hub_private_repo, revision=h.hub_revision)


def staged(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """source's files under target as hard links (copies where links cannot be made), without the names in skip."""
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if relative.parts[0] in skip or not path.is_file():
            continue
        dest = target / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)


class HubPush(Callback):
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg, self.strategy = cfg, cfg.hub.hub_strategy
        self.output_dir = Path(cfg.train.output_dir)
        self.repo = training_repo(cfg)
        self.pending: list[Future] = []

    def on_begin(self, state: Any, resumed_from: Path | None) -> None:
        try:
            self.repo.create()
        except Exception as e:  # before the first step: nothing is lost by stopping here
            said = " ".join(str(e).split())
            raise HubError(f"push_to_hub: could not create {self.repo.url} ({type(e).__name__}: {said}); training "
                           f"has not started: check hub_model_id and hub_token, or drop push_to_hub") from e
        logger.info("push_to_hub: uploading to %s (hub_strategy %s)", self.repo.url, self.strategy)

    def on_save(self, state: Any, path: Path) -> None:
        if self.strategy == "end":
            return
        if any(not f.done() for f in self.pending) and not self.cfg.hub.hub_always_push:
            logger.info("push_to_hub: the previous upload still runs; %s is not uploaded (hub_always_push: true "
                        "uploads every checkpoint)", path.name)
            return
        message = f"Training in progress, step {state.global_step}"
        uploads = [(None, (*TRAINING_STATE, CARD))]  # the model files, to the root (its card comes at the end)
        if self.strategy == "checkpoint":
            uploads.append((LAST_CHECKPOINT, ()))
        elif self.strategy == "all_checkpoints":
            uploads.append((path.name, ()))
        for path_in_repo, skip in uploads:
            folder = partial_folder(self.output_dir / "hub-upload")
            staged(path, folder, skip)
            future = self.repo.upload(folder, message, path_in_repo=path_in_repo, background=True)
            future.add_done_callback(lambda f, folder=folder: shutil.rmtree(folder, ignore_errors=True))
            self.pending.append(future)

    def files_holding_tokens(self) -> list[str]:
        """output_dir's config files that spell out a token of this config (a UI's saved config): never uploaded."""
        tokens = [t for t in (self.cfg.hub.hub_token, self.cfg.model.hf_hub_token) if t]
        held = [p.name for p in self.output_dir.iterdir() if p.is_file() and p.suffix in CONFIG_SUFFIXES
                and any(t in p.read_text(encoding="utf-8", errors="replace") for t in tokens)] if tokens else []
        for name in held:
            logger.warning("push_to_hub: %s holds the hub token and is not uploaded", name)
        return held

    def finish(self, results: dict[str, Any]) -> None:
        """After the outputs (model card included) are written: wait for the checkpoints' uploads, then upload
        output_dir (not for a stopped run, whose model is its last checkpoint). An upload that failed raises a
        HubError that says the local output is complete."""
        for error in wait(self.pending):
            logger.warning("push_to_hub: a checkpoint's upload failed (%s: %s); the final upload follows",
                           type(error).__name__, error)
        self.pending = []
        if results.get("status") == "stopped":
            return
        ignore = [".*", STOP_FILE, *self.files_holding_tokens()]
        ignore += [] if self.strategy == "all_checkpoints" else ["checkpoint-*"]
        try:
            self.repo.upload(self.output_dir, "End of training", ignore=ignore)
        except Exception as e:
            raise self.repo.failed("training finished: its output", self.output_dir, e) from e
        logger.info("push_to_hub: uploaded %s to %s", self.output_dir, self.repo.url)
