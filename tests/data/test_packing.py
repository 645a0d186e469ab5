"""Packing: first-fit decreasing bins, document chunks, and packed loss == unpacked loss on a real model."""

from __future__ import annotations

import datasets
import pytest
import torch

from tuneforge.batch import Layout
from tuneforge.data import build
from tuneforge.data.collate import Collator
from tuneforge.data.encode import IGNORE_INDEX
from tuneforge.data.packing import assemble, assemble_batch, first_fit_decreasing, sequential_pieces


def test_first_fit_decreasing_by_hand():
    # longest first: 5 -> bin 0 (room 3), 4 -> bin 1 (room 4), 3 -> bin 0 (room 0), 3 -> bin 1 (room 1),
    # 2 -> bin 2 (room 6), 1 -> bin 1 (room 0)
    assert first_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert first_fit_decreasing([], 8) == []
    assert first_fit_decreasing([8, 8], 8) == [[0], [1]]


def test_first_fit_decreasing_is_valid_on_many_lengths():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = first_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert bins == first_fit_decreasing(list(lengths), 128)  # deterministic


def test_sequential_pieces_by_hand():
    assert sequential_pieces([4, 6, 2], 5, across_documents=True) == [
        [(0, 0, 4), (1, 0, 1)],
        [(1, 1, 6)],
        [(2, 0, 2)],
    ]
    assert sequential_pieces([4, 6, 2], 5, across_documents=False) == [
        [(0, 0, 4)],
        [(1, 0, 5)],
        [(1, 5, 6)],
        [(2, 0, 2)],
    ]



SAMPLES = {"input_ids": [[10, 11, 12], [20, 21], [30, 31, 32, 33]], "labels": [[-100, 11, 12], [-100, 21], [-100, -100, 32, 33]]}
PIECES = [[(2, 0, 4), (0, 0, 3)], [(1, 0, 2)]]


def test_packed_rows_by_hand():
    rows = assemble_batch({"pieces": PIECES}, source=datasets.Dataset.from_dict(SAMPLES), packed=True)
    assert rows == {
        "input_ids": [[30, 31, 32, 33, 10, 11, 12], [20, 21]],
        "labels": [[-100, -100, 32, 33, -100, 11, 12], [-100, 21]],  # each piece's first token: not predicted
        "attention_mask": [[1] * 7, [1, 1]],
        "position_ids": [[0, 1, 2, 3, 0, 1, 2], [0, 1]],
    }


def test_document_chunks_by_hand_labels_are_the_ids():
    docs = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]})
    plan = sequential_pieces([4, 6, 2], 5, across_documents=False)
    rows = assemble_batch({"pieces": plan}, source=docs, packed=False)
    assert rows["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10], [11, 12]]
    assert rows["labels"] == rows["input_ids"] and "position_ids" not in rows
    packed = assemble_batch({"pieces": sequential_pieces([4, 6, 2], 5, across_documents=True)}, source=docs,
                            packed=True)
    assert packed["input_ids"] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    # a document continued from the row before starts its row with a piece: that token is not predicted either
    assert packed["labels"] == [[-100, 2, 3, 4, -100], [-100, 7, 8, 9, 10], [-100, 12]]
    assert packed["position_ids"] == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4], [0, 1]]


def test_assembled_rows_from_a_shuffled_source_are_written_to_their_file(tmp_path):
    source = datasets.Dataset.from_dict(SAMPLES).shuffle(seed=0)  # rows reached through an indices mapping
    order = [source[i]["input_ids"] for i in range(3)]
    target = tmp_path / "rows.arrow"
    rows = assemble(source, [[(0, 0, len(order[0]))], [(2, 1, len(order[2])), (1, 0, 1)]], packed=True, num_proc=None,
                    batch_size=1, fingerprint="test-assemble", cache_file=str(target))
    assert rows.features["input_ids"].feature.dtype == "int32" and rows.features["attention_mask"].feature.dtype == "int8"
    assert rows["input_ids"] == [order[0], order[2][1:] + order[1][:1]]
    assert [f["filename"] for f in rows.cache_files] == [str(target)]  # memory-mapped, not held in memory


CHATS = [
    {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    for q, a in [
        ("Hi", "Hello! How can I help?"),
        ("What is two plus two?", "Four."),
        ("Name a colour.", "Blue, like the sky on a clear day."),
        ("Say yes.", "Yes."),
        ("Count to five.", "One, two, three, four, five."),
        ("Bye", "Goodbye, see you soon!"),
    ]
]


def per_sample_losses(model, rows, pad_id, packed=False):
    """{sample input ids: summed token cross-entropy} for every sample (or packed piece) in rows."""
    batch = Collator(pad_id, Layout(packed=packed))(rows)
    with torch.no_grad():
        logits = model(**batch.model_inputs, use_cache=False).logits
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1),
        batch.targets["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(len(rows), -1)
    losses = {}
    for r, row in enumerate(rows):
        positions = row.get("position_ids", list(range(len(row["input_ids"]))))
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for a, b in zip(starts, starts[1:], strict=False):
            # tokens a+1 .. b-1 of a piece are predicted from the positions before them
            losses[tuple(row["input_ids"][a:b])] = token_loss[r, a : b - 1].sum().item()
    return losses


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_packed_loss_equals_unpacked(
    tokenizer, tiny_model_dir, home, tmp_path, write_dataset, make_cfg, attn, train_on_prompt
):
    from transformers import AutoModelForCausalLM

    write_dataset(tmp_path / "d", "chats", CHATS, {"formatting": "sharegpt"})
    keys = {"dataset": "chats", "cutoff_len": 128, "train_on_prompt": train_on_prompt}
    packed = build(make_cfg(tmp_path / "d", packing=True, **keys), tokenizer)
    plain = build(make_cfg(tmp_path / "d", **keys), tokenizer)
    assert packed.stats["packed_rows"] == len(packed.train) < len(plain.train) == len(CHATS)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation=attn, dtype=torch.float32
    )
    model.eval()
    packed_rows, plain_rows = [dict(r) for r in packed.train], [dict(r) for r in plain.train]
    assert all(len(r["input_ids"]) <= 128 for r in packed_rows)
    packed_losses = per_sample_losses(model, packed_rows, tokenizer.pad_token_id, packed=True)
    plain_losses = per_sample_losses(model, plain_rows, tokenizer.pad_token_id)
    assert packed_losses.keys() == plain_losses.keys()
    # to fp32's rounding of sums near 400 (an ulp is 3e-5; the two layouts' kernels round differently on some CPUs);
    # attention leaking across pieces moves a later piece's loss by 1e-4 relative or more here
    for sample, loss in plain_losses.items():
        assert packed_losses[sample] == pytest.approx(loss, rel=1e-6, abs=1e-5)
    # the loss sees the same supervised tokens either way
    assert packed.stats["supervised_tokens"] == plain.stats["supervised_tokens"]
