"""The batched sft encoder (one render per conversation where its shape allows, template.Layouts) gives the same
ids, labels and status as a straightforward reference that renders every prefix and tokenizes row by row, for
every template of ours, the families' official templates and the model's own, on varied rows."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from tuneforge.data import formats, template
from tuneforge.data.encode import EncodeSettings, build_sample, encode_supervised
from tuneforge.data.formats import BadRow
from tuneforge.data.registry import parse_entry

OFFICIAL = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
ATTR = parse_entry("rows", {"file_name": "rows.json", "formatting": "sharegpt",
                            "columns": {"messages": "conversations", "system": "system", "tools": "tools"}})
TOOLS = '[{"name": "f", "description": "adds", "parameters": {"type": "object", "properties": {}}}]'


def row(*turns, system=None, tools=None, tags=("human", "gpt")):
    out = {"conversations": [{"from": tags[i % 2], "value": t} for i, t in enumerate(turns)], "system": system,
           "tools": tools}
    return out


# each shape at least twice with other contents (the second takes the layout path), and odd contents
ROWS = [
    row("Hi", "Hello there."),
    row("What is 2+2?", "4"),
    row("Explain BPE.", "Byte pair encoding merges frequent pairs.\nIt starts from bytes."),
    row("Hi", "Hello.", "And then?", "Then more.", "Last one", "Done."),
    row("a", "b", "c", "d", "e", "f"),
    row("Be brief", "OK", system="You are terse."),
    row("Say yes", "yes", system="Answer in one word."),
    row("  padded  ", "  spaced answer \n", system=" sys "),
    row("", "an answer to nothing"),
    row("empty answer next", ""),
    row("think first", "<think>\nreasoning here\n</think>\n\nThe answer."),
    row("q1", "<think>r1</think>a1", "q2", "a2"),
    row("unicode ☃ ünï", "ответ 答案 🙂"),
    row("call it", '{"name": "f", "arguments": {"x": 1}}', "7", "It is 7.", tools=TOOLS,
        tags=("human", "function_call")),
    row("call again", '{"name": "f", "arguments": {}}', "8", "It is 8.", tools=TOOLS,
        tags=("human", "function_call")),
    row("long " * 60, "answer " * 40, "more " * 30, "end " * 20),
    row("long " * 50, "answer " * 45, "more " * 35, "end " * 25),
]
ROWS[13]["conversations"][2]["from"] = ROWS[14]["conversations"][2]["from"] = "observation"
ROWS[13]["conversations"][3]["from"] = ROWS[14]["conversations"][3]["from"] = "gpt"

SETTINGS = [
    EncodeSettings(stage="sft", cutoff_len=4096, skip_bad_rows=True),
    EncodeSettings(stage="sft", cutoff_len=40, skip_bad_rows=True),  # truncation at cutoff_len, some rows dropped
    EncodeSettings(stage="sft", cutoff_len=64, mask_history=True, skip_bad_rows=True),
    EncodeSettings(stage="sft", cutoff_len=4096, train_on_prompt=True, skip_bad_rows=True),
]


def reference(tokenizer, chat, rows, settings):
    """Row by row: every prefix rendered (no layouts), the text tokenized alone, tokens scanned one by one."""
    out = []
    for r in rows:
        try:
            conv = formats.to_conversation(r, ATTR, default_system=settings.default_system)
            text, spans = template.render(tokenizer, chat, conv)
        except BadRow:
            out.append(([], [], "bad"))
            continue
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets, n = enc["offset_mapping"], len(enc["input_ids"])
        tok_spans = []
        for a, b in spans:
            first = next((k for k, (_, end) in enumerate(offsets) if end > a), n)
            last = next((k for k in range(first, n) if offsets[k][0] >= b), n)
            tok_spans.append((first, last))
        out.append(build_sample(enc["input_ids"], tok_spans, settings, conv.trained_turns()))
    return out


def encoded(tokenizer, chat, rows, settings):
    batch = {key: [r[key] for r in rows] for key in rows[0]}
    enc = encode_supervised(batch, list(range(len(rows))), tokenizer=tokenizer, chat=chat, attr=ATTR,
                            settings=settings)
    return list(zip(enc["input_ids"], enc["labels"], enc["_status"], strict=True))


def chats():
    """Every distinct template of ours (with its thinking and tool options), then the official ones."""
    seen, out = set(), []
    for name, source in template.TEMPLATES.items():
        if source in seen:
            continue
        seen.add(source)
        out.append(template.ChatTemplate(name, source))
        if "enable_thinking" in source:
            out.append(template.ChatTemplate(name, source, (("enable_thinking", False),)))
    out.append(template.ChatTemplate("chatml", template.TEMPLATES["chatml"], tool_format="qwen"))
    out += [template.ChatTemplate(p.stem, p.read_text()) for p in sorted(OFFICIAL.glob("*.jinja"))]
    return out


@pytest.mark.parametrize("chat", chats(), ids=lambda c: f"{c.name}{'-' + str(c.options) if c.options else ''}"
                         f"{'-' + c.tool_format if c.tool_format else ''}")
def test_batched_encoding_matches_the_reference(bare, chat):
    rows = ROWS + ROWS[::-1]  # twice over: every shape is met again, by the same and by other contents
    for settings in SETTINGS:
        assert encoded(bare, chat, rows, settings) == reference(bare, chat, rows, settings)


def test_the_models_own_template_matches_the_reference(tokenizer):
    chat = template.resolve_template(None, tokenizer)
    for settings in SETTINGS:
        assert encoded(tokenizer, chat, ROWS * 2, settings) == reference(tokenizer, chat, ROWS * 2, settings)


def test_a_repeated_shape_renders_once_per_conversation(bare, monkeypatch):
    """The layout path is taken: ten two-turn rows of Mistral v3's own template (which compares whole messages, so
    it is rendered) take one render each, plus the shape's prefix renders."""
    calls = []
    real = template._render
    monkeypatch.setattr(template, "_render", lambda *a: calls.append(1) or real(*a))
    chat = template.ChatTemplate("mistral_v3", (OFFICIAL / "mistral_v3.jinja").read_text())
    rows = [row(f"question {i}", f"answer {i}", f"next {i}", f"more {i}") for i in range(10)]
    encoded(bare, chat, rows, SETTINGS[0])
    # row 1 renders its 4 prefixes and itself (5); the marked shape 1 + 4; each of the other 9 rows once
    assert len(calls) == 5 + 5 + 9


