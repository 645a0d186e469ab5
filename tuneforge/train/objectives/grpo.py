"""GRPO: sample num_generations completions per prompt, score them, and step the policy on group-normalized
advantages with PPO's clipped ratio (and a k3 KL penalty to the reference when beta > 0).

Everything that samples happens in `prepare_step`, which the trainer calls once per optimizer step, under no_grad,
before the units are counted: generate (each completion from its own seeded generator, so it does not depend on the
prompts beside it), score with the rewards, turn the rewards into advantages over the step (all processes, for
scale_rewards: batch), and collate prompt + completion sequences with the completion tokens as targets. The
forward (`__call__`) is then an ordinary log-prob pass. The pure pieces are in policy.py.

What the objective samples with comes from the workflow as a `Rollouts` (tuneforge/rollout.py), so train imports
neither infer nor data nor the rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from tuneforge.batch import Batch
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.policy import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    k3_kl,
    loss_units,
)
from tuneforge.train.objectives.sampling import Rollouts, SamplingObjective, moments_over_ranks
from tuneforge.train.objectives.token_logps import target_owners, token_logps

if TYPE_CHECKING:
    from tuneforge.config import RunConfig
    from tuneforge.train.objectives.reference import Reference

__all__ = ["GRPOObjective", "GRPOSettings", "Rollouts"]


@dataclass(frozen=True)
class GRPOSettings:
    num_generations: int = 8
    max_completion_length: int = 256
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    num_iterations: int = 1
    mask_truncated_completions: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> GRPOSettings:
        from tuneforge.config.rl import resolved_rl

        r = resolved_rl(cfg)
        return cls(r.num_generations, r.max_completion_length, r.loss_type, r.scale_rewards, r.epsilon,
                   r.epsilon_high, r.beta, r.num_iterations, r.mask_truncated_completions)


class GRPOObjective(SamplingObjective):
    """GRPO on prompt rows; the unit is the loss_type's (policy.loss_units)."""

    name = "grpo"
    reports_perplexity = False

    def __init__(self, settings: GRPOSettings, rollouts: Rollouts, reference: Reference | None = None) -> None:
        if settings.beta > 0 and reference is None:
            raise ValueError("grpo with beta > 0 needs a reference (the policy without adapters, or ref_model)")
        self.settings, self.rollouts, self.reference = settings, rollouts, reference
        self.num_generations, self.max_completion_length = settings.num_generations, settings.max_completion_length
        self.iterations = settings.num_iterations  # the trainer steps this often on each prepared group
        self.samples: list[dict[str, Any]] = []  # a few of the latest completions, for the log

    @classmethod
    def from_config(cls, cfg: RunConfig, reference: Reference | None, rollouts: Rollouts) -> GRPOObjective:
        return cls(GRPOSettings.from_config(cfg), rollouts, reference)

    # ---- rollouts -----------------------------------------------------------------------------------------
    def prepare_step(self, model: torch.nn.Module, batches: list[Batch]) -> list[Batch]:
        """Sample, score and collate every micro-batch of the step; advantages over the step."""
        rollouts = [self._sample(model, batch) for batch in batches]
        batch_std = None
        if self.settings.scale_rewards == "batch":  # the std of every reward of the step, over all processes
            batch_std = moments_over_ranks([r["rewards"] for r in rollouts])[1] ** 0.5
        return [self._collated(model, batch, r, batch_std) for batch, r in zip(batches, rollouts, strict=True)]

    def _collated(self, model: torch.nn.Module, batch: Batch, r: dict[str, Any], batch_std: float | None) -> Batch:
        s, G = self.settings, self.settings.num_generations
        collated = self._collate(model, batch, r, unlearned=r["truncated"] if s.mask_truncated_completions else None)
        owners = target_owners(collated)
        advantages = group_advantages(r["rewards"].to(owners.device), G, s.scale_rewards, batch_std)
        extra: dict[str, Any] = {"owners": owners, "advantages": advantages}
        if s.num_iterations > 1:  # the policy that sampled, for the ratio of the later iterations
            extra["old_logps"] = token_logps(model, collated).detach()
        if s.beta > 0:
            extra["ref_token_logps"] = self.reference.token_logps(model, collated)
        num_sequences, num_tokens = len(r["completions"]), int(owners.numel())
        extra["units"] = loss_units(s.loss_type, num_sequences, num_tokens)
        extra["metrics"], extra["counts"] = self._group_metrics(r)
        self._keep_samples(r)
        collated.targets.update(extra)
        return replace(collated, num_rows=batch.num_rows, sample_seeds=batch.sample_seeds)

    def _group_metrics(self, r: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
        """The rollout metrics, and how the rewards spread within each prompt's group."""
        metrics, counts = self._rollout_metrics(r)
        G = self.settings.num_generations
        groups = r["rewards"].view(-1, G)
        group_std = groups.std(dim=1) if G > 1 else torch.zeros(groups.shape[0])
        metrics["reward_std"], metrics["frac_reward_zero_std"] = float(group_std.sum()), float((group_std < 1e-6).sum())
        counts["reward_std"] = counts["frac_reward_zero_std"] = groups.shape[0]
        return metrics, counts

    # ---- the loss -----------------------------------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        s, t = self.settings, batch.targets
        logps = token_logps(model, batch)
        owners = t["owners"]
        old = t.get("old_logps")
        old = logps.detach() if old is None else old
        token_losses, clipped = clipped_surrogate(logps, old, t["advantages"][owners], s.epsilon,
                                                  s.epsilon if s.epsilon_high is None else s.epsilon_high)
        metrics: dict[str, Any] = dict(t["metrics"])
        counts: dict[str, Any] = dict(t["counts"])
        tokens = int(owners.numel())
        metrics["clip_ratio"], counts["clip_ratio"] = clipped.float().sum().detach(), tokens
        if s.beta > 0:
            kl = k3_kl(logps, t["ref_token_logps"])
            token_losses = token_losses + s.beta * kl
            metrics["kl"], counts["kl"] = kl.sum().detach(), tokens
        num_sequences = int(batch.targets["sequence_ends"].shape[0])
        loss_sum = aggregate(token_losses, owners, num_sequences, s.loss_type, s.max_completion_length)
        return ObjectiveOutput(loss_sum=loss_sum, metrics=metrics, counts=counts)
