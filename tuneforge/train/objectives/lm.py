"""Next-token cross-entropy (pt, sft): summed over supervised tokens without an fp32 copy of all logits.

The vocabulary projection dominates activation memory (49k-256k logits per token). Two paths:
- "fused" (default when the model allows it): run the decoder, keep the hidden states of positions whose
  next token is supervised, and project + cross-entropy them in fp32 chunks under activation checkpointing.
  Only one chunk of logits ever exists; backward recomputes it.
- "forward": call the model's own forward with a boolean `logits_to_keep` mask (transformers 5), so only
  supervised positions get logits, then fp32 cross-entropy in checkpointed chunks. Used for models whose
  head transforms logits (soft-capping, scaling) and for wrappers (DDP) that must see the top-level forward.

Measured on SmolLM2-135M, fp32, batch 4 x 512, half the tokens supervised, gradient checkpointing,
peak memory allocated during forward + backward: `model(labels=...)` 1301 MiB, "forward" 914 MiB,
"fused" 641 MiB; the gap grows with the number of supervised tokens (the fused peak stays one chunk).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tuneforge.train.objectives import ObjectiveOutput

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                "max_length_k", "shared_prefix")
# elements of one fp32 logits chunk: 2**25 floats = 128 MiB, ~680 tokens of a 49k vocabulary
CHUNK_ELEMENTS = 2**25
# config keys of heads that transform logits after the projection: those models use their own forward
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling")
HEAD_PATHS = ("auto", "fused", "forward")


def supervised_positions(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Boolean (batch, seq) mask of the positions whose *next* token is a supervised target.

    In packed rows (position_ids given) a position whose next token starts a new sample (position id 0)
    is never a target: no sample learns to predict the first token of another.
    """
    labels = batch["labels"]
    next_supervised = labels[:, 1:] != IGNORE_INDEX
    position_ids = batch.get("position_ids")
    if position_ids is not None:
        next_supervised = next_supervised & (position_ids[:, 1:] != 0)
    return F.pad(next_supervised, (0, 1), value=False)


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Sum of fp32 cross-entropy over rows of (n, vocab) logits, one checkpointed chunk at a time."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0  # keeps the graph so backward works on a batch without targets
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    for start in range(0, logits.shape[0], chunk_tokens):
        rows, row_targets = logits[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if recompute:
            total = total + checkpoint(_cross_entropy_sum, rows, row_targets, use_reentrant=False)
        else:
            total = total + _cross_entropy_sum(rows, row_targets)
    return total


def _head_cross_entropy_sum(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def weights_partitioned(module: torch.nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 partitions the module's weights (gathered only while the module runs).

    The "auto" head path then takes the model's own forward: a checkpointed chunk that calls the head would
    recompute it after ZeRO-3 released the weight again (the non-reentrant checkpoint then finds a weight of
    shape [0]; under the reentrant one, the gradient of a head tied to the embeddings came out incomplete:
    measured grad norm 0.79 against 1.08 on the tiny tied model)."""
    return any(hasattr(p, "ds_id") for p in module.parameters(recurse=False))


def partitioned_head(model: torch.nn.Module) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return isinstance(head, torch.nn.Module) and weights_partitioned(head)


def fused_head_cross_entropy_sum(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Sum of fp32 cross-entropy of head(hidden) over (n, hidden) rows, projecting one chunk at a time."""
    if hidden.shape[0] == 0:
        return head(hidden).sum() * 0.0
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    recompute = torch.is_grad_enabled()
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows, row_targets = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if recompute:
            total = total + checkpoint(_head_cross_entropy_sum, head, rows, row_targets, use_reentrant=False)
        else:
            total = total + _head_cross_entropy_sum(head, rows, row_targets)
    return total


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def can_fuse_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly output_embeddings(decoder(...).last_hidden_state)."""
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        return False
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, key, None) for key in LOGIT_TRANSFORMS):
        return False
    try:
        decoder = model.get_decoder()
        return decoder is not None and decoder is not model and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


class LMObjective:
    """Next-token cross-entropy; the unit is one supervised (shifted label != -100) token."""

    name = "lm"
    reports_perplexity = True

    def __init__(self, head: str = "auto", chunk_tokens: int | None = None) -> None:
        """head: "fused", "forward" or "auto" (fused when can_fuse_head(model)); see the module docstring.
        chunk_tokens: rows per fp32 cross-entropy chunk (default: CHUNK_ELEMENTS / vocab size)."""
        if head not in HEAD_PATHS:
            raise ValueError(f"head must be one of {HEAD_PATHS}, not {head!r}")
        self.head = head
        self.chunk_tokens = chunk_tokens

    def count(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int(supervised_positions(batch).sum())

    def __call__(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> ObjectiveOutput:
        keep = supervised_positions(batch)
        targets = batch["labels"][:, 1:][keep[:, :-1]]
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        fused = self.head == "fused" or (self.head == "auto" and can_fuse_head(model) and not partitioned_head(model))
        if fused:
            head = model.get_output_embeddings()
            hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state[keep]
            chunk = self._chunk(head.weight.shape[0] if hasattr(head, "weight") else model.config.vocab_size)
            return ObjectiveOutput(loss_sum=fused_head_cross_entropy_sum(head, hidden, targets, chunk))
        if _accepts_logits_to_keep(model):
            logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
        else:
            logits = model(**inputs, use_cache=False).logits
        if logits.dim() == 3:  # the model returned every position (it ignored or lacks logits_to_keep)
            logits = logits[keep]
        return ObjectiveOutput(
            loss_sum=chunked_cross_entropy_sum(logits, targets, self._chunk(logits.shape[-1]))
        )

    def _chunk(self, vocab_size: int) -> int:
        return self.chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_size)
