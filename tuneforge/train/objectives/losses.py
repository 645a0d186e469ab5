"""The preference losses: small pure functions of per-sequence log-probabilities (or reward scores).

Each returns the per-pair (per-sample for KTO) losses and the rewards its metrics report. Inputs are
(B,) fp32 tensors: `*_logps` are log-probs summed over a completion's supervised tokens, `*_avg` the
same divided by the token count. β is pref_beta throughout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PairLosses(NamedTuple):
    losses: torch.Tensor  # (B,)
    chosen_rewards: torch.Tensor  # (B,)
    rejected_rewards: torch.Tensor  # (B,)


def dpo_sigmoid_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> PairLosses:
    """DPO: Δ = (log π_c − log ref_c) − (log π_r − log ref_r);
    loss = −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)  (ε = label_smoothing; ε = 0 is plain DPO).
    Rewards: β·(log π − log ref) of each completion."""
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    margin = chosen_rewards - rejected_rewards  # = βΔ
    losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return PairLosses(losses, chosen_rewards.detach(), rejected_rewards.detach())


def dpo_hinge_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> PairLosses:
    """SLiC hinge: loss = relu(1 − βΔ), Δ as in DPO. Rewards: β·(log π − log ref)."""
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    losses = torch.relu(1 - (chosen_rewards - rejected_rewards))
    return PairLosses(losses, chosen_rewards.detach(), rejected_rewards.detach())


def ipo_loss(
    policy_chosen_avg: torch.Tensor,
    policy_rejected_avg: torch.Tensor,
    ref_chosen_avg: torch.Tensor,
    ref_rejected_avg: torch.Tensor,
    beta: float,
) -> PairLosses:
    """IPO on length-normalized log-probs: Δ = (avg log π_c − avg log ref_c) − (avg log π_r − avg log ref_r);
    loss = (Δ − 1/(2β))². Rewards: β·(avg log π − avg log ref)."""
    chosen_ratio = policy_chosen_avg - ref_chosen_avg
    rejected_ratio = policy_rejected_avg - ref_rejected_avg
    losses = (chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2
    return PairLosses(losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, accurate near 0 (expm1) and for very negative x (log1p).

    x is clamped just below 0 so a completion of probability 1 gives a large finite value, not inf."""
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(policy_chosen_avg: torch.Tensor, policy_rejected_avg: torch.Tensor, beta: float) -> PairLosses:
    """ORPO (no reference): with p = exp(avg log π), log-odds(p) = log p − log(1 − p);
    loss = −avg log π_c − β·log σ(log-odds(p_c) − log-odds(p_r))  (β = λ, the odds-ratio weight).
    Rewards: β·avg log π."""
    log_odds = (policy_chosen_avg - policy_rejected_avg) - (
        log1mexp(policy_chosen_avg) - log1mexp(policy_rejected_avg)
    )
    losses = -policy_chosen_avg - beta * F.logsigmoid(log_odds)
    return PairLosses(losses, (beta * policy_chosen_avg).detach(), (beta * policy_rejected_avg).detach())


def simpo_loss(
    policy_chosen_avg: torch.Tensor, policy_rejected_avg: torch.Tensor, beta: float, gamma: float
) -> PairLosses:
    """SimPO (no reference): loss = −log σ(β·(avg log π_c − avg log π_r) − γ). Rewards: β·avg log π."""
    chosen_rewards, rejected_rewards = beta * policy_chosen_avg, beta * policy_rejected_avg
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return PairLosses(losses, chosen_rewards.detach(), rejected_rewards.detach())


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    kl: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    chosen_weight: float = 1.0,
    rejected_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO per sample: r = log π − log ref of the completion, z = kl (the batch's detached KL estimate);
    desirable: chosen_weight·(1 − σ(β(r − z))); undesirable: rejected_weight·(1 − σ(β(z − r))).
    Returns (losses (B,), rewards β·r (B,))."""
    log_ratio = policy_logps - ref_logps
    desirable_losses = chosen_weight * (1 - torch.sigmoid(beta * (log_ratio - kl)))
    undesirable_losses = rejected_weight * (1 - torch.sigmoid(beta * (kl - log_ratio)))
    losses = torch.where(desirable.bool(), desirable_losses, undesirable_losses)
    return losses, (beta * log_ratio).detach()


def kto_kl_estimate(kl_log_ratio_sum: torch.Tensor, kl_pairs: torch.Tensor | float) -> torch.Tensor:
    """z = max(0, mean over the batch's KL pairs of (log π_kl − log ref_kl)), detached.

    Takes the sum of the log-ratios and the number of pairs, so that the caller can add both up over ranks
    first (the mean of the whole distributed batch)."""
    return (kl_log_ratio_sum.detach() / max(float(kl_pairs), 1.0)).clamp(min=0)


def pairwise_reward_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Reward model (Bradley–Terry): loss = −log σ(r_c − r_r) per pair."""
    return -F.logsigmoid(chosen_scores - rejected_scores)
