"""LlamaFactory "v1" config files (nested `model:` / `peft_config:` / `dist_config:` ..., `train_dataset:` naming a
dataset-spec YAML) -> the flat keys of our schema.

A v1 file is recognized by a key only v1 has (V1_MARKERS). Every key of v1's argument classes (ModelArguments,
DataArguments, TrainingArguments, SampleArguments and the plugin configs they hold) has one row in TOP or in a
plugin table (PLUGINS) saying what it becomes:

- `to(flat)`: the same meaning under our flat key (values converted where v1 spells them differently);
- `ignored(why)`: accepted, it changes nothing here;
- `only(default, advice)`: accepted at v1's default, refused otherwise (tuneforge has no equivalent) with a message
  naming the key path, the value and what to do.

Where v1's default differs from ours, V1_DEFAULTS puts v1's value in the flat config (a v1 file trains as v1
trains it). Keys that are not v1 keys pass through as flat keys (so `stage: rm`, `template: ...` or `logging_steps`
may be added to a v1 file). v1 picks the stage with its command (`llamafactory-cli sft | dpo | rm`); tuneforge
has one `train` command, so a v1 file without `stage` trains dpo when its train_dataset holds preference pairs and
sft otherwise (`stage: rm` selects a reward model).
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuneforge.config import v1_datasets
from tuneforge.config.processes import planned_processes
from tuneforge.config.schema import RunConfig
from tuneforge.errors import ConfigError

logger = logging.getLogger(__name__)

# keys that only a v1 file has: one of them makes a file a v1 file
V1_MARKERS = frozenset({
    "model", "train_dataset", "micro_batch_size", "global_batch_size", "model_class", "custom_chat_template",
    "peft_config", "dist_config", "kernel_config", "quant_config", "init_config", "optim_config",
    "lr_scheduler_config", "batching_strategy", "batching_workers", "enable_activation_checkpointing",
    "dist_timeout", "dp_size", "cp_size", "cp_mode", "mp_replicate_size", "mp_shard_size", "save_epochs",
    "save_ckpt_as_hf", "sample_backend",
})
_UNSET = object()


class _Refused(Exception):
    """A v1 value tuneforge cannot honour; the message says what to do."""


@dataclass(frozen=True)
class Rule:
    doc: str  # one line for the README / errors
    apply: Callable[[Any], dict[str, Any]]  # the v1 value -> flat keys (raises _Refused)


def to(flat: str, convert: Callable[[Any], Any] | None = None, note: str = "") -> Rule:
    """Same meaning under the flat key `flat` (the value converted by `convert`)."""
    return Rule(f"-> {flat}{' (' + note + ')' if note else ''}",
                lambda v: {flat: convert(v) if convert is not None else v})


def choose(flat: str, values: dict[Any, Any], advice: str) -> Rule:
    """An enumerated v1 value -> the flat key's value; a value not in `values` is refused with `advice`."""
    def apply(v: Any) -> dict[str, Any]:
        key = v.strip().lower() if isinstance(v, str) else v
        if key not in values:
            raise _Refused(advice)
        return {} if values[key] is _UNSET else {flat: values[key]}
    return Rule(f"-> {flat} ({', '.join(f'{a}: {b}' for a, b in values.items() if b is not _UNSET)})", apply)


def ignored(why: str) -> Rule:
    return Rule(f"ignored: {why}", lambda v: {})


def only(default: Any, advice: str) -> Rule:
    def apply(v: Any) -> dict[str, Any]:
        if not same(v, default):
            raise _Refused(advice)
        return {}
    return Rule(f"only {default!r}: {advice}", apply)


def same(value: Any, default: Any) -> bool:
    """Whether a v1 value is the default as a YAML file may write it (null / "none", 1 / 1.0, "true")."""
    if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
        value = None
    if default is None or value is None:
        return value is None and default is None
    if isinstance(default, bool):
        return value is default or (isinstance(value, str) and value.strip().lower() == str(default).lower())
    if isinstance(default, (int, float)):
        try:
            return not isinstance(value, bool) and math.isclose(float(value), float(default))
        except (TypeError, ValueError):
            return False
    return str(value).strip().lower() == str(default).lower()


def _dataset(v: Any) -> list[str]:
    if not isinstance(v, str) or not v.strip():
        raise _Refused("give the path of a dataset-spec YAML (name: {path: ..., converter: ...}) or of a data file")
    return [v]


def _resume(v: Any) -> Any:
    return True if isinstance(v, str) and v.strip().lower() == "auto" else v


