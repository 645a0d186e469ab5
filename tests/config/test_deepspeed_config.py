"""deepspeed: a DeepSpeed JSON config (LlamaFactory's, with "auto" fields) -> the config the engine gets, and the
combinations refused before any process starts."""

import json

import pytest

from tuneforge.config import from_dict
from tuneforge.config.deepspeed import deepspeed_settings, filled_config
from tuneforge.errors import ConfigError

pytest.importorskip("deepspeed")

# the keys and "auto" fields of LlamaFactory's examples/deepspeed/ds_z3_config.json (written for HF's Trainer)
LLAMAFACTORY_Z3 = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "comms_config": {"verbose": False},
    "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
}


def cfg(tmp_path, **kw):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **kw})


def write(tmp_path, config, name="ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def test_llamafactory_config_gets_our_values_for_its_auto_fields(tmp_path):
    c = cfg(tmp_path, deepspeed=write(tmp_path, LLAMAFACTORY_Z3), per_device_train_batch_size=3,
            gradient_accumulation_steps=5, max_grad_norm=0.5, bf16=True)
    settings = deepspeed_settings(c)
    assert (settings.stage, settings.offload_optimizer, settings.offload_param) == (3, False, False)
    ds = filled_config(settings, c, hidden_size=64, world_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640
    assert zero["stage3_max_live_parameters"] == 1e9  # what the file gives stays
    assert ds["monitor_config"] == LLAMAFACTORY_Z3["monitor_config"]
    assert "auto" not in json.dumps(ds)
    assert json.loads(open(c.train.deepspeed).read()) == LLAMAFACTORY_Z3  # the user's file is not touched


def test_a_mapping_works_as_the_file_does_and_missing_keys_come_from_our_config(tmp_path):
    c = cfg(tmp_path, deepspeed={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            per_device_train_batch_size=2)
    settings = deepspeed_settings(c)
    assert (settings.stage, settings.offload_optimizer) == (2, True)
    ds = filled_config(settings, c, hidden_size=None, world_size=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (2, 2 * 1 * 2)  # ga 1 (the default)
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"]["enabled"] is False
    assert ds["zero_force_ds_cpu_optimizer"] is False  # tuneforge's torch optimizer steps the offloaded states


def test_numbers_that_agree_with_our_config_are_accepted(tmp_path):
    c = cfg(tmp_path, deepspeed={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                 "train_batch_size": 16, "zero_optimization": {"stage": 1}},
            per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert filled_config(deepspeed_settings(c), c, 32, world_size=2)["train_batch_size"] == 16
    with pytest.raises(ConfigError, match=r"train_batch_size 16, but per_device_train_batch_size 2 x "
                                          r"gradient_accumulation_steps 4 x 3 processes is 24"):
        filled_config(deepspeed_settings(c), c, 32, world_size=3)


@pytest.mark.parametrize(
    ("deepspeed", "kw", "message"),
    [
        ("missing.json", {}, r"deepspeed: missing.json is not a file"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, {},
         r"has a 'optimizer' section; tuneforge builds the optimizer from its own keys \(optim, learning_rate"),
        ({"scheduler": {"type": "WarmupLR"}}, {}, r"has a 'scheduler' section; .*lr_scheduler_type"),
        ({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, {},
         r"sets zero_optimization.sub_group_size to \"auto\", which tuneforge cannot fill"),
        ({"zero_optimization": {"stage": 4}}, {}, r"zero_optimization.stage must be 0, 1, 2 or 3 \(got 4\)"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, {}, r"offload to nvme"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, {},
         r"offload_param needs zero_optimization.stage 3"),
        ({"train_micro_batch_size_per_gpu": 8}, {"per_device_train_batch_size": 2},
         r"train_micro_batch_size_per_gpu is 8 but per_device_train_batch_size is 2"),
        ({"bf16": {"enabled": True}}, {"bf16": False}, r"bf16.enabled is True but bf16 is False"),
        ({"zero_optimization": {"stage": 2}}, {"fsdp": "full_shard"}, r"deepspeed and fsdp .* choose one"),
        ({"zero_optimization": {"stage": 3}}, {"finetuning_type": "lora", "quantization_bit": 4},
         r"ZeRO-3 partitions the weights.*for QLoRA use zero_optimization.stage 2"),
        ({"zero_optimization": {"stage": 3}}, {"finetuning_type": "lora", "pissa_init": True},
         r"ZeRO-3 with pissa_init is not supported"),
    ],
)
def test_configs_that_cannot_work_are_refused_before_any_process_starts(tmp_path, monkeypatch, deepspeed, kw, message):
    monkeypatch.chdir(tmp_path)
    if kw.get("quantization_bit"):
        pytest.importorskip("bitsandbytes")
    with pytest.raises(ConfigError, match=message):
        cfg(tmp_path, deepspeed=deepspeed, **kw)


def test_a_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{stage: 3")
    with pytest.raises(ConfigError, match=rf"deepspeed: {path} is not valid JSON"):
        cfg(tmp_path, deepspeed=str(path))


def test_a_checkpoint_resumes_under_the_strategy_that_wrote_it(tmp_path):
    written_by_deepspeed = tmp_path / "out" / "checkpoint-2"
    (written_by_deepspeed / "deepspeed").mkdir(parents=True)
    (written_by_deepspeed / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"checkpoint-2 was written with deepspeed; resume it with the same"):
        cfg(tmp_path, resume_from_checkpoint=True)
    plain = tmp_path / "plain" / "checkpoint-1"
    plain.mkdir(parents=True)
    (plain / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"checkpoint-1 was written without deepspeed; resume it without"):
        cfg(tmp_path, resume_from_checkpoint=str(plain), deepspeed={"zero_optimization": {"stage": 2}})
    cfg(tmp_path, resume_from_checkpoint=True, deepspeed={"zero_optimization": {"stage": 2}})  # the same kind


def test_chat_and_export_of_a_deepspeed_run_do_not_need_deepspeed(tmp_path, monkeypatch):
    import tuneforge.config.deepspeed as ds
    from tuneforge.config import load

    path = tmp_path / "cfg.yaml"
    path.write_text(f"model_name_or_path: m\ndataset: d\noutput_dir: {tmp_path / 'out'}\ndeepspeed: gone.json\n")
    monkeypatch.setattr(ds.importlib.util, "find_spec", lambda name: None)
    load(path, for_training=False)  # the key is kept, nothing is read
    with pytest.raises(ConfigError, match=r"deepspeed: gone.json is not a file"):
        load(path)
