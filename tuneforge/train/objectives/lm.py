"""Next-token cross-entropy (pt, sft): summed over supervised tokens without an fp32 copy of all logits.

The loss sum is the sum of token_logps.token_losses (minus the log-probs; smoothed with label_smoothing_factor;
or sft_losses' dft / eaft / asft), from the one chunked log-prob path (fused decoder + head, or the model's own forward with logits_to_keep; see that
module for the memory figures).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tuneforge.batch import Batch, position_samples
from tuneforge.train.objectives import ObjectiveOutput
from tuneforge.train.objectives.reference import Reference
from tuneforge.train.objectives.sft_losses import TokenLoss
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

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

logger = logging.getLogger(__name__)


class LMObjective:
    """Next-token cross-entropy, or another per-token loss of sft_losses; the unit is one supervised (shifted label
    != -100) token."""

    name = "lm"

    def __init__(self, head: str = "auto", chunk_tokens: int | None = None, label_smoothing: float = 0.0,
                 accuracy: bool = False, loss: TokenLoss | None = None, reference: Reference | None = None) -> None:
        """head: "fused", "forward" or "auto" (see token_logps). chunk_tokens: rows per fp32 chunk (default:
        CHUNK_ELEMENTS / vocab size). label_smoothing: transformers' label_smoothing_factor (the same as
        loss=TokenLoss(label_smoothing=...)). loss: the per-token loss, in training and evaluation alike (as
        transformers' Trainer applies its loss function in both); any but plain cross-entropy is no mean negative
        log-likelihood, so evaluation then reports no perplexity. reference: the starting model, for asft's KL.
        accuracy: evaluation also reports `accuracy`, the share of each sample's targets that are its most likely
        token, averaged over samples (LlamaFactory's compute_accuracy)."""
        if head not in HEAD_PATHS:
            raise ValueError(f"head must be one of {HEAD_PATHS}, not {head!r}")
        self.loss = loss or TokenLoss(label_smoothing=label_smoothing)
        if self.loss.needs_reference and reference is None:
            raise ValueError(f"the {self.loss.kind} loss needs a reference model")
        self.head = head
        self.chunk_tokens = chunk_tokens
        self.reference = reference
        self.reports_perplexity = self.loss.is_nll
        self.accuracy = accuracy

    @classmethod
    def from_config(cls, cfg: RunConfig, reference: Reference | None = None) -> LMObjective:
        return cls(loss=token_loss(cfg), accuracy=cfg.train.compute_accuracy, reference=reference)

    def count(self, batch: Batch) -> int:
        return int(supervised_positions(batch).sum())

    def __call__(self, model: torch.nn.Module, batch: Batch) -> ObjectiveOutput:
        hits: list[torch.Tensor] | None = [] if self.accuracy and not torch.is_grad_enabled() else None
        ref = self.reference.target_rows(model, batch) if self.loss.needs_reference else None
        losses = token_losses(model, batch, self.head, self.chunk_tokens, self.loss, hits, ref)
        if not hits:
            return ObjectiveOutput(loss_sum=losses.sum())
        share, samples = sample_accuracy(torch.cat(hits), target_samples(batch))
        return ObjectiveOutput(loss_sum=losses.sum(), metrics={"accuracy": share}, counts={"accuracy": samples})


def token_loss(cfg: RunConfig) -> TokenLoss:
    """The per-token loss cfg asks for (one of use_dft_loss / use_eaft_loss / use_asft_loss, checked when the config
    loaded; else cross-entropy with label_smoothing_factor)."""
    m = cfg.method
    if m.use_dft_loss:
        return TokenLoss("dft")
    if m.use_eaft_loss:
        return TokenLoss("eaft", alpha=m.eaft_alpha)
    if m.use_asft_loss:
        return TokenLoss("asft", alpha=m.asft_alpha)
    return TokenLoss(label_smoothing=cfg.train.label_smoothing_factor)


def target_samples(batch: Batch) -> torch.Tensor:
    """The sample of each supervised target (in supervised_targets' order): a row each when padded, else the
    samples a row holds, each starting at position 0."""
    if "sequence_ids" in batch.targets or batch.layout.shared_prefix:
        return target_owners(batch)
    keep, _ = supervised_targets(batch)
    ids = batch.model_inputs["input_ids"]
    if batch.layout.samples_share_rows:
        sample = position_samples(batch.model_inputs)
    else:
        sample = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    return sample[keep]


def sample_accuracy(hits: torch.Tensor, owners: torch.Tensor) -> tuple[float, int]:
    """(the sum over samples of each one's share of hits, the number of samples with targets)."""
    samples, at = torch.unique(owners, return_inverse=True)
    right = torch.zeros(len(samples), device=hits.device).index_add_(0, at, hits.float())
    total = torch.zeros(len(samples), device=hits.device).index_add_(0, at, torch.ones_like(hits, dtype=torch.float))
    return float((right / total).sum()), len(samples)
