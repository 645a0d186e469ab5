"""One request on its way through the engine: its events, its cancel flag, and the stopping criterion
that decodes each new token as `generate` appends it.

Events, in order, to the request's sink (called from the engine's worker thread):

    Delta(index, text)              new text of answer `index` (whole characters; no part of a stop string)
    Finish(index, reason, tokens)   answer `index` ended: "stop" (end-of-turn / eos token or a stop
                                    string), "length" (max tokens or the context), "cancelled"
    Done(prompt_tokens, completion_tokens)   the request's last event
    Failed(error)                   the request failed (its last event)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tuneforge.infer.decode import Output
from tuneforge.infer.request import Sampling


@dataclass(frozen=True)
class Delta:
    index: int
    text: str


@dataclass(frozen=True)
class Finish:
    index: int
    reason: str
    tokens: int


@dataclass(frozen=True)
class Done:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str
    tokens: int


@dataclass(frozen=True)
class Completion:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int


class Job:
    """One submitted request; `cancel()` stops it (before it starts, or within one token)."""

    def __init__(self, prompt_ids: Sequence[int], params: Sampling, sink: Callable[[Any], None],
                 media: dict[str, Any] | None = None) -> None:
        self.prompt_ids = list(prompt_ids)
        self.media = media or {}  # the prompt's media inputs (pixel values, grid sizes) for a vision-language model
        self.sampling = params
        self.cancelled = threading.Event()
        self._sink = sink

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: Any) -> None:
        try:
            self._sink(event)
        except Exception:  # the consumer is gone (its event loop closed): nobody reads the rest
            self.cancelled.set()


class Watch:
    """A stopping criterion: decodes each row's new token, ends rows at their stops, all rows on cancel."""

    def __init__(self, job: Job, outputs: list[Output]) -> None:
        self.job, self.outputs = job, outputs

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        for i, token in enumerate(input_ids[:, -1].tolist()):
            feed(self.job, i, self.outputs[i], token)
        cancelled = self.job.cancelled.is_set()
        done = [cancelled or o.finish_reason is not None for o in self.outputs]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class CancelOnly:
    """Beam search reorders rows every step, so answers are decoded at the end; it still stops on cancel."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.job.cancelled.is_set(), device=input_ids.device)


def feed(job: Job, index: int, output: Output, token: int) -> None:
    if output.finish_reason is not None:
        return
    text = output.push(token)
    if text:
        job.emit(Delta(index, text))
    if output.finish_reason is not None:
        job.emit(Finish(index, output.finish_reason, output.tokens))
