"""Load the tokenizer and a model ready to train: dtype, attention, quantization, checkpointing, adapters."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuneforge.config.kernels import compiles
from tuneforge.errors import ConfigError, ModelError
from tuneforge.model import attention
from tuneforge.model.adapters import apply_finetuning, decoder_layers, load_adapter, upcast_trainable_params
from tuneforge.model.checkpointing import checkpoint_by_memory
from tuneforge.model.fused_norm import fuse_rms_norms
from tuneforge.model.hub import resolve, resolve_adapter
from tuneforge.model.kernels import (
    check_liger,
    compile_layers,
    liger_enabled,
    patch_model,
    set_tf32,
    upcast_norms,
)
from tuneforge.model.lean_mlp import lean_gated_mlps
from tuneforge.model.lora_addmm import add_lora_by_addmm
from tuneforge.model.mkl_warmup import settle_vml_dispatch
from tuneforge.model.multimodal import hear_videos, omni_without_talker, text_writer
from tuneforge.model.prequantized import check_prequantized
from tuneforge.model.processor import is_multimodal, load_processor
from tuneforge.model.rope import apply_rope_scaling
from tuneforge.model.shifted_attention import use_shifted_sparse_attention
from tuneforge.model.vocab import add_new_tokens, fit_embeddings, train_embeddings, wants_new_tokens

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from tuneforge.config import ModelArgs, RunConfig, TrainArgs

logger = logging.getLogger(__name__)

ATTENTION = {"auto": "sdpa", "sdpa": "sdpa", "disabled": "eager", "eager": "eager", "fa2": "flash_attention_2"}


def resolve_model_path(model_args: ModelArgs) -> Path:
    """The local folder of cfg.model.model_name_or_path (downloaded / converted if needed)."""
    if not model_args.model_name_or_path:
        raise ConfigError("model_name_or_path is required (a local folder, a hub id, or smollm2-135m-instruct)")
    return resolve(model_args.model_name_or_path, cache_dir=model_args.cache_dir,
                   revision=model_args.model_revision, token=model_args.hf_hub_token)


def load_tokenizer(model_args: ModelArgs) -> PreTrainedTokenizerBase:
    """The model's tokenizer, padding on the right, with pad_token = eos_token when it has none, and the new tokens
    (vocab.add_new_tokens: the config's, and those its adapters' saved tokenizers carry)."""
    tokenizer = _base_tokenizer(model_args)
    add_new_tokens(tokenizer, model_args)
    return tokenizer


def _base_tokenizer(model_args: ModelArgs) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    path = resolve_model_path(model_args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    except ValueError as e:
        raise ModelError(_explain_load_error(path, e)) from None
    except OSError as e:
        raise ModelError(f"cannot load a tokenizer from {path}: {e}. The folder needs tokenizer files "
                         f"(tokenizer.json or tokenizer_config.json)") from None
    return _ready_tokenizer(tokenizer, path)


def load_model_processor(model_args: ModelArgs):
    """The processor of a vision- / audio-language model (its tokenizer prepared as load_tokenizer prepares one),
    or None for a text-only model."""
    path = resolve_model_path(model_args)
    processor = load_processor(path, load_config(path, model_args), trust_remote_code=model_args.trust_remote_code)
    if processor is not None:
        processor.tokenizer = _ready_tokenizer(processor.tokenizer, path)
        add_new_tokens(processor.tokenizer, model_args)
    return processor


def _ready_tokenizer(tokenizer: PreTrainedTokenizerBase, path: Path) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"the tokenizer in {path} has neither a pad_token nor an eos_token; "
                             f"add one to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer has no pad token: using eos %r", tokenizer.eos_token)
    tokenizer.padding_side = "right"
    return tokenizer


def compute_dtype(train_args: TrainArgs) -> torch.dtype:
    """bf16 / fp16 when mixed precision (or pure_bf16) is on, else fp32."""
    if train_args.bf16 or train_args.pure_bf16:
        return torch.bfloat16
    if train_args.fp16:
        return torch.float16
    return torch.float32


def attention_implementation(flash_attn: str) -> str:
    """cfg.model.flash_attn -> the attn_implementation name transformers takes."""
    if flash_attn not in ATTENTION:
        raise ConfigError(f"flash_attn '{flash_attn}' is not one of {', '.join(ATTENTION)}")
    return ATTENTION[flash_attn]


def quantization_config(model_args: ModelArgs, dtype: torch.dtype):
    """A BitsAndBytesConfig for quantization_bit 4 or 8, else None."""
    bits = model_args.quantization_bit
    if bits is None:
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise ConfigError("quantization_bit needs bitsandbytes: pip install 'tuneforge[qlora]'") from None
    if bits == 4:
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=model_args.quantization_type,
            bnb_4bit_use_double_quant=model_args.double_quantization, bnb_4bit_compute_dtype=dtype,
        )
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ConfigError(f"quantization_bit must be 4 or 8 (got {bits})")


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_model(cfg: RunConfig, device: torch.device | None = None) -> PreTrainedModel | PeftModel:
    """The model of cfg, ready to train: a peft.PeftModel (lora / oft) or a PreTrainedModel (full / freeze)."""
    m, method = cfg.model, cfg.method
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = resolve_model_path(m)
    config = model_config(path, cfg)
    saved = check_prequantized(config, path, method.finetuning_type, m.quantization_bit, device)
    run_dtype = compute_dtype(cfg.train)
    # full fine-tuning trains (and so keeps in fp32) every weight: load it in fp32 directly; but pure_bf16 trains
    # the bf16 weights themselves, and BAdam keeps its own fp32 copy of the one block it trains (as LlamaFactory)
    half_weights = cfg.train.pure_bf16 or cfg.memory.use_badam
    load_dtype = torch.float32 if method.finetuning_type == "full" and not half_weights else run_dtype
    quant = quantization_config(m, run_dtype)
    set_tf32(cfg.train.tf32, device)
    check_liger(config, cfg)
    model = _from_pretrained(path, config, m, dtype=load_dtype, quant=quant, device=device)
    model.config.use_cache = False  # the KV cache only costs memory while training
    _use_packed_sdpa(model, cfg)
    if fit_vocabulary(model, m, cfg.train.seed):  # before checkpointing hooks onto the (then replaced) embedding
        cfg = train_embeddings(cfg, model)
    if m.shift_attn:
        _use_shift_attn(model)
    patch_model(model, cfg)  # liger-kernel, fp8, upcast_layernorm, upcast_lmhead_output
    if quant is not None or saved is not None:
        _prepare_quantized(model)
    if not liger_enabled(cfg):  # liger has its own RMSNorm and SwiGLU kernels
        fuse_rms_norms(model)
        lean_gated_mlps(model)
    if not m.disable_gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model = apply_finetuning(model, cfg)
    add_lora_by_addmm(model)
    if not half_weights:
        upcast_trainable_params(model)
    checkpointing = "off" if m.disable_gradient_checkpointing else "on"
    if m.disable_gradient_checkpointing is None and (chosen := _checkpoint_by_memory(model, cfg, device)):
        checkpointing = chosen.summary()
    compile_layers(model, cfg.train)
    model.train()
    logger.info(
        "loaded %s: dtype %s (trainable params %s), attention %s, quantization %s, finetuning %s, "
        "gradient checkpointing %s, device %s",
        path, str(load_dtype).removeprefix("torch."), "as loaded" if half_weights else "fp32", attention.describe(model.config._attn_implementation),
        f"{saved} (saved so)" if saved else _describe_quant(m), method.finetuning_type, checkpointing, device,
    )
    logger.info("%s", describe_trainable(model))
    return model


def load_reference(cfg: RunConfig, device: torch.device | None = None) -> PreTrainedModel:
    """The frozen reference model of dpo / kto / grpo / ppo: ref_model (in ref_model_quantization_bit bits when
    set, with ref_model_adapters merged into it), or, without one, a fresh load of model_name_or_path (the policy
    as it was before training).

    It runs in the compute dtype (bf16 / fp16 / fp32), in eval mode, with no trainable parameter.
    lora / oft runs without ref_model need none of this: their reference is the policy with its adapters
    disabled.
    """
    method = cfg.method
    device = torch.device(device) if device is not None else default_device()
    m = cfg.model
    if method.ref_model:
        m = replace(m, model_name_or_path=method.ref_model, quantization_bit=method.ref_model_quantization_bit)
    path = resolve_model_path(m)
    dtype = compute_dtype(cfg.train)
    quant = quantization_config(m, dtype) if method.ref_model else None
    model = _from_pretrained(path, model_config(path, replace(cfg, model=m)), m, dtype=dtype, quant=quant,
                             device=device)
    model.config.use_cache = False
    _use_packed_sdpa(model, cfg)
    # the policy's vocabulary (new tokens: the policy's starting rows, from the same seed)
    fit_vocabulary(model, replace(m, adapter_name_or_path=method.ref_model_adapters), cfg.train.seed)
    for adapter in method.ref_model_adapters or []:
        folder = resolve_adapter(adapter, cache_dir=m.cache_dir, revision=m.model_revision,
                                 token=m.hf_hub_token)
        model = load_adapter(model, folder, trainable=False).merge_and_unload()
        logger.info("reference: merged adapter %s", folder)
    model.requires_grad_(False)
    model.eval()
    logger.info("reference model: %s (%s%s, frozen)", path, str(dtype).removeprefix("torch."),
                f", {_describe_quant(m)}" if quant is not None else "")
    return model


def reference_identity(cfg: RunConfig) -> dict[str, object]:
    """What the reference's outputs depend on (for caching precomputed log-probs): its weights' files
    (name, size, modification time), the adapters merged into it, and the dtype it runs in."""
    method, m = cfg.method, cfg.model
    name = method.ref_model or m.model_name_or_path
    folders = [resolve_model_path(replace(m, model_name_or_path=name))]
    adapters = method.ref_model_adapters if method.ref_model else None
    if not method.ref_model and method.finetuning_type in ("lora", "oft"):
        # the policy with its adapters disabled: the base with every adapter it merged (all but the last,
        # or all of them with create_new_adapter)
        given = m.adapter_name_or_path or []
        adapters = given if method.create_new_adapter else given[:-1]
    folders += [resolve_adapter(a, cache_dir=m.cache_dir, revision=m.model_revision,
                                 token=m.hf_hub_token) for a in adapters or []]
    files = [
        (str(p), p.stat().st_size, p.stat().st_mtime_ns)
        for folder in folders
        for p in sorted(folder.iterdir())
        if p.suffix in (".safetensors", ".bin", ".json") and p.is_file()
    ]
    identity = {"files": files, "dtype": str(compute_dtype(cfg.train)), "padding_free": cfg.data.padding_free}
    if m.rope_scaling:
        identity["rope"] = [m.rope_scaling, context_length(cfg)]
    if method.ref_model and method.ref_model_quantization_bit:
        identity["quantization_bit"] = method.ref_model_quantization_bit
    return identity


def fit_vocabulary(model: PreTrainedModel, model_args: ModelArgs, seed: int) -> bool:
    """The model's embeddings fitted to the tokenizer with the new tokens (vocab.fit_embeddings); True when they
    should train. Loads the tokenizer only when the config can change the vocabulary."""
    if not wants_new_tokens(model_args):
        return False
    tokenizer = _base_tokenizer(model_args)
    return fit_embeddings(model, tokenizer, add_new_tokens(tokenizer, model_args, quiet=True), model_args, seed)


def _use_packed_sdpa(model: PreTrainedModel, cfg: RunConfig) -> None:
    """With padding_free, run sdpa per sequence on flattened batches (models on the attention interface)."""
    if cfg.data.padding_free and model.config._attn_implementation == "sdpa" and attention.supports_padding_free(model):
        attention.register()
        model.set_attn_implementation(attention.PACKED_SDPA)


def _use_shift_attn(model: PreTrainedModel) -> None:
    """shift_attn: LongLoRA's S²-Attn in training, on the padding-free sdpa path."""
    if model.config._attn_implementation != attention.PACKED_SDPA:
        raise ConfigError(f"shift_attn: {type(model).__name__} does not run the padding-free sdpa attention that "
                          f"S²-Attn replaces (it needs padding_free: true, flash_attn: auto or sdpa, and a model on "
                          f"transformers' attention interface)", key="shift_attn")
    use_shifted_sparse_attention(model)
    logger.info("shift_attn: LongLoRA's shifted sparse attention in training (groups of 1/4 of each sequence); "
                "full attention in evaluation and inference")


