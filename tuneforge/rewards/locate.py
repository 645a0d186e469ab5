"""Where the reward model of a config is, checked on the file system before anything loads.

A stage rm run saves value_head.safetensors beside what it trained: the model folder (finetuning_type full)
or the adapter folder (lora). reward_model_type full: reward_model is that model folder. lora: reward_model
is the base and reward_model_adapters the rm adapter folder(s), the last holding the head; or reward_model is
the rm adapter folder itself, and its adapter_config.json names the base (base_model_name_or_path).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tuneforge.errors import ConfigError

if TYPE_CHECKING:
    from tuneforge.config.schema import RLArgs, RunConfig

VALUE_HEAD_FILE = "value_head.safetensors"  # tuneforge.model.value_head's name; that module imports torch
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class RewardModelLocation:
    """base: the model to load (a folder, hub id or alias); adapters: the rm adapter folders merged into it
    (none for a full reward model); head_key: the config key naming the folder with the value head."""

    base: str
    adapters: tuple[str, ...]
    head_key: str

    @property
    def head_folder(self) -> str:
        return self.adapters[-1] if self.adapters else self.base


def _is_adapter_folder(name: str) -> bool:
    return (Path(name).expanduser() / ADAPTER_CONFIG).is_file()


def _looks_like_hub_id(name: str) -> bool:  # as tuneforge.model.hub decides it
    return not name.startswith((".", "/", "~")) and name.count("/") == 1


def reward_model_location(rl: RLArgs, *, source: str) -> RewardModelLocation:
    """The reward model of a lora / full reward_model_type; ConfigError naming the keys when the keys do not
    describe one."""
    name, adapters = rl.reward_model, tuple(rl.reward_model_adapters or ())
    assert name is not None and rl.reward_model_type != "api"

    def fail(message: str, key: str | tuple[str, ...]) -> ConfigError:
        return ConfigError(f"{source}: {message}", key=key)

    if rl.reward_model_type == "full":
        if adapters:
            raise fail("reward_model_type full loads reward_model as a whole model, so reward_model_adapters does "
                       "not apply: drop it, or set reward_model_type: lora", ("reward_model_adapters", "reward_model_type"))
        if _is_adapter_folder(name) and not (Path(name).expanduser() / "config.json").is_file():
            raise fail(f"reward_model {name} is a lora adapter folder ({ADAPTER_CONFIG}): set reward_model_type: lora",
                       ("reward_model_type", "reward_model"))
        return RewardModelLocation(name, (), "reward_model")
    if _is_adapter_folder(name):
        if adapters:
            raise fail(f"reward_model {name} is itself an adapter folder, and reward_model_adapters names more: give "
                       f"either the rm adapter folder as reward_model, or its base as reward_model and the adapter "
                       f"folders as reward_model_adapters", ("reward_model", "reward_model_adapters"))
        return RewardModelLocation(_adapter_base(name, source), (name,), "reward_model")
    if adapters:
        return RewardModelLocation(name, adapters, "reward_model_adapters")
    if (Path(name).expanduser() / VALUE_HEAD_FILE).is_file():
        raise fail(f"reward_model {name} holds a whole reward model (a full rm run's output): set "
                   f"reward_model_type: full", "reward_model_type")
    raise fail("reward_model_type lora needs the rm adapter: set reward_model_adapters to the output folder of a "
               "stage rm lora run (reward_model is then its base), or point reward_model at that folder",
               ("reward_model_adapters", "reward_model"))


def _adapter_base(folder: str, source: str) -> str:
    path = Path(folder).expanduser() / ADAPTER_CONFIG
    try:
        base = json.loads(path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{source}: cannot read {path} (reward_model): {e}", key="reward_model") from None
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{source}: {path} names no base_model_name_or_path: set reward_model to the base model "
                          f"and reward_model_adapters to {folder}", key=("reward_model", "reward_model_adapters"))
    return base


def check_reward_model_files(cfg: RunConfig) -> None:
    """ConfigError when the reward model's folders (those on this machine) lack what loading it needs."""
    rl, source = cfg.rl, cfg.source
    where = reward_model_location(rl, source=source)
    for adapter in where.adapters:
        path = Path(adapter).expanduser()
        if path.exists() and not (path / ADAPTER_CONFIG).is_file():
            raise ConfigError(f"{source}: {adapter} ({where.head_key}) has no {ADAPTER_CONFIG}: it is not an adapter "
                              f"folder; give the output folder of a stage rm lora run", key=where.head_key)
    head = Path(where.head_folder).expanduser()
    if head.is_dir():
        if not (head / VALUE_HEAD_FILE).is_file():
            raise ConfigError(f"{source}: {head} ({where.head_key}) has no {VALUE_HEAD_FILE}, so it is not a reward "
                              f"model: give the output folder of a stage rm run", key=where.head_key)
    elif not _looks_like_hub_id(where.head_folder):  # a hub id is fetched, and its head checked, when it loads
        raise ConfigError(f"{source}: the reward model folder {head} ({where.head_key}) does not exist",
                          key=where.head_key)
    bits = rl.reward_model_quantization_bit
    if bits is not None:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"{source}: reward_model_quantization_bit needs bitsandbytes: pip install "
                              f"'tuneforge[qlora]', or drop the key", key="reward_model_quantization_bit")
        if len(where.adapters) > 1:
            raise ConfigError(f"{source}: a quantized reward model cannot take merged adapters, so it takes one "
                              f"adapter folder (got {len(where.adapters)}): drop reward_model_quantization_bit or "
                              f"merge the adapters first", key=("reward_model_quantization_bit", "reward_model_adapters"))
