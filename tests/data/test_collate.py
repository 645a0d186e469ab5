"""Collator: right padding, label padding, pad_to_multiple_of, and packed rows' position ids."""

from __future__ import annotations

import pytest
import torch

from tuneforge.batch import Layout
from tuneforge.data.collate import Collator

X = -100
PACKED, FLAT = Layout(packed=True), Layout(flat=True, packed=True)


def columns(batch):
    """A collated Batch's model inputs and targets in one mapping, to read them by name."""
    return {**batch.model_inputs, **batch.targets}


def test_plain_rows_are_right_padded_with_an_attention_mask():
    rows = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [X, 6, 7]},
        {"input_ids": [8], "attention_mask": [1], "labels": [8]},
    ]
    batch = columns(Collator(pad_token_id=0)(rows))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[X, 6, 7], [8, X, X]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_pad_to_multiple_of():
    batch = columns(Collator(pad_token_id=2, pad_to_multiple_of=4)([{"input_ids": [1] * 5, "labels": [1] * 5}]))
    assert batch["input_ids"].shape == (1, 8)
    assert batch["input_ids"][0, 5:].tolist() == [2, 2, 2]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3]


def test_packed_rows_get_position_ids_and_no_attention_mask():
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [X, 2, X, X, 5], "position_ids": [0, 1, 0, 1, 2]},
        {"input_ids": [6, 7], "labels": [X, 7], "position_ids": [0, 1]},
    ]
    batch = columns(Collator(pad_token_id=0, layout=PACKED)(rows))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    # padding continues as a fresh run from 0, so it is a block of its own in the block-diagonal mask
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 0, 1, 2]]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert batch["labels"].tolist() == [[X, 2, X, X, 5], [X, 7, X, X, X]]


def test_packed_padding_is_its_own_sequence_for_transformers():
    from transformers.masking_utils import find_packed_sequence_indices

    rows = [
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "position_ids": [0, 1, 2]},
        {"input_ids": [4, 5], "labels": [4, 5], "position_ids": [0, 0]},
    ]
    batch = columns(Collator(pad_token_id=0, layout=PACKED, pad_to_multiple_of=4)(rows))
    assert find_packed_sequence_indices(batch["position_ids"]).tolist() == [[0, 0, 0, 1], [0, 1, 2, 2]]


def test_empty_batch_and_missing_pad_id():
    with pytest.raises(ValueError):
        Collator(pad_token_id=0)([])
    with pytest.raises(ValueError, match="pad_token_id"):
        Collator(pad_token_id=None)


def test_padding_free_puts_the_batch_in_one_row_with_sequence_boundaries():
    rows = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [X, 6, 7]},
        {"input_ids": [8], "attention_mask": [1], "labels": [8]},
        {"input_ids": [1, 2, 3, 4], "labels": [X, 2, X, 4], "position_ids": [0, 1, 0, 1]},  # packed
    ]
    batch = columns(Collator(pad_token_id=0, layout=FLAT)(rows))
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[X, 6, 7, 8, X, 2, X, 4]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    # four sequences: the packed row's two pieces stay apart
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 6, 8]
    assert batch["cu_seq_lens_q"].dtype == torch.int32  # what flash-attention's varlen kernel takes
    assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
    assert batch["max_length_q"] == batch["max_length_k"] == 3


def test_padding_free_refuses_a_packed_row_that_starts_mid_sequence():
    with pytest.raises(ValueError, match="position id 0"):
        Collator(pad_token_id=0, layout=FLAT)([{"input_ids": [1, 2], "position_ids": [1, 2]}])
