"""Stage encoders: sft truncation budgets and drops, pt documents and chunks, stage / dataset kind checks."""

from __future__ import annotations

import pytest

from tuneforge.data import build
from tuneforge.data.encode import IGNORE_INDEX, EncodeSettings, Turn, build_sample, fit_turns, split_budget
from tuneforge.errors import DataError

X = IGNORE_INDEX


@pytest.mark.parametrize(
    "source,target,budget,expected",
    [
        (3, 4, 10, (3, 4)),  # fits: nothing cut
        (30, 6, 20, (14, 6)),  # short response kept whole, prompt cut
        (4, 30, 20, (4, 16)),  # short prompt kept whole, response cut
        (10, 30, 20, (5, 15)),  # both long: cut in proportion, response gets int(20 * 30 / 40)
        (100, 100, 51, (26, 25)),  # int(51 * 100 / 200) = 25 for the response, the rest for the prompt
        (60, 4, 8, (8, 0)),  # a long prompt leaves the response nothing
    ],
)
def test_split_budget(source, target, budget, expected):
    assert split_budget(source, target, budget) == expected


def turns(*lengths):
    out, token = [], 0
    for s, t in lengths:
        src, tgt = list(range(token, token + s)), list(range(token + s, token + s + t))
        token += s + t
        out.append(Turn(src, [X] * s, tgt, list(tgt)))
    return out


def shape(kept):
    return [(len(t.source), len(t.target)) for t in kept]


def test_fit_turns_keeps_whole_turns_then_cuts_one():
    assert shape(fit_turns(turns((3, 2), (4, 5), (6, 6)), 12, keep_last=False)) == [(3, 2), (4, 3)]
    assert shape(fit_turns(turns((3, 2), (4, 5), (6, 6)), 30, keep_last=False)) == [(3, 2), (4, 5), (6, 6)]
    assert shape(fit_turns(turns((3, 2), (4, 5)), 5, keep_last=False)) == [(3, 2)]


def test_fit_turns_for_mask_history_keeps_the_last_turn_first():
    assert shape(fit_turns(turns((3, 2), (4, 5), (6, 6)), 12, keep_last=True)) == [(6, 6)]
    assert shape(fit_turns(turns((3, 2), (4, 5), (6, 6)), 22, keep_last=True)) == [(4, 5), (6, 6)]
    assert shape(fit_turns(turns((3, 2), (4, 5), (6, 6)), 10, keep_last=True)) == [(5, 5)]


def test_build_sample_truncates_and_drops():
    ids = list(range(10, 20))  # prompt 10..15, answer 16..18, trailing newline 19
    full = build_sample(ids, [(6, 9)], EncodeSettings(stage="sft", cutoff_len=10))
    assert full == (ids, [X] * 6 + [16, 17, 18, X], "ok")
    # response 4 (with the newline) < 9 / 2: kept whole, the prompt keeps its first 5 tokens
    cut = build_sample(ids, [(6, 9)], EncodeSettings(stage="sft", cutoff_len=9))
    assert cut == ([10, 11, 12, 13, 14, 16, 17, 18, 19], [X] * 5 + [16, 17, 18, X], "ok_truncated")
    # budget 6: the response gets int(6 * 4 / 10) = 2 tokens
    cut = build_sample(ids, [(6, 9)], EncodeSettings(stage="sft", cutoff_len=6))
    assert cut == ([10, 11, 12, 13, 16, 17], [X, X, X, X, 16, 17], "ok_truncated")
    # budget 2: int(2 * 4 / 10) = 0 response tokens: nothing left to learn
    assert build_sample(ids, [(6, 9)], EncodeSettings(stage="sft", cutoff_len=2)) == ([], [], "dropped")


