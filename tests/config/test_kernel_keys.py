"""The kernel and compilation keys are checked when the config loads: what cannot run here says why, naming the key."""

from __future__ import annotations

import pytest
import torch

from tuneforge.config import from_dict
from tuneforge.config.kernels import compile_backend, compiles
from tuneforge.errors import ConfigError

NO_GPU = not torch.cuda.is_available()


def cfg(tmp_path, **kw):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **kw})


def test_defaults_are_llamafactorys_and_transformers(tmp_path):
    c = cfg(tmp_path)
    assert (c.train.torch_compile, c.train.torch_compile_backend, c.train.torch_compile_mode, c.train.tf32) == (
        False, None, None, None)
    assert (c.model.enable_liger_kernel, c.train.use_liger_kernel, c.train.liger_kernel_config) == (False, False, None)
    assert (c.model.upcast_layernorm, c.model.upcast_lmhead_output, c.model.mixture_of_depths) == (False, False, None)
    assert (c.train.fp8, c.train.fp8_backend, c.train.fp8_enable_fsdp_float8_all_gather) == (False, "auto", False)
    # a file that spells out the defaults loads
    cfg(tmp_path, use_unsloth=False, use_unsloth_gc=False, mixture_of_depths=None, fp8_backend="torchao")


@pytest.mark.parametrize(("kw", "on", "backend"), [
    ({}, False, "inductor"),
    ({"torch_compile": True}, True, "inductor"),
    ({"torch_compile_backend": "aot_eager"}, True, "aot_eager"),  # as in transformers: a backend or mode turns it on
    ({"torch_compile_mode": "max-autotune"}, True, "inductor"),
])
def test_a_compile_backend_or_mode_turns_compilation_on(tmp_path, kw, on, backend):
    c = cfg(tmp_path, **kw)
    assert (compiles(c.train), compile_backend(c.train)) == (on, backend)


@pytest.mark.parametrize(("kw", "keys", "message"), [
    ({"torch_compile_backend": "turbo"}, "torch_compile_backend",
     "torch_compile_backend 'turbo' is not a torch.compile backend; available: .*inductor"),
    ({"torch_compile_mode": "fast"}, "torch_compile_mode", "'fast' is not one of null, default, reduce-overhead"),
    ({"torch_compile": True, "stage": "grpo", "reward_funcs": ["length"]}, ("torch_compile", "stage"),
     "stage grpo generates completions"),
    ({"liger_kernel_config": {"rope": True}}, ("liger_kernel_config", "enable_liger_kernel"),
     "liger_kernel_config configures liger-kernel, which is off"),
    ({"fp8_enable_fsdp_float8_all_gather": True, "fp8": True}, ("fp8_enable_fsdp_float8_all_gather", "fp8", "fsdp"),
     "it needs fp8: true and fsdp"),
    ({"fp8": True, "fp16": True}, ("fp8", "fp16"), "set bf16: true"),
    ({"fp8": True, "quantization_bit": 4}, ("fp8", "quantization_bit"), "a quantized base"),
    ({"fp8_backend": "te"}, "fp8_backend", "fp8_backend te is not supported .* use fp8_backend: torchao"),
    ({"use_unsloth": True}, "use_unsloth",
     "use_unsloth True needs the unsloth package.*finetuning_type: lora.* gradient checkpointing"),
    ({"use_unsloth_gc": True}, "use_unsloth_gc", "use_unsloth_gc True is Unsloth's gradient checkpointing"),
    ({"mixture_of_depths": "convert"}, "mixture_of_depths",
     "mixture_of_depths convert needs the mixture-of-depth package.* does not import with transformers 5"),
])
def test_impossible_kernel_settings_fail_at_load_naming_the_key(tmp_path, kw, keys, message):
    with pytest.raises(ConfigError, match=message) as e:
        cfg(tmp_path, **kw)
    assert e.value.keys == ((keys,) if isinstance(keys, str) else keys)


@pytest.mark.skipif(not NO_GPU, reason="the CPU's messages")
@pytest.mark.parametrize(("kw", "message"), [
    ({"enable_liger_kernel": True}, "enable_liger_kernel: liger-kernel's kernels are Triton kernels for CUDA GPUs"),
    ({"use_liger_kernel": True}, "use_liger_kernel: liger-kernel's kernels are Triton kernels for CUDA GPUs"),
    ({"fp8": True, "bf16": True}, "fp8 runs float8 matmuls on an Ada or Hopper GPU"),
])
def test_gpu_only_keys_refuse_a_cpu_run_before_anything_loads(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        cfg(tmp_path, **kw)
    from_dict({"model_name_or_path": "m", **kw}, for_training=False)  # chat / export of such a run still load


@pytest.mark.skipif(not NO_GPU, reason="the CPU's behaviour")
def test_tf32_is_accepted_on_the_cpu(tmp_path):
    assert cfg(tmp_path, tf32=True).train.tf32 is True  # the model load warns that it changes nothing here
