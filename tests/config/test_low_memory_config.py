"""The memory-efficient optimizer keys and pure_bf16: LlamaFactory's names and defaults load, and every combination
that cannot work is refused when the config loads, naming its keys (before any model loads)."""

import pytest

from tuneforge.config import from_dict
from tuneforge.errors import ConfigError

FULL = {"finetuning_type": "full"}
LAYERWISE = {"gradient_accumulation_steps": 1, "max_grad_norm": 0}


def cfg(tmp_path, **kw):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **kw})


def test_llamafactory_files_load_with_their_keys(tmp_path):
    c = cfg(tmp_path, **FULL, use_galore=True, galore_layerwise=True, galore_target="q_proj,v_proj",
            galore_rank=128, galore_scale=2.0, pure_bf16=True, **LAYERWISE)
    assert c.memory.galore_target == ["q_proj", "v_proj"] and c.memory.galore_rank == 128 and c.train.pure_bf16
    c = cfg(tmp_path, **FULL, use_badam=True, badam_mode="layer", badam_switch_mode="ascending",
            badam_switch_interval=50, badam_verbose=2, gradient_accumulation_steps=8)
    assert c.memory.use_badam and c.memory.badam_switch_interval == 50
    c = cfg(tmp_path, **FULL, use_apollo=True, apollo_scale_type="tensor", apollo_proj="svd")
    assert (c.memory.apollo_rank, c.memory.apollo_scale, c.memory.apollo_update_interval) == (16, 32.0, 200)


@pytest.mark.parametrize(("kw", "message", "keys"), [
    ({**FULL, "use_galore": True, "use_badam": True}, "use_galore and use_badam are each an optimizer; choose one",
     ("use_galore", "use_badam")),
    ({**FULL, "use_muon": True, "use_adam_mini": True}, "choose one", ("use_adam_mini", "use_muon")),
    ({"use_galore": True}, "needs finetuning_type full or freeze, not lora", ("use_galore", "finetuning_type")),
    ({"finetuning_type": "freeze", "use_badam": True}, "needs finetuning_type full", ("use_badam", "finetuning_type")),
    ({**FULL, "use_apollo": True, "optim": "adamw_8bit"}, "builds on optim adamw_torch, not adamw_8bit",
     ("use_apollo", "optim")),
    ({**FULL, "use_muon": True, "optim": "sgd"}, "builds on optim adamw_torch, not sgd", ("use_muon", "optim")),
    ({**FULL, "use_galore": True, "optim": "sgd"}, "adamw_torch / adamw_8bit / adamw_bnb_8bit", ("use_galore", "optim")),
    ({**FULL, "use_badam": True, "badam_mode": "ratio"}, "badam_mode ratio is not supported yet.*use badam_mode: "
     "layer", ("badam_mode",)),
    ({**FULL, "use_galore": True, "galore_rank": 0}, "galore_rank must be >= 1", ("galore_rank",)),
    ({**FULL, "use_apollo": True, "apollo_update_interval": 0}, "apollo_update_interval must be >= 1",
     ("apollo_update_interval",)),
    ({**FULL, "use_badam": True, "badam_switch_interval": 0}, "badam_switch_interval must be >= 1, or -1",
     ("badam_switch_interval",)),
    ({**FULL, "use_badam": True, "badam_update_ratio": 0}, r"badam_update_ratio must be in \(0, 1\]",
     ("badam_update_ratio",)),
    ({**FULL, "use_galore": True, "galore_layerwise": True, "max_grad_norm": 0, "gradient_accumulation_steps": 4},
     "gradients cannot accumulate: set gradient_accumulation_steps: 1", ("galore_layerwise",
                                                                         "gradient_accumulation_steps")),
    ({**FULL, "use_apollo": True, "apollo_layerwise": True, "gradient_accumulation_steps": 1},
     "it cannot be clipped: set max_grad_norm: 0", ("apollo_layerwise", "max_grad_norm")),
    ({**FULL, "use_galore": True, "galore_layerwise": True, "fp16": True, **LAYERWISE},
     "fp16's loss scale", ("galore_layerwise", "fp16")),
    ({**FULL, "use_adam_mini": True, "deepspeed": {"zero_optimization": {"stage": 2}}}, "which deepspeed shards",
     ("use_adam_mini", "deepspeed")),
    ({**FULL, "use_badam": True, "fp16": True}, "use bf16 or pure_bf16", ("use_badam", "fp16")),
    ({"pure_bf16": True, "fp16": True}, "pure_bf16 and fp16 are both true", ("pure_bf16", "fp16")),
    ({"pure_bf16": True, "deepspeed": {"zero_optimization": {"stage": 3}}}, "DeepSpeed keeps its own fp32 master",
     ("pure_bf16", "deepspeed")),
])
def test_combinations_that_cannot_work_are_refused(tmp_path, kw, message, keys):
    with pytest.raises(ConfigError, match=message) as raised:
        cfg(tmp_path, **kw)
    assert raised.value.keys == keys


@pytest.mark.parametrize("key", ["use_galore", "use_badam"])
def test_several_processes_are_refused_for_what_runs_on_one(tmp_path, monkeypatch, key):
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    extra = {"galore_layerwise": True, **LAYERWISE} if key == "use_galore" else {}
    with pytest.raises(ConfigError, match="train on one process"):
        cfg(tmp_path, **FULL, **{key: True}, **extra)
    if key == "use_galore":  # not layer-wise: DDP steps the averaged gradients; FSDP's shards cannot be projected
        cfg(tmp_path, **FULL, use_galore=True)
        with pytest.raises(ConfigError, match="which fsdp shards") as raised:
            cfg(tmp_path, **FULL, use_galore=True, fsdp="full_shard")
        assert raised.value.keys == ("use_galore", "fsdp")


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "badam" else real(name, *a))
    with pytest.raises(ConfigError, match=r"use_badam needs the badam package: pip install 'tuneforge\[low-memory\]'"):
        cfg(tmp_path, **FULL, use_badam=True)


def test_chat_and_export_do_not_check_training_only_keys(tmp_path):
    from tuneforge.config.validate import validate

    c = cfg(tmp_path, **FULL)
    c.memory.use_galore, c.method.finetuning_type = True, "lora"
    validate(c, for_training=False)  # the key belongs to training; export of a lora run still works


@pytest.mark.parametrize(("name", "key"), [("galore_full_sft", "use_galore"), ("badam_full_sft", "use_badam"),
                                           ("muon_full_sft", "use_muon")])
def test_the_examples_load(name, key):
    from pathlib import Path

    from tuneforge.config import load

    c = load(Path(__file__).parents[2] / "examples" / f"{name}.yaml")
    assert getattr(c.memory, key) and c.method.finetuning_type == "full"
