"""The pairwise (rm / dpo) and feedback (kto) encoders: token-exact rendering, labels, truncation, KL pairs."""

from __future__ import annotations

import json

import pytest

from tuneforge.data import template
from tuneforge.data.encode import IGNORE_INDEX, EncodeSettings
from tuneforge.data.encode_pref import (
    Rendered,
    build_group,
    encode_feedback,
    encode_pairwise,
    shared_prompt_len,
)
from tuneforge.data.registry import parse_entry
from tuneforge.errors import DataError

X = IGNORE_INDEX
RANKING = parse_entry(
    "pairs",
    {
        "file_name": "pairs.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    },
)
FEEDBACK = parse_entry(
    "judged",
    {
        "file_name": "judged.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "kto_tag": "label"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    },
)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
PAIR_COLUMNS = [f"{p}_{c}" for p in ("chosen", "rejected") for c in ("input_ids", "labels", "attention_mask")]


def run(encoder, tokenizer, rows, attr, cutoff_len=8192, **settings):
    """The real batched encoder over rows (one batch), as datasets.map calls it."""
    batch = {key: [row.get(key) for row in rows] for key in {k for row in rows for k in row}}
    return encoder(
        batch,
        list(range(len(rows))),
        tokenizer=tokenizer,
        chat=template.resolve_template(None, tokenizer),
        attr=attr,
        settings=EncodeSettings(stage="dpo", cutoff_len=cutoff_len, **settings),
    )


def pair(prompt, chosen, rejected):
    return {
        "conversations": [{"from": "human", "value": prompt}],
        "chosen": {"from": "gpt", "value": chosen},
        "rejected": {"from": "gpt", "value": rejected},
    }


def judged(prompt, answer, label):
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
        "label": label,
    }


def supervised(ids, labels):
    return [t for t, label in zip(ids, labels, strict=True) if label != X]


def reference_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]


def test_dpo_en_demo_is_token_exact_and_learns_only_the_answer(tokenizer, lf_data_dir):
    rows = json.loads((lf_data_dir / "dpo_en_demo.json").read_text())[:40]
    out = run(encode_pairwise, tokenizer, rows, RANKING)
    assert out["_status"] == ["ok"] * len(rows)
    assert {len(r["conversations"]) for r in rows} >= {1, 2, 5}  # plain, with a system message, multi-turn
    for i, row in enumerate(rows):
        prompt = [{"role": SHAREGPT_ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]]
        for key in ("chosen", "rejected"):
            ids, labels = out[f"{key}_input_ids"][i], out[f"{key}_labels"][i]
            answer = row[key]["value"]
            assert ids == reference_ids(tokenizer, prompt + [{"role": "assistant", "content": answer}])
            # only the final turn learns (earlier assistant turns of the prompt do not): content + <|im_end|>
            assert tokenizer.decode(supervised(ids, labels)) == answer + "<|im_end|>"
            assert out[f"{key}_attention_mask"][i] == [1] * len(ids)
        start = out["chosen_labels"][i].index(next(t for t in out["chosen_labels"][i] if t != X))
        assert out["rejected_input_ids"][i][:start] == out["chosen_input_ids"][i][:start]  # one shared prompt


def test_kto_en_demo_is_token_exact_with_its_tag_and_kl_pair(tokenizer, lf_data_dir):
    rows = json.loads((lf_data_dir / "kto_en_demo.json").read_text())[:30]
    out = run(encode_feedback, tokenizer, rows, FEEDBACK)
    assert out["_status"] == ["ok"] * len(rows)
    assert out["kto_tag"] == [int(r["label"]) for r in rows] and 0 in out["kto_tag"] and 1 in out["kto_tag"]
    for i, row in enumerate(rows):
        ids, labels = out["input_ids"][i], out["labels"][i]
        assert ids == reference_ids(tokenizer, row["messages"])
        assert tokenizer.decode(supervised(ids, labels)) == row["messages"][-1]["content"] + "<|im_end|>"
        other = rows[(i + 1) % len(rows)]["messages"][
            -1
        ]  # the next row's answer, the last row takes the first's
        kl_ids = out["kl_input_ids"][i]
        assert kl_ids == reference_ids(tokenizer, row["messages"][:-1] + [other])
        assert tokenizer.decode(supervised(kl_ids, out["kl_labels"][i])) == other["content"] + "<|im_end|>"


# SmolLM2's template with its default system prompt renders the prompt "Hi" as 31 tokens ending with
# "<|im_start|>assistant\n"; the answers are "Hello", " there" and "Go", " away", " now", " please", each then
# <|im_end|> (2) and an unsupervised newline (198).
CHOSEN = [19556, 665, 2, 198]
REJECTED = [6044, 2025, 1209, 5361, 2, 198]


