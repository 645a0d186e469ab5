"""FSDP2: Hugging Face's `fsdp` and `fsdp_config` keys, read into the settings torch's fully_shard takes.

`fsdp` is true or words as Hugging Face writes them: one strategy (full_shard, shard_grad_op, hybrid_shard,
hybrid_shard_zero2) plus offload / auto_wrap. `fsdp_config` is a mapping or the path of a JSON file with
Hugging Face's FSDP2 keys (an `fsdp_` prefix, as accelerate writes them, is dropped). Every key is either read
(FsdpSettings), an FSDP1-only knob that FSDP2 has no use for (FSDP1_ONLY, accepted as Hugging Face accepts
it with version 2), or an error that says what to write instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tuneforge.config.schema import RunConfig
from tuneforge.errors import ConfigError
from tuneforge.flags import parse_flag

SHARDED_CHECKPOINT = "sharded"  # the torch.distributed.checkpoint folder inside an fsdp run's checkpoint-N
FSDP_WORDS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap")
# fsdp_config keys that only FSDP1 reads (Hugging Face ignores them with version 2 too)
FSDP1_ONLY = ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states")
FSDP_CONFIG_KEYS = (
    "version", "reshard_after_forward", "cpu_offload", "offload_params", "transformer_layer_cls_to_wrap",
    "auto_wrap_policy", "min_num_params", "activation_checkpointing", "state_dict_type",
    "cpu_ram_efficient_loading", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", *FSDP1_ONLY,
)


@dataclass(frozen=True)
class FsdpSettings:
    """What `fsdp` and `fsdp_config` ask of torch's fully_shard."""

    reshard_after_forward: bool = True  # full_shard (ZeRO-3); false: shard_grad_op (ZeRO-2)
    hybrid: bool = False  # hybrid_shard: shard within a node, replicate across nodes
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer states live on the CPU
    layer_classes: tuple[str, ...] = ()  # sharded one by one; () = the model's own (_no_split_modules)
    wrap_layers: bool = True  # auto_wrap_policy NO_WRAP: one unit, the whole model


def _flag(value: Any, key: str, fail) -> bool:
    flag = parse_flag(value)
    if flag is None:
        fail(f"fsdp_config: {key} must be true or false (got {value!r})")
    return bool(flag)


def _fsdp_config_mapping(raw: dict | str | None, fail) -> dict[str, Any]:
    """fsdp_config as a mapping (read from its JSON / YAML file when it is a path), fsdp_ prefixes dropped."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        path = Path(raw)
        if not path.is_file():
            fail(f"fsdp_config: {raw} is neither a mapping nor a file; give {{reshard_after_forward: true, ...}} "
                 f"or the path of a JSON file")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            fail(f"fsdp_config: {path} is not valid JSON / YAML: {e}")
        if not isinstance(raw, dict):
            fail(f"fsdp_config: {path} must hold a mapping of key: value")
    return {k[len("fsdp_"):] if k.startswith("fsdp_") else k: v for k, v in raw.items()}


def fsdp_settings(cfg: RunConfig) -> FsdpSettings | None:
    """The FSDP2 settings of cfg, or None when fsdp is off; a ConfigError names the key that cannot work."""
    t = cfg.train

    def fail(msg: str) -> None:
        raise ConfigError(f"{cfg.source}: {msg}", key="fsdp_config" if msg.startswith("fsdp_config") else "fsdp")

    if t.fsdp is None or t.fsdp is False or t.fsdp == []:
        if t.fsdp_config:
            fail("fsdp_config is set but fsdp is not; set fsdp: full_shard (or true), or drop fsdp_config")
        return None
    words = [] if t.fsdp is True else [w for item in t.fsdp for w in str(item).replace(",", " ").split()]
    unknown = [w for w in words if w not in FSDP_WORDS]
    if "no_shard" in unknown:
        fail("fsdp: no_shard keeps a full copy of the model on every process: that is DDP, which tuneforge uses "
             "without fsdp; drop fsdp")
    if unknown:
        fail(f"fsdp: {unknown[0]!r} is not one of {', '.join(FSDP_WORDS)}")
    strategies = [w for w in words if w not in ("offload", "auto_wrap")]
    if len(strategies) > 1:
        fail(f"fsdp: choose one sharding strategy, not {' and '.join(strategies)}")
    strategy = strategies[0] if strategies else "full_shard"
    conf = _fsdp_config_mapping(t.fsdp_config, fail)
    bad = sorted(k for k in conf if k not in FSDP_CONFIG_KEYS)
    if bad:
        fail(f"fsdp_config: unknown key {bad[0]!r}; tuneforge reads {', '.join(FSDP_CONFIG_KEYS[:10])}")
    if str(conf.get("version", 2)) != "2":
        fail(f"fsdp_config: version {conf['version']!r}: tuneforge runs FSDP2 (fully_shard) only; set version: 2 "
             f"or drop it")
    if str(conf.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper() not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"):
        fail(f"fsdp_config: auto_wrap_policy {conf['auto_wrap_policy']!r}: tuneforge shards layer by layer "
             f"(TRANSFORMER_BASED_WRAP, the default, with transformer_layer_cls_to_wrap) or the model as one unit "
             f"(NO_WRAP)")
    if int(conf.get("min_num_params", 0) or 0) > 0:
        fail("fsdp_config: min_num_params (size-based wrapping) is not supported; tuneforge shards each decoder "
             "layer (choose them with transformer_layer_cls_to_wrap); drop min_num_params")
    if str(conf.get("state_dict_type", "SHARDED_STATE_DICT")).upper() != "SHARDED_STATE_DICT":
        fail(f"fsdp_config: state_dict_type {conf['state_dict_type']!r}: fsdp checkpoints are always sharded "
             f"(torch.distributed.checkpoint) and the final model always a full Hugging Face folder; drop "
             f"state_dict_type or set SHARDED_STATE_DICT")
    for key in ("cpu_ram_efficient_loading", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):
        if _flag(conf.get(key, False), key, fail):
            fail(f"fsdp_config: {key} is not supported (every process loads the weights itself; no XLA); "
                 f"drop {key}")
    if "activation_checkpointing" in conf:
        wanted = _flag(conf["activation_checkpointing"], "activation_checkpointing", fail)
        current = cfg.model.disable_gradient_checkpointing  # null: on, per layer by memory
        if wanted == current or (current is None and not wanted):
            fail(f"fsdp_config: activation_checkpointing {str(wanted).lower()} contradicts "
                 f"disable_gradient_checkpointing {'null' if current is None else str(current).lower()}; "
                 f"set disable_gradient_checkpointing: {str(not wanted).lower()} to switch gradient checkpointing "
                 f"{'on' if wanted else 'off'}, and drop activation_checkpointing")
    layers = conf.get("transformer_layer_cls_to_wrap") or ()
    layers = tuple(x.strip() for x in (layers.split(",") if isinstance(layers, str) else layers) if x.strip())
    reshard = strategy in ("full_shard", "hybrid_shard")
    offload = "offload" in words
    for key in ("cpu_offload", "offload_params"):
        offload = offload or _flag(conf.get(key, False), key, fail)
    return FsdpSettings(
        reshard_after_forward=_flag(conf.get("reshard_after_forward", reshard), "reshard_after_forward", fail),
        hybrid=strategy.startswith("hybrid"),
        cpu_offload=offload,
        layer_classes=layers,
        wrap_layers=str(conf.get("auto_wrap_policy", "")).upper() != "NO_WRAP",
    )
