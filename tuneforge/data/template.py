"""Render a Conversation with a chat template and find the tokens the model is trained on.

By default the tokenizer's own `chat_template` renders the text, through `apply_chat_template`, so the
training tokens are exactly the ones the model sees at inference. The supervised spans are found by
rendering prefixes: the text of `messages[:i]` with the generation prompt ends where assistant turn i
starts, and the text of `messages[:i + 1]` ends where it stops. Characters map to tokens through the fast
tokenizer's offset mapping; a token that overlaps a span is supervised.

Rows of a dataset mostly share a few shapes (roles in order, tools): the encoders pass a per-batch `Layouts`, so a
conversation whose shape was met before renders once and takes its spans from the shape's layout when its text is
that layout's with its contents put in (else it renders its prefixes); with a template that provably writes contents
verbatim (data/verbatim.py) it is not rendered at all: its text, and where the template's prefixes are not prefixes
of the whole (Qwen3 writes the last answer's empty reasoning block) the texts of its prefixes too, are the marked
renders with the contents put in.

A supervised span is the assistant's content plus the template's end-of-turn marker (`<|im_end|>`,
`<|eot_id|>`, `</s>`): the model must learn to stop. Whitespace that the template writes after the
marker (ChatML's newline) stays unsupervised: generation stops at the marker, so the model never
produces that newline itself.

Every render passes the ChatTemplate's options (enable_thinking, preserve_thinking) to the template, and with a
tool_format writes tools and calls into the messages first (data/tool_formats.py): training, chat, api, eval and
export all render the same way. A run that sets enable_thinking records it in the chat template saved with the
model (with_thinking_recorded), which inference reads back for an adapter (recorded_thinking).
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tuneforge.data import chat_formats, tool_formats, verbatim, word_tokens
from tuneforge.data.formats import BadRow, Conversation
from tuneforge.errors import DataError

logger = logging.getLogger(__name__)

# Our own Jinja chat templates, for models whose tokenizer has none. Each one renders a prefix of a
# conversation as a prefix of its text, which the span search relies on. "default" and "empty" are written
# here; every LlamaFactory template name with a chat format of its own has one in chat_formats.
_SYSTEM_FIRST = r"{%- set rest = messages[1:] if messages[0]['role'] == 'system' else messages -%}"

TEMPLATES: dict[str, str] = {
    "default": _SYSTEM_FIRST
    + (
        r"{%- if messages[0]['role'] == 'system' -%}"
        r"{{ 'System: ' + messages[0]['content'] + '\n' }}{%- endif -%}"
        r"{%- if tools -%}{{ 'Tools: ' + (tools | tojson) + '\n' }}{%- endif -%}"
        r"{%- for m in rest -%}"
        r"{%- if m['role'] == 'user' -%}{{ 'Human: ' + m['content'] + '\n' }}"
        r"{%- elif m['role'] == 'tool' -%}{{ 'Observation: ' + m['content'] + '\n' }}"
        r"{%- else -%}{{ 'Assistant: ' + m['content'] + (eos_token or '') + '\n' }}{%- endif -%}"
        r"{%- endfor -%}"
        r"{%- if add_generation_prompt -%}{{ 'Assistant: ' }}{%- endif -%}"
    ),
    "empty": (
        r"{%- for m in messages -%}"
        r"{%- if m['role'] == 'assistant' -%}{{ m['content'] + (eos_token or '') }}"
        r"{%- else -%}{{ m['content'] }}{%- endif -%}"
        r"{%- endfor -%}"
    ),
}
TEMPLATES.update({name: chat_formats.source(name) for name in chat_formats.names()})

# Formats rather than model families: the name always means our template, even when the tokenizer has one.
GENERIC_TEMPLATES = ("default", "empty", "alpaca", "fewshot")
# Names of model families (LlamaFactory's template names): with a tokenizer that has a chat_template we use
# that template, token for token; without one, ours (TEMPLATES), or an error for the MODEL_ONLY names.
FAMILY_TEMPLATES = frozenset(TEMPLATES).union(chat_formats.MODEL_ONLY).difference(GENERIC_TEMPLATES)
_CHOICES = f"{', '.join(GENERIC_TEMPLATES)}, or a LlamaFactory template name such as qwen, llama3 or mistral"


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # "tokenizer" for the tokenizer's own, else one of TEMPLATES
    source: str | None  # Jinja text of ours; None = the tokenizer's own
    options: tuple[tuple[str, Any], ...] = ()  # variables the template reads (enable_thinking, preserve_thinking)
    tool_format: str | None = None  # tools and calls written into the text (data/tool_formats.py), else the template's

    @property
    def kwargs(self) -> dict[str, Any]:
        """The options as apply_chat_template's keyword arguments."""
        return dict(self.options)

    @property
    def thinking(self) -> bool | None:
        """enable_thinking as given (None: the template's own default)."""
        return self.kwargs.get("enable_thinking")

    def jinja(self, tokenizer: Any) -> Any:
        """The Jinja text rendered: ours, else the tokenizer's chat_template (a str, named ones in a dict, or None)."""
        return self.source if self.source is not None else getattr(tokenizer, "chat_template", None)

    def saved_text(self, tokenizer: Any) -> str | None:
        """The Jinja text a saved model carries: ours or the tokenizer's, recording enable_thinking."""
        own = self.jinja(tokenizer)
        return with_thinking_recorded(own, self.thinking) if isinstance(own, str) else own

    def text(self, tokenizer: Any) -> str:
        """The Jinja text and its options, for the cache key."""
        own = self.jinja(tokenizer)
        own = own if isinstance(own, str) else json.dumps(own, sort_keys=True)
        return own + (json.dumps(self.kwargs, sort_keys=True) if self.options else "") + (self.tool_format or "")


