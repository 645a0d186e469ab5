"""The training loop: one optimizer step reads top to bottom as batch -> forward -> loss -> backward -> clip
-> step -> log. The stage-specific part is the Objective; everything else is the same for every stage.

Gradient accumulation: the micro-batches of one optimizer step are collated first, their units (supervised
tokens for lm) counted and summed over all ranks, and each micro-batch back-propagates
loss_sum / total_units. The step's gradient is therefore the gradient of the whole batch's mean loss,
however it is split into micro-batches or ranks.

Data order is a pure function of (seed, epoch), so resuming skips the consumed micro-batches of the current
epoch without running them and continues with exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import set_seed

from tuneforge.config import RunConfig
from tuneforge.errors import DataError, TrainingError
from tuneforge.train import callbacks, checkpoint, deepspeed, fsdp
from tuneforge.train.dist import data_parallel
from tuneforge.train.objectives import Objective, lm_objective
from tuneforge.train.optim import base_learning_rate, build_optimizer, build_scheduler, total_training_steps

logger = logging.getLogger(__name__)

Collator = Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]


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


def epoch_micro_batches(
    num_rows: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """Row indices of this rank's micro-batches of one epoch, shuffled by seed + epoch; the last may be short.

    The shuffled rows are cut into global micro-batches of batch_size x world_size rows, and rank r takes
    rows r, r + world_size, ... of each, so the ranks together see what one process with world_size times
    the batch would see, step by step. Every rank gets the same number of micro-batches, none empty: with
    more than one rank, the order is first padded to a multiple of world_size by repeating its first rows
    (as torch's DistributedSampler does), since a rank that skipped a step would leave the others waiting.
    """
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
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


@dataclass
class StepResult:
    loss_sum: float
    units: int  # all ranks
    tokens: int  # all ranks
    samples: int  # all ranks
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)  # denominators of subset metrics


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
    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        collator: Collator | None = None,
        objective: Objective = lm_objective,
    ) -> None:
        if collator is None:
            raise TypeError(
                "Trainer needs a collator (rows -> dict of tensors), e.g. tuneforge.data's Collator"
            )
        t = cfg.train
        self.cfg, self.model, self.tokenizer, self.objective = cfg, model, tokenizer, objective
        self.train_dataset, self.eval_dataset, self.collator = train_dataset, eval_dataset, collator
        self.output_dir = Path(t.output_dir or ".")
        self.rank, self.world_size = rank_and_world_size()
        self.is_main = self.rank == 0
        self.device = next(model.parameters()).device
        self.reporter_names = callbacks.requested_reporters(t.report_to, cfg.source)
        if t.eval_strategy != "no" and eval_dataset is None:
            raise DataError(
                f"{cfg.source}: eval_strategy {t.eval_strategy} needs evaluation data, but none was "
                f"given; set val_size or eval_dataset"
            )
        num_rows = len(train_dataset) if train_dataset is not None else 0
        padded_rows = math.ceil(num_rows / self.world_size) * self.world_size
        self.micro_batches_per_epoch = math.ceil(padded_rows / (t.per_device_train_batch_size * self.world_size))
        steps_per_epoch = math.ceil(self.micro_batches_per_epoch / t.gradient_accumulation_steps)
        self.total_steps = total_training_steps(cfg, max(steps_per_epoch, 1))
        self.sharded = fsdp.enabled(cfg)
        if self.sharded:  # before the optimizer: fully_shard replaces the parameters by the shards it steps
            self.step_module = fsdp.shard(model, objective, cfg, self.device)
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        # DeepSpeed scales an fp16 loss itself
        scaling = t.fp16 and self.device.type == "cuda" and not deepspeed.enabled(cfg)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=scaling)
        if t.fp16 and self.device.type != "cuda":
            logger.warning("fp16 on %s runs without loss scaling; bf16 is the safer choice", self.device.type)
        if t.bf16 and self.device.type == "cpu" and not cpu_has_native_bf16():
            logger.warning(
                "bf16 on this CPU (%s, without avx512_bf16 / AMX) is emulated: its matrix products can be "
                "many times slower than fp32; set bf16: false to train in fp32 here",
                torch.backends.cpu.get_cpu_capability(),
            )
        self.engine = deepspeed.Engine(model, objective, self.optimizer, cfg) if deepspeed.enabled(cfg) else None
        if self.engine is not None:  # ZeRO partitions the optimizer built above (and at stage 3 the weights)
            self.step_module = self.engine
        elif not self.sharded:
            self.step_module = data_parallel(model, objective, self.device)  # forward = the objective
        # every rank must run each forward when each forward gathers weights from all ranks
        self.gathers_weights = self.sharded or (self.engine is not None and self.engine.partitions_weights)
        self.state = checkpoint.TrainerState(total_steps=self.total_steps)
        self.eval_every = t.eval_steps or t.logging_steps
        self.pissa_init: Path | None = None  # the run's initial PiSSA adapter (set by _start)

    # ---- the loop -------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train to total_steps (or early stop), write the outputs, and return the run's metrics."""
        t = self.cfg.train
        if self.micro_batches_per_epoch == 0:
            raise DataError(f"{self.cfg.source}: the training dataset is empty; check dataset / max_samples")
        resumed_from = self._start()
        if t.eval_on_start and resumed_from is None:  # the untrained model's figures, to compare against
            self._evaluate_and_track()
        self.model.train()
        window, stop_reason = Window(), None
        while self.state.global_step < self.total_steps and stop_reason is None:
            for group in self._accumulation_groups():
                result = self._optimizer_step(group)
                epoch_ended = self._advance(len(group), result)
                window.add(result)
                step = self.state.global_step
                if step % t.logging_steps == 0:
                    self._log_train(window)
                    window = Window()
                every_n = t.eval_strategy == "steps" and step % self.eval_every == 0
                if every_n or (t.eval_strategy == "epoch" and epoch_ended):
                    stop_reason = self._evaluate_and_track()
                if t.save_strategy == "steps" and step % t.save_steps == 0:
                    self._save_checkpoint()
                self.progress.step(step)
                if stop_reason is not None or step >= self.total_steps:
                    break
        if window.steps:  # the steps after the last multiple of logging_steps
            self._log_train(window)
        if stop_reason is not None:
            logger.info(
                "%s; stopping at step %d of %d", stop_reason, self.state.global_step, self.total_steps
            )
        if self.eval_dataset is not None and self.state.last_eval_step != self.state.global_step:
            self._evaluate_and_track()
        results = self._results()
        self._finish(results, resumed_from)
        return results

    def _optimizer_step(self, group: list[list[int]]) -> StepResult:
        """Forward + backward each micro-batch, normalized by the step's total units; clip; step."""
        t = self.cfg.train
        rows = [[self.train_dataset[i] for i in indices] for indices in group]
        batches = [self.collator(micro_batch_rows) for micro_batch_rows in rows]
        units, tokens = all_reduce_sum(
            [sum(self.objective.count(b) for b in batches), sum(b.num_tokens for b in batches)], self.device
        )
        # DDP averages gradients over ranks; multiplying by world_size turns that average into the global sum
        scale = self.world_size / max(units, 1)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        metrics: dict[str, torch.Tensor | float] = {}
        counts: dict[str, torch.Tensor | float] = {}
        for i, batch in enumerate(batches):
            # under DDP, gradients are all-reduced once per step: with the last micro-batch's backward
            last = i == len(batches) - 1
            no_sync = getattr(self.step_module, "no_sync", None)
            if self.engine is not None:  # DeepSpeed reduces when the accumulation boundary comes
                with self._autocast():
                    out = self.engine(self._to_device(batch))
                self.engine.backward(out.loss_sum * scale, last)
            else:
                with contextlib.nullcontext() if last or no_sync is None else no_sync():
                    with self._autocast():
                        out = self.step_module(self._to_device(batch))
                    self.scaler.scale(out.loss_sum * scale).backward()
            loss_sum += out.loss_sum.detach().float()
            add_into(metrics, out.metrics)
            add_into(counts, out.counts)
        step = self.state.global_step + 1
        samples = sum(b.num_rows for b in batches)
        # the step's loss, metrics and samples over all ranks (every rank's objective emits the same keys)
        keys, count_keys = sorted(metrics), sorted(counts)
        reduced = all_reduce_sum(
            [float(loss_sum), samples, *(float(metrics[k]) for k in keys), *(float(counts[k]) for k in count_keys)],
            self.device,
        )
        loss_value, samples = reduced[0], int(reduced[1])
        metrics = dict(zip(keys, reduced[2 : 2 + len(keys)], strict=True))
        counts = dict(zip(count_keys, reduced[2 + len(keys) :], strict=True))
        if not math.isfinite(loss_value):
            raise TrainingError(
                f"step {step}: the loss is {loss_value}. Lower learning_rate (now {t.learning_rate:g})"
                f"{', or use bf16 instead of fp16' if t.fp16 else ''}, and check the data of this step"
            )
        if self.engine is not None:  # reduce, clip, step, zero the gradients (fp16: DeepSpeed skips an overflow)
            grad_norm = self.engine.step()
            grad_norm = grad_norm if t.fp16 else self._check_norm(grad_norm, step)
        else:
            grad_norm = self._clip_gradients(step)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.session.steps, self.session.tokens = self.session.steps + 1, self.session.tokens + int(tokens)
        self.session.samples += samples
        metric_values = {k: float(v) for k, v in metrics.items()}
        count_values = {k: float(v) for k, v in counts.items()}
        return StepResult(loss_value, int(units), int(tokens), samples, grad_norm, metric_values, count_values)

    def _clip_gradients(self, step: int) -> float:
        """Clip to max_grad_norm (0: no clipping) and return the norm before clipping."""
        t = self.cfg.train
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        return norm if self.scaler.is_enabled() else self._check_norm(norm, step)  # fp16: the scaler skips the step

    def _check_norm(self, norm: float, step: int) -> float:
        t = self.cfg.train
        if not math.isfinite(norm):
            raise TrainingError(
                f"step {step}: the gradient norm is {norm}. Lower learning_rate (now {t.learning_rate:g}) "
                f"or set max_grad_norm (now {t.max_grad_norm:g})"
            )
        return norm

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return batch.to(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast_context(self.cfg.train, self.device)

    def _accumulation_groups(self) -> Iterator[list[list[int]]]:
        """The remaining micro-batches of the current epoch, gradient_accumulation_steps at a time."""
        t = self.cfg.train
        size, epoch = t.per_device_train_batch_size, self.state.epoch
        batches = epoch_micro_batches(
            len(self.train_dataset), size, t.seed, epoch, self.rank, self.world_size
        )
        remaining = batches[self.state.batches_in_epoch :]
        ga = t.gradient_accumulation_steps
        for start in range(0, len(remaining), ga):
            yield remaining[start : start + ga]

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
        """eval_loss (the mean over all eval units, e.g. tokens), perplexity, and the objective's metrics."""
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            raise DataError(f"{self.cfg.source}: there is no evaluation data; set val_size or eval_dataset")
        was_training = self.model.training
        self.model.eval()
        size = self.cfg.train.per_device_eval_batch_size
        batches = eval_batches(len(self.eval_dataset), size, self.rank, self.world_size, self.gathers_weights)
        loss_sum, units, sums, counts = 0.0, 0, {}, {}
        for indices, counted in batches:
            batch = self.collator([self.eval_dataset[i] for i in indices])
            with self._autocast():
                if self.gathers_weights:
                    out = self.step_module(self._to_device(batch))
                else:
                    out = self.objective(self.model, self._to_device(batch))
            if not counted:
                continue
            units += self.objective.count(batch)
            loss_sum += float(out.loss_sum)
            add_into(sums, out.metrics)
            add_into(counts, out.counts)
        self.model.train(was_training)
        # every rank reduces the same list: the metric names are the objective's, the same on all ranks
        keys, count_keys = sorted(sums), sorted(counts)
        reduced = all_reduce_sum(
            [loss_sum, units, *(float(sums[k]) for k in keys), *(float(counts[k]) for k in count_keys)],
            self.device,
        )
        loss_sum, units = reduced[0], reduced[1]
        sums = dict(zip(keys, reduced[2 : 2 + len(keys)], strict=True))
        counts = dict(zip(count_keys, reduced[2 + len(keys) :], strict=True))
        if units == 0:
            raise DataError(
                f"{self.cfg.source}: the evaluation data has no {self.objective.name} units "
                f"(e.g. every label is -100); check eval_dataset / val_size"
            )
        metrics = {"eval_loss": loss_sum / units}
        if self.objective.reports_perplexity:
            metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else math.inf
        metrics.update({f"eval_{k}": v for k, v in metric_means(sums, counts, units).items()})
        return metrics

    def _evaluate_and_track(self) -> str | None:
        """Evaluate, log, and update early stopping; return why training should stop, if it should."""
        s, patience = self.state, self.cfg.train.early_stopping_steps
        metrics = self.evaluate()
        s.last_eval_step = s.global_step
        entry = {**metrics, "epoch": round(s.epoch_progress, 4), "step": s.global_step}
        self._record(entry)
        logger.info(
            "eval at step %d: %s", s.global_step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        )
        if s.best_eval_loss is None or metrics["eval_loss"] < s.best_eval_loss:
            s.best_eval_loss, s.evals_without_improvement = metrics["eval_loss"], 0
        else:
            s.evals_without_improvement += 1
        if patience and s.evals_without_improvement >= patience:
            return (
                f"early stopping: eval_loss has not improved on {s.best_eval_loss:.4f} for "
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
        entry.update(metric_means(window.metrics, window.counts, max(window.units, 1)))
        entry["step"] = s.global_step
        self._record(entry)

    def _record(self, entry: dict[str, Any]) -> None:
        self.state.log_history.append(entry)
        if not self.is_main:
            return
        line = self.trainer_log.write(self.state.global_step, entry, self.session, self.state.total_tokens)
        if "loss" in entry:
            self.progress.log(line)
        self.reporters.log(self.state.global_step, entry)

    def _save_checkpoint(self) -> None:
        parts = (self.model, self.tokenizer, self.optimizer, self.scheduler, self.scaler, self.state)
        if self.engine is not None:  # every rank writes its partitions
            self.engine.save_checkpoint(self.output_dir, self.tokenizer, self.scheduler, self.state, is_main=self.is_main)
        elif self.sharded:  # every rank writes its shards
            fsdp.save_checkpoint(self.output_dir, *parts, is_main=self.is_main)
        elif self.is_main:
            checkpoint.save_checkpoint(self.output_dir, *parts)
        if self.is_main:
            checkpoint.rotate_checkpoints(self.output_dir, self.cfg.train.save_total_limit)

    def _start(self) -> Path | None:
        """Resume (weights, optimizer, scheduler, RNG, data position) or seed a fresh run; open the logs."""
        folder = checkpoint.resume_folder(self.cfg)
        # before the checkpoint's weights replace the initial adapter
        self.pissa_init = checkpoint.keep_pissa_init(self.model, self.output_dir, folder, write=self.is_main)
        if folder is not None:
            parts = (self.model, self.optimizer, self.scheduler, self.scaler)
            if self.engine is not None:
                self.state = self.engine.load_checkpoint(folder, self.scheduler)
            else:
                self.state = (fsdp.load_checkpoint if self.sharded else checkpoint.load_checkpoint)(folder, *parts)
            self.state.total_steps = self.total_steps
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
        self.progress = callbacks.Progress(self.total_steps, self.cfg.train.disable_tqdm or not self.is_main)
        self.progress.start(self.state.global_step)
        self.trainer_log = callbacks.TrainerLog(self.output_dir, self.total_steps)
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.remove_stale_temporaries(self.output_dir)
            self.trainer_log.start(self.state.global_step if folder is not None else None)
        names = self.reporter_names if self.is_main else []
        self.reporters = callbacks.Reporters(names, self.output_dir, self.cfg.to_dict())
        t = self.cfg.train
        logger.info(
            "training %d steps (%d micro-batches of %d per epoch, %d per step)",
            self.total_steps,
            self.micro_batches_per_epoch,
            t.per_device_train_batch_size,
            t.gradient_accumulation_steps,
        )
        self.session = callbacks.Session()
        callbacks.reset_peak_memory(self.device)  # training's peak, not loading's
        return folder

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
        # every rank's peak memory since training started (RSS on a CPU, allocated memory on CUDA)
        own = callbacks.peak_memory_mb(self.device)
        peaks = all_reduce_sum([(own or 0.0) if r == self.rank else 0.0 for r in range(self.world_size)], self.device)
        if own is not None:
            results["train_peak_memory_mb"] = round(max(peaks), 1)
            if self.world_size > 1:
                results["train_peak_memory_mb_per_rank"] = [round(p, 1) for p in peaks]
        evals = [e for e in s.log_history if "eval_loss" in e]
        if evals:
            results.update({k: v for k, v in evals[-1].items() if k not in ("epoch", "step")})
        return results

    def _finish(self, results: dict[str, Any], resumed_from: Path | None) -> None:
        self.progress.close()
        self.reporters.close()
        pissa_convert = self.cfg.method.pissa_convert
        if self.engine is not None:  # at ZeRO-3 every rank sends its partitions; rank 0 writes the folder
            self.engine.save_final_model(self.model, self.tokenizer, self.output_dir, self.pissa_init, pissa_convert,
                                         is_main=self.is_main)
        elif self.sharded:  # every rank sends its shards; rank 0 writes the folder
            fsdp.save_final_model(self.model, self.tokenizer, self.output_dir, is_main=self.is_main)
        if not self.is_main:
            return
        if self.engine is None and not self.sharded:
            checkpoint.save_final_model(self.model, self.tokenizer, self.output_dir, self.pissa_init, pissa_convert)
        checkpoint.write_results(self.output_dir, results, self.state)
        if self.cfg.train.plot_loss:
            callbacks.plot_losses(self.state.log_history, self.output_dir)
        resumed = f" (resumed from {resumed_from.name})" if resumed_from else ""
        logger.info(
            "finished %d steps%s: train_loss %.4f; outputs in %s",
            self.state.global_step,
            resumed,
            results["train_loss"],
            self.output_dir,
        )
