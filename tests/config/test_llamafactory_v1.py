"""LlamaFactory v1 config files (nested model / peft_config / dist_config ...): each of its example configs flattens
to the flat keys it means here, or is refused naming the key path, the value and what to do."""

from __future__ import annotations

import pytest
import yaml

from tuneforge.config import from_dict, llamafactory_v1, load
from tuneforge.config.loader import build
from tuneforge.errors import ConfigError

# every field of v1's argument classes (ModelArguments, DataArguments, TrainingArguments, SampleArguments)
V1_FIELDS = (
    "model", "custom_chat_template", "trust_remote_code", "flash_attn", "model_class", "init_config", "peft_config",
    "kernel_config", "quant_config", "train_dataset", "eval_dataset", "output_dir", "micro_batch_size",
    "global_batch_size", "cutoff_len", "learning_rate", "num_train_epochs", "max_steps", "max_grad_norm", "bf16",
    "batching_strategy", "batching_workers", "enable_activation_checkpointing", "dist_config", "dp_size", "cp_size",
    "cp_mode", "mp_replicate_size", "mp_shard_size", "dist_timeout", "optim_config", "lr_scheduler_config", "seed",
    "full_determinism", "resume_from_checkpoint", "save_steps", "save_epochs", "save_ckpt_as_hf",
    "save_total_limit", "logging_steps", "pref_loss", "pref_beta", "pref_ftx", "simpo_gamma", "dpo_label_smoothing",
    "ld_alpha", "sample_backend", "max_new_tokens",
)
# the keys of v1's LoRA and freeze plugin configs (LoraParams, FreezeParams)
V1_PEFT_FIELDS = {
    "lora": ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora", "modules_to_save",
             "adapter_name_or_path", "export_dir", "export_size", "export_hub_model_id", "infer_dtype",
             "export_legacy_format"),
    "freeze": ("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules",
               "cast_trainable_params_to_fp32"),
}

