"""What the RL objectives (grpo, ppo) share: sampling and scoring completions of a micro-batch's prompts, the
rollout metrics they log, and statistics over every process of the step.

What an objective samples with comes from the workflow as a `Rollouts` (tuneforge/rollout.py), so train imports
neither infer nor data nor the rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from tuneforge.batch import Batch, Layout, sample_seed
from tuneforge.train.objectives.token_logps import IGNORE_INDEX

SAMPLES_LOGGED = 2  # completions shown in each trainer_log.jsonl line


class Rollouts(Protocol):
    """What an RL objective samples and scores with (built by the workflow: tuneforge/rollout.py)."""

    stop_token_ids: frozenset[int]
    reward_names: list[str]

    def __call__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], **overrides: Any) -> list[list[int]]:
        """Completions of token-id prompts (infer.generation.completion_generator; overrides as there, media=
        each prompt's stored media tensors)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def collate(self, groups: list[list[dict[str, list[int]]]], layout: Layout,
                media: Sequence[bytes | None] | None = None) -> tuple[dict, dict]:
        """Groups of sequences ({input_ids, labels}) that begin with the same prompt -> (model_inputs, targets):
        on one copy of each prompt under a shared-prefix layout (data.collate.Collator.groups); media: each
        group's prompt's stored media tensors, given to every sequence of the group."""
        ...

    def score(self, prompts: list[str], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(per_reward (n, k) with NaN where a reward had nothing to say, total (n,)): the weighted rewards."""
        ...


def moments_over_ranks(values: list[torch.Tensor]) -> tuple[float, float, int]:
    """(mean, Bessel-corrected variance, count) of every element of values, over all processes."""
    from tuneforge.train.trainer import sums_over_ranks

    every = torch.cat([v.reshape(-1) for v in values]).double()
    sums = sums_over_ranks({"x": {"n": every.numel(), "sum": float(every.sum()), "sq": float((every**2).sum())}},
                           every.device)["x"]
    n = int(sums["n"])
    if n == 0:
        return 0.0, 0.0, 0
    mean = sums["sum"] / n
    variance = (sums["sq"] - sums["sum"] ** 2 / n) / (n - 1) if n > 1 else 0.0
    return mean, max(variance, 0.0), n


class SamplingObjective:
    """The shared part of the RL objectives: `rollouts`, `num_generations` and `max_completion_length` set by the
    subclass; `samples` holds a few of the latest completions, for the log."""

    rollouts: Rollouts
    num_generations: int
    max_completion_length: int
    samples: list[dict[str, Any]]

    def _sample(self, model: torch.nn.Module, batch: Batch) -> dict[str, Any]:
        """num_generations completions of each prompt of the micro-batch, each from its own seeded generator (so it
        does not depend on the prompts beside it), decoded and scored."""
        G = self.num_generations
        prompts: list[list[int]] = batch.targets["prompt_ids"]
        row_seeds = batch.sample_seeds or tuple(range(len(prompts)))
        seeds = [sample_seed(row_seed, j) for row_seed in row_seeds for j in range(G)]
        completions = self.rollouts(model, prompts, num_return_sequences=G, max_new_tokens=self.max_completion_length,
                                    seeds=seeds, media=batch.targets.get("prompt_media"))
        owners = [b for b in range(len(prompts)) for _ in range(G)]  # the prompt of each completion
        prompt_texts = [self.rollouts.decode(p, skip_special_tokens=False) for p in prompts]
        texts = [self.rollouts.decode(c) for c in completions]
        columns = [batch.targets["columns"][b] for b in owners]
        device = next(model.parameters()).device
        per_reward, total = self.rollouts.score([prompt_texts[b] for b in owners], texts, columns, completions, device)
        truncated = [not c or c[-1] not in self.rollouts.stop_token_ids for c in completions]
        return {"prompts": prompts, "media": batch.targets.get("prompt_media"), "owners": owners,
                "completions": completions, "texts": texts,
                "prompt_texts": prompt_texts, "per_reward": per_reward.float(), "rewards": total.float(),
                "truncated": truncated}

    def _collate(self, model: torch.nn.Module, batch: Batch, r: dict[str, Any], *,
                 unlearned: Sequence[bool] | None = None) -> Batch:
        """The prompt + completion sequences of a micro-batch's rollout `r` (num_generations consecutive ones per
        prompt), the completion tokens as targets (none for a completion marked in `unlearned`), on the model's
        device; with a shared-prefix layout each prompt is computed once for its completions."""
        sequences = []
        for i, (b, completion) in enumerate(zip(r["owners"], r["completions"], strict=True)):
            prompt, learn = list(r["prompts"][b]), not (unlearned and unlearned[i])
            labels = [IGNORE_INDEX] * len(prompt) + (list(completion) if learn else [IGNORE_INDEX] * len(completion))
            sequences.append({"input_ids": prompt + list(completion), "labels": labels})
        G, layout = self.num_generations, Layout(rows="plain", flat=batch.layout.flat,
                                                 shared_prefix=batch.layout.shared_prefix)
        groups = [sequences[i : i + G] for i in range(0, len(sequences), G)]
        model_inputs, targets = self.rollouts.collate(groups, layout, media=r["media"])
        collated = Batch(model_inputs, targets, layout).to(next(model.parameters()).device)
        return replace(collated, num_tokens=sum(len(seq["input_ids"]) for seq in sequences))

    def count(self, batch: Batch) -> int:
        """The units prepare_step put in the batch (they are known only once the completions are)."""
        return int(batch.targets["units"])

    def _rollout_metrics(self, r: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
        """Sums (and their counts) of what the rollouts scored, so the trainer averages them over the window."""
        rewards, per_reward = r["rewards"], r["per_reward"]
        n = rewards.numel()
        metrics = {
            "reward": float(rewards.sum()), "reward/sq": float((rewards**2).sum()),
            "completions/mean_length": float(sum(len(c) for c in r["completions"])),
            "completions/clipped_ratio": float(sum(r["truncated"])),
        }
        counts = {key: n for key in metrics}
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