def test_sft_truncation_on_a_real_sample(tokenizer, home, tmp_path, write_dataset, make_cfg):
    write_dataset(
        tmp_path / "d",
        "one",
        [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there"}]}],
        {"formatting": "sharegpt"},
    )
    full = build(make_cfg(tmp_path / "d", dataset="one"), tokenizer).train[0]
    assert len(full["input_ids"]) == 35  # 31 prompt tokens, "Hello", " there", <|im_end|>, "\n"
    cut = build(make_cfg(tmp_path / "d", dataset="one", cutoff_len=20), tokenizer)
    # the 4-token response is under half the budget: kept whole, the prompt gets 20 - 4 = 16 tokens
    assert cut.train[0]["input_ids"] == full["input_ids"][:16] + [19556, 665, 2, 198]
    assert cut.train[0]["labels"] == [X] * 16 + [19556, 665, 2, X]
    assert cut.stats["datasets"]["one"]["truncated"] == 1


def test_dropped_samples_are_counted(tokenizer, home, tmp_path, write_dataset, make_cfg, caplog):
    rows = [
        {"instruction": "short", "input": "", "output": "ok"},
        # a response over half the budget and a huge prompt: the response's share int(40 * r / (p + r)) is 0
        {"instruction": "word " * 1200, "input": "", "output": "fine " * 25},
    ]
    write_dataset(tmp_path / "d", "mixed", rows)
    splits = build(make_cfg(tmp_path / "d", dataset="mixed", cutoff_len=40), tokenizer)
    assert splits.stats["datasets"]["mixed"]["dropped_by_truncation"] == 1
    assert splits.stats["dropped_by_truncation"] == 1
    assert len(splits.train) == 1 and max(len(r) for r in splits.train["input_ids"]) <= 40
    assert "dropped 1 samples with nothing left to learn" in caplog.text


PT_DOCS = ["one two three", "", "alpha beta gamma delta epsilon", "x"]


def test_pt_chunks_documents_with_own_positions(tokenizer, home, tmp_path, write_dataset, make_cfg):
    # tokens: [537, 827, 1296] + eos 2, [13433, 11345, 16439, 15184, 35592] + 2, [104] + 2: 12 in all
    write_dataset(tmp_path / "d", "docs", PT_DOCS, {"columns": {"prompt": "text"}}, file_name="docs.txt")
    splits = build(make_cfg(tmp_path / "d", dataset="docs", stage="pt", cutoff_len=5), tokenizer)
    rows = [dict(r) for r in splits.train]
    assert [r["input_ids"] for r in rows] == [
        [537, 827, 1296, 2, 13433],
        [11345, 16439, 15184, 35592, 2],
        [104, 2],
    ]
    assert [r["position_ids"] for r in rows] == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4], [0, 1]]
    assert [r["labels"] for r in rows] == [[X, 827, 1296, 2, X], [X, 16439, 15184, 35592, 2], [X, 2]]
    s = splits.stats
    assert (s["tokens"], s["supervised_tokens"], s["packed_rows"], s["samples"]) == (12, 8, 3, 3)
    assert s["datasets"]["docs"]["empty_documents"] == 1


def test_pt_without_packing_keeps_one_document_per_row(tokenizer, home, tmp_path, write_dataset, make_cfg):
    write_dataset(tmp_path / "d", "docs", PT_DOCS, {"columns": {"prompt": "text"}}, file_name="docs.txt")
    splits = build(
        make_cfg(tmp_path / "d", dataset="docs", stage="pt", cutoff_len=5, packing=False), tokenizer
    )
    rows = [dict(r) for r in splits.train]
    assert [r["input_ids"] for r in rows] == [
        [537, 827, 1296, 2],
        [13433, 11345, 16439, 15184, 35592],
        [2],
        [104, 2],
    ]
    assert all(r["labels"] == r["input_ids"] and "position_ids" not in r for r in rows)
    assert splits.stats["packed_rows"] == 0


def test_ranking_and_feedback_datasets_are_refused_by_sft(tokenizer, home, lf_data_dir, make_cfg):
    with pytest.raises(
        DataError, match="dataset 'dpo_en_demo' is a ranking dataset .* stage sft cannot train"
    ):
        build(make_cfg(lf_data_dir, dataset="dpo_en_demo"), tokenizer)
    with pytest.raises(DataError, match="dataset 'kto_en_demo' is a feedback dataset"):
        build(make_cfg(lf_data_dir, dataset="kto_en_demo"), tokenizer)


def test_pt_refuses_sharegpt(tokenizer, home, lf_data_dir, make_cfg):
    with pytest.raises(DataError, match="stage pt reads plain text, but the dataset is sharegpt"):
        build(make_cfg(lf_data_dir, dataset="glaive_toolcall_en_demo", stage="pt"), tokenizer)
