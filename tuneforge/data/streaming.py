"""Streaming datasets (`streaming: true`): the training rows are read, shuffled in a buffer of `buffer_size` rows,
tokenized and packed while the run goes, for corpora that do not fit on disk or in memory once tokenized. Nothing
of the training data is cached; the evaluation data is built and cached as usual.

Each process reads its own share of every dataset (datasets' split_dataset_by_node: rows rank, rank + world, ...,
or whole files when a dataset has several), tokenizes it with the stage's encoder in batches of
preprocessing_batch_size, mixes the datasets (mix_strategy) and shuffles with a buffer seeded by data_seed / seed
and the pass over the data; packing (pt, or packing: true) bins each batch of samples into rows, so a row never
mixes two batches. When the data runs out before max_steps, the next pass starts, shuffled anew.

`StreamedRows` is the trainer's view: as many rows as max_steps consumes, row i built when it is asked for (in
order). A resumed run replays its stream up to the checkpoint's row — the same rows in the same order, read and
tokenized again but not trained on — so it continues at the exact sample.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

from tuneforge.data import encode, packing, registry
from tuneforge.errors import DataError

logger = logging.getLogger(__name__)


def _raw_stream(plan: Any, attr: Any, rank: int, world: int) -> Any:
    """One dataset's rows for this process, read lazily from its files."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    d = plan.cfg.data
    if attr.load_from != "file":
        raise DataError(f"dataset '{attr.name}': streaming reads local files (file_name); {attr.source} is not one")
    files = registry.local_files(attr, d.dataset_dir)
    builder = registry.file_type(attr, files)
    try:
        stream = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", streaming=True)
        first = next(iter(stream), None)
    except Exception as e:  # datasets raises many kinds for a malformed file
        raise DataError(f"dataset '{attr.name}': cannot read {', '.join(map(str, files))} as {builder}: {e}") from None
    if first is None:
        raise DataError(f"dataset '{attr.name}' ({attr.source}) has no rows")
    plan.check_columns(attr, list(first))  # on the first row: a stream has no column list
    limit = attr.num_samples or d.max_samples
    if limit:
        stream = stream.take(limit)
    return split_dataset_by_node(stream, rank=rank, world_size=world), list(first)


def _encoded_stream(plan: Any, attr: Any, rank: int, world: int) -> Any:
    """One dataset's samples for this process: its rows through the stage's encoder, the usable ones kept."""
    raw, columns = _raw_stream(plan, attr, rank, world)
    fn_kwargs = {"tokenizer": plan.tokenizer, "attr": attr, "settings": plan.settings, "row_numbers": None}
    if plan.chat is not None:
        fn_kwargs["chat"] = plan.chat
    encoded = raw.map(plan.encoder.function, batched=True, with_indices=True, batch_size=plan.cfg.data.preprocessing_batch_size,
                      remove_columns=columns, fn_kwargs=fn_kwargs, features=plan.encoder.features())
    return encoded.filter(lambda status: [s in encode.KEPT for s in status], input_columns="_status", batched=True
                          ).remove_columns("_status")


def sample_stream(plan: Any, rank: int, world: int, epoch: int) -> Any:
    """This process's samples for one pass over the data: mixed, then shuffled in the buffer."""
    import datasets

    d, t = plan.cfg.data, plan.cfg.train
    seed = t.seed if t.data_seed is None else t.data_seed
    parts = [_encoded_stream(plan, attr, rank, world) for attr in plan.train_attrs]
    if len(parts) == 1:
        mixed = parts[0]
    elif d.mix_strategy == "concat":
        mixed = datasets.concatenate_datasets(parts)
    else:
        stopping = "first_exhausted" if d.mix_strategy == "interleave_under" else "all_exhausted"
        mixed = datasets.interleave_datasets(parts, probabilities=d.interleave_probs, seed=seed,
                                             stopping_strategy=stopping)
    if t.disable_shuffling:
        return mixed
    shuffled = mixed.shuffle(seed=seed, buffer_size=d.buffer_size)
    shuffled.set_epoch(epoch)
    return shuffled


def row_stream(plan: Any, rank: int, world: int, epoch: int) -> Iterator[dict[str, Any]]:
    """This process's training rows for one pass: the samples as they are, or packed batch by batch."""
    import datasets

    d = plan.cfg.data
    samples = iter(sample_stream(plan, rank, world, epoch))
    if not (plan.packing or plan.encoder.documents):
        yield from samples
        return
    while window := list(itertools.islice(samples, d.preprocessing_batch_size)):
        lengths = [len(s["input_ids"]) for s in window]
        if plan.encoder.documents:
            pieces = packing.sequential_pieces(lengths, d.cutoff_len, across_documents=plan.packing)
        else:
            pieces = packing.bins_to_pieces(packing.first_fit_decreasing(lengths, d.cutoff_len), lengths)
        rows = packing.assemble_batch({"pieces": pieces}, source=datasets.Dataset.from_list(window),
                                      packed=plan.packing)
        for i in range(len(rows["input_ids"])):
            yield {k: v[i] for k, v in rows.items()}


def process_place() -> tuple[int, int]:
    """(rank, world size) of this process (0, 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StreamedRows:
    """The training rows of a streamed run, as the trainer reads them (len() and row i, asked in increasing order
    on each process: rows rank, rank + world, ... of each global micro-batch)."""

    streamed = True

    def __init__(self, plan: Any, total_rows: int) -> None:
        self.plan, self.total_rows = plan, total_rows
        self.rank = self.world = None
        self.rows: Iterator[dict[str, Any]] | None = None
        self.epoch = self.position = 0  # the pass over the data, and the next local row's number
        self.pass_start = 0  # the local row this pass started at
        self.current: tuple[int, dict[str, Any]] | None = None

    def __len__(self) -> int:
        return self.total_rows

    def _start(self) -> None:
        self.rank, self.world = process_place()
        self.rows = row_stream(self.plan, self.rank, self.world, self.epoch)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.rows is None:
            self._start()
        local = index // self.world
        if self.current is not None and self.current[0] == local:
            return self.current[1]
        if local < self.position:
            raise IndexError(f"streamed rows are read in order: row {index} was asked after a later one")
        while self.position <= local:
            row = next(self.rows, None)
            if row is None:  # the data ran out before max_steps: the next pass, shuffled anew
                if self.position == self.pass_start:
                    raise DataError(f"the streamed training data holds no usable rows for process {self.rank}; check "
                                    f"dataset, max_samples and cutoff_len")
                self.epoch, self.pass_start = self.epoch + 1, self.position
                logger.info("streaming: pass %d over the training data", self.epoch + 1)
                self.rows = row_stream(self.plan, self.rank, self.world, self.epoch)
                continue
            self.current = (self.position, row)
            self.position += 1
        return self.current[1]
