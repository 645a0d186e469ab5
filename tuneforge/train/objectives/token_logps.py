"""The one token log-prob path: log p(target) of every supervised target of a batch, without all the logits.

Every objective and evaluation goes through `token_logps`: the lm objective's cross-entropy sum is minus
their sum (its other per-token losses, sft_losses, read the same chunks); the preference objectives add them up
per sequence (logps.sequence_logps).

The vocabulary projection dominates activation memory (49k-256k logits per token). Two ways to the logits:
- "fused" (default when the model allows it): run the decoder, keep the hidden states of the positions
  that predict a target, and project + log-softmax them in fp32 chunks under activation checkpointing.
  Only one chunk of logits ever exists; backward recomputes it. When the head is frozen (LoRA, QLoRA, freeze) and
  the loss is plain cross-entropy, the chunk's gradient to the hidden states is taken in the forward instead
  (FrozenHeadCrossEntropy): one projection per chunk and one product for the gradient, nothing recomputed.
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

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tuneforge.batch import Batch, text_positions
from tuneforge.train.objectives.sft_losses import PLAIN, TokenLoss
from tuneforge.trunk import trunk, unwrapped

IGNORE_INDEX = -100
# elements of one fp32 logits chunk: 2**23 floats = 32 MiB, ~170 tokens of a 49k vocabulary (a chunk is live while
# every activation of the forward is: 2**25 made the peak of W1 without gradient checkpointing 260 MiB higher)
CHUNK_ELEMENTS = 2**23
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


@dataclass(frozen=True)
class ReferenceRows:
    """What a reference's vocabulary projection reads at a batch's supervised targets (asft): its kept hidden states
    and its head (a callable), or its kept logits (head None); in supervised_targets' order."""

    head: Callable[[torch.Tensor], torch.Tensor] | None
    rows: torch.Tensor


def _chunk_losses(head: torch.nn.Module | None, rows: torch.Tensor, targets: torch.Tensor, loss: TokenLoss,
                  ref_head: Callable | None = None, ref_rows: torch.Tensor | None = None) -> torch.Tensor:
    logits = head(rows) if head is not None else rows
    ref_logits = None
    if ref_rows is not None:
        with torch.no_grad():
            ref_logits = ref_head(ref_rows) if ref_head is not None else ref_rows
    return loss(logits, targets, ref_logits)


def frozen_linear(head: torch.nn.Module | None) -> bool:
    """A plain linear head with nothing to train (LoRA, QLoRA, freeze tuning: the head stays frozen)."""
    return type(head) is torch.nn.Linear and not any(p.requires_grad for p in head.parameters())


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy through a frozen linear head, its gradient taken in the forward.

    d(-log p_t)/dh_t = (softmax_t - onehot_t) W depends on token t alone, so each chunk's logits are made once, give
    the losses and this (n, hidden) gradient, and are dropped; backward only scales it by the incoming gradient. A
    checkpointed chunk makes the logits twice (forward and recompute) and runs a third product in its backward.
    The head module is called (not its weight read), so its hooks and autocast apply as on the other path."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, chunk_tokens: int
                ) -> torch.Tensor:
        losses, grads = [], []
        for start in range(0, rows.shape[0], chunk_tokens):
            chunk_targets = targets[start : start + chunk_tokens]
            projected = head(rows[start : start + chunk_tokens])
            logits = projected.float()
            # the losses exactly as the other path computes them: a reference's log-probs (no gradient, that path)
            # must equal the policy's where their weights are equal (dpo's first step: every reward exactly 0)
            losses.append(PLAIN(logits, chunk_targets))
            shift = logits.amax(dim=-1, keepdim=True)  # then the softmax in place: one chunk-sized tensor
            probs = logits.sub_(shift).exp_()
            probs.div_(probs.sum(dim=-1, keepdim=True))
            probs[torch.arange(len(chunk_targets), device=probs.device), chunk_targets] -= 1
            grads.append(probs.to(projected.dtype) @ head.weight.to(projected.dtype))
        ctx.save_for_backward(torch.cat(grads))
        ctx.rows_dtype = rows.dtype
        return torch.cat(losses)

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        (grads,) = ctx.saved_tensors
        return (grad_losses[:, None] * grads.float()).to(ctx.rows_dtype), None, None, None


