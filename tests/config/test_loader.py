"""Config loading: files, overrides, type coercion, LlamaFactory keys, and the errors users see."""

import json

import pytest

from tuneforge.config import from_dict, load
from tuneforge.config.loader import parse_overrides
from tuneforge.errors import ConfigError

BASE = {"model_name_or_path": "m", "dataset": "identity", "output_dir": "out"}


def test_yaml_file_and_overrides_with_types(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "model_name_or_path: m\nstage: sft\nfinetuning_type: lora\nlora_target: q_proj,v_proj\n"
        "dataset: identity, alpaca_en_demo\nlearning_rate: 1.0e-4\noutput_dir: " + str(tmp_path / "o") + "\n"
    )
    cfg = load(path, ["learning_rate=5e-5", "max_steps=10", "bf16=true", "lora_rank=16"])
    assert cfg.train.learning_rate == pytest.approx(5e-5)  # PyYAML reads 5e-5 as a string: coerced
    assert cfg.train.max_steps == 10 and cfg.train.bf16 is True
    assert cfg.method.lora_rank == 16 and cfg.method.lora_target == ["q_proj", "v_proj"]
    assert cfg.data.dataset == ["identity", "alpaca_en_demo"]
    assert cfg.source == str(path)


def test_yaml_no_is_the_strategy_no(tmp_path):
    """YAML 1.1 reads `eval_strategy: no` as False; LlamaFactory files write it that way."""
    path = tmp_path / "cfg.yaml"
    path.write_text(f"model_name_or_path: m\ndataset: d\noutput_dir: {tmp_path / 'o'}\neval_strategy: no\n"
                    "save_strategy: no\n")
    cfg = load(path, ["eval_strategy=no"])
    assert (cfg.train.eval_strategy, cfg.train.save_strategy) == ("no", "no")


def test_json_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**BASE, "output_dir": str(tmp_path / "o"), "cutoff_len": 256}))
    assert load(path).data.cutoff_len == 256


def test_override_syntax():
    assert parse_overrides(["a=1", "--b=true", "c=x,y", "d="]) == {"a": 1, "b": True, "c": "x,y", "d": None}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["learning_rate"])


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'learnig_rate' — did you mean 'learning_rate'"):
        from_dict({**BASE, "learnig_rate": 1e-4})


def test_llamafactory_keys_that_change_nothing_are_accepted(tmp_path):
    cfg = from_dict({**BASE, "output_dir": str(tmp_path), "ddp_timeout": 180000000, "dataloader_num_workers": 4,
                     "save_only_model": True, "use_cpu": True, "report_to": "none", "do_train": True})
    assert cfg.train.report_to == ["none"]


def test_llamafactory_key_not_supported_yet_is_an_error():
    with pytest.raises(ConfigError, match="LlamaFactory key 'use_kt' is not supported by tuneforge yet"):
        from_dict({**BASE, "use_kt": True})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("lora_rank", "eight", "key 'lora_rank': expected an integer, got 'eight'"),
        ("learning_rate", "fast", "key 'learning_rate': expected a number"),
        ("bf16", "maybe", "key 'bf16': expected true or false"),
        ("finetuning_type", "qlora", "key 'finetuning_type': 'qlora' is not one of full, freeze, lora, oft"),
        ("lr_scheduler_type", "cosin", "is not one of linear, cosine"),
        ("quantization_bit", 3, "'quantization_bit': 3 is not one of null, 4, 8"),
    ],
)
def test_wrong_type_or_value_names_key_and_accepted(key, value, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as err:
        from_dict({**BASE, "output_dir": str(tmp_path), key: value}, source="cfg.yaml")
    assert str(err.value).startswith("cfg.yaml: ")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load(listy)


def test_llamafactory_example_file_loads_unchanged(tmp_path):
    """LlamaFactory's examples/train_lora/llama3_lora_sft.yaml, keys and values as they ship."""
    text = f"""
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: {tmp_path}/saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""
    path = tmp_path / "llama3_lora_sft.yaml"
    path.write_text(text)
    cfg = load(path)
    assert cfg.model.template == "llama3" and cfg.train.gradient_accumulation_steps == 8
    assert cfg.data.preprocessing_num_workers == 16 and cfg.train.resume_from_checkpoint is None
    assert cfg.to_dict()["lora_target"] == ["all"]
