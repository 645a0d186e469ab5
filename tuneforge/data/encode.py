"""One encoder per stage: raw rows -> token rows. Each is a batched `datasets.map` function.

Every output row carries `_status`: ok / ok_truncated (kept), bad (skipped malformed row), dropped
(truncation left nothing supervised), empty (a pt document without text). The pipeline counts and
filters on it. The preference encoders (`pairwise`, `feedback`) are in encode_pref.py; tuneforge.data.encoders
registers them all by name, and a stage's row in tuneforge/stages.py names the one it uses.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuneforge.data import formats, template, word_tokens
from tuneforge.data.formats import BadRow
from tuneforge.data.registry import DatasetAttr
from tuneforge.errors import DataError

IGNORE_INDEX = -100
KEPT = ("ok", "ok_truncated")


@dataclass(frozen=True)
class EncodeSettings:
    stage: str
    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    default_system: str | None = None
    skip_bad_rows: bool = False
    completion_room: int = 0  # prompt encoders: tokens kept free for the sampled completion


KIND_WORDS = {
    "plain": "a plain dataset (no ranking, no kto_tag)",
    "pairwise": "a ranking dataset (chosen/rejected, for rm or dpo)",
    "feedback": "a feedback dataset (kto_tag, for kto)",
}
KIND_NEEDS = {
    "plain": "a dataset without ranking/kto_tag",
    "pairwise": "a ranking dataset (ranking: true with chosen/rejected columns)",
    "feedback": "a feedback dataset (a kto_tag column of true/false)",
}


def check_stage(attr: DatasetAttr, stage: Any) -> None:
    """Stop before tokenizing when the stage (its row in tuneforge/stages.py) cannot train on this kind of
    dataset."""
    if attr.kind not in stage.dataset_kinds:
        raise DataError(
            f"dataset '{attr.name}' is {KIND_WORDS[attr.kind]}, which stage {stage.name} cannot train on: it "
            f"needs {KIND_NEEDS[stage.dataset_kinds[0]]}; choose another dataset or stage"
        )


def bad_row_error(attr: DatasetAttr, row_index: int, problem: str) -> DataError:
    return DataError(
        f"dataset '{attr.name}' ({attr.source}), row {row_index}: {problem}. Fix the row, or set "
        f"skip_bad_rows: true to skip and count such rows"
    )


def stop_unless_skipping(error: Exception, attr: DatasetAttr, settings: EncodeSettings, row_index: int) -> None:
    """A bad row stops the run, naming the dataset and row, unless skip_bad_rows (the caller then skips it
    and its status counts it)."""
    if not settings.skip_bad_rows:
        raise bad_row_error(attr, row_index, str(error)) from None


def row_features(packed: bool, *, media: bool = False) -> Any:
    """The column types of token rows (int32 ids and labels keep the cache small; media: mm_inputs bytes)."""
    import datasets

    ints = datasets.List(datasets.Value("int32"))
    cols = {"input_ids": ints, "labels": ints, "attention_mask": datasets.List(datasets.Value("int8"))}
    if packed:
        cols["position_ids"] = ints
    if media:
        from tuneforge.data.multimodal import MEDIA_COLUMN

        cols[MEDIA_COLUMN] = datasets.Value("binary")
    return datasets.Features(cols)


def pretrain_features() -> Any:
    """The column types encode_pretrain's map returns (documents: ids only)."""
    import datasets

    return datasets.Features({"input_ids": datasets.List(datasets.Value("int32")), "_status": datasets.Value("string")})


def supervised_features() -> Any:
    """The column types encode_supervised's map returns."""
    import datasets

    features = row_features(False)
    features["_status"] = datasets.Value("string")
    return features


def split_budget(source_len: int, target_len: int, budget: int) -> tuple[int, int]:
    """How many prompt and response tokens of one turn fit in `budget` (LlamaFactory's rule).

    A short response (under half the budget) is kept whole and the prompt cut; else a short prompt is
    kept whole and the response cut; else both are cut in proportion to their lengths.
    """
    if 2 * target_len < budget:
        target_cap = budget
    elif 2 * source_len < budget:
        target_cap = budget - source_len
    else:
        target_cap = int(budget * target_len / (source_len + target_len))
    target = min(target_cap, target_len)
    source = min(max(budget - target, 0), source_len)
    return source, target


@dataclass
class Turn:
    source: list[int]
    source_labels: list[int]
    target: list[int]
    target_labels: list[int]

    def __len__(self) -> int:
        return len(self.source) + len(self.target)

    def cut(self, budget: int) -> Turn:
        s, t = split_budget(len(self.source), len(self.target), budget)
        return Turn(self.source[:s], self.source_labels[:s], self.target[:t], self.target_labels[:t])


