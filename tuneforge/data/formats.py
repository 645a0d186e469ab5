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
    media: dict[str, list[Any]] = field(default_factory=dict)  # image / video / audio -> the row's references
    # per message, 1.0 trained / 0.0 not (LlamaFactory v1's loss_weight); None: every assistant message is trained
    loss_weights: list[float] | None = None

    def trained_turns(self) -> list[bool] | None:
        """Per assistant message, whether it is trained (None: all are)."""
        if self.loss_weights is None:
            return None
        return [w > 0 for m, w in zip(self.messages, self.loss_weights, strict=True) if m["role"] == "assistant"]

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as `apply_chat_template` takes them (a system message first when there is one)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]


def required_columns(attr: DatasetAttr, documents: bool = False, prompts: bool = False) -> list[str]:
    """documents: the rows are read as plain text documents (the pretrain encoder); prompts: only the prompt
    is read (the RL stages sample the answers)."""
    if attr.formatting == "alpaca":
        # a ranking row's answers are in its chosen / rejected columns, not in a response column
        keys: tuple[str, ...] = (
            ("prompt",) if documents or prompts or attr.kind == "pairwise" else ("prompt", "response")
        )
    else:
        keys = ("messages",)
    keys += {"pairwise": ("chosen", "rejected"), "feedback": ("kto_tag",)}.get(attr.kind, ())
    return [attr.column(k) for k in keys if attr.column(k)]


def check_columns(
    attr: DatasetAttr, column_names: list[str], stage: str, *, documents: bool = False, needs_response: bool = False,
    prompts: bool = False,
) -> None:
    """Stop before encoding when a column the stage needs is missing from the whole dataset.

    documents: the stage's encoder reads plain text documents (pretrain); needs_response: it reads an
    answer from every row (supervised), as a feedback dataset's rows always have one."""
    if documents and attr.formatting != "alpaca":
        raise DataError(
            f"dataset '{attr.name}': stage {stage} reads plain text, but the dataset is {attr.formatting}; "
            f'describe it with columns: {{"prompt": "<its text column>"}}'
        )
    if attr.formatting == "alpaca" and not attr.column("prompt"):
        raise DataError(f'dataset \'{attr.name}\': columns must name a prompt column (e.g. "prompt": "text")')
    needs_response = needs_response or attr.kind == "feedback"
    if needs_response and attr.formatting == "alpaca" and not attr.column("response"):
        raise DataError(
            f"dataset '{attr.name}': stage {stage} needs a response column in columns "
            f'(e.g. "response": "output")'
        )
    if attr.kind == "pairwise" and not (attr.column("chosen") and attr.column("rejected")):
        raise DataError(
            f"dataset '{attr.name}' has ranking: true, so columns must name its chosen and rejected "
            f'columns (e.g. "chosen": "chosen", "rejected": "rejected") in dataset_info.json'
        )
    missing = [c for c in required_columns(attr, documents, prompts) if c not in column_names]
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
    if attr.formatting == "v1":
        from tuneforge.data import v1

        return v1.to_conversation(row, attr, default_system=default_system,
                                  require_final_assistant=require_final_assistant)
    if attr.formatting == "alpaca":
        conv = _from_alpaca(row, attr)
    else:
        conv = _from_sharegpt(row, attr)
    if not conv.system and default_system:
        conv.system = default_system
    check_turns(conv.messages, require_final_assistant=require_final_assistant)
    return conv


def _from_alpaca(row: dict[str, Any], attr: DatasetAttr) -> Conversation:
    conv = alpaca_prompt(row, attr)
    response = _text(row, attr.column("response"), "response", required=True)
    if not conv.messages[-1]["content"] and not response and len(conv.messages) == 1:
        raise BadRow("empty conversation (no prompt and no response)")
    conv.messages.append({"role": "assistant", "content": response})
    return conv


def alpaca_prompt(row: dict[str, Any], attr: DatasetAttr) -> Conversation:
    """The history, then the prompt (and query) as the last user turn."""
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
    messages.append({"role": "user", "content": user})
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