def resolve_template(name: str | None, tokenizer: Any, *, enable_thinking: bool | None = None,
                     preserve_thinking: bool = False, tool_format: str | None = None) -> ChatTemplate:
    """The chat template for `template: name` (None: the tokenizer's own), with the thinking options it is
    rendered with (enable_thinking None: the template's default; preserve_thinking false is every template's) and
    the tool format (used with a template of ours, or a model's own that does not render tools)."""
    named = _resolve_name(name, tokenizer)
    if tool_format and named.source is None and "tools" in named.text(tokenizer):
        logger.info("tool_format %s: the model's chat template renders tools itself, so its own way is used",
                    tool_format)
        tool_format = None
    if enable_thinking is None and named.source is None and (name or "").endswith("_nothink"):
        enable_thinking = False  # LlamaFactory's *_nothink names on the model's own template: its non-thinking mode
    options = {"enable_thinking": enable_thinking} if enable_thinking is not None else {}
    if preserve_thinking:
        options["preserve_thinking"] = True
    return ChatTemplate(named.name, named.source, tuple(options.items()), tool_format)


def _resolve_name(name: str | None, tokenizer: Any) -> ChatTemplate:
    has_own = bool(getattr(tokenizer, "chat_template", None))
    if name is None:
        if not has_own:
            raise DataError(
                f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat_template; "
                f"set template to one of {_CHOICES}"
            )
        return ChatTemplate("tokenizer", None)
    if name in FAMILY_TEMPLATES and has_own:
        logger.info("template '%s': using the tokenizer's own chat_template", name)
        return ChatTemplate("tokenizer", None)
    if name in TEMPLATES:
        return ChatTemplate(name, TEMPLATES[name])
    if name in chat_formats.MODEL_ONLY:
        raise DataError(
            f"template '{name}' needs the model's own chat template ({chat_formats.MODEL_ONLY[name]}), but the "
            f"tokenizer has no chat_template; use the model's tokenizer, or set template to one of {_CHOICES}"
        )
    raise DataError(f"unknown template '{name}'; choose one of {_CHOICES} (README: Chat templates), or leave it unset")


def parse_tools(tools: str | None) -> list[dict[str, Any]] | None:
    """A conversation's tools JSON as `apply_chat_template` takes it: [{type: function, function: {...}}]."""
    if not tools:
        return None
    try:
        value = json.loads(tools)
    except json.JSONDecodeError as e:
        raise BadRow(f"tools is not valid JSON ({e})") from None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow("tools must be a JSON list of function descriptions")
    return [t if "function" in t else {"type": "function", "function": t} for t in value] or None


