"""The `lr_scheduler_type` values (every one transformers' get_scheduler knows) and the `lr_scheduler_kwargs` each
takes, checked when the config loads (a leaf: no torch).

The schedules are transformers' own (tuneforge.train.optim.build_scheduler calls transformers.get_scheduler); this
table only says which keyword arguments each one's function takes and what values they may hold, so a misspelt or
misplaced key is refused before anything loads. A test keeps it equal to transformers' signatures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tuneforge.config.schema import RunConfig

NUMBER, WHOLE = "number", "whole number"
SHAPES = ("linear", "cosine", "1-sqrt")  # warmup_stable_decay's warmup_type / decay_type
PLATEAU_KWARGS = {"mode": ("min", "max"), "factor": NUMBER, "patience": WHOLE, "threshold": NUMBER,
                  "threshold_mode": ("rel", "abs"), "cooldown": WHOLE, "min_lr": NUMBER, "eps": NUMBER}


@dataclass(frozen=True)
class Schedule:
    """name: the lr_scheduler_type value. kwargs: lr_scheduler_kwargs key -> NUMBER, WHOLE or the allowed words.
    on_metric: stepped with the evaluation's metric_for_best_model after each evaluation during training (as
    transformers' Trainer steps it), not after each optimizer step. warmup: it reads warmup_steps / warmup_ratio."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    on_metric: bool = False
    warmup: bool = True


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("linear"),
    Schedule("cosine", {"num_cycles": NUMBER}),
    Schedule("cosine_with_restarts", {"num_cycles": WHOLE}),
    Schedule("polynomial", {"lr_end": NUMBER, "power": NUMBER}),
    Schedule("constant", warmup=False),
    Schedule("constant_with_warmup"),
    Schedule("inverse_sqrt", {"timescale": WHOLE}),
    Schedule("reduce_lr_on_plateau", PLATEAU_KWARGS, on_metric=True, warmup=False),
    Schedule("cosine_with_min_lr", {"num_cycles": NUMBER, "min_lr": NUMBER, "min_lr_rate": NUMBER}),
    Schedule("cosine_warmup_with_min_lr", {"num_cycles": NUMBER, "min_lr": NUMBER, "min_lr_rate": NUMBER,
                                           "warmup_lr_rate": NUMBER}),
    Schedule("warmup_stable_decay", {"num_decay_steps": WHOLE, "num_stable_steps": WHOLE, "warmup_type": SHAPES,
                                     "decay_type": SHAPES, "min_lr_ratio": NUMBER, "num_cycles": NUMBER}),
    Schedule("greedy", {**PLATEAU_KWARGS, "warmup": WHOLE, "max_lr": NUMBER, "verbose": (True, False),
                        "smooth": (True, False), "window_size": WHOLE, "reset_start": WHOLE},
             on_metric=True, warmup=False),
)}
SCHEDULER_CHOICES = tuple(SCHEDULES)


def _is(kind: Any, value: Any) -> bool:
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == WHOLE:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value in kind