def _save_epochs(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if same(v, 1):
        return {"save_strategy": "epoch"}
    raise _Refused("tuneforge saves a checkpoint at each epoch's end (save_epochs: 1) or every save_steps steps; "
                   "set save_epochs: 1 or save_steps")


_MAX_STEPS = to("max_steps", lambda v: -1 if v is None else v, "null: -1, train num_train_epochs")

TOP: dict[str, Rule] = {
    # ModelArguments
    "model": to("model_name_or_path"),
    "custom_chat_template": only(None, "tuneforge takes a chat template by name (template: <name>) or the model's "
                                       "own; put the Jinja text in the tokenizer's chat_template instead"),
    "trust_remote_code": to("trust_remote_code"),
    "flash_attn": choose("flash_attn", {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "fa2"},
                         "use eager, sdpa or flash_attention_2"),
    "model_class": choose("model_class", {"llm": _UNSET, "cls": _UNSET},
                          "tuneforge trains causal language models (llm); a reward model (cls) is stage rm"),
    # DataArguments
    "train_dataset": to("dataset", _dataset, "a dataset-spec YAML or a data file"),
    "eval_dataset": to("eval_dataset", lambda v: None if v is None else _dataset(v)),
    # TrainingArguments
    "output_dir": to("output_dir"),
    "micro_batch_size": to("per_device_train_batch_size"),
    "global_batch_size": only(None, "set gradient_accumulation_steps instead (global batch = micro_batch_size x "
                                    "gradient_accumulation_steps x processes)"),
    "cutoff_len": to("cutoff_len"),
    "learning_rate": to("learning_rate"),
    "num_train_epochs": to("num_train_epochs"),
    "max_steps": _MAX_STEPS,
    "max_grad_norm": to("max_grad_norm"),
    "bf16": to("bf16"),
    "batching_strategy": choose("padding_free", {"normal": False, "padding_free": True},
                                "dynamic batching is not in tuneforge; use normal or padding_free, or packing: true "
                                "(samples packed into cutoff_len rows that never attend to each other)"),
    "batching_workers": ignored("batches are built in-process from tokenized rows"),
    "enable_activation_checkpointing": to("disable_gradient_checkpointing", lambda v: not v, "negated"),
    "dist_timeout": to("ddp_timeout"),
    "dp_size": only(None, "tuneforge's data-parallel size is the number of processes; remove dp_size"),
    "cp_size": to("sequence_parallel_size"),
    "cp_mode": choose("sequence_parallel_size", {"ulysses": _UNSET}, "tuneforge's sequence parallelism is "
                      "Ulysses (all-to-all attention): set cp_mode: ulysses"),
    "mp_replicate_size": only(1, "for replicated shards use fsdp: hybrid_shard; remove mp_replicate_size"),
    "mp_shard_size": only(None, "FSDP shards over all processes (or each node's with fsdp: hybrid_shard); remove "
                                "mp_shard_size"),
    "lr_scheduler_config": only(None, "set lr_scheduler_type (linear, cosine, constant, ...) instead"),
    "seed": to("seed"),
    "full_determinism": to("full_determinism"),
    "resume_from_checkpoint": to("resume_from_checkpoint", _resume, "auto: true"),
    "save_steps": to("save_steps"),
    "save_epochs": Rule("1 -> save_strategy: epoch", _save_epochs),
    "save_ckpt_as_hf": only(False, "tuneforge's checkpoints keep what an exact resume needs; the final output is a "
                                   "Hugging Face folder: remove save_ckpt_as_hf"),
    "save_total_limit": to("save_total_limit"),
    "logging_steps": to("logging_steps"),
    "pref_loss": to("pref_loss"),
    "pref_beta": to("pref_beta"),
    "pref_ftx": to("pref_ftx"),
    "simpo_gamma": to("simpo_gamma"),
    "dpo_label_smoothing": to("dpo_label_smoothing"),
    "ld_alpha": to("ld_alpha"),
    # SampleArguments
    "sample_backend": choose("infer_backend", {"hf": "huggingface", "vllm": "vllm"}, "use hf or vllm"),
    "max_new_tokens": to("max_new_tokens"),
}

_LORA = {
    "r": to("lora_rank"),
    "lora_alpha": to("lora_alpha"),
    "lora_dropout": to("lora_dropout"),
    "target_modules": to("lora_target"),
    "use_rslora": to("use_rslora"),
    "use_dora": to("use_dora"),
    "modules_to_save": to("additional_target"),
    "adapter_name_or_path": to("adapter_name_or_path"),
    "export_dir": to("export_dir"),
    "export_size": to("export_size"),
    "export_hub_model_id": to("export_hub_model_id"),
    "infer_dtype": to("infer_dtype"),
    "export_legacy_format": to("export_legacy_format"),
}
_FREEZE = {
    "freeze_trainable_layers": to("freeze_trainable_layers"),
    "freeze_trainable_modules": to("freeze_trainable_modules"),
    "freeze_extra_modules": to("freeze_extra_modules"),
    "cast_trainable_params_to_fp32": only(True, "tuneforge keeps trainable weights in float32 under mixed "
                                                "precision; remove cast_trainable_params_to_fp32"),
}
_BNB = {
    "quantization_bit": to("quantization_bit"),
    "double_quantization": to("double_quantization"),
    "quantization_type": to("quantization_type"),
    "compute_dtype": only("float16", "the 4-bit compute dtype follows bf16 / fp16 here; remove compute_dtype"),
}
_INIT = {"init_on_default": {}, "init_on_rank0": {}, "init_on_meta": {}}
_FSDP2 = {
    "dcp_path": only(None, "tuneforge loads the model from model (a Hugging Face folder); convert the distributed "
                           "checkpoint to one and remove dcp_path"),
    "reshard_after_forward": to("fsdp_config.reshard_after_forward"),
    "offload_params": to("fsdp_config.cpu_offload"),
    "pin_memory": ignored("offloaded weights' memory is managed by torch"),
}

# plugin config key -> {plugin name -> (its keys' rules, the flat keys the plugin itself sets)}
PLUGINS: dict[str, dict[str, tuple[dict[str, Rule], dict[str, Any]]]] = {
    "peft_config": {
        "lora": (_LORA, {"finetuning_type": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05}),
        "freeze": (_FREEZE, {"finetuning_type": "freeze"}),
    },
    "quant_config": {"bnb": (_BNB, {"quantization_method": "bnb", "quantization_bit": 4}),
                     "auto": (_BNB, {"quantization_method": "bnb"})},
    "init_config": {name: ({}, {}) for name in _INIT},  # where weights are first materialized: no effect here
    "kernel_config": {"auto": ({"include_kernels": ignored("speed only"), "chunk_size": ignored("speed only")}, {})},
    "dist_config": {"fsdp2": (_FSDP2, {"fsdp": True}),
                    "deepspeed": ({"config_file": to("deepspeed")}, {})},
    "optim_config": {},
}
PLUGIN_ADVICE = {
    "peft_config": "use lora or freeze (no peft_config: full fine-tuning)",
    "quant_config": "use bnb (bitsandbytes 4 / 8 bit)",
    "init_config": "use init_on_default, init_on_rank0 or init_on_meta",
    "kernel_config": "tuneforge runs transformers' own layers (use_kernels: true swaps in Hugging Face hub kernels); "
                     "use name: auto or remove kernel_config",
    "dist_config": "use fsdp2 or deepspeed (fsdpturbo's expert parallelism is not in tuneforge)",
    "optim_config": "tuneforge's optimizers are chosen with optim (adamw_torch, ...); remove optim_config",
}

# v1's defaults where ours differ: a v1 file that leaves the key out trains as v1 would
V1_DEFAULTS: dict[str, Any] = {
    "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507",
    "finetuning_type": "full",  # no peft_config
    "per_device_train_batch_size": 1,
    "learning_rate": 1.0e-4,
    "bf16": True,
    "padding_free": False,  # batching_strategy: normal
    "logging_steps": 1,
    "ddp_timeout": 18000,
    "save_strategy": "no",  # no save_steps / save_epochs: no checkpoint before the end
    "lr_scheduler_type": "constant",  # no lr_scheduler_config: LambdaLR(1.0)
    "weight_decay": 0.01,  # torch.optim.AdamW's default, which v1 builds with only lr
    "max_new_tokens": 128,
    "media_dir": ".",  # image_url values are opened as written, from the working folder
}


def is_v1(raw: dict[str, Any]) -> bool:
    return any(key in V1_MARKERS for key in raw)


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The v1 mapping with `key=value` overrides applied; `peft_config.r=16` sets a plugin's key, as v1's CLI."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if rest:
            if not isinstance(out.get(head), dict):
                out[head] = {}
            out[head][rest] = value
        else:
            out[key] = value
    return out


def _fail(source: str, path: str, value: Any, advice: str) -> ConfigError:
    return ConfigError(f"{source}: LlamaFactory v1 key '{path}' = {value!r} has no equivalent in tuneforge: {advice}",
                       key=path.split(".")[0])


def _plugin(key: str, value: Any, source: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict) or "name" not in value:
        raise ConfigError(f"{source}: LlamaFactory v1 key '{key}' must be a mapping with a name (e.g. {{name: lora}}), "
                          f"got {value!r}", key=key)
    name = str(value["name"]).strip()
    names = [n.strip() for n in name.split(",") if n.strip()] if key == "kernel_config" else [name]
    out: dict[str, Any] = {}
    for n in names:
        if n not in PLUGINS[key]:
            raise _fail(source, f"{key}.name", value["name"], PLUGIN_ADVICE[key])
        rules, sets = PLUGINS[key][n]
        out.update(sets)
        for sub, v in value.items():
            if sub == "name":
                continue
            if sub not in rules:
                known = ", ".join(rules) or "none"
                raise ConfigError(f"{source}: unknown LlamaFactory v1 key '{key}.{sub}' for {key} name {n} "
                                  f"(its keys: {known})", key=key)
            out.update(_apply(rules[sub], f"{key}.{sub}", v, source))
    return out


def _apply(rule: Rule, path: str, value: Any, source: str) -> dict[str, Any]:
    try:
        return rule.apply(value)
    except _Refused as e:
        raise _fail(source, path, value, str(e)) from None


def flatten(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The flat config of a v1 mapping (ConfigError for a value tuneforge cannot honour)."""
    mapped: dict[str, Any] = {}
    passed: dict[str, Any] = {}
    for key, value in raw.items():
        if key in PLUGINS:
            mapped.update(_plugin(key, value, source))
        elif key in TOP:
            mapped.update(_apply(TOP[key], key, value, source))
        else:
            passed[key] = value  # a flat tuneforge / LlamaFactory key: the loader checks it
    fsdp_config = {k.split(".", 1)[1]: mapped.pop(k) for k in list(mapped) if k.startswith("fsdp_config.")}
    if fsdp_config:
        mapped["fsdp_config"] = fsdp_config
    for key in passed.keys() & mapped.keys():
        if passed[key] != mapped[key]:
            raise ConfigError(f"{source}: '{key}' is set twice: {passed[key]!r}, and {mapped[key]!r} from the v1 keys; "
                              f"keep one", key=key)
    flat = {**V1_DEFAULTS, **mapped, **passed}
    if "output_dir" not in flat:  # v1's default: a fresh folder under outputs/
        flat["output_dir"] = os.path.join("outputs", uuid.uuid4().hex)
    if "stage" not in flat:
        flat["stage"] = _stage(raw, source)
    if raw.get("model_class") == "cls" and flat["stage"] != "rm":
        raise _fail(source, "model_class", "cls", f"a reward model is stage rm here (got stage {flat['stage']}); "
                                                  f"add stage: rm")
    return flat


def fit_processes(cfg: RunConfig) -> None:
    """v1 runs dist_config fsdp2 on one process too (sharding over one rank changes nothing); tuneforge's fsdp
    refuses one process, so a v1 run on one process trains unsharded, as it would under v1."""
    if cfg.train.fsdp and planned_processes(cfg) == 1:
        logger.info("%s: dist_config fsdp2 on one process shards nothing: training unsharded", cfg.source)
        cfg.train.fsdp, cfg.train.fsdp_config = None, None


def _stage(raw: dict[str, Any], source: str) -> str:
    """v1's command picks the stage; without one: dpo for preference pairs, rm for a model_class cls, else sft."""
    if raw.get("model_class") == "cls":
        return "rm"
    data = raw.get("train_dataset")
    if isinstance(data, str) and v1_datasets.holds_pairs(data):
        logger.info("%s: train_dataset %s holds preference pairs: stage dpo (add stage: rm for a reward model)",
                    source, data)
        return "dpo"
    return "sft"


def documented_rules() -> dict[str, str]:
    """Every v1 key path -> what it becomes, for the docs and tests."""
    out = {key: rule.doc for key, rule in TOP.items()}
    for key, plugins in PLUGINS.items():
        out[f"{key}.name"] = ", ".join(plugins) or f"none ({PLUGIN_ADVICE[key]})"
        for rules, _ in plugins.values():
            out.update({f"{key}.{sub}": rule.doc for sub, rule in rules.items()})
    return out
