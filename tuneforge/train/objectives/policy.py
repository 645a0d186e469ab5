"""The policy-gradient pieces of the RL objectives, each a small pure function of tensors.

Token tensors are flat, one entry per completion token that takes part in the loss, in token_logps' order;
`owners` names each token's completion (0 .. S-1).
"""

from __future__ import annotations

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
