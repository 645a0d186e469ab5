"""build() and preview() for the preference stages: row layouts, stats, stage checks, KL batches, demo data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneforge.batch import Layout
from tuneforge.data import build, preview
from tuneforge.data.collate import Collator
from tuneforge.errors import DataError

X = -100
REPO_DATA = Path(__file__).resolve().parents[2] / "data"
PAIRWISE_COLUMNS = [
    f"{p}_{c}" for p in ("chosen", "rejected") for c in ("input_ids", "labels", "attention_mask")
]
FEEDBACK_COLUMNS = [f"{p}{c}" for p in ("", "kl_") for c in ("input_ids", "labels", "attention_mask")] + [
    "kto_tag"
]
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
RANKING_ENTRY = {
    "ranking": True,
    "formatting": "sharegpt",
    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
}


def pair(prompt, chosen, rejected):
    return {
        "conversations": [{"from": "human", "value": prompt}],
        "chosen": {"from": "gpt", "value": chosen},
        "rejected": {"from": "gpt", "value": rejected},
    }


def counted(rows, prefixes):
    """(tokens, supervised tokens) of rows, by hand: every sequence, each one's first label not counted."""
    tokens = sum(len(r[f"{p}input_ids"]) for r in rows for p in prefixes)
    learn = sum(sum(label != X for label in r[f"{p}labels"][1:]) for r in rows for p in prefixes)
    return tokens, learn


def apply_template(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]


def test_dpo_en_demo_builds_pairwise_rows(tokenizer, home, lf_data_dir, make_cfg):
    raw = json.loads((lf_data_dir / "dpo_en_demo.json").read_text())[:16]
    splits = build(
        make_cfg(lf_data_dir, dataset="dpo_en_demo", stage="dpo", max_samples=16, cutoff_len=8192), tokenizer
    )
    assert splits.train.column_names == PAIRWISE_COLUMNS
    rows = [dict(r) for r in splits.train]
    assert len(rows) == 16 and splits.stats["datasets"]["dpo_en_demo"]["truncated"] == 0
    for row, source in zip(rows, raw, strict=True):
        prompt = [{"role": ROLES[m["from"]], "content": m["value"]} for m in source["conversations"]]
        for key in ("chosen", "rejected"):
            answer = {"role": "assistant", "content": source[key]["value"]}
            assert row[f"{key}_input_ids"] == apply_template(tokenizer, prompt + [answer])
    assert (splits.stats["tokens"], splits.stats["supervised_tokens"]) == counted(
        rows, ("chosen_", "rejected_")
    )
    assert splits.stats["packing"] is False and splits.stats["packed_rows"] == 0

    cut = build(
        make_cfg(lf_data_dir, dataset="dpo_en_demo", stage="rm", max_samples=16, cutoff_len=256), tokenizer
    )
    assert cut.stats["datasets"]["dpo_en_demo"]["truncated"] > 0
    for row in cut.train:
        assert max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"])) <= 256
        start = next(i for i, label in enumerate(row["chosen_labels"]) if label != X)
        assert row["rejected_input_ids"][:start] == row["chosen_input_ids"][:start]
        assert set(row["rejected_labels"][:start]) == {X}


def test_kto_en_demo_builds_feedback_rows_with_kl_pairs(tokenizer, home, lf_data_dir, make_cfg):
    raw = json.loads((lf_data_dir / "kto_en_demo.json").read_text())[:16]
    splits = build(
        make_cfg(lf_data_dir, dataset="kto_en_demo", stage="kto", max_samples=16, cutoff_len=8192), tokenizer
    )
    assert splits.train.column_names == FEEDBACK_COLUMNS
    rows = [dict(r) for r in splits.train]
    assert [r["kto_tag"] for r in rows] == [int(s["label"]) for s in raw]
    for i, (row, source) in enumerate(zip(rows, raw, strict=True)):
        assert row["input_ids"] == apply_template(tokenizer, source["messages"])
        other = raw[(i + 1) % 16]["messages"][-1]  # one batch of 16 rows: the next row's answer
        assert row["kl_input_ids"] == apply_template(tokenizer, source["messages"][:-1] + [other])
    assert (splits.stats["tokens"], splits.stats["supervised_tokens"]) == counted(rows, ("", "kl_"))


