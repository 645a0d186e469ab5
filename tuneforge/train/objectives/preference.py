"""The dpo stage's objective: one of the preference losses of tuneforge/stages.py's PREF_LOSSES table (DPO
(sigmoid), hinge, IPO, ORPO, SimPO, or a registered one) on pairwise batches.

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

from typing import TYPE_CHECKING, Any

import torch

from tuneforge.batch import Batch
from tuneforge.errors import ConfigError
from tuneforge.stages import PREF_LOSSES, preference_problem
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.logps import num_sequences, sequence_logps
from tuneforge.train.objectives.losses import PairLosses
from tuneforge.train.objectives.reference import Reference, batch_reference_logps

if TYPE_CHECKING:
    from tuneforge.config import RunConfig


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
    """A pref_loss of the PREF_LOSSES table on pairwise batches; the unit is a pair."""

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
        options: dict[str, Any] | None = None,
    ) -> None:
        """pref_ftx adds pref_ftx × NLL(chosen) (the chosen completion's mean per-token negative log-likelihood)
        to every pair's loss, whatever the pref_loss. reference: needed (unless the batches carry ref_logps)
        for the losses that need one; the others ignore it. head, chunk_tokens: as in logps.sequence_logps.
        options: values of further config keys a registered loss takes (its row's `options`).

        Config validation has checked these values (stages.preference_problem); checking them again here
        only catches a direct call with bad values."""
        problem = preference_problem(pref_loss=pref_loss, pref_beta=pref_beta, pref_ftx=pref_ftx,
                                     simpo_gamma=simpo_gamma, dpo_label_smoothing=dpo_label_smoothing)
        if problem:
            raise ConfigError(problem)
        self.pref_loss, self.pref_beta, self.pref_ftx = pref_loss, pref_beta, pref_ftx
        self.simpo_gamma, self.dpo_label_smoothing = simpo_gamma, dpo_label_smoothing
        self.loss = PREF_LOSSES[pref_loss]
        settings = {"dpo_label_smoothing": dpo_label_smoothing, "simpo_gamma": simpo_gamma, **(options or {})}
        missing = [key for key in self.loss.options if key not in settings]
        if missing:
            raise ConfigError(f"pref_loss {pref_loss} takes {', '.join(missing)}, which were not given")
        self.loss_options = {keyword: settings[key] for key, keyword in self.loss.options.items()}
        self.reference = reference if self.loss.needs_reference else None
        self.head, self.chunk_tokens = head, chunk_tokens

    @classmethod
    def from_config(cls, cfg: RunConfig, reference: Reference | None = None) -> PreferenceObjective:
        keys = cfg.to_dict()
        return cls(
            options={key: keys[key] for key in PREF_LOSSES[cfg.method.pref_loss].options},
            pref_loss=cfg.method.pref_loss,
            pref_beta=cfg.method.pref_beta,
            pref_ftx=cfg.method.pref_ftx,
            simpo_gamma=cfg.method.simpo_gamma,
            dpo_label_smoothing=cfg.method.dpo_label_smoothing,
            reference=reference,
        )

    @property
    def needs_reference(self) -> bool:
        return self.loss.needs_reference

    def count(self, batch: Batch) -> int:
        return num_sequences(batch) // 2

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        policy = sequence_logps(model, batch, head=self.head, chunk_tokens=self.chunk_tokens)
        pairs = num_sequences(batch) // 2
        averages = policy.average()
        ref = batch_reference_logps(self.reference, model, batch, "stage dpo") if self.needs_reference else None
        normalized = self.loss.length_normalized
        logps = averages if normalized else policy.logps
        chosen, rejected = logps[:pairs], logps[pairs:]
        function = self.loss.resolve()
        if ref is not None:
            if normalized:
                ref = ref / policy.counts.clamp(min=1.0)  # same tokens, same counts as the policy
            result = function(chosen, rejected, ref[:pairs], ref[pairs:], self.pref_beta, **self.loss_options)
        else:
            result = function(chosen, rejected, self.pref_beta, **self.loss_options)
        losses = result.losses
        if self.pref_ftx > 0:
            losses = losses - self.pref_ftx * averages[:pairs]  # + ftx · NLL(chosen)
        return ObjectiveOutput(loss_sum=losses.sum(), metrics=pair_metrics(result, chosen, rejected))
