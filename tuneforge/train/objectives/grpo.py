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

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tuneforge.batch import Batch, Layout, sample_seed
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.policy import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    k3_kl,
    loss_units,
)
from tuneforge.train.objectives.token_logps import IGNORE_INDEX, supervised_targets, token_logps

if TYPE_CHECKING:
    from tuneforge.config import RunConfig
    from tuneforge.train.objectives.reference import Reference

SAMPLES_LOGGED = 2  # completions shown in each trainer_log.jsonl line


class Rollouts(Protocol):
    """What an RL objective samples and scores with (built by the workflow: tuneforge/rollout.py)."""

    stop_token_ids: frozenset[int]
    reward_names: list[str]

    def __call__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], **overrides: Any) -> list[list[int]]:
        """Completions of token-id prompts (infer.generation.completion_generator; overrides as there)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def collate(self, sequences: list[dict[str, list[int]]], layout: Layout) -> tuple[dict, dict]:
        """Sequences ({input_ids, labels}) -> (model_inputs, targets with sequence_ids / sequence_ends)."""
        ...

    def score(self, prompts: list[str], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(per_reward (n, k) with NaN where a reward had nothing to say, total (n,)): the weighted rewards."""
        ...


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
        r = cfg.rl
        return cls(r.num_generations, r.max_completion_length, r.loss_type, r.scale_rewards, r.epsilon,
                   r.epsilon_high, r.beta, r.num_iterations, r.mask_truncated_completions)


