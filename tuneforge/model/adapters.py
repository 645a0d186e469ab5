"""What trains: full / freeze (chosen layers and modules) / lora / oft (through peft), and continued adapters."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tuneforge.errors import ConfigError, ModelError
from tuneforge.model.hub import resolve_adapter
from tuneforge.model.llama_pro import expanded_layer_ids
from tuneforge.model.multimodal import adapted_paths, freeze_media_side, language_model_path

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from tuneforge.config import MethodArgs, RunConfig

logger = logging.getLogger(__name__)

PEFT_TYPES = {"lora": "LORA", "oft": "OFT"}
PISSA_INIT = "pissa_init"  # the folder tuneforge.train saves a PiSSA run's initial adapter in


def apply_finetuning(model: PreTrainedModel, cfg: RunConfig) -> PreTrainedModel | PeftModel:
    """Set what trains according to cfg.method.finetuning_type; lora / oft return a peft.PeftModel."""
    method = cfg.method
    kind = method.finetuning_type
    if kind == "full":
        model.requires_grad_(True)
        _freeze_media_side(model, method)
        return model
    if kind == "freeze":
        setup_freeze(model, method)
        _freeze_media_side(model, method)
        return model
    if kind in PEFT_TYPES:
        if cfg.model.adapter_name_or_path:
            return continue_adapters(model, cfg)
        return add_adapter(model, method, pissa_initial=pissa_initial_on_resume(cfg))
    raise ConfigError(f"finetuning_type '{kind}' is not one of full, freeze, lora, oft")


def _freeze_media_side(model: nn.Module, method: MethodArgs) -> None:
    freeze_media_side(model, tower=method.freeze_vision_tower, projector=method.freeze_multi_modal_projector,
                      language_model=method.freeze_language_model)


def upcast_trainable_params(model: nn.Module) -> None:
    """Trainable weights live in fp32 (the loop autocasts); frozen ones keep the load dtype.

    `param.data` is replaced in place, so tied parameters (lm_head / embed_tokens) stay one tensor.
    """
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


# ---------------------------------------------------------------- freeze


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, the ModuleList of decoder layers): the first ModuleList as long as num_hidden_layers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(config, "num_hidden_layers", None)
    lm = language_model_path(model)  # a multimodal model: the language model's layers, not the vision tower's
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and (lm is None or name.startswith(lm + ".")):
            return name, module
    raise ModelError(f"cannot find the {count} decoder layers of {type(model).__name__}; "
                     f"use finetuning_type full, lora or oft")


def setup_freeze(model: nn.Module, method: MethodArgs) -> None:
    """Train the last N decoder layers (first N when negative; with use_llama_pro, the N added blocks), only the
    named submodules, plus extras."""
    layers_path, layers = decoder_layers(model)
    count, wanted = len(layers), method.freeze_trainable_layers
    if method.use_llama_pro:  # the blocks `tuneforge llama-pro` added
        layer_ids = expanded_layer_ids(count, wanted)
    elif wanted == 0 or abs(wanted) > count:
        raise ConfigError(f"freeze_trainable_layers must be between -{count} and {count} and not 0 "
                          f"(the model has {count} layers; got {wanted})")
    else:
        layer_ids = range(count - wanted, count) if wanted > 0 else range(-wanted)
    model.requires_grad_(False)
    names = method.freeze_trainable_modules or ["all"]
    for idx in layer_ids:
        layer = layers[idx]
        targets = [layer] if "all" in names else [_layer_submodule(layer, name) for name in names]
        for target in targets:
            target.requires_grad_(True)
    for name in method.freeze_extra_modules or []:
        _outside_module(model, layers_path, name).requires_grad_(True)
    logger.info("freeze: training layers %s (%s)%s", list(layer_ids), ", ".join(names),
                f" + {', '.join(method.freeze_extra_modules)}" if method.freeze_extra_modules else "")


def _layer_submodule(layer: nn.Module, name: str) -> nn.Module:
    found = dict(layer.named_modules())
    if name and name in found:
        return found[name]
    available = ", ".join(["all"] + [child for child, _ in layer.named_children()])
    raise ConfigError(f"freeze_trainable_modules: '{name}' is not a module of a decoder layer; "
                      f"available: {available}")


def _holds_weights(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _outside_module(model: nn.Module, layers_path: str, name: str) -> nn.Module:
    """A module outside the decoder layers that holds weights, by its name (embed_tokens) or path."""
    candidates = {
        path: module for path, module in model.named_modules()
        if path and not path.startswith(layers_path + ".") and _holds_weights(module)
    }
    for path, module in candidates.items():
        if path == name or path.rsplit(".", 1)[-1] == name:
            return module
    available = ", ".join(sorted({path.rsplit(".", 1)[-1] for path in candidates}))
    raise ConfigError(f"freeze_extra_modules: '{name}' is not a module outside the decoder layers; "
                      f"available: {available}")


# ---------------------------------------------------------------- lora / oft


def linear_module_names(model: nn.Module, *, include_head: bool = False) -> list[str]:
    """Short names of the linear layers (nn.Linear and bitsandbytes Linear4bit / Linear8bitLt)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for path, module in model.named_modules():
        if not _is_linear(module) or (module is head and not include_head):
            continue
        short = path.rsplit(".", 1)[-1]
        if short not in names:
            names.append(short)
    return names


