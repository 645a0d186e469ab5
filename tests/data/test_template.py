"""Rendering with the chat template: token-exact with apply_chat_template, and exactly which tokens learn."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from tuneforge.data import encode, template
from tuneforge.data.encode import IGNORE_INDEX, EncodeSettings
from tuneforge.data.registry import parse_entry
from tuneforge.errors import DataError

SHAREGPT = parse_entry(
    "conv",
    {
        "file_name": "x.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "system": "system", "tools": "tools"},
    },
)
ALPACA = parse_entry("alp", {"file_name": "x.json"})
GLAIVE_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def encode_rows(tokenizer, rows, attr=SHAREGPT, chat=None, **settings):
    """Run the real batched sft encoder over rows; returns [(input_ids, labels, status)]."""
    chat = chat or template.resolve_template(None, tokenizer)
    batch = {key: [row.get(key) for row in rows] for key in {k for row in rows for k in row}}
    s = EncodeSettings(stage="sft", cutoff_len=settings.pop("cutoff_len", 8192), **settings)
    out = encode.encode_supervised(
        batch, list(range(len(rows))), tokenizer=tokenizer, chat=chat, attr=attr, settings=s
    )
    return list(zip(out["input_ids"], out["labels"], out["_status"], strict=True))


def supervised_runs(labels):
    """Consecutive supervised positions as lists of token ids."""
    runs, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(label)
    return runs + ([current] if current else [])


def sharegpt(*turns, system=None, tools=None):
    roles = ["human", "gpt"]
    row = {"conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]}
    if system:
        row["system"] = system
    if tools:
        row["tools"] = tools
    return row


def reference_ids(tokenizer, messages, tools=None, chat_template=None):
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=chat_template, tokenize=True)[
        "input_ids"
    ]


def test_hand_built_label_mask(tokenizer):
    ((ids, labels, status),) = encode_rows(tokenizer, [sharegpt("Hi", "Hello there")])
    # SmolLM2's template adds its default system prompt; the ids below are its ChatML rendering
    system = [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
        198,
    ]
    user = [1, 4093, 198, 26843, 2, 198]
    header = [1, 520, 9531, 198]
    answer = [19556, 665, 2]  # "Hello", " there", <|im_end|>
    assert ids == system + user + header + answer + [198]
    assert labels == [IGNORE_INDEX] * (len(system) + len(user) + len(header)) + answer + [IGNORE_INDEX]
    assert status == "ok"


def test_trailing_newline_after_end_of_turn_is_not_supervised(tokenizer):
    ((ids, labels, _),) = encode_rows(tokenizer, [sharegpt("a", "b", "c", "d")])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    for i, token in enumerate(ids):
        if token == end and labels[i] != IGNORE_INDEX:  # an assistant's end-of-turn marker learns ...
            assert (
                ids[i + 1] == newline and labels[i + 1] == IGNORE_INDEX
            )  # ... the newline after it does not


@pytest.mark.parametrize(
    "row",
    [
        sharegpt("What is 2+2?", "4"),
        sharegpt("Hi", "Hello!", "How are you?", "Fine, thanks.", "Bye", "Goodbye."),
        sharegpt("Translate 'cat'", "chat", system="You are a translator."),
        sharegpt("  leading spaces", "\n\nnewlines first\n", system="S"),
    ],
)
def test_token_exact_and_spans(tokenizer, row):
    ((ids, labels, status),) = encode_rows(tokenizer, [row])
    messages = ([{"role": "system", "content": row["system"]}] if "system" in row else []) + [
        {"role": GLAIVE_ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]
    ]
    assert ids == reference_ids(tokenizer, messages)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = supervised_runs(labels)
    assert len(runs) == len(answers)
    for run, answer in zip(runs, answers, strict=True):
        assert tokenizer.decode(run).lstrip() == answer.lstrip() + "<|im_end|>"


def test_token_exact_on_glaive_rows_with_tools(tokenizer, lf_data_dir):
    rows = json.loads((lf_data_dir / "glaive_toolcall_en_demo.json").read_text())[:25]
    attr = parse_entry(
        "glaive",
        {
            "file_name": "g.json",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "tools": "tools"},
        },
    )
    for row, (ids, labels, status) in zip(rows, encode_rows(tokenizer, rows, attr), strict=True):
        messages = [{"role": GLAIVE_ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]]
        tools = [{"type": "function", "function": f} for f in json.loads(row["tools"])] or None
        assert status == "ok"
        assert ids == reference_ids(tokenizer, messages, tools)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(r) for r in supervised_runs(labels)] == [a + "<|im_end|>" for a in answers]


def test_token_exact_on_identity_rows(tokenizer, lf_data_dir):
    rows = json.loads((lf_data_dir / "identity.json").read_text())
    for row, (ids, labels, _) in zip(rows, encode_rows(tokenizer, rows, ALPACA), strict=True):
        user = "\n".join(p for p in (row["instruction"], row["input"]) if p)
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        assert ids == reference_ids(tokenizer, messages)
        # LlamaFactory's {{name}} / {{author}} placeholders stay as they are
        assert tokenizer.decode(supervised_runs(labels)[0]) == row["output"] + "<|im_end|>"
    assert "{{name}}" in rows[0]["output"]


def test_train_on_prompt_supervises_everything(tokenizer):
    ((ids, labels, _),) = encode_rows(tokenizer, [sharegpt("a", "b", "c", "d")], train_on_prompt=True)
    assert labels == ids


def test_mask_history_supervises_only_the_last_turn(tokenizer):
    ((ids, labels, _),) = encode_rows(
        tokenizer, [sharegpt("q1", "first answer", "q2", "second answer")], mask_history=True
    )
    assert [tokenizer.decode(r) for r in supervised_runs(labels)] == ["second answer<|im_end|>"]


@pytest.fixture(scope="module")
def bare_tokenizer(tokenizer):
    """The same tokenizer without a chat template, as a base model's would be (plus Llama 3's markers)."""
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    bare.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    return bare


@pytest.mark.parametrize("name", ["default", "empty", "chatml", "llama3", "alpaca"])  # the rest: test_chat_formats
def test_our_templates_are_token_exact(bare_tokenizer, name):
    chat = template.resolve_template(name, bare_tokenizer)
    assert chat.name == name
    rows = [
        sharegpt(
            "Hi",
            "Hello",
            "More?",
            "Yes.",
            system="Be brief.",
            tools=json.dumps([{"name": "f", "description": "d", "parameters": {}}]),
        )
    ]
    ((ids, labels, _),) = encode_rows(bare_tokenizer, rows, chat=chat)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "Yes."},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    assert ids == reference_ids(bare_tokenizer, messages, tools, chat_template=template.TEMPLATES[name])
    if name != "empty":  # the others show the tools to the model
        assert '"name": "f"' in bare_tokenizer.decode(ids)
    runs = [bare_tokenizer.decode(r).strip() for r in supervised_runs(labels)]
    if name == "empty":  # no separators: BPE may merge across the boundary, so only check the ends
        assert runs[-1].endswith("Yes.<|im_end|>")
    else:
        end = "<|eot_id|>" if name == "llama3" else "<|im_end|>"  # <|im_end|> is this tokenizer's eos
        assert runs == ["Hello" + end, "Yes." + end]


def test_family_name_uses_the_tokenizers_own_template(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="tuneforge.data.template"):
        chat = template.resolve_template("qwen", tokenizer)
    assert chat.name == "tokenizer" and chat.source is None
    assert "tokenizer's own chat_template" in caplog.text
    assert template.resolve_template("alpaca", tokenizer).name == "alpaca"  # a format name is always ours


def test_template_errors(tokenizer, bare_tokenizer):
    assert template.resolve_template("qwen", bare_tokenizer).name == "qwen"  # ours, for a base model
    with pytest.raises(DataError, match="unknown template 'nonsense'; choose one of default, empty, alpaca"):
        template.resolve_template("nonsense", tokenizer)
    with pytest.raises(DataError, match="has no chat_template; set template"):
        template.resolve_template(None, bare_tokenizer)
    assert template.resolve_template("chatml", bare_tokenizer).name == "chatml"


def test_spans_when_history_renders_differently(tokenizer):
    # like reasoning templates: the last assistant turn is shown with a <think> block, earlier ones without
    src = (
        "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{ 'U: ' + m['content'] + '\\n' }}"
        "{%- elif loop.last -%}{{ 'A: <think>x</think>' + m['content'] + '</s>\\n' }}"
        "{%- else -%}{{ 'A:\\n' + m['content'] + '</s>\\n' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ 'A: <think>x</think>' }}{%- endif -%}"
    )
    chat = template.ChatTemplate("custom", src)
    ((ids, labels, _),) = encode_rows(tokenizer, [sharegpt("q1", "c1", "q2", "c2")], chat=chat)
    assert tokenizer.decode(ids) == "U: q1\nA:\nc1</s>\nU: q2\nA: <think>x</think>c2</s>\n"
    assert [tokenizer.decode(r) for r in supervised_runs(labels)] == ["c1</s>", "c2</s>"]


def test_bad_tools_json_is_a_bad_row(tokenizer):
    with pytest.raises(DataError, match=r"dataset 'conv' \(x.json\), row 0: tools is not valid JSON"):
        encode_rows(tokenizer, [sharegpt("a", "b", tools="[{not json")])
