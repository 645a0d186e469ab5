"""What each optimizer's state costs on the built-in model (full fine-tuning): one step on a short random batch,
then the bytes of every tensor its state_dict holds (moments, GaLore / APOLLO projections, BAdam's fp32 block copy).

    python benchmarks/optimizer_memory.py [name ...]     # names: the keys of VARIANTS (default: all)
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from tuneforge.config import from_dict
from tuneforge.model.load import load_model
from tuneforge.train.optim import build_optimizer

VARIANTS: dict[str, dict[str, Any]] = {
    "adamw_torch": {},
    "galore (rank 16)": {"use_galore": True},
    "galore (rank 128)": {"use_galore": True, "galore_rank": 128},
    "galore layerwise (rank 16)": {"use_galore": True, "galore_layerwise": True, "max_grad_norm": 0},
    "apollo (rank 16)": {"use_apollo": True},
    "badam (layer)": {"use_badam": True, "bf16": True},
    "adam_mini": {"use_adam_mini": True},
    "muon": {"use_muon": True},
    "pure_bf16 adamw_torch": {"pure_bf16": True},
}


def tensor_bytes(value: Any, seen: set[int]) -> int:
    """Bytes of the tensors in a nested state (dicts, lists, projector objects), each storage once."""
    if isinstance(value, torch.Tensor):
        key = value.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return value.untyped_storage().nbytes()
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    if hasattr(value, "__dict__"):
        return tensor_bytes(vars(value), seen)
    return 0


def measure(name: str, keys: dict[str, Any]) -> None:
    cfg = from_dict({"model_name_or_path": "smollm2-135m-instruct", "finetuning_type": "full", "dataset": ["x"],
                     "output_dir": "/tmp/optimizer-memory", "disable_gradient_checkpointing": True, **keys})
    torch.manual_seed(0)
    model = load_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    ids = torch.randint(100, 10000, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = tensor_bytes(optimizer.state_dict(), set())
    print(f"{name}: state {state / 2**20:.0f} MiB ({state / params:.2f} bytes a parameter), weights "
          f"{weights / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    for variant in sys.argv[1:] or VARIANTS:
        measure(variant, VARIANTS[variant])
