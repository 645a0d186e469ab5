"""Collator on preference rows: S = 2B sequences, padded or padding-free, with the objectives' extra keys."""

from __future__ import annotations

import pytest
import torch

from tuneforge.batch import Layout
from tuneforge.data.collate import Collator

X = -100
PAIRED, PAIRED_FLAT = Layout(rows="pairwise"), Layout(rows="pairwise", flat=True)
FED, FED_FLAT = Layout(rows="feedback"), Layout(rows="feedback", flat=True)


def columns(batch):
    """A collated Batch's model inputs and targets in one mapping, to read them by name."""
    return {**batch.model_inputs, **batch.targets}
PAIRS = [
    {
        "chosen_input_ids": [1, 2, 3],
        "chosen_labels": [X, 2, 3],
        "chosen_attention_mask": [1, 1, 1],
        "rejected_input_ids": [1, 2, 4, 5],
        "rejected_labels": [X, X, 4, 5],
        "rejected_attention_mask": [1, 1, 1, 1],
    },
    {
        "chosen_input_ids": [6, 7],
        "chosen_labels": [X, 7],
        "chosen_attention_mask": [1, 1],
        "rejected_input_ids": [6, 8, 9],
        "rejected_labels": [X, 8, 9],
        "rejected_attention_mask": [1, 1, 1],
    },
]
FEEDBACK = [
    {
        "input_ids": [1, 2],
        "labels": [X, 2],
        "attention_mask": [1, 1],
        "kl_input_ids": [1, 3, 4],
        "kl_labels": [X, 3, 4],
        "kl_attention_mask": [1, 1, 1],
        "kto_tag": 1,
        "ref_logps": -1.5,
        "ref_kl_logps": -2.5,
    },
    {
        "input_ids": [5, 6, 7],
        "labels": [X, 6, 7],
        "attention_mask": [1, 1, 1],
        "kl_input_ids": [5, 8],
        "kl_labels": [X, 8],
        "kl_attention_mask": [1, 1],
        "kto_tag": 0,
        "ref_logps": -0.5,
        "ref_kl_logps": -3.0,
    },
]


def test_pairwise_rows_pad_as_chosen_then_rejected_sequences():
    batch = columns(Collator(pad_token_id=0, layout=PAIRED)(PAIRS))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "sequence_ids", "sequence_ends"}
    # order: chosen_0, chosen_1, rejected_0, rejected_1
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [6, 7, 0, 0], [1, 2, 4, 5], [6, 8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[X, 2, 3, X], [X, 7, X, X], [X, X, 4, 5], [X, 8, 9, X]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, -1], [1, 1, -1, -1], [2, 2, 2, 2], [3, 3, 3, -1]]
    assert batch["sequence_ends"].tolist() == [2, 5, 11, 14]  # row * 4 + length - 1
    assert batch["input_ids"].view(-1)[batch["sequence_ends"]].tolist() == [3, 7, 5, 9]
    assert all(batch[k].dtype == torch.long for k in batch)


def test_pairwise_rows_padding_free():
    batch = columns(Collator(pad_token_id=0, layout=PAIRED_FLAT)(PAIRS))
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[1, 2, 3, 6, 7, 1, 2, 4, 5, 6, 8, 9]]
    assert batch["labels"].tolist() == [[X, 2, 3, X, 7, X, X, 4, 5, X, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 12] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 4
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]]
    assert batch["sequence_ends"].tolist() == [2, 4, 8, 11]


def test_feedback_rows_carry_tags_and_reference_log_probs():
    batch = columns(Collator(pad_token_id=0, layout=FED, pad_to_multiple_of=4)(FEEDBACK))
    # order: completion_0, completion_1, kl_0, kl_1
    assert batch["input_ids"].tolist() == [[1, 2, 0, 0], [5, 6, 7, 0], [1, 3, 4, 0], [5, 8, 0, 0]]
    assert batch["labels"].tolist() == [[X, 2, X, X], [X, 6, 7, X], [X, 3, 4, X], [X, 8, X, X]]
    assert batch["sequence_ends"].tolist() == [1, 6, 10, 13]
    assert batch["sequence_ids"].tolist() == [[0, 0, -1, -1], [1, 1, 1, -1], [2, 2, 2, -1], [3, 3, -1, -1]]
    assert batch["kto_tags"].tolist() == [1, 0] and batch["kto_tags"].dtype == torch.long
    assert batch["ref_logps"].dtype == torch.float32
    assert batch["ref_logps"].tolist() == [-1.5, -0.5, -2.5, -3.0]
    flat = columns(Collator(pad_token_id=0, layout=FED_FLAT)(FEEDBACK))
    assert flat["input_ids"].tolist() == [[1, 2, 5, 6, 7, 1, 3, 4, 5, 8]]
    assert flat["sequence_ends"].tolist() == [1, 4, 7, 9]
    assert flat["kto_tags"].tolist() == [1, 0] and flat["ref_logps"].tolist() == [-1.5, -0.5, -2.5, -3.0]


def test_pairwise_reference_log_probs_follow_the_sequence_order():
    rows = [
        {**PAIRS[0], "ref_chosen_logps": -1.0, "ref_rejected_logps": -4.0},
        {**PAIRS[1], "ref_chosen_logps": -2.0, "ref_rejected_logps": -8.0},
    ]
    assert Collator(pad_token_id=0, layout=PAIRED)(rows).targets["ref_logps"].tolist() == [-1.0, -2.0, -4.0, -8.0]
    assert "ref_logps" not in columns(Collator(pad_token_id=0, layout=PAIRED)(PAIRS))
    with pytest.raises(ValueError, match="some rows of the batch carry reference log-probs"):
        Collator(pad_token_id=0, layout=PAIRED)([rows[0], PAIRS[1]])


def test_a_batch_cannot_mix_row_layouts():
    with pytest.raises(ValueError, match="mixes row layouts"):
        Collator(pad_token_id=0, layout=PAIRED)([PAIRS[0], FEEDBACK[0]])
    with pytest.raises(ValueError, match="mixes row layouts"):
        Collator(pad_token_id=0)([{"input_ids": [1], "labels": [1]}, PAIRS[0]])
