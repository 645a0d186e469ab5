"""alpaca / sharegpt / openai rows -> Conversation, and the errors a malformed row gives."""

from __future__ import annotations

import logging

import pytest

from tuneforge.data import build
from tuneforge.data.formats import (
    BadRow,
    Conversation,
    FeedbackRow,
    PairwiseRow,
    to_conversation,
    to_document,
    to_feedback,
    to_pairwise,
)
from tuneforge.data.registry import parse_entry
from tuneforge.errors import DataError

ALPACA = parse_entry(
    "a",
    {
        "file_name": "a.json",
        "columns": {
            "prompt": "instruction",
            "query": "input",
            "response": "output",
            "history": "history",
            "system": "system",
        },
    },
)
SHAREGPT = parse_entry(
    "s",
    {
        "file_name": "s.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    },
)
OPENAI = parse_entry("o", {"file_name": "o.json", "formatting": "openai"})


def test_alpaca_history_query_and_system():
    row = {
        "instruction": "Summarize",
        "input": "the text",
        "output": "Done.",
        "system": "Be short.",
        "history": [["hi", "hello"], ["who are you?", "a bot"]],
    }
    conv = to_conversation(row, ALPACA)
    assert conv == Conversation(
        system="Be short.",
        tools=None,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "who are you?"},
            {"role": "assistant", "content": "a bot"},
            {"role": "user", "content": "Summarize\nthe text"},
            {"role": "assistant", "content": "Done."},
        ],
    )


def test_alpaca_empty_input_and_default_system():
    conv = to_conversation(
        {"instruction": "hi", "input": "", "output": "I am {{name}}."},
        ALPACA,
        default_system="You are tuneforge.",
    )
    assert conv.system == "You are tuneforge."
    assert conv.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "I am {{name}}."},
    ]
    kept = to_conversation({"instruction": "hi", "output": "x", "system": "Own."}, ALPACA, default_system="D")
    assert kept.system == "Own."


def test_sharegpt_roles_tools_and_system_message():
    row = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "weather?"},
            {"from": "function_call", "value": '{"name": "w"}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "It is sunny."},
        ],
        "tools": '[{"name": "w"}]',
    }
    conv = to_conversation(row, SHAREGPT)
    assert conv.system == "sys" and conv.tools == '[{"name": "w"}]'
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[1]["content"] == '{"name": "w"}'
    assert conv.chat_messages()[0] == {"role": "system", "content": "sys"}


def test_openai_format_uses_role_and_content():
    row = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "a"},
        ]
    }
    conv = to_conversation(row, OPENAI)
    assert conv.system == "s"
    assert conv.messages[1] == {"role": "assistant", "content": '[{"name": "f", "arguments": "{}"}]'}
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]


def test_document_text_for_pt():
    attr = parse_entry("w", {"file_name": "w.txt", "columns": {"prompt": "text"}})
    assert to_document({"text": "A document."}, attr) == "A document."
    with pytest.raises(BadRow, match="text column 'text' must be text, got int"):
        to_document({"text": 3}, attr)


GOOD = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
BAD_SHAREGPT = [
    ({"other": 1}, "messages column 'conversations' is missing"),
    ({"conversations": "just text"}, "messages column 'conversations' must be a list of messages, got str"),
    ({"conversations": []}, r"empty conversation \(no messages\)"),
    (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q2"}]},
        "message 1 is user where an assistant turn is expected",
    ),
    (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]},
        "message 1 has unknown role 'robot'",
    ),
    (
        {
            "conversations": [
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
                {"from": "human", "value": "q2"},
            ]
        },
        "the last message is user, but a training sample must end with an assistant turn",
    ),
    (
        {"conversations": [{"from": "human", "value": 7}, {"from": "gpt", "value": "a"}]},
        "message 0 must have text under 'value', got int",
    ),
]


@pytest.mark.parametrize("bad,problem", BAD_SHAREGPT)
def test_bad_sharegpt_row_names_dataset_and_row(
    tokenizer, home, tmp_path, write_dataset, make_cfg, bad, problem
):
    write_dataset(tmp_path / "d", "chats", [GOOD, GOOD, bad, GOOD], {"formatting": "sharegpt"})
    with pytest.raises(DataError, match=rf"dataset 'chats' \(chats.json\), row 2: {problem}.*skip_bad_rows"):
        build(make_cfg(tmp_path / "d", dataset="chats"), tokenizer)


