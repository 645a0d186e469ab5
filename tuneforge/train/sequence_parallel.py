"""Sequence parallelism (DeepSpeed-Ulysses): each micro-batch's sequence split over `sequence_parallel_size` ranks.

The ranks are cut into consecutive sequence groups of sequence_parallel_size; the ranks of one group read the same
rows (the data-parallel degree is world_size / sequence_parallel_size) and each keeps one contiguous shard of the
padding-free row: its tokens, their position ids (so rope sees the true positions) and the label each of its
positions predicts, shifted on the whole row first (the shard's last token predicts the next shard's first). The
row is padded to a multiple of the group size with one extra, unsupervised sequence.

Every layer then runs on the shard, except attention, which needs the whole sequence: an all-to-all scatters the
heads and gathers the sequence (each rank holds heads / size heads over the whole row), the padding-free sdpa runs
on them with the row's global sequence boundaries, and a second all-to-all brings the shard back with every head.
Their backward is the opposite all-to-all, so a rank's gradients carry what its shard contributed to the others'
attention.

Each rank counts the supervised tokens of its own shard, so the trainer's units summed over all ranks are the
global token count, and its loss sum is its shard's: the gradient averaged over every rank (DDP) times
world_size / units is exactly the gradient of the whole batch's mean loss, as without sequence parallelism.
Supported: stages pt and sft (the lm objective) on padding-free rows, one or many sequence groups under DDP
(the local strategy); models whose attention heads and key / value heads divide by sequence_parallel_size.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from tuneforge.batch import Batch
from tuneforge.errors import ConfigError
from tuneforge.model import attention

logger = logging.getLogger(__name__)

ULYSSES_SDPA = "tuneforge_ulysses_sdpa"
NEXT_LABELS = "next_labels"  # a shard's targets: the label each position predicts (shifted on the whole row)
IGNORE_INDEX = -100
# what a padding-free text row holds; anything else (media, shared prompts) is refused
ROW_KEYS = {"input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}

_group: dist.ProcessGroup | None = None  # this process's sequence group (the attention function's)


@dataclasses.dataclass(frozen=True)
class SequenceGroup:
    size: int
    rank: int  # this process's place in its group: which shard it keeps
    data_rank: int  # which group: the rows it reads
    data_ranks: int  # how many groups (the data-parallel degree)
    group: Any = None

    def shard(self, batch: Batch) -> Batch:
        return shard(batch, self.rank, self.size)


def setup(cfg: Any, model: torch.nn.Module) -> SequenceGroup | None:
    """Form the sequence groups and switch the model's attention to Ulysses; None when sequence_parallel_size is 1.
    Every process of the run calls it (forming groups is collective)."""
    global _group
    size = cfg.train.sequence_parallel_size
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % size or world < size:
        raise ConfigError(f"sequence_parallel_size {size} must divide the number of processes ({world}); start "
                          f"a multiple of it (FORCE_TORCHRUN=1 NPROC_PER_NODE={size})", key="sequence_parallel_size")
    check_model(model, size)
    rank = dist.get_rank()
    for first in range(0, world, size):  # every process creates every group, in the same order
        members = list(range(first, first + size))
        created = dist.new_group(members)
        if rank in members:
            _group = created
    attention.register()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ULYSSES_SDPA, ulysses_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ULYSSES_SDPA, sdpa_mask)
    model.set_attn_implementation(ULYSSES_SDPA)
    if rank == 0:
        logger.info("sequence parallel: %d ranks per sequence (Ulysses all-to-all attention), %d data-parallel "
                    "group(s) under DDP; stages pt / sft, padding-free rows", size, world // size)
    return SequenceGroup(size, rank % size, rank // size, world // size, _group)


def check_model(model: torch.nn.Module, size: int) -> None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise ConfigError(f"sequence_parallel_size {size}: the model's {heads} attention heads and {kv_heads} key / "
                          f"value heads must both divide by it (each rank attends with an equal share of the heads)",
                          key="sequence_parallel_size")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ConfigError("sequence_parallel_size: models with sliding-window attention are not supported",
                          key="sequence_parallel_size")
    if not attention.supports_padding_free(model):
        raise ConfigError(f"sequence_parallel_size: {type(model).__name__} does not run transformers' attention "
                          f"interface, which sequence parallelism replaces", key="sequence_parallel_size")


def next_labels(labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(1, n): the label each position of a padding-free row predicts; -100 where the next token starts another
    sequence (position id 0), and at the end."""
    following = labels[:, 1:].masked_fill(positions[:, 1:] == 0, IGNORE_INDEX)
    return torch.nn.functional.pad(following, (0, 1), value=IGNORE_INDEX)