def load_config(path: Path, model_args: ModelArgs) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    except (ValueError, KeyError, OSError) as e:
        raise ModelError(_explain_load_error(path, e)) from None


def context_length(cfg: RunConfig) -> int:
    """model_max_length, by default cutoff_len: the length rope_scaling stretches the model to."""
    return cfg.model.model_max_length or cfg.data.cutoff_len


def model_config(path: Path, cfg: RunConfig) -> PretrainedConfig:
    """The config the model of cfg is built with: its folder's, with rope_scaling applied."""
    config = load_config(path, cfg.model)
    apply_rope_scaling(config, cfg.model.rope_scaling, context_length(cfg))
    return config


def _from_pretrained(path: Path, config, model_args: ModelArgs, *, dtype: torch.dtype, quant,
                     device: torch.device) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM

    settle_vml_dispatch()  # before anything runs on several threads: a first call's race (mkl_warmup.py)
    auto = AutoModelForMultimodalLM if is_multimodal(config) else AutoModelForCausalLM
    attn = attention_implementation(model_args.flash_attn)
    # use_kernels: transformers (5.2x, with `kernels` installed) would otherwise fetch hub kernels on a GPU
    kwargs = dict(config=config, dtype=dtype, trust_remote_code=model_args.trust_remote_code,
                  device_map={"": str(device)}, use_kernels=model_args.use_kernels)
    if quant is not None:
        kwargs["quantization_config"] = quant
    if is_multimodal(config):
        kwargs["config"] = omni_without_talker(config)
    try:
        try:
            model = auto.from_pretrained(path, attn_implementation=attn, **kwargs)
        except ValueError as e:
            if model_args.flash_attn != "auto" or "sdpa" not in str(e).lower():
                raise
            logger.warning("%s does not support sdpa attention; using eager", path)
            model = auto.from_pretrained(path, attn_implementation="eager", **kwargs)
    except ImportError as e:
        raise ModelError(f"cannot load {path} with attention '{attn}': {e}. Set flash_attn: sdpa "
                         f"or install the missing package") from None
    except (ValueError, OSError) as e:
        raise ModelError(_explain_load_error(path, e)) from None
    writer = text_writer(model)
    if writer is not model:
        logger.info("%s: an omni model; its thinker (%s) is trained and run, its speech side is not loaded", path,
                    type(writer).__name__)
    if model_args.use_audio_in_video:
        hear_videos(writer)
    return writer