def test_truncation_keeps_one_prompt_for_both_answers(tokenizer):
    row = pair("Hi", "Hello there", "Go away now please")
    full = run(encode_pairwise, tokenizer, [row], RANKING)
    prompt = full["chosen_input_ids"][0][:31]
    assert (
        full["chosen_input_ids"][0] == prompt + CHOSEN and full["rejected_input_ids"][0] == prompt + REJECTED
    )
    # budget 20, longest answer 6 < 20 / 2: answers kept whole, the prompt gets 20 - 6 = 14 tokens in both
    cut = run(encode_pairwise, tokenizer, [row], RANKING, cutoff_len=20)
    assert cut["_status"] == ["ok_truncated"]
    assert cut["chosen_input_ids"][0] == prompt[:14] + CHOSEN
    assert cut["chosen_labels"][0] == [X] * 14 + [19556, 665, 2, X]
    assert cut["rejected_input_ids"][0] == prompt[:14] + REJECTED
    assert cut["rejected_labels"][0] == [X] * 14 + [6044, 2025, 1209, 5361, 2, X]
    # budget 10: both long, the answers get int(10 * 6 / 37) = 1 token each, the prompt 9
    cut = run(encode_pairwise, tokenizer, [row], RANKING, cutoff_len=10)
    assert cut["chosen_input_ids"][0] == prompt[:9] + [19556] and cut["chosen_labels"][0] == [X] * 9 + [19556]
    assert cut["rejected_input_ids"][0] == prompt[:9] + [6044] and cut["rejected_labels"][0] == [X] * 9 + [
        6044
    ]
    # budget 5: int(5 * 6 / 37) = 0 answer tokens, nothing left to learn: dropped, with empty columns
    gone = run(encode_pairwise, tokenizer, [row], RANKING, cutoff_len=5)
    assert gone["_status"] == ["dropped"] and all(gone[c] == [[]] for c in PAIR_COLUMNS)


def test_build_group_by_hand():
    prompt = [10, 11, 12, 13, 14, 15]
    chosen = Rendered(prompt + [20, 21, 22, 23], start=6, end=9)  # 23: the unsupervised newline
    rejected = Rendered(prompt + [30, 31, 32, 33, 34, 35, 36, 37], start=6, end=13)
    (c, r), status = build_group([chosen, rejected], cutoff_len=14)  # 6 + 8 fits
    assert status == "ok" and c == (chosen.ids, [X] * 6 + [20, 21, 22, X]) and r[0] == rejected.ids
    # budget 10 for a 6-token prompt and an 8-token longest answer: answers int(10 * 8 / 14) = 5, prompt 5
    (c, r), status = build_group([chosen, rejected], cutoff_len=10)
    assert status == "ok_truncated"
    assert c == ([10, 11, 12, 13, 14, 20, 21, 22, 23], [X] * 5 + [20, 21, 22, X])
    assert r == ([10, 11, 12, 13, 14, 30, 31, 32, 33, 34], [X] * 5 + [30, 31, 32, 33, 34])
    # int(1 * 8 / 14) = 0: the answers vanish
    assert build_group([chosen, rejected], cutoff_len=1) == ([([], []), ([], [])], "dropped")


def test_a_token_merged_across_the_prompt_end_goes_to_each_answer():
    # a template without separators: BPE joined the prompt's last characters with the answers' first
    a = Rendered([1, 2, 3, 4, 5], start=2, end=5)
    b = Rendered([1, 2, 9, 8], start=2, end=4)
    assert shared_prompt_len([a, b]) == 2
    assert shared_prompt_len([Rendered([1, 2, 3, 4], 3, 4), Rendered([1, 2, 9, 4], 3, 4)]) == 2
    (ca, cb), status = build_group([Rendered([1, 2, 3, 4], 3, 4), Rendered([1, 2, 9, 4], 3, 4)], 100)
    assert ca == ([1, 2, 3, 4], [X, X, X, 4]) and cb == ([1, 2, 9, 4], [X, X, X, 4]) and status == "ok"


