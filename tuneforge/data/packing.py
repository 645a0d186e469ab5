"""Packing: several samples (sft) or documents (pt) in one row of at most cutoff_len tokens.

A packed row carries `position_ids` that restart at 0 for each piece; with no attention_mask the model
builds a block-diagonal causal mask from them (transformers' find_packed_sequence_indices), so no piece
attends to another. The label of each piece's first token is -100: inside its own sample nothing
precedes it, so only the previous sample's last token could "predict" it — which unpacked training
never does. Packed loss therefore equals unpacked loss.

A vision-language model's samples pack with their media (mm_inputs joined in piece order), for the families whose
samples stay apart in one row (model.multimodal.media_packing_refusal; the workflow asks before tokenizing).

pt differs from LlamaFactory here on purpose: LlamaFactory concatenates documents with attention across
them; we give each document its own positions and attention, the same as sft packing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tuneforge.data import arrow_batch
from tuneforge.data.encode import IGNORE_INDEX, row_features
from tuneforge.data.multimodal import MEDIA_COLUMN, join_blobs
from tuneforge.errors import DataError

Piece = tuple[int, int, int]  # (sample index, start, end) in the source dataset


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of sample indices) of total length <= capacity: longest first, each into the first bin
    with room. Deterministic (ties keep input order); O(n log n) through a max-tree over the bins."""
    n = len(lengths)
    if n == 0:
        return []
    if max(lengths) > capacity:
        raise ValueError(f"a sample of {max(lengths)} tokens cannot fit in rows of {capacity}")
    size = 1
    while size < n:
        size *= 2
    room = [-1] * (2 * size)  # room[node] = the most room left in any bin under node
    for leaf in range(n):
        room[size + leaf] = capacity
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    bins: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(n), key=lambda k: (-lengths[k], k)):
        node = 1
        while node < size:  # walk to the leftmost bin with enough room
            node = 2 * node if room[2 * node] >= lengths[i] else 2 * node + 1
        bins[node - size].append(i)
        room[node] -= lengths[i]
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return [b for b in bins if b]


def sequential_pieces(lengths: list[int], capacity: int, *, across_documents: bool) -> list[list[Piece]]:
    """Documents in order, cut into rows of `capacity` tokens; a long document continues in the next row.

    across_documents=False starts every document in a new row (one document per row, split if long).
    """
    rows: list[list[Piece]] = []
    row: list[Piece] = []
    room = capacity
    for doc, n in enumerate(lengths):
        if not across_documents and row:
            rows.append(row)
            row, room = [], capacity
        start = 0
        while start < n:
            take = min(room, n - start)
            row.append((doc, start, start + take))
            start += take
            room -= take
            if room == 0:
                rows.append(row)
                row, room = [], capacity
    if row:
        rows.append(row)
    return rows


def bins_to_pieces(bins: list[list[int]], lengths: list[int]) -> list[list[Piece]]:
    return [[(i, 0, lengths[i]) for i in b] for b in bins]


def assemble_batch(batch: dict[str, list], *, source: Any, packed: bool) -> dict[str, list]:
    """Rows from their pieces, as lists. Without `labels` in the source (pt), labels are the input ids."""
    return assemble_table(batch, source=source, packed=packed).to_pydict()


