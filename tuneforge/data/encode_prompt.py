"""The prompt encoder of the RL stages (grpo): raw rows -> prompts to sample completions from.

A prompt is the conversation up to its last user turn, rendered with the chat template's generation prompt:
an alpaca row's instruction + input (its history before them), or a sharegpt / openai conversation without
its final assistant turn, if it has one. Everything else the row holds (an `answer` or `solution` column, the
reference response, ...) is kept as JSON text in `columns`, and reaches the reward functions with each of the
prompt's completions.

A prompt must leave room for max_completion_length tokens within cutoff_len: a longer one keeps its last
tokens (the generation prompt and the question's end) and counts as truncated; one with images (a vision-language
model's: rendered by its processor, whose tensors the row keeps as mm_inputs) is dropped instead and counted as
media_cut, since a cut could split an image's tokens.
"""

from __future__ import annotations

import json
from typing import Any

from tuneforge.data import formats, template
from tuneforge.data.encode import EncodeSettings, batch_rows, source_row, stop_unless_skipping
from tuneforge.data.formats import BadRow
from tuneforge.data.registry import DatasetAttr

COLUMNS = "columns"  # the row's other columns, as JSON text


def prompt_features() -> Any:
    import datasets

    return datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32")),
        "attention_mask": datasets.List(datasets.Value("int8")),
        COLUMNS: datasets.Value("string"),
        "_status": datasets.Value("string"),
    })


def prompt_conversation(row: dict[str, Any], attr: DatasetAttr, default_system: str | None) -> formats.Conversation:
    """The row's conversation up to (and with) its last user turn."""
    if attr.formatting == "alpaca":
        conv = formats.alpaca_prompt(row, attr)
    else:
        conv = formats.to_conversation(row, attr, require_final_assistant=False)
        if conv.messages[-1]["role"] == "assistant":  # a finished conversation: prompt with its last question
            conv.messages.pop()
    if not conv.system and default_system:
        conv.system = default_system
    if not conv.messages or conv.messages[-1]["role"] == "assistant":
        raise BadRow("there is no user turn to answer")
    formats.check_turns(conv.messages, require_final_assistant=False)
    if not conv.messages[-1]["content"].strip():
        raise BadRow("the prompt is empty")
    return conv


def prompt_columns(attr: DatasetAttr) -> set[str]:
    """The columns the prompt is read from (the rest reach the rewards)."""
    used = {attr.column(k) for k in ("prompt", "query", "history", "system", "tools", "messages")}
    return {c for c in used if c}


def encode_prompts(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer: Any,
    chat: template.ChatTemplate,
    attr: DatasetAttr,
    settings: EncodeSettings,
    row_numbers: list[int] | None = None,
    processor: Any = None,
    media_settings: Any = None,
) -> dict[str, list]:
    """grpo / ppo: each row's prompt ids (generation prompt included) and its other columns as JSON text; with a
    processor, also the prompt's media tensors (mm_inputs)."""
    from tuneforge.data import media, multimodal

    budget = settings.cutoff_len - settings.completion_room
    own = prompt_columns(attr)
    out: dict[str, list] = {"input_ids": [], "attention_mask": [], COLUMNS: [], "_status": []}
    if processor is not None:
        out[multimodal.MEDIA_COLUMN] = []
    for i, row in enumerate(batch_rows(batch)):
        blob = b""
        try:
            conv = prompt_conversation(row, attr, settings.default_system)
            if processor is None:
                if conv.media:  # media parts of a LlamaFactory v1 row
                    raise BadRow(f"the row has {', '.join(conv.media)} media, but the model reads text only")
                ids = template.render_prompt(tokenizer, chat, conv.chat_messages(), conv.tools)
            else:
                conv.media = conv.media or media.row_media(row, attr.columns)
                ids, tensors = multimodal.prompt_inputs(processor, conv, media_settings, conv.tools, chat)
                if len(ids) <= budget:
                    blob = multimodal.pack_tensors(multimodal.stored_tensors(tensors, len(ids)), list(range(len(ids))))
        except BadRow as e:
            stop_unless_skipping(e, attr, settings, source_row(indices, i, row_numbers))
            ids, status = [], "bad"
        else:
            status = "ok" if len(ids) <= budget else "media_cut" if processor is not None else "ok_truncated"
            ids = ids[-budget:] if status != "media_cut" else []
        out["input_ids"].append(ids)
        out["attention_mask"].append([1] * len(ids))
        out[COLUMNS].append(json.dumps({k: v for k, v in row.items() if k not in own}, ensure_ascii=False, default=str))
        out["_status"].append(status)
        if processor is not None:
            out[multimodal.MEDIA_COLUMN].append(blob)
    return out


def row_columns(row: dict[str, Any]) -> dict[str, Any]:
    """The columns a prompt row carries for the rewards (parsed back from JSON)."""
    text = row.get(COLUMNS)
    return json.loads(text) if text else {}
