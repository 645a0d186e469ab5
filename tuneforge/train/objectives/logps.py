"""Per-sequence log-probabilities of a collated pairwise / feedback batch, without all the logits at once.

A preference batch holds S sequences (chosen then rejected, or completion then KL), padded (S, T) or
padding-free (1, N); `sequence_ids` names the sequence of every token. In a shared-prompt batch (the two
sequences of a row share one copy of their prompt) the targets are listed explicitly instead:
`target_positions` (the hidden state predicting each), `target_ids` and `target_sequences`. For each sequence this sums
log p(token) over its supervised targets (next-token, as lm.supervised_positions defines them) and
counts those targets. The vocabulary projection, log_softmax and gather run in fp32 chunks under
activation checkpointing (as lm.py's cross-entropy does), so only one chunk of logits ever exists; the
backward pass recomputes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tuneforge.train.objectives.lm import (
    CHUNK_ELEMENTS,
    HEAD_PATHS,
    MODEL_INPUTS,
    _accepts_logits_to_keep,
    can_fuse_head,
    partitioned_head,
    supervised_positions,
)


@dataclass
class SequenceLogps:
    """logps: (S,) fp32, the summed log-prob of each sequence's supervised tokens (carries the graph).
    counts: (S,) fp32, the number of those tokens."""

    logps: torch.Tensor
    counts: torch.Tensor

    def average(self) -> torch.Tensor:
        """Length-normalized log-probs (mean per supervised token; a sequence without targets gives 0)."""
        return self.logps / self.counts.clamp(min=1.0)


def num_sequences(batch: Mapping[str, torch.Tensor]) -> int:
    """S, the sequences of a collated pairwise / feedback batch (one end index per sequence)."""
    return int(batch["sequence_ends"].shape[0])


def _logits_token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(logits.float(), targets, reduction="none")


def _head_token_logps(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(head(hidden).float(), targets, reduction="none")


def chunked_token_logps(
    head: torch.nn.Module | None, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """log p(target) of each of n rows, (n,) fp32; rows are hidden states (head given) or logits (head None).

    Each chunk is projected (when head is given), log-softmaxed in fp32 and gathered under checkpointing:
    only its (n,) result is kept for backward, never the (chunk, vocab) logits.
    """
    if rows.shape[0] == 0:  # keep the graph so a batch without targets still back-propagates
        projected = head(rows) if head is not None else rows
        return projected.float().sum(dim=-1) * 0.0
    recompute = torch.is_grad_enabled()
    pieces = []
    for start in range(0, rows.shape[0], chunk_tokens):
        chunk, chunk_targets = rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if head is not None:
            args = (_head_token_logps, head, chunk, chunk_targets)
        else:
            args = (_logits_token_logps, chunk, chunk_targets)
        pieces.append(checkpoint(*args, use_reentrant=False) if recompute else args[0](*args[1:]))
    return torch.cat(pieces)


def sequence_logps(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    head: str = "auto",
    chunk_tokens: int | None = None,
) -> SequenceLogps:
    """Summed log-probs and target counts of the S sequences of a collated pairwise / feedback batch.

    head: "fused" (decoder + the output embedding, projected in chunks), "forward" (the model's own
    forward with a boolean logits_to_keep, for heads that transform logits and for wrappers) or "auto"
    (fused when lm.can_fuse_head(model)). Works on peft-wrapped models (their decoder holds the adapters).
    """
    if head not in HEAD_PATHS:
        raise ValueError(f"head must be one of {HEAD_PATHS}, not {head!r}")
    if "target_positions" in batch:  # shared prompts: one position may predict targets of two sequences
        keep = (0, batch["target_positions"])
        targets, owners = batch["target_ids"], batch["target_sequences"]
    else:
        keep = supervised_positions(batch)
        targets = batch["labels"][:, 1:][keep[:, :-1]]
        # the position that predicts a target is in the target's own sequence (boundaries are never targets)
        owners = batch["sequence_ids"][keep]
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if head == "fused" or (head == "auto" and can_fuse_head(model) and not partitioned_head(model)):
        projection = model.get_output_embeddings()
        hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state[keep]
        vocab = projection.weight.shape[0] if hasattr(projection, "weight") else model.config.vocab_size
        token_logps = chunked_token_logps(projection, hidden, targets, _chunk(chunk_tokens, vocab))
    else:
        explicit = isinstance(keep, tuple)
        if _accepts_logits_to_keep(model):
            logits = model(**inputs, logits_to_keep=keep[1] if explicit else keep, use_cache=False).logits
            if explicit:  # (1, targets, vocab): the kept positions, in target order
                logits = logits[0]
        else:
            logits = model(**inputs, use_cache=False).logits
        if logits.dim() == 3:  # the model returned every position
            logits = logits[keep]
        token_logps = chunked_token_logps(None, logits, targets, _chunk(chunk_tokens, logits.shape[-1]))
    count = num_sequences(batch)
    logps = token_logps.new_zeros(count).index_add(0, owners, token_logps)
    counts = torch.bincount(owners, minlength=count).to(device=logps.device, dtype=torch.float32)
    return SequenceLogps(logps=logps, counts=counts)


def _chunk(chunk_tokens: int | None, vocab_size: int) -> int:
    return chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_size)
