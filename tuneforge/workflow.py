"""One dispatch from stage to run: tokenizer -> data -> model -> the one Trainer -> outputs.

A stage is a row of tuneforge/stages.py, not a subclass, and this module asks it everything: the data
package builds with the encoder the row names, the row says whether the model gets a value head and whether
a reference is built, the objective comes from the registry by the row's name, and the batch layout (row
kind from the row; flat from the model; packed from the data build) is decided here once. Adding a stage =
an encoder (or an existing one), an objective, one row.

A reference (the policy with its adapters disabled for lora / oft, else a frozen model) can have its
log-probs precomputed once (precompute_ref_log_probs), so that no reference stays in memory.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tuneforge.batch import SHARED_PROMPT_ROWS, Layout
from tuneforge.config import RunConfig
from tuneforge.config.validate import uses_reference
from tuneforge.errors import ConfigError, DataError
from tuneforge.stages import STAGES, stage_of

logger = logging.getLogger(__name__)

__all__ = ["STAGES", "ask_model", "batch_layout", "prepare_data", "run", "train"]


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_data(cfg: RunConfig):
    """Tokenizer + tokenized splits (cached); everything `tuneforge preprocess` needs, no model weights.

    For a vision- / audio-language model the tokenizer is its processor's, and splits.processor the processor."""
    from tuneforge.data import build
    from tuneforge.model import load_model_processor, load_tokenizer
    from tuneforge.train.dist import node_leader_first

    processor = load_model_processor(cfg.model)
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(cfg.model)
    media_packing = None
    if processor is not None and (cfg.data.packing or cfg.data.neat_packing):  # can its samples share a row?
        from tuneforge.model.load import load_config, resolve_model_path
        from tuneforge.model.multimodal import family_media_packing

        path = resolve_model_path(cfg.model)
        media_packing = family_media_packing(load_config(path, cfg.model),
                                             trust_remote_code=cfg.model.trust_remote_code)
    with node_leader_first() as leader:  # many processes: one per node tokenizes, the others read its cache
        splits = build(cfg if leader else replace(cfg, data=replace(cfg.data, overwrite_cache=False)), tokenizer,
                       processor, media_packing=media_packing)
    logger.info("data: %s", ", ".join(f"{k}={v}" for k, v in splits.stats.items() if not isinstance(v, dict)))
    return tokenizer, splits


def train(cfg: RunConfig, ask: str | None = None, argv: list[str] | None = None) -> dict[str, Any] | None:
    """One `tuneforge train` (the CLI and any other front end call this): the rules a run needs beyond the
    config's own, then the run where it belongs — in Ray Train workers (use_ray / USE_RAY=1), in processes
    relaunched under torchrun (several GPUs, FORCE_TORCHRUN=1), or in this process.

    Returns the results of rank 0 (see `run`); None in a process that only relaunched the run under torchrun
    (its rank 0 reports) and on the other ranks. With do_train false it evaluates or predicts instead
    (LlamaFactory's way), returning eval's results. argv: the command line to relaunch under torchrun
    (default: this config, written to a temporary file)."""
    check_request(cfg, ask)
    # the hub reachable and the token able to write, before loading (once: ranks other than 0 do not upload)
    if cfg.train.do_train and cfg.hub.push_to_hub and os.environ.get("RANK", "0") == "0":
        from tuneforge.hub import check_access

        check_access(cfg.hub.hub_token or cfg.model.hf_hub_token, "push_to_hub", "hub_token", cfg.source)
    if not cfg.train.do_train:
        from tuneforge.eval import evaluate
        from tuneforge.model.inference import use_trained_output

        return evaluate(use_trained_output(cfg))
    from tuneforge.config.processes import ray_requested
    from tuneforge.train.launch import launch_plan, relaunch
    from tuneforge.train.ray_launch import run_on_ray

    if ray_requested(cfg):  # the same run in Ray Train workers; rank 0's results come back
        return _then_predict(cfg, run_on_ray(cfg, run, ask=ask))
    plan = launch_plan()
    if plan is not None:
        if argv is not None:
            relaunch(plan, argv)
        else:
            with _config_file(cfg) as path:
                relaunch(plan, ["train", str(path), *(["--ask", ask] if ask else [])])
        for line in (_then_predict(cfg, {}).get("predict") or {}).get("summary", []):
            logger.info("%s", line)  # the training processes have ended; this one predicts, as one process
        return None
    if os.environ.get("RANK", "0") != "0":
        run(cfg, ask=ask)
        return None
    return _then_predict(cfg, run(cfg, ask=ask))


def _then_predict(cfg: RunConfig, results: dict[str, Any]) -> dict[str, Any]:
    """do_predict beside do_train (LlamaFactory's way): after training, answers generated for the eval rows with
    the trained model and scored, under results["predict"]. Under torchrun this runs on rank 0's launcher alone."""
    if cfg.train.do_predict and os.environ.get("LOCAL_RANK") is None and results.get("status", "completed") == "completed":
        from tuneforge.eval import evaluate
        from tuneforge.model.inference import use_trained_output

        results["predict"] = evaluate(use_trained_output(cfg))
    return results


