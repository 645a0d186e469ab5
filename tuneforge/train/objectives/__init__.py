"""Objectives: the only stage-specific part of training.

An objective turns (model, micro-batch) into a *sum* of per-unit losses. A unit is whatever the stage
normalizes by: a supervised token for pt / sft, a chosen/rejected pair for rm / dpo. The trainer asks
`count(batch)` for the units of every micro-batch of one optimizer step *before* any forward, adds them
up (over all micro-batches and all ranks) and back-propagates `loss_sum / total_units`, so gradient
accumulation and data parallelism give the loss of the whole batch.

Objectives take a tuneforge.batch.Batch and pass its model_inputs to the model as they are. A stage's row
(tuneforge/stages.py) names its objective in the registry below (register_objective); the loop does not
change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from tuneforge.batch import Batch  # the batch contract every objective takes

if TYPE_CHECKING:
    from tuneforge.config import RunConfig


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
from tuneforge.train.objectives.grpo import GRPOObjective  # noqa: E402
from tuneforge.train.objectives.kto import KTOObjective  # noqa: E402
from tuneforge.train.objectives.lm import LMObjective  # noqa: E402
from tuneforge.train.objectives.ppo import PPOObjective  # noqa: E402
from tuneforge.train.objectives.preference import PreferenceObjective  # noqa: E402
from tuneforge.train.objectives.reference import (  # noqa: E402
    AdapterReference,
    ModelReference,
    Reference,
    reference_logps,
)
from tuneforge.train.objectives.reward import RewardObjective  # noqa: E402

lm_objective = LMObjective()

# name -> factory(cfg, *, reference=None, generate=None) -> Objective. A stage's row (tuneforge/stages.py)
# names its objective. reference: the frozen reference (AdapterReference / ModelReference) when the stage
# uses one, else None. generate: what the workflow hands objectives to sample completions with: callable as
# generate(model, prompts, **overrides), and for RL objectives also decoding, collation and the rewards
# (sampling.Rollouts; tuneforge/rollout.py builds it).
ObjectiveFactory = Callable[..., Objective]
OBJECTIVES: dict[str, ObjectiveFactory] = {}


def register_objective(name: str, factory: ObjectiveFactory, *, replace: bool = False) -> ObjectiveFactory:
    """Make `factory` the objective a stage row names `name`; replace=True to redefine one."""
    if name in OBJECTIVES and not replace:
        raise ValueError(f"objective {name!r} is already registered")
    OBJECTIVES[name] = factory
    return factory


def build_objective(cfg: RunConfig, reference: Reference | None = None, *, generate: Callable | None = None) -> Objective:
    """The objective of cfg.method.stage, from the factory its stage row names. reference: the stage's
    reference (unused when the batches carry precomputed ref_logps); generate: for objectives that sample."""
    from tuneforge.errors import ConfigError
    from tuneforge.stages import STAGES

    stage = STAGES.get(cfg.method.stage)
    if stage is None or stage.objective is None:
        raise ConfigError(f"stage {cfg.method.stage} has no training objective yet")
    if stage.objective not in OBJECTIVES:
        raise ConfigError(f"stage {stage.name} names objective {stage.objective!r}, which is not registered; "
                          f"registered: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[stage.objective](cfg, reference=reference, generate=generate)


register_objective("lm", lambda cfg, reference=None, generate=None: LMObjective.from_config(cfg, reference))
register_objective("reward", lambda cfg, reference=None, generate=None: RewardObjective())
register_objective("preference", lambda cfg, reference=None, generate=None: PreferenceObjective.from_config(cfg, reference))
register_objective("kto", lambda cfg, reference=None, generate=None: KTOObjective.from_config(cfg, reference))
register_objective("grpo", lambda cfg, reference=None, generate=None: GRPOObjective.from_config(cfg, reference, generate))
register_objective("ppo", lambda cfg, reference=None, generate=None: PPOObjective.from_config(cfg, reference, generate))


__all__ = [
    "OBJECTIVES", "AdapterReference", "Batch", "GRPOObjective", "KTOObjective", "LMObjective", "ModelReference", "Objective",
    "ObjectiveFactory", "ObjectiveOutput", "PPOObjective", "PreferenceObjective", "Reference", "RewardObjective", "build_objective",
    "lm_objective", "reference_logps", "register_objective",
]
