"""Continuous batching for the engine: transformers' own (`model.init_continuous_batching()`), one answer per row.

Concurrent requests share every decode step: a row joins the running batch as soon as it is added and leaves it
when it ends, between two steps (transformers' paged KV cache and scheduler). The batcher adds a request's n
answers as n rows, reads each row's new tokens after every step (one reader thread, `_route`), decodes them
(decode.Output) and sends the request's events (job.py), exactly as the one-at-a-time path does.

What transformers' manager cannot do stays with the engine's exclusive path (engine.py decides per request):
its sampling draws every row from one global generator (torch.multinomial without a generator), so a request
with a `seed` would not get its own samples back; it has no beam search, takes prompts as token ids only (no
pixel values), and repetition_penalty is not among its per-request processors. `pause()` stops the batch between steps while the exclusive path runs, so nothing else draws
from the global generator meanwhile (a seed reproduces exactly what it did before batching).

Per-row sampling uses the manager's per-request temperature / top_k / top_p processors; a greedy row is a row
with top_k 1 (the most likely token is the only one left, so the draw is the argmax).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from tuneforge.infer.decode import Output
from tuneforge.infer.job import Delta, Done, Failed, Finish, Job, feed

logger = logging.getLogger(__name__)
PAGE = 256  # tokens per block of the paged KV cache (transformers' default page_size)
POLL = 0.02  # seconds the reader waits for an output before it looks for cancelled requests


@dataclass(frozen=True)
class RowSampling:
    """How one row picks its tokens: greedy, or sampled at temperature / top_k / top_p."""

    greedy: bool
    temperature: float = 1.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0

    def kwargs(self, vocab: int) -> dict[str, Any]:
        """The manager's per-request processor arguments (top_k 1 for greedy)."""
        if self.greedy:
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        return {"temperature": float(self.temperature), "top_k": int(self.top_k or vocab), "top_p": float(self.top_p)}


def unbatchable(model: Any, num_beams: int = 1, repetition_penalty: float = 1.0) -> str | None:
    """Why generation on this model with these settings cannot be batched here (None: it can)."""
    attention = getattr(model.config, "_attn_implementation", None) or ""
    if num_beams > 1:
        return "num_beams > 1"
    if repetition_penalty != 1.0:
        return "repetition_penalty is set"
    if attention != "sdpa" and "flash" not in attention:
        return f"attention {attention or 'unknown'} (batching needs sdpa or flash attention)"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "several processes generate together (synced_gpus)"
    return None


def manager(model: Any, *, max_rows: int, cache_blocks: int, step_tokens: int) -> Any:
    """transformers' ContinuousBatchingManager for model (not started): at most max_rows rows per step, a paged KV
    cache of cache_blocks blocks of PAGE tokens, step_tokens tokens per forward pass."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Values that are neither None nor neutral, so the manager builds its per-request temperature / top-k / top-p
    # processors; every row passes its own values (RowSampling.kwargs).
    config = GenerationConfig(do_sample=True, temperature=0.5, top_k=2, top_p=0.5, max_new_tokens=16, eos_token_id=-1)
    cb = ContinuousBatchingConfig(num_blocks=cache_blocks, page_size=PAGE, max_batch_tokens=step_tokens,
                                  max_requests_per_batch=max_rows, per_request_processors=True,
                                  auto_switch_to_flash=False)
    return model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)


def _logits_of_sampled_rows_only(_module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A forward pre-hook: the LM head runs only at the positions that sample a token (one per row).

    transformers' manager passes `logits_indices` (the last token of each row) but no `logits_to_keep`, so the
    model projects every prompt token onto the vocabulary and the manager then keeps one row each: on a small
    model with a large vocabulary (SmolLM2: 49k) that is most of a prefill step. Here the model gets
    logits_to_keep = those positions, and the manager's own index tensor (read after the forward to pick the rows)
    is rewritten in place to 0..n-1, the rows of the already-cut logits; the manager fills it anew every step."""
    positions = kwargs.get("logits_indices")
    if positions is None or "logits_to_keep" in kwargs:
        return args, kwargs
    kwargs["logits_to_keep"] = positions.clone()
    positions.copy_(torch.arange(positions.numel(), dtype=positions.dtype, device=positions.device))
    return args, kwargs


@dataclass
class _Running:
    """A request whose rows are in the batch."""

    key: int
    job: Job
    outputs: list[Output]
    rows: dict[str, int] = field(default_factory=dict)  # request id of each live row -> its answer index
    fed: dict[int, int] = field(default_factory=dict)  # answer index -> tokens already read


