"""The policy-gradient pieces of the RL objectives (grpo, ppo), each a small pure function of tensors.

Token tensors are flat, one entry per completion token that takes part in the loss, in token_logps' order;
`owners` names each token's completion (0 .. S-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STD_FLOOR = 1e-4  # added to a reward standard deviation before dividing by it (a group of equal rewards has 0)
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, batch_std: float | None = None) -> torch.Tensor:
    """(S,) advantages of S = groups x group_size rewards, each group's completions consecutive: the reward minus
    its group's mean, divided by the group's standard deviation (scale "group"), by batch_std (scale "batch": the
    standard deviation of every reward of the step, over all processes) or not at all ("none")."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (groups.std(dim=1, keepdim=True) + STD_FLOOR)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("scale 'batch' needs the standard deviation of the whole batch's rewards")
        centred = centred / (batch_std + STD_FLOOR)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, not {scale!r}")
    return centred.reshape(-1)


def clipped_surrogate(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped) of PPO's clipped objective: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
    with r = exp(logps - old_logps). clipped: where the clipped term is the smaller one (its gradient is 0)."""
    ratio = torch.exp(logps - old_logps)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages
    return -torch.min(unclipped, clipped), clipped < unclipped


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy: exp(d) - d - 1, d = ref - policy
    (Schulman's k3: unbiased, never negative)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def loss_units(loss_type: str, num_sequences: int, num_tokens: int) -> int:
    """The units one micro-batch of S completions with n loss tokens counts for this loss_type (see aggregate)."""
    return {"grpo": num_sequences, "dr_grpo": num_sequences, "dapo": num_tokens, "bnpo": 1}[loss_type]


def aggregate(
    token_losses: torch.Tensor, owners: torch.Tensor, num_sequences: int, loss_type: str, max_completion_length: int
) -> torch.Tensor:
    """The loss sum of one micro-batch, so that the trainer's sum over micro-batches and ranks divided by the sum
    of loss_units is the loss_type's mean:

    grpo: each completion's mean token loss, averaged over completions (unit: a completion).
    dr_grpo: token losses summed per completion and divided by max_completion_length (unit: a completion).
    dapo: every token of the step weighs the same (unit: a token).
    bnpo: the mean token loss of each micro-batch, averaged over micro-batches (unit: a micro-batch), so it
        depends on per_device_train_batch_size, as defined."""
    if loss_type == "grpo":
        per_sequence = token_losses.new_zeros(num_sequences).index_add(0, owners, token_losses)
        lengths = torch.bincount(owners, minlength=num_sequences).clamp(min=1).to(token_losses.dtype)
        return (per_sequence / lengths).sum()
    if loss_type == "dr_grpo":
        return token_losses.sum() / max_completion_length
    if loss_type == "dapo":
        return token_losses.sum()
    if loss_type == "bnpo":
        return token_losses.sum() / max(token_losses.numel(), 1)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")


# ---- PPO ------------------------------------------------------------------------------------------------------
def per_sequence(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(S, T) rows of a flat token tensor whose sequences are consecutive (lengths each), zero-padded on the right."""
    return torch.nn.utils.rnn.pad_sequence(list(torch.split(flat, lengths)), batch_first=True)


def flatten(rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The inverse of per_sequence."""
    return torch.cat([row[:n] for row, n in zip(rows, lengths, strict=True)])


def kl_shaped_rewards(
    scores: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, lengths: list[int], kl_coef: float
) -> torch.Tensor:
    """Per-token rewards of PPO for RLHF: -kl_coef * (logp - ref_logp) at every completion token, plus the
    sequence's score at its last token. scores: (S,); the rest flat, sequences consecutive (lengths each)."""
    rewards = -kl_coef * (logps - ref_logps)
    ends = torch.tensor(lengths, device=rewards.device).cumsum(0) - 1
    return rewards.index_add(0, ends, scores.to(rewards.dtype))


def gae(rewards: torch.Tensor, values: torch.Tensor, lengths: list[int], gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), flat like the inputs: generalized advantage estimation over each completion,
    A_t = sum_k (gamma lam)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t, with V = 0 after the last token;
    returns = A + V (the value head's targets)."""
    r, v = per_sequence(rewards, lengths), per_sequence(values, lengths)  # the padding is 0: no value after the end
    advantages = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        next_value = v[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(running)
        running = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = flatten(advantages, lengths)
    return advantages, advantages + values


def whiten(values: torch.Tensor, mean: float, variance: float, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(variance + 1e-8), with the mean added back when not shift_mean (whitened rewards keep
    their sign). mean and variance are given: they are the whole step's, over every process."""
    whitened = (values - mean) * (variance + 1e-8) ** -0.5
    return whitened if shift_mean else whitened + mean


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped) of PPO's value loss: 0.5 max((V - R)^2, (clip(V, V_old ± clip) - R)^2).
    clipped: where the clipped term is the larger one."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    plain, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.max(plain, clipped), clipped > plain


def adaptive_kl_coef(coef: float, kl: float, target: float, steps: int, horizon: int) -> float:
    """The KL coefficient after one rollout of `steps` samples whose mean KL (summed over tokens) was kl: moved
    towards target by at most 20% of the error per horizon samples (Ziegler et al. 2019)."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return coef * (1 + error * steps / horizon)


@dataclass
class RunningMoments:
    """Mean and variance of every score seen so far (PPO's score normalization), merged batch by batch."""

    mean: float = 0.0
    variance: float = 1.0  # population variance
    count: float = 0.0

    def update(self, batch_mean: float, batch_variance: float, batch_count: float) -> None:
        """Merge a batch's mean, population variance and size (Chan et al.'s parallel formula)."""
        total = self.count + batch_count
        delta = batch_mean - self.mean
        squares = self.variance * self.count + batch_variance * batch_count + delta**2 * self.count * batch_count / total
        self.mean += delta * batch_count / total
        self.variance, self.count = squares / total, total

    @property
    def std(self) -> float:
        """The sample standard deviation (1 until there are two scores)."""
        return math.sqrt(self.variance * self.count / (self.count - 1)) if self.count > 1 else 1.0
