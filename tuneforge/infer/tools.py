"""Tool calls in a model's text, in the chat template's own convention, and back into text.

The syntax is read from the chat template's Jinja text:

| syntax | template mentions | the model writes |
|---|---|---|
| hermes  | `<tool_call>` (Qwen2.5, Qwen3, Hermes) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call |
| mistral | `[TOOL_CALLS]` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` |
| llama3  | `<|python_tag|>` or `"parameters"` (Llama 3.1+) | `{"name": ..., "parameters": {...}}` |
| json    | none of these (the default) | the whole answer is `{"name": ..., "arguments": {...}}` or a list of them |
| action  | (tool_format: default) | `Action: name` then `Action Input: {...}`, per call |
| xml     | `<function=` (Qwen3.5, Qwen3-Coder) | `<tool_call><function=name><parameter=key>value</parameter>...</function></tool_call>` |

`json` is the function-call turn of LlamaFactory's tool datasets (glaive_toolcall's `function_call`
messages), so a model fine-tuned on such data by tuneforge writes it whatever its template is; every
syntax therefore also accepts it. A call counts only when it names one of the request's tools and its
arguments are a JSON object; otherwise the text stays an answer.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from tuneforge.infer.decode import held_back

SYNTAXES = ("hermes", "mistral", "llama3", "json", "action", "xml")
PYTHON_TAG = "<|python_tag|>"
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "action": "Action:", "xml": "<tool_call>"}
_XML_CALL = re.compile(r"<tool_call>\s*<function=([^\s<>]+)>(.*?)</function>\s*</tool_call>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^\s<>]+)>\n?(.*?)\n?</parameter>", re.S)
_ACTION = re.compile(r"Action:\s*([^\s]+)\s*\nAction Input:\s*(.+?)(?=\s*\nAction:|\s*\Z)", re.S)
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)
_MISTRAL_ARGS = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?\[ARGS\]\s*(.*)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's tool_calls item: arguments as a JSON string."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _call(obj: Any) -> ToolCall | None:
    """{"name": str, "arguments" | "parameters": object or JSON text of one} -> a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args)


def _calls(value: Any) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    return calls if calls and all(c is not None for c in calls) else None


def _whole_json(text: str) -> tuple[int, list[ToolCall] | None]:
    """The whole answer is a call object or a list of them (after an optional <|python_tag|>)."""
    start = len(text) - len(text.lstrip())
    body = text[start:]
    body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
    return start, _calls(_loads(body.strip()))


def _hermes(text: str) -> tuple[int, list[ToolCall] | None]:
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks:
        return 0, None
    calls = [_call(_loads(b.group(1))) for b in blocks]
    return blocks[0].start(), (calls if all(c is not None for c in calls) else None)


def _mistral(text: str) -> tuple[int, list[ToolCall] | None]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return 0, None
    parts = [p.strip() for p in text[start:].split("[TOOL_CALLS]") if p.strip()]
    calls: list[ToolCall | None] = []
    for part in parts:
        if part.startswith(("[", "{")):  # [TOOL_CALLS][{...}, ...]
            calls += _calls(_loads(part)) or [None]
            continue
        m = _MISTRAL_ARGS.fullmatch(part)  # [TOOL_CALLS]name[ARGS]{...} (tokenizer v11+)
        args = _loads(m.group(2).strip()) if m else None
        calls.append(ToolCall(m.group(1), args) if m and isinstance(args, dict) else None)
    return start, (calls if calls and all(c is not None for c in calls) else None)


def _action(text: str) -> tuple[int, list[ToolCall] | None]:
    found = list(_ACTION.finditer(text))
    if not found:
        return 0, None
    calls = [_call({"name": m.group(1), "arguments": _loads(m.group(2).strip())}) for m in found]
    return found[0].start(), (calls if all(c is not None for c in calls) else None)


def _xml(text: str) -> tuple[int, list[ToolCall] | None]:
    found = list(_XML_CALL.finditer(text))
    if not found:
        return 0, None
    calls = []
    for m in found:  # a value is JSON when it reads as JSON, else the text itself
        args = {k: (v if (parsed := _loads(v)) is None and v != "null" else parsed) for k, v in _XML_PARAM.findall(m.group(2))}
        calls.append(ToolCall(m.group(1), args))
    return found[0].start(), calls


@dataclass(frozen=True)
class ToolSyntax:
    name: str  # one of SYNTAXES
    structured: bool  # the template renders an assistant message's tool_calls itself

    def parse(self, text: str, tool_names: set[str] | frozenset[str]) -> tuple[str, list[ToolCall]]:
        """(the answer's text before the calls, the calls with fresh ids); no calls -> (text, [])."""
        start, calls = {"hermes": _hermes, "mistral": _mistral, "action": _action, "xml": _xml}.get(
            self.name, _whole_json)(text)
        if not calls:
            start, calls = _whole_json(text)
        if not calls or any(c.name not in tool_names for c in calls):
            return text, []
        content = text[:start].rstrip()
        return content, [ToolCall(c.name, c.arguments, new_call_id()) for c in calls]

    def hold_from(self, text: str) -> int:
        """Where in a streamed answer a tool call may be starting: text from here on is held back
        until the answer ends (len(text) when nothing needs holding)."""
        body = text.lstrip()
        if not body or body[0] in "{[" or body.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(body):
            return 0  # the whole answer may be a JSON call
        marker = _MARKERS.get(self.name)
        if marker is None:
            return len(text)
        at = text.find(marker)
        return at if at >= 0 else len(text) - held_back(text, (marker,))

    def render(self, calls: list[ToolCall]) -> str:
        """The text a model writes for these calls, for templates that do not render tool_calls."""
        key = "parameters" if self.name == "llama3" else "arguments"
        objs = [{"name": c.name, key: c.arguments} for c in calls]
        if self.name == "hermes":
            return "\n".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>" for o in objs)
        if self.name == "mistral":
            return "[TOOL_CALLS]" + json.dumps(objs, ensure_ascii=False)
        if self.name == "xml":
            return "\n".join(
                f"<tool_call>\n<function={c.name}>"
                + "".join(f"\n<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>"
                          for k, v in c.arguments.items())
                + "\n</function>\n</tool_call>" for c in calls)
        if self.name == "action":
            return "\n".join(f"Action: {o['name']}\nAction Input: {json.dumps(o['arguments'], ensure_ascii=False)}"
                             for o in objs)
        return json.dumps(objs[0] if len(objs) == 1 else objs, ensure_ascii=False)


def tool_syntax(template_text: str) -> ToolSyntax:
    """The tool-call convention of a chat template (its Jinja text)."""
    if "<tool_call>" in template_text:
        name = "hermes"
    elif "[TOOL_CALLS]" in template_text:
        name = "mistral"
    elif PYTHON_TAG in template_text or '"parameters"' in template_text:
        name = "llama3"
    else:
        name = "json"
    return ToolSyntax(name, structured="tool_calls" in template_text)