class Batcher:
    """transformers' ContinuousBatchingManager on a model, with a reader thread that routes outputs to jobs.

    add(job, outputs, sampling, stop_ids) puts a request's rows in the batch; pause() is a context that holds the
    batch between steps (for the engine's exclusive path); close() ends both threads. `rows_per_step` counts the
    forward passes by how many rows each one carried (prompt chunks and decode steps together)."""

    def __init__(self, model: Any, *, max_rows: int, cache_tokens: int, step_tokens: int, on_done: Any) -> None:
        self.vocab = model.config.get_text_config().vocab_size
        self.cache_tokens = cache_tokens
        self._on_done = on_done  # called with (job, generated tokens) when a request ends (the engine's stats)
        self.manager = manager(model, max_rows=max_rows, cache_blocks=-(-cache_tokens // PAGE), step_tokens=step_tokens)
        self.rows_per_step: dict[int, int] = {}
        self._hooks = [model.register_forward_pre_hook(self._count_rows, with_kwargs=True),
                       model.register_forward_pre_hook(_logits_of_sampled_rows_only, with_kwargs=True)]
        self._running: dict[int, _Running] = {}
        self._owner: dict[str, _Running] = {}  # request id -> its request
        self._lock = threading.Lock()
        self._next = 0
        self._closed = threading.Event()
        with torch.inference_mode():  # the manager's thread runs in the caller's inference mode
            self.manager.start()
        self._reader = threading.Thread(target=self._read, name="tuneforge-batch-reader", daemon=True)
        self._reader.start()

    def _count_rows(self, _module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        bounds = kwargs.get("cu_seq_lens_q")  # only the manager's forwards pass it (a flattened batch)
        if bounds is not None:
            rows = int(bounds.numel()) - 1
            self.rows_per_step[rows] = self.rows_per_step.get(rows, 0) + 1

    def fits(self, prompt_tokens: int, new_tokens: int, n: int) -> bool:
        """Whether the request's rows fit the paged cache together (a longer one runs on the exclusive path)."""
        return n * (prompt_tokens + new_tokens) <= self.cache_tokens // 2

    def add(self, job: Job, outputs: list[Output], sampling: RowSampling, stop_ids: list[int]) -> None:
        """Put each answer of the request in the batch as a row (they share the prompt's cache blocks)."""
        with self._lock:
            running = _Running(self._next, job, outputs)
            self._next += 1
            running.rows = {f"tf{running.key}-{i}": i for i in range(len(outputs))}
            running.fed = dict.fromkeys(range(len(outputs)), 0)
            self._owner.update(dict.fromkeys(running.rows, running))
        for rid in list(running.rows):
            added = self.manager.add_request(job.prompt_ids, request_id=rid, max_new_tokens=job.sampling.max_new_tokens,
                                             streaming=True, eos_token_id=stop_ids, **sampling.kwargs(self.vocab))
            if added is None:  # the manager refuses requests (stopping, or its loop failed)
                self._end(running, failed=RuntimeError("the batched generation loop is not running"))
                return
        with self._lock:  # only now may the reader end it on cancel: every row is in the batch to be cancelled
            if running.rows:
                self._running[running.key] = running

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the batch between two steps while the caller uses the model (a loop that is gone holds nothing)."""
        held = self.manager.pause() if self.manager.is_running() else nullcontext()
        try:
            held.__enter__()
        except RuntimeError:  # the loop stopped before it could pause
            held = nullcontext()
        try:
            yield
        finally:
            held.__exit__(None, None, None)

    # ---- the reader thread
    def _read(self) -> None:
        while True:
            out = self.manager.get_result(timeout=POLL)
            if out is None and self._closed.is_set():  # closed, and every output read
                return
            try:
                if out is not None:
                    self._route(out)
                self._reap_cancelled()
                if out is None and not self.manager.is_running():  # the loop died (its error is logged)
                    self._fail_all(RuntimeError("the batched generation loop stopped; restart the server"))
                    self._closed.wait(POLL)
            except Exception:  # a bug here must not stop the other requests' answers
                logger.exception("routing a batched output failed")

    def _route(self, out: Any) -> None:
        with self._lock:
            running = self._owner.get(out.request_id)
        if running is None:  # a row already ended (a stop string, a cancel): its last outputs are dropped
            return
        job, index = running.job, running.rows[out.request_id]
        if out.error:
            self._end(running, failed=RuntimeError(f"batched generation failed: {out.error}"))
            return
        output = running.outputs[index]
        tokens = out.generated_tokens[running.fed[index]:]
        running.fed[index] += len(tokens)
        for token in tokens:
            feed(job, index, output, token)
        if output.finish_reason is None and out.is_finished():  # max_new_tokens (a stop token finished it already)
            self._finish(job, index, output, "length")
        if output.finish_reason is not None:
            self._drop_row(running, out.request_id, cancel=not out.is_finished())

    def _reap_cancelled(self) -> None:
        with self._lock:
            cancelled = [r for r in self._running.values() if r.job.cancelled.is_set()]
        for running in cancelled:
            self._end(running)

    def _finish(self, job: Job, index: int, output: Output, reason: str) -> None:
        text = output.finish(reason)
        if text:
            job.emit(Delta(index, text))
        job.emit(Finish(index, output.finish_reason, output.tokens))

    def _drop_row(self, running: _Running, rid: str, *, cancel: bool) -> None:
        if cancel:
            self.manager.cancel_request(rid)
        with self._lock:
            running.rows.pop(rid, None)
            self._owner.pop(rid, None)
            last = not running.rows
            if last:
                self._running.pop(running.key, None)
        if last:
            tokens = sum(o.tokens for o in running.outputs)
            running.job.emit(Done(len(running.job.prompt_ids), tokens))
            self._on_done(running.job, tokens, cancelled=running.job.cancelled.is_set(), failed=False)

    def _end(self, running: _Running, failed: BaseException | None = None) -> None:
        """End every live row of a request: cancelled (its client left), or failed."""
        with self._lock:
            rows = list(running.rows.items())
            running.rows.clear()
            for rid, _ in rows:
                self._owner.pop(rid, None)
            self._running.pop(running.key, None)
        for rid, index in rows:
            self.manager.cancel_request(rid)
            if failed is None:
                self._finish(running.job, index, running.outputs[index], "cancelled")
        tokens = sum(o.tokens for o in running.outputs)
        if failed is not None:
            running.job.emit(Failed(failed))
        else:
            running.job.emit(Done(len(running.job.prompt_ids), tokens))
        self._on_done(running.job, tokens, cancelled=failed is None, failed=failed is not None)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            running = list(self._running.values())
        for r in running:
            self._end(r, failed=error)

    def close(self) -> None:
        """Finish the rows in the batch, then stop the manager and the reader."""
        if self._closed.is_set():
            return
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=60)
        self._closed.set()
        self._reader.join(timeout=10)
        for hook in self._hooks:
            hook.remove()
