"""Next-token cross-entropy (pt, sft): summed over supervised tokens without an fp32 copy of all logits.

The loss sum is the sum of token_logps.token_losses (minus the log-probs; smoothed with label_smoothing_factor),
from the one chunked log-prob path (fused decoder + head, or the model's own forward with logits_to_keep; see that
module for the memory figures).
"""

from __future__ import annotations

import logging

import torch

from tuneforge.batch import Batch
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.token_logps import (  # noqa: F401  (re-exported: lm's public names before)
    CHUNK_ELEMENTS,
    HEAD_PATHS,
    IGNORE_INDEX,
    can_fuse_head,
    partitioned_head,
    supervised_positions,
    token_logps,
    token_losses,
)

logger = logging.getLogger(__name__)


class LMObjective:
    """Next-token cross-entropy; the unit is one supervised (shifted label != -100) token."""

    name = "lm"

    def __init__(self, head: str = "auto", chunk_tokens: int | None = None, label_smoothing: float = 0.0) -> None:
        """head: "fused", "forward" or "auto" (see token_logps). chunk_tokens: rows per fp32 chunk (default:
        CHUNK_ELEMENTS / vocab size). label_smoothing: transformers' label_smoothing_factor, the smoothed
        cross-entropy in training and evaluation alike (as transformers' Trainer); the loss is then no mean
        negative log-likelihood, so evaluation reports no perplexity."""
        if head not in HEAD_PATHS:
            raise ValueError(f"head must be one of {HEAD_PATHS}, not {head!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), not {label_smoothing}")
        self.head = head
        self.chunk_tokens = chunk_tokens
        self.label_smoothing = label_smoothing
        self.reports_perplexity = label_smoothing == 0.0

    def count(self, batch: Batch) -> int:
        return int(supervised_positions(batch).sum())

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        losses = token_losses(model, batch, self.head, self.chunk_tokens, self.label_smoothing)
        return ObjectiveOutput(loss_sum=losses.sum())
