"""Raw rows (alpaca / sharegpt / openai) -> one canonical Conversation, or the text of a document (pt).

A row that cannot be read raises BadRow with the problem in words; the encoder adds the dataset name and
row index and either stops (DataError) or skips and counts the row (`skip_bad_rows`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tuneforge.data.registry import DatasetAttr
from tuneforge.errors import DataError

ROLES = ("user", "assistant", "tool")
PROMPT_SIDE = ("user", "tool")  # turns 0, 2, 4, ...: a question or a tool's result
RESPONSE_SIDE = ("assistant",)  # turns 1, 3, 5, ...


class BadRow(Exception):
    """A row that cannot be used; the message says why."""


@dataclass
class Conversation:
    system: str | None = None
    tools: str | None = None  # JSON text, as in the dataset's tools column
    messages: list[dict[str, str]] = field(default_factory=list)  # {role: user|assistant|tool, content}

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as `apply_chat_template` takes them (a system message first when there is one)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]


def required_columns(attr: DatasetAttr, stage: str) -> list[str]:
    if attr.formatting == "alpaca":
        keys = ("prompt",) if stage == "pt" else ("prompt", "response")
    else:
        keys = ("messages",)
    return [attr.column(k) for k in keys if attr.column(k)]


def check_columns(attr: DatasetAttr, column_names: list[str], stage: str) -> None:
    """Stop before encoding when a column the stage needs is missing from the whole dataset."""
    if stage == "pt" and attr.formatting != "alpaca":
        raise DataError(
            f"dataset '{attr.name}': stage pt reads plain text, but the dataset is {attr.formatting}; "
            f'describe it with columns: {{"prompt": "<its text column>"}}'
        )
    if attr.formatting == "alpaca" and not attr.column("prompt"):
        raise DataError(f'dataset \'{attr.name}\': columns must name a prompt column (e.g. "prompt": "text")')
    if stage == "sft" and attr.formatting == "alpaca" and not attr.column("response"):
        raise DataError(
            f"dataset '{attr.name}': stage sft needs a response column in columns "
            f'(e.g. "response": "output")'
        )
    missing = [c for c in required_columns(attr, stage) if c not in column_names]
    if missing:
        raise DataError(
            f"dataset '{attr.name}': column '{missing[0]}' is not in the data (it has "
            f'{", ".join(column_names)}); fix "columns" in dataset_info.json'
        )


def _text(row: dict[str, Any], column: str, what: str, *, required: bool) -> str | None:
    value = row.get(column)
    if value is None:
        if required:
            raise BadRow(f"{what} column '{column}' is missing")
        return None
    if not isinstance(value, str):
        raise BadRow(f"{what} column '{column}' must be text, got {type(value).__name__}")
    return value


def _tools(row: dict[str, Any], attr: DatasetAttr) -> str | None:
    column = attr.column("tools")
    value = row.get(column) if column else None
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise BadRow(f"tools column '{column}' must be JSON text or a list, got {type(value).__name__}")
    return value


def _system(row: dict[str, Any], attr: DatasetAttr) -> str | None:
    column = attr.column("system")
    return _text(row, column, "system", required=False) if column else None


def to_conversation(
    row: dict[str, Any],
    attr: DatasetAttr,
    *,
    default_system: str | None = None,
    require_final_assistant: bool = True,
) -> Conversation:
    """One raw row -> Conversation, or BadRow."""
    if attr.formatting == "alpaca":
        conv = _from_alpaca(row, attr)
    else:
        conv = _from_sharegpt(row, attr)
    if not conv.system and default_system:
        conv.system = default_system
    check_turns(conv.messages, require_final_assistant=require_final_assistant)
    return conv


def _from_alpaca(row: dict[str, Any], attr: DatasetAttr) -> Conversation:
    messages: list[dict[str, str]] = []
    history_column = attr.column("history")
    history = row.get(history_column) if history_column else None
    if history is not None:
        if not isinstance(history, list):
            raise BadRow(f"history column '{history_column}' must be a list of [question, answer] pairs")
        for i, pair in enumerate(history):
            if not (
                isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)
            ):
                raise BadRow(f"history item {i} must be a [question, answer] pair of texts, got {pair!r:.80}")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = _text(row, attr.column("prompt"), "prompt", required=True)
    query = _text(row, attr.column("query"), "query", required=False) if attr.column("query") else None
    # LlamaFactory joins the instruction and the input with a newline, leaving out empty parts
    user = "\n".join(part for part in (prompt, query) if part)
    response = _text(row, attr.column("response"), "response", required=True)
    if not user and not response and not messages:
        raise BadRow("empty conversation (no prompt and no response)")
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": response}]
    return Conversation(system=_system(row, attr), tools=_tools(row, attr), messages=messages)


def _role_map(attr: DatasetAttr) -> dict[str, str]:
    t = attr.tags
    pairs = (
        (t.get("user_tag"), "user"),
        (t.get("assistant_tag"), "assistant"),
        (t.get("observation_tag"), "tool"),
        (t.get("function_tag"), "assistant"),
    )
    return {tag: role for tag, role in pairs if tag}


def _from_sharegpt(row: dict[str, Any], attr: DatasetAttr) -> Conversation:
    column = attr.column("messages")
    raw = row.get(column)
    if raw is None:
        raise BadRow(f"messages column '{column}' is missing")
    if not isinstance(raw, list):
        raise BadRow(f"messages column '{column}' must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise BadRow("empty conversation (no messages)")
    role_tag, content_tag, system_tag = (
        attr.tags["role_tag"],
        attr.tags["content_tag"],
        attr.tags.get("system_tag"),
    )
    roles = _role_map(attr)
    system = _system(row, attr)
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRow(f"message {i} must be a mapping with '{role_tag}' and '{content_tag}'")
        tag = message.get(role_tag)
        content = _message_content(message, i, attr)
        if system_tag and tag == system_tag:
            if i != 0:
                raise BadRow(f"message {i} is a system message; only the first message may be one")
            system = content
            continue
        if tag not in roles:
            known = ", ".join(repr(t) for t in list(roles) + ([system_tag] if system_tag else []))
            raise BadRow(f"message {i} has unknown role {tag!r} (known: {known})")
        messages.append({"role": roles[tag], "content": content})
    if not messages:
        raise BadRow("empty conversation (only a system message)")
    return Conversation(system=system, tools=_tools(row, attr), messages=messages)


def _message_content(message: dict[str, Any], index: int, attr: DatasetAttr) -> str:
    content_tag = attr.tags["content_tag"]
    content = message.get(content_tag)
    calls = message.get("tool_calls") if attr.formatting == "openai" else None
    if calls:  # OpenAI-style tool calls become the assistant's text, as LlamaFactory writes them
        return json.dumps(
            [c.get("function", c) if isinstance(c, dict) else c for c in calls], ensure_ascii=False
        )
    if not isinstance(content, str):
        got = "nothing" if content is None else type(content).__name__
        raise BadRow(f"message {index} must have text under '{content_tag}', got {got}")
    return content


def check_turns(messages: list[dict[str, str]], *, require_final_assistant: bool) -> None:
    """Turns alternate: user (or tool) at even positions, assistant at odd ones."""
    for i, m in enumerate(messages):
        expected = PROMPT_SIDE if i % 2 == 0 else RESPONSE_SIDE
        if m["role"] not in expected:
            want = "a user or tool" if i % 2 == 0 else "an assistant"
            raise BadRow(
                f"message {i} is {m['role']} where {want} turn is expected "
                f"(turns must alternate user/assistant)"
            )
    if require_final_assistant and messages[-1]["role"] != "assistant":
        raise BadRow(
            f"the last message is {messages[-1]['role']}, but a training sample must end with "
            f"an assistant turn"
        )


def to_document(row: dict[str, Any], attr: DatasetAttr) -> str:
    """The text of one pt document: the prompt column (and the query column, joined by a newline)."""
    prompt = _text(row, attr.column("prompt"), "text", required=True)
    query = _text(row, attr.column("query"), "query", required=False) if attr.column("query") else None
    return "\n".join(part for part in (prompt, query) if part)