def _is_linear(module: nn.Module) -> bool:
    # bitsandbytes layers subclass nn.Linear today; the names keep us right if that changes
    return isinstance(module, nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def target_modules(model: nn.Module, requested: list[str], key: str, method: MethodArgs | None = None) -> list[str]:
    """'all' -> every linear layer but the output head (of a multimodal model: the language model's, as full paths,
    plus the tower's / projector's when freeze_vision_tower / freeze_multi_modal_projector are off); else the
    names, checked against the model."""
    if not requested or "all" in requested:
        names = linear_module_names(model)
        if not names:
            raise ModelError(f"{key}: all found no linear layers in {type(model).__name__}")
        if language_model_path(model) is not None:
            head = model.get_output_embeddings()
            linear = [path for path, module in model.named_modules() if _is_linear(module) and module is not head]
            return adapted_paths(model, linear, tower=method is None or method.freeze_vision_tower,
                                 projector=method is None or method.freeze_multi_modal_projector)
        return names
    paths = [path for path, module in model.named_modules()
             if _is_linear(module) or isinstance(module, nn.Embedding)]
    for name in requested:
        if not any(path == name or path.endswith("." + name) for path in paths):
            available = ", ".join(linear_module_names(model, include_head=True))
            raise ConfigError(f"{key}: '{name}' is not a linear layer of the model; available: all, {available}")
    return list(requested)


def _modules_to_save(model: nn.Module, requested: list[str] | None) -> list[str] | None:
    if not requested:
        return None
    owners = [path for path, module in model.named_modules() if path and _holds_weights(module)]
    for name in requested:
        if not any(path == name or path.endswith("." + name) for path, _ in model.named_modules()):
            available = ", ".join(sorted({path.rsplit(".", 1)[-1] for path in owners}))
            raise ConfigError(f"additional_target: '{name}' is not a module of the model; available: {available}")
    return list(requested)


def _touches_tied_embeddings(model: nn.Module, names: list[str] | None) -> bool:
    """Whether modules_to_save names the input or output embedding of a model that ties them."""
    if not names or not getattr(model.config, "tie_word_embeddings", False):
        return False
    embeddings = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return any(id(module) in embeddings for path, module in model.named_modules()
               if any(path == n or path.endswith("." + n) for n in names))


def pissa_init_name(pissa_iter: int) -> str:
    """peft's init_lora_weights value: exact SVD for -1, else fast SVD with that many iterations."""
    return "pissa" if pissa_iter == -1 else f"pissa_niter_{pissa_iter}"


def adapter_config(model: nn.Module, method: MethodArgs):
    """A fresh peft LoraConfig / OFTConfig from the method keys."""
    from peft import LoraConfig, OFTConfig

    save = _modules_to_save(model, method.additional_target)
    tied = _touches_tied_embeddings(model, save)
    # use_llama_pro: adapters only on the blocks `tuneforge llama-pro` added (peft's layers_to_transform)
    layers = {}
    if method.use_llama_pro:
        path, decoder = decoder_layers(model)
        layers = {"layers_to_transform": expanded_layer_ids(len(decoder), method.freeze_trainable_layers),
                  "layers_pattern": path.rsplit(".", 1)[-1]}
    if method.finetuning_type == "oft":
        if tied:
            raise ConfigError("additional_target names a tied embedding, which peft's OFT cannot keep tied; "
                              "use finetuning_type lora, or drop it from additional_target")
        return OFTConfig(task_type="CAUSAL_LM", r=method.oft_rank, oft_block_size=method.oft_block_size,
                         target_modules=target_modules(model, method.oft_target, "oft_target", method),
                         modules_to_save=save, **layers)
    return LoraConfig(
        task_type="CAUSAL_LM", r=method.lora_rank,
        lora_alpha=method.lora_alpha if method.lora_alpha is not None else 2 * method.lora_rank,
        lora_dropout=method.lora_dropout,
        target_modules=target_modules(model, method.lora_target, "lora_target", method),
        modules_to_save=save, use_dora=method.use_dora, use_rslora=method.use_rslora,
        init_lora_weights=pissa_init_name(method.pissa_iter) if method.pissa_init else True,
        ensure_weight_tying=tied,  # a trained copy of embed_tokens is also the head's
        **layers,
    )


def add_adapter(model: nn.Module, method: MethodArgs, pissa_initial: Path | None = None) -> nn.Module:
    """Wrap the model in a fresh lora / oft adapter (only adapter weights and modules_to_save train).

    PiSSA (lora with pissa_init) is initialized by init_pissa, or, given pissa_initial (a resumed run's saved
    initial adapter), rebuilt from it by restore_pissa_init instead of from a new SVD, which, randomized,
    may not come out as the run's did."""
    from peft import get_peft_model

    config = adapter_config(model, method)
    pissa = method.finetuning_type == "lora" and method.pissa_init
    if pissa:
        config.init_lora_weights = False  # PiSSA runs below, layer by layer
    targets = sorted({path.rsplit(".", 1)[-1] for path in config.target_modules})
    logger.info("%s on %s%s", method.finetuning_type, ", ".join(targets),
                f", modules_to_save {config.modules_to_save}" if config.modules_to_save else "")
    try:
        model = get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"cannot add a {method.finetuning_type} adapter: {e}") from None
    if pissa:
        if pissa_initial is not None:
            restore_pissa_init(model, pissa_initial)
        else:
            init_pissa(model, pissa_init_name(method.pissa_iter))
        model.peft_config["default"].init_lora_weights = pissa_init_name(method.pissa_iter)
    return model


