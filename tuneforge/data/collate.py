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

Preference rows (pairwise: chosen_* / rejected_*; feedback: the answer and kl_*) hold several sequences.
B rows become S = 2B sequences, all first halves then all second halves (chosen_0 .. chosen_{B-1},
rejected_0 .. rejected_{B-1}), collated as plain rows are, plus what the objectives read:
`sequence_ids` (shaped like input_ids: the sequence of each token, -1 on padding), `sequence_ends` (S,)
(the index in input_ids.view(-1) of each sequence's last token), `kto_tags` (B,) for feedback rows, and
`ref_logps` (S,) float32 when the rows carry precomputed reference log-probs.
"""

from __future__ import annotations

from typing import Any

import torch

from tuneforge.data.encode import IGNORE_INDEX
from tuneforge.data.encode_pref import REF_LOGP_COLUMNS, SEQUENCE_PREFIXES


def row_kind(row: dict[str, Any]) -> str:
    """plain, pairwise or feedback: which layout a token row has."""
    if "chosen_input_ids" in row:
        return "pairwise"
    if "kl_input_ids" in row:
        return "feedback"
    return "plain"


class Collator:
    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        padding_free: bool = False,
        share_prompts: bool = False,
    ) -> None:
        """share_prompts (with padding_free): a preference row's two sequences share one copy of their
        prompt (see shared_prompt_batch); only for models whose attention reads `shared_prefix`."""
        if pad_token_id is None:
            raise ValueError("Collator needs a pad_token_id (the tokenizer's pad or eos token)")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_free = padding_free
        self.share_prompts = share_prompts and padding_free

    def _width(self, rows: list[dict[str, Any]]) -> int:
        width = max(len(r["input_ids"]) for r in rows)
        m = self.pad_to_multiple_of
        return -(-width // m) * m if m else width

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        kinds = {row_kind(r) for r in rows}
        if len(kinds) > 1:
            raise ValueError(f"cannot collate a batch that mixes row layouts {sorted(kinds)}")
        kind = kinds.pop()
        if kind != "plain":
            return self._preference(rows, kind)
        return self._plain(rows)

    def _plain(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
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

    def _preference(self, rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
        prefixes = SEQUENCE_PREFIXES[kind]
        if self.share_prompts:
            batch = shared_prompt_batch(rows, prefixes)
        else:
            batch = self._separate(rows, prefixes)
        if kind == "feedback":
            batch["kto_tags"] = torch.tensor([int(r["kto_tag"]) for r in rows], dtype=torch.long)
        ref = _ref_logps(rows, prefixes)
        if ref is not None:
            batch["ref_logps"] = ref
        return batch

    def _separate(self, rows: list[dict[str, Any]], prefixes: tuple[str, str]) -> dict[str, Any]:
        """The 2B sequences one after another (padded rows, or back to back when padding-free)."""
        sequences = [
            {
                "input_ids": r[f"{p}input_ids"],
                "labels": r[f"{p}labels"],
                "attention_mask": r.get(f"{p}attention_mask") or [1] * len(r[f"{p}input_ids"]),
            }
            for p in prefixes
            for r in rows
        ]
        batch = self._plain(sequences)
        lengths = torch.tensor([len(s["input_ids"]) for s in sequences], dtype=torch.long)
        width = batch["input_ids"].shape[1]
        batch["sequence_ids"], batch["sequence_ends"] = sequence_layout(lengths, width, self.padding_free)
        return batch


def shared_prefix_len(first: tuple[list, list], second: tuple[list, list]) -> int:
    """Leading tokens both sequences share, none of them a target (so their hidden states serve both);
    at least one token of each sequence stays its own."""
    (ids_a, labels_a), (ids_b, labels_b) = first, second
    limit = min(len(ids_a), len(ids_b)) - 1
    n = 0
    while n < limit and ids_a[n] == ids_b[n] and labels_a[n] == IGNORE_INDEX == labels_b[n]:
        n += 1
    return n


def shared_prompt_batch(rows: list[dict[str, Any]], prefixes: tuple[str, str]) -> dict[str, Any]:
    """B preference rows -> one padding-free row where each row's two sequences share their prompt.

    Row b becomes [prompt, rest of sequence A, rest of sequence B]; B's position ids continue from the
    prompt, and `shared_prefix` (start, prompt, rest A, rest B per row) tells the attention that B sees the
    prompt but not A. The prompt's tokens are computed once instead of twice. Because one position can now
    predict a token of either sequence, the supervised targets are listed explicitly: `target_positions`
    (the row index of the hidden state that predicts each target), `target_ids`, `target_sequences` (its
    sequence, 0..2B-1 in the contract's order: all A's, then all B's); `sequence_ends` as usual.
    """
    count = len(rows)
    input_ids: list[int] = []
    positions: list[int] = []
    groups, ends = [], [0] * (2 * count)
    target_positions: list[int] = []
    target_ids: list[int] = []
    target_sequences: list[int] = []
    for b, r in enumerate(rows):
        pair = [(list(r[f"{p}input_ids"]), list(r[f"{p}labels"])) for p in prefixes]
        (ids_a, _), (ids_b, _) = pair
        shared, start = shared_prefix_len(*pair), len(input_ids)
        input_ids += ids_a + ids_b[shared:]
        positions += list(range(len(ids_a))) + list(range(shared, len(ids_b)))
        groups.append([start, shared, len(ids_a) - shared, len(ids_b) - shared])
        for k, (ids, labels) in enumerate(pair):
            own = start if k == 0 else start + len(ids_a) - shared  # token j >= shared sits at own + j
            where = [start + j if j < shared else own + j for j in range(len(ids))]  # each token's row index
            for j in range(1, len(ids)):
                if labels[j] != IGNORE_INDEX:
                    target_positions.append(where[j - 1])
                    target_ids.append(labels[j])
                    target_sequences.append(k * count + b)
            ends[k * count + b] = where[-1]
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "shared_prefix": torch.tensor(groups, dtype=torch.long),
        "sequence_ends": torch.tensor(ends, dtype=torch.long),
        "target_positions": torch.tensor(target_positions, dtype=torch.long),
        "target_ids": torch.tensor(target_ids, dtype=torch.long),
        "target_sequences": torch.tensor(target_sequences, dtype=torch.long),
    }


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


def sequence_layout(
    lengths: torch.Tensor, width: int, padding_free: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence_ids, sequence_ends) of S sequences: padded, one per row of `width`; or back to back."""
    count = len(lengths)
    if padding_free:
        ids = torch.repeat_interleave(torch.arange(count), lengths).unsqueeze(0)
        return ids, torch.cumsum(lengths, 0) - 1
    positions = torch.arange(width).expand(count, -1)
    owner = torch.arange(count).unsqueeze(1).expand(-1, width)
    ids = torch.where(positions < lengths.unsqueeze(1), owner, -1)
    return ids, torch.arange(count) * width + lengths - 1


def _ref_logps(rows: list[dict[str, Any]], prefixes: tuple[str, ...]) -> torch.Tensor | None:
    columns = [REF_LOGP_COLUMNS[p] for p in prefixes]
    carried = [all(c in r and r[c] is not None for c in columns) for r in rows]
    if not any(carried):
        return None
    if not all(carried):
        raise ValueError(
            f"some rows of the batch carry reference log-probs ({', '.join(columns)}) and others not"
        )
    return torch.tensor([float(r[c]) for c in columns for r in rows], dtype=torch.float32)
