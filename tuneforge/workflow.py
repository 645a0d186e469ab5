"""One dispatch from stage to run: tokenizer -> data -> model -> the one Trainer -> outputs.

A Stage is a row in STAGES, not a subclass: its encoder (chosen by the data package from
cfg.method.stage) and its objective. Adding a stage = one encoder, one objective, one row.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneforge.config import RunConfig
from tuneforge.train.objectives import Objective, lm_objective

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    encoder: str  # the name of the data/encode.py encoder, for the docs and the log
    objective: Objective


STAGES: dict[str, Stage] = {
    "pt": Stage(encoder="pretrain", objective=lm_objective),
    "sft": Stage(encoder="supervised", objective=lm_objective),
}


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_data(cfg: RunConfig, tokenizer=None):
    """Tokenizer + tokenized splits (cached); everything `tuneforge preprocess` needs, no model weights."""
    from tuneforge.data import build
    from tuneforge.model import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(cfg.model)
    splits = build(cfg, tokenizer)
    logger.info("data: %s", ", ".join(f"{k}={v}" for k, v in splits.stats.items() if not isinstance(v, dict)))
    return tokenizer, splits


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train cfg.method.stage end to end; returns the results plus where the outputs are."""
    from tuneforge.data.collate import Collator
    from tuneforge.model import load_model
    from tuneforge.model.attention import supports_padding_free
    from tuneforge.train import Trainer

    stage = STAGES[cfg.method.stage]
    seed_everything(cfg.train.seed)
    logger.info("stage %s: encoder %s, finetuning %s", cfg.method.stage, stage.encoder, cfg.method.finetuning_type)
    # data first: a bad row or template fails before the weights load
    tokenizer, splits = prepare_data(cfg)
    model = load_model(cfg)  # logs what it loaded and the trainable-parameter count
    padding_free = cfg.data.padding_free and supports_padding_free(model)
    if cfg.data.padding_free and not padding_free:
        logger.info("padding_free: %s does not use transformers' attention interface; batches are padded",
                    type(model).__name__)
    collator = Collator(tokenizer.pad_token_id, padding_free=padding_free)
    trainer = Trainer(cfg, model, tokenizer, splits.train, splits.eval, collator, objective=stage.objective)
    results = trainer.train()
    return {**results, **loss_curve(Path(cfg.train.output_dir)), "output_dir": cfg.train.output_dir}


def loss_curve(output_dir: Path) -> dict[str, float]:
    """First and last logged training loss, read back from trainer_log.jsonl."""
    log = output_dir / "trainer_log.jsonl"
    if not log.is_file():
        return {}
    losses = [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if r.get("loss") is not None]
    return {"first_loss": losses[0], "last_loss": losses[-1]} if losses else {}