@pytest.mark.parametrize(
    "bad,problem",
    [
        ({"instruction": "q"}, "response column 'output' is missing"),
        ({"instruction": ["q"], "output": "a"}, "prompt column 'instruction' must be text, got list"),
        ({"instruction": "q", "output": "a", "history": [["only one"]]}, "history item 0 must be a"),
        ({"instruction": "", "input": "", "output": ""}, "empty conversation"),
    ],
)
def test_bad_alpaca_row_names_dataset_and_row(
    tokenizer, home, tmp_path, write_dataset, make_cfg, bad, problem
):
    good = {"instruction": "q", "input": "", "output": "a"}
    write_dataset(
        tmp_path / "d",
        "alp",
        [good, bad],
        {"columns": {"prompt": "instruction", "query": "input", "response": "output", "history": "history"}},
    )
    with pytest.raises(DataError, match=rf"dataset 'alp' \(alp.json\), row 1: {problem}"):
        build(make_cfg(tmp_path / "d", dataset="alp"), tokenizer)


def test_skip_bad_rows_counts_and_warns(tokenizer, home, tmp_path, write_dataset, make_cfg, caplog):
    rows = [GOOD] + [bad for bad, _ in BAD_SHAREGPT] + [GOOD]
    write_dataset(tmp_path / "d", "chats", rows, {"formatting": "sharegpt"})
    with caplog.at_level(logging.WARNING, logger="tuneforge.data.pipeline"):
        splits = build(make_cfg(tmp_path / "d", dataset="chats", skip_bad_rows=True), tokenizer)
    assert splits.stats["datasets"]["chats"] == {
        "rows": 9,
        "bad_rows": 7,
        "dropped_by_truncation": 0,
        "truncated": 0,
        "empty_documents": 0,
        "samples": 2,
    }
    assert splits.stats["bad_rows"] == 7 and len(splits.train) == 2
    assert "dataset 'chats': skipped 7 bad rows of 9" in caplog.text


def test_every_row_bad_is_an_empty_dataset_error(tokenizer, home, tmp_path, write_dataset, make_cfg):
    write_dataset(tmp_path / "d", "chats", [{"conversations": []}] * 3, {"formatting": "sharegpt"})
    with pytest.raises(
        DataError, match="dataset 'chats' is empty after encoding: of 3 rows, 3 were skipped as bad"
    ):
        build(make_cfg(tmp_path / "d", dataset="chats", skip_bad_rows=True), tokenizer)


def test_missing_column_in_whole_dataset(tokenizer, home, tmp_path, write_dataset, make_cfg):
    write_dataset(tmp_path / "d", "alp", [{"question": "q", "answer": "a"}])
    with pytest.raises(
        DataError, match="column 'instruction' is not in the data \\(it has question, answer\\)"
    ):
        build(make_cfg(tmp_path / "d", dataset="alp"), tokenizer)


ALPACA_RANKING = parse_entry(
    "ar",
    {
        "file_name": "ar.json",
        "ranking": True,
        "columns": {
            "prompt": "instruction",
            "query": "input",
            "history": "history",
            "system": "system",
            "chosen": "good",
            "rejected": "bad",
        },
    },
)
SHAREGPT_RANKING = parse_entry(
    "sr",
    {
        "file_name": "sr.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    },
)
SHAREGPT_FEEDBACK = parse_entry(
    "sf",
    {
        "file_name": "sf.json",
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


def test_alpaca_ranking_row_is_a_prompt_and_two_answers():
    row = {
        "instruction": "Name it",
        "input": "a red fruit",
        "good": "An apple.",
        "bad": "A car.",
        "system": "Be brief.",
        "history": [["hi", "hello"]],
    }
    pair = to_pairwise(row, ALPACA_RANKING, default_system="unused, the row has one")
    assert pair == PairwiseRow(
        prompt=Conversation(
            system="Be brief.",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "Name it\na red fruit"},
            ],
        ),
        chosen="An apple.",
        rejected="A car.",
    )
    assert to_pairwise(
        {"instruction": "q", "good": "a", "bad": "b"}, ALPACA_RANKING, default_system="D"
    ).prompt == (Conversation(system="D", messages=[{"role": "user", "content": "q"}]))


def test_sharegpt_ranking_row_takes_its_answers_from_the_chosen_and_rejected_messages():
    row = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "weather?"},
            {"from": "function_call", "value": "{}"},
            {"from": "observation", "value": "sunny"},
        ],
        "chosen": {"from": "gpt", "value": "It is sunny."},
        "rejected": {"from": "function_call", "value": '{"again": 1}'},  # a tool call is an assistant turn
    }
    pair = to_pairwise(row, SHAREGPT_RANKING)
    assert pair.prompt.system == "sys"
    assert [m["role"] for m in pair.prompt.messages] == ["user", "assistant", "tool"]
    assert (pair.chosen, pair.rejected) == ("It is sunny.", '{"again": 1}')


