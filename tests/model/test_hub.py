"""hub.resolve / resolve_adapter: local folders, the built-in alias, hub ids offline, and the errors a user sees."""

from __future__ import annotations

import json

import pytest

from tuneforge.errors import ModelError
from tuneforge.model.hub import BUILTIN_ALIASES, resolve, resolve_adapter


def test_local_folder_resolves_to_itself(tiny_model_dir):
    assert resolve(str(tiny_model_dir)) == tiny_model_dir


@pytest.mark.parametrize("alias", sorted(BUILTIN_ALIASES) + ["SmolLM2-135M-Instruct"])
def test_builtin_aliases_resolve_to_the_converted_folder(alias, smol_dir, monkeypatch):
    monkeypatch.setenv("TUNEFORGE_HOME", str(smol_dir.parents[1]))  # the cache smol_dir was converted into
    assert resolve(alias) == smol_dir
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=r"has no config\.json; point model_name_or_path at a model folder"):
        resolve(str(tmp_path))


def test_offline_hub_id_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as info:
        resolve("nobody-tuneforge/not-a-model", cache_dir=str(tmp_path))
    message = str(info.value)
    assert "'nobody-tuneforge/not-a-model'" in message
    assert "offline (HF_HUB_OFFLINE=1)" in message and "Download it first" in message


@pytest.mark.parametrize("name", ["./no/such/folder", "a/b/c", "/definitely/not/here"])
def test_neither_folder_nor_hub_id(name):
    with pytest.raises(ModelError, match="neither a local folder nor a hub id"):
        resolve(name)


def test_adapter_folder_without_adapter_config(tiny_model_dir):
    with pytest.raises(ModelError, match=r"has no adapter_config\.json; point adapter_name_or_path"):
        resolve_adapter(str(tiny_model_dir))


def test_adapter_missing_path():
    with pytest.raises(ModelError, match="adapter './missing-adapter' is neither a local folder"):
        resolve_adapter("./missing-adapter")


def test_adapter_offline_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="cannot get adapter 'nobody-tuneforge/no-adapter'"):
        resolve_adapter("nobody-tuneforge/no-adapter", cache_dir=str(tmp_path))


def test_adapter_folder_resolves(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    assert resolve_adapter(str(tmp_path)) == tmp_path