def check_request(cfg: RunConfig, ask: str | None) -> None:
    """What a run asks beyond its config, checked before anything starts."""
    stage = stage_of(cfg.method.stage)
    if ask and not stage.writes_text:
        raise ConfigError(f"--ask needs a model that writes answers; stage {stage.name} trains {stage.summary}",
                          key="stage")
    if ask and cfg.train.fsdp:
        raise ConfigError("--ask does not run on a sharded (fsdp) model yet; ask with `tuneforge chat` after training")
    if ask and cfg.train.deepspeed:
        from tuneforge.config.deepspeed import deepspeed_settings

        if deepspeed_settings(cfg).partitions_weights:
            raise ConfigError("--ask does not run on ZeRO-3's partitioned weights; ask with `tuneforge chat` after "
                              "training")
    if not (cfg.train.do_train or cfg.train.do_predict or cfg.train.do_eval):
        raise ConfigError(f"{cfg.source}: do_train is false and neither do_eval nor do_predict is set: nothing to do",
                          key=("do_train", "do_eval", "do_predict"))


@contextlib.contextmanager
def _config_file(cfg: RunConfig) -> Iterator[Path]:
    """cfg as a YAML file (the keys that differ from their defaults), for the processes torchrun starts."""
    import tempfile

    import yaml

    from tuneforge.config.loader import defaults

    default = defaults()
    keys = {k: v for k, v in cfg.to_dict().items() if v != default.get(k)}
    with tempfile.TemporaryDirectory(prefix="tuneforge-launch-") as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(yaml.safe_dump(keys, sort_keys=False), encoding="utf-8")
        yield path


def run(cfg: RunConfig, ask: str | None = None) -> dict[str, Any]:
    """Train cfg.method.stage end to end in this process; returns the results plus where the outputs are.

    ask: a question put to the model (greedy, in the chat template) before and after training; the two
    answers come back under "answers", so the user sees what training changed.
    Started by torchrun (tuneforge/train/launch.py) or Ray, each process joins the process group first and
    leaves it after training (a failed process leaves it too, without waiting for the others; torchrun ends
    them and names it)."""
    from tuneforge.train import dist

    # DeepSpeed's engine runs on a process group, also in a single process
    joined = dist.setup(cfg.train.ddp_timeout, cfg.train.data_wait_timeout, alone=bool(cfg.train.deepspeed))
    finished = False
    try:
        results = _run(cfg, ask)
        finished = True
        return results
    finally:
        if joined:
            dist.teardown(wait_for_others=finished)


def _run(cfg: RunConfig, ask: str | None) -> dict[str, Any]:
    from tuneforge.data.collate import Collator
    from tuneforge.data.template import record_thinking
    from tuneforge.model import load_model
    from tuneforge.model.load import load_config, resolve_model_path
    from tuneforge.model.multimodal import rope_positions
    from tuneforge.model.prequantized import check_prequantized
    from tuneforge.model.value_head import ValueHeadModel
    from tuneforge.train import Trainer
    from tuneforge.train.objectives import build_objective
    from tuneforge.train.strategy import build_strategy
    from tuneforge.train.trainer import rank_and_world_size

    stage = stage_of(cfg.method.stage)
    seed_everything(cfg.train.seed)
    objective_name = f"{stage.objective} ({cfg.method.pref_loss})" if stage.pref_loss else stage.objective
    logger.info(
        "stage %s: encoder %s, objective %s, finetuning %s",
        stage.name, stage.encoder, objective_name, cfg.method.finetuning_type,
    )
    # a checkpoint saved quantized that this run cannot train on fails first, then the data: a bad row or template
    # fails before the weights load
    check_prequantized(load_config(resolve_model_path(cfg.model), cfg.model), cfg.model.model_name_or_path,
                       cfg.method.finetuning_type, cfg.model.quantization_bit)
    tokenizer, splits = prepare_data(cfg)
    check_reward_columns(cfg, splits)
    model = load_model(cfg)  # logs what it loaded and the trainable-parameter count
    layout = batch_layout(cfg, splits, model)
    before = ask_model(cfg, model, tokenizer, ask, splits.processor) if ask else None
    if stage.value_head:
        model = ValueHeadModel(model, critic=stage.critic)
    # a 3-D rope model's flat and packed media rows get its own positions per sample
    collator = Collator(tokenizer.pad_token_id, layout, rope=rope_positions(model) if splits.processor else None)
    strategy = build_strategy(cfg, model)  # local / DDP, FSDP2 or DeepSpeed (nothing wrapped yet)
    train_rows, eval_rows, reference = splits.train, splits.eval, None
    if uses_reference(cfg) and cfg.method.precompute_ref_log_probs:
        # the objective reads the reference columns; a reference model, if one was loaded, is freed here
        train_rows, eval_rows = precompute_reference(cfg, splits, model, collator)
        gc.collect()
    elif uses_reference(cfg):
        reference = strategy.place_reference(build_reference(cfg))  # FSDP shards it, ZeRO-3 partitions it
    objective = build_objective(cfg, reference, generate=rollout_generator(cfg, tokenizer, splits.processor))
    # saved beside the model: the processor (its tokenizer included) of a vision- / audio-language model, its chat
    # template recording enable_thinking when set
    files = splits.processor or tokenizer
    for owner in (tokenizer,) if files is tokenizer else (tokenizer, files):
        record_thinking(owner, cfg.data.enable_thinking)
    pusher = None
    if cfg.hub.push_to_hub and rank_and_world_size()[0] == 0:  # rank 0 uploads
        from tuneforge.train.hub_push import HubPush

        pusher = HubPush(cfg)
    trainer = Trainer(cfg, model, files, train_rows, eval_rows, collator, objective=objective, strategy=strategy,
                      callbacks=[pusher] if pusher else [], eval_parts=splits.stats.get("eval_parts"))
    results = trainer.train()
    if trainer.is_main:
        finish_outputs(cfg, trainer, results, pusher)
    if ask:
        after = ask_model(cfg, model, tokenizer, ask, splits.processor)
        results["answers"] = {"question": ask, "before": before, "after": after}
    return {**results, **loss_curve(Path(cfg.train.output_dir)), "output_dir": cfg.train.output_dir}


