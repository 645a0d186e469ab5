"""LlamaFactory v1 data: dataset specs -> DatasetAttr, and rows of typed messages -> Conversation / PairwiseRow.

A v1 message is {"role": system | user | assistant | tool, "content": [parts], "loss_weight": w}; a part is
{"type": text | reasoning | tool_call | image_url | video_url | audio_url, "value": ...}. Text parts are joined as
written; reasoning parts become the message's `reasoning_content` (rendered as the chat template renders reasoning,
see formats.fold_reasoning); tool calls ({"name", "arguments"} JSON) become the assistant's text as our other
formats write them; a medium's part becomes its placeholder at that place and its value joins the row's media.
Content may also be a plain string (the `pair` converter's rows), with <image> placeholders and media columns.

loss_weight (v1's default 1.0) says which assistant messages are trained: 0 = not trained. v1 scales each trained
message's tokens by the weight within a micro-batch's weighted mean; tuneforge trains a message fully or not at
all, so a weight other than 0 or 1 is refused. As in v1, only assistant messages are ever trained (a weight on
another role changes nothing).

Spec converters: alpaca and sharegpt read the rows with our readers of those formats (v1's columns: system,
instruction, input, output / conversations, tools, and the media columns); pair reads `chosen` / `rejected`
message lists; no converter reads v1 rows (messages, or chosen_messages / rejected_messages).
"""

from __future__ import annotations

import json
from typing import Any

from tuneforge.config import v1_datasets
from tuneforge.data.formats import BadRow, Conversation, PairwiseRow, check_turns
from tuneforge.data.registry import OPENAI_TAGS, SHAREGPT_TAGS, DatasetAttr

FORMATTING = "v1"
MEDIA_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
MEDIA_COLUMNS = {"images": "images", "videos": "videos", "audios": "audios"}
ROLES = ("system", "user", "assistant", "tool")


def dataset_attrs(name: str) -> list[DatasetAttr]:
    """The datasets of one v1 spec YAML (or data file), as the registry describes datasets."""
    return [_attr(n, e) for n, e in v1_datasets.read_spec(name).items()]


def _media_columns(entry: dict[str, Any]) -> dict[str, str]:
    """The media columns a converter reads that the rows have (their first row shows; none for unpeekable rows,
    so a text model is not refused for columns the data lacks)."""
    row = v1_datasets.first_row(entry["path"]) if entry["source"] == "local" else None
    return {k: c for k, c in MEDIA_COLUMNS.items() if row is not None and row.get(c) not in (None, [])}


def _attr(name: str, entry: dict[str, Any]) -> DatasetAttr:
    converter = entry.get("converter")
    attr = DatasetAttr(name=name, load_from="file" if entry["source"] == "local" else "hf_hub", source=entry["path"],
                       split=entry.get("split", "train"), num_samples=entry.get("size"),
                       entry={"v1": True, **entry})
    if converter == "alpaca":
        attr.formatting = "alpaca"
        attr.columns = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                        **_media_columns(entry)}
    elif converter == "sharegpt":
        attr.formatting = "sharegpt"
        attr.columns = {"messages": "conversations", "tools": "tools", **_media_columns(entry)}
        attr.tags = dict(SHAREGPT_TAGS)
    else:
        attr.formatting, attr.tags = FORMATTING, dict(OPENAI_TAGS)
        attr.ranking = v1_datasets.entry_holds_pairs(entry) or (converter is None and _hub_pairs(attr))
        if converter == "pair":
            attr.columns = {"chosen": "chosen", "rejected": "rejected", "tools": "tools", **_media_columns(entry)}
        elif attr.ranking:
            attr.columns = {"chosen": "chosen_messages", "rejected": "rejected_messages", "tools": "tools"}
        else:
            attr.columns = {"messages": "messages", "tools": "tools"}
    return attr


def _hub_pairs(attr: DatasetAttr) -> bool:
    """A v1 dataset whose rows cannot be peeked without loading them (hub, parquet): ask its columns."""
    if attr.load_from == "file" and v1_datasets.first_row(attr.source) is not None:
        return False
    from tuneforge.data.registry import load_raw

    return set(v1_datasets.PAIR_COLUMNS) <= set(load_raw(attr, ".").column_names)


