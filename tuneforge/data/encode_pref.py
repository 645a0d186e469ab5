"""The preference stages' encoders: ranking rows (rm, dpo) and feedback rows (kto) -> token rows.

Each sequence is the prompt plus one answer, rendered by the chat template as one conversation, so its
tokens are exactly `apply_chat_template`'s. Only the final assistant turn learns (its content and
end-of-turn marker, as sft supervises a turn); answers earlier in the prompt do not.

The sequences of one row (chosen and rejected; or the judged answer and the KL pair) share their prompt
tokens and are cut together: one prompt budget and one answer budget, from split_budget with the longest
answer as the target, so both sequences keep the same prompt. A row where any answer's supervised part is
cut away is dropped (status "dropped"), as sft drops a sample with nothing left to learn.

Row layouts (the batch contract with the objectives):
  pairwise: chosen_{input_ids,labels,attention_mask}, rejected_{input_ids,labels,attention_mask}
  feedback: {input_ids,labels,attention_mask} (prompt + this row's answer), kl_{...} (the same prompt +
            another row's answer: the KL pair), kto_tag (1 desirable, 0 undesirable)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuneforge.data import formats, template
from tuneforge.data.encode import (
    IGNORE_INDEX,
    EncodeSettings,
    batch_rows,
    gc_paused,
    source_row,
    split_budget,
    stop_unless_skipping,
)
from tuneforge.data.formats import BadRow, Conversation
from tuneforge.data.media import row_media
from tuneforge.data.registry import DatasetAttr

# the column prefix of each sequence of a row, in the order the collator lays them out
SEQUENCE_PREFIXES = {"pairwise": ("chosen_", "rejected_"), "feedback": ("", "kl_")}
# the reference log-prob column that goes with each prefix (written when they are precomputed)
REF_LOGP_COLUMNS = {
    "chosen_": "ref_chosen_logps",
    "rejected_": "ref_rejected_logps",
    "": "ref_logps",
    "kl_": "ref_kl_logps",
}


@dataclass
class Rendered:
    """One tokenized prompt + answer, and where the answer's supervised tokens are."""

    ids: list[int]
    start: int  # first token of the final assistant turn's span (content + end-of-turn marker)
    end: int  # one past its last token


def shared_prompt_len(seqs: list[Rendered]) -> int:
    """How many leading tokens all sequences share, stopping where the first answer begins.

    With a template that separates turns, this is exactly the prompt; where BPE merges the prompt's last
    characters with an answer's first, the differing token goes to each answer's side.
    """
    limit = min(s.start for s in seqs)
    first = seqs[0].ids
    n = 0
    while n < limit and all(s.ids[n] == first[n] for s in seqs[1:]):
        n += 1
    return n


def group_cut(seqs: list[Rendered], cutoff_len: int) -> tuple[int, int, int]:
    """(shared prompt length, prompt tokens kept, answer tokens kept) of one row's sequences cut together."""
    p = shared_prompt_len(seqs)
    keep_prompt, keep_answer = split_budget(p, max(len(s.ids) - p for s in seqs), cutoff_len)
    return p, keep_prompt, keep_answer


def build_group(seqs: list[Rendered], cutoff_len: int) -> tuple[list[tuple[list[int], list[int]]], str]:
    """The sequences of one row -> [(input_ids, labels)] truncated together to cutoff_len, and the status."""
    p, keep_prompt, keep_answer = group_cut(seqs, cutoff_len)
    prompt = seqs[0].ids[:p]
    answers = [s.ids[p:] for s in seqs]
    answer_labels = [
        [t if s.start <= p + j < s.end else IGNORE_INDEX for j, t in enumerate(a)]
        for s, a in zip(seqs, answers, strict=True)
    ]
    longest = max(len(a) for a in answers)
    out = [
        (prompt[:keep_prompt] + a[:keep_answer], [IGNORE_INDEX] * keep_prompt + labels[:keep_answer])
        for a, labels in zip(answers, answer_labels, strict=True)
    ]
    # the first label is never predicted (nothing comes before it), so it cannot keep a sequence alive
    if any(all(label == IGNORE_INDEX for label in labels[1:]) for _, labels in out):
        return [([], []) for _ in seqs], "dropped"
    truncated = keep_prompt < len(prompt) or keep_answer < longest
    return out, "ok_truncated" if truncated else "ok"


def answer_message(answer: str | dict[str, Any]) -> dict[str, Any]:
    """The assistant message of an answer (its text, or a whole message with reasoning_content)."""
    return dict(answer) if isinstance(answer, dict) else {"role": "assistant", "content": answer}


def render_answer(
    tokenizer: Any, chat: template.ChatTemplate, prompt: Conversation, answer: str | dict[str, Any],
    layouts: template.Layouts | None = None,
) -> tuple[str, tuple[int, int]]:
    """The text of prompt + the assistant's answer, and the character span of that answer's turn (layouts: the
    batch's, template.Layouts)."""
    if prompt.media:
        raise BadRow(f"the row has {', '.join(prompt.media)} media, but the model reads text only; use a vision- or "
                     f"audio-language model")
    conv = Conversation(
        system=prompt.system,
        tools=prompt.tools,
        messages=[dict(m) for m in prompt.messages] + [answer_message(answer)],
    )
    text, spans = template.render(tokenizer, chat, conv, layouts=layouts)
    return text, spans[-1]


