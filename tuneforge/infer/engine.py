"""The generation engine behind `tuneforge chat` and `tuneforge api` (infer_backend: huggingface).

One model, loaded once. A request (`submit`) is a prompt's token ids, its `Sampling` settings and a sink
that receives the request's events as they happen (job.py: Delta, Finish, Done, Failed). Two paths:

- batched (batching.py, the default): concurrent requests share each decode step (transformers' continuous
  batching): a request's n answers join the running batch as rows when it arrives and leave it when they end.
- exclusive: one worker thread runs the rest, one at a time, while the batch is held between two steps: a
  sampled request with a `seed` (it draws from the global generator exactly as before batching, so the seed
  gives the same answer), media prompts, beam search, repetition_penalty, a request too long for the shared
  cache, and reward-model scoring (`score`). With infer_max_batch 1 (`tuneforge api cfg.yaml
  infer_max_batch=1`) every request takes it: the one-at-a-time server.

On the exclusive path the n answers of a request are the rows of one `model.generate` batch; a stopping
criterion decodes each new token as it is appended (decode.Output), ends rows at stop strings, and ends all
rows when the job is cancelled (`Job.cancel()`: the client went away). Either way a cancelled request stops
within one token. The context is the model's max_position_embeddings: a longer prompt is refused
(PromptTooLongError), and an answer never runs past it.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from tuneforge.data.formats import BadRow, Conversation
from tuneforge.data.media import COLUMN_OF, MediaSettings, supported_media
from tuneforge.data.multimodal import prompt_inputs, repeat_inputs
from tuneforge.errors import ConfigError, TuneforgeError
from tuneforge.infer.batching import Batcher, RowSampling, unbatchable
from tuneforge.infer.decode import Output
from tuneforge.infer.generation import chat_template, end_of_turn, generate_kwargs, render_prompt
from tuneforge.infer.job import CancelOnly, Choice, Completion, Delta, Done, Failed, Finish, Job, Watch, feed
from tuneforge.infer.request import RequestError, Sampling, sampling
from tuneforge.model.value_head import ValueHeadModel, score_token_rows

if TYPE_CHECKING:
    from tuneforge.config import GenerateArgs, RunConfig
    from tuneforge.data.template import ChatTemplate
    from tuneforge.infer.generation import Stops

logger = logging.getLogger(__name__)
SCORE_BATCH = 8  # texts per forward pass of the reward model
MAX_BATCH = 32  # rows (answers) decoded together by default
CACHE_TOKENS = 16384  # the batch's paged KV cache (prompts and answers of the rows in it)
STEP_TOKENS = 512  # tokens per forward pass of the batch (prompt chunks and one token of each decoding row)


def check_backend(cfg: RunConfig) -> None:
    """infer_backend: huggingface is built in; vllm is named with what to do. infer_max_batch is at least 1."""
    if cfg.generate.infer_max_batch < 1:
        raise ConfigError(f"{cfg.source}: infer_max_batch must be >= 1 (1 = one request at a time), "
                          f"got {cfg.generate.infer_max_batch}")
    if cfg.generate.infer_backend != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{cfg.source}: infer_backend vllm needs the vllm package: pip install vllm "
                          f"(a CUDA machine), or set infer_backend: huggingface")
    raise ConfigError(f"{cfg.source}: infer_backend vllm is not built into tuneforge chat / api yet; "
                      f"set infer_backend: huggingface")


def context_length(model: Any, fallback: int) -> int:
    """The model's max_position_embeddings (fallback when its config has none)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(n) if n else fallback


def served_name(cfg: RunConfig) -> str:
    """The model's name for clients: the last adapter, else model_name_or_path, as the config writes it."""
    return (cfg.model.adapter_name_or_path or [cfg.model.model_name_or_path])[-1]


