"""PPO for language models (Ziegler et al. 2019; Ouyang et al. 2022), LlamaFactory's `stage: ppo` on the same loop.

The policy carries a critic: a value head on its own last hidden states (model/value_head.py, saved as
critic_head.safetensors), so one decoder pass gives both the log-probs and the values. A rollout (the trainer
prepares ppo_buffer_size accumulation groups at once) goes:

1. sample num_generations (default 1) completions per prompt, seeded per prompt, and score them with the rewards;
   with ppo_score_norm, scores are normalized by the running mean and std of every score so far;
2. one no-grad pass for the sampling policy's log-probs and values, and the reference's log-probs;
3. per-token rewards: -kl_coef * (logp - ref_logp), plus the score at the last token (whitened over the rollout,
   mean kept, with ppo_whiten_rewards); GAE (ppo_gamma, ppo_lam) gives advantages and returns; advantages are
   whitened over the rollout (all processes);
4. the adaptive KL coefficient moves towards ppo_target from the rollout's mean KL (when ppo_adaptive_kl).

The trainer then steps ppo_epochs times over the rollout, each pass one optimizer step per accumulation group, on
the clipped policy loss plus ppo_vf_coef times the clipped value loss, averaged over the completion tokens. The
running state (KL coefficient, score statistics) is checkpointed with the trainer state. The pure pieces are in
policy.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from tuneforge.batch import Batch
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.policy import (
    RunningMoments,
    adaptive_kl_coef,
    clipped_surrogate,
    clipped_value_loss,
    gae,
    kl_shaped_rewards,
    whiten,
)
from tuneforge.train.objectives.sampling import Rollouts, SamplingObjective, moments_over_ranks
from tuneforge.train.objectives.token_logps import target_owners, token_logps_and_values

if TYPE_CHECKING:
    from tuneforge.config import RunConfig
    from tuneforge.train.objectives.reference import Reference

SCORE_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class PPOSettings:
    num_generations: int = 1
    max_completion_length: int = 256
    epochs: int = 4
    buffer: int = 1
    score_norm: bool = False
    whiten_rewards: bool = False
    target: float = 6.0
    kl_coef: float = 0.2
    adaptive_kl: bool = True
    kl_horizon: int = 10000
    gamma: float = 1.0
    lam: float = 0.95
    epsilon: float = 0.2
    epsilon_high: float | None = None
    value_clip: float = 0.2
    vf_coef: float = 0.1

    @classmethod
    def from_config(cls, cfg: RunConfig) -> PPOSettings:
        from tuneforge.config.rl import resolved_rl

        r = resolved_rl(cfg)
        return cls(r.num_generations, r.max_completion_length, r.ppo_epochs, r.ppo_buffer_size, r.ppo_score_norm,
                   r.ppo_whiten_rewards, r.ppo_target, r.ppo_kl_coef, r.ppo_adaptive_kl, r.ppo_kl_horizon, r.ppo_gamma,
                   r.ppo_lam, r.epsilon, r.epsilon_high, r.ppo_value_clip, r.ppo_vf_coef)


class PPOObjective(SamplingObjective):
    """PPO on prompt rows, for a policy with a critic (a ValueHeadModel); the unit is a completion token."""

    name = "ppo"
    reports_perplexity = False

    def __init__(self, settings: PPOSettings, rollouts: Rollouts, reference: Reference | None) -> None:
        if reference is None:
            raise ValueError("ppo needs a reference (the policy without adapters, or ref_model) for its KL penalty")
        self.settings, self.rollouts, self.reference = settings, rollouts, reference
        self.num_generations, self.max_completion_length = settings.num_generations, settings.max_completion_length
        self.iterations, self.buffer = settings.epochs, settings.buffer  # the trainer's rollout shape
        self.kl_coef = settings.kl_coef
        self.score_moments = RunningMoments()
        self.samples: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, cfg: RunConfig, reference: Reference | None, rollouts: Rollouts) -> PPOObjective:
        return cls(PPOSettings.from_config(cfg), rollouts, reference)

    # ---- running state (checkpointed) ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_coef, "score_moments": asdict(self.score_moments)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_coef = float(state["kl_coef"])
        self.score_moments = RunningMoments(**state["score_moments"])

    # ---- rollouts -----------------------------------------------------------------------------------------
    def prepare_step(self, model: torch.nn.Module, batches: list[Batch]) -> list[Batch]:
        """Sample, score, and turn every micro-batch of the rollout into advantages and returns (see the module
        docstring). Running statistics move only while training (model.training), never in an evaluation."""
        s, training = self.settings, model.training
        rollouts = [self._sample(model, batch) for batch in batches]
        scores = [r["rewards"] for r in rollouts]
        if s.score_norm:
            scores = self._normalized(scores, update=training)
        device = next(model.parameters()).device
        prepared = [self._forward_rollout(model, batch, r, score.to(device))
                    for batch, r, score in zip(batches, rollouts, scores, strict=True)]
        if s.whiten_rewards:
            mean, variance, _ = moments_over_ranks([p["rewards"] for p in prepared])
            for p in prepared:
                p["rewards"] = whiten(p["rewards"], mean, variance, shift_mean=False)
        for p in prepared:
            p["advantages"], p["returns"] = gae(p["rewards"], p["old_values"], p["lengths"], s.gamma, s.lam)
        mean, variance, _ = moments_over_ranks([p["advantages"] for p in prepared])
        kl_mean, _, sequences = moments_over_ranks([p["kl"] for p in prepared])
        coef = self.kl_coef
        if training and s.adaptive_kl:  # from this rollout's KL, for the next rollout's rewards
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl_mean, s.target, sequences, s.kl_horizon)
        out = []
        for batch, r, p in zip(batches, rollouts, prepared, strict=True):
            collated = p["batch"]
            metrics, counts = self._rollout_metrics(r)
            metrics["kl"], counts["kl"] = float(p["kl"].sum()), p["kl"].numel()
            metrics["kl_coef"], counts["kl_coef"] = coef, 1
            collated.targets.update({
                "old_logps": p["old_logps"], "old_values": p["old_values"], "returns": p["returns"],
                "advantages": whiten(p["advantages"], mean, variance), "units": p["old_logps"].numel(),
                "metrics": metrics, "counts": counts,
            })
            out.append(replace(collated, num_rows=batch.num_rows, sample_seeds=batch.sample_seeds))
        self._keep_samples(rollouts[0])
        return out

    def _normalized(self, scores: list[torch.Tensor], *, update: bool) -> list[torch.Tensor]:
        """Scores less the running mean, over the running std (this rollout's scores merged in first)."""
        if update:
            mean, variance, n = moments_over_ranks(scores)
            self.score_moments.update(mean, variance * (n - 1) / n if n else 0.0, n)
        m = self.score_moments
        return [(x - m.mean) / (m.std + SCORE_EPS) for x in scores]

    def _forward_rollout(self, model: torch.nn.Module, batch: Batch, r: dict[str, Any], scores: torch.Tensor
                         ) -> dict[str, Any]:
        """The collated prompt + completion sequences, the sampling policy's log-probs and values, the reference's
        log-probs, and the KL-shaped per-token rewards."""
        collated = self._collate(model, batch, r)
        owners, count = target_owners(collated), len(r["completions"])
        lengths = torch.bincount(owners, minlength=count).tolist()
        old_logps, old_values = token_logps_and_values(model, collated)
        ref_logps = self.reference.token_logps(model, collated)
        rewards = kl_shaped_rewards(scores, old_logps, ref_logps, lengths, self.kl_coef)
        kl = old_logps.new_zeros(count).index_add(0, owners, old_logps - ref_logps)
        return {"batch": collated, "lengths": lengths, "old_logps": old_logps.detach(),
                "old_values": old_values.detach().float(), "rewards": rewards, "kl": kl}

    # ---- the loss -----------------------------------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        s, t = self.settings, batch.targets
        logps, values = token_logps_and_values(model, batch)
        policy, clipped = clipped_surrogate(logps, t["old_logps"], t["advantages"], s.epsilon,
                                            s.epsilon if s.epsilon_high is None else s.epsilon_high)
        value, value_clipped = clipped_value_loss(values, t["old_values"], t["returns"], s.value_clip)
        metrics: dict[str, Any] = {
            **t["metrics"], "policy_loss": policy.sum().detach(), "value_loss": value.sum().detach(),
            "clip_ratio": clipped.float().sum(), "value_clip_ratio": value_clipped.float().sum(),
        }
        return ObjectiveOutput(loss_sum=(policy + s.vf_coef * value).sum(), metrics=metrics, counts=dict(t["counts"]))
