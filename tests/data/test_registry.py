"""dataset_info.json: LlamaFactory's own file parses and its local datasets load; file types; clear errors."""

from __future__ import annotations

import json

import pytest

from tuneforge.data import build, registry
from tuneforge.errors import DataError


def lf_entries(lf_data_dir):
    return registry.read_dataset_info(lf_data_dir)


def test_every_llamafactory_entry_parses(lf_data_dir):
    info = lf_entries(lf_data_dir)
    attrs = {name: registry.parse_entry(name, entry) for name, entry in info.items()}
    assert len(attrs) == len(info) > 100
    glaive = attrs["glaive_toolcall_en_demo"]
    assert (glaive.load_from, glaive.formatting) == ("file", "sharegpt")
    assert (glaive.column("messages"), glaive.column("tools")) == ("conversations", "tools")
    assert glaive.tags["role_tag"] == "from" and glaive.tags["function_tag"] == "function_call"
    wiki = attrs[
        "wiki_demo"
    ]  # with "columns" given, the unnamed alpaca columns are unused (as in LlamaFactory)
    assert (wiki.column("prompt"), wiki.column("query"), wiki.column("response")) == ("text", None, None)
    alpaca = attrs["alpaca_en_demo"]  # without "columns": instruction / input / output
    assert (alpaca.column("prompt"), alpaca.column("query"), alpaca.column("response")) == (
        "instruction",
        "input",
        "output",
    )
    assert attrs["dpo_en_demo"].kind == "pairwise" and attrs["kto_en_demo"].kind == "feedback"
    assert attrs["mllm_video_audio_demo"].media_columns == ["videos", "audios"]
    assert (attrs["alpaca_en"].load_from, attrs["alpaca_en"].source) == ("hf_hub", "llamafactory/alpaca_en")
    assert attrs["deepctrl"].load_from == "ms_hub"
    assert (attrs["ultrachat_200k"].split, attrs["ultrachat_200k"].tags["observation_tag"]) == (
        "train_sft",
        None,
    )
    assert (attrs["llava_1k_en"].subset, attrs["starcoder_python"].folder) == ("en", "python")


def local_text_datasets(lf_data_dir):
    """Every local, text-only, plain dataset in LlamaFactory's file, with the stage it is meant for."""
    out = []
    for name, entry in lf_entries(lf_data_dir).items():
        attr = registry.parse_entry(name, entry)
        if attr.load_from == "file" and attr.kind == "plain" and not attr.media_columns:
            is_text = attr.formatting == "alpaca" and not attr.column("response")
            out.append((name, "pt" if is_text else "sft"))
    return out


def test_local_llamafactory_datasets_load_and_encode(tokenizer, home, lf_data_dir, make_cfg):
    found = local_text_datasets(lf_data_dir)
    expected = {
        "identity",
        "alpaca_en_demo",
        "alpaca_zh_demo",
        "glaive_toolcall_en_demo",
        "glaive_toolcall_zh_demo",
        "wiki_demo",
        "c4_demo",
    }
    assert expected <= {name for name, _ in found}
    for name, stage in found:
        cfg = make_cfg(lf_data_dir, dataset=name, stage=stage, max_samples=12, cutoff_len=512)
        splits = build(cfg, tokenizer)
        entry = splits.stats["datasets"][name]
        assert entry["rows"] == 12 and entry["bad_rows"] == 0 and entry["samples"] == 12, name
        assert splits.stats["supervised_tokens"] > 0 and len(splits.train) > 0


@pytest.mark.parametrize("name", ["mllm_demo", "mllm_audio_demo", "mllm_video_demo", "mllm_video_audio_demo"])
def test_media_datasets_need_a_model_that_reads_media(tokenizer, home, lf_data_dir, make_cfg, name):
    with pytest.raises(DataError, match=rf"dataset '{name}' holds .* but the model is text-only"):
        build(make_cfg(lf_data_dir, dataset=name), tokenizer)


def test_unknown_name_lists_close_names(lf_data_dir):
    with pytest.raises(
        DataError,
        match=r"dataset 'alpaca_en_dem' is not in .*dataset_info.json; did you mean "
        r"'alpaca_en_demo'",
    ):
        registry.get_dataset_attrs(["alpaca_en_dem"], lf_data_dir)


