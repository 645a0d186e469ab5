"""build(): dataset names -> tokenized train / eval splits, cached by the hash of everything they depend on.

registry (rows) -> encode (the stage's encoder, per dataset) -> mix -> eval split -> packing -> cache.
The stage's row (tuneforge/stages.py) names the encoder (tuneforge.data.encoders) and whether rows pack:
the preference stages never do, their objectives compare whole sequences.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.atomic import partial_folder
from tuneforge.config.rl import resolved_rl
from tuneforge.data import (
    arrow_batch,
    cache,
    encode,
    formats,
    media,
    multimodal,
    packing,
    registry,
    streaming,
    template,
)
from tuneforge.data.encoders import get_encoder
from tuneforge.data.registry import DatasetAttr
from tuneforge.errors import DataError
from tuneforge.paths import tuneforge_home
from tuneforge.stages import stage_of

logger = logging.getLogger(__name__)

@dataclass
class DataSplits:
    train: Any  # datasets.Dataset | None
    eval: Any  # datasets.Dataset | None
    stats: dict[str, Any] = field(default_factory=dict)
    processor: Any = None  # the processor a vision- / audio-language model's rows were rendered with


# Rows per tokenizing process when preprocessing_num_workers is unset: a process's start, its copy of the tokenizer
# and its own memory of words cost ~0.4 s on a 2-core machine, ~800 rows of sft work (docs/performance.md,
# "Processes by default").
AUTO_ROWS_PER_WORKER = 2_000


def worker_count(requested: int | None, rows: int | None = None) -> int | None:
    """The processes that tokenize `rows` rows: preprocessing_num_workers, or where it is unset one per
    AUTO_ROWS_PER_WORKER rows; at most one per CPU this process may use (more only share the cores, each with its
    own copy of the tokenizer). None (one process or fewer): tokenize in this process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested is None:
        auto = min(cores, (rows or 0) // AUTO_ROWS_PER_WORKER)
        return auto if auto > 1 else None
    if requested <= 1:
        return None
    if requested > cores:
        logger.info("preprocessing_num_workers %d: %d CPU core(s) here, so %d processes", requested, cores, cores)
    return min(requested, cores) if cores > 1 else None


class _Plan:
    """Everything one build depends on, resolved from the config and the tokenizer."""

    def __init__(self, cfg: Any, tokenizer: Any, processor: Any = None, media_packing: str | None = None) -> None:
        d = cfg.data
        self.cfg, self.tokenizer, self.stage = cfg, tokenizer, cfg.method.stage
        self.processor = processor  # a vision- / audio-language model's processor, None for a text model
        self.media_packing = media_packing  # why this model's media samples cannot share a row, "" when they can
        self.train_attrs = registry.get_dataset_attrs(d.dataset, d.dataset_dir)
        self.eval_attrs = registry.get_dataset_attrs(d.eval_dataset, d.dataset_dir)
        if not self.train_attrs and not self.eval_attrs:
            raise DataError(
                "no dataset to build: set dataset (names from dataset_info.json), or tokenized_path "
                "to a folder written by `tuneforge preprocess`"
            )
        spec = stage_of(self.stage)
        for attr in self.train_attrs + self.eval_attrs:
            encode.check_stage(attr, spec)
        self.encoder = get_encoder(spec.encoder)
        self._check_media(spec)
        self.chat = template.resolve_template(
            cfg.model.template, processor or tokenizer, enable_thinking=d.enable_thinking,
            preserve_thinking=d.preserve_thinking, tool_format=d.tool_format,
        ) if self.encoder.chat else None
        if processor is not None and self.chat is not None and self.chat.source is not None:
            raise DataError(f"template {cfg.model.template!r} is a text template; a vision- or audio-language model "
                            f"renders its media with its processor's own chat template: leave template unset")
        self.settings = encode.EncodeSettings(
            stage=self.stage,
            cutoff_len=d.cutoff_len,
            train_on_prompt=d.train_on_prompt,
            mask_history=d.mask_history,
            default_system=d.default_system,
            skip_bad_rows=d.skip_bad_rows,
            completion_room=resolved_rl(cfg).max_completion_length if self.encoder.samples_completions else 0,
        )
        self.packing = spec.can_pack and (
            bool(d.neat_packing) or (d.packing if d.packing is not None else spec.packs_by_default)
        )
        if self.packing and processor is not None and self.media_packing != "":
            raise DataError(f"packing cannot put this model's samples in one row with their media: "
                            f"{self.media_packing or 'the model was not checked'}; set packing: false")
        self.media = media.MediaSettings.from_config(cfg)
        self.media_files: set[Path] = set()  # filled while encoding: the cache checks them on each hit
        self.workers = worker_count(d.preprocessing_num_workers)
        self.key = self._key()
        self.scratch: Path | None = None  # the scratch folder of the build running (_scratch_folder)

    def processes(self, rows: int, what: str) -> int | None:
        """The processes for a map over `rows` rows: preprocessing_num_workers as set, or chosen from the rows
        where it is unset, except for an encoder whose result depends on how the rows are split into batches."""
        if self.cfg.data.preprocessing_num_workers is not None or self.encoder.batch_dependent:
            return self.workers
        workers = worker_count(None, rows)
        if workers:
            logger.info("%s: %d rows in %d processes (preprocessing_num_workers unset: one per %d rows, at most "
                        "one per core)", what, rows, workers, AUTO_ROWS_PER_WORKER)
        return workers

    def _check_media(self, spec: Any) -> None:
        """Media in the data need a model that reads them and an encoder that renders them; before tokenizing."""
        for attr in self.train_attrs + self.eval_attrs:
            kinds = {kind for kind in media.KINDS if attr.column(media.COLUMN_OF[kind])}
            media.check_media(self.processor, kinds, f"dataset '{attr.name}'", self.cfg.model.use_audio_in_video)
        if self.processor is None:
            return
        if not self.encoder.media:
            raise DataError(f"stage {self.stage} does not train vision- or audio-language models yet "
                            f"(its {spec.encoder} encoder renders text only); use stage sft")

    def _key(self) -> str:
        d, t = self.cfg.data, self.cfg.train
        material = {
            "version": cache.CACHE_VERSION,
            "train": [cache.dataset_identity(a, d.dataset_dir) for a in self.train_attrs],
            "eval": [cache.dataset_identity(a, d.dataset_dir) for a in self.eval_attrs],
            "tokenizer": cache.tokenizer_fingerprint(self.tokenizer),
            "template": self.cfg.model.template,
            "chat_template": self.chat.text(self.tokenizer) if self.chat else None,
            "stage": self.stage,
            "cutoff_len": d.cutoff_len,
            "train_on_prompt": d.train_on_prompt,
            "mask_history": d.mask_history,
            "packing": self.packing,
            "max_samples": d.max_samples,
            "val_size": d.val_size,
            "mix_strategy": d.mix_strategy,
            "interleave_probs": d.interleave_probs,
            "seed": t.seed,
            "default_system": d.default_system,
            "eval_on_each_dataset": d.eval_on_each_dataset,
            "streaming": d.streaming,  # the training rows are then built while training, not here
            "skip_bad_rows": d.skip_bad_rows,
            "completion_room": self.settings.completion_room,
        }
        if self.processor is not None:
            material["processor"] = cache.processor_fingerprint(self.processor)
            material["media"] = self.media
        if self.encoder.batch_dependent:  # e.g. kto's KL pairs, drawn within each batch of each worker's shard
            material["kl_batches"] = [d.preprocessing_batch_size, self.workers]
        return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def check_columns(self, attr: DatasetAttr, column_names: list[str]) -> None:
        """Stop before encoding when a column the stage needs is missing from the dataset."""
        formats.check_columns(attr, column_names, self.stage, documents=self.encoder.documents,
                              needs_response=self.encoder.needs_response, prompts=self.encoder.samples_completions)

    def fingerprint(self, *parts: str) -> str:
        """A datasets fingerprint for one step (so datasets need not hash our functions and tokenizer)."""
        return hashlib.sha256("/".join((self.key,) + parts).encode()).hexdigest()[:32]

    def scratch_file(self, *parts: str) -> str | None:
        """Where a step that reads the source data writes its result: in this build's scratch folder (every later
        step's files go beside its source's, so there too); None outside a build (datasets' own cache)."""
        return None if self.scratch is None else str(self.scratch / f"{self.fingerprint(*parts)}.arrow")


def _local_media(raw: Any, attr: DatasetAttr, settings: media.MediaSettings) -> set[Path]:
    """The local files the rows' media columns name (URLs and embedded media have none)."""
    columns = [c for kind in media.KINDS if (c := attr.column(media.COLUMN_OF[kind])) in raw.column_names]
    values = (value for column in columns for value in raw[column])
    refs = [ref for value in values for ref in (value if isinstance(value, list) else [value])]
    if attr.formatting == "v1":  # LlamaFactory v1 rows name their media in content parts
        from tuneforge.data.v1 import media_values

        refs += media_values(raw, attr)
    return {file for ref in refs if (file := media.local_file(ref, settings)) is not None}


def _sample_indices(n: int, target: int, seed: int) -> list[int]:
    """LlamaFactory's num_samples: a seeded random subset, or the whole set repeated plus a random rest."""
    import numpy as np

    rng = np.random.default_rng(seed)
    whole = list(range(n)) * (target // n)
    return whole + rng.permutation(n)[: target % n].tolist()


def _encode_dataset(plan: _Plan, attr: DatasetAttr, stats: dict[str, Any]) -> Any:
    d = plan.cfg.data
    raw = registry.load_raw(attr, d.dataset_dir, cache_dir=plan.cfg.model.cache_dir)
    plan.check_columns(attr, raw.column_names)
    row_numbers = None
    if attr.num_samples:
        row_numbers = _sample_indices(len(raw), attr.num_samples, plan.cfg.train.seed)
        raw = raw.select(row_numbers, indices_cache_file_name=plan.scratch_file(attr.name, "sample"))
    if d.max_samples and len(raw) > d.max_samples:
        raw = raw.select(range(d.max_samples))
    fn_kwargs: dict[str, Any] = {
        "tokenizer": plan.tokenizer,
        "attr": attr,
        "settings": plan.settings,
        "row_numbers": row_numbers,
    }
    if plan.chat is not None:
        fn_kwargs["chat"] = plan.chat
    features = plan.encoder.features()
    if plan.processor is not None:
        fn_kwargs.update(processor=plan.processor, media_settings=plan.media)
        for prefix in plan.encoder.sequences:
            features[f"{prefix}{multimodal.MEDIA_COLUMN}"] = multimodal.media_feature()
    processes = plan.processes(len(raw), f"encoding {attr.name}")
    encoded = raw.map(
        arrow_batch.mapped,
        batched=True,
        with_indices=True,
        batch_size=d.preprocessing_batch_size,
        num_proc=processes,
        remove_columns=raw.column_names,
        fn_kwargs={**fn_kwargs, "encoder": plan.encoder.function, "features": features},
        features=features,
        new_fingerprint=plan.fingerprint(attr.name, "encode"),
        cache_file_name=plan.scratch_file(attr.name, "encode"),
        load_from_cache_file=False,
        desc=f"encoding {attr.name}",
    )
    counts = Counter(encoded.data.column("_status").to_pylist())
    kept = encoded.filter(
        lambda status: [s in encode.KEPT for s in status],
        input_columns="_status",
        batched=True,
        new_fingerprint=plan.fingerprint(attr.name, "filter"),
        load_from_cache_file=False,
    ).remove_columns("_status")
    stats["datasets"][attr.name] = entry = {
        "rows": len(raw),
        "bad_rows": counts["bad"],
        "dropped_by_truncation": counts["dropped"],
        "truncated": counts["ok_truncated"],
        "empty_documents": counts["empty"],
        "samples": len(kept),
    }
    if plan.processor is not None:
        entry["dropped_media_cut"] = counts["media_cut"]
        plan.media_files.update(_local_media(raw, attr, plan.media))
    # what the rows held: the RL stages' rewards read some of these columns
    stats.setdefault("dataset_columns", {})[attr.name] = raw.column_names
    if entry["bad_rows"]:
        logger.warning(
            "dataset '%s': skipped %d bad rows of %d (skip_bad_rows)", attr.name, entry["bad_rows"], len(raw)
        )
    if entry["dropped_by_truncation"]:
        logger.warning(
            "dataset '%s': dropped %d samples with nothing left to learn after truncation to cutoff_len=%d",
            attr.name,
            entry["dropped_by_truncation"],
            d.cutoff_len,
        )
    if entry.get("dropped_media_cut"):
        logger.warning(
            "dataset '%s': dropped %d samples whose media tokens do not fit in cutoff_len=%d (raise cutoff_len or "
            "lower image_max_pixels)", attr.name, entry["dropped_media_cut"], d.cutoff_len,
        )
    if len(kept) == 0:
        raise DataError(
            f"dataset '{attr.name}' is empty after encoding: of {len(raw)} rows, {entry['bad_rows']} were "
            f"skipped as bad, {entry['dropped_by_truncation']} lost all supervised tokens to truncation at "
            f"cutoff_len={d.cutoff_len}, {entry.get('dropped_media_cut', 0)} could not fit their media in it, "
            f"{entry['empty_documents']} had no text; "
            f"fix the rows or raise cutoff_len"
        )
    return kept


def _mix(plan: _Plan, parts: list[Any]) -> Any:
    import datasets

    d = plan.cfg.data
    if len(parts) == 1:
        return parts[0]
    if d.mix_strategy == "concat":
        return datasets.concatenate_datasets(parts)
    stopping = "first_exhausted" if d.mix_strategy == "interleave_under" else "all_exhausted"
    if stopping == "all_exhausted" and d.interleave_probs and min(d.interleave_probs) == 0:
        raise DataError(
            "mix_strategy interleave_over with an interleave_probs value of 0 never ends (that "
            "dataset is never drawn, so never exhausted); drop the dataset or give it a share"
        )
    return datasets.interleave_datasets(
        parts, probabilities=d.interleave_probs, seed=plan.cfg.train.seed, stopping_strategy=stopping
    )


def _split_eval(plan: _Plan, train: Any) -> tuple[Any, Any]:
    val_size = plan.cfg.data.val_size
    size: float | int = int(val_size) if val_size >= 1 else val_size
    if isinstance(size, int) and size >= len(train):
        raise DataError(f"val_size {size} holds out every one of the {len(train)} samples; lower val_size")
    parts = train.train_test_split(
        test_size=size,
        seed=plan.cfg.train.seed,
        shuffle=True,
        train_new_fingerprint=plan.fingerprint("split", "train"),
        test_new_fingerprint=plan.fingerprint("split", "eval"),
    )
    return parts["train"], parts["test"]


def _rows(plan: _Plan, samples: Any, split: str) -> Any:
    """Samples -> training rows: documents (pt) are chunked into rows; samples are packed when packing is on."""
    if samples is None or not (plan.encoder.documents or plan.packing):
        return samples
    d = plan.cfg.data
    processes = plan.processes(len(samples), f"{'chunking' if plan.encoder.documents else 'packing'} {split}")
    kw = {
        "num_proc": processes,
        "batch_size": d.preprocessing_batch_size,
        "fingerprint": plan.fingerprint(split, "rows"),
        "cache_file": plan.scratch_file(split, "rows"),  # a corpus's rows on disk, not in memory
    }
    if plan.encoder.documents:
        return packing.chunk_documents(samples, d.cutoff_len, packed=plan.packing, **kw)
    return packing.pack_samples(samples, d.cutoff_len, **kw)


def _token_counts(ds: Any, prefixes: tuple[str, ...]) -> dict[str, int]:
    """Rows, tokens and supervised tokens (labels the loss uses: every label but each sequence's first).

    prefixes: the encoder's sequence column prefixes. Preference rows hold several sequences (chosen_ /
    rejected_, or the answer and kl_): all are counted, as the model runs on all of them.
    """
    import pyarrow.compute as pc

    rows = tokens = supervised = 0
    for table in ds.with_format("arrow").iter(batch_size=10_000):
        rows += table.num_rows
        for prefix in prefixes:
            tokens += pc.sum(pc.list_value_length(table[f"{prefix}input_ids"])).as_py() or 0
            if f"{prefix}labels" not in table.column_names:  # prompt rows (grpo): nothing supervised yet
                continue
            labels = table[f"{prefix}labels"]
            flat = pc.list_flatten(labels)
            first = pc.list_element(labels, 0)
            supervised += (pc.sum(pc.not_equal(flat, encode.IGNORE_INDEX)).as_py() or 0) - (
                pc.sum(pc.not_equal(first, encode.IGNORE_INDEX)).as_py() or 0
            )
    return {"rows": rows, "tokens": tokens, "supervised_tokens": supervised}


def _build_fresh(plan: _Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    d = plan.cfg.data
    stats: dict[str, Any] = {"datasets": {}, "stage": plan.stage, "packing": plan.packing}
    train = (  # streamed training rows are built while training (data/streaming.py)
        _mix(plan, [_encode_dataset(plan, a, stats) for a in plan.train_attrs])
        if plan.train_attrs and not d.streaming else None
    )
    evaluation = eval_rows = None
    if plan.eval_attrs:
        import datasets

        parts = [_encode_dataset(plan, a, stats) for a in plan.eval_attrs]
        evaluation = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        if d.eval_on_each_dataset:  # each dataset's rows built apart (never packed together), then listed
            rows = [_rows(plan, part, f"eval-{a.name}") for a, part in zip(plan.eval_attrs, parts, strict=True)]
            eval_rows = datasets.concatenate_datasets(rows) if len(rows) > 1 else rows[0]
            ends = list(itertools.accumulate(len(r) for r in rows))
            stats["eval_parts"] = {a.name: [end - len(r), end]
                                   for a, r, end in zip(plan.eval_attrs, rows, ends, strict=True)}
        if d.val_size > 0:
            logger.warning("eval_dataset is set, so val_size %s is ignored", d.val_size)
    elif d.val_size > 0 and train is not None:
        train, evaluation = _split_eval(plan, train)
    per = stats["datasets"].values()
    stats.update(
        {
            "rows_read": sum(e["rows"] for e in per),
            "bad_rows": sum(e["bad_rows"] for e in per),
            "dropped_by_truncation": sum(e["dropped_by_truncation"] for e in per),
            "train_samples": len(train) if train is not None else 0,
            "eval_samples": len(evaluation) if evaluation is not None else 0,
        }
    )
    splits = {"train": _rows(plan, train, "train"), "eval": eval_rows if eval_rows is not None else _rows(plan, evaluation, "eval")}
    for name, ds in splits.items():
        if ds is not None:
            counts = _token_counts(ds, plan.encoder.sequences)
            stats[f"{name}_rows"], stats[f"{name}_tokens"] = counts["rows"], counts["tokens"]
            stats[f"{name}_supervised_tokens"] = counts["supervised_tokens"]
    stats["samples"] = stats["train_samples"]
    stats["tokens"] = stats.get("train_tokens", 0)
    stats["supervised_tokens"] = stats.get("train_supervised_tokens", 0)
    stats["packed_rows"] = stats.get("train_rows", 0) if plan.packing else 0
    return {k: v for k, v in splits.items() if v is not None}, stats


@contextlib.contextmanager
def _scratch_folder(plan: _Plan, entry: Path) -> Iterator[None]:
    """A folder beside the cache entry for the files of one build's steps, removed after it. The rows are kept in
    tuneforge's cache; datasets would keep each step's result in its own cache too, beside the source data, never
    read again (load_from_cache_file is off) and growing with every build. A fresh folder also keeps datasets from
    splitting a map into as many shards as an earlier map with its fingerprint left files there: after a build in
    one process, every later one ran in one process whatever num_proc said. A killed build's folder is removed by
    the next build of the same entry (atomic.partial_folder). plan.scratch names it while the build runs."""
    plan.scratch = partial_folder(entry.with_name(f"{entry.name}.scratch"))
    try:
        yield
    finally:
        shutil.rmtree(plan.scratch, ignore_errors=True)
        plan.scratch = None


def _load(path: Path, *, cache_hit: bool) -> DataSplits:
    train, evaluation, stats = cache.load_splits(path, cache_hit=cache_hit)
    return DataSplits(train=train, eval=evaluation, stats=stats)


def _streamed_rows(plan: _Plan) -> streaming.StreamedRows:
    """The training rows of a streamed run: as many as max_steps consumes over all processes."""
    t = plan.cfg.train
    if plan.processor is not None:
        raise DataError("streaming reads text datasets; a vision- or audio-language model's data is built ahead: set "
                        "streaming: false")
    rows = t.max_steps * t.gradient_accumulation_steps * t.per_device_train_batch_size * streaming.process_place()[1]
    logger.info("streaming: %d training rows over %d steps, tokenized while training (buffer_size %d)", rows,
                t.max_steps, plan.cfg.data.buffer_size)
    return streaming.StreamedRows(plan, rows)


def build(cfg: Any, tokenizer: Any, processor: Any = None, *, media_packing: str | None = None) -> DataSplits:
    """Tokenized train / eval splits for cfg (a RunConfig), from the cache when nothing changed.

    processor: a vision- / audio-language model's processor (model.processor.load_processor), None for text.
    media_packing: with a processor and packing, "" when the model's samples stay apart in one row with their
    media (model.multimodal.media_packing_refusal), else why not."""
    d = cfg.data
    saved = Path(d.tokenized_path) if d.tokenized_path else None
    if saved is not None and saved.exists() and not d.overwrite_cache and not cache.is_empty_folder(saved):
        logger.info("loading tokenized data from tokenized_path %s", saved)
        splits = _load(saved, cache_hit=True)
        splits.processor = processor
        return splits
    plan = _Plan(cfg, tokenizer, processor, media_packing)
    entry = tuneforge_home() / "datasets" / plan.key
    hit = (entry / cache.STATS_FILE).is_file() and not d.overwrite_cache
    changed = cache.changed_media(entry) if hit else None
    if changed:
        logger.info("tokenized data: %s changed since %s was built; tokenizing again", changed, entry)
    if hit and not changed:
        logger.info("tokenized data: cache hit %s", entry)
        splits = _load(entry, cache_hit=True)
    else:
        logger.info(
            "tokenizing %s for stage %s",
            ", ".join(a.name for a in plan.train_attrs + plan.eval_attrs),
            plan.stage,
        )
        with _scratch_folder(plan, entry):
            built, stats = _build_fresh(plan)
            cache.save_splits(built, stats, entry, replace=d.overwrite_cache or bool(changed),
                              media_files=sorted(plan.media_files))
        splits = _load(entry, cache_hit=False)
    if d.streaming:  # the training figures are unknown until the stream is read
        splits.train, splits.stats["streaming"] = _streamed_rows(plan), True
        for key in ("train_samples", "samples", "tokens", "supervised_tokens", "packed_rows"):
            splits.stats.pop(key, None)
    if saved is not None:
        found = {k: v for k, v in (("train", splits.train), ("eval", splits.eval)) if v is not None}
        kept_stats = {k: v for k, v in splits.stats.items() if k not in ("cache_hit", "cache_dir")}
        cache.save_splits(found, kept_stats, saved, replace=True)
        logger.info("saved tokenized data to %s", saved)
    splits.processor = processor
    return splits


OPEN_MARK, CLOSE_MARK = "⟦", "⟧"


def mark_supervised(tokenizer: Any, input_ids: list[int], labels: list[int]) -> str:
    """The decoded text with each run of supervised tokens between ⟦ and ⟧."""
    out, run, run_supervised = [], [], None
    for token, label in zip(input_ids, labels, strict=True):
        supervised = label != encode.IGNORE_INDEX
        if run and supervised != run_supervised:
            text = tokenizer.decode(run, skip_special_tokens=False)
            out.append(OPEN_MARK + text + CLOSE_MARK if run_supervised else text)
            run = []
        run.append(token)
        run_supervised = supervised
    if run:
        text = tokenizer.decode(run, skip_special_tokens=False)
        out.append(OPEN_MARK + text + CLOSE_MARK if run_supervised else text)
    return "".join(out)


def collapse_media_runs(text: str, processor: Any) -> str:
    """A run of one medium's tokens (<|image_pad|> x 64) written once with its count: where the image goes and how
    many tokens it takes."""
    if processor is None:
        return text
    for kind in media.KINDS:
        token = media.media_token(processor, kind)
        if token:
            text = re.sub(f"(?:{re.escape(token)}){{2,}}", lambda m, t=token: f"{t}×{len(m.group()) // len(t)}", text)
    return text


def _preview_head(plan: _Plan, attr: DatasetAttr, count: int) -> tuple[dict[str, list], list[int]]:
    raw = registry.load_raw(attr, plan.cfg.data.dataset_dir, cache_dir=plan.cfg.model.cache_dir)
    plan.check_columns(attr, raw.column_names)
    head = raw.select(range(min(len(raw), max(4 * count, 16))))[:]
    return head, list(range(len(head[raw.column_names[0]])))


def _preview_texts(plan: _Plan, attr: DatasetAttr, count: int) -> list[str]:
    """Up to `count` samples of one dataset, rendered with their supervised spans marked."""
    import datasets

    head, indices = _preview_head(plan, attr, count)
    tok = plan.tokenizer
    if plan.encoder.documents:
        enc = plan.encoder.function(head, indices, tokenizer=tok, attr=attr, settings=plan.settings)
        docs = [ids for ids, s in zip(enc["input_ids"], enc["_status"], strict=True) if s in encode.KEPT]
        pieces = packing.sequential_pieces(
            [len(x) for x in docs], plan.cfg.data.cutoff_len, across_documents=plan.packing
        )
        rows = packing.assemble_batch(
            {"pieces": pieces[:count]},
            source=datasets.Dataset.from_dict({"input_ids": docs}),
            packed=plan.packing,
        )
        return [
            mark_supervised(tok, i, lab) for i, lab in zip(rows["input_ids"], rows["labels"], strict=True)
        ]
    media_kwargs = {"processor": plan.processor, "media_settings": plan.media} if plan.processor is not None else {}
    enc = plan.encoder.function(head, indices, tokenizer=tok, chat=plan.chat, attr=attr, settings=plan.settings,
                                **media_kwargs)
    kept = [i for i, s in enumerate(enc["_status"]) if s in encode.KEPT][:count]

    def marked(prefix: str, i: int) -> str:
        ids = enc[f"{prefix}input_ids"][i]
        labels = enc[f"{prefix}labels"][i] if f"{prefix}labels" in enc else [encode.IGNORE_INDEX] * len(ids)
        text = mark_supervised(tok, ids, labels)  # a prompt row (grpo) has no labels: nothing is marked
        return collapse_media_runs(text, plan.processor)

    return [plan.encoder.show(marked, enc, i) for i in kept]


def preview(cfg: Any, tokenizer: Any, n: int = 3, processor: Any = None) -> list[str]:
    """The first n training samples (before packing) as text, supervised tokens between ⟦ and ⟧.

    A ranking sample shows its chosen and its rejected rendering; a kto sample its tag and rendering; an image
    shows as its run of media tokens with their count (<|image_pad|>×64).
    """
    plan = _Plan(cfg, tokenizer, processor, media_packing="")  # samples before packing
    out: list[str] = []
    for attr in plan.train_attrs + plan.eval_attrs:
        out += _preview_texts(plan, attr, n - len(out))
        if len(out) >= n:
            return out[:n]
    return out
