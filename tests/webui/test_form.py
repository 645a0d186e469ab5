"""The training form is the config schema: every key has a field, and config -> form -> config gives back what a
YAML file says, key for key. Errors land on the field they name."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest
import yaml

from tuneforge.config.loader import build
from tuneforge.config.schema import GROUPS, key_index
from tuneforge.webui import form

# a value other than the default for every kind of key, as a YAML file would write it
SAMPLES = {
    "learning_rate": 3e-4, "num_train_epochs": 2.5, "max_steps": 7, "dataset": ["identity", "alpaca_demo"],
    "lora_target": ["q_proj", "v_proj"], "bf16": True, "disable_gradient_checkpointing": True,
    "finetuning_type": "full", "quantization_bit": 4, "stage": "dpo", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
    "eval_strategy": "steps", "template": "qwen", "output_dir": "saves/x", "max_samples": 100,
}


def test_every_schema_key_is_one_field_with_its_default_and_help():
    specs = form.field_specs()
    assert [s.key for s in specs] == list(key_index())
    by_key = {s.key: s for s in specs}
    assert by_key["bf16"].kind == "bool" and by_key["bf16"].default is False
    assert by_key["finetuning_type"].kind == "choice" and "lora" in by_key["finetuning_type"].choices
    assert by_key["quantization_bit"].choices == ("null", "4", "8") and by_key["quantization_bit"].default == "null"
    assert by_key["learning_rate"].kind == "text" and by_key["learning_rate"].default == "5e-05"
    assert all(s.help for s in specs), [s.key for s in specs if not s.help]


def test_defaults_make_an_empty_config_and_every_key_round_trips():
    values, errors = form.to_form({})
    assert not errors and form.from_form(values) == {}
    values, errors = form.to_form(SAMPLES)
    assert not errors
    back = form.from_form(values)
    assert back == SAMPLES
    assert build(back).to_dict() == build(SAMPLES).to_dict()


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_groups_keys_round_trip_a_non_default_value(group):
    """Every key, one at a time: a value other than its default survives config -> form -> config."""
    specs = {s.key: s for s in form.field_specs()}
    defaults = build({}).to_dict()
    hints = typing.get_type_hints(GROUPS[group])
    for f in fields(GROUPS[group]):
        spec = specs[f.name]
        if spec.kind == "bool":
            value = not defaults[f.name]
        elif spec.kind == "choice":
            others = [c for c in spec.choices if c != spec.default]
            if not others:  # one choice (quantization_method: bnb)
                continue
            value = None if others[0] == "null" else int(others[0]) if others[0].isdigit() else others[0]
        else:
            value = _other_value(f.name, defaults[f.name], hints[f.name])
        values, errors = form.to_form({f.name: value})
        assert not errors, (f.name, errors)
        back = form.from_form(values)
        assert build(back).to_dict()[f.name] == build({f.name: value}).to_dict()[f.name], f.name


def _other_value(key, default, tp):
    """A value of the key's type other than its default."""
    options = [o for o in typing.get_args(tp) if o is not type(None)] or [tp]
    kind = typing.get_origin(options[0]) or options[0]
    if kind is list:
        item = typing.get_args(options[0])[0]
        return [0.25, 0.75] if item is float else [1, 2] if item is int else ["a", "b"]
    if kind is dict:
        return {"k": 1}
    if kind is int:
        return (default or 0) + 3
    if kind is float:
        return (default or 0.0) + 0.25
    return "something" if default != "something" else "else"


def test_a_llamaboard_file_fills_the_form_and_unknown_keys_are_named(tmp_path):
    saved = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "stage": "sft", "do_train": True,
             "finetuning_type": "lora", "lora_rank": 16, "dataset": "identity,alpaca_en_demo", "cutoff_len": 2048,
             "learning_rate": 5e-5, "not_a_key": 1, "lora_alpha": "sixteen", "include_num_input_tokens_seen": True,
             "lora_rnak": 8}
    values, errors = form.to_form(saved)
    assert values["lora_rank"] == "16" and values["dataset"] == "identity,alpaca_en_demo"
    assert values["finetuning_type"] == "lora" and values["do_train"] is True
    # a LlamaFactory key the CLI accepts and ignores is no error; the others carry the CLI's message
    assert set(errors) == {"not_a_key", "lora_alpha", "lora_rnak"} and "'sixteen' is not int" in errors["lora_alpha"]
    assert "did you mean 'lora_rank'" in errors["lora_rnak"]


def test_check_puts_the_validators_message_on_the_key_it_names(tmp_path):
    cfg, errors, general = form.check({"model_name_or_path": "m", "dataset": ["identity"], "output_dir": "o",
                                       "lora_rank": 0})
    assert cfg is None and not general and set(errors) == {"lora_rank"} and "lora_rank must be > 0" in errors["lora_rank"]
    cfg, errors, general = form.check({"model_name_or_path": "m", "dataset": ["identity"], "output_dir": "o",
                                       "learning_rate": "fast"})
    assert cfg is None and "learning_rate" in errors and "expected a number" in errors["learning_rate"]
    (tmp_path / "checkpoint-2").mkdir()  # the CLI's rule: a folder with checkpoints is not overwritten
    cfg, errors, _ = form.check({"model_name_or_path": "m", "dataset": ["identity"], "output_dir": str(tmp_path)})
    assert cfg is None and "output_dir" in str(errors)
    cfg, errors, general = form.check({"model_name_or_path": "m", "dataset": ["identity"], "output_dir": "o"})
    assert cfg is not None and not errors and not general


def test_the_yaml_runs_as_written():
    text = form.to_yaml({"output_dir": "saves/x", "model_name_or_path": "smollm2", "dataset": ["identity"]})
    assert text.splitlines()[0] == "model_name_or_path: smollm2"  # the schema's order
    assert yaml.safe_load(text) == {"model_name_or_path": "smollm2", "dataset": ["identity"], "output_dir": "saves/x"}


def test_load_reads_a_llamafactory_v1_file_as_its_flat_keys(tmp_path):
    path = tmp_path / "v1.yaml"
    path.write_text("model: smollm2-135m-instruct\npeft_config:\n  name: lora\n  r: 16\n"
                    "train_dataset: data/v1_sft_demo.yaml\nmicro_batch_size: 2\n")
    raw = form.read_config(str(path))
    values, errors = form.to_form(raw)
    assert not errors
    assert values["model_name_or_path"] == "smollm2-135m-instruct" and str(values["lora_rank"]) == "16"
    assert str(values["per_device_train_batch_size"]) == "2" and values["finetuning_type"] == "lora"
