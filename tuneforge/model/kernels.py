"""Kernels, precision and compilation of the model being trained: the keys checked in tuneforge/config/kernels.py.

load_model applies them in this order: tf32 (process-wide), liger-kernel's patch and fp8's float8 layers on the
transformers model (before adapters wrap its linear layers), fp32 norms, the head's fp32 output, and last
torch.compile of each decoder layer (after gradient checkpointing and adapters: what is compiled is what runs).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from tuneforge.config.kernels import compile_backend, compiles, liger_enabled
from tuneforge.errors import ConfigError
from tuneforge.model.adapters import decoder_layers

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from tuneforge.config import RunConfig, TrainArgs

logger = logging.getLogger(__name__)

FLOAT8_MULTIPLE = 16  # float8 matmuls need both dimensions of a weight divisible by 16


def set_tf32(tf32: bool | None, device: torch.device) -> None:
    """tf32 true / false: whether CUDA's fp32 matmuls and convolutions may round their inputs to TF32."""
    if tf32 is None:
        return
    if device.type != "cuda":
        logger.warning("tf32: %s changes nothing here: TF32 is a mode of CUDA GPUs, and this run is on the %s",
                       str(tf32).lower(), device.type)
        return
    precision = "tf32" if tf32 else "ieee"
    # torch's per-backend precision API (mixing it with the legacy allow_tf32 flags is an error)
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    torch.backends.cudnn.rnn.fp32_precision = precision
    logger.info("tf32: fp32 matmuls and convolutions in %s", precision)


def check_liger(config: PretrainedConfig, cfg: RunConfig) -> None:
    """Before the weights load: liger-kernel has kernels for this model family, and liger_kernel_config only names
    switches its patch function takes."""
    if not liger_enabled(cfg):
        return
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    key = "enable_liger_kernel" if cfg.model.enable_liger_kernel else "use_liger_kernel"
    patch = MODEL_TYPE_TO_APPLY_LIGER_FN.get(config.model_type)
    if patch is None:
        raise ConfigError(f"{key}: liger-kernel has no kernels for model type '{config.model_type}' (it has: "
                          f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); remove {key}", key=key)
    switches = set(inspect.signature(patch).parameters) - {"model"}
    unknown = sorted(set(cfg.train.liger_kernel_config or {}) - switches)
    if unknown:
        raise ConfigError(f"liger_kernel_config: liger-kernel's patch for {config.model_type} has no switch "
                          f"{', '.join(unknown)}; it takes {', '.join(sorted(switches))}", key="liger_kernel_config")


def patch_model(model: PreTrainedModel, cfg: RunConfig) -> None:
    """The kernel keys that change the transformers model itself, before adapters wrap it."""
    m, t = cfg.model, cfg.train
    if liger_enabled(cfg):
        from transformers.integrations.liger import apply_liger_kernel

        # liger's fused linear cross-entropy replaces only the forward called with labels, which tuneforge's
        # chunked loss never calls; its RMSNorm, SwiGLU and rotary kernels run in the decoder
        apply_liger_kernel(model, dict(t.liger_kernel_config or {}))
        logger.info("liger-kernel: %s patched (%s)", model.config.model_type, t.liger_kernel_config or "its defaults")
    if t.fp8:
        to_float8(model, t)
    if m.upcast_layernorm:
        count = upcast_norms(model)
        logger.info("upcast_layernorm: %d norm weights in fp32", count)
    if m.upcast_lmhead_output:
        upcast_head_output(model)


def upcast_norms(model: nn.Module) -> int:
    """Keep every norm layer's weights in fp32 (one vector per norm: a small cost); how many were cast."""
    count = 0
    for module in model.modules():
        if "norm" in type(module).__name__.lower():
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and param.dtype != torch.float32:
                    param.data = param.data.float()
                    count += 1
    return count


def upcast_head_output(model: PreTrainedModel) -> None:
    """The vocabulary head returns fp32 logits (under autocast it computes in bf16 / fp16, then casts)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError(f"upcast_lmhead_output: {type(model).__name__} has no vocabulary head",
                          key="upcast_lmhead_output")
    head.register_forward_hook(_to_fp32)
    logger.info("upcast_lmhead_output: the head's logits in fp32")


def _to_fp32(_module: nn.Module, _args, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def float8_config(train_args: TrainArgs, *, emulate: bool = False):
    """torchao's tensorwise float8 recipe (its default; the one FSDP2's float8 all-gather takes). emulate: float8
    numerics in high precision, without float8 matmuls (torchao's test mode, runs on a CPU)."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(enable_fsdp_float8_all_gather=train_args.fp8_enable_fsdp_float8_all_gather,
                              emulate=emulate)


def to_float8(model: PreTrainedModel, train_args: TrainArgs, *, emulate: bool = False) -> int:
    """Swap the decoder layers' linear layers (both dimensions multiples of 16) for torchao's Float8Linear; the
    embeddings and the vocabulary head stay in high precision. How many were swapped."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    _, layers = decoder_layers(model)

    def worthy(module: nn.Module, _name: str) -> bool:
        return (isinstance(module, nn.Linear) and module.in_features % FLOAT8_MULTIPLE == 0
                and module.out_features % FLOAT8_MULTIPLE == 0)

    convert_to_float8_training(layers, module_filter_fn=worthy, config=float8_config(train_args, emulate=emulate))
    count = sum(isinstance(module, Float8Linear) for module in layers.modules())
    logger.info("fp8: %d linear layers of the decoder train with torchao float8 matmuls", count)
    return count


def compile_layers(model: nn.Module, train_args: TrainArgs) -> None:
    """torch_compile: compile each decoder layer in place (module names, state dict and adapters stay as they are).

    A gradient-checkpointed layer runs its forward inside torch's checkpoint, which torch.compile cannot trace
    through there (transformers' forward mutates a context variable: a graph break that leaves the whole layer
    eager), so its parts (attention, MLP, norms) are compiled instead: they run compiled in the forward and again
    in the backward's recompute."""
    if not compiles(train_args):
        return
    _, layers = decoder_layers(model)
    backend, mode = compile_backend(train_args), train_args.torch_compile_mode
    checkpointed = any(getattr(layer, "gradient_checkpointing", False) for layer in layers)
    for layer in layers:
        for part in layer.children() if checkpointed else (layer,):
            part.compile(backend=backend, mode=mode)
    logger.info("torch_compile: %d decoder layers compiled%s (backend %s, mode %s); the first steps compile",
                len(layers), " part by part (gradient checkpointing)" if checkpointed else "", backend,
                mode or "default")
