"""DeepSpeed ZeRO: the `deepspeed` key (a JSON file or a mapping), read and checked before any process starts.

A DeepSpeed config written for Hugging Face's Trainer (LlamaFactory's examples/deepspeed files among them) leaves
the values the trainer knows as "auto"; `filled_config` puts ours in: the batch sizes, gradient clipping, the
precision and the bucket sizes that depend on the model's hidden size. A number given instead of "auto" must
agree with our config, as Hugging Face requires too. tuneforge builds the optimizer and the learning-rate
schedule itself (optim, learning_rate, lr_scheduler_type, ...), so a config with its own "optimizer" or
"scheduler" section is refused with what to change.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneforge.config.schema import RunConfig
from tuneforge.errors import ConfigError

DEEPSPEED_CHECKPOINT = "deepspeed"  # the folder DeepSpeed's engine writes inside a checkpoint-N
DEEPSPEED_LAYOUT = "deepspeed_layout.json"  # beside it: the ZeRO stage and number of processes of its partitions
INSTALL = ("DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed>=0.19,<0.20' (on a machine without a GPU "
           "DeepSpeed runs with DS_ACCELERATOR=cpu)")
# where an "auto" may stand: the values filled_config knows (as Hugging Face's Trainer fills them)
AUTO_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "fp16.enabled", "bf16.enabled", "bfloat16.enabled", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
)
NEVER_PRINT = 2**31 - 1  # steps_per_print: the trainer logs the steps itself


@dataclass(frozen=True)
class ZeroSettings:
    """What the `deepspeed` config asks for, its "auto" values still open."""

    stage: int  # ZeRO stage 0-3: 1 partitions optimizer states, 2 also gradients, 3 also parameters
    offload_optimizer: bool
    offload_param: bool
    raw: dict[str, Any]
    source: str  # the file (or "the deepspeed mapping") for messages

    @property
    def partitions_weights(self) -> bool:
        return self.stage == 3


def _read(value: dict | str, fail: Callable[[str], None]) -> tuple[dict[str, Any], str]:
    if isinstance(value, dict):
        return copy.deepcopy(value), "the deepspeed mapping"
    path = Path(value).expanduser()
    if not path.is_file():
        fail(f"deepspeed: {value} is not a file; give the path of a DeepSpeed JSON config (e.g. "
             f"examples/deepspeed/ds_z3_config.json) or a mapping")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"deepspeed: {path} is not valid JSON: {e}")
    if not isinstance(raw, dict):
        fail(f"deepspeed: {path} must hold a JSON object")
    return raw, str(path)


def _get(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _autos(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose value is "auto"."""
    if not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        found += [path] if value == "auto" else _autos(value, path + ".")
    return found


def _device(section: Any) -> str:
    return str(section.get("device", "none")).lower() if isinstance(section, dict) else "none"


