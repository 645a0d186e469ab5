"""OpenAI's wire format (the parts tuneforge serves): request models, response and chunk builders, errors.

Requests are pydantic models, so a wrong type or range is refused with the field's name before any
work; unknown fields are ignored, as OpenAI-compatible servers do, except those whose meaning we cannot
honour (logprobs, a JSON response_format, forced tool_choice), which are refused with a message.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuneforge.infer.request import MAX_N, RequestError


class ToolFunction(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: ToolFunction


class CalledFunction(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text


class ToolCallIn(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    role: str  # checked when the messages are converted, with the list of known roles
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the chat template (vLLM's name), e.g. enable_thinking

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported by this server")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        choice = self.tool_choice
        if choice is not None and choice not in ("auto", "none"):
            raise ValueError("tool_choice: only 'auto' and 'none' are supported (the model decides)")
        return self

    @property
    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class ScoreRequest(BaseModel):
    model: str
    messages: list[str] = Field(min_length=1)
    max_length: int | None = Field(None, ge=1)


# ---- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def message(content: str | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def completion(cid: str, created: int, model: str, choices: list[dict[str, Any]],
               use: dict[str, int]) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use}


def chunk(cid: str, created: int, model: str, index: int | None = None, delta: dict[str, Any] | None = None,
          finish_reason: str | None = None, use: dict[str, int] | None = None) -> dict[str, Any]:
    """A chat.completion.chunk: one choice's delta, or (index None) the final usage chunk."""
    choices = [] if index is None else [
        {"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}]
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def error(message: str, *, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of pydantic's first error, in words a client can act on."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None, \
            "invalid_json"
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if "input" in first and first.get("type") not in ("missing", "model_attributes_type"):
        given = repr(first["input"])
        msg += f" (got {given[:80]})"
    return (f"{param}: {msg}" if param else msg), param, "invalid_value"


def request_error(e: RequestError) -> dict[str, Any]:
    return error(str(e), param=e.param, code=e.code)