def _conversation(messages: list[dict[str, Any]], media: dict[str, list[Any]]) -> Conversation:
    """Request messages (a system message first or not) as a Conversation with their media."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    rest = [{"role": m["role"], "content": m["content"]} for m in messages[1 if system is not None else 0:]]
    return Conversation(system=system, messages=rest, media=media)


class Engine:
    """A loaded model serving requests from one worker thread (build it with `Engine.from_config(cfg)`).

    prompt_ids(messages, tools) -> token ids; sampling(prompt_tokens, **options) -> Sampling;
    submit(ids, sampling, sink) -> Job; stream(messages, tools=, **options) -> events;
    complete(messages, tools=, **options) -> Completion; score / score_future(texts) for a reward model;
    close(). `stats` counts requests, finished, cancelled, failed, generated_tokens, and batched (requests that
    ran on the batched path); `batch_rows()` counts the batch's forward passes by their number of rows."""

    def __init__(self, model: Any, tokenizer: Any, template: ChatTemplate, gen: GenerateArgs, *,
                 context: int, default_system: str | None = None, name: str = "model",
                 stops: Stops | None = None, processor: Any = None, media: MediaSettings | None = None,
                 media_root: str | None = None, max_batch: int = MAX_BATCH) -> None:
        """processor: a vision- / audio-language model's processor (messages may then carry `images` / `audios`);
        media: how they are prepared (the config's image_* / audio_* keys); max_batch: rows decoded together
        (1: one request at a time)."""
        self.tokenizer, self.template, self.gen = tokenizer, template, gen
        self.processor, self.media = processor, media or MediaSettings()
        self.media_root = media_root  # the only folder whose files API clients may name (None: no local files)
        self.scorer = model if isinstance(model, ValueHeadModel) else None  # a reward model
        self.lm = model.model if self.scorer is not None else model
        self.device = next(model.parameters()).device
        self.stops = stops or end_of_turn(tokenizer, template)
        self.context, self.default_system, self.name = context, default_system, name
        self.stats = {"requests": 0, "finished": 0, "cancelled": 0, "failed": 0, "generated_tokens": 0, "batched": 0}
        self._stats_lock, self._tokenizer_lock = threading.Lock(), threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._batcher = self._start_batching(max_batch)
        self._worker = threading.Thread(target=self._work, name="tuneforge-engine", daemon=True)
        self._worker.start()

    def _start_batching(self, max_batch: int) -> Batcher | None:
        """The batched path, unless max_batch is 1 or the settings need generate (said in the log)."""
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1 (got {max_batch})")
        why = ("max_batch is 1" if max_batch == 1 else "the model reads media" if self.processor is not None else
               unbatchable(self.lm, self.gen.num_beams, self.gen.repetition_penalty))
        if why:
            logger.info("requests are answered one at a time: %s", why)
            return None
        try:
            return Batcher(self.lm, max_rows=max_batch, cache_tokens=CACHE_TOKENS, step_tokens=STEP_TOKENS,
                           on_done=self._batch_done)
        except Exception as e:  # an architecture transformers' continuous batching does not take
            logger.warning("requests are answered one at a time: continuous batching failed to start: %s", e)
            return None

    def batch_rows(self) -> dict[int, int]:
        """Forward passes of the batched path by their number of rows ({} when it is off)."""
        return dict(self._batcher.rows_per_step) if self._batcher is not None else {}

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Engine:
        """Tokenizer and template first (their errors come before the weights load), then the model."""
        from tuneforge.model import load_model_processor, load_tokenizer
        from tuneforge.model.inference import load_inference_model

        check_backend(cfg)
        processor = load_model_processor(cfg.model)
        tokenizer = processor.tokenizer if processor is not None else load_tokenizer(cfg.model)
        template = chat_template(cfg, processor or tokenizer)
        stops = end_of_turn(tokenizer, template, processor)
        model = load_inference_model(cfg)
        return cls(model, tokenizer, template, cfg.generate, context=context_length(model, cfg.data.cutoff_len),
                   default_system=cfg.data.default_system, name=served_name(cfg), stops=stops, processor=processor,
                   media=MediaSettings.from_config(cfg), media_root=cfg.data.media_dir,
                   max_batch=cfg.generate.infer_max_batch)

    # ---- requests
    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation rendered with the chat template, up to the assistant's turn, as token ids."""
        return self.prompt(messages, tools)[0]

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               options: dict[str, Any] | None = None) -> tuple[list[int], dict[str, Any]]:
        """(token ids, media inputs) of the conversation up to the assistant's turn. A message may carry `images`
        / `audios` (paths, URLs, {"bytes": ...} or PIL images) for a vision- / audio-language model, placed at its
        <image> / <audio> placeholders (or before its text when it has none). options: variables for the chat
        template (e.g. enable_thinking) over the configured ones."""
        chat = replace(self.template, options=tuple({**self.template.kwargs, **options}.items())) if options else \
            self.template
        media = {kind: refs for kind in ("image", "audio")
                 if (refs := [ref for m in messages for ref in m.get(COLUMN_OF[kind]) or []])}
        if media and self.processor is None:
            raise RequestError("this model reads text only; send the messages without media", param="messages")
        unread = set(media) - supported_media(self.processor) if media else set()
        if unread:
            raise RequestError(f"this model cannot read {', '.join(COLUMN_OF[k] for k in sorted(unread))}",
                               param="messages")
        try:
            with self._tokenizer_lock:
                if self.processor is None:
                    return render_prompt(self.tokenizer, chat, messages, tools), {}
                return prompt_inputs(self.processor, _conversation(messages, media), self.media,
                                     tools, chat)
        except TuneforgeError:
            raise
        except BadRow as e:
            raise RequestError(str(e), param="messages") from None
        except Exception as e:  # the template refused the conversation (raise_exception, a missing key)
            raise RequestError(f"the chat template cannot render these messages: {e}", param="messages") from None

    def sampling(self, prompt_tokens: int, **options: Any) -> Sampling:
        """Checked per-request settings (max_tokens, n, temperature, top_p, stop, seed, skip_special_tokens)."""
        params = sampling(prompt_tokens, self.context, self.gen.max_new_tokens, **options)
        if self.gen.num_beams > 1 and params.n > self.gen.num_beams:
            raise RequestError(f"n {params.n} is more than num_beams {self.gen.num_beams}", param="n")
        return params

    def submit(self, prompt_ids: Sequence[int], params: Sampling, sink: Callable[[Any], None],
               media: dict[str, Any] | None = None) -> Job:
        """Queue a request; its events go to sink (called from the worker thread). media: the prompt's media
        inputs (Engine.prompt), for a vision-language model."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        job = Job(prompt_ids, params, sink, media or {})
        if self._batcher is not None and self._batchable(job):
            self._count(requests=1, batched=1)
            self._batcher.add(job, self._outputs(params), self._row_sampling(params), list(self.stops.token_ids))
        else:
            self._queue.put(lambda: self._run(job))
        return job

    def _batchable(self, job: Job) -> bool:
        s = job.sampling
        seeded = s.seed is not None and not self._row_sampling(s).greedy
        return not job.media and not seeded and self._batcher.fits(len(job.prompt_ids), s.max_new_tokens, s.n)

    def _row_sampling(self, s: Sampling) -> RowSampling:
        """The request's sampling as generate_kwargs resolves it (a temperature given: sampled iff > 0)."""
        temperature = self.gen.temperature if s.temperature is None else s.temperature
        sample = (self.gen.do_sample if s.temperature is None else True) and temperature > 0
        top_p = self.gen.top_p if s.top_p is None else s.top_p
        return RowSampling(False, temperature, self.gen.top_k, top_p) if sample else RowSampling(True)

    def _outputs(self, s: Sampling) -> list[Output]:
        skip = self.gen.skip_special_tokens if s.skip_special_tokens is None else s.skip_special_tokens
        return [Output(self.tokenizer, self.stops.token_ids, self.stops.strings + s.stop, skip_special_tokens=skip)
                for _ in range(s.n)]

    def _batch_done(self, job: Job, tokens: int, *, cancelled: bool, failed: bool) -> None:
        outcome = "failed" if failed else "cancelled" if cancelled else "finished"
        self._count(generated_tokens=tokens, **{outcome: 1})

    def stream(self, messages: list[dict[str, Any]], *, tools: list | None = None,
               **options: Any) -> Iterator[Delta | Finish | Done]:
        """Submit a conversation and iterate over its events (closing the iterator cancels it)."""
        ids, media = self.prompt(messages, tools)
        params = self.sampling(len(ids), **options)
        events: queue.Queue = queue.Queue()
        job = self.submit(ids, params, events.put, media)

        def iterate() -> Iterator[Delta | Finish | Done]:
            try:
                while True:
                    event = events.get()
                    if isinstance(event, Failed):
                        raise event.error
                    yield event
                    if isinstance(event, Done):
                        return
            finally:
                job.cancel()

        return iterate()

    def complete(self, messages: list[dict[str, Any]], *, tools: list | None = None, **options: Any) -> Completion:
        """The whole answer(s) to a conversation."""
        texts: dict[int, list[str]] = {}
        finished: dict[int, Finish] = {}
        done = Done(0, 0)
        for event in self.stream(messages, tools=tools, **options):
            if isinstance(event, Delta):
                texts.setdefault(event.index, []).append(event.text)
            elif isinstance(event, Finish):
                finished[event.index] = event
            else:
                done = event
        choices = [Choice(i, "".join(texts.get(i, [])), f.reason, f.tokens) for i, f in sorted(finished.items())]
        return Completion(choices, done.prompt_tokens, done.completion_tokens)

    # ---- reward model
    def score_future(self, texts: Sequence[str], max_length: int | None = None) -> Future:
        """Scores of texts by the reward model's value head (read at each text's last token), computed on
        the worker. Texts are scored as given: render conversations with the chat template first."""
        if self.scorer is None:
            raise RequestError("this model has no value head, so it cannot score texts: start the server with "
                               "the output folder of a stage rm run", code="model_not_reward_model")
        if not texts or any(not isinstance(t, str) or not t for t in texts):
            raise RequestError("messages must be a non-empty list of non-empty texts", param="messages")
        if max_length is not None and max_length < 1:
            raise RequestError(f"max_length must be >= 1 (got {max_length})", param="max_length")
        limit = min(max_length or self.context, self.context)
        future: Future = Future()

        def task() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._score(list(texts), limit))
                except Exception as e:
                    future.set_exception(e)

        self._queue.put(task)
        return future

    def score(self, texts: Sequence[str], max_length: int | None = None) -> list[float]:
        return self.score_future(texts, max_length).result()

    @torch.inference_mode()
    def _score(self, texts: list[str], limit: int) -> list[float]:
        with self._tokenizer_lock:
            rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"][:limit] for t in texts]
        scores: list[float] = []
        for start in range(0, len(rows), SCORE_BATCH):
            batch = rows[start : start + SCORE_BATCH]
            scores += score_token_rows(self.scorer, batch, self.tokenizer.pad_token_id, self.device)
        return scores

    # ---- the worker
    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                with self._batcher.pause() if self._batcher is not None else nullcontext():
                    task()
            except Exception:  # a task reports its own errors; this is a bug in the engine
                logger.exception("engine task failed")

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self.stats[key] += value

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while the request waited
            self._count(cancelled=1)
            return
        self._count(requests=1)
        try:
            outputs = self._generate(job)
        except Exception as e:
            if not isinstance(e, TuneforgeError):
                logger.exception("generation failed")
            self._count(failed=1)
            job.emit(Failed(e))
            return
        tokens = sum(o.tokens for o in outputs)
        self._count(generated_tokens=tokens, **({"cancelled": 1} if job.cancelled.is_set() else {"finished": 1}))
        job.emit(Done(len(job.prompt_ids), tokens))

    def _generate(self, job: Job) -> list[Output]:
        s = job.sampling
        gen = self.gen
        if s.temperature is not None:
            gen = replace(gen, do_sample=s.temperature > 0, temperature=s.temperature)
        if s.top_p is not None:
            gen = replace(gen, top_p=s.top_p)
        kwargs = generate_kwargs(gen, self.tokenizer, self.stops)
        kwargs.pop("stop_strings", None)  # stop strings are cut from the decoded text (decode.Output)
        kwargs.pop("tokenizer", None)
        kwargs["max_new_tokens"] = s.max_new_tokens
        outputs = self._outputs(s)
        prompt = torch.tensor([job.prompt_ids], dtype=torch.long, device=self.device)
        beams = gen.num_beams > 1
        rows = 1 if beams else s.n
        if job.media:  # pixel values and grid sizes of a vision-language model's prompt, once per row
            media = repeat_inputs(job.media, rows, prompt.shape[1])
            kwargs.update({k: v.to(self.device) for k, v in media.items()})
        if beams:
            kwargs["num_return_sequences"] = s.n
            criterion: Any = CancelOnly(job)
        else:
            prompt = prompt.repeat(s.n, 1)
            criterion = Watch(job, outputs)
        from transformers import StoppingCriteriaList

        if s.seed is not None:
            torch.manual_seed(s.seed)  # one worker: nothing else draws from the generator meanwhile
        with torch.inference_mode():
            out = self.lm.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True,
                                   stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
        if beams:
            for i, output in enumerate(outputs):
                for token in out[i, prompt.shape[1]:].tolist():
                    feed(job, i, output, token)
        reason = "cancelled" if job.cancelled.is_set() else "length"
        for i, output in enumerate(outputs):
            if output.finish_reason is None:
                text = output.finish(reason)
                if text:
                    job.emit(Delta(i, text))
                job.emit(Finish(i, output.finish_reason, output.tokens))
        return outputs

    def close(self) -> None:
        """Stop the worker after the queued requests, and the batch after its rows."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join(timeout=60)
            if self._batcher is not None:
                self._batcher.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
