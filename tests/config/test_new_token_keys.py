"""The new-token keys load with LlamaFactory's names and meanings, and a config that cannot work stops before
anything loads, naming the key."""

from __future__ import annotations

import json

import pytest

from tuneforge.config import from_dict
from tuneforge.config.new_tokens import requested_tokens
from tuneforge.errors import ConfigError


def cfg(**keys):
    return from_dict({"model_name_or_path": "m", **keys}, for_training=False)


def test_comma_separated_tokens_and_the_older_name():
    m = cfg(add_tokens="<a>, <b>", new_special_tokens="<|x|>,<|y|>").model
    assert m.add_tokens == ["<a>", "<b>"] and m.add_special_tokens == ["<|x|>", "<|y|>"]
    assert m.init_special_tokens == "noise_init" and m.resize_vocab is False
    assert requested_tokens(m).plain == ("<a>", "<b>") and requested_tokens(m).special == ("<|x|>", "<|y|>")


@pytest.mark.parametrize("kind", ["yaml", "json", "inline", "inline-json"])
def test_descriptions_from_a_file_or_inline(tmp_path, kind):
    described = {"<think>": "the start of the reasoning", "</think>": "its end"}
    if kind == "yaml":
        (tmp_path / "t.yaml").write_text("<think>: the start of the reasoning\n</think>: its end\n")
        value = str(tmp_path / "t.yaml")
    elif kind == "json":
        (tmp_path / "t.json").write_text(json.dumps(described))
        value = str(tmp_path / "t.json")
    else:
        value = described if kind == "inline" else json.dumps(described)
    tokens = requested_tokens(cfg(new_special_tokens_config=value, init_special_tokens="desc_init_w_noise").model)
    assert tokens.special == ("<think>", "</think>") and tokens.descriptions == described


@pytest.mark.parametrize(("keys", "message", "key"), [
    ({"new_special_tokens_config": "nowhere.yaml"}, "new_special_tokens_config: nowhere.yaml is not a file",
     "new_special_tokens_config"),
    ({"new_special_tokens_config": {"<a>": ["not", "text"]}}, r"'<a>': \['not', 'text'\] is not a token and a "
     "description", "new_special_tokens_config"),
    ({"init_special_tokens": "mean_init"}, "'mean_init' is not one of noise_init, desc_init, desc_init_w_noise",
     "init_special_tokens"),
    ({"add_special_tokens": "<a>", "init_special_tokens": "desc_init"},
     "init_special_tokens desc_init starts each new special token from its description: set "
     "new_special_tokens_config", "init_special_tokens"),
    ({"add_tokens": "<a>", "add_special_tokens": "<a>"}, "<a> is in add_tokens and in the special tokens",
     "add_tokens"),
    ({"add_tokens": ["<a>", "<a>"]}, "add_tokens: <a> is listed more than once", "add_tokens"),
    ({"add_tokens": ["<a>", " "]}, "add_tokens: a token is empty", "add_tokens"),
    ({"add_special_tokens": "<a>", "quantization_bit": 4, "finetuning_type": "lora"},
     "grow the embeddings, which a 4-bit base cannot take", "quantization_bit"),
])
def test_configs_that_cannot_work_name_the_key(keys, message, key):
    if "quantization_bit" in keys:
        pytest.importorskip("bitsandbytes")
    with pytest.raises(ConfigError, match=message) as e:
        cfg(**keys)
    assert e.value.key == key


def test_a_descriptions_file_that_is_not_a_mapping(tmp_path):
    (tmp_path / "t.yaml").write_text("- <think>\n- </think>\n")
    with pytest.raises(ConfigError, match=r"t.yaml must map each new special token to its description.*got list"):
        cfg(new_special_tokens_config=str(tmp_path / "t.yaml"))
