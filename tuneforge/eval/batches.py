"""Prompts in batches for a decoder: longest first (similar lengths share a batch), padded on the left so
that every row's last prompt token sits in the last column, where scoring and generation read."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def left_padded_batches(
    prompts: Sequence[Sequence[int]], batch_size: int, pad_id: int, device: torch.device
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """(row indices, input_ids, attention_mask) per batch; the rows are indices into prompts."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[pad_id] * (width - len(prompts[i])) + list(prompts[i]) for i in rows], device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows], device=device)
        yield rows, ids, mask