def test_a_template_that_writes_contents_verbatim_renders_each_shape_once(tokenizer, monkeypatch):
    """The model's own ChatML template writes contents verbatim: ten rows of one shape render only the shape's
    marked text and its 4 prefixes; a row with an empty content renders itself and its prefixes."""
    calls = []
    real = template._render
    monkeypatch.setattr(template, "_render", lambda *a: calls.append(1) or real(*a))
    chat = template.resolve_template(None, tokenizer)
    rows = [row(f"question {i}", f"answer {i}", f"next {i}", f"more {i}") for i in range(10)]
    assert encoded(tokenizer, chat, rows, SETTINGS[0]) == reference(tokenizer, chat, rows, SETTINGS[0])
    assert len(calls) == 5 + 10 * 5  # the reference renders each row and its 4 prefixes
    calls.clear()
    encoded(tokenizer, chat, [*rows, row("question", "", "next", "more")], SETTINGS[0])
    assert len(calls) == 5 + 5


def test_a_template_whose_prefixes_differ_renders_each_shape_once(bare, monkeypatch):
    """Qwen3's own template writes an empty reasoning block before the last answer only, so a prefix that ends with
    an earlier answer is not a prefix of the whole; its prefixes are filled in from their marked renders too: ten
    rows of one shape take the shape's marked text and 2 prefixes (found not to be prefixes of the whole), then the
    whole and 3 prefixes filled in (the last is the whole); a row holding `</think>` renders itself and 4 prefixes."""
    calls = []
    real = template._render
    monkeypatch.setattr(template, "_render", lambda *a: calls.append(1) or real(*a))
    chat = template.ChatTemplate("qwen3", (OFFICIAL / "qwen3.jinja").read_text())
    rows = [row(f"question {i}", f"answer {i}", f"next {i}", f"more {i}") for i in range(10)]
    assert encoded(bare, chat, rows, SETTINGS[0]) == reference(bare, chat, rows, SETTINGS[0])
    assert len(calls) == 3 + 4 + 10 * 5
    calls.clear()
    encoded(bare, chat, [*rows, row("question", "answer", "next", "<think>r</think>more")], SETTINGS[0])
    assert len(calls) == 3 + 4 + 5


