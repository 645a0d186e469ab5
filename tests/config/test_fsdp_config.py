"""fsdp / fsdp_config (Hugging Face's keys) -> FsdpSettings, and the combinations refused before any process starts."""

import json

import pytest

from tuneforge.config import from_dict
from tuneforge.config.fsdp import FsdpSettings, fsdp_settings
from tuneforge.config.processes import planned_processes
from tuneforge.errors import ConfigError

TWO = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}


@pytest.fixture
def two_processes(monkeypatch):
    for key, value in TWO.items():
        monkeypatch.setenv(key, value)


def cfg(tmp_path, **kw):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **kw})


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, None),
        ({"fsdp": False}, None),
        ({"fsdp": True}, FsdpSettings()),
        ({"fsdp": "full_shard auto_wrap"}, FsdpSettings()),
        ({"fsdp": "shard_grad_op"}, FsdpSettings(reshard_after_forward=False)),
        ({"fsdp": ["full_shard", "offload"]}, FsdpSettings(cpu_offload=True)),
        ({"fsdp": "hybrid_shard"}, FsdpSettings(hybrid=True)),
        ({"fsdp": "hybrid_shard_zero2"}, FsdpSettings(hybrid=True, reshard_after_forward=False)),
        # Hugging Face's FSDP2 keys, with accelerate's fsdp_ prefix too; the FSDP1-only knobs change nothing
        ({"fsdp": True, "fsdp_config": {"fsdp_reshard_after_forward": "false", "cpu_offload": True, "version": 2,
                                        "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                        "backward_prefetch": "BACKWARD_PRE", "activation_checkpointing": True}},
         FsdpSettings(reshard_after_forward=False, cpu_offload=True, layer_classes=("LlamaDecoderLayer",))),
        ({"fsdp": True, "fsdp_config": {"auto_wrap_policy": "NO_WRAP"}}, FsdpSettings(wrap_layers=False)),
    ],
)
def test_fsdp_keys_become_settings(tmp_path, two_processes, kw, expected):
    assert fsdp_settings(cfg(tmp_path, **kw)) == expected


def test_fsdp_config_may_be_a_json_file(tmp_path, two_processes):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_transformer_layer_cls_to_wrap": ["A", "B"], "fsdp_offload_params": True}))
    settings = fsdp_settings(cfg(tmp_path, fsdp="full_shard", fsdp_config=str(path)))
    assert settings == FsdpSettings(cpu_offload=True, layer_classes=("A", "B"))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"fsdp": "no_shard"}, "no_shard keeps a full copy .* that is DDP"),
        ({"fsdp": "full_shard shard_grad_op"}, "choose one sharding strategy, not full_shard and shard_grad_op"),
        ({"fsdp": "zero3"}, "'zero3' is not one of full_shard, shard_grad_op"),
        ({"fsdp_config": {"reshard_after_forward": True}}, "fsdp_config is set but fsdp is not"),
        ({"fsdp": True, "fsdp_config": {"version": 1}}, "version 1: tuneforge runs FSDP2"),
        ({"fsdp": True, "fsdp_config": {"reshard_after_foward": True}}, "unknown key 'reshard_after_foward'"),
        ({"fsdp": True, "fsdp_config": {"reshard_after_forward": "maybe"}}, "reshard_after_forward must be true or false"),
        ({"fsdp": True, "fsdp_config": {"min_num_params": 1000}}, "min_num_params .* not supported"),
        ({"fsdp": True, "fsdp_config": {"auto_wrap_policy": "SIZE_BASED_WRAP"}}, "auto_wrap_policy 'SIZE_BASED_WRAP'"),
        ({"fsdp": True, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}}, "fsdp checkpoints are always sharded"),
        ({"fsdp": True, "fsdp_config": {"cpu_ram_efficient_loading": True}}, "cpu_ram_efficient_loading is not"),
        ({"fsdp": True, "fsdp_config": "missing.json"}, "missing.json is neither a mapping nor a file"),
        ({"fsdp": True, "fsdp_config": {"activation_checkpointing": False}}, "set disable_gradient_checkpointing"),
        ({"fsdp": True, "fp16": True}, "fsdp with fp16 .* use bf16"),
        ({"fsdp": True, "quantization_bit": 8}, "quantization_bit 8.*use quantization_bit: 4"),
        ({"fsdp": True, "pissa_init": True}, "fsdp with pissa_init is not supported"),
    ],
)
def test_combinations_refused_before_any_process_starts(tmp_path, two_processes, kw, message):
    with pytest.raises(ConfigError, match=message):
        cfg(tmp_path, **kw)


def test_fsdp_needs_several_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    monkeypatch.setenv("NPROC_PER_NODE", "1")
    with pytest.raises(ConfigError, match="this run starts one; start several .*or set fsdp: false"):
        cfg(tmp_path, fsdp="full_shard")
    assert cfg(tmp_path, fsdp=True, use_ray=True, ray_num_workers=2).train.fsdp is True  # Ray's workers
    with pytest.raises(ConfigError, match="or ray_num_workers: 2 with Ray"):
        cfg(tmp_path, fsdp=True, use_ray=True, ray_num_workers=1)
    # export / chat / eval read the same file in one process
    assert from_dict({"model_name_or_path": "m", "fsdp": True}, for_training=False).train.fsdp is True


def test_planned_processes_follows_the_launch_variables(tmp_path):
    c = cfg(tmp_path)
    assert planned_processes(c, {"LOCAL_RANK": "0", "WORLD_SIZE": "4"}) == 4
    assert planned_processes(c, {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "NNODES": "3"}) == 6
    assert planned_processes(c, {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "two"}) is None  # launch names that error
    assert planned_processes(c, {"USE_RAY": "1", "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}) == 1  # Ray's workers


def test_a_checkpoint_resumes_under_the_strategy_that_wrote_it(tmp_path, two_processes):
    sharded = tmp_path / "a" / "checkpoint-2"
    (sharded / "sharded").mkdir(parents=True)
    (sharded / "trainer_state.json").write_text("{}")
    whole = tmp_path / "b" / "checkpoint-2"
    whole.mkdir(parents=True)
    (whole / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match="sharded checkpoint of an fsdp run; resume it with the same fsdp"):
        cfg(tmp_path, resume_from_checkpoint=str(sharded))
    with pytest.raises(ConfigError, match="written without fsdp; resume it without fsdp"):
        cfg(tmp_path, fsdp=True, resume_from_checkpoint=str(whole))
    with pytest.raises(ConfigError, match="sharded checkpoint of an fsdp run"):
        from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "a"),
                   "resume_from_checkpoint": True})
    assert cfg(tmp_path, fsdp=True, resume_from_checkpoint=str(sharded)).train.fsdp is True