# ---------------------------------------------------------------- pissa


def _lora_layers(model: PeftModel, adapter: str):
    from peft.tuners.lora import LoraLayer

    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
            yield name, layer


@torch.no_grad()
def init_pissa(model: PeftModel, init: str, adapter: str = "default") -> None:
    """peft's own PiSSA init (LoraLayer.pissa_init), run on an fp32 copy of each weight, one layer at a time.

    Through get_peft_model, peft computes the residual W - scaling·B0·A0 with fp32 A0, B0 and then rounds
    A0, B0 to the base dtype: in bf16, residual + adapter is then not W, and the residual cannot be rebuilt
    from the adapter. Here A0, B0 stay fp32 (the trainable dtype) and only the residual is rounded, as
    restore_pissa_init rounds it: a resumed bf16 run rebuilds it bit for bit.
    """
    for _, layer in _lora_layers(model, adapter):
        base = layer.get_base_layer()
        dtype = base.weight.dtype
        base.weight.data = base.weight.data.to(torch.float32)
        layer.pissa_init(adapter, init)
        base.weight.data = base.weight.data.to(dtype)


def pissa_initial_on_resume(cfg: RunConfig) -> Path | None:
    """When cfg resumes a PiSSA run: the initial adapter that run saved beside its checkpoints, if there."""
    from tuneforge.config import checkpoints_in

    method, resume = cfg.method, cfg.train.resume_from_checkpoint
    if not method.pissa_init or method.finetuning_type != "lora" or resume is None or resume is False:
        return None
    if resume is True:
        found = checkpoints_in(cfg.train.output_dir) if cfg.train.output_dir else []
        if not found:
            return None
        resume = found[-1]
    folder = Path(resume).parent / PISSA_INIT
    if not (folder / "adapter_model.safetensors").is_file():
        logger.warning("resuming a PiSSA run without %s: its residual base cannot be rebuilt", folder)
        return None
    logger.info("PiSSA: rebuilding the initial adapter and the residual base from %s", folder)
    return folder


