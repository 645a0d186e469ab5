"""The one token log-prob path: log p(target) of every supervised target of a batch, without all the logits.

Every objective and evaluation goes through `token_logps`: the lm objective's cross-entropy sum is minus
their sum; the preference objectives add them up per sequence (logps.sequence_logps).

The vocabulary projection dominates activation memory (49k-256k logits per token). Two ways to the logits:
- "fused" (default when the model allows it): run the decoder, keep the hidden states of the positions
  that predict a target, and project + log-softmax them in fp32 chunks under activation checkpointing.
  Only one chunk of logits ever exists; backward recomputes it.
- "forward": call the model's own forward with `logits_to_keep` (a boolean mask, or the positions of a
  shared-prompt batch; transformers 5), so only those positions get logits, then fp32 log-softmax in
  checkpointed chunks. Used for models whose head transforms logits (soft-capping, scaling), for wrappers
  (DDP) that must see the top-level forward, and when DeepSpeed ZeRO-3 partitions the head
  (`partitioned_head`): a checkpointed chunk that calls the head would recompute it after ZeRO-3 released
  its weight again.

Measured on SmolLM2-135M, fp32, batch 4 x 512, half the tokens supervised, gradient checkpointing,
peak memory allocated during forward + backward: `model(labels=...)` 1301 MiB, "forward" 914 MiB,
"fused" 641 MiB; the gap grows with the number of supervised tokens (the fused peak stays one chunk).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tuneforge.batch import Batch, text_positions
from tuneforge.trunk import trunk, unwrapped

IGNORE_INDEX = -100
# elements of one fp32 logits chunk: 2**25 floats = 128 MiB, ~680 tokens of a 49k vocabulary
CHUNK_ELEMENTS = 2**25
# config keys of heads that transform logits after the projection: those models use their own forward
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling")
HEAD_PATHS = ("auto", "fused", "forward")


def supervised_positions(batch: Batch) -> torch.Tensor:
    """Boolean (batch, seq) mask of the positions whose *next* token is a supervised target.

    When samples share rows (packed or flat layouts), a position whose next token starts a new sample
    (position id 0) is never a target: no sample learns to predict the first token of another.
    """
    if "next_labels" in batch.targets:  # a sequence-parallel shard: shifted on the whole row (sequence_parallel)
        return batch.targets["next_labels"] != IGNORE_INDEX
    labels = batch.targets["labels"]
    next_supervised = labels[:, 1:] != IGNORE_INDEX
    if batch.layout.samples_share_rows:
        next_supervised = next_supervised & (text_positions(batch.model_inputs)[:, 1:] != 0)
    return F.pad(next_supervised, (0, 1), value=False)


def supervised_targets(batch: Batch) -> tuple[torch.Tensor | tuple[int, torch.Tensor], torch.Tensor]:
    """(keep, targets): which hidden states predict a target (a boolean mask over input_ids, or for a
    shared-prompt layout (0, positions) in target order) and the target token ids, in the same order."""
    if batch.layout.shared_prefix:  # one position may predict targets of two sequences: listed explicitly
        return (0, batch.targets["target_positions"]), batch.targets["target_ids"]
    keep = supervised_positions(batch)
    if "next_labels" in batch.targets:
        return keep, batch.targets["next_labels"][keep]
    return keep, batch.targets["labels"][:, 1:][keep[:, :-1]]


def target_owners(batch: Batch) -> torch.Tensor:
    """The sequence of each supervised target, in supervised_targets' order."""
    if batch.layout.shared_prefix:
        return batch.targets["target_sequences"]
    keep, _ = supervised_targets(batch)
    # the position that predicts a target is in the target's own sequence (boundaries are never targets)
    return batch.targets["sequence_ids"][keep]


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


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    base = unwrapped(model)
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def can_fuse_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly output_embeddings(decoder(...).last_hidden_state)."""
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        return False
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if config is None or any(getattr(c, key, None) for key in LOGIT_TRANSFORMS for c in (config, text_config)):
        return False
    try:
        decoder = trunk(model)
        return decoder is not None and decoder is not model and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


def _logits_token_logps(logits: torch.Tensor, targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    return -F.cross_entropy(logits.float(), targets, reduction="none", label_smoothing=smoothing)


def _head_token_logps(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, smoothing: float
                      ) -> torch.Tensor:
    return -F.cross_entropy(head(hidden).float(), targets, reduction="none", label_smoothing=smoothing)


def chunked_token_logps(
    head: torch.nn.Module | None, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
    label_smoothing: float = 0.0, hits: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """log p(target) of each of n rows, (n,) fp32; rows are hidden states (head given) or logits (head None).

    Each chunk is projected (when head is given), log-softmaxed in fp32 and gathered under checkpointing:
    only its (n,) result is kept for backward, never the (chunk, vocab) logits. label_smoothing: minus the
    smoothed cross-entropy instead, (1 - e) log p(target) + e x the mean log p over the vocabulary. hits (without
    gradients only, e.g. evaluation): a list that receives, per chunk, whether each target is the most likely token.
    """
    if hits is not None:
        if torch.is_grad_enabled():
            raise ValueError("hits are read in evaluation, without gradients")
        pieces = []
        for start in range(0, rows.shape[0], chunk_tokens):
            chunk, chunk_targets = rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]
            logits = (head(chunk) if head is not None else chunk).float()
            pieces.append(-F.cross_entropy(logits, chunk_targets, reduction="none", label_smoothing=label_smoothing))
            hits.append(logits.argmax(dim=-1) == chunk_targets)
        return torch.cat(pieces) if pieces else rows.new_zeros(0, dtype=torch.float32)
    if rows.shape[0] == 0:  # keep the graph so a batch without targets still back-propagates
        projected = head(rows) if head is not None else rows
        return projected.float().sum(dim=-1) * 0.0
    recompute = torch.is_grad_enabled() and (head is not None or rows.requires_grad)
    pieces = []
    for start in range(0, rows.shape[0], chunk_tokens):
        chunk, chunk_targets = rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if head is not None:
            args = (_head_token_logps, head, chunk, chunk_targets, label_smoothing)
        else:
            args = (_logits_token_logps, chunk, chunk_targets, label_smoothing)
        pieces.append(checkpoint(*args, use_reentrant=False) if recompute else args[0](*args[1:]))
    return torch.cat(pieces)


def fuses_head(model: torch.nn.Module, head: str) -> bool:
    if head not in HEAD_PATHS:
        raise ValueError(f"head must be one of {HEAD_PATHS}, not {head!r}")
    return head == "fused" or (head == "auto" and can_fuse_head(model) and not partitioned_head(model))


def token_logps(
    model: torch.nn.Module, batch: Batch, head: str = "auto", chunk_tokens: int | None = None
) -> torch.Tensor:
    """(n,) fp32 log p(target) of the batch's supervised targets, in supervised_targets' order.

    head: "fused", "forward" or "auto" (fused when can_fuse_head(model) and ZeRO-3 does not partition the
    head); see the module docstring. chunk_tokens: rows per fp32 chunk (default CHUNK_ELEMENTS / vocab size).
    The model's inputs are batch.model_inputs, passed through as they are. Works on peft-wrapped models
    (their decoder holds the adapters) and on a value-head model (its language model's log-probs)."""
    return _token_logps(model, batch, head, chunk_tokens, with_values=False)[0]


def token_losses(
    model: torch.nn.Module, batch: Batch, head: str = "auto", chunk_tokens: int | None = None,
    label_smoothing: float = 0.0, hits: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """(n,) fp32 cross-entropy of the batch's supervised targets (-token_logps); with label_smoothing e, the smoothed
    cross-entropy (1 - e) x -log p(target) + e x the mean of -log p over the vocabulary, transformers'
    label_smoothing_factor (torch's cross_entropy(label_smoothing=e)). hits: see chunked_token_logps."""
    return -_token_logps(model, batch, head, chunk_tokens, with_values=False, smoothing=label_smoothing,
                         hits=hits)[0]


def token_logps_and_values(
    model: torch.nn.Module, batch: Batch, head: str = "auto", chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, values), each (n,) fp32 in supervised_targets' order, from one decoder pass of a value-head model
    (a PPO policy and its critic): the value head reads the same last hidden states the vocabulary projection
    reads, at the positions that predict each target (the state before the token)."""
    logps, values = _token_logps(model, batch, head, chunk_tokens, with_values=True)
    return logps, values


def _token_logps(model: torch.nn.Module, batch: Batch, head: str, chunk_tokens: int | None, *, with_values: bool,
                 smoothing: float = 0.0, hits: list[torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    value_head = getattr(model, "v_head", None)
    if isinstance(value_head, torch.nn.Module):  # a ValueHeadModel: the log-probs are its language model's
        model = model.model
    elif with_values:
        raise ValueError(f"{type(model).__name__} has no value head (v_head)")
    keep, targets = supervised_targets(batch)
    if fuses_head(model, head):
        projection = model.get_output_embeddings()
        hidden = trunk(model)(**batch.model_inputs, use_cache=False).last_hidden_state[keep]
        vocab = projection.weight.shape[0] if hasattr(projection, "weight") else model.config.vocab_size
        logps = chunked_token_logps(projection, hidden, targets, _chunk(chunk_tokens, vocab), smoothing, hits)
        return logps, _values(value_head, hidden) if with_values else None
    heads_input: list[torch.Tensor] = []  # what the vocabulary projection reads: the kept last hidden states
    hook = (model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: heads_input.append(args[0]))
            if with_values else None)
    explicit = isinstance(keep, tuple)
    try:
        if _accepts_logits_to_keep(model):
            logits = model(**batch.model_inputs, logits_to_keep=keep[1] if explicit else keep, use_cache=False).logits
            if explicit:  # (1, targets, vocab): the kept positions, in target order
                logits = logits[0]
        else:
            logits = model(**batch.model_inputs, use_cache=False).logits
    finally:
        if hook is not None:
            hook.remove()
    hidden = heads_input[-1] if with_values else None
    if logits.dim() == 3:  # the model returned every position (it ignored or lacks logits_to_keep)
        logits = logits[keep]
        hidden = hidden[keep] if hidden is not None else None
    elif hidden is not None and hidden.dim() == 3:
        hidden = hidden[0]
    logps = chunked_token_logps(None, logits, targets, _chunk(chunk_tokens, logits.shape[-1]), smoothing, hits)
    return logps, _values(value_head, hidden) if with_values else None


def _values(value_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under mixed precision
        return value_head(hidden.float()).squeeze(-1)


def _chunk(chunk_tokens: int | None, vocab_size: int) -> int:
    return chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_size)