def build_media_group(samples: list[Any], cutoff_len: int) -> tuple[list[tuple[list[int], list[int]]], list[bytes], str]:
    """build_group for sequences rendered with their media (multimodal.MediaSample): also each sequence's
    tensors, per-token ones cut like its ids; a cut that would lose a medium's tokens drops the row."""
    from tuneforge.data import multimodal

    seqs = [Rendered(m.ids, *m.spans[-1]) for m in samples]
    group, status = build_group(seqs, cutoff_len)
    if status == "dropped":
        return group, [b"" for _ in samples], status
    p, keep_prompt, keep_answer = group_cut(seqs, cutoff_len)
    blobs = []
    for m in samples:
        positions = list(range(keep_prompt)) + list(range(p, min(p + keep_answer, len(m.ids))))
        if not multimodal.media_kept(m.media_spans, positions):
            return [([], []) for _ in samples], [b"" for _ in samples], "media_cut"
        blobs.append(multimodal.pack_tensors(m.tensors, positions))
    return group, blobs, status


def render_media_answer(processor: Any, chat: template.ChatTemplate, prompt: Conversation,
                        answer: str | dict[str, Any], settings: Any) -> Any:
    """prompt + the assistant's answer rendered with the prompt's media (multimodal.MediaSample)."""
    from tuneforge.data import multimodal

    conv = Conversation(system=prompt.system, tools=prompt.tools, media=prompt.media,
                        messages=[dict(m) for m in prompt.messages] + [answer_message(answer)])
    return multimodal.render_sample(processor, chat, conv, settings)


def tokenize_answers(tokenizer: Any, rendered: list[tuple[str, tuple[int, int]]]) -> list[Rendered]:
    if not rendered:
        return []
    all_ids, all_offsets = template.tokenize_rendered(tokenizer, [text for text, _ in rendered])
    out = []
    for (_, span), ids, offsets in zip(rendered, all_ids, all_offsets, strict=True):
        ((start, end),) = template.token_spans(offsets, [span])
        out.append(Rendered(ids, start, end))
    return out


def _empty_columns(prefixes: tuple[str, ...], n: int, media: bool = False) -> dict[str, list]:
    out: dict[str, list] = {f"{p}{c}": [[] for _ in range(n)] for p in prefixes for c in ("input_ids", "labels")}
    if media:
        from tuneforge.data.multimodal import MEDIA_COLUMN

        out.update({f"{p}{MEDIA_COLUMN}": [b""] * n for p in prefixes})
    return out


def _store(out: dict[str, list], prefixes: tuple[str, ...], i: int, group: list[tuple[list, list]]) -> None:
    for prefix, (ids, labels) in zip(prefixes, group, strict=True):
        out[f"{prefix}input_ids"][i], out[f"{prefix}labels"][i] = ids, labels


def _store_media(out: dict[str, list], prefixes: tuple[str, ...], i: int, blobs: list[bytes]) -> None:
    from tuneforge.data.multimodal import MEDIA_COLUMN

    for prefix, blob in zip(prefixes, blobs, strict=True):
        out[f"{prefix}{MEDIA_COLUMN}"][i] = blob


def _finish(out: dict[str, list], prefixes: tuple[str, ...], status: list[str]) -> dict[str, list]:
    for prefix in prefixes:
        out[f"{prefix}attention_mask"] = [[1] * len(ids) for ids in out[f"{prefix}input_ids"]]
    out["_status"] = status
    return out


@gc_paused
def encode_pairwise(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer: Any,
    chat: template.ChatTemplate,
    attr: DatasetAttr,
    settings: EncodeSettings,
    row_numbers: list[int] | None = None,
    processor: Any = None,
    media_settings: Any = None,
) -> dict[str, list]:
    """rm / dpo: prompt + chosen and prompt + rejected, sharing the prompt tokens (and the prompt's images, with
    a processor)."""
    rendered: list[tuple[int, list[tuple[str, tuple[int, int]]]]] = []
    status = ["bad"] * len(indices)
    prefixes = SEQUENCE_PREFIXES["pairwise"]
    out = _empty_columns(prefixes, len(indices), media=processor is not None)
    layouts = template.Layouts()
    for i, row in enumerate(batch_rows(batch)):
        try:
            pair = formats.to_pairwise(row, attr, default_system=settings.default_system)
            if processor is not None:
                pair.prompt.media = pair.prompt.media or row_media(row, attr.columns)
                samples = [render_media_answer(processor, chat, pair.prompt, a, media_settings)
                           for a in (pair.chosen, pair.rejected)]
                group, blobs, status[i] = build_media_group(samples, settings.cutoff_len)
                _store(out, prefixes, i, group)
                _store_media(out, prefixes, i, blobs)
                continue
            texts = [render_answer(tokenizer, chat, pair.prompt, a, layouts) for a in (pair.chosen, pair.rejected)]
        except BadRow as e:
            stop_unless_skipping(e, attr, settings, source_row(indices, i, row_numbers))
            continue
        rendered.append((i, texts))
    seqs = tokenize_answers(tokenizer, [t for _, texts in rendered for t in texts])
    for k, (i, _) in enumerate(rendered):
        group, status[i] = build_group(seqs[2 * k : 2 * k + 2], settings.cutoff_len)
        _store(out, prefixes, i, group)
    return _finish(out, prefixes, status)