class GRPOObjective:
    """GRPO on prompt rows; the unit is the loss_type's (policy.loss_units)."""

    name = "grpo"
    reports_perplexity = False

    def __init__(self, settings: GRPOSettings, rollouts: Rollouts, reference: Reference | None = None) -> None:
        if settings.beta > 0 and reference is None:
            raise ValueError("grpo with beta > 0 needs a reference (the policy without adapters, or ref_model)")
        self.settings, self.rollouts, self.reference = settings, rollouts, reference
        self.iterations = settings.num_iterations  # the trainer steps this often on each prepared group
        self.samples: list[dict[str, Any]] = []  # a few of the latest completions, for the log

    @classmethod
    def from_config(cls, cfg: RunConfig, reference: Reference | None, rollouts: Rollouts) -> GRPOObjective:
        return cls(GRPOSettings.from_config(cfg), rollouts, reference)

    # ---- rollouts -----------------------------------------------------------------------------------------
    def prepare_step(self, model: torch.nn.Module, batches: list[Batch]) -> list[Batch]:
        """Sample, score and collate every micro-batch of the step; advantages over the step."""
        rollouts = [self._sample(model, batch) for batch in batches]
        batch_std = self._batch_std([r["rewards"] for r in rollouts]) if self.settings.scale_rewards == "batch" else None
        return [self._collated(model, batch, r, batch_std) for batch, r in zip(batches, rollouts, strict=True)]

    def _sample(self, model: torch.nn.Module, batch: Batch) -> dict[str, Any]:
        s, G = self.settings, self.settings.num_generations
        prompts: list[list[int]] = batch.targets["prompt_ids"]
        row_seeds = batch.sample_seeds or tuple(range(len(prompts)))
        seeds = [sample_seed(row_seed, j) for row_seed in row_seeds for j in range(G)]
        completions = self.rollouts(model, prompts, num_return_sequences=G, max_new_tokens=s.max_completion_length,
                                    seeds=seeds)
        owners = [b for b in range(len(prompts)) for _ in range(G)]  # the prompt of each completion
        prompt_texts = [self.rollouts.decode(p, skip_special_tokens=False) for p in prompts]
        texts = [self.rollouts.decode(c) for c in completions]
        columns = [batch.targets["columns"][b] for b in owners]
        device = next(model.parameters()).device
        per_reward, total = self.rollouts.score([prompt_texts[b] for b in owners], texts, columns, completions, device)
        truncated = [not c or c[-1] not in self.rollouts.stop_token_ids for c in completions]
        return {"prompts": prompts, "owners": owners, "completions": completions, "texts": texts,
                "prompt_texts": prompt_texts, "per_reward": per_reward.float(), "rewards": total.float(),
                "truncated": truncated}

    def _batch_std(self, rewards: list[torch.Tensor]) -> float:
        """The standard deviation (Bessel-corrected) of every reward of the step, over all processes."""
        from tuneforge.train.trainer import sums_over_ranks

        every = torch.cat(rewards).double()
        sums = sums_over_ranks({"r": {"n": every.numel(), "sum": float(every.sum()), "sq": float((every**2).sum())}},
                               every.device)["r"]
        n = sums["n"]
        if n < 2:
            return 0.0
        variance = (sums["sq"] - sums["sum"] ** 2 / n) / (n - 1)
        return math.sqrt(max(variance, 0.0))

    def _collated(self, model: torch.nn.Module, batch: Batch, r: dict[str, Any], batch_std: float | None) -> Batch:
        s, G = self.settings, self.settings.num_generations
        sequences = []
        for b, completion, cut in zip(r["owners"], r["completions"], r["truncated"], strict=True):
            prompt = r["prompts"][b]
            learn = not (cut and s.mask_truncated_completions)
            labels = [IGNORE_INDEX] * len(prompt) + (list(completion) if learn else [IGNORE_INDEX] * len(completion))
            sequences.append({"input_ids": list(prompt) + list(completion), "labels": labels})
        layout = Layout(rows="plain", flat=batch.layout.flat)
        model_inputs, targets = self.rollouts.collate(sequences, layout)
        device = next(model.parameters()).device
        collated = Batch(model_inputs, targets, layout).to(device)
        keep, _ = supervised_targets(collated)
        owners = collated.targets["sequence_ids"][keep]
        advantages = group_advantages(r["rewards"].to(device), G, s.scale_rewards, batch_std)
        extra: dict[str, Any] = {"owners": owners, "advantages": advantages}
        if s.num_iterations > 1:  # the policy that sampled, for the ratio of the later iterations
            extra["old_logps"] = token_logps(model, collated).detach()
        if s.beta > 0:
            extra["ref_token_logps"] = self.reference.token_logps(model, collated)
        num_sequences, num_tokens = len(sequences), int(owners.numel())
        extra["units"] = loss_units(s.loss_type, num_sequences, num_tokens)
        extra["metrics"], extra["counts"] = self._rollout_metrics(r, G)
        self._keep_samples(r)
        collated.targets.update(extra)
        tokens = sum(len(seq["input_ids"]) for seq in sequences)
        return replace(collated, num_rows=batch.num_rows, num_tokens=tokens, sample_seeds=batch.sample_seeds)

    def _rollout_metrics(self, r: dict[str, Any], G: int) -> tuple[dict[str, float], dict[str, float]]:
        """Sums (and their counts) of what the rollouts scored, so the trainer averages them over the window."""
        rewards, per_reward = r["rewards"], r["per_reward"]
        n, groups = rewards.numel(), rewards.view(-1, G)
        group_std = groups.std(dim=1) if G > 1 else torch.zeros(groups.shape[0])
        metrics = {
            "reward": float(rewards.sum()), "reward/sq": float((rewards**2).sum()),
            "reward_std": float(group_std.sum()),
            "frac_reward_zero_std": float((group_std < 1e-6).sum()),
            "completions/mean_length": float(sum(len(c) for c in r["completions"])),
            "completions/clipped_ratio": float(sum(r["truncated"])),
        }
        counts = {"reward": n, "reward/sq": n, "reward_std": groups.shape[0], "frac_reward_zero_std": groups.shape[0],
                  "completions/mean_length": n, "completions/clipped_ratio": n}
        for k, name in enumerate(self.rollouts.reward_names):
            values = per_reward[:, k]
            scored = ~torch.isnan(values)
            key = f"rewards/{name}"
            metrics[f"{key}/mean"] = float(values[scored].sum())
            metrics[f"{key}/sq"] = float((values[scored] ** 2).sum())
            counts[f"{key}/mean"] = counts[f"{key}/sq"] = int(scored.sum())
        return metrics, counts

    def _keep_samples(self, r: dict[str, Any]) -> None:
        self.samples = [
            {"prompt": r["prompt_texts"][b], "completion": text, "reward": round(float(reward), 4)}
            for b, text, reward in list(zip(r["owners"], r["texts"], r["rewards"].tolist(), strict=True))[:SAMPLES_LOGGED]
        ]

    # ---- the loss -----------------------------------------------------------------------------------------
    def count(self, batch: Batch) -> int:
        return int(batch.targets["units"])

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

    def finish_metrics(self, means: dict[str, float], *, evaluating: bool) -> dict[str, float]:
        """Standard deviations from the means of squares (over the logged window); the latest samples."""
        out = {k: v for k, v in means.items() if not k.endswith("/sq")}
        for key, square in means.items():
            if key.endswith("/sq"):
                base = key.removesuffix("/sq")
                mean = means.get(f"{base}/mean", means.get(base))
                if mean is not None:
                    out[f"{base}/std" if base != "reward" else "reward_std_all"] = math.sqrt(max(square - mean**2, 0.0))
        if not evaluating and self.samples:
            out["samples"] = self.samples
        return out