def _render(
    tokenizer: Any, template: ChatTemplate, messages: list[dict], tools: list | None, gen: bool
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template.source, tokenize=False, add_generation_prompt=gen,
            **template.kwargs,
        )
    except Exception as e:  # templates raise for conversations they refuse (e.g. raise_exception)
        raise BadRow(f"the chat template cannot render this conversation: {e}") from None


def with_tool_format(template: ChatTemplate, messages: list[dict], tools: list | None) -> tuple[list[dict], list | None]:
    """With a tool_format, the tools and call turns written into the messages (no tools left for the template)."""
    if template.tool_format:
        return tool_formats.apply(template.tool_format, messages, tools), None
    return messages, tools


def render_prompt(
    tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]], tools: list | str | None = None
) -> list[int]:
    """Token ids of a conversation up to the assistant's next turn, the generation prompt included, tokenized
    as training tokenizes (chat, eval and the RL stages' prompts all start from this)."""
    if isinstance(tools, str):
        tools = parse_tools(tools)
    messages, tools = with_tool_format(template, messages, tools or None)
    text = _render(tokenizer, template, messages, tools, True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render(
    tokenizer: Any, template: ChatTemplate, conv: Conversation, messages: list[dict[str, Any]] | None = None,
    layouts: Layouts | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The text of the whole conversation and the character span of each assistant turn.

    tokenizer: a tokenizer or a processor (anything with apply_chat_template); messages: the conversation's
    messages as that template takes them (default: text contents, conv.chat_messages()); layouts: the spans of
    conversation shapes already seen in this batch (Layouts), so a repeated shape is rendered once, not per prefix."""
    messages = messages if messages is not None else conv.chat_messages()
    if template.thinking is False:  # trained to answer without thinking: no reasoning is learned
        messages = [without_reasoning(m) if m["role"] == "assistant" else m for m in messages]
    if any(m.get("reasoning_content") for m in messages):  # LlamaFactory v1's reasoning parts
        from tuneforge.data.v1 import fold_reasoning

        messages = fold_reasoning(messages, "reasoning_content" in template.text(tokenizer))
    # once for the whole conversation: each prefix below renders the same messages
    messages, tools = with_tool_format(template, messages, parse_tools(conv.tools))
    filled = layouts.filled(tokenizer, template, messages, tools) if layouts is not None else None
    if filled is not None:
        return filled
    full = _render(tokenizer, template, messages, tools, False)
    found = layouts.spans(tokenizer, template, messages, tools, full) if layouts is not None else None
    if found is None:
        found = _prefix_spans(messages, full, lambda k, gen: _render(tokenizer, template, messages[:k], tools, gen))
    return full, found


def _prefix_spans(messages: list[dict[str, Any]], full: str, render: Callable[[int, bool], str]
                  ) -> list[tuple[int, int]]:
    """Each assistant turn's span, found from the texts of the prefixes that end before and after it
    (`render(k, generation_prompt)`: the text of `messages[:k]`)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(i, True)
        through = render(i + 1, False)
        start, end = _locate(full, before, through, _text_of(message["content"]), cursor, i)
        end = _trim_end(full, start, end)
        spans.append((start, end))
        cursor = end
    return spans


def _trim_end(full: str, start: int, end: int) -> int:
    while end > start and full[end - 1].isspace():  # whitespace after the end-of-turn marker
        end -= 1
    return end


# A stand-in for message j's content while a conversation shape is rendered (private-use characters; a content
# holding one renders its prefixes)
_MARK = "\ue000{}\ue001"


@dataclass(frozen=True)
class _Layout:
    """A conversation shape rendered with marks for contents: the text between the marks, and each assistant
    turn's span as (piece, offset in that piece) for its start and end."""

    pieces: tuple[str, ...]  # len(messages) + 1 texts; the contents go between them
    spans: tuple[tuple[tuple[int, int], tuple[int, int]], ...]

    def fill(self, contents: list[str]) -> str:
        return _fill(self.pieces, contents)

    def spans_in(self, contents: list[str], full: str) -> list[tuple[int, int]] | None:
        """The spans in the text with these contents (trimmed as _prefix_spans trims), None if they overlap."""
        starts = [0]  # where piece k starts in the filled text
        for piece, content in zip(self.pieces, contents, strict=False):
            starts.append(starts[-1] + len(piece) + len(content))
        out, cursor = [], 0
        for (k, a), (m, b) in self.spans:
            start, end = starts[k] + a, starts[m] + b
            if start < cursor:  # the prefix renders would not locate it this way either: render them
                return None
            end = _trim_end(full, start, end)
            out.append((start, end))
            cursor = end
        return out


def _shape(messages: list[dict[str, Any]], tools: list | None) -> tuple | None:
    """What a conversation's layout depends on besides its contents; None when its messages hold more than a
    role and a text (their renders are not a matter of contents alone)."""
    for m in messages:
        if len(m) != 2 or not isinstance(m.get("content"), str) or "\ue000" in m["content"]:
            return None
    return tuple(m["role"] for m in messages), json.dumps(tools, sort_keys=True) if tools else None


def _fill(pieces: tuple[str, ...], contents: list[str]) -> str:
    return "".join(p + c for p, c in zip(pieces, contents, strict=False)) + pieces[-1]


def _marked(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": _MARK.format(j)} for j, m in enumerate(messages)]


def _pieces(full: str, marked: list[dict[str, str]]) -> tuple[str, ...] | None:
    """A marked render cut at its marks; None when they do not show each content once, in order."""
    pieces, at = [], 0
    for m in marked:
        found = full.find(m["content"], at)
        if found < 0 or full.count(m["content"]) != 1:
            return None
        pieces.append(full[at:found])
        at = found + len(m["content"])
    pieces.append(full[at:])
    return tuple(pieces)


def _layout(tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]],
            tools: list | None) -> _Layout | None:
    """The layout of this conversation's shape, or None when the marks do not show each content once, in order,
    or a prefix does not render as a prefix of the whole (such shapes are rendered prefix by prefix)."""
    marked = _marked(messages)
    try:
        full = _render(tokenizer, template, marked, tools, False)
        pieces = _pieces(full, marked)
        if pieces is None:
            return None
        bounds, at = [], 0  # (start, end) of each piece in the marked text
        for piece, m in zip(pieces, [*marked, {"content": ""}], strict=True):
            bounds.append((at, at + len(piece)))
            at += len(piece) + len(m["content"])

        def anchor(position: int) -> tuple[int, int] | None:
            return next(((k, position - a) for k, (a, b) in enumerate(bounds) if a <= position <= b), None)

        spans = []
        for i, m in enumerate(marked):
            if m["role"] != "assistant":
                continue
            before = _render(tokenizer, template, marked[:i], tools, True)
            through = _render(tokenizer, template, marked[: i + 1], tools, False)
            start, end = anchor(len(before)), anchor(len(through))
            if not (full.startswith(through) and through.startswith(before)) or start is None or end is None:
                return None
            spans.append((start, end))
    except BadRow:
        return None
    return _Layout(tuple(pieces), tuple(spans))


class _Unfilled(Exception):
    """A prefix's marked render does not show each content once, in order."""


class Layouts:
    """The layouts of the conversation shapes one batch holds (its roles in order, its tools).

    Rows of one dataset mostly share a few shapes (system?, user, assistant, ...). A shape seen twice is rendered
    once with marks for its contents, prefix by prefix; a conversation of that shape then renders once, and where
    its text is the marked text with the contents put in, its spans are the marked spans moved by the contents'
    lengths. A template that writes a content other than verbatim (trims it, drops reasoning) gives another text,
    and such a conversation is rendered prefix by prefix, as every conversation of an unfit shape is. Where the
    template's syntax proves that it writes every content verbatim, or every one trimmed (data/verbatim.py), a
    conversation whose contents its Form takes (none empty, none holding text the template looks for, ...) is not
    rendered at all: its text is the marked text with its contents (trimmed) put in. Where the shape's prefixes do
    not render as prefixes of the whole (Qwen3's empty reasoning block goes before the last answer only), the
    prefixes' texts are filled in from their own marked renders, and the spans found from them as from rendered
    prefixes."""

    def __init__(self) -> None:
        self._seen: dict[tuple, int] = {}
        self._layouts: dict[tuple, _Layout | None] = {}
        self._prefixes: dict[tuple, tuple[str, ...] | None] = {}  # (shape of a prefix, generation prompt) -> pieces
        self._today: tuple[str, ...] | None = None  # the date the layouts hold, where the template writes it

    def filled(self, tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]],
               tools: list | None) -> tuple[str, list[tuple[int, int]]] | None:
        """The text and assistant spans of a conversation from its shape's marked renders, without rendering it,
        where the template writes contents verbatim (or all of them trimmed) and the contents are ones its Form
        takes (none empty, ...); else None (render it)."""
        own = template.jinja(tokenizer)
        form = verbatim.content_form(own) if isinstance(own, str) else None
        key = _shape(messages, tools) if form is not None else None
        contents = form.contents(messages) if key is not None else None
        if contents is None:
            return None
        if form.clock:
            self._dated(form.clock)
        layout = self._layout(key, tokenizer, template, messages, tools)
        if layout is None:  # the prefixes filled in too, their spans found as from rendered prefixes
            return self._filled_prefixes(key, tokenizer, template, messages, tools, contents)
        text = layout.fill(contents)
        spans = layout.spans_in(contents, text)
        return None if spans is None else (text, spans)

    def _dated(self, formats: frozenset[str]) -> None:
        """Start the layouts again where today's date, as the template writes it (transformers' strftime_now), is no
        longer the one they were rendered with."""
        today = tuple(datetime.now().strftime(f) for f in sorted(formats))
        if today != self._today:
            self._seen.clear()
            self._layouts.clear()
            self._prefixes.clear()
            self._today = today

    def _filled_prefixes(self, key: tuple, tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]],
                         tools: list | None, contents: list[str]) -> tuple[str, list[tuple[int, int]]] | None:
        def fill(k: int, gen: bool) -> str:
            prefix = (key[0][:k], key[1], gen)
            if prefix not in self._prefixes:
                marked = _marked(messages[:k])
                try:
                    self._prefixes[prefix] = _pieces(_render(tokenizer, template, marked, tools, gen), marked)
                except BadRow:
                    self._prefixes[prefix] = None
            if self._prefixes[prefix] is None:
                raise _Unfilled
            return _fill(self._prefixes[prefix], contents[:k])

        try:
            full = fill(len(messages), False)
            return full, _prefix_spans(messages, full, fill)
        except _Unfilled:
            return None

    def _layout(self, key: tuple, tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]],
                tools: list | None) -> _Layout | None:
        if key not in self._layouts:
            self._layouts[key] = _layout(tokenizer, template, messages, tools)
        return self._layouts[key]

    def spans(self, tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]], tools: list | None,
              full: str) -> list[tuple[int, int]] | None:
        """The assistant spans of the conversation whose text is `full`, or None to render its prefixes."""
        key = _shape(messages, tools)
        if key is None:
            return None
        self._seen[key] = seen = self._seen.get(key, 0) + 1
        if seen < 2:  # a shape met once costs no extra render
            return None
        layout = self._layout(key, tokenizer, template, messages, tools)
        contents = [m["content"] for m in messages]
        if layout is None or layout.fill(contents) != full:
            return None
        return layout.spans_in(contents, full)


