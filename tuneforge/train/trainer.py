"""The training loop: one optimizer step reads top to bottom as batch -> forward -> loss -> backward -> clip
-> step -> log. The stage-specific part is the Objective; everything else is the same for every stage.

Gradient accumulation: the micro-batches of one optimizer step are collated first, their units (supervised
tokens for lm) counted and summed over all ranks, and each micro-batch back-propagates
loss_sum / total_units. The step's gradient is therefore the gradient of the whole batch's mean loss,
however it is split into micro-batches or ranks.

Rollouts: an objective may define `prepare(model, batch) -> batch`, or `prepare_step(model, batches) -> batches`
when it needs the whole step at once (advantages scaled over the step's rewards). The trainer calls it for the
micro-batches of the step (and of an evaluation) after collation and the move to the device, under no_grad, with
the plain model inside the strategy's `weights_usable()` context (outside DDP / FSDP / DeepSpeed's wrapper), and
counts the units only after all of them: a unit known only after generation (a generated token) normalizes
exactly too. Each batch then carries `sample_seeds`, one per row from (seed, epoch, row index), so what a row
samples does not depend on where it lands. The model is in train mode while training prepares, in eval mode
while evaluation does (an objective updates its running statistics only in the first).

A rollout is what is prepared at once: `buffer` accumulation groups (ppo's ppo_buffer_size; 1 by default). An
objective with `iterations` > 1 (grpo's num_iterations, ppo's ppo_epochs) is stepped that many times on each
rollout, one optimizer step per accumulation group each time, before the data moves on. Checkpoints (and stop
requests) fall between rollouts (a checkpoint due inside one is written at its end), so a resumed run prepares
exactly what the uninterrupted one did; an objective's own running state (`state_dict` / `load_state_dict`:
ppo's adaptive KL coefficient and score statistics) is saved in trainer_state.json.

With sequence_parallel_size > 1 (train/sequence_parallel.py), the ranks of a sequence group read the same rows
and each collated batch is cut to this rank's shard of the sequence; its units are the shard's, so the sums over
ranks stay the batch's.

How it runs on one or many processes is the Strategy's business (train/strategy.py); the run hooks (progress,
trainer_log.jsonl, reporters, plots, stop requests) are callbacks (train/callbacks.py). A stop request (SIGINT /
SIGTERM, output_dir/STOP) ends the run after the current optimizer step with a checkpoint, status "stopped".

Data order is a pure function of (seed, epoch), so resuming skips the consumed micro-batches of the current
epoch without running them and continues with exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import set_seed

from tuneforge.batch import MEDIA_COLUMN, Batch, sample_seed
from tuneforge.config import RunConfig
from tuneforge.config.kernels import compiles
from tuneforge.config.schedules import SCHEDULES
from tuneforge.errors import DataError, TrainingError
from tuneforge.model.checkpointing import held_tokens, layer_modes, selective_fits
from tuneforge.model.mixed_precision import autocast_inputs, plain_lora_layers
from tuneforge.model.recompute import recomputing
from tuneforge.train import callbacks as _callbacks
from tuneforge.train import checkpoint, reporters, sequence_parallel
from tuneforge.train.neftune import NEFTune
from tuneforge.train.objectives import OBJECTIVES, Objective
from tuneforge.train.optim import base_learning_rate, build_optimizer, build_scheduler, total_training_steps
from tuneforge.train.strategy import Strategy, build_strategy

logger = logging.getLogger(__name__)

Collator = Callable[[list[dict[str, Any]]], Batch]  # rows -> tuneforge.batch.Batch
CAP_SAMPLE = 128  # micro-batches collated to choose the activation cap


def rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (a no-op in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def sums_over_ranks(
    groups: Mapping[str, Mapping[str, Any]], device: torch.device
) -> dict[str, dict[str, float]]:
    """Every value of every group (loss and counts, metric sums, metric counts, ...) summed over the ranks, in
    one all-reduce. Every rank must pass the same group and key names (the objective's metric names are the
    same on every rank); the order they come in does not matter."""
    keys = sorted((group, key) for group, values in groups.items() for key in values)
    flat = [float(groups[group][key]) for group, key in keys]
    reduced = all_reduce_sum(flat, device)
    out: dict[str, dict[str, float]] = {group: {} for group in groups}
    for (group, key), value in zip(keys, reduced, strict=True):
        out[group][key] = value
    return out


def epoch_micro_batches(
    num_rows: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1, shuffle: bool = True
) -> list[list[int]]:
    """Row indices of this rank's micro-batches of one epoch, shuffled by seed + epoch (in dataset order without
    shuffle); the last may be short.

    The shuffled rows are cut into global micro-batches of batch_size x world_size rows, and rank r takes
    rows r, r + world_size, ... of each, so the ranks together see what one process with world_size times
    the batch would see, step by step. Every rank gets the same number of micro-batches, none empty: with
    more than one rank, the order is first padded to a multiple of world_size by repeating its first rows
    (as torch's DistributedSampler does), since a rank that skipped a step would leave the others waiting.
    """
    if shuffle:
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(num_rows))
    if world_size > 1 and order:
        order += order[: -len(order) % world_size]
    chunk = batch_size * world_size
    return [order[i : i + chunk][rank::world_size] for i in range(0, len(order), chunk)]


def eval_batches(
    num_rows: int, batch_size: int, rank: int = 0, world_size: int = 1, same_count: bool = False
) -> list[tuple[list[int], bool]]:
    """This rank's evaluation batches as (row indices, counted): rows rank, rank + world_size, ...

    same_count: every rank runs the same number of forwards (each gathers the weights from all ranks, under
    FSDP2 or ZeRO-3), so a rank with fewer rows repeats its last batch, uncounted."""
    rows = list(range(rank, num_rows, world_size))
    batches = [(rows[i : i + batch_size], True) for i in range(0, len(rows), batch_size)]
    if not same_count:
        return batches
    most = math.ceil(math.ceil(num_rows / world_size) / batch_size)
    filler = batches[-1][0] if batches else [0]
    return batches + [(filler, False)] * (most - len(batches))


def best_metric(t: Any, metrics: Mapping[str, float]) -> tuple[str, bool]:
    """(the evaluation metric that ranks evaluations, whether larger is better): metric_for_best_model as the
    evaluation names it, with or without its `eval_` prefix (default eval_loss), and greater_is_better (default:
    false for a loss or perplexity)."""
    given = t.metric_for_best_model or "eval_loss"
    name = next((n for n in (given, f"eval_{given}", given.removeprefix("eval_")) if n in metrics), None)
    if name is None:
        raise TrainingError(f"metric_for_best_model {given!r}: the evaluation reports {', '.join(sorted(metrics))}; "
                            f"choose one of those")
    greater = t.greater_is_better
    if greater is None:
        greater = not (name.endswith("loss") or name.endswith("perplexity"))
    return name, greater


def cpu_has_native_bf16() -> bool:
    """True when oneDNN runs bf16 matrix products natively on this CPU (avx512_bf16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: say nothing rather than guess
        return True


def autocast_context(train_args: Any, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 / fp16 autocast as configured (also used to precompute reference log-probs the same way)."""
    if train_args.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if train_args.fp16:
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Phase:
    """Where an optimizer step falls in its rollout (the accumulation groups prepared together)."""

    rollout: list[list[int]]  # every micro-batch of the rollout: prepared together, at its first step
    chunk: int  # which accumulation group of the rollout this step trains on
    iteration: int  # 0 .. iterations - 1
    chunks: int
    iterations: int

    @property
    def first(self) -> bool:
        return self.iteration == 0 and self.chunk == 0

    @property
    def consumes(self) -> bool:
        """The last pass over this step's micro-batches: they count as consumed data."""
        return self.iteration == self.iterations - 1

    @property
    def ends_rollout(self) -> bool:
        return self.consumes and self.chunk == self.chunks - 1


@dataclass
class StepResult:
    loss_sum: float
    units: int  # all ranks
    tokens: int  # all ranks
    samples: int  # all ranks
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)  # denominators of subset metrics
    stop: str | None = None  # why the run stops after this step (asked on some rank: all ranks agree)


@dataclass
class Window:
    """Sums since the last log line (the logged loss is their token-weighted mean)."""

    loss_sum: float = 0.0
    units: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    grad_norm: float = 0.0  # of the window's last step, as logged

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.grad_norm = result.grad_norm
        self.loss_sum += result.loss_sum
        self.units += result.units
        add_into(self.metrics, result.metrics)
        add_into(self.counts, result.counts)


def add_into(sums: dict[str, Any], values: Mapping[str, Any]) -> None:
    """sums[k] += values[k] for every key (detached floats, so no graph is kept alive)."""
    for key, value in values.items():
        value = value.detach().float() if torch.is_tensor(value) else value
        sums[key] = sums.get(key, 0.0) + value


def merge_sums(parts: Iterable[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Grouped sums (sums_over_ranks' shape) added up group by group, key by key."""
    out: dict[str, dict[str, float]] = {}
    for part in parts:
        for group, values in part.items():
            add_into(out.setdefault(group, {}), values)
    return out


def metric_means(metrics: Mapping[str, float], counts: Mapping[str, float], units: float) -> dict[str, float]:
    """Each metric's sum divided by its own count when it has one (a subset metric), else by the units.

    A subset metric with no members in the window (no desirable sample in a KTO batch) is left out."""
    means = {}
    for key, total in metrics.items():
        denominator = counts.get(key, units)
        if denominator > 0:
            means[key] = float(total) / float(denominator)
    return means


class Trainer:
    """The one loop. strategy: how it runs on one or many processes (built from the config when not given; give
    it when a frozen reference model must be placed first: strategy.place_reference before the objective is
    built). callbacks: run hooks besides the built-in ones (progress, trainer_log.jsonl, reporters, plots,
    stop requests)."""

    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        collator: Collator | None = None,
        objective: Objective | None = None,
        *,
        strategy: Strategy | None = None,
        callbacks: Sequence[_callbacks.Callback] = (),
        eval_parts: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """eval_parts: name -> [start, stop) rows of eval_dataset evaluated apart too (eval_on_each_dataset)."""
        if collator is None:
            raise TypeError(
                "Trainer needs a collator (rows -> dict of tensors), e.g. tuneforge.data's Collator"
            )
        t = cfg.train
        if objective is None:  # the lm objective, with the config's label_smoothing_factor
            objective = OBJECTIVES["lm"](cfg)
        self.cfg, self.model, self.tokenizer, self.objective = cfg, model, tokenizer, objective
        self.train_dataset, self.eval_dataset, self.collator = train_dataset, eval_dataset, collator
        self.eval_parts = dict(eval_parts or {})
        # rollouts and other work before the forward, under no_grad: per micro-batch or for the whole step
        self.prepare = getattr(objective, "prepare", None)
        self.prepare_step = getattr(objective, "prepare_step", None)
        self.samples = self.prepare is not None or self.prepare_step is not None
        # optimizer steps per rollout, and accumulation groups per rollout (see the module docstring)
        self.iterations = max(int(getattr(objective, "iterations", 1)), 1)
        self.buffer = max(int(getattr(objective, "buffer", 1)), 1)
        self.finish_metrics = getattr(objective, "finish_metrics", None)
        self.extra_callbacks = list(callbacks)
        self.output_dir = Path(t.output_dir or ".")
        self.rank, self.world_size = rank_and_world_size()
        self.is_main = self.rank == 0
        # sequence parallelism: a sequence group's ranks read the same rows, each keeps one shard of every batch
        self.sequence = sequence_parallel.setup(cfg, model)
        self.data_rank, self.data_ranks = (self.rank, self.world_size) if self.sequence is None else (
            self.sequence.data_rank, self.sequence.data_ranks)
        if self.sequence is not None:
            self.collator = lambda rows: self.sequence.shard(collator(rows))
        self.device = next(model.parameters()).device
        self.reporter_names = reporters.requested(cfg)  # a tracker that cannot run: refused before training
        if t.eval_strategy != "no" and eval_dataset is None:
            raise DataError(
                f"{cfg.source}: eval_strategy {t.eval_strategy} needs evaluation data, but none was "
                f"given; set val_size or eval_dataset"
            )
        num_rows = len(train_dataset) if train_dataset is not None else 0
        padded_rows = math.ceil(num_rows / self.data_ranks) * self.data_ranks
        self.micro_batches_per_epoch = math.ceil(padded_rows / (t.per_device_train_batch_size * self.data_ranks))
        steps_per_epoch = math.ceil(self.micro_batches_per_epoch / t.gradient_accumulation_steps) * self.iterations
        self.total_steps = total_training_steps(cfg, max(steps_per_epoch, 1))
        if t.fp16 and self.device.type != "cuda":
            logger.warning("fp16 on %s runs without loss scaling; bf16 is the safer choice", self.device.type)
        if (t.bf16 or t.pure_bf16) and self.device.type == "cpu" and not cpu_has_native_bf16():
            logger.warning(
                "bf16 on this CPU (%s, without avx512_bf16 / AMX) is emulated: its matrix products can be "
                "many times slower than fp32; set bf16: false to train in fp32 here",
                torch.backends.cpu.get_cpu_capability(),
            )
        self.strategy = strategy if strategy is not None else build_strategy(cfg, model)
        # reduce_lr_on_plateau / greedy: stepped with metric_for_best_model after each evaluation in training
        self.schedule_on_metric = SCHEDULES[t.lr_scheduler_type].on_metric

        def make_optimizer() -> torch.optim.Optimizer:  # called by the strategy once the parameters are final
            self.optimizer = build_optimizer(model, cfg)
            self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
            return self.optimizer

        self.step_module = self.strategy.wrap(objective, make_optimizer)  # forward(batch) = the objective's call
        # every rank runs each evaluation forward when each gathers weights from all ranks, and when prepare may
        # generate (under several processes, generation keeps the ranks in step token by token)
        self.same_eval_count = self.strategy.gathers_weights or self.samples
        self.state = checkpoint.TrainerState(total_steps=self.total_steps)
        self.eval_every = t.eval_steps or t.logging_steps
        self.improved = False  # whether the latest evaluation beat the best so far (metric_for_best_model)
        self.best_name = "eval_loss"
        self.pissa_init: Path | None = None  # the run's initial PiSSA adapter (set by _start)
        self._noising: Callable[[Batch], contextlib.AbstractContextManager] = lambda batch: contextlib.nullcontext()
        self._plain_lora = plain_lora_layers(model)
        # activations cheap to compute again are kept as recipes (model/recompute.py); not where parameters are
        # gathered and released inside a layer (DeepSpeed, FSDP) or compiled
        self._recomputing = recomputing if selective_fits(cfg) and not compiles(t) else contextlib.nullcontext
        # each micro-batch's gradient checkpointing, when memory chooses it (model/checkpointing.py)
        self.layer_modes = layer_modes(model)

    # ---- the loop -------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train to total_steps (or an early stop, or a stop request), write the outputs, return the metrics."""
        t = self.cfg.train
        if self.micro_batches_per_epoch == 0:
            raise DataError(f"{self.cfg.source}: the training dataset is empty; check dataset / max_samples")
        self.stop_requests = _callbacks.StopRequests(self.output_dir)
        self.stop_requests.install()
        noise = None
        try:
            if t.neftune_noise_alpha:  # the training forward's input embeddings get noise (train/neftune.py)
                noise = NEFTune(self.model, t.neftune_noise_alpha)
                self._noising = noise.noising
            return self._train(t)
        finally:
            self.stop_requests.restore()
            if noise:
                noise.remove()

    def _train(self, t: Any) -> dict[str, Any]:
        resumed_from = self._start()
        self._cap_activations()
        if t.eval_on_start and resumed_from is None:  # the untrained model's figures, to compare against
            self._evaluate_and_track()
        self.model.train()
        window, stop_reason, stopped, pending_stop, pending_save = Window(), None, None, None, False
        while self.state.global_step < self.total_steps and stop_reason is None and stopped is None:
            for group, phase in self._accumulation_groups():
                result = self._optimizer_step(group, phase=phase)
                epoch_ended = self._advance(len(group) if phase.consumes else 0, result)
                window.add(result)
                step = self.state.global_step
                if result.stop is not None and step < self.total_steps:
                    pending_stop = result.stop
                if pending_stop is not None and phase.ends_rollout and step < self.total_steps:
                    stopped = pending_stop  # between rollouts, where a checkpoint can resume exactly
                if step % t.logging_steps == 0 or stopped:
                    self._log_train(window)
                    window = Window()
                every_n = t.eval_strategy == "steps" and step % self.eval_every == 0
                self.improved = False
                if every_n or (t.eval_strategy == "epoch" and epoch_ended):
                    stop_reason = self._evaluate_and_track(during_training=True)
                pending_save = (pending_save or (t.save_strategy == "steps" and step % t.save_steps == 0)
                                or (t.save_strategy == "epoch" and epoch_ended)
                                or (t.save_strategy == "best" and self.improved))
                if (pending_save and phase.ends_rollout) or (stopped and stop_reason is None):
                    self._save_checkpoint()  # a stopped run can be resumed from this step
                    pending_save = False
                self.callbacks.on_step(self.state)
                if stop_reason is not None or stopped or step >= self.total_steps:
                    break
        if window.steps:  # the steps after the last multiple of logging_steps
            self._log_train(window)
        if stop_reason is not None:
            stopped = None  # early stopping ends the run as finished
            logger.info(
                "%s; stopping at step %d of %d", stop_reason, self.state.global_step, self.total_steps
            )
        if self.is_main:  # honoured, or moot (the run ended anyway): the next run must not stop at once
            self.stop_requests.honoured()
        if stopped is None and self.eval_dataset is not None and self.state.last_eval_step != self.state.global_step:
            self._evaluate_and_track()
            if t.save_strategy == "best" and self.improved:
                self._save_checkpoint()
        if stopped is None and t.load_best_model_at_end:
            self._load_best()
        self.state.status = "stopped" if stopped else "completed"
        results = self._results()
        self._finish(results, resumed_from, stopped)
        return results

    def _optimizer_step(self, group: list[list[int]], *, phase: Phase | None = None) -> StepResult:
        """[prepare] + forward + backward each micro-batch, normalized by the step's total units; clip; step.

        phase: where the step falls in its rollout (None: a rollout of this one group); the rollout's first step
        prepares all of its micro-batches, the later ones step on what it prepared."""
        t = self.cfg.train
        phase = phase or Phase([*group], 0, 0, 1, 1)
        if phase.first:
            rows = [[self.train_dataset[i] for i in indices] for indices in phase.rollout]
            batches = [self.collator(micro_batch_rows) for micro_batch_rows in rows]
            if self.samples:  # rollouts first: units may only be known after them (generated tokens)
                seeds = [[sample_seed(t.seed, self.state.epoch, i) for i in indices] for indices in phase.rollout]
                batches = self._prepared(batches, seeds)
            self._rollout = batches if phase.chunks > 1 or phase.iterations > 1 else None
        else:
            batches = self._rollout
        size = len(group)
        batches = batches[phase.chunk * t.gradient_accumulation_steps:][:size]
        units, tokens = all_reduce_sum(
            [sum(self.objective.count(b) for b in batches), sum(b.num_tokens for b in batches)], self.device
        )
        # the strategies average gradients over ranks; multiplying by world_size turns that into the global sum
        scale = self.world_size / max(units, 1)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        metrics: dict[str, torch.Tensor | float] = {}
        counts: dict[str, torch.Tensor | float] = {}
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1  # gradients are reduced over ranks once per step: with the last backward
            with self.strategy.accumulating(last):
                batch = self._to_device(batch)
                if self.layer_modes is not None and (held := held_tokens(batch)):
                    self.layer_modes.apply(held)
                with self._autocast(), self._noising(batch), self._recomputing():
                    out = self.step_module(batch)
                with self._adapter_inputs():  # checkpointed layers recompute in backward: as in the forward
                    self.strategy.backward(out.loss_sum * scale, last)
            loss_sum += out.loss_sum.detach().float()
            add_into(metrics, out.metrics)
            add_into(counts, out.counts)
        step = self.state.global_step + 1
        samples = sum(b.num_rows for b in batches)
        # the step's loss, metrics and samples over all ranks, and whether any rank was asked to stop
        asked = self.callbacks.should_stop()
        reduced = sums_over_ranks(
            {"step": {"loss": loss_sum, "samples": samples, "stop": 1.0 if asked else 0.0},
             "metrics": metrics, "counts": counts},
            self.device,
        )
        loss_value, samples = reduced["step"]["loss"], int(reduced["step"]["samples"])
        stop = (asked or "another process was asked to stop") if reduced["step"]["stop"] > 0 else None
        if not math.isfinite(loss_value):
            raise TrainingError(
                f"step {step}: the loss is {loss_value}. Lower learning_rate (now {t.learning_rate:g})"
                f"{', or use bf16 instead of fp16' if t.fp16 else ''}, and check the data of this step"
            )
        grad_norm = self.strategy.step(step)  # clip, step, zero the gradients
        if not self.schedule_on_metric:  # those step on evaluations (_evaluate_and_track)
            self.scheduler.step()
        self.session.steps, self.session.tokens = self.session.steps + 1, self.session.tokens + int(tokens)
        self.session.samples += samples
        return StepResult(loss_value, int(units), int(tokens), samples, grad_norm, reduced["metrics"],
                          reduced["counts"], stop)

    def _cap_activations(self) -> None:
        """The activation cap of each micro-batch's checkpointing (LayerModes.choose_cap), from the token counts of
        up to CAP_SAMPLE micro-batches spread over this rank's first epoch, collated without their media. Not for
        rows whose batches are only known after rollouts, nor for streamed rows."""
        modes = self.layer_modes
        if modes is None or self.samples or getattr(self.train_dataset, "streamed", False):
            return
        batches = self._epoch_micro_batches(0)
        rows = self.train_dataset
        media = [c for c in getattr(rows, "column_names", None) or () if c.endswith(MEDIA_COLUMN)]  # kl_mm_inputs too
        if media:
            rows = rows.remove_columns(media)
        sample = batches[:: math.ceil(len(batches) / CAP_SAMPLE)]
        held = [held_tokens(self.collator([rows[i] for i in indices])) or 0 for indices in sample]
        cap = modes.choose_cap(held)
        if cap is not None and cap < max(held):
            over = sum(tokens > cap for tokens in held)
            logger.info(
                "gradient checkpointing: a micro-batch of more than %d tokens checkpoints the layers its activations "
                "would take beyond that (%d of %d sampled micro-batches, up to %d tokens; ~%.0f%% more compute)",
                cap, over, len(held), max(held), 100 * modes.extra_compute(held, cap))

    @torch.no_grad()
    def _prepared(self, batches: list[Batch], seeds: list[list[int]]) -> list[Batch]:
        """The objective's prepare_step (or prepare of each micro-batch) on the device, outside the strategy's
        wrapper (weights usable), each batch carrying its rows' sample seeds."""
        batches = [replace(self._to_device(b), sample_seeds=tuple(s)) for b, s in zip(batches, seeds, strict=True)]
        with self.strategy.weights_usable(), self._autocast():
            if self.prepare_step is not None:
                return list(self.prepare_step(self.model, batches))
            return [self.prepare(self.model, batch) for batch in batches]

    def _to_device(self, batch: Batch) -> Batch:
        return batch.to(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The configured autocast; under it, plain LoRA layers skip their redundant fp32 input copy."""
        stack = contextlib.ExitStack()
        stack.enter_context(autocast_context(self.cfg.train, self.device))
        stack.enter_context(self._adapter_inputs())
        return stack

    def _adapter_inputs(self) -> contextlib.AbstractContextManager:
        """Under bf16 / fp16 autocast, plain LoRA layers take their input as it comes (mixed_precision.py)."""
        t = self.cfg.train
        return autocast_inputs(self._plain_lora) if (t.bf16 or t.fp16) and self._plain_lora else contextlib.nullcontext()

    def _epoch_micro_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of an epoch (epoch_micro_batches with the run's data seed)."""
        t = self.cfg.train
        # streamed rows come shuffled by their buffer, in the order they are read
        shuffle = not (t.disable_shuffling or getattr(self.train_dataset, "streamed", False))
        return epoch_micro_batches(len(self.train_dataset), t.per_device_train_batch_size,
                                   t.seed if t.data_seed is None else t.data_seed, epoch, self.data_rank,
                                   self.data_ranks, shuffle=shuffle)

    def _accumulation_groups(self) -> Iterator[tuple[list[list[int]], Phase]]:
        """The remaining micro-batches of the current epoch, gradient_accumulation_steps at a time, each group with
        its place in its rollout: `buffer` groups prepared together, stepped on `iterations` times in order."""
        t = self.cfg.train
        remaining = self._epoch_micro_batches(self.state.epoch)[self.state.batches_in_epoch :]
        ga = t.gradient_accumulation_steps
        for start in range(0, len(remaining), ga * self.buffer):
            rollout = remaining[start : start + ga * self.buffer]
            groups = [rollout[i : i + ga] for i in range(0, len(rollout), ga)]
            for iteration in range(self.iterations):
                for chunk, group in enumerate(groups):
                    yield group, Phase(rollout, chunk, iteration, len(groups), self.iterations)

    def _advance(self, micro_batches: int, result: StepResult) -> bool:
        """Count the step into the state; True when it finished an epoch."""
        s = self.state
        s.global_step += 1
        s.batches_in_epoch += micro_batches
        s.total_tokens += result.tokens
        s.loss_sum += result.loss_sum
        s.loss_units += result.units
        ended = s.batches_in_epoch >= self.micro_batches_per_epoch
        if ended:
            s.epoch, s.batches_in_epoch = s.epoch + 1, 0
        s.epoch_progress = s.epoch + s.batches_in_epoch / self.micro_batches_per_epoch
        return ended

    # ---- evaluation -----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """eval_loss (the mean over all eval units, e.g. tokens), perplexity, and the objective's metrics; with
        eval_parts, the same for each part too, named eval_<part>_loss, eval_<part>_perplexity, ..."""
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            raise DataError(f"{self.cfg.source}: there is no evaluation data; set val_size or eval_dataset")
        was_training = self.model.training
        self.model.eval()
        parts = self.eval_parts or {"": (0, len(self.eval_dataset))}
        sums = {name: self._eval_sums(start, stop) for name, (start, stop) in parts.items()}
        self.model.train(was_training)
        metrics = self._eval_metrics(merge_sums(sums.values()), "eval_dataset / val_size")
        if self.eval_parts:
            for name, part in sums.items():
                named = self._eval_metrics(part, f"eval dataset '{name}'")
                metrics.update({f"eval_{name}_{k.removeprefix('eval_')}": v for k, v in named.items()})
        return metrics

    def _eval_sums(self, start: int, stop: int) -> dict[str, Any]:
        """The loss sum, units and metric sums of eval rows [start, stop), over all ranks."""
        size = self.cfg.train.per_device_eval_batch_size
        batches = eval_batches(stop - start, size, self.data_rank, self.data_ranks, self.same_eval_count)
        loss_sum, units, sums, counts = 0.0, 0, {}, {}
        for indices, counted in batches:
            batch = self.collator([self.eval_dataset[start + i] for i in indices])
            if self.samples:  # the same seeds at every evaluation: the figures compare across steps
                seeds = [sample_seed(self.cfg.train.seed, "eval", start + i) for i in indices]
                batch = self._prepared([batch], [seeds])[0]
            with self._autocast():
                out = self.strategy.eval_forward(self._to_device(batch))
            if not counted:
                continue
            units += self.objective.count(batch)
            loss_sum += float(out.loss_sum)
            add_into(sums, out.metrics)
            add_into(counts, out.counts)
        return sums_over_ranks({"eval": {"loss": loss_sum, "units": units}, "metrics": sums, "counts": counts},
                               self.device)

    def _eval_metrics(self, reduced: dict[str, Any], what: str) -> dict[str, float]:
        loss_sum, units = reduced["eval"]["loss"], reduced["eval"]["units"]
        if units == 0:
            raise DataError(
                f"{self.cfg.source}: the evaluation data ({what}) has no {self.objective.name} units "
                f"(e.g. every label is -100); check eval_dataset / val_size"
            )
        metrics = {"eval_loss": loss_sum / units}
        if self.objective.reports_perplexity:
            metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else math.inf
        means = metric_means(reduced["metrics"], reduced["counts"], units)
        if self.finish_metrics is not None:
            means = self.finish_metrics(means, evaluating=True)
        metrics.update({f"eval_{k}": v for k, v in means.items()})
        return metrics

    def _evaluate_and_track(self, during_training: bool = False) -> str | None:
        """Evaluate, log, and update early stopping; return why training should stop, if it should.

        during_training: an evaluation between optimizer steps (not before the first, nor after the last), which
        steps a schedule that follows the metric (reduce_lr_on_plateau, greedy), as transformers' Trainer does."""
        s, patience = self.state, self.cfg.train.early_stopping_steps
        metrics = self.evaluate()
        s.last_eval_step = s.global_step
        entry = {**metrics, "epoch": round(s.epoch_progress, 4), "step": s.global_step}
        s.log_history.append(entry)
        self.callbacks.on_evaluate(s, entry)
        logger.info(
            "eval at step %d: %s", s.global_step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        )
        name, greater = best_metric(self.cfg.train, metrics)
        self.best_name, value = name, metrics[name]
        if during_training and self.schedule_on_metric:
            self.scheduler.step(value)
        self.improved = s.best_metric is None or (value > s.best_metric if greater else value < s.best_metric)
        if self.improved:
            s.best_metric, s.best_step, s.evals_without_improvement = value, s.global_step, 0
        else:
            s.evals_without_improvement += 1
        if patience and s.evals_without_improvement >= patience:
            return (
                f"early stopping: {name} has not improved on {s.best_metric:.4f} for "
                f"{s.evals_without_improvement} evaluations (early_stopping_steps {patience})"
            )
        return None

    # ---- logging, saving, outputs ---------------------------------------------------------------------
    def _log_train(self, window: Window) -> None:
        s = self.state
        entry = {
            "loss": window.loss_sum / max(window.units, 1),
            "grad_norm": window.grad_norm,
            "learning_rate": base_learning_rate(self.optimizer),
            "epoch": round(s.epoch_progress, 4),
        }
        means = metric_means(window.metrics, window.counts, max(window.units, 1))
        if self.finish_metrics is not None:  # e.g. standard deviations from the means of squares, sample texts
            means = self.finish_metrics(means, evaluating=False)
        entry.update(means)
        entry["step"] = s.global_step
        s.log_history.append(entry)
        self.callbacks.on_log(s, entry)

    def _load_best(self) -> None:
        """load_best_model_at_end: the best evaluated checkpoint's weights become the output's."""
        s = self.state
        if s.best_step is None or s.best_step == s.global_step:
            return
        folder = checkpoint.folder_at(self.output_dir, s.best_step)
        if not folder.is_dir():
            logger.warning("load_best_model_at_end: %s is gone; the output keeps the last weights", folder)
            return
        self.strategy.load_checkpoint(folder, self.scheduler)  # its weights; this run's state stays
        logger.info("load_best_model_at_end: the output holds %s (%s %.4f)", folder.name, self.best_name,
                    s.best_metric)

    def _save_checkpoint(self) -> None:
        if hasattr(self.objective, "state_dict"):  # e.g. ppo's adaptive KL coefficient
            self.state.objective = self.objective.state_dict()
        path = self.strategy.save_checkpoint(self.output_dir, self.tokenizer, self.scheduler, self.state,
                                             is_main=self.is_main)
        if self.is_main:
            best = self.state.best_step
            keep = checkpoint.folder_at(self.output_dir, best) if best is not None else None
            checkpoint.rotate_checkpoints(self.output_dir, self.cfg.train.save_total_limit, keep=keep)
        self.callbacks.on_save(self.state, path)

    def _start(self) -> Path | None:
        """Resume (weights, optimizer, scheduler, RNG, data position) or seed a fresh run; open the logs."""
        folder = checkpoint.resume_folder(self.cfg)
        # before the checkpoint's weights replace the initial adapter
        self.pissa_init = checkpoint.keep_pissa_init(self.model, self.output_dir, folder, write=self.is_main)
        if folder is not None:
            self.state = self.strategy.load_checkpoint(folder, self.scheduler)
            if hasattr(self.objective, "load_state_dict") and self.state.objective:
                self.objective.load_state_dict(self.state.objective)
            self.state.total_steps = self.total_steps
            self.state.status = "running"
            if self.state.batches_in_epoch >= self.micro_batches_per_epoch:  # the data shrank since the save
                self.state.epoch, self.state.batches_in_epoch = self.state.epoch + 1, 0
            s = self.state
            logger.info(
                "resumed from %s at step %d (epoch %d, micro-batch %d)",
                folder,
                s.global_step,
                s.epoch,
                s.batches_in_epoch,
            )
        else:
            set_seed(self.cfg.train.seed)
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.remove_stale_temporaries(self.output_dir)
        self.session = _callbacks.Session()
        self.callbacks = _callbacks.Callbacks([*self._builtin_callbacks(), *self.extra_callbacks])
        self.callbacks.on_begin(self.state, folder)
        t = self.cfg.train
        logger.info(
            "training %d steps (%d micro-batches of %d per epoch, %d per step)",
            self.total_steps,
            self.micro_batches_per_epoch,
            t.per_device_train_batch_size,
            t.gradient_accumulation_steps,
        )
        self.session.restart()  # this session's pace from here
        _callbacks.reset_peak_memory(self.device)  # training's peak, not loading's
        return folder

    def _builtin_callbacks(self) -> list[_callbacks.Callback]:
        """Progress, trainer_log.jsonl, reporters and plots on rank 0; stop requests on every rank."""
        t = self.cfg.train
        own: list[_callbacks.Callback] = [self.stop_requests]
        if self.is_main:
            own += [
                _callbacks.ProgressCallback(self.total_steps, t.disable_tqdm, self.session),
                _callbacks.TrainerLogCallback(self.output_dir, self.total_steps, self.session),
                _callbacks.ReportersCallback(self.reporter_names, self.cfg, self.output_dir),
            ]
            if t.plot_loss:
                own.append(_callbacks.PlotsCallback(self.output_dir))
        return own

    def _results(self) -> dict[str, Any]:
        s, run = self.state, self.session
        runtime = run.elapsed()

        def per_second(count: float) -> float:
            return round(count / runtime, 3) if runtime > 0 else 0.0

        results: dict[str, Any] = {
            "epoch": round(s.epoch_progress, 4),
            "global_step": s.global_step,
            "total_tokens": s.total_tokens,
            "train_loss": s.loss_sum / max(s.loss_units, 1),
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": per_second(run.samples),
            "train_steps_per_second": per_second(run.steps),
            "train_tokens_per_second": per_second(run.tokens),
        }
        if s.status == "stopped":  # a finished run's results keep their keys
            results["status"] = s.status
        # every rank's peak memory since training started (RSS on a CPU, allocated memory on CUDA)
        own = _callbacks.peak_memory_mb(self.device)
        peaks = all_reduce_sum([(own or 0.0) if r == self.rank else 0.0 for r in range(self.world_size)], self.device)
        if own is not None:
            results["train_peak_memory_mb"] = round(max(peaks), 1)
            if self.world_size > 1:
                results["train_peak_memory_mb_per_rank"] = [round(p, 1) for p in peaks]
        evals = [e for e in s.log_history if "eval_loss" in e]
        if evals:
            results.update({k: v for k, v in evals[-1].items() if k not in ("epoch", "step")})
        return results

    def _finish(self, results: dict[str, Any], resumed_from: Path | None, stopped: str | None) -> None:
        if not stopped:  # a stopped run's weights are in its last checkpoint, not (yet) the output
            self.strategy.save_final(self.tokenizer, self.output_dir, self.pissa_init,
                                     self.cfg.method.pissa_convert, is_main=self.is_main)
        if not self.is_main:
            self.callbacks.on_end(self.state, results)
            return
        checkpoint.write_results(self.output_dir, results, self.state)
        self.callbacks.on_end(self.state, results)
        resumed = f" (resumed from {resumed_from.name})" if resumed_from else ""
        if stopped:
            logger.warning(
                "stopped at step %d of %d (%s)%s: checkpoint-%d saved in %s; continue with "
                "resume_from_checkpoint: true (tuneforge train ... resume_from_checkpoint=true)",
                self.state.global_step, self.total_steps, stopped, resumed, self.state.global_step, self.output_dir,
            )
            return
        logger.info(
            "finished %d steps%s: train_loss %.4f; outputs in %s",
            self.state.global_step,
            resumed,
            results["train_loss"],
            self.output_dir,
        )
