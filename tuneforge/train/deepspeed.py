"""DeepSpeed ZeRO (`deepspeed: ds_config.json`, read by config/deepspeed.py): the engine runs our loop's step.

The trainer builds its optimizer and schedule as always; `deepspeed.initialize` wraps the ObjectiveStep (the
objective's call as the module's forward) and that optimizer, which ZeRO then partitions: stage 1 its states,
stage 2 also the gradients, stage 3 also the weights (gathered layer by layer around their forward and
backward by the hooks DeepSpeed puts on every module, so the objectives' direct calls of the decoder and the
head work unchanged). One optimizer step:

    engine.set_gradient_accumulation_boundary(last micro-batch?)
    engine.backward(loss_sum * world_size / units, scale_wrt_gas=False)   # our normalization, not DeepSpeed's
    engine.step()                                                         # reduce, clip, step, zero the grads

DeepSpeed averages gradients over the ranks as DDP does, so the trainer's scale is the same for every strategy.

- References: at stage 3 a separate frozen reference model is partitioned too (an engine without optimizer), so
  it takes 1/world of its memory per process; below stage 3 the weights, its too, are whole on every process.
- Checkpoints: the engine writes its partitioned states (trainable weights, fp32 master weights, optimizer
  states) into checkpoint-N/deepspeed, beside our scheduler, per-rank RNG states and trainer_state.json, all
  under a temporary name renamed by rank 0 once every rank has written. ZeRO's partitions are cut for the
  number of processes that wrote them: a checkpoint resumes on that many processes.
- The final save: below stage 3 rank 0 saves as usual; at stage 3 the weights are gathered onto rank 0 one
  module at a time (all ranks take part) and saved as the usual Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tuneforge.config import RunConfig
from tuneforge.config.deepspeed import (
    DEEPSPEED_CHECKPOINT,
    DEEPSPEED_LAYOUT,
    deepspeed_settings,
    filled_config,
)
from tuneforge.errors import TrainingError
from tuneforge.train import checkpoint
from tuneforge.train.dist import ObjectiveStep
from tuneforge.train.objectives import ModelReference, ObjectiveOutput
from tuneforge.train.strategy import MakeOptimizer, check_norm

logger = logging.getLogger(__name__)


def enabled(cfg: RunConfig) -> bool:
    return bool(cfg.train.deepspeed)


def _deepspeed():
    if not torch.cuda.is_available():  # DeepSpeed would probe for accelerators and warn before choosing the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def _hidden_size(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "hidden_size", None)


class _TupleStep(ObjectiveStep):
    """ObjectiveStep returning (loss_sum, metrics, counts): ZeRO-3 hooks the tensors of a module's output, and
    it finds them in tuples and dicts, not in a dataclass."""

    def forward(self, batch):
        out = self.objective(self.model, batch)
        return out.loss_sum, out.metrics, out.counts


class _OutputOf:
    """The engine's call as the trainer's step: (loss_sum, metrics, counts) back into an ObjectiveOutput."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __call__(self, batch: Any) -> ObjectiveOutput:
        return ObjectiveOutput(*self.engine(batch))