def test_missing_dataset_info_and_file(tmp_path, tokenizer, home, make_cfg):
    with pytest.raises(DataError, match=rf"{tmp_path}/dataset_info.json does not exist; set dataset_dir"):
        registry.get_dataset_attrs(["x"], tmp_path)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"x": {"file_name": "gone.json"}}))
    with pytest.raises(DataError, match=rf"dataset 'x': {tmp_path}/gone.json does not exist"):
        build(make_cfg(tmp_path, dataset="x"), tokenizer)
    (tmp_path / "dataset_info.json").write_text("{not json")
    with pytest.raises(DataError, match="dataset_info.json is not valid JSON"):
        registry.get_dataset_attrs(["x"], tmp_path)


def test_hub_datasets_offline_and_other_hubs(lf_data_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (attr,) = registry.get_dataset_attrs(["alpaca_en"], lf_data_dir)
    with pytest.raises(
        DataError,
        match=r"dataset 'alpaca_en' comes from the hub \(llamafactory/alpaca_en\) and is "
        r"not available offline",
    ):
        registry.load_raw(attr, lf_data_dir)
    (attr,) = registry.get_dataset_attrs(["deepctrl"], lf_data_dir)
    with pytest.raises(DataError, match="only on the ModelScope hub"):
        registry.load_raw(attr, lf_data_dir)


def test_entry_errors():
    with pytest.raises(DataError, match="formatting 'chatty'; use one of alpaca, sharegpt, openai"):
        registry.parse_entry("x", {"file_name": "x.json", "formatting": "chatty"})
    with pytest.raises(DataError, match="has none of file_name, hf_hub_url"):
        registry.parse_entry("x", {"columns": {}})
    openai = registry.parse_entry("o", {"file_name": "o.json", "formatting": "openai"})
    assert openai.column("messages") == "messages" and openai.tags["role_tag"] == "role"
    assert openai.tags["observation_tag"] == "tool"


ROWS = [{"instruction": "q0", "output": "a0"}, {"instruction": "q1", "output": "a1"}]


def write_as(path, kind):
    import datasets
    import pyarrow as pa

    ds = datasets.Dataset.from_list(ROWS)
    if kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "jsonl":
        ds.to_json(str(path), lines=True)
    elif kind == "csv":
        ds.to_csv(str(path), index=False)
    elif kind == "parquet":
        ds.to_parquet(str(path))
    elif kind == "arrow":
        table = pa.Table.from_pylist(ROWS)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)


@pytest.mark.parametrize("kind", ["json", "jsonl", "csv", "parquet", "arrow"])
def test_file_types(tmp_path, kind):
    write_as(tmp_path / f"rows.{kind}", kind)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"r": {"file_name": f"rows.{kind}"}}))
    (attr,) = registry.get_dataset_attrs(["r"], tmp_path)
    assert registry.load_raw(attr, tmp_path).to_list() == ROWS


def test_txt_and_folder_of_files(tmp_path):
    (tmp_path / "docs.txt").write_text("first document\nsecond document\n")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.json").write_text(json.dumps(ROWS[:1]))
    (tmp_path / "parts" / "b.json").write_text(json.dumps(ROWS[1:]))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.json").write_text("[]")
    (tmp_path / "mixed" / "b.csv").write_text("x\n")
    (tmp_path / "dataset_info.json").write_text(
        json.dumps(
            {
                "docs": {"file_name": "docs.txt", "columns": {"prompt": "text"}},
                "parts": {"file_name": "parts"},
                "mixed": {"file_name": "mixed"},
            }
        )
    )
    docs, parts, mixed = registry.get_dataset_attrs(["docs", "parts", "mixed"], tmp_path)
    assert registry.load_raw(docs, tmp_path)["text"][:] == ["first document", "second document"]
    assert registry.load_raw(parts, tmp_path).to_list() == ROWS
    with pytest.raises(DataError, match="the folder mixes file types"):
        registry.load_raw(mixed, tmp_path)