def make_turns(ids: list[int], spans: list[tuple[int, int]], s: EncodeSettings,
               trained: list[bool] | None = None) -> list[Turn]:
    """Split a rendered conversation at its assistant spans: turn k = (prompt before span k, span k).

    The text after the last span (the template's trailing newline) joins the last response, unsupervised.
    trained: per span, whether its message is trained at all (LlamaFactory v1's loss_weight 0: not).
    """
    turns, prev = [], 0
    for k, (start, end) in enumerate(spans):
        end = len(ids) if k == len(spans) - 1 else end
        supervised = (trained is None or trained[k]) and (
            s.train_on_prompt or not s.mask_history or k == len(spans) - 1)
        target = ids[start:end]
        labels = list(target) if supervised else [IGNORE_INDEX] * len(target)
        if not s.train_on_prompt:
            span_len = spans[k][1] - start
            labels[span_len:] = [IGNORE_INDEX] * (len(target) - span_len)
        source = ids[prev:start]
        turns.append(
            Turn(source, list(source) if s.train_on_prompt else [IGNORE_INDEX] * len(source), target, labels)
        )
        prev = end
    return turns


def fit_turns(turns: list[Turn], cutoff_len: int, *, keep_last: bool) -> list[Turn]:
    """Turns that fit in cutoff_len: whole turns from the start, then the first that does not fit is cut.

    With keep_last (mask_history, where only the last turn is supervised) the last turn is fitted first and
    whole earlier turns are kept from the end while they fit.
    """
    if sum(map(len, turns)) <= cutoff_len:
        return turns
    if keep_last:
        last = turns[-1].cut(cutoff_len)
        budget, kept = cutoff_len - len(last), [last]
        for turn in reversed(turns[:-1]):
            if len(turn) > budget:
                break
            kept.insert(0, turn)
            budget -= len(turn)
        return kept
    kept, budget = [], cutoff_len
    for turn in turns:
        if budget <= 0:
            break
        cut = turn.cut(budget)
        kept.append(cut)
        budget -= len(cut)
    return kept


def build_sample(
    ids: list[int], spans: list[tuple[int, int]], s: EncodeSettings, trained: list[bool] | None = None
) -> tuple[list[int], list[int], str]:
    """(input_ids, labels, status) of one rendered conversation, truncated to cutoff_len (trained: make_turns)."""
    turns = make_turns(ids, spans, s, trained)
    kept = fit_turns(turns, s.cutoff_len, keep_last=s.mask_history and not s.train_on_prompt)
    input_ids, labels = [], []
    for t in kept:
        input_ids += t.source + t.target
        labels += t.source_labels + t.target_labels
    # the first label is never predicted (nothing comes before it), so it cannot keep a sample alive
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return [], [], "dropped"
    return input_ids, labels, "ok_truncated" if len(input_ids) < len(ids) else "ok"


def build_media_sample(sample: Any, s: EncodeSettings,
                       trained: list[bool] | None = None) -> tuple[list[int], list[int], bytes, str]:
    """(input_ids, labels, mm_inputs, status) of one rendered multimodal sample (multimodal.MediaSample), cut to
    cutoff_len like a text sample; a cut that would lose any of a medium's tokens drops the sample instead."""
    from tuneforge.data import multimodal

    positions, position_labels, status = build_sample(list(range(len(sample.ids))), sample.spans, s, trained)
    if status == "dropped":
        return [], [], b"", status
    if not multimodal.media_kept(sample.media_spans, positions):
        return [], [], b"", "media_cut"
    ids = [sample.ids[p] for p in positions]
    labels = [sample.ids[p] if label != IGNORE_INDEX else IGNORE_INDEX
              for p, label in zip(positions, position_labels, strict=True)]
    return ids, labels, multimodal.pack_tensors(sample.tensors, positions), status


def batch_rows(batch: dict[str, list]) -> list[dict[str, Any]]:
    keys = list(batch)
    return [dict(zip(keys, values, strict=True)) for values in zip(*(batch[k] for k in keys), strict=True)]


def source_row(indices: list[int], i: int, row_numbers: list[int] | None) -> int:
    return row_numbers[indices[i]] if row_numbers is not None else indices[i]