@torch.no_grad()
def restore_pissa_init(model: PeftModel, folder: Path, adapter: str = "default") -> None:
    """Load the initial adapter (A0, B0) from folder and make each target weight W the residual
    W - scaling·B0·A0, computed as peft's PiSSA init computes it (in fp32, then in the weight's dtype)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(folder / "adapter_model.safetensors")
    result = set_peft_model_state_dict(model, saved, adapter_name=adapter)
    missing = [k for k in result.missing_keys if f".{adapter}." in k]
    if missing or result.unexpected_keys:
        raise ModelError(f"the PiSSA initial adapter {folder} does not fit this model (missing "
                         f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}); resume with the "
                         f"settings of the run that saved it")
    for name, layer in _lora_layers(model, adapter):
        base = layer.get_base_layer()
        flip = getattr(layer, "fan_in_fan_out", False)  # Conv1D-style weights are stored transposed
        weight = base.weight.to(torch.float32)
        weight = weight.T if flip else weight
        delta = layer.scaling[adapter] * layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight
        if delta.shape != weight.shape:
            raise ModelError(f"cannot rebuild the PiSSA residual of {name}: its adapter makes "
                             f"{tuple(delta.shape)}, its weight is {tuple(weight.shape)}")
        residual = (weight - delta).to(base.weight.dtype)
        base.weight.data = residual.T if flip else residual


def continue_adapters(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """Load adapter_name_or_path: merge all but the last, continue the last (or, with create_new_adapter,
    merge them all and add a fresh one)."""
    m, method = cfg.model, cfg.method
    folders = [resolve_adapter(p, cache_dir=m.cache_dir, revision=m.model_revision,
                                 token=m.hf_hub_token)
               for p in m.adapter_name_or_path]
    for folder in folders:
        _check_adapter_type(folder, method.finetuning_type)
    to_merge = folders if method.create_new_adapter else folders[:-1]
    if to_merge and m.quantization_bit is not None:
        raise ConfigError("merging adapters into a quantized base would round them away: with quantization_bit "
                          "give a single adapter_name_or_path and create_new_adapter: false, or merge first "
                          "without quantization")
    for folder in to_merge:
        model = load_adapter(model, folder, trainable=False).merge_and_unload()
        logger.info("merged adapter %s into the base", folder)
    if method.create_new_adapter:
        return add_adapter(model, method, pissa_initial=pissa_initial_on_resume(cfg))
    logger.info("continuing adapter %s (its own adapter_config.json sets rank and targets)", folders[-1])
    return load_adapter(model, folders[-1], trainable=True)


def _check_adapter_type(folder: Path, finetuning_type: str) -> None:
    try:
        peft_type = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("peft_type")
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {folder / 'adapter_config.json'}: {e}") from None
    if peft_type != PEFT_TYPES[finetuning_type]:
        raise ConfigError(f"adapter {folder} is a {peft_type} adapter but finetuning_type is "
                          f"{finetuning_type}; set finetuning_type to match it")


def load_adapter(model: nn.Module, folder: Path, *, trainable: bool) -> nn.Module:
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, folder, is_trainable=trainable)
    except (RuntimeError, ValueError, KeyError) as e:
        first = next((line.strip() for line in str(e).splitlines() if "mismatch" in line), str(e).splitlines()[0])
        base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
        raise ModelError(f"adapter {folder} does not fit this base model ({first}); it was trained on "
                         f"{base!r}: set model_name_or_path to that model") from None