def chunked_token_losses(
    head: torch.nn.Module | None, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
    loss: TokenLoss = PLAIN, hits: list[torch.Tensor] | None = None, ref: ReferenceRows | None = None,
) -> torch.Tensor:
    """The per-token loss (sft_losses.TokenLoss, plain cross-entropy by default) of each of n rows, (n,) fp32; rows
    are hidden states (head given) or logits (head None); ref: the reference's rows at the same targets (asft).

    Each chunk is projected (when head is given) and turned into fp32 losses under checkpointing: only its (n,) result
    is kept for backward, never the (chunk, vocab) logits (nor the reference's, recomputed without gradients). hits
    (without gradients only, e.g. evaluation): a list that receives, per chunk, whether each target is the most
    likely token.
    """
    if hits is not None and torch.is_grad_enabled():
        raise ValueError("hits are read in evaluation, without gradients")
    if rows.shape[0] == 0:  # keep the graph so a batch without targets still back-propagates
        projected = head(rows) if head is not None else rows
        return projected.float().sum(dim=-1) * 0.0
    recompute = torch.is_grad_enabled() and (head is not None or rows.requires_grad)
    if torch.is_grad_enabled() and rows.requires_grad and loss.is_nll and ref is None and frozen_linear(head):
        return FrozenHeadCrossEntropy.apply(rows, head, targets, chunk_tokens)
    pieces = []
    for start in range(0, rows.shape[0], chunk_tokens):
        end = start + chunk_tokens
        chunk, chunk_targets = rows[start:end], targets[start:end]
        ref_args = (ref.head, ref.rows[start:end]) if ref is not None else ()
        if hits is not None:
            logits = (head(chunk) if head is not None else chunk).float()
            hits.append(logits.argmax(dim=-1) == chunk_targets)
            pieces.append(_chunk_losses(None, logits, chunk_targets, loss, *ref_args))
            continue
        args = (head, chunk, chunk_targets, loss, *ref_args)
        pieces.append(checkpoint(_chunk_losses, *args, use_reentrant=False) if recompute else _chunk_losses(*args))
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
    return -_token_losses(model, batch, head, chunk_tokens, with_values=False)[0]


def token_losses(
    model: torch.nn.Module, batch: Batch, head: str = "auto", chunk_tokens: int | None = None,
    loss: TokenLoss = PLAIN, hits: list[torch.Tensor] | None = None, ref: ReferenceRows | None = None,
) -> torch.Tensor:
    """(n,) fp32 per-token losses of the batch's supervised targets: by default their cross-entropy (-token_logps);
    loss: another of sft_losses (label-smoothed cross-entropy, dft, eaft, asft with ref, the reference's
    `reference_rows` of the same batch). hits: see chunked_token_losses."""
    return _token_losses(model, batch, head, chunk_tokens, with_values=False, loss=loss, hits=hits, ref=ref)[0]


def token_logps_and_values(
    model: torch.nn.Module, batch: Batch, head: str = "auto", chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, values), each (n,) fp32 in supervised_targets' order, from one decoder pass of a value-head model
    (a PPO policy and its critic): the value head reads the same last hidden states the vocabulary projection
    reads, at the positions that predict each target (the state before the token)."""
    losses, values = _token_losses(model, batch, head, chunk_tokens, with_values=True)
    return -losses, values


def reference_rows(model: torch.nn.Module, batch: Batch, head: str = "auto",
                   head_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> ReferenceRows:
    """What `model`'s vocabulary projection reads at the batch's supervised targets, without gradients: the
    reference side of asft's KL. head_context: entered around each call of the head (the policy's own head with its
    adapters disabled, for the policy-without-adapters reference)."""
    with torch.no_grad():
        projection, rows, _ = _projection_rows(model, batch, fuses_head(model, head), with_values=False)
    if projection is None or head_context is None:
        return ReferenceRows(projection, rows)

    def head_fn(hidden: torch.Tensor) -> torch.Tensor:
        with head_context():
            return projection(hidden)

    return ReferenceRows(head_fn, rows)


def _projection_rows(model: torch.nn.Module, batch: Batch, fused: bool, *, with_values: bool
                     ) -> tuple[torch.nn.Module | None, torch.Tensor, torch.Tensor | None]:
    """(head, rows, hidden): fused, the vocabulary projection and the kept last hidden states as rows; else None and
    the kept logits of the model's own forward. hidden: the kept hidden states when with_values (for a value head)."""
    keep, _ = supervised_targets(batch)
    if fused:
        hidden = trunk(model)(**batch.model_inputs, use_cache=False).last_hidden_state[keep]
        return model.get_output_embeddings(), hidden, hidden if with_values else None
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
    return None, logits, hidden


def _token_losses(model: torch.nn.Module, batch: Batch, head: str, chunk_tokens: int | None, *, with_values: bool,
                  loss: TokenLoss = PLAIN, hits: list[torch.Tensor] | None = None, ref: ReferenceRows | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    value_head = getattr(model, "v_head", None)
    if isinstance(value_head, torch.nn.Module):  # a ValueHeadModel: the log-probs are its language model's
        model = model.model
    elif with_values:
        raise ValueError(f"{type(model).__name__} has no value head (v_head)")
    _, targets = supervised_targets(batch)
    projection, rows, hidden = _projection_rows(model, batch, fuses_head(model, head), with_values=with_values)
    if projection is None:
        vocab = rows.shape[-1]
    else:
        vocab = projection.weight.shape[0] if hasattr(projection, "weight") else model.config.vocab_size
    losses = chunked_token_losses(projection, rows, targets, _chunk(chunk_tokens, vocab), loss, hits, ref)
    return losses, _values(value_head, hidden) if with_values else None


def _values(value_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under mixed precision
        return value_head(hidden.float()).squeeze(-1)


def _chunk(chunk_tokens: int | None, vocab_size: int) -> int:
    return chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_size)