def gc_paused(encoder: Callable[..., dict[str, list]]) -> Callable[..., dict[str, list]]:
    """Run a batch encoder with Python's cyclic garbage collector paused.

    A batch allocates millions of small objects (ids, labels, offset pairs) that reference counting frees; left on,
    the collector walks them again and again (about a tenth of the sft encoder's time on a 10k-row sharegpt set)."""

    @functools.wraps(encoder)
    def paused(*args: Any, **kwargs: Any) -> dict[str, list]:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return encoder(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused


@gc_paused
def encode_supervised(
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
    """sft: chat template, labels on each assistant turn's content and end-of-turn marker.

    With a processor (a vision- / audio-language model) each row renders with its media through the processor, and
    the rows gain mm_inputs (the processor's tensors)."""
    if processor is not None:
        return _encode_supervised_media(batch, indices, processor=processor, chat=chat, attr=attr,
                                        settings=settings, media_settings=media_settings, row_numbers=row_numbers)
    rendered: list[tuple[int, str, list[tuple[int, int]], list[bool] | None]] = []
    status = ["bad"] * len(indices)
    layouts = template.Layouts()  # the batch's conversation shapes: each renders its prefixes once
    for i, row in enumerate(batch_rows(batch)):
        try:
            conv = formats.to_conversation(row, attr, default_system=settings.default_system)
            if conv.media:  # media parts of a LlamaFactory v1 row
                raise BadRow(f"the row has {', '.join(conv.media)} media, but the model reads text only; use a "
                             f"vision- or audio-language model")
            text, spans = template.render(tokenizer, chat, conv, layouts=layouts)
        except BadRow as e:
            stop_unless_skipping(e, attr, settings, source_row(indices, i, row_numbers))
            continue
        rendered.append((i, text, spans, conv.trained_turns()))
    out: dict[str, list] = {"input_ids": [[] for _ in indices], "labels": [[] for _ in indices]}
    if rendered:
        all_ids, all_offsets = template.tokenize_rendered(tokenizer, [text for _, text, _, _ in rendered])
        for (i, _, spans, trained), ids, offsets in zip(rendered, all_ids, all_offsets, strict=True):
            tok_spans = template.token_spans(offsets, spans)
            out["input_ids"][i], out["labels"][i], status[i] = build_sample(ids, tok_spans, settings, trained)
    out["attention_mask"] = [[1] * len(ids) for ids in out["input_ids"]]
    out["_status"] = status
    return out


def _encode_supervised_media(batch: dict[str, list], indices: list[int], *, processor: Any,
                             chat: template.ChatTemplate, attr: DatasetAttr, settings: EncodeSettings,
                             media_settings: Any, row_numbers: list[int] | None) -> dict[str, list]:
    from tuneforge.data import media, multimodal

    out: dict[str, list] = {"input_ids": [], "labels": [], multimodal.MEDIA_COLUMN: [], "_status": []}
    for i, row in enumerate(batch_rows(batch)):
        try:
            conv = formats.to_conversation(row, attr, default_system=settings.default_system)
            conv.media = conv.media or media.row_media(row, attr.columns)
            sample = multimodal.render_sample(processor, chat, conv, media_settings)
            ids, labels, blob, status = build_media_sample(sample, settings, conv.trained_turns())
        except BadRow as e:
            stop_unless_skipping(e, attr, settings, source_row(indices, i, row_numbers))
            ids, labels, blob, status = [], [], b"", "bad"
        for key, value in (("input_ids", ids), ("labels", labels), (multimodal.MEDIA_COLUMN, blob), ("_status", status)):
            out[key].append(value)
    out["attention_mask"] = [[1] * len(ids) for ids in out["input_ids"]]
    return out


def encode_pretrain(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer: Any,
    attr: DatasetAttr,
    settings: EncodeSettings,
    row_numbers: list[int] | None = None,
) -> dict[str, list]:
    """pt: each document as the tokenizer encodes it (with its special tokens), then EOS.

    Chunking into cutoff_len rows happens later (packing.chunk_documents), over the whole dataset.
    """
    texts, status = [], []
    for i, row in enumerate(batch_rows(batch)):
        try:
            text = formats.to_document(row, attr)
        except BadRow as e:
            stop_unless_skipping(e, attr, settings, source_row(indices, i, row_numbers))
            texts.append("")
            status.append("bad")
            continue
        texts.append(text)
        status.append("ok" if text else "empty")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("stage pt ends every document with the EOS token, but the tokenizer has no eos_token")
    encoded = word_tokens.encode_documents(tokenizer, texts)
    ids = [
        (e if e and e[-1] == eos else e + [eos]) if s == "ok" else []
        for e, s in zip(encoded, status, strict=True)
    ]
    return {"input_ids": ids, "_status": status}
