"""OpenAI chat messages -> the messages and tools a chat template renders.

- `developer` is a system message (OpenAI's newer name); content parts of type text are joined, and an
  `image_url` part becomes an <image> placeholder where it stands, its image in the message's `images`
  (https URLs, data: URLs, and local files only inside the server's media_dir); an `input_audio` part (base64
  data) an <audio> placeholder, its clip in `audios`.
- An assistant message's `tool_calls` go to the template as structured tool_calls (arguments as an
  object) when the template renders them itself, else as the text the model writes for them
  (tools.ToolSyntax.render), so the conversation reads as the model would have written it.
- A `tool` message keeps its content; its function's name is looked up from the call it answers.
- With no system message, the config's default_system is put first (as training did for such rows).
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from tuneforge.data.media import placeholders
from tuneforge.infer.request import RequestError
from tuneforge.infer.tools import ToolCall, ToolSyntax

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(value: Any, where: str, media_root: str | None) -> tuple[str | None, dict[str, list[Any]]]:
    """(text, media): text parts joined, each image_url / input_audio part an <image> / <audio> placeholder where it
    stands, its source under media["images"] / media["audios"]."""
    if value is None or isinstance(value, str):
        return value, {}
    texts, images, audios = [], [], []
    for j, part in enumerate(value):
        part = part if isinstance(part, dict) else part.model_dump()
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
            images.append(image_source(url, f"{where}.content.{j}.image_url.url", media_root))
            texts.append(placeholders()["image"])
        elif kind == "input_audio":
            audios.append(audio_source(part.get("input_audio"), f"{where}.content.{j}.input_audio"))
            texts.append(placeholders()["audio"])
        else:
            raise RequestError(f"{where}.content.{j}: content parts of type text, image_url and input_audio are "
                               f"supported (got type {kind!r})", param=f"{where}.content")
    media = {"images": images, "audios": audios}
    return "".join(texts), {key: refs for key, refs in media.items() if refs}


def audio_source(value: Any, where: str) -> dict[str, bytes]:
    """An input_audio part ({"data": base64, "format": "wav" | "mp3" | ...}) as the audio loader takes it."""
    data = value.get("data") if isinstance(value, dict) else None
    if not isinstance(data, str) or not data:
        raise RequestError(f"{where}.data must hold the audio as base64", param=f"{where}.data")
    try:
        return {"bytes": base64.b64decode(data, validate=True)}
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}.data is not valid base64", param=f"{where}.data") from None


def image_source(url: Any, where: str, media_root: str | None) -> Any:
    """An image_url's url as the image loader takes it: an https URL, the bytes of a data: URL, or a local file
    (a path or file:// URL) inside media_root; anything else is refused with the reason."""
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where} must be a URL", param=where)
    if url.startswith("https://"):
        return url
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.endswith(";base64") or not payload:
            raise RequestError(f"{where}: a data URL must be data:<type>;base64,<data>", param=where)
        try:
            return {"bytes": base64.b64decode(payload, validate=True)}
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: the data URL is not valid base64", param=where) from None
    if url.startswith("http://"):
        raise RequestError(f"{where}: plain http URLs are refused; use https or a data: URL", param=where)
    if url.startswith("file://"):
        host, _, path = url[len("file://"):].partition("/")
        if host not in ("", "localhost"):
            raise RequestError(f"{where}: file URLs of other hosts are refused", param=where)
        url = "/" + path
    if "://" in url:
        raise RequestError(f"{where}: use an https, data: or file URL", param=where)
    if media_root is None:
        raise RequestError(f"{where}: this server reads no local files (start it with media_dir set to the folder "
                           f"clients may name)", param=where)
    root = Path(media_root).resolve()
    path = (root / url).resolve()
    if not path.is_relative_to(root):
        raise RequestError(f"{where}: {url} is outside the server's media_dir", param=where)
    return str(path)


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
                      default_system: str | None = None, media_root: str | None = None) -> list[dict[str, Any]]:
    """Messages (dicts in OpenAI's shape) as the chat template takes them (a user message's images under
    `images`); RequestError names the bad one. media_root: the folder local image files may come from."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where, role = f"messages.{i}", m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role: unknown role {role!r} (known: {', '.join(ROLES)})",
                               param=f"{where}.role")
        content, media = _content(m.get("content"), where, media_root)
        if media and role != "user":
            raise RequestError(f"{where}: only user messages carry images or audio", param=f"{where}.content")
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
            out.append({"role": role, "content": content, **media})
    if all(m["role"] == "system" for m in out):
        raise RequestError("messages hold no user message", param="messages")
    if default_system and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": default_system})
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tools list, as apply_chat_template takes it ({type: function, function: {...}})."""
    return [{"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}}
            for t in tools] if tools else None
