"""Token rows -> a padded batch of tensors.

Rows without position_ids get an attention_mask (1 on tokens, 0 on padding). Packed rows (with
position_ids) get position_ids and no attention_mask: transformers then builds a block-diagonal causal
mask from the position ids, one block per run that starts at 0. Padding is given its own such run
(0, 1, 2, ...), so it is a block of its own and no real token attends to it.

With padding_free, a micro-batch becomes one row: the samples back to back, position ids restarting at 0
for each, and their boundaries as `cu_seq_lens_q/k` (+ `max_length_q/k`), the keywords transformers'
varlen attention reads (flash-attention, and tuneforge.model.attention's sdpa). No token is padding, and
the loss is the padded batch's: every sample sees only itself.

The model must run without a KV cache (`use_cache=False`) for this: with a cache transformers does not
look for packed sequences and lets the pieces of a row attend to each other.
"""

from __future__ import annotations

from typing import Any

import torch

from tuneforge.data.encode import IGNORE_INDEX


class Collator:
    def __init__(
        self, pad_token_id: int, pad_to_multiple_of: int | None = None, padding_free: bool = False
    ) -> None:
        if pad_token_id is None:
            raise ValueError("Collator needs a pad_token_id (the tokenizer's pad or eos token)")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_free = padding_free

    def _width(self, rows: list[dict[str, Any]]) -> int:
        width = max(len(r["input_ids"]) for r in rows)
        m = self.pad_to_multiple_of
        return -(-width // m) * m if m else width

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        if self.padding_free:
            return flatten(rows)
        width = self._width(rows)
        packed = any("position_ids" in r for r in rows)
        input_ids, labels, masks, positions = [], [], [], []
        for r in rows:
            ids = list(r["input_ids"])
            pad = width - len(ids)
            input_ids.append(ids + [self.pad_token_id] * pad)
            labels.append(list(r.get("labels", ids)) + [IGNORE_INDEX] * pad)
            if packed:
                own = list(r["position_ids"]) if "position_ids" in r else list(range(len(ids)))
                positions.append(own + list(range(pad)))
            else:
                masks.append(list(r.get("attention_mask", [1] * len(ids))) + [0] * pad)
        batch = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
        }
        if packed:
            batch["position_ids"] = torch.tensor(positions, dtype=torch.long)
        else:
            batch["attention_mask"] = torch.tensor(masks, dtype=torch.long)
        return batch


def flatten(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows (plain or packed) -> one padding-free row with position ids and sequence boundaries."""
    input_ids, labels, positions = [], [], []
    for r in rows:
        ids = list(r["input_ids"])
        input_ids += ids
        labels += list(r.get("labels", ids))
        positions += list(r["position_ids"]) if "position_ids" in r else list(range(len(ids)))
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    if starts[0] != 0:
        raise ValueError("a packed row must start a sequence (position id 0) at its first token")
    cu_seq_lens = torch.tensor(starts, dtype=torch.int32)
    longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest,
        "max_length_k": longest,
    }
