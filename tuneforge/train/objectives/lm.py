"""Next-token cross-entropy (pt, sft): summed over supervised tokens without an fp32 copy of all logits.

The loss sum is minus the sum of token_logps.token_logps, the one chunked log-prob path (fused decoder +
head, or the model's own forward with logits_to_keep; see that module for the memory figures).
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
)

logger = logging.getLogger(__name__)


class LMObjective:
    """Next-token cross-entropy; the unit is one supervised (shifted label != -100) token."""

    name = "lm"
    reports_perplexity = True

    def __init__(self, head: str = "auto", chunk_tokens: int | None = None) -> None:
        """head: "fused", "forward" or "auto" (see token_logps). chunk_tokens: rows per fp32 chunk (default:
        CHUNK_ELEMENTS / vocab size)."""
        if head not in HEAD_PATHS:
            raise ValueError(f"head must be one of {HEAD_PATHS}, not {head!r}")
        self.head = head
        self.chunk_tokens = chunk_tokens

    def count(self, batch: Batch) -> int:
        return int(supervised_positions(batch).sum())

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        logps = token_logps(model, batch, head=self.head, chunk_tokens=self.chunk_tokens)
        return ObjectiveOutput(loss_sum=torch.neg(logps).sum())
