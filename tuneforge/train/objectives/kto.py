"""The kto stage's objective on feedback batches.

A collated feedback batch holds S = 2B sequences, completion_0 … completion_{B-1} then kl_0 … kl_{B-1}
(the same prompt with another row's completion), all in one forward pass, and `kto_tags` (B,): 1 for a
desirable completion, 0 for an undesirable one. The unit is a sample: count(batch) = B.

z, the KL estimate, is the mean over the batch's KL pairs of log π_kl − log ref_kl, detached and clamped
at 0. While training under torch.distributed its sum and count are all-reduced, so z is the whole
batch's. During evaluation (model.eval()) it stays per rank: the trainer's ranks may then run different
numbers of eval batches, and a collective call that one rank skips would hang the others.

Metrics: rewards/chosen and logps/chosen (β·log π/ref and log π of the completion) summed over the
desirable samples, rewards/rejected and logps/rejected over the undesirable ones, each with its count
in ObjectiveOutput.counts (the trainer averages over those); kl is z × B, so it averages to z. Every key
is emitted for every batch, zero when it has no sample of a kind, since ranks all-reduce one key list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tuneforge.batch import Batch
from tuneforge.errors import ConfigError
from tuneforge.stages import preference_problem
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.logps import num_sequences, sequence_logps
from tuneforge.train.objectives.losses import kto_kl_estimate, kto_loss
from tuneforge.train.objectives.reference import Reference, batch_reference_logps

if TYPE_CHECKING:
    from tuneforge.config import RunConfig


def summed_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """values summed element-wise over all ranks (unchanged in a single process)."""
    if dist.is_available() and dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values)
    return values


class KTOObjective:
    """KTO on feedback batches; the unit is a sample (a completion with its desirable / undesirable tag)."""

    name = "kto"
    reports_perplexity = False

    def __init__(
        self,
        pref_beta: float = 0.1,
        kto_chosen_weight: float = 1.0,
        kto_rejected_weight: float = 1.0,
        reference: Reference | None = None,
        head: str = "auto",
        chunk_tokens: int | None = None,
    ) -> None:
        # config validation has checked these (stages.preference_problem); this catches a direct call
        problem = preference_problem(pref_beta=pref_beta, kto_chosen_weight=kto_chosen_weight,
                                     kto_rejected_weight=kto_rejected_weight)
        if problem:
            raise ConfigError(problem)
        self.pref_beta = pref_beta
        self.kto_chosen_weight, self.kto_rejected_weight = kto_chosen_weight, kto_rejected_weight
        self.reference = reference
        self.head, self.chunk_tokens = head, chunk_tokens

    @classmethod
    def from_config(cls, cfg: RunConfig, reference: Reference | None = None) -> KTOObjective:
        return cls(
            pref_beta=cfg.method.pref_beta,
            kto_chosen_weight=cfg.method.kto_chosen_weight,
            kto_rejected_weight=cfg.method.kto_rejected_weight,
            reference=reference,
        )

    def count(self, batch: Batch) -> int:
        return num_sequences(batch) // 2

    def kl_estimate(self, kl_log_ratios: torch.Tensor, training: bool) -> torch.Tensor:
        """z of the batch (all ranks' KL pairs while training)."""
        totals = torch.stack([kl_log_ratios.detach().float().sum(), kl_log_ratios.new_tensor(len(kl_log_ratios))])
        if training:
            totals = summed_over_ranks(totals)
        return kto_kl_estimate(totals[0], float(totals[1]))

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        policy = sequence_logps(model, batch, head=self.head, chunk_tokens=self.chunk_tokens).logps
        ref = batch_reference_logps(self.reference, model, batch, "stage kto")
        samples = num_sequences(batch) // 2
        desirable = batch.targets["kto_tags"].to(policy.device).bool()
        z = self.kl_estimate(policy[samples:] - ref[samples:], model.training)
        losses, rewards = kto_loss(
            policy[:samples], ref[:samples], z, desirable,
            self.pref_beta, self.kto_chosen_weight, self.kto_rejected_weight,
        )
        completion_logps = policy[:samples].detach().float()
        undesirable = ~desirable
        chosen_count, rejected_count = desirable.sum().float(), undesirable.sum().float()
        metrics = {
            "rewards/chosen": rewards[desirable].sum(),
            "rewards/rejected": rewards[undesirable].sum(),
            "logps/chosen": completion_logps[desirable].sum(),
            "logps/rejected": completion_logps[undesirable].sum(),
            "kl": z * samples,
        }
        counts = {
            "rewards/chosen": chosen_count,
            "logps/chosen": chosen_count,
            "rewards/rejected": rejected_count,
            "logps/rejected": rejected_count,
        }
        return ObjectiveOutput(loss_sum=losses.sum(), metrics=metrics, counts=counts)