def test_kl_pairs_follow_the_encoding_batches_and_the_cache_key_knows(tokenizer, home, make_cfg):
    one_batch = build(make_cfg(REPO_DATA, dataset="kto_demo", stage="kto", max_samples=8), tokenizer)
    in_fours = build(
        make_cfg(REPO_DATA, dataset="kto_demo", stage="kto", max_samples=8, preprocessing_batch_size=4),
        tokenizer,
    )
    assert in_fours.stats["cache_hit"] is False
    kl, own = in_fours.train["kl_input_ids"], in_fours.train["input_ids"]
    answer_of = {i: tokenizer.decode(ids).split("assistant\n")[-1] for i, ids in enumerate(own)}
    kl_answer = [tokenizer.decode(ids).split("assistant\n")[-1] for ids in kl]
    assert kl_answer == [answer_of[j] for j in (1, 2, 3, 0, 5, 6, 7, 4)]  # each batch of four wraps around
    assert one_batch.train["kl_input_ids"][3] != kl[3]


def test_kl_pairs_stay_in_one_process_where_workers_are_unset(tokenizer, home, make_cfg, monkeypatch):
    # the pairs follow each process's share of the rows, so the cores of the machine must not choose them
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("tuneforge.data.pipeline.AUTO_ROWS_PER_WORKER", 2)
    keys = {"dataset": "kto_demo", "stage": "kto", "max_samples": 8}
    one = build(make_cfg(REPO_DATA, preprocessing_num_workers=1, **keys), tokenizer)
    unset = build(make_cfg(REPO_DATA, overwrite_cache=True, **keys), tokenizer)
    assert unset.stats["cache_hit"] is False
    assert unset.train["kl_input_ids"][:] == one.train["kl_input_ids"][:]
    two = build(make_cfg(REPO_DATA, preprocessing_num_workers=2, **keys), tokenizer)
    assert two.train["kl_input_ids"][:] != one.train["kl_input_ids"][:]  # two processes pair within halves


def test_the_collator_takes_built_rows(tokenizer, home, make_cfg):
    splits = build(make_cfg(REPO_DATA, dataset="dpo_demo", stage="dpo", max_samples=4), tokenizer)
    rows = [splits.train[i] for i in range(3)]
    batch = Collator(tokenizer.pad_token_id, Layout(rows="pairwise"))(rows)
    assert batch.model_inputs["input_ids"].shape[0] == 6
    ends = batch.model_inputs["input_ids"].view(-1)[batch.targets["sequence_ends"]]
    assert ends.tolist() == [198] * 6  # every sequence ends with the newline after <|im_end|>


@pytest.mark.parametrize(
    "dataset,stage,problem",
    [
        (
            "plain",
            "dpo",
            "dataset 'plain' is a plain dataset .* stage dpo .* needs a ranking dataset \\(ranking: true "
            "with chosen/rejected columns\\)",
        ),
        ("plain", "rm", "stage rm cannot train on: it needs a ranking dataset"),
        (
            "plain",
            "kto",
            "dataset 'plain' is a plain dataset .* needs a feedback dataset \\(a kto_tag column",
        ),
        ("pairs", "kto", "dataset 'pairs' is a ranking dataset .* stage kto .* needs a feedback dataset"),
        ("judged", "dpo", "dataset 'judged' is a feedback dataset .* needs a ranking dataset"),
        ("pairs", "sft", "dataset 'pairs' is a ranking dataset .* stage sft cannot train on"),
    ],
)
def test_stage_and_dataset_mismatch_is_caught_before_reading_rows(
    tokenizer, home, tmp_path, make_cfg, dataset, stage, problem
):
    info = {  # none of these files exist: the mismatch is found from dataset_info.json alone
        "plain": {"file_name": "missing.json"},
        "pairs": {"file_name": "missing.json", **RANKING_ENTRY},
        "judged": {"file_name": "missing.json", "columns": {"prompt": "p", "response": "r", "kto_tag": "t"}},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match=problem):
        build(make_cfg(tmp_path, dataset=dataset, stage=stage), tokenizer)


def test_ranking_needs_its_chosen_and_rejected_columns_named(
    tokenizer, home, tmp_path, write_dataset, make_cfg
):
    write_dataset(tmp_path / "d", "pairs", [pair("q", "a", "b")], {"ranking": True, "formatting": "sharegpt"})
    with pytest.raises(DataError, match="dataset 'pairs' has ranking: true, so columns must name its chosen"):
        build(make_cfg(tmp_path / "d", dataset="pairs", stage="dpo"), tokenizer)


