"""What generating text needs from the config and the chat template: the prompt tokens, where an answer
stops, and the sampling settings. Shared by chat, the API server, eval, the quick-start question and the
rollouts of training objectives (`completion_generator`, handed to them by the workflow).

An answer stops at the chat template's end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, `</s>`), found by
rendering a one-turn conversation and reading what the template writes after the assistant's text; the
tokenizer's eos_token often differs from it (SmolLM2: eos `<|endoftext|>`, end of turn `<|im_end|>`), and a
fine-tuned model that is only stopped at eos runs on past its answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tuneforge.data.multimodal import generate_inputs, left_padded_media
from tuneforge.data.template import (
    ChatTemplate,
    recorded_thinking,
    render_prompt,
    resolve_template,
    saved_chat_template,
)
from tuneforge.errors import DataError

if TYPE_CHECKING:
    from tuneforge.config import GenerateArgs, RunConfig

_ANSWER = "\x00tuneforge-answer\x00"


@dataclass(frozen=True)
class Stops:
    token_ids: tuple[int, ...]  # eos and the template's end-of-turn tokens
    strings: tuple[str, ...]  # end-of-turn text that is not one special token (a template on plain text)


def chat_template(cfg: RunConfig, tokenizer: Any) -> ChatTemplate:
    """The template training used: cfg.model.template, else the tokenizer's own; with enable_thinking as set, else
    as the last adapter was trained (recorded in the chat template saved with it)."""
    thinking = cfg.data.enable_thinking
    if thinking is None and cfg.model.adapter_name_or_path:
        thinking = recorded_thinking(saved_chat_template(cfg.model.adapter_name_or_path[-1]))
    return resolve_template(cfg.model.template, tokenizer, enable_thinking=thinking,
                            preserve_thinking=cfg.data.preserve_thinking, tool_format=cfg.data.tool_format)


def end_of_turn(tokenizer: Any, template: ChatTemplate, processor: Any = None) -> Stops:
    """The tokens (and text) that end an assistant turn under this template (a vision- / audio-language model's:
    its processor's), plus eos."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ANSWER}]
    try:
        if processor is not None:
            parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
            text = processor.apply_chat_template(parts, tokenize=False, **template.kwargs)
        else:
            text = tokenizer.apply_chat_template(messages, chat_template=template.source, tokenize=False,
                                                 **template.kwargs)
    except Exception as e:  # a template may refuse this conversation; eos still stops
        raise DataError(f"the chat template cannot render a one-turn conversation: {e}") from None
    marker = text[text.find(_ANSWER) + len(_ANSWER):].strip() if _ANSWER in text else ""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    strings: list[str] = []
    if marker:
        marker_ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if marker_ids and all(i in special for i in marker_ids):
            ids += marker_ids  # e.g. <|im_end|>, or <|eot_id|>
        elif marker_ids and marker_ids[0] in special:
            ids.append(marker_ids[0])  # e.g. `</s>` followed by plain text the template adds
        else:
            strings.append(marker)
    return Stops(tuple(dict.fromkeys(ids)), tuple(strings))


def generate_kwargs(gen: GenerateArgs, tokenizer: Any, stops: Stops) -> dict[str, Any]:
    """Keyword arguments for `model.generate` from the generation keys (temperature 0 means greedy)."""
    sample = gen.do_sample and gen.temperature > 0
    kwargs: dict[str, Any] = dict(
        do_sample=sample, num_beams=gen.num_beams, repetition_penalty=gen.repetition_penalty,
        max_new_tokens=gen.max_new_tokens, eos_token_id=list(stops.token_ids),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops.token_ids[0],
    )
    if sample:
        kwargs.update(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
    else:  # unset, so transformers does not warn that sampling settings are ignored
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if gen.num_beams > 1:
        kwargs["length_penalty"] = gen.length_penalty
    if stops.strings:
        kwargs.update(stop_strings=list(stops.strings), tokenizer=tokenizer)
    return kwargs


@torch.no_grad()
def answer(model: Any, tokenizer: Any, template: ChatTemplate, question: str, *, system: str | None = None,
           max_new_tokens: int = 96, processor: Any = None) -> str:
    """The model's greedy answer to one question (used on a model in training too: its mode is restored).
    processor: a vision- / audio-language model's, whose chat template renders the question."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    device = next(model.parameters()).device
    extra: dict[str, Any] = {}
    if processor is not None:
        from tuneforge.data.formats import Conversation
        from tuneforge.data.media import MediaSettings
        from tuneforge.data.multimodal import prompt_inputs

        prompt, tensors = prompt_inputs(processor, Conversation(system=system, messages=messages[-1:]),
                                        MediaSettings(), chat=template)
        extra = {k: v.to(device) for k, v in tensors.items()}
    else:
        prompt = render_prompt(tokenizer, template, messages)
    ids = torch.tensor([prompt], device=device)
    stops = end_of_turn(tokenizer, template, processor)
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=list(stops.token_ids), pad_token_id=tokenizer.pad_token_id, use_cache=True,
            temperature=None, top_p=None, top_k=None, **extra,
        )
    finally:
        model.train(was_training)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    for s in stops.strings:
        text = text.split(s)[0]
    return text.strip()


# generate(model, prompts, **overrides) -> one list of completion token ids per prompt (see completion_generator)
GenerateCompletions = Callable[..., list[list[int]]]


class SeededSampling:
    """A logits processor that samples every row of the batch from its own random generator (seeded per row),
    and leaves only the drawn token possible, so that greedy decoding takes it.

    transformers' sampling draws the whole batch from one generator, so what a row samples depends on the rows
    beside it; here it depends only on the row's seed. The sampling settings (temperature, top_k, top_p) are
    applied first, with transformers' own warpers."""

    def __init__(self, seeds: Sequence[int], temperature: float | None, top_k: int | None, top_p: float | None) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.seeds = list(seeds)
        self.generators: list[torch.Generator] | None = None
        self.warpers: list[Any] = []
        if temperature is not None and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:
            if scores.shape[0] != len(self.seeds):
                raise ValueError(f"{len(self.seeds)} seeds for a batch of {scores.shape[0]} rows")
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        picks = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators, strict=True)])
        only = torch.full_like(scores, -math.inf)
        return only.scatter_(1, picks.unsqueeze(1), 0.0)