class DeepSpeedStrategy:
    """The DeepSpeed engine around ObjectiveStep(model, objective) and the trainer's optimizer."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module) -> None:
        self.cfg, self.model = cfg, model
        self.settings = deepspeed_settings(cfg)
        self.stage, self.world_size = self.settings.stage, dist.get_world_size()
        self.config = filled_config(self.settings, cfg, _hidden_size(model), self.world_size)
        self.partitions_weights = self.settings.partitions_weights
        # every forward gathers each module's partitions from every rank (ZeRO-3)
        self.gathers_weights = self.partitions_weights
        self.reference: ModelReference | None = None

    def place_reference(self, reference: Any) -> Any:
        """At ZeRO-3 a frozen reference model is partitioned like the policy: in place, by wrap, after the
        policy's engine exists. Below stage 3 (or the policy without adapters) it stays as it is."""
        if isinstance(reference, ModelReference) and self.partitions_weights:
            self.reference = reference
        return reference

    def wrap(self, objective: Any, make_optimizer: MakeOptimizer) -> Callable[[Any], ObjectiveOutput]:
        deepspeed = _deepspeed()
        self.objective = objective
        self.optimizer = make_optimizer()  # ZeRO partitions it (its states; at stage 3 the weights too)
        self.engine, *_ = deepspeed.initialize(
            model=_TupleStep(self.model, objective), optimizer=self.optimizer, config=self.config,
            dist_init_required=False,
        )
        if self.reference is not None:
            # an engine without optimizer only partitions the frozen weights and gathers them around each module
            # (kept: its parameter coordinator serves the hooks it put on the reference's modules)
            self.reference_engine, *_ = deepspeed.initialize(model=self.reference.model, config=self.config,
                                                             dist_init_required=False)
            logger.info("deepspeed: the reference model is partitioned like the policy (ZeRO-3)")
        s = self.settings
        offload = [what for what, on in (("optimizer", s.offload_optimizer), ("parameters", s.offload_param)) if on]
        logger.info(
            "deepspeed: ZeRO stage %d over %d process%s%s, %s", self.stage, self.world_size,
            "es" if self.world_size > 1 else "", f", {' and '.join(offload)} offloaded to the CPU" if offload else "",
            "bf16" if self.cfg.train.bf16 else "fp16" if self.cfg.train.fp16 else "fp32",
        )
        return _OutputOf(self.engine)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # DeepSpeed reduces when the accumulation boundary comes (backward)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Back-propagate one micro-batch's already normalized loss; the last one ends the accumulation."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, step: int) -> float:
        """Reduce, clip (gradient_clipping = max_grad_norm), step and zero the gradients; the norm before clipping.
        fp16: DeepSpeed's loss scaler skips a step whose gradients overflowed, so its norm is not checked."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else 0.0
        return norm if self.cfg.train.fp16 else check_norm(norm, step, self.cfg)

    def eval_forward(self, batch: Any) -> ObjectiveOutput:
        if self.partitions_weights:
            return ObjectiveOutput(*self.engine(batch))
        return self.objective(self.model, batch)

    def weights_usable(self) -> contextlib.AbstractContextManager:
        """ZeRO-3: every weight gathered (collective); below stage 3 each rank holds them whole already."""
        if not self.partitions_weights:
            return contextlib.nullcontext()
        return _deepspeed().zero.GatheredParameters(list(self.model.parameters()))

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, output_dir: Path, tokenizer: Any, scheduler: Any, state: checkpoint.TrainerState,
                        *, is_main: bool) -> Path:
        """output_dir/checkpoint-{global_step}, written by every rank (collective) and renamed into place."""
        final = checkpoint.folder_at(output_dir, state.global_step)
        with checkpoint.folder_of_all_ranks(final, is_main) as folder:
            # frozen weights are the base model's: not saved, as in every tuneforge checkpoint
            self.engine.save_checkpoint(str(folder), tag=DEEPSPEED_CHECKPOINT, save_latest=False,
                                        exclude_frozen_parameters=True)
            torch.save(checkpoint.capture_rng(), folder / f"rng_state_{dist.get_rank()}.pt")
            if is_main:
                checkpoint.write_json(folder / DEEPSPEED_LAYOUT, {"zero_stage": self.stage, "processes": self.world_size})
                torch.save(scheduler.state_dict(), folder / checkpoint.SCHEDULER)
                if tokenizer is not None:
                    tokenizer.save_pretrained(folder)
                state.save(folder / checkpoint.TRAINER_STATE)
        if is_main:
            logger.info("saved %s (ZeRO stage %d, %d processes)", final, self.stage, self.world_size)
        return final

    def load_checkpoint(self, folder: Path, scheduler: Any) -> checkpoint.TrainerState:
        """Restore the engine's partitions, the scheduler and this rank's RNG."""
        layout = json.loads((folder / DEEPSPEED_LAYOUT).read_text()) if (folder / DEEPSPEED_LAYOUT).is_file() else {}
        if layout.get("processes", self.world_size) != self.world_size or layout.get("zero_stage", self.stage) != self.stage:
            raise TrainingError(
                f"checkpoint {folder} holds ZeRO stage {layout['zero_stage']} partitions for {layout['processes']} "
                f"processes; this run has stage {self.stage} on {self.world_size}. Resume it with the same deepspeed "
                f"config on {layout['processes']} processes, or start afresh"
            )
        loaded, _ = self.engine.load_checkpoint(str(folder), tag=DEEPSPEED_CHECKPOINT, load_module_strict=False,
                                                load_lr_scheduler_states=False)
        if loaded is None:
            raise TrainingError(f"checkpoint {folder}: DeepSpeed could not load {folder / DEEPSPEED_CHECKPOINT}; "
                                f"start afresh or resume from another checkpoint")
        scheduler.load_state_dict(torch.load(folder / checkpoint.SCHEDULER, weights_only=True))
        checkpoint.restore_rng(torch.load(folder / f"rng_state_{dist.get_rank()}.pt", weights_only=True))
        return checkpoint.TrainerState.load(folder / checkpoint.TRAINER_STATE)

    def save_final(self, tokenizer: Any, output_dir: Path, pissa_init: Path | None, pissa_convert: bool,
                   *, is_main: bool) -> None:
        """The Hugging Face folder on rank 0; at stage 3 the weights are first gathered onto it (collective)."""
        model = self.model
        if not self.partitions_weights:
            if is_main:
                checkpoint.save_final_model(model, tokenizer, output_dir, pissa_init, pissa_convert)
            return
        peft = hasattr(model, "peft_config") or hasattr(getattr(model, "model", None), "peft_config")
        # keys of the ObjectiveStep: "model." + the trained model's own; an adapter's frozen base is left out
        gathered = self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=peft)
        head = getattr(model, "v_head", None)
        inner = model.model if isinstance(head, torch.nn.Module) else model  # ValueHeadModel saves .model
        prefix = "model.model." if inner is not model else "model."
        deepspeed = _deepspeed()
        gather_head = deepspeed.zero.GatheredParameters(list(head.parameters())) if inner is not model \
            else contextlib.nullcontext()
        with gather_head:  # value_head_state() reads the head's whole weights
            if is_main:
                state_dict = {k[len(prefix):]: v for k, v in gathered.items() if k.startswith(prefix)}
                checkpoint.save_final_model(model, tokenizer, output_dir, state_dict=state_dict)
