"""Per-sequence log-probabilities of a collated pairwise / feedback batch, without all the logits at once.

A preference batch holds S sequences (chosen then rejected, or completion then KL), padded (S, T) or
padding-free (1, N); `sequence_ids` names the sequence of every token. In a shared-prompt batch (the two
sequences of a row share one copy of their prompt) the targets are listed explicitly instead:
`target_positions` (the hidden state predicting each), `target_ids` and `target_sequences`. For each sequence this sums
log p(token) over its supervised targets (next-token, as lm.supervised_positions defines them) and
counts those targets. The token log-probs come from the one chunked path (token_logps.py), so only one
chunk of logits ever exists; the backward pass recomputes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tuneforge.batch import Batch
from tuneforge.train.objectives.token_logps import target_owners, token_logps


@dataclass
class SequenceLogps:
    """logps: (S,) fp32, the summed log-prob of each sequence's supervised tokens (carries the graph).
    counts: (S,) fp32, the number of those tokens."""

    logps: torch.Tensor
    counts: torch.Tensor

    def average(self) -> torch.Tensor:
        """Length-normalized log-probs (mean per supervised token; a sequence without targets gives 0)."""
        return self.logps / self.counts.clamp(min=1.0)


def num_sequences(batch: Batch) -> int:
    """S, the sequences of a collated pairwise / feedback batch (one end index per sequence)."""
    return int(batch.targets["sequence_ends"].shape[0])


def sequence_logps(model: torch.nn.Module, batch: Batch, head: str = "auto", chunk_tokens: int | None = None) -> SequenceLogps:
    """Summed log-probs and target counts of the S sequences of a collated pairwise / feedback batch.

    The token log-probs come from token_logps.token_logps (head, chunk_tokens as there); each is added to
    the sequence that owns its target."""
    logps = token_logps(model, batch, head=head, chunk_tokens=chunk_tokens)
    owners = target_owners(batch)
    count = num_sequences(batch)
    summed = logps.new_zeros(count).index_add(0, owners, logps)
    counts = torch.bincount(owners, minlength=count).to(device=summed.device, dtype=torch.float32)
    return SequenceLogps(logps=summed, counts=counts)
