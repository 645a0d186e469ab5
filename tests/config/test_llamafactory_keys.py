"""Every key a LlamaFactory config may carry (its argument classes and the Hugging Face training arguments they
inherit, tests/fixtures/llamafactory_keys.json) is ours, accepted and ignored, or not supported yet — never unknown —
and a file that spells out LlamaFactory's defaults loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneforge.config import llamafactory
from tuneforge.config.loader import build, parse_overrides
from tuneforge.config.schema import key_index
from tuneforge.errors import ConfigError

KEYS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "llamafactory_keys.json").read_text())["keys"]


def test_every_llamafactory_key_is_in_exactly_one_place():
    places = {"schema": set(key_index()), "ignored": set(llamafactory.IGNORED), "not_yet": set(llamafactory.NOT_YET)}
    for key in KEYS:
        found = [name for name, keys in places.items() if key in keys]
        assert len(found) == 1, (key, found)
    assert not places["ignored"] & places["not_yet"] and not (places["ignored"] | places["not_yet"]) & places["schema"]


def test_a_file_spelling_out_every_llamafactory_default_loads():
    build(dict(KEYS))


@pytest.mark.parametrize("key", sorted(llamafactory.NOT_YET))
def test_a_key_not_supported_yet_is_accepted_at_its_default_and_refused_otherwise(key):
    default = llamafactory.NOT_YET[key]
    build({key: default})
    written = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
    build(parse_overrides([f"{key}={written}"]))  # as an override writes it
    other = (not default if isinstance(default, bool) else "something" if default is None or isinstance(default, str)
             else default + 7 if isinstance(default, (int, float)) else ["x"])
    with pytest.raises(ConfigError, match=rf"'{key}' is not supported by tuneforge yet .*only its default") as e:
        build({key: other})
    assert e.value.key == key


def test_null_for_a_key_that_takes_no_null_means_its_default():
    cfg = build({"disable_tqdm": None, "lr_scheduler_kwargs": None, "learning_rate": None})
    assert cfg.train.disable_tqdm is False and cfg.train.lr_scheduler_kwargs == {} and cfg.train.learning_rate == 5e-5


def test_older_names_map_to_their_current_keys():
    cfg = build({"evaluation_strategy": "steps", "dpo_beta": 0.25, "per_gpu_train_batch_size": 3})
    assert cfg.train.eval_strategy == "steps" and cfg.method.pref_beta == 0.25
    assert cfg.train.per_device_train_batch_size == 3
    assert build({"evaluation_strategy": "steps", "eval_strategy": "steps"}).train.eval_strategy == "steps"
    with pytest.raises(ConfigError, match="'evaluation_strategy' is the older name of 'eval_strategy'"):
        build({"evaluation_strategy": "steps", "eval_strategy": "epoch"})
    places = set(key_index()) | set(llamafactory.IGNORED) | set(llamafactory.NOT_YET)
    assert not (set(llamafactory.RENAMED) | set(llamafactory.REPLACED)) & places
    assert set(llamafactory.RENAMED.values()) <= places  # each points at a key that exists


def test_older_keys_without_a_successor_say_what_replaced_them():
    build({"image_resolution": None, "no_cuda": False, "dispatch_batches": None})  # at their old defaults
    with pytest.raises(ConfigError, match="image_resolution.*set image_max_pixels") as e:
        build({"image_resolution": 512})
    assert e.value.key == "image_resolution"
    with pytest.raises(ConfigError, match="max_source_length.*set cutoff_len"):
        build({"max_source_length": 1024})


def test_allow_extra_args_lets_unknown_keys_through_with_a_warning(monkeypatch, caplog):
    with pytest.raises(ConfigError, match="unknown key 'my_own_key'"):
        build({"my_own_key": 1})
    monkeypatch.setenv("ALLOW_EXTRA_ARGS", "1")
    build({"my_own_key": 1})
    assert "unknown key 'my_own_key' ignored (ALLOW_EXTRA_ARGS is set)" in caplog.text
    with pytest.raises(ConfigError, match="not supported by tuneforge yet"):  # a key that would change the result
        build({"train_from_scratch": True})


def test_a_key_tuneforge_cannot_honour_is_named_before_an_unknown_one():
    # LlamaFactory's Megatron examples: the Megatron-Core keys are named as such, not as unknown
    with pytest.raises(ConfigError, match="'tensor_model_parallel_size' is not supported by tuneforge yet"):
        build({"my_extra": 1, "tensor_model_parallel_size": 4})
    with pytest.raises(ConfigError, match="unknown key 'my_extra'"):
        build({"my_extra": 1, "tensor_model_parallel_size": 1})
