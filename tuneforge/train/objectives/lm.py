"""Next-token cross-entropy (pt, sft): summed over supervised tokens without an fp32 copy of all logits.

The loss sum is the sum of token_logps.token_losses (minus the log-probs; smoothed with label_smoothing_factor),
from the one chunked log-prob path (fused decoder + head, or the model's own forward with logits_to_keep; see that
module for the memory figures).
"""

from __future__ import annotations

import logging

import torch

from tuneforge.batch import Batch, text_positions
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.token_logps import (  # noqa: F401  (re-exported: lm's public names before)
    CHUNK_ELEMENTS,
    HEAD_PATHS,
    IGNORE_INDEX,
    can_fuse_head,
    partitioned_head,
    supervised_positions,
    supervised_targets,
    target_owners,
    token_logps,
    token_losses,
)

logger = logging.getLogger(__name__)


class LMObjective:
    """Next-token cross-entropy; the unit is one supervised (shifted label != -100) token."""

    name = "lm"

    def __init__(self, head: str = "auto", chunk_tokens: int | None = None, label_smoothing: float = 0.0,
                 accuracy: bool = False) -> None:
        """head: "fused", "forward" or "auto" (see token_logps). chunk_tokens: rows per fp32 chunk (default:
        CHUNK_ELEMENTS / vocab size). label_smoothing: transformers' label_smoothing_factor, the smoothed
        cross-entropy in training and evaluation alike (as transformers' Trainer); the loss is then no mean
        negative log-likelihood, so evaluation reports no perplexity. accuracy: evaluation also reports `accuracy`,
        the share of each sample's targets that are its most likely token, averaged over samples (LlamaFactory's
        compute_accuracy)."""
        if head not in HEAD_PATHS:
            raise ValueError(f"head must be one of {HEAD_PATHS}, not {head!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), not {label_smoothing}")
        self.head = head
        self.chunk_tokens = chunk_tokens
        self.label_smoothing = label_smoothing
        self.reports_perplexity = label_smoothing == 0.0
        self.accuracy = accuracy

    def count(self, batch: Batch) -> int:
        return int(supervised_positions(batch).sum())

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        hits: list[torch.Tensor] | None = [] if self.accuracy and not torch.is_grad_enabled() else None
        losses = token_losses(model, batch, self.head, self.chunk_tokens, self.label_smoothing, hits)
        if not hits:
            return ObjectiveOutput(loss_sum=losses.sum())
        share, samples = sample_accuracy(torch.cat(hits), target_samples(batch))
        return ObjectiveOutput(loss_sum=losses.sum(), metrics={"accuracy": share}, counts={"accuracy": samples})


def target_samples(batch: Batch) -> torch.Tensor:
    """The sample of each supervised target (in supervised_targets' order): a row each when padded, else the
    samples a row holds, each starting at position 0."""
    if "sequence_ids" in batch.targets or batch.layout.shared_prefix:
        return target_owners(batch)
    keep, _ = supervised_targets(batch)
    ids = batch.model_inputs["input_ids"]
    if batch.layout.samples_share_rows:
        starts = text_positions(batch.model_inputs) == 0
        sample = starts.flatten().cumsum(0).view_as(starts)
    else:
        sample = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    return sample[keep]


def sample_accuracy(hits: torch.Tensor, owners: torch.Tensor) -> tuple[float, int]:
    """(the sum over samples of each one's share of hits, the number of samples with targets)."""
    samples, at = torch.unique(owners, return_inverse=True)
    right = torch.zeros(len(samples), device=hits.device).index_add_(0, at, hits.float())
    total = torch.zeros(len(samples), device=hits.device).index_add_(0, at, torch.ones_like(hits, dtype=torch.float))
    return float((right / total).sum()), len(samples)
