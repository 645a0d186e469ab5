"""One dispatch from stage to run: tokenizer -> data -> model -> the one Trainer -> outputs.

A Stage is a row in STAGES, not a subclass: its encoder (chosen by the data package from
cfg.method.stage) and its objective (built by objectives.build_objective from the config). Adding a
stage = one encoder, one objective, one row.

Preference stages add two things around the same loop: rm wraps the model with a value head; dpo and
kto get a reference (the policy with its adapters disabled for lora / oft, else a frozen model), whose
log-probs can be precomputed once (precompute_ref_log_probs) so that no reference stays in memory.
"""

from __future__ import annotations

import gc
import json
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuneforge.config import RunConfig
from tuneforge.config.validate import uses_reference

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    encoder: str  # the name of the data/encode.py encoder, for the docs and the log
    objective: str  # the objective objectives.build_objective makes for it


STAGES: dict[str, Stage] = {
    "pt": Stage(encoder="pretrain", objective="lm"),
    "sft": Stage(encoder="supervised", objective="lm"),
    "rm": Stage(encoder="pairwise", objective="reward"),
    "dpo": Stage(encoder="pairwise", objective="preference (pref_loss)"),
    "kto": Stage(encoder="feedback", objective="kto"),
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
    from tuneforge.train.dist import node_leader_first

    tokenizer = tokenizer or load_tokenizer(cfg.model)
    with node_leader_first() as leader:  # many processes: one per node tokenizes, the others read its cache
        splits = build(cfg if leader else replace(cfg, data=replace(cfg.data, overwrite_cache=False)), tokenizer)
    logger.info("data: %s", ", ".join(f"{k}={v}" for k, v in splits.stats.items() if not isinstance(v, dict)))
    return tokenizer, splits


def run(cfg: RunConfig, ask: str | None = None) -> dict[str, Any]:
    """Train cfg.method.stage end to end; returns the results plus where the outputs are.

    ask: a question put to the model (greedy, in the chat template) before and after training; the two
    answers come back under "answers", so the user sees what training changed.
    Started by torchrun (tuneforge/train/launch.py), each process joins the process group first and leaves
    it after training; a process that fails just exits, and torchrun ends the others and names it."""
    from tuneforge.train import dist

    # DeepSpeed's engine runs on a process group, also in a single process
    joined = dist.setup(cfg.train.ddp_timeout, cfg.train.data_wait_timeout, alone=bool(cfg.train.deepspeed))
    results = _run(cfg, ask)
    if joined:
        dist.teardown()
    return results


def _run(cfg: RunConfig, ask: str | None) -> dict[str, Any]:
    from tuneforge.data.collate import Collator
    from tuneforge.model import load_model
    from tuneforge.model.attention import supports_padding_free
    from tuneforge.model.value_head import ValueHeadModel
    from tuneforge.train import Trainer
    from tuneforge.train.objectives import build_objective
    from tuneforge.train.strategy import build_strategy

    stage = STAGES[cfg.method.stage]
    seed_everything(cfg.train.seed)
    logger.info(
        "stage %s: encoder %s, objective %s, finetuning %s",
        cfg.method.stage, stage.encoder, stage.objective, cfg.method.finetuning_type,
    )
    # data first: a bad row or template fails before the weights load
    tokenizer, splits = prepare_data(cfg)
    model = load_model(cfg)  # logs what it loaded and the trainable-parameter count
    padding_free = cfg.data.padding_free and supports_padding_free(model)
    if cfg.data.padding_free and not padding_free:
        logger.info("padding_free: %s does not use transformers' attention interface; batches are padded",
                    type(model).__name__)
    before = ask_model(cfg, model, tokenizer, ask) if ask else None
    if cfg.method.stage == "rm":
        model = ValueHeadModel(model)
    collator = Collator(tokenizer.pad_token_id, padding_free=padding_free, share_prompts=shares_prompts(model))
    strategy = build_strategy(cfg, model)  # local / DDP, FSDP2 or DeepSpeed (nothing wrapped yet)
    train_rows, eval_rows, reference = splits.train, splits.eval, None
    if uses_reference(cfg) and cfg.method.precompute_ref_log_probs:
        # the objective reads the reference columns; a reference model, if one was loaded, is freed here
        train_rows, eval_rows = precompute_reference(cfg, splits, model, collator)
        gc.collect()
    elif uses_reference(cfg):
        reference = strategy.place_reference(build_reference(cfg))  # FSDP shards it, ZeRO-3 partitions it
    objective = build_objective(cfg, reference)
    trainer = Trainer(cfg, model, tokenizer, train_rows, eval_rows, collator, objective=objective, strategy=strategy)
    results = trainer.train()
    if ask:
        results["answers"] = {"question": ask, "before": before, "after": ask_model(cfg, model, tokenizer, ask)}
    return {**results, **loss_curve(Path(cfg.train.output_dir)), "output_dir": cfg.train.output_dir}


def ask_model(cfg: RunConfig, model, tokenizer, question: str) -> str:
    from tuneforge.infer.generation import answer, chat_template

    reply = answer(model, tokenizer, chat_template(cfg, tokenizer), question, system=cfg.data.default_system)
    logger.info("asked %r: %r", question, reply)
    return reply


def shares_prompts(model) -> bool:
    """Whether a preference pair's two sequences can share one forward of their prompt: the model runs
    tuneforge's padding-free sdpa, which reads `shared_prefix`, and has no sliding-window layers."""
    from tuneforge.model.attention import PACKED_SDPA

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return config._attn_implementation == PACKED_SDPA and not sliding


def build_reference(cfg: RunConfig):
    """The reference of dpo / kto: the policy without its adapters (lora / oft) or a frozen model."""
    from tuneforge.train.objectives import AdapterReference, ModelReference

    if cfg.method.ref_model is None and cfg.method.finetuning_type in ("lora", "oft"):
        logger.info("reference: the policy with its adapters disabled (no second copy in memory)")
        return AdapterReference()
    from tuneforge.model import load_reference

    return ModelReference(load_reference(cfg))


def precompute_reference(cfg: RunConfig, splits, model, collator):
    """(train, eval) rows with the reference log-prob columns, from the cache or computed now (the
    reference is built only when something is computed, so a cache hit loads no reference model)."""
    from tuneforge.data.encode_pref import REF_LOGP_COLUMNS, SEQUENCE_PREFIXES
    from tuneforge.model import reference_identity
    from tuneforge.train import precompute
    from tuneforge.train.dist import node_leader_first
    from tuneforge.train.trainer import autocast_context

    device = next(model.parameters()).device
    built = []  # the reference, once a split needs it

    def compute_split(rows):
        if not built:
            built.append(build_reference(cfg))
        return precompute.compute(
            rows, built[0], model, collator, batch_size=cfg.train.per_device_eval_batch_size,
            device=device, autocast=lambda: autocast_context(cfg.train, device),
        )

    kind = "feedback" if cfg.method.stage == "kto" else "pairwise"
    columns = tuple(REF_LOGP_COLUMNS[prefix] for prefix in SEQUENCE_PREFIXES[kind])
    cache_dir = Path(splits.stats["cache_dir"])
    with node_leader_first():  # many processes: one per node computes, the others read its cache
        with_ref = precompute.with_reference_logps(
            {"train": splits.train, "eval": splits.eval}, columns, cache_dir, reference_identity(cfg), compute_split
        )
    return with_ref["train"], with_ref["eval"]


# preference metrics whose first -> last logged values the summary shows
CURVE_METRICS = ("rewards/accuracies", "rewards/margins")


def loss_curve(output_dir: Path) -> dict[str, Any]:
    """First and last logged training loss (and preference metrics), read back from trainer_log.jsonl."""
    log = output_dir / "trainer_log.jsonl"
    if not log.is_file():
        return {}
    rows = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("loss") is not None]
    if not rows:
        return {}
    curves = {}
    for key in CURVE_METRICS:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            curves[key] = (values[0], values[-1])
    out: dict[str, Any] = {"first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}
    return {**out, "metric_curves": curves} if curves else out
