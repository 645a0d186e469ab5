"""The rm stage's objective: a pairwise (Bradley–Terry) loss on the value head's scores.

The model is a tuneforge.model.value_head.ValueHeadModel (called, not imported: train does not import
model). Called with a batch's model_inputs and its `sequence_ends` target, it returns one fp32 score per sequence:
the value head at the sequence's last token. Chosen and rejected go through it in one forward pass
(S = 2B sequences, chosen first). The unit is a pair: count(batch) = S // 2.

Metrics (sums over pairs; the trainer divides by the pairs): rewards/chosen, rewards/rejected (the raw
scores r_c, r_r), rewards/margins (r_c − r_r), rewards/accuracies (r_c > r_r).
"""

from __future__ import annotations

import torch

from tuneforge.batch import Batch
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.logps import num_sequences
from tuneforge.train.objectives.losses import pairwise_reward_loss


class RewardObjective:
    """−log σ(r_c − r_r) per pair, r = the value head's score at each sequence's last token."""

    name = "rm"
    reports_perplexity = False

    def count(self, batch: Batch) -> int:
        return num_sequences(batch) // 2

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        scores = model(**batch.model_inputs, sequence_ends=batch.targets["sequence_ends"]).float()
        pairs = num_sequences(batch) // 2
        chosen, rejected = scores[:pairs], scores[pairs:]
        losses = pairwise_reward_loss(chosen, rejected)
        chosen, rejected = chosen.detach(), rejected.detach()
        metrics = {
            "rewards/chosen": chosen.sum(),
            "rewards/rejected": rejected.sum(),
            "rewards/accuracies": (chosen > rejected).float().sum(),
            "rewards/margins": (chosen - rejected).sum(),
        }
        return ObjectiveOutput(loss_sum=losses.sum(), metrics=metrics)
