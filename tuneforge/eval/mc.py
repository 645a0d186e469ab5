"""Multiple-choice benchmarks (MMLU layout): few-shot prompts, answer-letter scoring, accuracy tables.

The prompt follows LlamaFactory's evaluator: each solved example is a user turn (the question, its four
choices, "Answer:") followed by an assistant turn (the letter); the question to answer is the last user
turn, and a header naming the subject opens the first user turn. The conversation is rendered with the
model's chat template up to the assistant's answer, or, with `template: fewshot`, as plain text (the turns
back to back, a blank line after each solved example, no chat markup; LlamaFactory's template of that name).

The model's answer is the letter, A to D, whose token is most likely at the answer position (one forward
per question, no generation). Questions run in batches of batch_size, left-padded, longest first; only
the last position's logits are computed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tuneforge.errors import ModelError
from tuneforge.eval.batches import left_padded_batches
from tuneforge.eval.benchmark import CHOICES, Benchmark, Question, load_benchmark
from tuneforge.trunk import unwrapped

logger = logging.getLogger(__name__)

FEWSHOT_TEMPLATE = "fewshot"
HEADERS = {  # lang -> (header before the first question, the cue after the choices)
    "en": ("The following are multiple choice questions (with answers) about {subject}.\n\n", "\nAnswer:"),
    "zh": ("以下是关于{subject}的单项选择题（附答案）。\n\n", "\n答案："),
}
RESULTS_FILE, LOG_FILE = "results.json", "results.log"


def format_question(q: Question, lang: str) -> str:
    """The question, its choices one per line ("A. ..."), and the answer cue."""
    choices = "".join(f"\n{letter}. {text}" for letter, text in zip(CHOICES, q.choices, strict=True))
    return q.question + choices + HEADERS[lang][1]


def build_messages(q: Question, shots: Sequence[Question], subject: str, lang: str) -> list[dict[str, str]]:
    """The solved examples as user / assistant turns, then the question as the last user turn."""
    messages = []
    for shot in shots:
        messages += [{"role": "user", "content": format_question(shot, lang)},
                     {"role": "assistant", "content": shot.answer}]
    messages.append({"role": "user", "content": format_question(q, lang)})
    messages[0]["content"] = HEADERS[lang][0].format(subject=subject) + messages[0]["content"]
    return messages


def fewshot_text(messages: list[dict[str, str]]) -> str:
    """`template: fewshot`: the turns as plain text, a blank line after each solved example."""
    parts = []
    for m in messages:
        parts.append(m["content"] + ("\n\n" if m["role"] == "assistant" else ""))
    return "".join(parts)


def prompt_ids(tokenizer: Any, template: Any, messages: list[dict[str, str]], system: str | None) -> list[int]:
    """Token ids up to the answer: the chat template's (with its generation prompt), or plain few-shot text
    (template None) tokenized as a document, with the tokenizer's own special tokens (e.g. BOS)."""
    if template is None:
        return tokenizer(fewshot_text(messages), add_special_tokens=True)["input_ids"]
    from tuneforge.infer.generation import render_prompt

    head = [{"role": "system", "content": system}] if system else []
    return render_prompt(tokenizer, template, head + messages)


def letter_ids(tokenizer: Any) -> list[int]:
    """The token of each answer letter as it follows the prompt (the last token of the bare letter)."""
    ids = [tokenizer.encode(letter, add_special_tokens=False)[-1] for letter in CHOICES]
    if len(set(ids)) != len(ids):
        raise ModelError(f"the tokenizer maps the letters {', '.join(CHOICES)} to the tokens {ids}, not four "
                         f"distinct ones, so the answer cannot be read from one position")
    return ids


def _keeps_last_logits(model: torch.nn.Module) -> bool:
    import inspect

    base = unwrapped(model)
    return "logits_to_keep" in inspect.signature(base.forward).parameters


@torch.no_grad()
def score(model: torch.nn.Module, prompts: Sequence[list[int]], choice_ids: Sequence[int], pad_id: int,
          batch_size: int) -> torch.Tensor:
    """(n, 4) log-probabilities of the answer letters at each prompt's next position (fp32)."""
    device = next(model.parameters()).device
    out = torch.empty(len(prompts), len(choice_ids), dtype=torch.float32)
    keep = {"logits_to_keep": 1} if _keeps_last_logits(model) else {}
    started, logged, done = time.monotonic(), time.monotonic(), 0
    for rows, ids, mask in left_padded_batches(prompts, batch_size, pad_id, device):
        done += len(rows)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **keep).logits
        logps = torch.log_softmax(logits[:, -1].float(), dim=-1)
        out[rows] = logps[:, list(choice_ids)].cpu()
        if time.monotonic() - logged > 15:
            logged = time.monotonic()
            logger.info("scored %d / %d questions (%.0f s)", done, len(prompts), logged - started)
    return out