def _explain_load_error(path: Path, error: Exception) -> str:
    text = str(error)
    if "trust_remote_code" in text:
        return (f"{path} holds custom model code that must run to load it; if you trust that code, "
                f"set trust_remote_code: true")
    if "safetensors" in text or "pytorch_model.bin" in text or "no file named" in text.lower():
        return f"{path} has no model weights (model.safetensors): {text.splitlines()[0]}"
    return f"cannot load the model in {path}: {text.splitlines()[0] if text else type(error).__name__}"


def _describe_quant(model_args: ModelArgs) -> str:
    bits = model_args.quantization_bit
    if bits is None:
        return "none"
    if bits == 4:
        double = " + double quantization" if model_args.double_quantization else ""
        return f"4-bit {model_args.quantization_type}{double} (bitsandbytes)"
    return "8-bit (bitsandbytes)"


def _prepare_quantized(model: PreTrainedModel) -> None:
    """Freeze the quantized base and keep its norms in fp32 for stability (small: one vector per norm).

    Like peft's prepare_model_for_kbit_training, but without upcasting the embeddings / head to fp32,
    which for a large vocabulary would cost more memory than the 4-bit body saves.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    upcast_norms(model)


def _checkpoint_by_memory(model: torch.nn.Module, cfg: RunConfig, device: torch.device):
    """disable_gradient_checkpointing unset: each layer's mode from the memory estimate (none, selective, full). Not
    with torch_compile: its compiled parts of a checkpointed layer would run under selective checkpointing's
    dispatch mode, which torch.compile does not trace; every layer stays fully checkpointed then."""
    if compiles(cfg.train):
        return None
    try:
        _, layers = decoder_layers(model)
    except ModelError:  # layers not found: every layer stays checkpointed
        return None
    optimizer_bytes = 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # fp32 grad + 2 moments
    return checkpoint_by_memory(model, layers, cfg, device, reserved=optimizer_bytes)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant checkpointing; inputs require grad so frozen embeddings still back-propagate."""
    if not model.supports_gradient_checkpointing:
        logger.warning("%s does not support gradient checkpointing; training without it",
                       type(model).__name__)
        return
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not (getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None)):
        model.enable_input_require_grads()


def describe_trainable(model: torch.nn.Module) -> str:
    """'trainable params: 1,234 || all params: 5,678 || trainable%: 21.7329' (tied weights counted once)."""
    trainable = total = 0
    for param in model.parameters():  # parameters() yields a tied weight once
        count = param.numel() or getattr(param, "ds_numel", 0)  # DeepSpeed ZeRO-3 leaves shards empty
        if type(param).__name__ == "Params4bit":  # two 4-bit values per stored byte
            count *= 2 * getattr(getattr(param, "quant_storage", None), "itemsize", 1)
        total += count
        trainable += count if param.requires_grad else 0
    share = 100 * trainable / total if total else 0.0
    return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {share:.4f}"