def deepspeed_settings(cfg: RunConfig) -> ZeroSettings | None:
    """The ZeRO settings of cfg (None without `deepspeed`); a ConfigError names what cannot work."""
    t, me = cfg.train, cfg.method

    def fail(msg: str) -> None:
        raise ConfigError(f"{cfg.source}: {msg}", key="deepspeed")

    if t.deepspeed in (None, "", False):
        return None
    if not isinstance(t.deepspeed, dict | str):
        fail(f"deepspeed must be the path of a DeepSpeed JSON config or a mapping (got {t.deepspeed!r})")
    raw, source = _read(t.deepspeed, fail)
    for section in ("optimizer", "scheduler"):
        if section in raw:
            what = "optim, learning_rate, weight_decay, adam_beta1/2, adam_epsilon" if section == "optimizer" \
                else "lr_scheduler_type, warmup_steps / warmup_ratio"
            fail(f"deepspeed: {source} has a {section!r} section; tuneforge builds the {section} from its own keys "
                 f"({what}), so remove the section from the DeepSpeed config")
    unknown_autos = [k for k in _autos(raw) if k not in AUTO_KEYS]
    if unknown_autos:
        fail(f"deepspeed: {source} sets {unknown_autos[0]} to \"auto\", which tuneforge cannot fill; give a value "
             f"(\"auto\" is filled for: {', '.join(AUTO_KEYS)})")
    zero = raw.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        fail(f"deepspeed: {source}: zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        fail(f"deepspeed: {source}: zero_optimization.stage must be 0, 1, 2 or 3 (got {stage!r})")
    offload_optimizer, offload_param = _device(zero.get("offload_optimizer")), _device(zero.get("offload_param"))
    if "nvme" in (offload_optimizer, offload_param):
        fail(f"deepspeed: {source}: offload to nvme needs DeepSpeed's async-io extension, which tuneforge does not "
             f"build; offload to \"cpu\" instead")
    if offload_param != "none" and stage != 3:
        fail(f"deepspeed: {source}: offload_param needs zero_optimization.stage 3 (parameters are only partitioned, "
             f"and so only offloadable, at stage 3); drop offload_param or set stage 3")
    mismatches = [
        f"{key} is {_get(raw, key)!r} but {ours} is {value!r}"
        for key, ours, value in (
            ("train_micro_batch_size_per_gpu", "per_device_train_batch_size", t.per_device_train_batch_size),
            ("gradient_accumulation_steps", "gradient_accumulation_steps", t.gradient_accumulation_steps),
            ("gradient_clipping", "max_grad_norm", t.max_grad_norm),
            ("fp16.enabled", "fp16", t.fp16),
            ("bf16.enabled", "bf16", t.bf16),
        )
        if _get(raw, key) not in (None, "auto") and _get(raw, key) != value
    ]
    if mismatches:
        fail(f"deepspeed: {source} disagrees with the training keys: {'; '.join(mismatches)}. Set them to \"auto\" "
             f"in the DeepSpeed config (tuneforge fills them) or make the two agree")
    if cfg.train.fsdp:
        fail("deepspeed and fsdp are two ways of sharding the same model; choose one (drop fsdp or deepspeed)")
    if stage == 3 and cfg.model.quantization_bit:
        fail("deepspeed ZeRO-3 partitions the weights, and bitsandbytes' quantized weights cannot be partitioned; "
             "for QLoRA use zero_optimization.stage 2, or fsdp")
    if stage == 3 and me.pissa_init:
        fail("deepspeed ZeRO-3 with pissa_init is not supported (the PiSSA conversion needs the whole adapter in one "
             "process); use zero_optimization.stage 2, or drop pissa_init")
    if importlib.util.find_spec("deepspeed") is None:
        fail(f"deepspeed is not installed: {INSTALL}")
    return ZeroSettings(stage, offload_optimizer != "none", offload_param != "none", raw, source)


def filled_config(settings: ZeroSettings, cfg: RunConfig, hidden_size: int | None, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config with every "auto" replaced by the value our config gives (as Hugging Face fills them)."""
    t = cfg.train
    ds = copy.deepcopy(settings.raw)
    global_batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size
    given = ds.get("train_batch_size")
    if given not in (None, "auto") and given != global_batch:
        raise ConfigError(
            f"{cfg.source}: deepspeed: {settings.source} has train_batch_size {given}, but per_device_train_batch_size "
            f"{t.per_device_train_batch_size} x gradient_accumulation_steps {t.gradient_accumulation_steps} x "
            f"{world_size} processes is {global_batch}; set train_batch_size to \"auto\"", key="deepspeed",
        )
    hidden = hidden_size or 0
    fills = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": t.per_device_train_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.max_grad_norm,
        "fp16.enabled": t.fp16,
        "bf16.enabled": t.bf16,
        "bfloat16.enabled": t.bf16,
        # Hugging Face's rule of thumb for the communication buckets, from the hidden size
        "zero_optimization.reduce_bucket_size": hidden * hidden or 5e8,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden) or 5e7,
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden or 1e5,
    }
    for key, value in fills.items():
        parent, _, leaf = key.rpartition(".")
        node = _get(ds, parent) if parent else ds
        if isinstance(node, dict) and (node.get(leaf) == "auto" or (not parent and leaf not in node)):
            node[leaf] = value
    if "bfloat16" not in ds:  # DeepSpeed's older name of the bf16 section
        ds.setdefault("bf16", {}).setdefault("enabled", t.bf16)
    ds.setdefault("fp16", {}).setdefault("enabled", t.fp16)
    ds.setdefault("steps_per_print", NEVER_PRINT)
    if settings.offload_optimizer:  # the optimizer is tuneforge's (torch's), stepping the offloaded fp32 partitions
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
    ds["zero_allow_untested_optimizer"] = True  # ZeRO partitions any torch optimizer's states
    return ds