@dataclass
class Tally:
    correct: int = 0
    total: int = 0

    def add(self, correct: int, total: int) -> None:
        self.correct, self.total = self.correct + correct, self.total + total

    def as_dict(self) -> dict[str, Any]:
        return {"accuracy": self.correct / self.total if self.total else 0.0, "correct": self.correct,
                "total": self.total}


def accuracy_table(bench: Benchmark, predictions: dict[str, list[str]]) -> dict[str, Any]:
    """Accuracy per subject, per category (subjects' questions pooled) and overall (all questions)."""
    subjects, categories, overall = {}, {}, Tally()
    for s in bench.subjects:
        preds = predictions[s.key]
        tally = Tally(sum(p == q.answer for p, q in zip(preds, s.questions, strict=True)), len(s.questions))
        subjects[s.key] = {"name": s.name, "category": s.category, **tally.as_dict(), "predictions": "".join(preds)}
        if s.category:
            categories.setdefault(s.category, Tally()).add(tally.correct, tally.total)
        overall.add(tally.correct, tally.total)
    return {**overall.as_dict(), "categories": {k: v.as_dict() for k, v in sorted(categories.items())},
            "subjects": subjects}


def report_lines(table: dict[str, Any]) -> list[str]:
    """The human-readable table: one line per subject, per category, and the average (percent)."""
    def line(label: str, entry: dict[str, Any]) -> str:
        return f"{label:>24}: {100 * entry['accuracy']:6.2f}  ({entry['correct']}/{entry['total']})"

    lines = [line(entry["name"], entry) for entry in table["subjects"].values()]
    lines += [line(f"[{name}]", entry) for name, entry in table["categories"].items()]
    return [*lines, line("Average", table)]


def evaluate_mc(cfg: Any, out_dir: Path) -> dict[str, Any]:
    """Score cfg.eval.task; write results.json and results.log to out_dir."""
    from tuneforge.infer.generation import chat_template
    from tuneforge.model import load_tokenizer
    from tuneforge.model.inference import load_inference_model

    e = cfg.eval
    bench = load_benchmark(e.task, e.task_dir, e.n_shot)  # every layout problem before the model loads
    logger.info("task %s: %d subjects, %d questions (%s split), %d-shot", e.task, len(bench.subjects),
                bench.size, bench.split, e.n_shot)
    tokenizer = load_tokenizer(cfg.model)
    template = None if cfg.model.template == FEWSHOT_TEMPLATE else chat_template(cfg, tokenizer)
    choice_ids = letter_ids(tokenizer)
    prompts, owners = [], []
    for s in bench.subjects:
        if 0 < len(s.shots) < e.n_shot:
            logger.warning("subject %s has %d solved examples for n_shot %d", s.key, len(s.shots), e.n_shot)
        for i, q in enumerate(s.questions):
            same_split = bench.split == "dev"  # never show a question as its own example
            shots = [x for j, x in enumerate(s.shots) if not (same_split and j == i)][: e.n_shot]
            messages = build_messages(q, shots, s.name, e.lang)
            prompts.append(prompt_ids(tokenizer, template, messages, cfg.data.default_system))
            owners.append(s.key)
    model = load_inference_model(cfg, value_head=False)
    started = time.perf_counter()
    logps = score(model, prompts, choice_ids, tokenizer.pad_token_id, e.batch_size)
    runtime = time.perf_counter() - started
    predictions: dict[str, list[str]] = {s.key: [] for s in bench.subjects}
    for owner, best in zip(owners, logps.argmax(dim=-1).tolist(), strict=True):
        predictions[owner].append(CHOICES[best])
    table = accuracy_table(bench, predictions)
    head = {"task": e.task, "split": bench.split, "n_shot": e.n_shot, "lang": e.lang,
            "template": cfg.model.template or "the tokenizer's chat template",
            "model": cfg.model.model_name_or_path, "adapters": cfg.model.adapter_name_or_path or [],
            "runtime": round(runtime, 3)}
    lines = report_lines(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, log = out_dir / RESULTS_FILE, out_dir / LOG_FILE
    results.write_text(json.dumps({**head, **table}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    title = f"{e.task} ({bench.split} split, {bench.size} questions), {e.n_shot}-shot, lang {e.lang}"
    log.write_text(f"{title}\nmodel {head['model']}\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return {**table, "runtime": runtime, "files": [str(results), str(log)],
            "summary": [title, *lines, f"results in {results} and {log}"]}