def shared_prompt_cache(model: Any, ids: torch.Tensor, mask: torch.Tensor, copies: int) -> Any:
    """The KV cache of a batch whose rows come in runs of `copies` equal prompts: each prompt but its last token
    goes through the model once, and the cache is repeated for its copies (generate then runs the last token
    and samples). G completions per prompt cost one prompt pass instead of G.

    Positions are the ones generate gives left-padded rows (the attention mask's running count), so the cache
    holds what generate's own first pass would have put there."""
    runner = model.generate.__self__  # the model that generates (a value-head wrapper's language model)
    unique_ids, unique_mask = ids[::copies, :-1], mask[::copies, :-1]
    positions = (unique_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = runner(input_ids=unique_ids, attention_mask=unique_mask, position_ids=positions, use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    cache.batch_repeat_interleave(copies)
    return cache


def completion_generator(cfg: RunConfig, tokenizer: Any, processor: Any = None) -> GenerateCompletions:
    """A function that generates completions of token-id prompts as chat and eval do: the same stop tokens (eos
    and the chat template's end of turn) and sampling settings (the generate keys: do_sample, temperature,
    top_p, top_k, num_beams, max_new_tokens, repetition_penalty, length_penalty).

        generate(model, prompts, **overrides) -> list[list[int]]

    model: the model to generate with (a training objective's prepare passes the model it was given; its
    train / eval mode is restored afterwards). prompts: token-id lists (rendered with the chat template, e.g.
    render_prompt), left-padded together into one batch. overrides: `model.generate` keywords that replace the
    configured ones (max_new_tokens=..., do_sample=False, num_return_sequences=G: G completions per prompt,
    one after the other), `seeds`: one seed per completion, each sampled from its own generator
    (SeededSampling), so a completion does not depend on the prompts it is batched with, and `media`: each
    prompt's stored media tensors (mm_inputs) for a vision-language model. Returns the completions only (no
    prompt, no padding), each up to and including the stop token that ended it (absent when it ran to
    max_new_tokens). In a run of several processes it generates
    with synced_gpus (every rank keeps taking forwards until all have finished), so every rank must call it the
    same number of times, as the trainer's prepare calls are."""
    stops = end_of_turn(tokenizer, chat_template(cfg, processor or tokenizer), processor)
    configured = generate_kwargs(cfg.generate, tokenizer, stops)
    pad_id = configured["pad_token_id"]

    @torch.no_grad()
    def generate(model: Any, prompts: Sequence[Sequence[int]] | torch.Tensor, *, seeds: Sequence[int] | None = None,
                 media: Sequence[bytes | None] | None = None, **overrides: Any) -> list[list[int]]:
        rows = prompts.tolist() if torch.is_tensor(prompts) else [list(p) for p in prompts]
        if not rows:
            return []
        copies = 1
        if seeds is not None:  # seeded rows decode greedily over their own draws: one row per completion
            copies = overrides.pop("num_return_sequences", 1)
            rows = [r for r in rows for _ in range(copies)]
        width = max(len(r) for r in rows)
        device = next(model.parameters()).device
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        kwargs = {**configured, "use_cache": True}
        if media is not None and any(media):  # each prompt's stored media tensors (mm_inputs), once per its rows
            samples = [generate_inputs(blob) for blob in media for _ in range(copies)]
            joined = left_padded_media(samples, [len(r) for r in rows], width)
            kwargs.update({k: v.to(device) for k, v in joined.items()})
        if overrides.get("do_sample") is False:  # greedy: no sampling settings (transformers warns of them)
            kwargs.update(temperature=None, top_p=None, top_k=None)
        kwargs.update(overrides)
        if seeds is not None and kwargs.get("do_sample"):  # each row draws from its own seeded generator
            sampler = SeededSampling(seeds, kwargs.pop("temperature"), kwargs.pop("top_k"), kwargs.pop("top_p"))
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None,
                          logits_processor=[*kwargs.get("logits_processor", []), sampler])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            kwargs.setdefault("synced_gpus", torch.distributed.get_world_size() > 1)
        was_training = model.training
        model.eval()
        try:
            if copies > 1 and width > 1 and kwargs.get("num_beams", 1) == 1 and not (media and any(media)):
                kwargs["cache"] = shared_prompt_cache(model, ids, mask, copies)
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        finally:
            model.train(was_training)
        stop_ids = set(kwargs["eos_token_id"]) if isinstance(kwargs.get("eos_token_id"), list) else set(stops.token_ids)
        completions = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
            if stops.strings and end == len(row):  # stopped by a stop string: the padding after it goes
                while end and row[end - 1] == pad_id:
                    end -= 1
            completions.append(row[:end])
        return completions

    return generate
