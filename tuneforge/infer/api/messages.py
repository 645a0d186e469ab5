"""OpenAI chat messages -> the messages and tools a chat template renders.

- `developer` is a system message (OpenAI's newer name); content parts of type text are joined.
- An assistant message's `tool_calls` go to the template as structured tool_calls (arguments as an
  object) when the template renders them itself, else as the text the model writes for them
  (tools.ToolSyntax.render), so the conversation reads as the model would have written it.
- A `tool` message keeps its content; its function's name is looked up from the call it answers.
- With no system message, the config's default_system is put first (as training did for such rows).
"""

from __future__ import annotations

import json
from typing import Any

from tuneforge.infer.request import RequestError
from tuneforge.infer.tools import ToolCall, ToolSyntax

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    texts = []
    for j, part in enumerate(value):
        part = part if isinstance(part, dict) else part.model_dump()
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content.{j}: only text content parts are supported "
                               f"(got type {part.get('type')!r})", param=f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)


def _call(raw: dict[str, Any], where: str) -> ToolCall:
    function = raw.get("function") or {}
    args = function.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}.function.arguments is not valid JSON ({e})",
                               param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments")
    return ToolCall(function.get("name", ""), args, raw.get("id") or "")


def template_messages(messages: list[dict[str, Any]], syntax: ToolSyntax, *,
                      default_system: str | None = None) -> list[dict[str, Any]]:
    """Messages (dicts in OpenAI's shape) as the chat template takes them; RequestError names the bad one."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where, role = f"messages.{i}", m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role: unknown role {role!r} (known: {', '.join(ROLES)})",
                               param=f"{where}.role")
        content = _content(m.get("content"), where)
        calls = [_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(m.get("tool_calls") or [])]
        if calls and role != "assistant":
            raise RequestError(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
        if content is None and not calls:
            raise RequestError(f"{where}.content is required", param=f"{where}.content")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": content})
        elif role == "tool":
            msg = {"role": "tool", "content": content or ""}
            call_id = m.get("tool_call_id")
            if call_id:
                msg["tool_call_id"] = call_id
                if call_id in call_names:
                    msg["name"] = call_names[call_id]
            out.append(msg)
        elif role == "assistant" and calls:
            call_names.update((c.id, c.name) for c in calls if c.id)
            if syntax.structured:
                out.append({"role": "assistant", "content": content or "", "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]})
            else:
                text = syntax.render(calls)
                out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        else:
            out.append({"role": role, "content": content})
    if all(m["role"] == "system" for m in out):
        raise RequestError("messages hold no user message", param="messages")
    if default_system and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": default_system})
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tools list, as apply_chat_template takes it ({type: function, function: {...}})."""
    return [{"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}}
            for t in tools] if tools else None