def test_kl_pairs_within_the_batch_skip_bad_rows_and_a_lone_row_pairs_with_itself(tokenizer):
    rows = [judged("q0", "zero", True), {"messages": [], "label": True}, judged("q2", "two", False)]
    out = run(encode_feedback, tokenizer, rows, FEEDBACK, skip_bad_rows=True)
    assert out["_status"] == ["ok", "bad", "ok"] and out["kto_tag"] == [1, 0, 0]
    answers = [
        tokenizer.decode(supervised(i, lab))
        for i, lab in zip(out["kl_input_ids"], out["kl_labels"], strict=True)
    ]
    assert answers == ["two<|im_end|>", "", "zero<|im_end|>"]  # the kept rows 0 and 2 swap answers
    assert out["input_ids"][1] == out["kl_input_ids"][1] == []
    alone = run(encode_feedback, tokenizer, rows[:1], FEEDBACK)
    assert alone["kl_input_ids"] == alone["input_ids"] and alone["kl_labels"] == alone["labels"]


def test_kto_truncation_cuts_the_answer_and_its_kl_pair_together(tokenizer):
    rows = [judged("Hi", "Hello there", True), judged("Hi", "Go away now please", False)]
    cut = run(encode_feedback, tokenizer, rows, FEEDBACK, cutoff_len=20)
    full = run(encode_feedback, tokenizer, rows, FEEDBACK)
    prompt = full["input_ids"][0][:31]
    # row 0: its own answer has 4 tokens, its KL answer (row 1's) 6: one budget from the longer, prompt 14
    assert cut["input_ids"][0] == prompt[:14] + CHOSEN and cut["kl_input_ids"][0] == prompt[:14] + REJECTED
    assert cut["input_ids"][1] == prompt[:14] + REJECTED and cut["kl_input_ids"][1] == prompt[:14] + CHOSEN
    assert cut["_status"] == ["ok_truncated"] * 2
    assert run(encode_feedback, tokenizer, rows, FEEDBACK, cutoff_len=5)["_status"] == ["dropped"] * 2


@pytest.mark.parametrize(
    "bad,problem",
    [
        (
            {"conversations": [{"from": "human", "value": "q"}], "chosen": None, "rejected": None},
            "chosen .* missing",
        ),
        (
            {**pair("q", "a", "b"), "chosen": {"from": "human", "value": "a"}},
            "chosen must be an assistant message",
        ),
        (
            {
                **pair("q", "a", "b"),
                "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}],
            },
            "the messages of a ranking row must end with a user \\(or tool\\) turn",
        ),
        ({**pair("q", "a", "b"), "conversations": []}, "empty conversation"),
        (
            {**pair("q", "a", "b"), "conversations": [{"from": "alien", "value": "q"}]},
            "message 0 has unknown role 'alien'",
        ),
    ],
)
def test_bad_ranking_row_names_dataset_and_row_or_is_skipped(tokenizer, bad, problem):
    rows = [pair("q", "a", "b"), bad, pair("q", "c", "d")]
    with pytest.raises(DataError, match=rf"dataset 'pairs' \(pairs.json\), row 1: {problem}.*skip_bad_rows"):
        run(encode_pairwise, tokenizer, rows, RANKING)
    out = run(encode_pairwise, tokenizer, rows, RANKING, skip_bad_rows=True)
    assert out["_status"] == ["ok", "bad", "ok"] and all(out[c][1] == [] for c in PAIR_COLUMNS)


@pytest.mark.parametrize(
    "bad,problem",
    [
        (
            {**judged("q", "a", True), "label": "true"},
            "kto_tag column 'label' must be true or false, got str",
        ),
        ({**judged("q", "a", True), "label": None}, "kto_tag column 'label' is missing"),
        (
            {"messages": [{"role": "user", "content": "q"}], "label": True},
            "the last message is user, but a training sample must end with an assistant turn",
        ),
    ],
)
def test_bad_feedback_row_names_dataset_and_row(tokenizer, bad, problem):
    with pytest.raises(DataError, match=rf"dataset 'judged' \(judged.json\), row 1: {problem}"):
        run(encode_feedback, tokenizer, [judged("q", "a", True), bad], FEEDBACK)


def test_alpaca_ranking_rows_are_token_exact(tokenizer):
    attr = parse_entry(
        "alp",
        {
            "file_name": "alp.json",
            "ranking": True,
            "columns": {
                "prompt": "instruction",
                "query": "input",
                "chosen": "chosen",
                "rejected": "rejected",
            },
        },
    )
    row = {"instruction": "Add the numbers", "input": "2 and 3", "chosen": "5", "rejected": "23"}
    out = run(encode_pairwise, tokenizer, [row], attr)
    user = {"role": "user", "content": "Add the numbers\n2 and 3"}
    for key in ("chosen", "rejected"):
        ids = out[f"{key}_input_ids"][0]
        assert ids == reference_ids(tokenizer, [user, {"role": "assistant", "content": row[key]}])
        assert tokenizer.decode(supervised(ids, out[f"{key}_labels"][0])) == row[key] + "<|im_end|>"