def finish_outputs(cfg: RunConfig, trainer, results: dict[str, Any], pusher=None) -> None:
    """Rank 0, after training: the model card in output_dir (a finished run's), then push_to_hub's final upload."""
    from tuneforge.export import card

    output_dir = Path(cfg.train.output_dir)
    if results.get("status") != "stopped":
        repo_id = pusher.repo.repo_id if pusher else None
        written = card.save(card.training_card(cfg, output_dir, results, trainer.state.log_history,
                                               processes=trainer.world_size, repo_id=repo_id), output_dir)
        if written:
            logger.info("model card: %s", written)
    if pusher is not None:
        pusher.finish(results)


def check_reward_columns(cfg: RunConfig, splits) -> None:
    """A reward reads a column the data lacks: say so (naming the dataset) before the weights load."""
    if not stage_of(cfg.method.stage).samples:
        return
    from tuneforge.rewards import required_columns

    for name, columns in splits.stats.get("dataset_columns", {}).items():
        try:
            required_columns(cfg, columns)
        except DataError as e:
            raise DataError(f"dataset '{name}': {e}") from None


def rollout_generator(cfg: RunConfig, tokenizer, processor=None):
    """What an objective's prepare generates with (infer.generation.completion_generator: the stops and sampling
    settings chat and eval use) and, for the RL stages, decodes, collates and scores with (tuneforge/rollout.py);
    each part is built on first use, so a stage that never samples never renders a template."""
    from tuneforge.rollout import Rollouts

    return Rollouts(cfg, tokenizer, processor)


def ask_model(cfg: RunConfig, model, tokenizer, question: str, processor=None) -> str:
    from tuneforge.infer.generation import answer, chat_template

    reply = answer(model, tokenizer, chat_template(cfg, processor or tokenizer), question,
                   system=cfg.data.default_system, processor=processor)
    logger.info("asked %r: %r", question, reply)
    return reply


def batch_layout(cfg: RunConfig, splits, model=None) -> Layout:
    """The layout of every batch of this run, decided once: the row kind from the stage's row, packed from
    the data build, flat (padding-free) and a shared prompt from what the loaded model runs (the model
    loader's attention module answers; without a model, batches are padded)."""
    from tuneforge.model.attention import batch_layouts
    from tuneforge.model.multimodal import media_packing_refusal, rope_index

    rows = stage_of(cfg.method.stage).rows
    packed = bool(splits.stats.get("packing", False))
    flat = shared = False
    media = getattr(splits, "processor", None) is not None
    if model is not None and cfg.data.padding_free:
        flat, shared = batch_layouts(model)
        if not flat:
            logger.info("padding_free: %s does not use transformers' attention interface; batches are padded",
                        type(model).__name__)
        elif media and media_packing_refusal(model):
            flat = False
            logger.info("padding_free: batches are padded with this model's media: %s", media_packing_refusal(model))
        elif media and rows == "prompt" and rope_index(model) is not None:
            flat = False  # sampled sequences are collated by the rollouts, which place no 3-D rope positions
            logger.info("padding_free: %s's sampled answers about media are padded (3-D rope positions)",
                        type(model).__name__)
        shared = shared and not media  # a shared prompt would need its media once: not built
    return Layout(rows=rows, flat=flat, packed=packed, shared_prefix=flat and shared and rows in SHARED_PROMPT_ROWS)


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

    columns = tuple(REF_LOGP_COLUMNS[prefix] for prefix in SEQUENCE_PREFIXES[stage_of(cfg.method.stage).rows])
    cache_dir = Path(splits.stats["cache_dir"])
    with node_leader_first():  # many processes: one per node computes, the others read its cache
        with_ref = precompute.with_reference_logps(
            {"train": splits.train, "eval": splits.eval}, columns, cache_dir, reference_identity(cfg), compute_split
        )
    return with_ref["train"], with_ref["eval"]


# metrics whose first -> last logged values the summary shows (preference stages; the RL stages' reward)
CURVE_METRICS = ("rewards/accuracies", "rewards/margins", "reward")


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
