"""optim, optim_args, lr_scheduler_type / lr_scheduler_kwargs and label_smoothing_factor: transformers' names all
known, each refused one with its reason, bad arguments refused when the config loads, naming the key."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from tuneforge.config import from_dict
from tuneforge.config.optimizers import OPTIMIZERS, REFUSED
from tuneforge.config.schedules import SCHEDULES
from tuneforge.errors import ConfigError


def cfg(tmp_path, **kw):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **kw})


def test_every_transformers_optimizer_name_is_built_or_refused():
    from transformers.training_args import OptimizerNames

    names = {o.value for o in OptimizerNames}
    assert names == set(OPTIMIZERS) | set(REFUSED)
    assert not set(OPTIMIZERS) & set(REFUSED)


def test_the_schedule_table_is_transformers_own():
    """Every SchedulerType, each with exactly the keyword arguments its function (or class) in transformers takes."""
    import torch
    from transformers import SchedulerType
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, GreedyLR

    assert [s.value for s in SchedulerType] == list(SCHEDULES)
    given = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}
    for kind, function in TYPE_TO_SCHEDULER_FUNCTION.items():
        target = {"reduce_lr_on_plateau": torch.optim.lr_scheduler.ReduceLROnPlateau, "greedy": GreedyLR}.get(
            kind.value, function)
        takes = set(inspect.signature(target).parameters) - given
        assert set(SCHEDULES[kind.value].kwargs) == takes, kind.value


@pytest.mark.parametrize(("name", "reason"), [
    ("galore_adamw_8bit", "use_galore: true with optim: adamw_8bit"),
    ("apollo_adamw_layerwise", "use_apollo: true, apollo_layerwise: true with optim: adamw_torch"),
    ("lomo", "not supported by tuneforge yet"),
    ("schedule_free_adamw", "not supported by tuneforge yet (schedule-free"),
    ("adamw_torch_xla", "is for TPUs"),
    ("adamw_anyprecision", "torchdistx"),
])
def test_refused_optimizers_say_why(tmp_path, name, reason):
    with pytest.raises(ConfigError, match=rf"optim {name} .*{reason.replace('(', '[(]')}") as raised:
        cfg(tmp_path, optim=name)
    assert raised.value.keys == ("optim",)


@pytest.mark.parametrize(("kw", "message"), [
    ({"optim": "sgd", "optim_args": "momentum"}, r"'momentum' is not key=value"),
    ({"optim": "sgd", "optim_args": "momentun=0.9"}, r"sgd does not read 'momentun' \(it reads: momentum, dampening"),
    ({"optim": "adamw_torch", "optim_args": "amsgrad=true"}, r"adamw_torch does not read 'amsgrad' \(it reads: none"),
    ({"optim": "sgd", "optim_args": "weight_decay=0.1"}, "weight_decay is its own key"),
    ({"optim": "sgd", "optim_args": "nesterov=maybe"}, "nesterov=maybe is not true or false"),
    ({"optim": "ademamix", "optim_args": "t_alpha=1.5"}, "t_alpha=1.5 is not a whole number"),
    ({"optim": "rmsprop_bnb", "optim_args": "centered=true"}, "rmsprop_bnb does not read 'centered'"),
    ({"optim": "adamw_torch_8bit", "optim_args": "block_size=0"}, "block_size must be >= 1"),
])
def test_bad_optim_args_are_refused_when_the_config_loads(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message) as raised:
        cfg(tmp_path, **kw)
    assert raised.value.keys[0] == "optim_args"


def test_greedy_cannot_drive_torchaos_tensor_learning_rate(tmp_path):
    with pytest.raises(ConfigError, match="greedy cannot drive optim adamw_torch_4bit") as raised:
        cfg(tmp_path, optim="adamw_torch_4bit", lr_scheduler_type="greedy", eval_strategy="steps", val_size=0.1)
    assert raised.value.keys == ("lr_scheduler_type", "optim")


def test_optim_args_in_transformers_format_load(tmp_path):
    assert cfg(tmp_path, optim="sgd", optim_args="momentum=0.9, nesterov=True").train.optim_args
    assert cfg(tmp_path, optim="ademamix_8bit", optim_args="beta3=0.999,alpha=8,t_alpha=100")


@pytest.mark.parametrize(("name", "package"), [("paged_adamw_8bit", "bitsandbytes"), ("adamw_torch_4bit", "torchao")])
def test_an_optimizer_whose_package_is_missing_says_what_to_install(tmp_path, monkeypatch, name, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a))
    with pytest.raises(ConfigError, match=rf"optim {name} needs {package}: pip install 'tuneforge\[optim\]'"):
        cfg(tmp_path, optim=name)


@pytest.mark.parametrize(("kw", "message", "keys"), [
    ({"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2, "lr_end": 1e-3}, "learning_rate": 1e-4},
     "lr_end 0.001 must be >= 0 and below learning_rate", ("lr_scheduler_kwargs", "learning_rate")),
    ({"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"num_cycles": 1.5}},
     "num_cycles: 1.5 is not a whole number", ("lr_scheduler_kwargs",)),
    ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"decay_type": "exp"}},
     "decay_type: 'exp' is not one of linear, cosine, 1-sqrt", ("lr_scheduler_kwargs",)),
    ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 90}, "max_steps": 100,
      "warmup_steps": 10}, "10 warm-up \\+ 30 stable \\+ 90 decay steps are more than the run's 100",
     ("lr_scheduler_kwargs", "max_steps")),
    ({"lr_scheduler_type": "cosine_warmup_with_min_lr"}, "needs lr_scheduler_kwargs with min_lr_rate",
     ("lr_scheduler_type", "lr_scheduler_kwargs")),
    ({"lr_scheduler_type": "cosine_warmup_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 1.5}},
     r"min_lr_rate must be in \[0, 1\]", ("lr_scheduler_kwargs",)),
    ({"lr_scheduler_type": "inverse_sqrt", "lr_scheduler_kwargs": {"num_cycles": 2}},
     r"\['num_cycles'\] do not apply to inverse_sqrt \(it takes: timescale\)", ("lr_scheduler_kwargs",)),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "needs evaluations during training: set eval_strategy",
     ("lr_scheduler_type", "eval_strategy")),
    ({"lr_scheduler_type": "greedy", "eval_strategy": "steps", "val_size": 0.1, "lr_scheduler_kwargs": {"factor": 2}},
     r"factor must be in \(0, 1\)", ("lr_scheduler_kwargs",)),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps", "val_size": 0.1,
      "lr_scheduler_kwargs": {"mode": "lowest"}}, "mode: 'lowest' is not one of min, max", ("lr_scheduler_kwargs",)),
])
def test_bad_schedule_arguments_are_refused_when_the_config_loads(tmp_path, kw, message, keys):
    with pytest.raises(ConfigError, match=message) as raised:
        cfg(tmp_path, **kw)
    assert raised.value.keys == keys


def test_every_schedule_loads_with_its_arguments(tmp_path):
    evaluated = {"eval_strategy": "steps", "val_size": 0.1}
    for kw in (
        {"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"num_cycles": 3}},
        {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"lr_end": 1e-7, "power": 0.5}},
        {"lr_scheduler_type": "inverse_sqrt", "lr_scheduler_kwargs": {"timescale": 100}},
        {"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 10,
                                                                             "decay_type": "1-sqrt"}},
        {"lr_scheduler_type": "cosine_warmup_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-6,
                                                                                   "warmup_lr_rate": 0.1}},
        {"lr_scheduler_type": "reduce_lr_on_plateau", "lr_scheduler_kwargs": {"patience": 2}, **evaluated},
        {"lr_scheduler_type": "greedy", "lr_scheduler_kwargs": {"smooth": True, "window_size": 5}, **evaluated},
    ):
        assert cfg(tmp_path, **kw).train.lr_scheduler_type == kw["lr_scheduler_type"]


def test_label_smoothing_is_for_the_lm_stages(tmp_path):
    assert cfg(tmp_path, stage="pt", label_smoothing_factor=0.1).train.label_smoothing_factor == 0.1
    assert cfg(tmp_path, stage="sft", label_smoothing_factor=0.1)
    with pytest.raises(ConfigError, match="label_smoothing_factor applies to stages pt and sft, not dpo") as raised:
        cfg(tmp_path, stage="dpo", label_smoothing_factor=0.1)
    assert raised.value.keys == ("label_smoothing_factor",)
    assert cfg(tmp_path, stage="dpo", label_smoothing_factor=0.0)  # its default, as LlamaFactory files write it
    with pytest.raises(ConfigError, match=r"label_smoothing_factor must be in \[0, 1\)"):
        cfg(tmp_path, label_smoothing_factor=1.0)


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_lion_32bit", "adafactor"])
def test_optimizers_that_cannot_step_fsdp_shards_are_refused_with_fsdp(tmp_path, name):
    """Measured on 2 CPU processes: bitsandbytes' kernels and Adafactor fail on FSDP2's DTensors (torch's and
    torchao's optimizers step them; under DeepSpeed ZeRO every optimizer gets plain partitions)."""
    with pytest.raises(ConfigError, match=f"optim {name} cannot step FSDP2's sharded weights") as raised:
        cfg(tmp_path, optim=name, fsdp="full_shard")
    assert raised.value.keys == ("optim", "fsdp")
