"""Checks of the kernel and compilation keys (torch_compile*, tf32, liger, fp8), run when the config loads.

What needs a GPU says so here, before any data or weights load; tuneforge/model/kernels.py applies the keys.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable

from tuneforge.config.schema import RunConfig, TrainArgs
from tuneforge.stages import stage_of

DEFAULT_COMPILE_BACKEND = "inductor"
FP8_CAPABILITY = (8, 9)  # float8 matmuls (torch._scaled_mm): Ada (8.9) and Hopper (9.0) or newer


def compiles(t: TrainArgs) -> bool:
    """torch_compile, or implied by torch_compile_backend / torch_compile_mode (as in transformers)."""
    return bool(t.torch_compile or t.torch_compile_backend or t.torch_compile_mode)


def compile_backend(t: TrainArgs) -> str:
    return t.torch_compile_backend or DEFAULT_COMPILE_BACKEND


def liger_enabled(cfg: RunConfig) -> bool:
    """enable_liger_kernel (LlamaFactory's name) or use_liger_kernel (transformers')."""
    return cfg.model.enable_liger_kernel or cfg.train.use_liger_kernel


def check_kernels(cfg: RunConfig, fail: Callable[..., None], for_training: bool) -> None:
    t = cfg.train
    training = for_training and t.do_train
    if compiles(t):
        _check_compile(cfg, fail, training)
    if t.tf32 and training and _cuda().is_available() and _cuda().get_device_capability() < (8, 0):
        fail(f"tf32: true needs an Ampere or newer GPU; {_cuda().get_device_name()} has none: set tf32: false "
             f"or remove it", key="tf32")
    if cfg.train.liger_kernel_config is not None and not liger_enabled(cfg):
        fail("liger_kernel_config configures liger-kernel, which is off: set enable_liger_kernel: true or remove "
             "liger_kernel_config", key=("liger_kernel_config", "enable_liger_kernel"))
    if liger_enabled(cfg) and training:
        key = "enable_liger_kernel" if cfg.model.enable_liger_kernel else "use_liger_kernel"
        if not _cuda().is_available():
            fail(f"{key}: liger-kernel's kernels are Triton kernels for CUDA GPUs, and this machine has none; "
                 f"remove {key} (on the CPU the model's own layers run)", key=key)
        if importlib.util.find_spec("liger_kernel") is None:
            fail(f"{key} needs the liger-kernel package: pip install 'tuneforge[liger]'", key=key)
    if t.fp8_enable_fsdp_float8_all_gather and not (t.fp8 and t.fsdp):
        fail("fp8_enable_fsdp_float8_all_gather all-gathers FSDP2's float8 weights: it needs fp8: true and fsdp",
             key=("fp8_enable_fsdp_float8_all_gather", "fp8", "fsdp"))
    if t.fp8:
        _check_fp8(cfg, fail, training)


def _check_compile(cfg: RunConfig, fail: Callable[..., None], training: bool) -> None:
    t = cfg.train
    backend = compile_backend(t)
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        fail(f"torch_compile_backend '{backend}' is not a torch.compile backend; available: {', '.join(known)}",
             key="torch_compile_backend")
    if t.fsdp or t.deepspeed:
        fail("torch_compile with fsdp / deepspeed is not supported yet (the compiled layers would trace the "
             "strategy's sharding hooks); drop torch_compile, or train under DDP", key=("torch_compile", "fsdp"))
    if stage_of(cfg.method.stage).samples:
        fail(f"torch_compile: stage {cfg.method.stage} generates completions with the policy, where compiled layers "
             f"recompile for every new length; drop torch_compile", key=("torch_compile", "stage"))
    if training and backend == "inductor" and not _cuda().is_available() and not _cpp_compiler():
        fail("torch_compile on the CPU: inductor builds C++ kernels and no C++ compiler was found (g++, clang++ or "
             "$CXX); install one (e.g. apt-get install g++), or set torch_compile_backend: aot_eager",
             key=("torch_compile", "torch_compile_backend"))


def _torch():
    """torch, imported only when a key that needs it is set: reading and checking a config imports no torch."""
    import torch

    return torch


def _cuda():
    return _torch().cuda


def _cpp_compiler() -> str | None:
    return next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c)), None)


def _check_fp8(cfg: RunConfig, fail: Callable[..., None], training: bool) -> None:
    t = cfg.train
    if t.fp16:
        fail("fp8 trains with bf16 (or fp32) around its float8 matmuls, not fp16's loss scaling: set bf16: true",
             key=("fp8", "fp16"))
    if cfg.model.quantization_bit is not None:
        fail("fp8 converts the linear layers to float8 training; a quantized base (quantization_bit) has none to "
             "convert: drop one of them", key=("fp8", "quantization_bit"))
    if t.deepspeed:
        fail("fp8 with deepspeed is not supported (tuneforge converts the layers to float8 for DDP and FSDP2 "
             "only); use fsdp or drop deepspeed", key=("fp8", "deepspeed"))
    if importlib.util.find_spec("torchao") is None:
        fail("fp8 needs torchao: pip install 'tuneforge[fp8]'", key="fp8")
    if not training:
        return
    torch = _torch()
    if not torch.cuda.is_available():
        fail("fp8 runs float8 matmuls on an Ada or Hopper GPU (CUDA), and this machine has none; remove fp8", key="fp8")
    if torch.cuda.get_device_capability() < FP8_CAPABILITY:
        fail(f"fp8 needs float8 matmuls (an Ada or Hopper GPU, compute capability 8.9+); "
             f"{torch.cuda.get_device_name()} is {'.'.join(map(str, torch.cuda.get_device_capability()))}: remove fp8",
             key="fp8")
