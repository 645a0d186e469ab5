"""The dpo stage's objective: DPO (sigmoid), hinge, IPO, ORPO and SimPO on pairwise batches.

A collated pairwise batch holds S = 2B sequences, chosen_0 … chosen_{B-1} then rejected_0 … rejected_{B-1},
all run through the model in one forward pass. The unit is a pair: count(batch) = S // 2, loss_sum = the
sum of the per-pair losses (each a pure function in losses.py).

Metrics (sums over pairs; the trainer divides by the pairs), under TRL / LlamaFactory's names:
rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies (chosen reward > rejected reward),
logps/chosen, logps/rejected. The rewards are β × log π/ref of each completion for sigmoid and hinge
(log-probs summed over the completion), β × the same of the per-token average log-probs for ipo, and
β × the average log-probs of the policy for orpo / simpo, which have no reference. logps/* are the policy
log-probs the loss reads: summed for sigmoid / hinge, per-token averages for ipo / orpo / simpo.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from tuneforge.config.schema import PREF_LOSSES, REFERENCE_FREE_LOSSES
from tuneforge.errors import ConfigError
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.logps import num_sequences, sequence_logps
from tuneforge.train.objectives.losses import (
    PairLosses,
    dpo_hinge_loss,
    dpo_sigmoid_loss,
    ipo_loss,
    orpo_loss,
    simpo_loss,
)
from tuneforge.train.objectives.reference import Reference, batch_reference_logps

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

LENGTH_NORMALIZED = ("ipo", "orpo", "simpo")


def pair_metrics(result: PairLosses, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> dict:
    """The metrics of a batch of pairs, each summed over the pairs."""
    chosen, rejected = result.chosen_rewards.float(), result.rejected_rewards.float()
    return {
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
        "rewards/accuracies": (chosen > rejected).float().sum(),
        "rewards/margins": (chosen - rejected).sum(),
        "logps/chosen": chosen_logps.detach().float().sum(),
        "logps/rejected": rejected_logps.detach().float().sum(),
    }


class PreferenceObjective:
    """pref_loss sigmoid | hinge | ipo | orpo | simpo on pairwise batches; the unit is a pair."""

    name = "dpo"
    reports_perplexity = False

    def __init__(
        self,
        pref_loss: str = "sigmoid",
        pref_beta: float = 0.1,
        pref_ftx: float = 0.0,
        simpo_gamma: float = 0.5,
        dpo_label_smoothing: float = 0.0,
        reference: Reference | None = None,
        head: str = "auto",
        chunk_tokens: int | None = None,
    ) -> None:
        """pref_ftx adds pref_ftx × NLL(chosen) (the chosen completion's mean per-token negative log-likelihood)
        to every pair's loss, whatever the pref_loss. reference: needed (unless the batches carry ref_logps)
        for sigmoid / hinge / ipo; orpo / simpo ignore it. head, chunk_tokens: as in logps.sequence_logps."""
        if pref_loss not in PREF_LOSSES:
            raise ConfigError(f"pref_loss '{pref_loss}' is not one of {', '.join(PREF_LOSSES)}")
        if pref_beta <= 0:
            raise ConfigError(f"pref_beta must be > 0 (got {pref_beta})")
        if pref_ftx < 0:
            raise ConfigError(f"pref_ftx must be >= 0 (got {pref_ftx})")
        if not 0 <= dpo_label_smoothing < 0.5:
            raise ConfigError(f"dpo_label_smoothing must be in [0, 0.5) (got {dpo_label_smoothing})")
        if dpo_label_smoothing and pref_loss != "sigmoid":
            raise ConfigError(
                f"dpo_label_smoothing applies to pref_loss sigmoid only, not {pref_loss}; set it to 0"
            )
        self.pref_loss, self.pref_beta, self.pref_ftx = pref_loss, pref_beta, pref_ftx
        self.simpo_gamma, self.dpo_label_smoothing = simpo_gamma, dpo_label_smoothing
        self.reference = None if pref_loss in REFERENCE_FREE_LOSSES else reference
        self.head, self.chunk_tokens = head, chunk_tokens

    @classmethod
    def from_config(cls, cfg: RunConfig, reference: Reference | None = None) -> PreferenceObjective:
        return cls(
            pref_loss=cfg.method.pref_loss,
            pref_beta=cfg.method.pref_beta,
            pref_ftx=cfg.method.pref_ftx,
            simpo_gamma=cfg.method.simpo_gamma,
            dpo_label_smoothing=cfg.method.dpo_label_smoothing,
            reference=reference,
        )

    @property
    def needs_reference(self) -> bool:
        return self.pref_loss not in REFERENCE_FREE_LOSSES

    def count(self, batch: Mapping[str, torch.Tensor]) -> int:
        return num_sequences(batch) // 2

    def __call__(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> ObjectiveOutput:
        policy = sequence_logps(model, batch, head=self.head, chunk_tokens=self.chunk_tokens)
        pairs = num_sequences(batch) // 2
        averages = policy.average()
        ref = batch_reference_logps(self.reference, model, batch, "stage dpo") if self.needs_reference else None
        normalized = self.pref_loss in LENGTH_NORMALIZED
        logps = averages if normalized else policy.logps
        chosen, rejected = logps[:pairs], logps[pairs:]
        if self.pref_loss == "sigmoid":
            result = dpo_sigmoid_loss(
                chosen, rejected, ref[:pairs], ref[pairs:], self.pref_beta, self.dpo_label_smoothing
            )
        elif self.pref_loss == "hinge":
            result = dpo_hinge_loss(chosen, rejected, ref[:pairs], ref[pairs:], self.pref_beta)
        elif self.pref_loss == "ipo":
            ref_averages = ref / policy.counts.clamp(min=1.0)  # same tokens, same counts as the policy
            result = ipo_loss(chosen, rejected, ref_averages[:pairs], ref_averages[pairs:], self.pref_beta)
        elif self.pref_loss == "orpo":
            result = orpo_loss(chosen, rejected, self.pref_beta)
        else:
            result = simpo_loss(chosen, rejected, self.pref_beta, self.simpo_gamma)
        losses = result.losses
        if self.pref_ftx > 0:
            losses = losses - self.pref_ftx * averages[:pairs]  # + ftx · NLL(chosen)
        return ObjectiveOutput(loss_sum=losses.sum(), metrics=pair_metrics(result, chosen, rejected))