_THOUGHT = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message without its reasoning (a `<think>...</think>` part of its text, reasoning_content)."""
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = _THOUGHT.sub("", content)
    elif isinstance(content, list):
        out["content"] = [{**p, "text": _THOUGHT.sub("", p["text"])} if p.get("type") == "text" else p for p in content]
    return out


# A saved chat template starts with this line when training set enable_thinking: the model then answers as it was
# trained (with or without thinking) wherever its template is rendered without the option (transformers, vLLM,
# Ollama), and tuneforge reads the line back for an adapter.
_THINKING_LINE = "{%- if enable_thinking is not defined %}{%- set enable_thinking = VALUE %}{%- endif %}\n"
_RECORDED = re.compile(re.escape(_THINKING_LINE).replace("VALUE", "(true|false)"))


def with_thinking_recorded(source: str, thinking: bool | None) -> str:
    """The chat template's text, its first line recording enable_thinking (unchanged when thinking is None or
    the template does not read the option)."""
    source = _RECORDED.sub("", source, count=1) if _RECORDED.match(source) else source
    if thinking is None or "enable_thinking" not in source:
        return source
    return _THINKING_LINE.replace("VALUE", str(thinking).lower()) + source


def saved_chat_template(folder: str | Path) -> str | None:
    """The chat template saved in a folder (chat_template.jinja, else tokenizer_config.json's), None if none."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        found = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        return found if isinstance(found, str) else None
    return None


def record_thinking(owner: Any, thinking: bool | None) -> None:
    """Record enable_thinking in a tokenizer's / processor's own chat template, which is saved with the model (a
    template of ours is written by export)."""
    own = getattr(owner, "chat_template", None)
    if isinstance(own, str):
        owner.chat_template = with_thinking_recorded(own, thinking)


def recorded_thinking(source: str | None) -> bool | None:
    """The enable_thinking a saved chat template records (None: none)."""
    found = _RECORDED.match(source) if isinstance(source, str) else None
    return None if found is None else found.group(1) == "true"


def _text_of(content: str | list[dict[str, Any]]) -> str:
    """A message's text: the content itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _locate(full: str, before: str, through: str, content: str, cursor: int, index: int) -> tuple[int, int]:
    if full.startswith(through) and through.startswith(before) and len(before) >= cursor:
        return len(before), len(through)
    # The template renders earlier turns differently from the last one (e.g. it drops reasoning from the
    # history): find the content itself, then the end-of-turn text the template writes after it.
    at = full.find(content, cursor) if content else -1
    if at < 0:
        raise BadRow(
            f"the chat template does not show assistant message {index} verbatim, so its tokens "
            f"cannot be found; set template to one of {_CHOICES}"
        )
    end = at + len(content)
    marker = through[through.rfind(content) + len(content) :].rstrip()
    if marker and full.startswith(marker, end):
        end += len(marker)
    return at, end


def token_spans(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character spans -> [first, last) token indices of the tokens that overlap each span."""
    if isinstance(offsets, word_tokens.Tiled):
        return offsets.token_spans(spans)
    out = []
    for a, b in spans:  # bisect by key: no per-token list is built
        first = bisect.bisect_right(offsets, a, key=_end)  # first token that ends after the span starts
        last = bisect.bisect_left(offsets, b, lo=first, key=_start)  # first token that starts at or after its end
        out.append((first, max(first, last)))
    return out


def _start(offset: tuple[int, int]) -> int:
    return offset[0]


def _end(offset: tuple[int, int]) -> int:
    return offset[1]


def tokenize_rendered(
    tokenizer: Any, texts: list[str]
) -> tuple[list[list[int]], list[Sequence[tuple[int, int]]]]:
    """Token ids (as `apply_chat_template(tokenize=True)` makes them) and character offsets.

    The texts word_tokens takes come from there (the same ids and offsets, faster); the rest from the tokenizer."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("the sft encoder needs a fast tokenizer (tokenizer.json) for its offset mapping")
    words = word_tokens.for_tokenizer(tokenizer)
    if words is None:
        ids, offsets = [None] * len(texts), [None] * len(texts)
    else:
        ids, offsets = words.encode(texts)
    rest = [n for n, got in enumerate(ids) if got is None]
    if rest:
        enc = tokenizer([texts[n] for n in rest], add_special_tokens=False, return_offsets_mapping=True,
                        return_attention_mask=False, return_token_type_ids=False)
        for n, got_ids, got_offsets in zip(rest, enc["input_ids"], enc["offset_mapping"], strict=True):
            ids[n], offsets[n] = got_ids, got_offsets
    return ids, offsets