def test_feedback_rows_split_off_the_judged_answer():
    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "label": False,
    }
    assert to_feedback(row, SHAREGPT_FEEDBACK) == FeedbackRow(
        prompt=Conversation(messages=[{"role": "user", "content": "q"}]), completion="a", desirable=False
    )
    alpaca = parse_entry(
        "af", {"file_name": "af.json", "columns": {"prompt": "p", "response": "r", "kto_tag": "t"}}
    )
    fb = to_feedback({"p": "question", "r": "answer", "t": True}, alpaca)
    assert (fb.prompt.messages, fb.completion, fb.desirable) == (
        [{"role": "user", "content": "question"}],
        "answer",
        True,
    )


Q = [{"from": "human", "value": "q"}]
A = {"from": "gpt", "value": "a"}
BAD_RANKING = [
    ({"conversations": Q, "rejected": A}, "chosen column 'chosen' is missing"),
    ({"conversations": Q, "chosen": A, "rejected": None}, "rejected column 'rejected' is missing"),
    ({"conversations": Q, "chosen": "a", "rejected": A}, "chosen column 'chosen' must hold one message"),
    (
        {"conversations": Q, "chosen": {"from": "human", "value": "a"}, "rejected": A},
        "chosen must be an assistant message \\(from: 'gpt'\\), got from: 'human'",
    ),
    ({"conversations": Q, "chosen": A, "rejected": {"from": "gpt"}}, "rejected must have text under 'value'"),
    ({"conversations": Q + [A], "chosen": A, "rejected": A}, "must end with a user \\(or tool\\) turn"),
    ({"conversations": [], "chosen": A, "rejected": A}, "empty conversation"),
    (
        {"conversations": [{"from": "robot", "value": "q"}], "chosen": A, "rejected": A},
        "unknown role 'robot'",
    ),
]


@pytest.mark.parametrize("row,problem", BAD_RANKING)
def test_bad_ranking_rows(row, problem):
    with pytest.raises(BadRow, match=problem):
        to_pairwise(row, SHAREGPT_RANKING)


@pytest.mark.parametrize(
    "row,problem",
    [
        ({"instruction": "q", "bad": "b"}, "chosen column 'good' is missing"),
        ({"instruction": "q", "good": ["a"], "bad": "b"}, "chosen column 'good' must be text, got list"),
    ],
)
def test_bad_alpaca_ranking_rows(row, problem):
    with pytest.raises(BadRow, match=problem):
        to_pairwise(row, ALPACA_RANKING)


U = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    "row,problem",
    [
        ({"messages": [U, ANSWER]}, "kto_tag column 'label' is missing"),
        ({"messages": [U, ANSWER], "label": 1}, "kto_tag column 'label' must be true or false, got int 1"),
        ({"messages": [U, ANSWER], "label": "yes"}, "must be true or false, got str 'yes'"),
        ({"messages": [U], "label": True}, "must end with an assistant turn"),
        ({"messages": [], "label": True}, "empty conversation"),
        ({"messages": [{"role": "bot", "content": "q"}, ANSWER], "label": True}, "unknown role 'bot'"),
    ],
)
def test_bad_feedback_rows(row, problem):
    with pytest.raises(BadRow, match=problem):
        to_feedback(row, SHAREGPT_FEEDBACK)