@dataclass
class PairwiseRow:
    """A ranking row: the prompt (ending with a user or tool turn) and the two answers to it."""

    prompt: Conversation
    chosen: str | dict[str, Any]  # the answer's text, or its whole message (with reasoning_content)
    rejected: str | dict[str, Any]


@dataclass
class FeedbackRow:
    """A kto row: the prompt, the answer that is judged, and the judgement (True: desirable)."""

    prompt: Conversation
    completion: str
    desirable: bool


def to_pairwise(row: dict[str, Any], attr: DatasetAttr, *, default_system: str | None = None) -> PairwiseRow:
    """One ranking row -> PairwiseRow, or BadRow.

    alpaca: the prompt columns make the prompt, the chosen / rejected columns hold the answers as text.
    sharegpt / openai: the messages end with a user (or tool) turn, and the chosen / rejected columns each
    hold one assistant message, written with the dataset's tags.
    """
    if attr.formatting == "v1":
        from tuneforge.data import v1

        return v1.to_pairwise(row, attr, default_system=default_system)
    if attr.formatting == "alpaca":
        prompt = alpaca_prompt(row, attr)
        chosen = _text(row, attr.column("chosen"), "chosen", required=True)
        rejected = _text(row, attr.column("rejected"), "rejected", required=True)
    else:
        prompt = _from_sharegpt(row, attr)
        chosen, rejected = _answer_message(row, attr, "chosen"), _answer_message(row, attr, "rejected")
    if not prompt.system and default_system:
        prompt.system = default_system
    check_turns(prompt.messages, require_final_assistant=False)
    last = prompt.messages[-1]["role"]
    if last not in PROMPT_SIDE:
        raise BadRow(
            f"the messages of a ranking row must end with a user (or tool) turn, but the last is {last}; "
            f"the answers belong in the chosen and rejected columns"
        )
    return PairwiseRow(prompt, chosen, rejected)


def _answer_message(row: dict[str, Any], attr: DatasetAttr, key: str) -> str:
    """The content of the assistant message in the chosen / rejected column."""
    column = attr.column(key)
    message = row.get(column)
    if message is None:
        raise BadRow(f"{key} column '{column}' is missing")
    role_tag, content_tag = attr.tags["role_tag"], attr.tags["content_tag"]
    if not isinstance(message, dict):
        raise BadRow(
            f"{key} column '{column}' must hold one message ({{'{role_tag}': ..., '{content_tag}': ...}}), "
            f"got {type(message).__name__}"
        )
    tag = message.get(role_tag)
    if _role_map(attr).get(tag) != "assistant":
        raise BadRow(
            f"{key} must be an assistant message ({role_tag}: {attr.tags.get('assistant_tag')!r}), "
            f"got {role_tag}: {tag!r}"
        )
    return _answer_content(message, key, attr)


def _answer_content(message: dict[str, Any], key: str, attr: DatasetAttr) -> str:
    try:
        return _message_content(message, 0, attr)
    except BadRow:
        content_tag = attr.tags["content_tag"]
        got = message.get(content_tag)
        got_words = "nothing" if got is None else type(got).__name__
        raise BadRow(f"{key} must have text under '{content_tag}', got {got_words}") from None


def to_feedback(row: dict[str, Any], attr: DatasetAttr, *, default_system: str | None = None) -> FeedbackRow:
    """One kto row -> FeedbackRow, or BadRow: the conversation's last assistant turn is the judged answer."""
    column = attr.column("kto_tag")
    tag = row.get(column)
    if tag is None:
        raise BadRow(f"kto_tag column '{column}' is missing")
    if not isinstance(tag, bool):
        raise BadRow(f"kto_tag column '{column}' must be true or false, got {type(tag).__name__} {tag!r:.40}")
    conv = to_conversation(row, attr, default_system=default_system)
    answer = conv.messages.pop()
    return FeedbackRow(conv, answer["content"], tag)