@gc_paused
def encode_feedback(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer: Any,
    chat: template.ChatTemplate,
    attr: DatasetAttr,
    settings: EncodeSettings,
    row_numbers: list[int] | None = None,
    processor: Any = None,
    media_settings: Any = None,
) -> dict[str, list]:
    """kto: prompt + the judged answer, its tag, and the KL pair: the same prompt + another row's answer (both
    with the prompt's images, with a processor).

    Within this batch, the k-th good row takes the answer of the (k + 1)-th (the last takes the first's; a
    batch with one good row pairs it with itself). Deterministic, so reference log-probs can be cached.
    """
    parsed: list[tuple[int, formats.FeedbackRow, tuple[str, tuple[int, int]]]] = []
    status = ["bad"] * len(indices)

    def bad(i: int, e: BadRow) -> None:
        stop_unless_skipping(e, attr, settings, source_row(indices, i, row_numbers))

    layouts = template.Layouts()

    for i, row in enumerate(batch_rows(batch)):
        try:
            fb = formats.to_feedback(row, attr, default_system=settings.default_system)
            if processor is not None:
                fb.prompt.media = row_media(row, attr.columns)
                parsed.append((i, fb, ("", (0, 0))))  # rendered with the KL pair below
            else:
                parsed.append((i, fb, render_answer(tokenizer, chat, fb.prompt, fb.completion, layouts)))
        except BadRow as e:
            bad(i, e)
    if processor is not None:
        return _feedback_media(parsed, processor, chat, settings, media_settings, status, bad)
    pairs: list[tuple[int, formats.FeedbackRow, list[tuple[str, tuple[int, int]]]]] = []
    for k, (i, fb, own) in enumerate(parsed):
        other = parsed[(k + 1) % len(parsed)][1].completion
        try:  # both halves rendered on their own; a template could still refuse the mix
            pairs.append((i, fb, [own, render_answer(tokenizer, chat, fb.prompt, other, layouts)]))
        except BadRow as e:
            bad(i, e)
    prefixes = SEQUENCE_PREFIXES["feedback"]
    out = _empty_columns(prefixes, len(indices))
    out["kto_tag"] = [0] * len(indices)
    seqs = tokenize_answers(tokenizer, [t for _, _, texts in pairs for t in texts])
    for k, (i, fb, _) in enumerate(pairs):
        group, status[i] = build_group(seqs[2 * k : 2 * k + 2], settings.cutoff_len)
        _store(out, prefixes, i, group)
        out["kto_tag"][i] = int(fb.desirable)
    return _finish(out, prefixes, status)


def _feedback_media(parsed: list, processor: Any, chat: template.ChatTemplate, settings: EncodeSettings,
                    media_settings: Any, status: list[str], bad: Any) -> dict[str, list]:
    prefixes = SEQUENCE_PREFIXES["feedback"]
    out = _empty_columns(prefixes, len(status), media=True)
    out["kto_tag"] = [0] * len(status)
    for k, (i, fb, _) in enumerate(parsed):
        other = parsed[(k + 1) % len(parsed)][1].completion
        try:
            samples = [render_media_answer(processor, chat, fb.prompt, a, media_settings)
                       for a in (fb.completion, other)]
        except BadRow as e:
            bad(i, e)
            continue
        group, blobs, status[i] = build_media_group(samples, settings.cutoff_len)
        _store(out, prefixes, i, group)
        _store_media(out, prefixes, i, blobs)
        out["kto_tag"][i] = int(fb.desirable)
    return _finish(out, prefixes, status)


def sequence_features(prefixes: tuple[str, ...], **extra: Any) -> Any:
    """The column types of rows holding one sequence per prefix (+ extra columns), as an encoder's map
    returns them."""
    import datasets

    ints = datasets.List(datasets.Value("int32"))
    cols: dict[str, Any] = {}
    for prefix in prefixes:
        cols[f"{prefix}input_ids"] = ints
        cols[f"{prefix}labels"] = ints
        cols[f"{prefix}attention_mask"] = datasets.List(datasets.Value("int8"))
    cols.update(extra)
    cols["_status"] = datasets.Value("string")
    return datasets.Features(cols)


def pairwise_features() -> Any:
    return sequence_features(SEQUENCE_PREFIXES["pairwise"])


def feedback_features() -> Any:
    import datasets

    return sequence_features(SEQUENCE_PREFIXES["feedback"], kto_tag=datasets.Value("int8"))
