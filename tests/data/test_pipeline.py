"""build(): cache hits and misses, tokenized_path, mixing, eval splits, sample limits, stats and preview."""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import pytest

from tuneforge.data import DataSplits, build, preview
from tuneforge.errors import DataError


@pytest.fixture
def two_datasets(tmp_path, write_dataset, alpaca_rows):
    root = tmp_path / "d"
    write_dataset(root, "small", alpaca_rows(4, "A"))
    write_dataset(root, "large", alpaca_rows(8, "B"))
    return root


def origins(tokenizer, ds):
    """'A' or 'B' for each row: which dataset its question came from."""
    return ["A" if "A question" in tokenizer.decode(ids) else "B" for ids in ds["input_ids"]]


def test_cache_hit_then_miss_after_the_data_changes(
    tokenizer, home, two_datasets, make_cfg, alpaca_rows, write_dataset
):
    cfg = make_cfg(two_datasets, dataset="small")
    first = build(cfg, tokenizer)
    assert isinstance(first, DataSplits) and first.stats["cache_hit"] is False
    second = build(cfg, tokenizer)
    assert second.stats["cache_hit"] is True and second.stats["cache_dir"] == first.stats["cache_dir"]
    assert second.train["input_ids"][:] == first.train["input_ids"][:]
    assert str(home / "datasets") in first.stats["cache_dir"]
    write_dataset(two_datasets, "small", alpaca_rows(5, "A"))  # a file's contents change
    third = build(cfg, tokenizer)
    assert third.stats["cache_hit"] is False and len(third.train) == 5
    assert (
        build(make_cfg(two_datasets, dataset="small", cutoff_len=512), tokenizer).stats["cache_hit"] is False
    )
    rebuilt = build(make_cfg(two_datasets, dataset="small", overwrite_cache=True), tokenizer)
    assert rebuilt.stats["cache_hit"] is False and len(rebuilt.train) == 5
    leftovers = [p.name for p in (home / "datasets").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # temporary folders were renamed or removed


def test_tokenized_path_round_trip(tokenizer, home, two_datasets, make_cfg, tmp_path):
    target = tmp_path / "tokenized"
    cfg = make_cfg(two_datasets, dataset="small,large", tokenized_path=str(target), val_size=2)
    made = build(cfg, tokenizer)
    assert (target / "train").is_dir() and (target / "eval").is_dir() and (target / "stats.json").is_file()
    saved = datasets.load_from_disk(str(target))
    assert saved["train"]["input_ids"][:] == made.train["input_ids"][:]
    # a later run loads the folder, even without dataset names
    again = build(make_cfg(two_datasets, tokenized_path=str(target)), tokenizer)
    assert again.stats["cache_hit"] is True and again.stats["train_samples"] == 10
    assert again.eval["input_ids"][:] == made.eval["input_ids"][:]


def test_mix_strategies(tokenizer, home, two_datasets, make_cfg):
    concat = build(make_cfg(two_datasets, dataset="small,large"), tokenizer)
    assert origins(tokenizer, concat.train) == ["A"] * 4 + ["B"] * 8
    under = build(make_cfg(two_datasets, dataset="small,large", mix_strategy="interleave_under"), tokenizer)
    assert origins(tokenizer, under.train) == ["A", "B"] * 4  # alternates, stops when the small one ends
    over = build(make_cfg(two_datasets, dataset="small,large", mix_strategy="interleave_over"), tokenizer)
    assert origins(tokenizer, over.train) == ["A", "B"] * 8  # alternates until the large one ends too
    keys = {"dataset": "small,large", "mix_strategy": "interleave_under", "interleave_probs": [0.2, 0.8]}
    weighted = build(make_cfg(two_datasets, **keys), tokenizer)
    again = build(make_cfg(two_datasets, overwrite_cache=True, **keys), tokenizer)
    assert origins(tokenizer, weighted.train) == origins(tokenizer, again.train)  # seeded
    assert origins(tokenizer, weighted.train).count("B") > origins(tokenizer, weighted.train).count("A")


def test_val_size_share_count_and_eval_dataset(tokenizer, home, two_datasets, make_cfg):
    share = build(make_cfg(two_datasets, dataset="small,large", val_size=0.25), tokenizer)
    assert (len(share.train), len(share.eval)) == (9, 3)
    count = build(make_cfg(two_datasets, dataset="small,large", val_size=5), tokenizer)
    assert (len(count.train), len(count.eval)) == (7, 5)
    held_out = {tuple(r) for r in count.eval["input_ids"]}
    assert not held_out & {tuple(r) for r in count.train["input_ids"]}
    other_seed = build(make_cfg(two_datasets, dataset="small,large", val_size=5, seed=7), tokenizer)
    assert {tuple(r) for r in other_seed.eval["input_ids"]} != held_out
    named = build(make_cfg(two_datasets, dataset="large", eval_dataset="small"), tokenizer)
    assert (len(named.train), len(named.eval)) == (8, 4)
    assert origins(tokenizer, named.eval) == ["A"] * 4
    with pytest.raises(DataError, match="val_size 12 holds out every one of the 12 samples"):
        build(make_cfg(two_datasets, dataset="small,large", val_size=12), tokenizer)


def test_max_samples_and_num_samples(tokenizer, home, two_datasets, make_cfg, write_dataset, alpaca_rows):
    limited = build(make_cfg(two_datasets, dataset="small,large", max_samples=3), tokenizer)
    assert origins(tokenizer, limited.train) == ["A"] * 3 + ["B"] * 3
    assert limited.stats["datasets"]["large"]["rows"] == 3
    write_dataset(two_datasets, "repeated", alpaca_rows(3, "A"), {"num_samples": 7})
    repeated = build(make_cfg(two_datasets, dataset="repeated"), tokenizer)
    texts = [tokenizer.decode(r) for r in repeated.train["input_ids"]]
    assert len(texts) == 7 and all(sum(f"A question {i}" in t for t in texts) >= 2 for i in range(3))


def test_stats_count_tokens(tokenizer, home, two_datasets, make_cfg):
    stats = build(make_cfg(two_datasets, dataset="small,large", packing=True, val_size=2), tokenizer).stats
    for key in (
        "rows_read",
        "bad_rows",
        "dropped_by_truncation",
        "samples",
        "tokens",
        "supervised_tokens",
        "packed_rows",
        "cache_hit",
        "train_samples",
        "eval_samples",
        "eval_tokens",
    ):
        assert key in stats, key
    assert (stats["rows_read"], stats["samples"], stats["eval_samples"]) == (12, 10, 2)
    assert stats["packed_rows"] == 1  # ten short samples fit in one 1024-token row
    # each sample supervises "answer number i." + <|im_end|>: "answer", " number", " ", "i", ".", <|im_end|>
    assert stats["supervised_tokens"] == 10 * 6


def test_preview_marks_supervised_spans(tokenizer, home, two_datasets, make_cfg):
    rows = preview(make_cfg(two_datasets, dataset="small"), tokenizer, n=2)
    assert len(rows) == 2
    assert rows[0].endswith(
        "<|im_start|>user\nA question 0<|im_end|>\n<|im_start|>assistant\n⟦answer number 0.<|im_end|>⟧\n"
    )
    pt_rows = preview(make_cfg(two_datasets, dataset="small", stage="pt", cutoff_len=5), tokenizer, n=3)
    # "A", " question", " ", "0", <|im_end|>: one document per 5-token row; its first token is not predicted
    assert pt_rows == [f"A⟦ question {i}<|im_end|>⟧" for i in range(3)]


def test_no_dataset_is_an_error(tokenizer, home, two_datasets, make_cfg):
    with pytest.raises(DataError, match="no dataset to build"):
        build(make_cfg(two_datasets), tokenizer)


def test_workers_and_batch_size_do_not_change_the_result(tokenizer, home, two_datasets, make_cfg):
    keys = {"dataset": "small,large", "packing": True, "cutoff_len": 64}
    one = build(make_cfg(two_datasets, **keys), tokenizer)
    two = build(
        make_cfg(
            two_datasets,
            overwrite_cache=True,
            preprocessing_num_workers=2,
            preprocessing_batch_size=3,
            **keys,
        ),
        tokenizer,
    )
    assert two.stats["cache_hit"] is False
    assert [dict(r) for r in two.train] == [dict(r) for r in one.train]


def test_neat_packing_packs_and_empty_tokenized_folder_is_filled(
    tokenizer, home, two_datasets, make_cfg, tmp_path
):
    target = tmp_path / "made-by-user"
    target.mkdir()
    splits = build(
        make_cfg(two_datasets, dataset="small", neat_packing=True, tokenized_path=str(target)), tokenizer
    )
    assert splits.stats["packed_rows"] == len(splits.train) == 1
    assert "position_ids" in splits.train.column_names
    assert datasets.load_from_disk(str(target))["train"].num_rows == 1


def test_interleave_over_with_a_zero_share_is_refused(tokenizer, home, two_datasets, make_cfg):
    with pytest.raises(DataError, match="interleave_over with an interleave_probs value of 0 never ends"):
        build(
            make_cfg(
                two_datasets,
                dataset="small,large",
                mix_strategy="interleave_over",
                interleave_probs=[0.0, 1.0],
            ),
            tokenizer,
        )


def test_tokenizing_processes_are_capped_at_the_cores(monkeypatch):
    from tuneforge.data.pipeline import worker_count

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert worker_count(16) == 2  # LlamaFactory's examples ask for 16
    assert worker_count(2) == 2 and worker_count(1) is None and worker_count(None) is None
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert worker_count(16) is None  # one core: in this process


def test_unset_workers_are_one_process_per_2000_rows_at_most_one_per_core(monkeypatch):
    from tuneforge.data.pipeline import worker_count

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert worker_count(None, 3_999) is None  # one process: this one
    assert worker_count(None, 4_000) == 2 and worker_count(None, 6_000) == 3
    assert worker_count(None, 1_000_000) == 4
    assert worker_count(1, 1_000_000) is None and worker_count(3, 10) == 3  # a setting wins


def test_a_build_leaves_only_the_source_data_in_datasets_cache(tokenizer, home, two_datasets, make_cfg):
    # the rows are kept in tuneforge's cache: each step's files go to a scratch folder removed after the build
    from tuneforge.data import registry

    cfg = make_cfg(two_datasets, dataset="small,large", packing=True, cutoff_len=64, val_size=2,
                   preprocessing_num_workers=2)
    built = build(cfg, tokenizer)
    assert built.stats["cache_hit"] is False and len(built.eval) == 2
    for attr in registry.get_dataset_attrs(cfg.data.dataset, cfg.data.dataset_dir):
        folder = Path(registry.load_raw(attr, cfg.data.dataset_dir).cache_files[0]["filename"]).parent
        assert sorted(p.name for p in folder.glob("cache-*")) == []
    assert [p.name for p in (home / "datasets").iterdir() if p.name.startswith(".")] == []


def test_a_killed_builds_scratch_folder_goes_with_the_next_build(tokenizer, home, two_datasets, make_cfg):
    entry = Path(build(make_cfg(two_datasets, dataset="small"), tokenizer).stats["cache_dir"])
    stale = entry.parent / f".{entry.name}.scratch.partial-999999999-x"  # a PID no process has
    stale.mkdir()
    build(make_cfg(two_datasets, dataset="small", overwrite_cache=True), tokenizer)
    assert not stale.exists()


def test_more_processes_after_a_run_in_one_still_share_the_rows(
    tokenizer, home, two_datasets, make_cfg, monkeypatch, tmp_path
):
    # datasets splits a map into as many shards as an earlier map with the same fingerprint left cache files
    from tuneforge.data import template

    pids, real = tmp_path / "pids", template.tokenize_rendered

    def noted(tokenizer, texts):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(tokenizer, texts)

    monkeypatch.setattr(template, "tokenize_rendered", noted)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    keys = {"dataset": "large", "preprocessing_batch_size": 2}
    build(make_cfg(two_datasets, preprocessing_num_workers=1, **keys), tokenizer)
    assert len(set(pids.read_text().split())) == 1
    pids.unlink()
    build(make_cfg(two_datasets, preprocessing_num_workers=2, overwrite_cache=True, **keys), tokenizer)
    assert len(set(pids.read_text().split())) == 2


def test_unset_workers_split_a_large_dataset_with_the_same_result(
    tokenizer, home, two_datasets, make_cfg, monkeypatch, caplog
):
    keys = {"dataset": "small,large", "packing": True, "cutoff_len": 64}
    one = build(make_cfg(two_datasets, preprocessing_num_workers=1, **keys), tokenizer)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("tuneforge.data.pipeline.AUTO_ROWS_PER_WORKER", 4)
    with caplog.at_level("INFO", logger="tuneforge.data.pipeline"):
        auto = build(make_cfg(two_datasets, overwrite_cache=True, **keys), tokenizer)
    assert auto.stats["cache_hit"] is False
    assert [dict(r) for r in auto.train] == [dict(r) for r in one.train]
    said = [r.getMessage() for r in caplog.records if "preprocessing_num_workers unset" in r.getMessage()]
    # small (4 rows) is encoded here; large (8 rows) and the 12 samples to pack in two processes
    assert said == ["encoding large: 8 rows in 2 processes (preprocessing_num_workers unset: one per 4 rows, at most "
                    "one per core)",
                    "packing train: 12 rows in 2 processes (preprocessing_num_workers unset: one per 4 rows, at most "
                    "one per core)"]
