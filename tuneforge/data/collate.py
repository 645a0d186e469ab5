"""Token rows -> a `tuneforge.batch.Batch`: the model's inputs, the objective's targets, the layout, the counts.

The layout (tuneforge.batch.Layout) is decided once by the workflow and handed to the Collator; nothing here
guesses it from the rows' columns.

Padded rows (not flat) get an attention_mask (1 on tokens, 0 on padding), unless they are packed: packed
rows get their position_ids and no attention_mask, and transformers builds a block-diagonal causal mask
from the position ids, one block per run that starts at 0. Padding is given its own such run (0, 1, 2, ...),
so it is a block of its own and no real token attends to it.

A flat (padding-free) layout makes a micro-batch one row: the samples back to back, position ids restarting
at 0 for each, and their boundaries as `cu_seq_lens_q/k` (+ `max_length_q/k`), the keywords transformers'
varlen attention reads (flash-attention, and tuneforge.model.attention's sdpa). No token is padding, and
the loss is the padded batch's: every sample sees only itself. The model must run without a KV cache
(`use_cache=False`) for this: with a cache transformers does not look for packed sequences and lets the
pieces of a row attend to each other.

Preference rows (pairwise: chosen_* / rejected_*; feedback: the answer and kl_*) hold several sequences.
B rows become S = 2B sequences, all first halves then all second halves (chosen_0 .. chosen_{B-1},
rejected_0 .. rejected_{B-1}), collated as plain rows are, plus the targets the objectives read:
`sequence_ids` (shaped like input_ids: the sequence of each token, -1 on padding), `sequence_ends` (S,)
(the index in input_ids.view(-1) of each sequence's last token), `kto_tags` (B,) for feedback rows, and
`ref_logps` (S,) float32 when the rows carry precomputed reference log-probs. A shared-prefix layout puts
each row's two sequences on one copy of their prompt (shared_prompt_batch); the RL objectives' groups of
sampled answers to one prompt go the same way (Collator.groups, shared_prompt_groups).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from tuneforge.batch import Batch, Layout
from tuneforge.data.encode import IGNORE_INDEX
from tuneforge.data.encode_pref import REF_LOGP_COLUMNS, SEQUENCE_PREFIXES
from tuneforge.data.encode_prompt import row_columns
from tuneforge.data.multimodal import MEDIA_COLUMN, collate_media, generate_inputs

# the column prefixes of the sequences one row holds, per row kind of the layout
ROW_PREFIXES: dict[str, tuple[str, ...]] = {"plain": ("",), "prompt": ("",), **SEQUENCE_PREFIXES}
# per row kind, columns of a row that become targets of the batch: row column -> target name (one value a row)
ROW_TARGETS: dict[str, dict[str, str]] = {"feedback": {"kto_tag": "kto_tags"}}

Columns = tuple[dict[str, Any], dict[str, Any]]  # (model_inputs, targets)
RopePositions = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]  # (input_ids (1, n), media inputs) -> (3, n)


def count_tokens(rows: list[dict[str, Any]], prefixes: tuple[str, ...]) -> int:
    """Real tokens of uncollated rows: each sequence's attention_mask sum (its length without one).

    Counted before collation, so padding, packing and prompt sharing cannot change it."""
    total = 0
    for row in rows:
        for prefix in prefixes:
            mask = row.get(f"{prefix}attention_mask")
            total += int(sum(mask)) if mask is not None else len(row[f"{prefix}input_ids"])
    return total


class Collator:
    def __init__(self, pad_token_id: int, layout: Layout | None = None, pad_to_multiple_of: int | None = None,
                 rope: RopePositions | None = None) -> None:
        """layout: the row kind, flat (padding-free), packed and shared-prefix, decided by the workflow. rope: a
        model's own 3-D rope placement of one row (model.multimodal.rope_positions), for its flat and packed
        media rows."""
        if pad_token_id is None:
            raise ValueError("Collator needs a pad_token_id (the tokenizer's pad or eos token)")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.layout = layout or Layout()
        self.rope = rope

    def _width(self, rows: list[dict[str, Any]]) -> int:
        width = max(len(r["input_ids"]) for r in rows)
        m = self.pad_to_multiple_of
        return -(-width // m) * m if m else width

    def __call__(self, rows: list[dict[str, Any]]) -> Batch:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        prefixes = ROW_PREFIXES[self.layout.rows]
        for i, row in enumerate(rows):
            missing = [f"{p}input_ids" for p in prefixes if f"{p}input_ids" not in row]
            if missing:
                raise ValueError(f"the batch mixes row layouts: row {i} has no {missing[0]} column, which "
                                 f"{self.layout.rows} rows hold")
        if self.layout.rows == "plain":
            model_inputs, targets = self._plain(rows)
        elif self.layout.rows == "prompt":  # the objective's prepare samples completions and builds the inputs
            model_inputs = {}
            targets = {"prompt_ids": [list(r["input_ids"]) for r in rows], "columns": [row_columns(r) for r in rows]}
            if any(r.get(MEDIA_COLUMN) for r in rows):  # each prompt's media tensors, for sampling and the loss
                targets["prompt_media"] = [r.get(MEDIA_COLUMN) for r in rows]
        else:
            model_inputs, targets = self._preference(rows, prefixes)
        return Batch(model_inputs, targets, self.layout, num_rows=len(rows), num_tokens=count_tokens(rows, prefixes))

    def _plain(self, rows: list[dict[str, Any]]) -> Columns:
        media = [r.get(MEDIA_COLUMN) for r in rows]
        if self.layout.flat:
            model_inputs, targets = flatten(rows, self.layout.packed)
            if any(media):  # the samples' media in row order (the model allows a flat layout: batch_layout)
                model_inputs.update(collate_media(media, None))
                if self.rope is not None:  # text positions first: transformers builds the packed mask from them
                    placed = torch.cat(rope_rows(self.rope, rows, media, self.layout.packed), dim=1)
                    model_inputs["position_ids"] = torch.cat([model_inputs["position_ids"], placed])[:, None]
            return model_inputs, targets
        width = self._width(rows)
        packed = self.layout.packed
        input_ids, labels, masks, positions = [], [], [], []
        for r in rows:
            ids = list(r["input_ids"])
            pad = width - len(ids)
            input_ids.append(ids + [self.pad_token_id] * pad)
            labels.append(list(r.get("labels", ids)) + [IGNORE_INDEX] * pad)
            if packed:
                positions.append(own_positions(r) + list(range(pad)))
            else:
                masks.append(list(r.get("attention_mask", [1] * len(ids))) + [0] * pad)
        model_inputs = {"input_ids": torch.tensor(input_ids, dtype=torch.long)}
        if packed:
            model_inputs["position_ids"] = torch.tensor(positions, dtype=torch.long)
        else:
            model_inputs["attention_mask"] = torch.tensor(masks, dtype=torch.long)
        if any(media):  # the processor's tensors: pixel values, grid sizes, per-token types
            model_inputs.update(collate_media(media, width))
            if packed and self.rope is not None:  # padding keeps its own run of positions in all four rows
                text = model_inputs["position_ids"]
                placed = text[None].repeat(3, 1, 1)
                for i, row_positions in enumerate(rope_rows(self.rope, rows, media, packed)):
                    placed[:, i, : row_positions.shape[1]] = row_positions
                model_inputs["position_ids"] = torch.cat([text[None], placed])
        return model_inputs, {"labels": torch.tensor(labels, dtype=torch.long)}

    def _preference(self, rows: list[dict[str, Any]], prefixes: tuple[str, ...]) -> Columns:
        if self.layout.shared_prefix:
            model_inputs, targets = shared_prompt_batch(rows, prefixes)
        else:
            model_inputs, targets = self._separate(rows, prefixes)
        for column, name in ROW_TARGETS.get(self.layout.rows, {}).items():
            targets[name] = torch.tensor([int(r[column]) for r in rows], dtype=torch.long)
        ref = _ref_logps(rows, prefixes)
        if ref is not None:
            targets["ref_logps"] = ref
        return model_inputs, targets

    def _separate(self, rows: list[dict[str, Any]], prefixes: tuple[str, ...]) -> Columns:
        """The 2B sequences one after another (padded rows, or back to back when flat)."""
        sequences = [
            {
                "input_ids": r[f"{p}input_ids"],
                "labels": r[f"{p}labels"],
                "attention_mask": r.get(f"{p}attention_mask") or [1] * len(r[f"{p}input_ids"]),
                MEDIA_COLUMN: r.get(f"{p}{MEDIA_COLUMN}"),
            }
            for p in prefixes
            for r in rows
        ]
        return self.sequences(sequences)

    def groups(self, groups: list[list[dict[str, Any]]]) -> Columns:
        """Groups of sequences that begin with the same prompt (an RL rollout's answers to each prompt), numbered
        in order: on one copy of each prompt under a shared-prefix layout, else as `sequences` collates them."""
        if self.layout.shared_prefix:
            return shared_prompt_groups([[(s["input_ids"], s["labels"]) for s in group] for group in groups])
        return self.sequences([s for group in groups for s in group])

    def sequences(self, sequences: list[dict[str, Any]]) -> Columns:
        """S sequences ({input_ids, labels[, attention_mask]}) collated one per row, or back to back when flat, with
        `sequence_ids` and `sequence_ends` among the targets (the RL objectives collate their completions so)."""
        model_inputs, targets = self._plain(sequences)
        lengths = torch.tensor([len(s["input_ids"]) for s in sequences], dtype=torch.long)
        width = model_inputs["input_ids"].shape[1]
        targets["sequence_ids"], targets["sequence_ends"] = sequence_layout(lengths, width, self.layout.flat)
        return model_inputs, targets


def rope_rows(rope: RopePositions, rows: list[dict[str, Any]], media: list[bytes | None],
              packed: bool) -> list[torch.Tensor]:
    """Each row's 3-D rope positions (3, n): the model's own placement of the whole row, each packed piece then
    moved to start at 0 (all three rows of a piece are offset by the same start, so each piece gets exactly
    the positions it would get alone). A row without media: its 1-D positions, three times."""
    out = []
    for row, blob in zip(rows, media, strict=True):
        text = own_positions(row) if packed else list(range(len(row["input_ids"])))
        inputs = generate_inputs(blob)
        if not inputs:
            out.append(torch.tensor(text, dtype=torch.long).expand(3, -1))
            continue
        placed = rope(torch.tensor([row["input_ids"]], dtype=torch.long), inputs).clone()
        starts = [i for i, p in enumerate(text) if p == 0] + [len(text)]
        for a, b in itertools.pairwise(starts):
            placed[:, a:b] -= placed[:, a : a + 1].clone()
        out.append(placed)
    return out


def own_positions(row: dict[str, Any]) -> list[int]:
    """A packed row's position ids (a row of one sample, without the column, counts from 0)."""
    return list(row["position_ids"]) if "position_ids" in row else list(range(len(row["input_ids"])))


def shared_prefix_len(*sequences: tuple[list, list]) -> int:
    """Leading tokens all sequences share, none of them a target (so their hidden states serve all of them);
    at least one token of each sequence stays its own."""
    limit = min(len(ids) for ids, _ in sequences) - 1
    (first_ids, _), n = sequences[0], 0
    while n < limit and all(ids[n] == first_ids[n] and labels[n] == IGNORE_INDEX for ids, labels in sequences):
        n += 1
    return n


def shared_prompt_batch(rows: list[dict[str, Any]], prefixes: tuple[str, ...]) -> Columns:
    """B preference rows -> one padding-free row where each row's two sequences share their prompt
    (shared_prompt_groups; sequence k of row b is sequence k * B + b, the contract's order: all A's, then all B's)."""
    count = len(rows)
    groups = [[(list(r[f"{p}input_ids"]), list(r[f"{p}labels"])) for p in prefixes] for r in rows]
    return shared_prompt_groups(groups, lambda b, k: k * count + b)


def shared_prompt_groups(groups: list[list[tuple[list[int], list[int]]]],
                         number: Callable[[int, int], int] | None = None) -> Columns:
    """Groups of sequences (input_ids, labels) that begin with the same prompt -> one padding-free row where
    each group's prompt is computed once.

    Group g becomes [prompt, rest of sequence 1, rest of sequence 2, ...]; every later sequence's position ids
    continue from the prompt, and `shared_prefix` (start, prompt, each rest's length per group, 0 where a group
    has fewer sequences) tells the attention that it sees the prompt but no other sequence. Because one
    position can now predict a token of several sequences, the supervised targets are listed explicitly:
    `target_positions` (the row index of the hidden state that predicts each target), `target_ids`,
    `target_sequences` (its sequence: number(g, k), default the running count); `sequence_ends` as usual.
    """
    offsets = [0]
    for group in groups:
        offsets.append(offsets[-1] + len(group))
    number = number or (lambda g, k: offsets[g] + k)
    width = max(len(group) for group in groups)
    input_ids: list[int] = []
    positions: list[int] = []
    shape, ends = [], [0] * offsets[-1]
    target_positions: list[int] = []
    target_ids: list[int] = []
    target_sequences: list[int] = []
    for g, group in enumerate(groups):
        shared, start = shared_prefix_len(*group), len(input_ids)
        input_ids += group[0][0][:shared]
        positions += list(range(shared))
        rests = []
        for k, (ids, labels) in enumerate(group):
            own = len(input_ids) - shared  # token j >= shared of this sequence sits at own + j
            input_ids += ids[shared:]
            positions += list(range(shared, len(ids)))
            rests.append(len(ids) - shared)
            where = [start + j if j < shared else own + j for j in range(len(ids))]  # each token's row index
            for j in range(1, len(ids)):
                if labels[j] != IGNORE_INDEX:
                    target_positions.append(where[j - 1])
                    target_ids.append(labels[j])
                    target_sequences.append(number(g, k))
            ends[number(g, k)] = where[-1]
        shape.append([start, shared, *rests] + [0] * (width - len(group)))
    model_inputs = {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "shared_prefix": torch.tensor(shape, dtype=torch.long),
    }
    return model_inputs, {
        "sequence_ends": torch.tensor(ends, dtype=torch.long),
        "target_positions": torch.tensor(target_positions, dtype=torch.long),
        "target_ids": torch.tensor(target_ids, dtype=torch.long),
        "target_sequences": torch.tensor(target_sequences, dtype=torch.long),
    }


def flatten(rows: list[dict[str, Any]], packed: bool = False) -> Columns:
    """Rows (plain or packed) -> one padding-free row with position ids and sequence boundaries."""
    input_ids, labels, positions = [], [], []
    for r in rows:
        ids = list(r["input_ids"])
        input_ids += ids
        labels += list(r.get("labels", ids))
        positions += own_positions(r) if packed else list(range(len(ids)))
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    if starts[0] != 0:
        raise ValueError("a packed row must start a sequence (position id 0) at its first token")
    cu_seq_lens = torch.tensor(starts, dtype=torch.int32)
    longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    model_inputs = {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    return model_inputs, {"labels": torch.tensor([labels], dtype=torch.long)}


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
