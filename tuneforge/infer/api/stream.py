"""From the engine's events to the client: the async bridge, tool-call holding, SSE chunks.

The engine's worker thread hands events to the event loop (`call_soon_threadsafe`), so a request
waits without holding a thread. With tools, text that may be the start of a tool call is held back
until the answer ends, then parsed (tools.ToolSyntax): the client gets either content or tool_calls,
never the raw call text.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from tuneforge.errors import TuneforgeError
from tuneforge.infer.api import protocol
from tuneforge.infer.engine import Engine
from tuneforge.infer.job import Delta, Done, Failed, Finish
from tuneforge.infer.request import RequestError, Sampling
from tuneforge.infer.tools import ToolCall, ToolSyntax

logger = logging.getLogger(__name__)


class Pending:
    """A submitted request whose events arrive on this event loop; iterate until Done (Failed raises)."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: Sampling,
                 media: dict[str, Any] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.job = engine.submit(prompt_ids, params, lambda e: loop.call_soon_threadsafe(self.events.put_nowait, e),
                                 media)

    async def __aiter__(self) -> AsyncIterator[Delta | Finish | Done]:
        while True:
            event = await self.events.get()
            if isinstance(event, Failed):
                raise event.error
            yield event
            if isinstance(event, Done):
                return


class ChoiceText:
    """One answer on its way out: `add` returns the content that can be sent now, `end` the rest."""

    def __init__(self, syntax: ToolSyntax | None, tool_names: frozenset[str]) -> None:
        self.syntax, self.names = syntax, tool_names
        self.text = ""  # everything generated
        self.content = ""  # what was (or will be) sent as content

    def add(self, delta: str) -> str:
        self.text += delta
        limit = len(self.text) if self.syntax is None else self.syntax.hold_from(self.text)
        if limit <= len(self.content):
            return ""
        out = self.text[len(self.content) : limit]
        self.content += out
        return out

    def end(self, reason: str) -> tuple[str, list[ToolCall], str]:
        """(content not sent yet, tool calls, finish_reason)."""
        calls: list[ToolCall] = []
        final = self.text
        if self.syntax is not None:
            parsed, calls = self.syntax.parse(self.text, self.names)
            if calls:
                final, reason = parsed, "tool_calls"
        rest = final[len(self.content) :] if final.startswith(self.content) else ""
        self.content += rest
        return rest, calls, reason


async def watch_disconnect(request: Any, pending: Pending, every: float = 0.5) -> None:
    """Cancel a non-streamed request whose client went away."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)
    pending.job.cancel()


async def collect(pending: Pending, request: Any, n: int, syntax: ToolSyntax | None,
                  names: frozenset[str]) -> tuple[list[dict[str, Any]], Done]:
    """The whole answers (OpenAI choices) and the usage counts."""
    texts = [ChoiceText(syntax, names) for _ in range(n)]
    choices: dict[int, dict[str, Any]] = {}
    done = Done(0, 0)
    watcher = asyncio.create_task(watch_disconnect(request, pending))
    try:
        async for event in pending:
            if isinstance(event, Delta):
                texts[event.index].add(event.text)
            elif isinstance(event, Finish):
                text = texts[event.index]
                _, calls, reason = text.end(event.reason)
                content = (text.content.strip() or None) if calls else text.content
                choices[event.index] = {
                    "index": event.index, "logprobs": None, "finish_reason": reason,
                    "message": protocol.message(content, [c.as_openai() for c in calls]),
                }
            else:
                done = event
    finally:
        watcher.cancel()
        pending.job.cancel()
    return [choices[i] for i in sorted(choices)], done


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse(engine: Engine, prompt_ids: list[int], params: Sampling, *, cid: str, created: int, model: str,
              syntax: ToolSyntax | None, names: frozenset[str], include_usage: bool,
              media: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """chat.completion.chunk events, then `data: [DONE]`. The request is submitted when the response
    starts; when the client goes away the response is cancelled at its next await, and `finally`
    cancels the generation."""
    n = params.n
    texts = [ChoiceText(syntax, names) for _ in range(n)]
    pending = Pending(engine, prompt_ids, params, media)

    def out(index: int | None = None, delta: dict | None = None, reason: str | None = None, use=None) -> str:
        return _sse(protocol.chunk(cid, created, model, index, delta, reason, use))

    try:
        for i in range(n):
            yield out(i, {"role": "assistant", "content": ""})
        async for event in pending:
            if isinstance(event, Delta):
                text = texts[event.index].add(event.text)
                if text:
                    yield out(event.index, {"content": text})
            elif isinstance(event, Finish):
                rest, calls, reason = texts[event.index].end(event.reason)
                if rest:
                    yield out(event.index, {"content": rest})
                if calls:
                    yield out(event.index, {"tool_calls": [{"index": k, **c.as_openai()} for k, c in enumerate(calls)]})
                yield out(event.index, {}, reason)
            elif include_usage:
                yield out(use=protocol.usage(event.prompt_tokens, event.completion_tokens))
        yield "data: [DONE]\n\n"
    except RequestError as e:
        yield _sse(protocol.request_error(e))
    except TuneforgeError as e:
        yield _sse(protocol.error(str(e)))
    except Exception as e:  # a bug: tell the client, keep serving
        logger.exception("streaming failed")
        yield _sse(protocol.error(f"generation failed: {e}", type="server_error"))
    finally:
        pending.job.cancel()