# LlamaFactory's examples/v1 configs (their keys and values), by file name
FSDP2 = {"name": "fsdp2", "dcp_path": None}
LORA = {"name": "lora", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all"}
COMMON = {"model": "Qwen/Qwen3-0.6B", "model_class": "llm", "kernel_config": {"name": "auto"}, "dist_config": FSDP2,
          "train_dataset": "data/v1_sft_demo.yaml", "micro_batch_size": 1, "cutoff_len": 2048,
          "learning_rate": 1.0e-4, "max_steps": 10, "sample_backend": "hf", "max_new_tokens": 128}
EXAMPLES = {
    "train_lora_sft": {**COMMON, "model": "Qwen/Qwen3-4B", "peft_config": LORA, "output_dir": "./outputs/test_lora"},
    "train_lora_sft_rank0": {**COMMON, "model": "Qwen/Qwen3-4B", "peft_config": LORA, "bf16": True,
                             "init_config": {"name": "init_on_rank0"}, "output_dir": "./outputs/test_lora"},
    "train_lora_dpo": {**COMMON, "model": "Qwen/Qwen3-4B", "peft_config": LORA, "learning_rate": 1.0e-5,
                       "train_dataset": "data/v1_dpo_demo.yaml", "output_dir": "./outputs/test_lora"},
    "train_freeze_sft": {**COMMON, "model": "Qwen/Qwen3-4B", "learning_rate": 2.0e-5, "output_dir": "./outputs/f",
                         "peft_config": {"name": "freeze", "freeze_trainable_layers": 2,
                                         "freeze_trainable_modules": "all", "freeze_extra_modules": None}},
    "train_full_fsdp2": {**COMMON, "quant_config": None, "output_dir": "outputs/test_fsdp2"},
    "train_full_deepspeed": {**{k: v for k, v in COMMON.items() if k not in ("sample_backend", "max_new_tokens")},
                             "dist_config": {"name": "deepspeed", "config_file": "examples/deepspeed/ds_z3_config.json"},
                             "output_dir": "outputs/Qwen3-0.6B-deepspeed"},
    "train_full_fsdp2_batching_normal": {**COMMON, "micro_batch_size": 2, "batching_strategy": "normal",
                                         "output_dir": "outputs/test_fsdp2"},
    "train_full_fsdp2_padding_free": {**COMMON, "micro_batch_size": 4, "batching_strategy": "padding_free",
                                      "flash_attn": "flash_attention_2", "output_dir": "outputs/test_fsdp2"},
    "train_multimodal": {**COMMON, "model": "Qwen/Qwen3.5-0.8B", "max_steps": 5,
                         "train_dataset": "data/v1_multimodal_demo.yaml", "output_dir": "outputs/test_multimodal"},
    "quantization": {**COMMON, "peft_config": LORA, "quant_config": {"name": "bnb", "quantization_bit": 4},
                     "output_dir": "outputs/test_quantization"},
    "export_lora": {"model": "Qwen/Qwen3-4B", "peft_config": {
        "name": "lora", "adapter_name_or_path": "./outputs/test_lora", "export_dir": "./merge_lora_model",
        "export_size": 5, "infer_dtype": "auto"}},
}
# what each example means in flat keys (beside the v1 defaults every file gets)
V1_DEFAULTS = {"per_device_train_batch_size": 1, "bf16": True, "logging_steps": 1, "lr_scheduler_type": "constant",
               "weight_decay": 0.01, "save_strategy": "no", "ddp_timeout": 18000, "media_dir": "."}
SFT = {"stage": "sft", "dataset": ["data/v1_sft_demo.yaml"], "cutoff_len": 2048, "max_steps": 10,
       "fsdp": True, "infer_backend": "huggingface", "max_new_tokens": 128, "padding_free": False}
LORA_FLAT = {"finetuning_type": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target": "all"}
EXPECTED = {
    "train_lora_sft": {**SFT, **LORA_FLAT, "model_name_or_path": "Qwen/Qwen3-4B", "learning_rate": 1e-4},
    "train_lora_sft_rank0": {**SFT, **LORA_FLAT, "model_name_or_path": "Qwen/Qwen3-4B"},
    "train_lora_dpo": {**SFT, **LORA_FLAT, "stage": "dpo", "dataset": ["data/v1_dpo_demo.yaml"],
                       "learning_rate": 1e-5},
    "train_freeze_sft": {**SFT, "finetuning_type": "freeze", "freeze_trainable_layers": 2,
                         "freeze_trainable_modules": "all", "freeze_extra_modules": None, "learning_rate": 2e-5},
    "train_full_fsdp2": {**SFT, "finetuning_type": "full", "model_name_or_path": "Qwen/Qwen3-0.6B"},
    "train_full_deepspeed": {"stage": "sft", "finetuning_type": "full", "fsdp": None,
                             "deepspeed": "examples/deepspeed/ds_z3_config.json"},
    "train_full_fsdp2_batching_normal": {**SFT, "per_device_train_batch_size": 2, "padding_free": False},
    "train_full_fsdp2_padding_free": {**SFT, "per_device_train_batch_size": 4, "padding_free": True,
                                      "flash_attn": "fa2"},
    "train_multimodal": {**SFT, "dataset": ["data/v1_multimodal_demo.yaml"], "max_steps": 5},
    "quantization": {**SFT, **LORA_FLAT, "quantization_bit": 4, "quantization_method": "bnb"},
    "export_lora": {"finetuning_type": "lora", "adapter_name_or_path": "./outputs/test_lora",
                    "export_dir": "./merge_lora_model", "export_size": 5, "infer_dtype": "auto", "lora_rank": 8,
                    "lora_alpha": 16},
}
# examples whose settings tuneforge cannot honour: (file, extra keys, the key path and value the error names)
REFUSED = {
    "train_full_fsdp2_dynamic_batching": ({"batching_strategy": "dynamic_batching"}, "'batching_strategy' = "
                                          "'dynamic_batching'"),
    "train_full_fsdp2_dynamic_padding_free": ({"batching_strategy": "dynamic_padding_free"},
                                              "'batching_strategy' = 'dynamic_padding_free'"),
    "train_full_liger_kernel": ({"kernel_config": {"name": "liger_kernel"}}, "'kernel_config.name' = 'liger_kernel'"),
    "train_full_muon": ({"optim_config": {"name": "muon", "wd": 0.1, "momentum": 0.95}}, "'optim_config.name' = 'muon'"),
    "train_full_qwen3_moe_fsdpturbo_ep_fsdp": ({"dist_config": {"name": "fsdpturbo", "ep_size": 16}, "cp_size": 1,
                                                "init_config": {"name": "init_on_meta"}},
                                               "'dist_config.name' = 'fsdpturbo'"),
    "train_full_ulysses_cp": ({"cp_mode": "ring", "cp_size": 2}, "'cp_mode' = 'ring'"),
}


@pytest.fixture
def lf_root(tmp_path, monkeypatch, lf_data_dir):
    """A working folder laid out as LlamaFactory's: its data/ holds the shared demo files (v1 paths start there)."""
    (tmp_path / "data").symlink_to(lf_data_dir)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_v1_argument_has_one_rule():
    rules = llamafactory_v1.documented_rules()
    assert [k for k in V1_FIELDS if k not in rules and f"{k}.name" not in rules] == []
    for name, keys in V1_PEFT_FIELDS.items():
        assert [k for k in keys if f"peft_config.{k}" not in rules] == [], name
    assert all(key in V1_FIELDS for key in llamafactory_v1.TOP.keys() | llamafactory_v1.PLUGINS.keys())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_v1_example_flattens_to_its_flat_keys(name, lf_root):
    flat = llamafactory_v1.flatten(dict(EXAMPLES[name]), f"{name}.yaml")
    want = {**V1_DEFAULTS, **EXPECTED[name]}
    assert {k: flat.get(k) for k in want} == want
    cfg = build(flat, f"{name}.yaml")  # every flat key is one our schema (or LlamaFactory's tables) takes
    assert cfg.method.stage == want.get("stage", "sft")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_v1_settings_without_an_equivalent_are_refused_by_key_path_and_value(name):
    extra, named = REFUSED[name]
    with pytest.raises(ConfigError) as e:
        llamafactory_v1.flatten({**COMMON, **extra}, f"{name}.yaml")
    assert f"{name}.yaml: LlamaFactory v1 key {named} has no equivalent in tuneforge: " in str(e.value)


def test_a_v1_file_loads_with_v1_overrides_and_trains_unsharded_on_one_process(lf_root, monkeypatch):
    for var in ("FORCE_TORCHRUN", "WORLD_SIZE", "LOCAL_RANK", "USE_RAY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    path = lf_root / "train_lora_sft.yaml"
    path.write_text(yaml.safe_dump(EXAMPLES["train_lora_sft"]))
    cfg = load(path, ["peft_config.r=4", "model=smollm2-135m-instruct", "max_steps=3", "stage=sft"],
               for_training=False)
    assert (cfg.method.lora_rank, cfg.method.lora_alpha, cfg.model.model_name_or_path) == (4, 32,
                                                                                             "smollm2-135m-instruct")
    assert cfg.train.max_steps == 3 and cfg.train.fsdp is None


def test_the_stage_follows_the_data_and_a_flat_stage_wins(lf_root):
    dpo = {**EXAMPLES["train_lora_dpo"]}
    assert llamafactory_v1.flatten(dpo, "f")["stage"] == "dpo"
    assert llamafactory_v1.flatten({**dpo, "stage": "rm"}, "f")["stage"] == "rm"
    assert llamafactory_v1.flatten({**dpo, "train_dataset": "data/v1_dpo_demo.jsonl"}, "f")["stage"] == "dpo"
    assert llamafactory_v1.flatten({**dpo, "model_class": "cls"}, "f")["stage"] == "rm"
    assert llamafactory_v1.flatten({**dpo, "train_dataset": "data/v1_sft_demo.jsonl"}, "f")["stage"] == "sft"


def test_v1_defaults_that_differ_from_ours_and_key_clashes():
    flat = llamafactory_v1.flatten({"model": "m", "save_epochs": 1, "enable_activation_checkpointing": False,
                                    "resume_from_checkpoint": "auto", "dist_timeout": 60}, "f")
    assert (flat["save_strategy"], flat["disable_gradient_checkpointing"], flat["resume_from_checkpoint"],
            flat["ddp_timeout"], flat["finetuning_type"], flat["learning_rate"]) == ("epoch", True, True, 60, "full",
                                                                                      1e-4)
    assert flat["output_dir"].startswith("outputs/") and len(flat["output_dir"]) == len("outputs/") + 32
    with pytest.raises(ConfigError, match="'model_name_or_path' is set twice"):
        llamafactory_v1.flatten({"model": "a", "model_name_or_path": "b"}, "f")
    with pytest.raises(ConfigError, match=r"unknown LlamaFactory v1 key 'peft_config\.rank' for peft_config name lora"):
        llamafactory_v1.flatten({"model": "a", "peft_config": {"name": "lora", "rank": 8}}, "f")
    with pytest.raises(ConfigError, match="'global_batch_size' = 64 .* set gradient_accumulation_steps"):
        llamafactory_v1.flatten({"model": "a", "global_batch_size": 64}, "f")
    # a v1 key at its v1 default is accepted even where tuneforge has no equivalent
    assert "cp_size" not in llamafactory_v1.flatten({"model": "a", "cp_size": 1, "dp_size": None,
                                                     "save_ckpt_as_hf": False}, "f")


def test_v1_context_parallelism_is_sequence_parallel_size():
    flat = llamafactory_v1.flatten({"model": "a", "cp_mode": "ulysses", "cp_size": 2}, "f")
    assert flat["sequence_parallel_size"] == 2 and "cp_mode" not in flat
    # LlamaFactory's own example: Ulysses under FSDP2 with v1's default (padded) batching
    with pytest.raises(ConfigError, match="sequence_parallel_size 2: it splits padding-free rows"):
        from_dict(llamafactory_v1.flatten({"model": "a", "cp_size": 2, "dist_config": FSDP2}, "f"), for_training=False)
    with pytest.raises(ConfigError, match="sequence_parallel_size 2: .* not yet with deepspeed or fsdp"):
        from_dict(llamafactory_v1.flatten({"model": "a", "cp_size": 2, "dist_config": FSDP2,
                                           "batching_strategy": "padding_free"}, "f"), for_training=False)


def test_no_llamafactory_v0_key_makes_a_file_look_like_v1():
    import json
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "llamafactory_keys.json"
    v0_keys = json.loads(fixture.read_text())["keys"]
    assert sorted(set(v0_keys) & llamafactory_v1.V1_MARKERS) == []
    assert not llamafactory_v1.is_v1({"model_name_or_path": "m", "dataset": "identity", "cutoff_len": 64})
