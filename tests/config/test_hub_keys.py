"""The hub keys: transformers' / LlamaFactory's names (older ones too) and the repository names, checked when the
file loads (the hub itself is checked when a run starts: tests/test_hub_upload.py)."""

from __future__ import annotations

import pytest

from tuneforge.config import from_dict
from tuneforge.errors import ConfigError

BASE = {"model_name_or_path": "m", "dataset": "d"}


def test_older_transformers_names_map_to_the_hub_keys(tmp_path):
    cfg = from_dict({**BASE, "output_dir": str(tmp_path / "out"), "push_to_hub": True,
                     "push_to_hub_model_id": "me/model", "push_to_hub_token": "hf_x"})
    assert (cfg.hub.hub_model_id, cfg.hub.hub_token) == ("me/model", "hf_x")
    assert cfg.hub.hub_strategy == "every_save" and cfg.hub.hub_private_repo is None  # transformers' defaults


@pytest.mark.parametrize(("keys", "message", "key"), [
    ({"push_to_hub": True, "hub_model_id": "me/bad name"}, "hub_model_id: 'me/bad name' is not a hub repository name",
     "hub_model_id"),
    ({"push_to_hub": True, "output_dir": "runs/my..run"}, r"hub_model_id: 'my..run' is not a hub repository name "
                                                          r"\(output_dir's name: set hub_model_id\)", "hub_model_id"),
    ({"export_hub_model_id": "a/b/c"}, "export_hub_model_id: 'a/b/c' is not a hub repository name",
     "export_hub_model_id"),
    ({"hub_strategy": "sometimes"}, "'sometimes' is not one of end, every_save, checkpoint, all_checkpoints",
     "hub_strategy"),
])
def test_hub_settings_that_cannot_work(tmp_path, keys, message, key):
    raw = {**BASE, "output_dir": str(tmp_path / "out"), **keys}
    with pytest.raises(ConfigError, match=message) as e:
        from_dict(raw)
    assert e.value.key == key


def test_a_repository_name_is_not_needed_without_push_to_hub(tmp_path):
    from_dict({**BASE, "output_dir": str(tmp_path / "my..run")})  # never uploaded: its name does not matter
