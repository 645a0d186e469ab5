"""predict_with_generate: answer every eval row, write the answers, score them (BLEU-4, ROUGE-1/2/L).

Each row of eval_dataset (or dataset when there is none; max_samples applies, val_size does not) becomes
the conversation up to its last assistant turn, rendered with the chat template as chat and the API render
it; the last assistant turn is the label. Prompts longer than cutoff_len keep their last cutoff_len tokens.
Generation runs per_device_eval_batch_size prompts at a time, left-padded, with the config's generation
keys, and stops at the template's end of turn. Outputs, named as LlamaFactory names them:
`generated_predictions.jsonl` ({"prompt", "predict", "label"} per row; the prompt as rendered, special
tokens included) and `predict_results.json` (predict_bleu-4, predict_rouge-1/2/l, runtime, samples/s).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tuneforge.errors import DataError
from tuneforge.eval.batches import left_padded_batches

logger = logging.getLogger(__name__)

PREDICTIONS_FILE, RESULTS_FILE = "generated_predictions.jsonl", "predict_results.json"


@dataclass
class Sample:
    prompt_ids: list[int]
    label: str
    media: dict[str, Any] = field(default_factory=dict)  # the processor's tensors for the prompt's images


def eval_samples(cfg: Any, tokenizer: Any, template: Any, processor: Any = None
                 ) -> tuple[list[Sample], dict[str, int]]:
    """(prompt, label) of each usable row, and counts of skipped bad rows and truncated prompts. With a processor
    (a vision-language model) a row's images come with its prompt; such a prompt is never cut (that would cut its
    image)."""
    from tuneforge.data import formats, media, multimodal, registry
    from tuneforge.data.encode import bad_row_error
    from tuneforge.infer.generation import render_prompt

    d = cfg.data
    names = d.eval_dataset or d.dataset
    if not names:
        raise DataError(f"{cfg.source}: predict_with_generate needs eval_dataset (or dataset): the rows to answer")
    if not d.eval_dataset and d.val_size > 0:
        logger.warning("predict: val_size does not apply; answering every row of dataset (set eval_dataset "
                       "to choose the rows)")
    samples: list[Sample] = []
    counts = {"bad_rows": 0, "truncated_prompts": 0}
    settings = media.MediaSettings.from_config(cfg)
    for attr in registry.get_dataset_attrs(names, d.dataset_dir):
        media.check_media(processor, {k for k in media.KINDS if attr.column(media.COLUMN_OF[k])},
                          f"dataset '{attr.name}'")
        if attr.kind != "plain":
            raise DataError(f"dataset '{attr.name}' is a {attr.kind} dataset; predict_with_generate answers "
                            f"the prompts of a plain (sft) dataset")
        raw = registry.load_raw(attr, d.dataset_dir, cache_dir=cfg.model.cache_dir)
        formats.check_columns(attr, raw.column_names, "sft", needs_response=True)
        if d.max_samples and len(raw) > d.max_samples:
            raw = raw.select(range(d.max_samples))
        for i, row in enumerate(raw):
            try:
                conv = formats.to_conversation(row, attr, default_system=d.default_system)
                label = conv.messages.pop()["content"]
                if processor is not None:
                    conv.media = conv.media or media.row_media(row, attr.columns)
                    ids, tensors = multimodal.prompt_inputs(processor, conv, settings,
                                                            tools=conv.tools, chat=template)
                    samples.append(Sample(ids, label, tensors))
                    continue
                ids = render_prompt(tokenizer, template, conv.chat_messages(), tools=conv.tools)
            except formats.BadRow as e:
                if not d.skip_bad_rows:
                    raise bad_row_error(attr, i, str(e)) from None
                counts["bad_rows"] += 1
                continue
            if len(ids) > d.cutoff_len:
                ids, counts["truncated_prompts"] = ids[-d.cutoff_len :], counts["truncated_prompts"] + 1
            samples.append(Sample(ids, label))
    if counts["truncated_prompts"]:
        logger.warning("predict: %d prompts were longer than cutoff_len %d and keep only their last %d tokens",
                       counts["truncated_prompts"], d.cutoff_len, d.cutoff_len)
    if not samples:
        raise DataError(f"{cfg.source}: no rows to answer in {', '.join(names)}")
    return samples, counts


def _cut(ids: list[int], stop_ids: set[int]) -> list[int]:
    for k, token in enumerate(ids):
        if token in stop_ids:
            return ids[:k]
    return ids


@torch.no_grad()
def generate_batched(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[list[int]], gen_kwargs: dict,
                     batch_size: int, stops: Any, skip_special_tokens: bool = True,
                     media: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """The answer to each prompt (in order), batch_size prompts per `generate`, left-padded, longest first.
    media: each prompt's media inputs (a vision-language model), joined per batch as the processor joins them."""
    from tuneforge.data.multimodal import left_padded_media

    device = next(model.parameters()).device
    pad = gen_kwargs.get("pad_token_id", tokenizer.pad_token_id)
    stop_ids = set(stops.token_ids)
    texts: list[str] = [""] * len(prompts)
    started, logged, done = time.monotonic(), time.monotonic(), 0
    for rows, ids, mask in left_padded_batches(prompts, batch_size, pad, device):
        done += len(rows)
        width = ids.shape[1]
        extra = left_padded_media([media[r] for r in rows], [len(prompts[r]) for r in rows], width) if media else {}
        extra = {k: v.to(device) for k, v in extra.items()}
        out = model.generate(input_ids=ids, attention_mask=mask, use_cache=True, **gen_kwargs, **extra)
        for row, generated in zip(rows, out[:, width:].tolist(), strict=True):
            text = tokenizer.decode(_cut(generated, stop_ids), skip_special_tokens=skip_special_tokens)
            for s in stops.strings:
                text = text.split(s)[0]
            texts[row] = text.strip()
        if time.monotonic() - logged > 15:
            logged = time.monotonic()
            logger.info("answered %d / %d prompts (%.0f s)", done, len(prompts), logged - started)
    return texts