def test_alpaca_ranking_dataset(tokenizer, home, tmp_path, write_dataset, make_cfg):
    rows = [
        {
            "instruction": "Capital of France?",
            "input": "",
            "better": "Paris.",
            "worse": "Rome.",
            "sys": "Be brief.",
        },
        {
            "instruction": "2 + 2?",
            "input": "Answer with a digit.",
            "better": "4",
            "worse": "5",
            "sys": "Be brief.",
        },
    ]
    entry = {
        "ranking": True,
        "columns": {
            "prompt": "instruction",
            "query": "input",
            "chosen": "better",
            "rejected": "worse",
            "system": "sys",
        },
    }
    write_dataset(tmp_path / "d", "alp_pairs", rows, entry)
    splits = build(make_cfg(tmp_path / "d", dataset="alp_pairs", stage="dpo"), tokenizer)
    for row, source in zip(splits.train, rows, strict=True):
        user = "\n".join(p for p in (source["instruction"], source["input"]) if p)
        prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]
        for key, column in (("chosen", "better"), ("rejected", "worse")):
            expected = apply_template(tokenizer, prompt + [{"role": "assistant", "content": source[column]}])
            assert row[f"{key}_input_ids"] == expected
            learned = [
                t
                for t, label in zip(row[f"{key}_input_ids"], row[f"{key}_labels"], strict=True)
                if label != X
            ]
            assert tokenizer.decode(learned) == source[column] + "<|im_end|>"


def test_dropped_and_bad_pairs_are_counted(tokenizer, home, tmp_path, write_dataset, make_cfg):
    rows = [
        pair("short", "ok", "no"),
        # a huge prompt: the answers' share int(40 * a / (p + a)) is 0, nothing left to learn
        pair("word " * 1200, "fine " * 25, "bad " * 25),
        {**pair("q", "a", "b"), "chosen": None},
        {
            **pair("q", "a", "b"),
            "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
        },
    ]
    write_dataset(tmp_path / "d", "pairs", rows, RANKING_ENTRY)
    splits = build(
        make_cfg(tmp_path / "d", dataset="pairs", stage="dpo", cutoff_len=40, skip_bad_rows=True), tokenizer
    )
    assert splits.stats["datasets"]["pairs"] == {
        "rows": 4,
        "bad_rows": 2,
        "dropped_by_truncation": 1,
        "truncated": 0,
        "empty_documents": 0,
        "samples": 1,
    }
    assert (splits.stats["bad_rows"], splits.stats["dropped_by_truncation"], len(splits.train)) == (2, 1, 1)


def test_the_pipeline_never_packs_preference_rows(tokenizer, home, make_cfg):
    cfg = make_cfg(REPO_DATA, dataset="dpo_demo", packing=True, max_samples=4)  # valid for sft ...
    cfg.method.stage = (
        "dpo"  # ... and config validation refuses it for dpo; the pipeline must not pack anyway
    )
    splits = build(cfg, tokenizer)
    assert splits.stats["packing"] is False and len(splits.train) == 4
    assert splits.train.column_names == PAIRWISE_COLUMNS


def test_preview_shows_both_renderings_and_the_kto_tag(tokenizer, home, tmp_path, write_dataset, make_cfg):
    write_dataset(tmp_path / "d", "pairs", [pair("Hi", "Hello there", "Go away")], RANKING_ENTRY)
    (text,) = preview(make_cfg(tmp_path / "d", dataset="pairs", stage="dpo"), tokenizer, n=3)
    head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chosen, rejected = text.split("\n[rejected]\n")
    assert chosen.startswith("[chosen]\n<|im_start|>system\n")
    assert chosen.endswith(head + "⟦Hello there<|im_end|>⟧\n")
    assert rejected.endswith(head + "⟦Go away<|im_end|>⟧\n")
    texts = preview(make_cfg(REPO_DATA, dataset="kto_demo", stage="kto"), tokenizer, n=2)
    assert texts[0].startswith("[kto_tag: true (desirable)]\n")
    assert texts[0].endswith("<|im_start|>assistant\n⟦The capital of Japan is Tokyo.<|im_end|>⟧\n")
    assert texts[1].startswith("[kto_tag: false (undesirable)]\n")


def test_our_demo_datasets(tokenizer, home, make_cfg):
    dpo = json.loads((REPO_DATA / "dpo_demo.json").read_text())
    kto = json.loads((REPO_DATA / "kto_demo.json").read_text())
    assert len(dpo) >= 60 and len(kto) >= 60
    answers = [r[k]["value"] for r in dpo for k in ("chosen", "rejected")] + [
        r["messages"][-1]["content"] for r in kto
    ]
    assert max(len(a.split()) for a in answers) < 60
    assert all(r["chosen"]["value"] != r["rejected"]["value"] for r in dpo)
    assert 0.4 <= sum(r["label"] for r in kto) / len(kto) <= 0.6
    for name, stage in (("dpo_demo", "dpo"), ("kto_demo", "kto")):
        stats = build(make_cfg(REPO_DATA, dataset=name, stage=stage), tokenizer).stats["datasets"][name]
        assert stats["bad_rows"] == stats["dropped_by_truncation"] == stats["truncated"] == 0
        assert stats["samples"] == stats["rows"] >= 60
