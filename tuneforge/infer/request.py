"""What one generation request asks for, checked before it reaches the model, and why one is refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tuneforge.errors import TuneforgeError

MAX_N = 16  # answers per request: each is a row of the batch


class RequestError(TuneforgeError):
    """A request the engine cannot serve; `param` names the request field (as OpenAI's errors do)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class PromptTooLongError(RequestError):
    def __init__(self, prompt_tokens: int, context: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens, but the model's context is {context} tokens "
            f"(its max_position_embeddings) and at least one must be left for the answer; "
            f"shorten the messages or start a new conversation",
            param="messages", code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.context = context


@dataclass(frozen=True)
class Sampling:
    """Per-request settings; None means the config's generation key."""

    max_new_tokens: int
    n: int = 1
    temperature: float | None = None  # given: sampling iff > 0 (0 = greedy), whatever do_sample says
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    skip_special_tokens: bool | None = None


def sampling(
    prompt_tokens: int,
    context: int,
    default_max_new_tokens: int,
    *,
    max_tokens: int | None = None,
    n: int = 1,
    temperature: float | None = None,
    top_p: float | None = None,
    stop: str | Sequence[str] | None = None,
    seed: int | None = None,
    skip_special_tokens: bool | None = None,
) -> Sampling:
    """Checked settings; max_new_tokens is max_tokens (else the config's max_new_tokens) cut to the room
    the context leaves after the prompt (the answer then ends with finish_reason "length")."""
    if prompt_tokens >= context:
        raise PromptTooLongError(prompt_tokens, context)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1 (got {max_tokens})", param="max_tokens")
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N} (got {n})", param="n")
    if temperature is not None and not 0 <= temperature <= 2:
        raise RequestError(f"temperature must be between 0 and 2 (got {temperature})", param="temperature")
    if top_p is not None and not 0 <= top_p <= 1:
        raise RequestError(f"top_p must be between 0 and 1 (got {top_p})", param="top_p")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of non-empty strings", param="stop")
    wanted = max_tokens if max_tokens is not None else default_max_new_tokens
    return Sampling(
        max_new_tokens=max(1, min(wanted, context - prompt_tokens)), n=n, temperature=temperature,
        top_p=top_p, stop=stops, seed=seed, skip_special_tokens=skip_special_tokens,
    )
