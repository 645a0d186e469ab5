"""How the one training loop runs on one or many processes: a Strategy, the same small protocol for each.

- `LocalStrategy`: one process, or DistributedDataParallel around the ObjectiveStep when several processes
  train (train/dist.py), with torch's GradScaler for fp16 on CUDA.
- `FsdpStrategy` (train/fsdp.py): FSDP2, every parameter, gradient and optimizer state sharded.
- `DeepSpeedStrategy` (train/deepspeed.py): a DeepSpeed ZeRO engine around the ObjectiveStep and our optimizer.

The Trainer never asks which one it has. The order of construction is part of the protocol:

    strategy = build_strategy(cfg, model)           # nothing wrapped yet
    reference = strategy.place_reference(reference) # before the objective is built (FSDP shards it, ZeRO-3
                                                    # partitions it, the others keep it as it is)
    objective = build_objective(cfg, reference)
    step = strategy.wrap(objective, make_optimizer) # the module called per micro-batch; the strategy calls
                                                    # make_optimizer when its parameters are final (after FSDP
                                                    # sharded them, before DeepSpeed takes the optimizer)

One optimizer step, for every strategy:

    for each micro-batch (last = the step's last):
        with strategy.accumulating(last):           # DDP / FSDP: no gradient sync but on the last
            out = step(batch)
            strategy.backward(out.loss_sum * world_size / units, last)
    grad_norm = strategy.step(step_number)          # clip to max_grad_norm, step, zero the gradients

Every strategy averages gradients over the ranks (DDP, FSDP2 and DeepSpeed alike), so the trainer's scale
world_size / units is the same for all. `weights_usable()` is the context under which the plain model may be
called outside the wrapper (an objective's prepare generates with it): nothing for local / DDP, the FSDP2 root
unsharded, ZeRO-3's parameters gathered.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tuneforge.errors import TrainingError
from tuneforge.train import checkpoint
from tuneforge.train.dist import data_parallel

if TYPE_CHECKING:
    from tuneforge.config import RunConfig
    from tuneforge.train.objectives import ObjectiveOutput

MakeOptimizer = Callable[[], torch.optim.Optimizer]


class Strategy(Protocol):
    model: torch.nn.Module  # the plain model (what objectives and prepare are called with)
    optimizer: torch.optim.Optimizer  # set by wrap
    # every rank must run each evaluation forward (and each generation): weights are gathered per forward
    gathers_weights: bool

    def place_reference(self, reference: Any) -> Any:
        """The reference to build the objective with (a frozen model sharded / partitioned like the policy)."""
        ...

    def wrap(self, objective: Any, make_optimizer: MakeOptimizer) -> torch.nn.Module:
        """The module whose forward(batch) is the objective's call; builds the optimizer at the right moment."""
        ...

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward: gradients are reduced over ranks only with the last."""
        ...

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Back-propagate one micro-batch's normalized loss (fp16: scaled)."""
        ...

    def step(self, step: int) -> float:
        """Clip to max_grad_norm, step the optimizer, zero the gradients; the gradient norm before clipping."""
        ...

    def eval_forward(self, batch: Any) -> ObjectiveOutput:
        """One evaluation micro-batch's objective output (under no_grad)."""
        ...

    def weights_usable(self) -> contextlib.AbstractContextManager:
        """A context under which `model` may be called directly (e.g. model.generate), outside the wrapper."""
        ...

    def save_checkpoint(self, output_dir: Path, tokenizer: Any, scheduler: Any, state: checkpoint.TrainerState,
                        *, is_main: bool) -> Path:
        """output_dir/checkpoint-{global_step}, atomically (collective where every rank holds a part)."""
        ...

    def load_checkpoint(self, folder: Path, scheduler: Any) -> checkpoint.TrainerState:
        """Restore weights, optimizer, scheduler (and scaler, RNG); the checkpoint's TrainerState."""
        ...

    def save_final(self, tokenizer: Any, output_dir: Path, pissa_init: Path | None, pissa_convert: bool,
                   *, is_main: bool) -> None:
        """The Hugging Face folder of the trained model or adapter in output_dir (collective where needed)."""
        ...


def build_strategy(cfg: RunConfig, model: torch.nn.Module) -> Strategy:
    """The strategy the config asks for (deepspeed, fsdp, else local / DDP); nothing is wrapped yet."""
    from tuneforge.train import deepspeed, fsdp

    if deepspeed.enabled(cfg):
        return deepspeed.DeepSpeedStrategy(cfg, model)
    if fsdp.enabled(cfg):
        return fsdp.FsdpStrategy(cfg, model)
    return LocalStrategy(cfg, model)


def check_norm(norm: float, step: int, cfg: RunConfig) -> float:
    """The gradient norm, or a TrainingError when it is not finite (without fp16's scaler to skip the step)."""
    t = cfg.train
    if not math.isfinite(norm):
        raise TrainingError(
            f"step {step}: the gradient norm is {norm}. Lower learning_rate (now {t.learning_rate:g}) "
            f"or set max_grad_norm (now {t.max_grad_norm:g})"
        )
    return norm


class LocalStrategy:
    """One process, or DDP around the ObjectiveStep; fp16 on CUDA scales the loss with a GradScaler."""

    gathers_weights = False

    def __init__(self, cfg: RunConfig, model: torch.nn.Module) -> None:
        self.cfg, self.model = cfg, model
        self.device = next(model.parameters()).device
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.train.fp16 and self.device.type == "cuda")
        self.objective: Any = None
        self.step_module: torch.nn.Module | None = None

    def place_reference(self, reference: Any) -> Any:
        return reference

    def wrap(self, objective: Any, make_optimizer: MakeOptimizer) -> torch.nn.Module:
        self.objective = objective
        self.optimizer = make_optimizer()
        self.step_module = data_parallel(self.model, objective, self.device)  # forward = the objective
        return self.step_module

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        no_sync = getattr(self.step_module, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.scaler.scale(loss).backward()

    def step(self, step: int) -> float:
        grad_norm = self._clip_gradients(step)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _clip_gradients(self, step: int) -> float:
        """Clip to max_grad_norm (0: no clipping) and return the norm before clipping."""
        t = self.cfg.train
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        # fp16: the scaler skips a step whose gradients overflowed
        return norm if self.scaler.is_enabled() else check_norm(norm, step, self.cfg)

    def eval_forward(self, batch: Any) -> ObjectiveOutput:
        return self.objective(self.model, batch)  # no wrapper: no rank waits for another

    def weights_usable(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def save_checkpoint(self, output_dir: Path, tokenizer: Any, scheduler: Any, state: checkpoint.TrainerState,
                        *, is_main: bool) -> Path:
        final = checkpoint.folder_at(output_dir, state.global_step)
        if is_main:  # the weights are the same on every rank
            checkpoint.save_checkpoint(output_dir, self.model, tokenizer, self.optimizer, scheduler, self.scaler,
                                       state)
        return final

    def load_checkpoint(self, folder: Path, scheduler: Any) -> checkpoint.TrainerState:
        return checkpoint.load_checkpoint(folder, self.model, self.optimizer, scheduler, self.scaler)

    def save_final(self, tokenizer: Any, output_dir: Path, pissa_init: Path | None, pissa_convert: bool,
                   *, is_main: bool) -> None:
        if is_main:
            checkpoint.save_final_model(self.model, tokenizer, output_dir, pissa_init, pissa_convert)


__all__ = ["LocalStrategy", "Strategy", "build_strategy", "check_norm"]