def test_a_template_that_writes_todays_date_fills_in_the_date_of_the_day(bare, monkeypatch):
    """Llama 3.2's own template writes today's date (transformers' strftime_now) into its system header: a shape's
    marked renders hold the day they were made on, so after midnight they are made again, and a conversation filled
    in holds the new date, as its render does."""
    import transformers.utils.chat_template_utils as chat_template_utils

    today = {"now": datetime(2026, 12, 7, 23, 59)}

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return today["now"]

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)  # what the render's strftime_now reads
    monkeypatch.setattr(template, "datetime", Clock)
    chat = template.ChatTemplate("llama3_2", (OFFICIAL / "llama3_2.jinja").read_text())
    layouts = template.Layouts()

    def filled_and_rendered(i):
        messages = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
        return layouts.filled(bare, chat, messages, None), template._render(bare, chat, messages, None, False)

    for i in range(2):
        (text, spans), rendered = filled_and_rendered(i)
        assert text == rendered and "Today Date: 07 Dec 2026" in text
    today["now"] = datetime(2026, 12, 8, 0, 0)
    (text, spans), rendered = filled_and_rendered(2)
    assert text == rendered and "Today Date: 08 Dec 2026" in text
    assert spans == template.Layouts().filled(bare, chat, [{"role": "user", "content": "question 2"},
                                                           {"role": "assistant", "content": "answer 2"}], None)[1]


PAIR_ATTR = parse_entry("pairs", {"file_name": "pairs.json", "formatting": "sharegpt", "ranking": True,
                                  "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                              "system": "system"}})
FEEDBACK_ATTR = parse_entry("fb", {"file_name": "fb.json", "formatting": "sharegpt",
                                   "columns": {"messages": "conversations", "kto_tag": "kto_tag", "system": "system"}})


@pytest.mark.parametrize("name", ["chatml", "llama3", "qwen3", "gemma", "default"])
def test_preference_encoders_match_prefix_rendering(bare, monkeypatch, name):
    """Pairs and kto rows give the same columns as when every conversation renders its prefixes (none filled in)."""
    from tuneforge.data.encode_pref import encode_feedback, encode_pairwise

    chat = template.ChatTemplate(name, template.TEMPLATES[name])
    settings = EncodeSettings(stage="dpo", cutoff_len=48, skip_bad_rows=True)
    sources = [r for r in ROWS if len(r["conversations"]) >= 2 and not r["tools"]]
    pairs = [{"conversations": r["conversations"][:-1], "system": r["system"],
              "chosen": r["conversations"][-1], "rejected": {"from": "gpt", "value": f"no {i}"}}
             for i, r in enumerate(sources)]
    feedback = [{"conversations": r["conversations"], "system": r["system"], "kto_tag": i % 2 == 0}
                for i, r in enumerate(sources)]

    def run():
        kw = {"tokenizer": bare, "chat": chat, "settings": settings}
        return (encode_pairwise({k: [p[k] for p in pairs] for k in pairs[0]}, list(range(len(pairs))),
                                attr=PAIR_ATTR, **kw),
                encode_feedback({k: [f[k] for f in feedback] for k in feedback[0]}, list(range(len(feedback))),
                                attr=FEEDBACK_ATTR, **kw))

    batched = run()
    monkeypatch.setattr(template.Layouts, "spans", lambda self, *a: None)
    monkeypatch.setattr(template.Layouts, "filled", lambda self, *a: None)
    assert batched == run()


def test_the_garbage_collector_is_back_on_after_a_batch_even_one_that_fails(tokenizer):
    import gc

    from tuneforge.errors import DataError

    chat = template.resolve_template(None, tokenizer)
    encoded(tokenizer, chat, ROWS[:2], SETTINGS[0])
    assert gc.isenabled()
    bad = [row("only a question")]  # no answer: a bad row, and skip_bad_rows is off
    with pytest.raises(DataError, match="row 0"):
        encoded(tokenizer, chat, bad, EncodeSettings(stage="sft", cutoff_len=64))
    assert gc.isenabled()