def predict(cfg: Any, out_dir: Path) -> dict[str, Any]:
    """Generate for every eval row; write generated_predictions.jsonl and predict_results.json to out_dir."""
    from transformers import set_seed

    from tuneforge.eval import metrics
    from tuneforge.infer.generation import chat_template, end_of_turn, generate_kwargs
    from tuneforge.model import load_model_processor, load_tokenizer
    from tuneforge.model.inference import load_inference_model
    from tuneforge.model.packed_linear import pack_for_generation

    metrics.require()
    if cfg.generate.infer_backend != "huggingface":
        logger.warning("predict generates with transformers; infer_backend %s is not used here",
                       cfg.generate.infer_backend)
    processor = load_model_processor(cfg.model)
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(cfg.model)
    template = chat_template(cfg, processor or tokenizer)
    samples, counts = eval_samples(cfg, tokenizer, template, processor)  # bad rows fail before the weights load
    stops = end_of_turn(tokenizer, template, processor)
    kwargs = generate_kwargs(cfg.generate, tokenizer, stops)
    model = load_inference_model(cfg, value_head=False)
    pack_for_generation(model)
    set_seed(cfg.train.seed)  # sampling (do_sample) is repeatable
    batch_size = cfg.train.per_device_eval_batch_size
    logger.info("predict: %d prompts, batches of %d, max_new_tokens %d, %s", len(samples), batch_size,
                cfg.generate.max_new_tokens, "sampling" if kwargs["do_sample"] else "greedy")
    started = time.perf_counter()
    texts = generate_batched(model, tokenizer, [s.prompt_ids for s in samples], kwargs, batch_size, stops,
                             cfg.generate.skip_special_tokens, [s.media for s in samples] if processor else None)
    runtime = time.perf_counter() - started
    labels = [s.label for s in samples]
    scores = metrics.similarity(texts, labels)
    steps = -(-len(samples) // batch_size)
    results = {f"predict_{name}": round(value, 4) for name, value in scores.items()}
    results.update(predict_samples=len(samples), predict_runtime=round(runtime, 4),
                   predict_samples_per_second=round(len(samples) / runtime, 3) if runtime > 0 else 0.0,
                   predict_steps_per_second=round(steps / runtime, 3) if runtime > 0 else 0.0, **counts)
    out_dir.mkdir(parents=True, exist_ok=True)
    predictions, result_file = out_dir / PREDICTIONS_FILE, out_dir / RESULTS_FILE
    with predictions.open("w", encoding="utf-8") as f:
        for sample, text in zip(samples, texts, strict=True):
            prompt = tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)
            f.write(json.dumps({"prompt": prompt, "predict": text, "label": sample.label}, ensure_ascii=False) + "\n")
    result_file.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    shown = ", ".join(f"{k} {results[k]:.2f}" for k in ("predict_bleu-4", "predict_rouge-1", "predict_rouge-2",
                                                        "predict_rouge-l"))
    summary = [shown, f"{len(samples)} answers in {runtime:.1f} s ({results['predict_samples_per_second']} samples/s)",
               f"answers in {predictions}, scores in {result_file}"]
    return {**results, "files": [str(predictions), str(result_file)], "summary": summary}