def stable_decay_steps(kwargs: Mapping[str, Any], warmup: int, total: int) -> dict[str, int]:
    """warmup_stable_decay's num_stable_steps and num_decay_steps, each from lr_scheduler_kwargs or, as LlamaFactory
    fills them, a third of the steps after warm-up stable and the rest decaying."""
    remaining = total - warmup
    return {"num_stable_steps": kwargs.get("num_stable_steps", remaining // 3),
            "num_decay_steps": kwargs.get("num_decay_steps", remaining - remaining // 3)}


def check_scheduler(cfg: RunConfig, fail: Callable[..., None]) -> None:
    """lr_scheduler_kwargs against what lr_scheduler_type's function in transformers takes, their values, and the
    evaluation a metric-driven schedule needs."""
    t = cfg.train
    schedule, kwargs = SCHEDULES[t.lr_scheduler_type], t.lr_scheduler_kwargs
    unknown = sorted(set(kwargs) - set(schedule.kwargs))
    if unknown:
        takes = ", ".join(schedule.kwargs) or "none"
        fail(f"lr_scheduler_kwargs {unknown} do not apply to {schedule.name} (it takes: {takes})",
             key="lr_scheduler_kwargs")
    for key, value in kwargs.items():
        kind = schedule.kwargs[key]
        if not _is(kind, value):
            wanted = f"a {kind}" if isinstance(kind, str) else "one of " + ", ".join(map(str, kind))
            fail(f"lr_scheduler_kwargs {key}: {value!r} is not {wanted}", key="lr_scheduler_kwargs")
    if "min_lr_rate" in schedule.kwargs:  # the two cosine schedules with a floor
        given = {"min_lr", "min_lr_rate"} & set(kwargs)
        if not given:
            fail(f"lr_scheduler_type {schedule.name} needs lr_scheduler_kwargs with min_lr_rate (a share of "
                 f"learning_rate, e.g. {{min_lr_rate: 0.1}}) or min_lr", key=("lr_scheduler_type", "lr_scheduler_kwargs"))
        if len(given) == 2:
            fail("lr_scheduler_kwargs: set only one of min_lr and min_lr_rate", key="lr_scheduler_kwargs")
    for key in ("min_lr_rate", "warmup_lr_rate", "min_lr_ratio"):
        if key in kwargs and not 0 <= kwargs[key] <= 1:
            fail(f"lr_scheduler_kwargs {key} must be in [0, 1] (got {kwargs[key]}): a share of learning_rate",
                 key="lr_scheduler_kwargs")
    if "lr_end" in kwargs and not 0 <= kwargs["lr_end"] < t.learning_rate:
        fail(f"lr_scheduler_kwargs lr_end {kwargs['lr_end']} must be >= 0 and below learning_rate "
             f"{t.learning_rate} (polynomial decays from learning_rate down to lr_end)",
             key=("lr_scheduler_kwargs", "learning_rate"))
    if "factor" in kwargs and not 0 < kwargs["factor"] < 1:
        fail(f"lr_scheduler_kwargs factor must be in (0, 1) (got {kwargs['factor']}): {schedule.name} multiplies "
             f"the learning rate by it", key="lr_scheduler_kwargs")
    if kwargs.get("timescale") == 0:
        fail("lr_scheduler_kwargs timescale must be > 0", key="lr_scheduler_kwargs")
    if schedule.name == "warmup_stable_decay" and t.max_steps > 0:  # else the step count is known after tokenizing
        _check_stable_decay(kwargs, t, fail)
    if schedule.on_metric and t.eval_strategy == "no":
        fail(f"lr_scheduler_type {schedule.name} lowers the learning rate when the evaluation's "
             f"{t.metric_for_best_model or 'eval_loss'} stops improving, so it needs evaluations during training: "
             f"set eval_strategy (steps or epoch) and val_size or eval_dataset, or choose another schedule",
             key=("lr_scheduler_type", "eval_strategy"))


def warmup_steps(t: Any, total: int) -> int:
    """The warm-up steps of a run of `total` steps: warmup_steps when > 0, else ceil(warmup_ratio x total)."""
    return t.warmup_steps if t.warmup_steps > 0 else math.ceil(t.warmup_ratio * total)


def _check_stable_decay(kwargs: Mapping[str, Any], t: Any, fail: Callable[..., None]) -> None:
    check_stable_decay(kwargs, warmup_steps(t, t.max_steps), t.max_steps, fail)


def check_stable_decay(kwargs: Mapping[str, Any], warmup: int, total: int, fail: Callable[..., None]) -> None:
    """warmup_stable_decay's phases must fit in the run (transformers would otherwise leave the schedule's shape to
    chance: a negative stable phase)."""
    phases = stable_decay_steps(kwargs, warmup, total)
    if warmup + phases["num_stable_steps"] + phases["num_decay_steps"] > total:
        fail(f"warmup_stable_decay: {warmup} warm-up + {phases['num_stable_steps']} stable + "
             f"{phases['num_decay_steps']} decay steps are more than the run's {total} steps; lower "
             f"num_stable_steps / num_decay_steps in lr_scheduler_kwargs (unset, they split the steps after warm-up "
             f"1/3 stable, 2/3 decay)", key=("lr_scheduler_kwargs", "max_steps"))