def assemble_table(batch: dict[str, list], *, source: Any, packed: bool) -> pa.Table:
    """Rows from their pieces, as a table: every piece's tokens gathered from the source's columns in one numpy
    indexing (a row by row copy in Python took ~30 % of a pretraining corpus's data step)."""
    plans = batch["pieces"]
    wanted = sorted({doc for plan in plans for doc, _, _ in plan})
    where = {doc: k for k, doc in enumerate(wanted)}
    fetched = source.select(wanted).with_format("arrow")[:]
    pieces = np.array([(where[doc], start, end) for plan in plans for doc, start, end in plan],
                      dtype=np.int64).reshape(-1, 3)
    lengths = pieces[:, 2] - pieces[:, 1]
    piece_starts = np.zeros(len(pieces) + 1, dtype=np.int64)  # where each piece begins in the batch's tokens
    np.cumsum(lengths, out=piece_starts[1:])
    if piece_starts[-1] > arrow_batch.MAX_OFFSET:
        raise DataError(f"a batch of {len(plans)} rows holds {piece_starts[-1]:,} tokens, more than a column of "
                        f"rows can; lower preprocessing_batch_size")
    ids, source_starts = _flat(fetched["input_ids"])
    within = np.arange(piece_starts[-1]) - np.repeat(piece_starts[:-1], lengths)  # each token's place in its piece
    gather = within + np.repeat(source_starts[pieces[:, 0]] + pieces[:, 1], lengths)
    input_ids = ids[gather]
    labels = _flat(fetched["labels"])[0][gather] if "labels" in fetched.column_names else input_ids.copy()
    if packed:
        labels[piece_starts[:-1][lengths > 0]] = IGNORE_INDEX
    rows = np.fromiter(map(len, plans), dtype=np.int64, count=len(plans))
    row_starts = piece_starts[np.concatenate(([0], np.cumsum(rows)))]
    columns = {  # the map casts them to the row features' types
        "input_ids": arrow_batch.list_array(row_starts, input_ids),
        "labels": arrow_batch.list_array(row_starts, labels),
        "attention_mask": arrow_batch.list_array(row_starts, np.ones(len(input_ids), dtype=np.int8)),
    }
    if packed:
        columns["position_ids"] = arrow_batch.list_array(row_starts, within)
    if MEDIA_COLUMN in fetched.column_names:  # a vision-language model's samples: their tensors join with them
        media = fetched[MEDIA_COLUMN].to_pylist()
        columns[MEDIA_COLUMN] = pa.array([join_blobs([media[where[doc]] for doc, _, _ in plan]) for plan in plans],
                                         pa.binary())
    return pa.table(columns)


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column's values back to back, and where each row begins among them."""
    lists = column.combine_chunks()
    starts = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(pc.list_value_length(lists).to_numpy(zero_copy_only=False), out=starts[1:])
    return lists.flatten().to_numpy(zero_copy_only=False), starts


def assemble(
    source: Any,
    plan: list[list[Piece]],
    *,
    packed: bool,
    num_proc: int | None,
    batch_size: int,
    fingerprint: str,
    cache_file: str | None = None,
) -> Any:
    """A Dataset of rows built from `plan` over the samples / documents of `source`, written to cache_file (then
    memory-mapped) where given, else held in memory."""
    import datasets

    plan_ds = datasets.Dataset.from_dict({"pieces": [[list(p) for p in row] for row in plan]})
    features = row_features(packed, media=MEDIA_COLUMN in source.column_names)
    return plan_ds.map(
        assemble_table,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        fn_kwargs={"source": source, "packed": packed},
        remove_columns=["pieces"],
        features=features,
        new_fingerprint=fingerprint,
        cache_file_name=cache_file,
        load_from_cache_file=False,
        desc="packing" if packed else "chunking",
    )


def pack_samples(source: Any, cutoff_len: int, **kw: Any) -> Any:
    """sft packing: samples bin-packed (first-fit decreasing) into rows of at most cutoff_len tokens."""
    lengths = _lengths(source)
    return assemble(
        source, bins_to_pieces(first_fit_decreasing(lengths, cutoff_len), lengths), packed=True, **kw
    )


def chunk_documents(source: Any, cutoff_len: int, *, packed: bool, **kw: Any) -> Any:
    """pt: documents concatenated in order and cut into cutoff_len rows (packed), or one document per row."""
    plan = sequential_pieces(_lengths(source), cutoff_len, across_documents=packed)
    return assemble(source, plan, packed=packed, **kw)


def _lengths(source: Any) -> list[int]:
    import pyarrow.compute as pc

    lengths: list[int] = []
    for table in source.with_format("arrow").iter(batch_size=10_000):
        lengths += pc.list_value_length(table["input_ids"]).to_pylist()
    return lengths