def media_values(raw: Any, attr: DatasetAttr) -> list[Any]:
    """The values of every media part in a dataset's v1 message columns (for the cache's file checks)."""
    columns = [c for k in ("messages", "chosen", "rejected") if (c := attr.column(k)) in raw.column_names]
    return [part["value"] for column in columns for messages in raw[column] for m in messages or []
            if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") in MEDIA_PARTS]


def fold_reasoning(messages: list[dict[str, Any]], template_reads_it: bool) -> list[dict[str, Any]]:
    """Messages whose `reasoning_content` a template that does not read it still shows: as <think>...</think>
    before the text, as reasoning models write it (a template that reads it gets it unchanged)."""
    if template_reads_it:
        return messages
    out = []
    for m in messages:
        if not m.get("reasoning_content"):
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
            continue
        think = f"<think>\n{m['reasoning_content'].strip()}\n</think>\n\n"
        content = m["content"]
        content = think + content if isinstance(content, str) else [{"type": "text", "text": think}, *content]
        out.append({k: v for k, v in m.items() if k != "reasoning_content"} | {"content": content})
    return out


def _weight(message: dict[str, Any], where: str) -> bool:
    """Whether the message is trained (its loss_weight, default 1)."""
    w = message.get("loss_weight", 1.0)
    if w is None:
        return True
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise BadRow(f"{where} has loss_weight {w!r}; it must be a number (0: not trained, 1: trained)")
    if w not in (0, 1):
        raise BadRow(f"{where} has loss_weight {w}; tuneforge trains a message fully (1) or not at all (0), "
                     f"fractional weights are not supported: use 0 or 1")
    return w == 1


def _content(message: dict[str, Any], where: str, media: dict[str, list[Any]]) -> tuple[str, str]:
    """(text with media placeholders, reasoning) of one message's content."""
    from tuneforge.data.media import placeholders

    content = message.get("content")
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        raise BadRow(f"{where} must have a list of content parts ({{type, value}}) or a text, got "
                     f"{'nothing' if content is None else type(content).__name__}")
    text, reasoning, calls = [], [], []
    marks = placeholders()
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        value = part.get("value") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            if value is None:
                raise BadRow(f"{where}, part {k} ({kind}) has no value")
            media.setdefault(MEDIA_PARTS[kind], []).append(value)
            text.append(marks[MEDIA_PARTS[kind]])
        elif kind in ("text", "reasoning", "tool_call"):
            if not isinstance(value, str):
                raise BadRow(f"{where}, part {k} ({kind}) must have text under 'value'")
            if kind == "tool_call":
                calls.append(_tool_call(value, f"{where}, part {k}"))
            else:
                (text if kind == "text" else reasoning).append(value)
        else:
            raise BadRow(f"{where}, part {k} has type {kind!r}; v1's types are text, reasoning, tool_call, "
                         f"image_url, video_url, audio_url")
    joined = "".join(text)
    if calls:
        joined = "\n".join(t for t in (joined, json.dumps(calls, ensure_ascii=False)) if t)
    return joined, "".join(reasoning)


def _tool_call(value: str, where: str) -> dict[str, Any]:
    try:
        call = json.loads(value)
    except json.JSONDecodeError as e:
        raise BadRow(f"{where}: a tool_call must be JSON ({e})") from None
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        raise BadRow(f"{where}: a tool_call must be a JSON object with name and arguments")
    return call


def _messages(raw: Any, column: str) -> Conversation:
    """One list of v1 messages -> Conversation (system apart, media gathered, loss weights kept)."""
    if raw is None:
        raise BadRow(f"column '{column}' is missing")
    if not isinstance(raw, list) or not raw:
        raise BadRow(f"column '{column}' must be a non-empty list of messages")
    conv = Conversation(loss_weights=[])
    for i, message in enumerate(raw):
        where = f"{column} message {i}"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            got = message.get("role") if isinstance(message, dict) else type(message).__name__
            raise BadRow(f"{where} has role {got!r}; v1's roles are {', '.join(ROLES)}")
        text, reasoning = _content(message, where, conv.media)
        trained = _weight(message, where)
        if message["role"] == "system":
            if i != 0:
                raise BadRow(f"{where} is a system message; only the first message may be one")
            conv.system = text
            continue
        entry = {"role": message["role"], "content": text}
        if reasoning:
            entry["reasoning_content"] = reasoning
        conv.messages.append(entry)
        conv.loss_weights.append(1.0 if trained and message["role"] == "assistant" else 0.0)
    if not conv.messages:
        raise BadRow(f"column '{column}' holds only a system message")
    return conv


def _tools(row: dict[str, Any], attr: DatasetAttr) -> str | None:
    column = attr.column("tools")
    value = row.get(column) if column else None
    if value in (None, "", []):
        return None
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def to_conversation(row: dict[str, Any], attr: DatasetAttr, *, default_system: str | None = None,
                    require_final_assistant: bool = True) -> Conversation:
    conv = _messages(row.get(attr.column("messages")), attr.column("messages"))
    conv.tools = _tools(row, attr)
    if not conv.system and default_system:
        conv.system = default_system
    check_turns(conv.messages, require_final_assistant=require_final_assistant)
    if require_final_assistant and not any(conv.loss_weights):
        raise BadRow("no assistant message has a loss_weight above 0: nothing to train on")
    return conv


def to_pairwise(row: dict[str, Any], attr: DatasetAttr, *, default_system: str | None = None) -> PairwiseRow:
    """chosen / rejected message lists that share everything but their last (assistant) message."""
    sides = [_messages(row.get(attr.column(k)), attr.column(k)) for k in ("chosen", "rejected")]
    answers = []
    for side, key in zip(sides, ("chosen", "rejected"), strict=True):
        last = side.messages[-1]
        if last["role"] != "assistant":
            raise BadRow(f"{attr.column(key)} must end with the assistant's answer, but its last message is "
                         f"{last['role']}")
        if not side.loss_weights[-1]:
            raise BadRow(f"{attr.column(key)}: the answer has loss_weight 0, so there is nothing to compare")
        answers.append(side.messages.pop())
        side.loss_weights.pop()
    chosen, rejected = sides
    if (chosen.system, chosen.messages, chosen.media) != (rejected.system, rejected.messages, rejected.media):
        raise BadRow(f"{attr.column('chosen')} and {attr.column('rejected')} must hold the same messages before "
                     f"their answers (one prompt, two answers)")
    prompt = chosen
    prompt.tools, prompt.loss_weights = _tools(row, attr), None
    if not prompt.system and default_system:
        prompt.system = default_system
    if not prompt.messages:
        raise BadRow("the preference pair has no prompt before its answers")
    check_turns(prompt.messages, require_final_assistant=False)
    if prompt.messages[-1]["role"] == "assistant":
        raise BadRow("the prompt before the answers must end with a user (or tool) message")
    return PairwiseRow(prompt, *(a if "reasoning_content" in a else a["content"] for a in answers))
