"""Objectives: the only stage-specific part of training.

An objective turns (model, micro-batch) into a *sum* of per-unit losses. A unit is whatever the stage
normalizes by: a supervised token for pt / sft, a chosen/rejected pair for rm / dpo. The trainer asks
`count(batch)` for the units of every micro-batch of one optimizer step *before* any forward, adds them
up (over all micro-batches and all ranks) and back-propagates `loss_sum / total_units`, so gradient
accumulation and data parallelism give the loss of the whole batch.

Later stages plug in as objects with the same two methods (a DPO objective holds its reference model,
a reward objective reads the value head); the loop does not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

Batch = Mapping[str, torch.Tensor]


@dataclass
class ObjectiveOutput:
    """What one micro-batch contributes to the optimizer step.

    loss_sum: scalar tensor, the loss summed over the micro-batch's units (it carries the graph).
    metrics: extra values, each *summed* over the same units (e.g. the number of pairs ranked right);
        the trainer divides them by the unit count when it logs, so they average like the loss.
    counts: for a metric that averages over a subset of the units (KTO's rewards/chosen over the
        desirable samples only), the size of that subset in this micro-batch; the trainer divides the
        metric's sum by the sum of its counts instead of by the unit count.
    """

    loss_sum: torch.Tensor
    metrics: dict[str, torch.Tensor | float] = field(default_factory=dict)
    counts: dict[str, torch.Tensor | float] = field(default_factory=dict)


@runtime_checkable
class Objective(Protocol):
    name: str
    # True when loss_sum / units is a mean negative log-likelihood, so exp(eval_loss) is a perplexity
    reports_perplexity: bool

    def count(self, batch: Batch) -> int:
        """Units in this micro-batch, computed from the (CPU) batch without running the model."""
        ...

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        """Forward the micro-batch and return its loss sum (and metric sums)."""
        ...


# imported last: the objectives build on the types above
from tuneforge.train.objectives.kto import KTOObjective  # noqa: E402
from tuneforge.train.objectives.lm import LMObjective  # noqa: E402
from tuneforge.train.objectives.preference import PreferenceObjective  # noqa: E402
from tuneforge.train.objectives.reference import (  # noqa: E402
    AdapterReference,
    ModelReference,
    Reference,
    reference_logps,
)
from tuneforge.train.objectives.reward import RewardObjective  # noqa: E402

lm_objective = LMObjective()


def build_objective(cfg: RunConfig, reference: Reference | None = None) -> Objective:
    """The objective of cfg.method.stage (pt / sft: lm_objective). reference: the dpo / kto reference
    (AdapterReference, ModelReference), unused when the batches carry precomputed ref_logps."""
    from tuneforge.errors import ConfigError

    stage = cfg.method.stage
    if stage in ("pt", "sft"):
        return lm_objective
    if stage == "rm":
        return RewardObjective()
    if stage == "dpo":
        return PreferenceObjective.from_config(cfg, reference)
    if stage == "kto":
        return KTOObjective.from_config(cfg, reference)
    raise ConfigError(f"stage {stage} has no training objective yet")


__all__ = [
    "AdapterReference", "Batch", "KTOObjective", "LMObjective", "ModelReference", "Objective",
    "ObjectiveOutput", "PreferenceObjective", "Reference", "RewardObjective", "build_objective",
    "lm_objective", "reference_logps",
]