def shard(batch: Batch, rank: int, size: int) -> Batch:
    """Shard `rank` of `size` of a padding-free row: tokens, positions and next labels of one contiguous piece; the
    row's (padded) sequence boundaries kept whole for attention."""
    inputs = batch.model_inputs
    extra = set(inputs) - ROW_KEYS
    if not batch.layout.flat or batch.layout.shared_prefix or extra or inputs["input_ids"].shape[0] != 1:
        raise ConfigError(f"sequence_parallel_size: only padding-free text rows can be split (got "
                          f"{', '.join(sorted(extra)) or 'another layout'})", key="sequence_parallel_size")
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    length = ids.shape[1]
    pad = -length % size
    bounds = inputs["cu_seq_lens_q"]
    if pad:  # one unsupervised sequence of padding at the end, so the shards are equal
        ids = torch.nn.functional.pad(ids, (0, pad), value=int(ids[0, -1]))
        positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype, device=positions.device)[None]], 1)
        bounds = torch.cat([bounds, bounds.new_tensor([length + pad])])
    labels = torch.nn.functional.pad(batch.targets["labels"], (0, pad), value=IGNORE_INDEX)
    follow = next_labels(labels, positions)
    width = (length + pad) // size
    piece = slice(rank * width, (rank + 1) * width)
    longest = int((bounds[1:] - bounds[:-1]).max())
    model_inputs = {"input_ids": ids[:, piece], "position_ids": positions[:, piece], "cu_seq_lens_q": bounds,
                    "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}
    targets = {k: v for k, v in batch.targets.items() if k != "labels"}
    targets[NEXT_LABELS] = follow[:, piece]
    if "sequence_ids" in targets:
        targets["sequence_ids"] = torch.nn.functional.pad(targets["sequence_ids"], (0, pad), value=-1)[:, piece]
    first = rank == 0  # the group's rows and tokens are counted once, by its first rank
    return dataclasses.replace(batch, model_inputs=model_inputs, targets=targets,
                               num_tokens=batch.num_tokens if first else 0, num_rows=batch.num_rows if first else 0)


class _AllToAll(torch.autograd.Function):
    """Split x into `group size` chunks along scatter_dim, send chunk j to rank j, concatenate what arrives along
    gather_dim (in rank order); the backward is the same exchange the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    size = dist.get_world_size(group)
    sent = [chunk.contiguous() for chunk in x.chunk(size, dim=scatter_dim)]
    received = [torch.empty_like(chunk) for chunk in sent]
    dist.all_to_all(received, sent, group=group)
    return torch.cat(received, dim=gather_dim)


def ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """query / key / value: (1, heads, shard, head_dim) -> attention output (1, shard, heads, head_dim)."""
    if kwargs.get("cu_seq_lens_q") is None:  # not a shard (generation: each rank holds its whole sequence)
        return attention.packed_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    whole = [_AllToAll.apply(x, 1, 2, _group) for x in (query, key, value)]  # heads scattered, sequence gathered
    out, _ = attention.packed_sdpa_attention_forward(module, *whole, None, **kwargs)  # (1, sequence, heads/n, d)
    return _AllToAll.apply(out, 1, 2, _group), None  # sequence scattered, heads gathered
