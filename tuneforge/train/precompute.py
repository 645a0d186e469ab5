"""Reference log-probs computed once before training (`precompute_ref_log_probs`), and cached.

DPO and KTO compare the policy with a frozen reference on every step. The reference never changes, so its
log-prob of each sequence can be computed once, stored as columns of the tokenized rows, and the reference
dropped from memory; every later step then runs one forward (the policy's) instead of two. The values go
to a safetensors file beside the tokenized data, keyed by the data and the reference, so the next run
with the same data and reference reuses them.

The values come from the same function as the on-the-fly reference (objectives.reference_logps), on the
same collated batches and under the same autocast, so training sees the same numbers either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tuneforge.batch import Batch
from tuneforge.train.objectives import reference_logps

logger = logging.getLogger(__name__)

def cache_key(dataset: Any, reference_identity: dict[str, Any]) -> str:
    """What the values depend on: the rows (their datasets fingerprint and length) and the reference."""
    material = {"rows": [dataset._fingerprint, len(dataset)], "reference": reference_identity}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


@torch.no_grad()
def compute(
    dataset: Any,
    reference: Any,
    policy: torch.nn.Module,
    collator: Callable[[list[dict[str, Any]]], Batch],
    *,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
) -> torch.Tensor:
    """(rows, 2) float32: the reference log-prob of each row's two sequences."""
    out = torch.empty((len(dataset), 2), dtype=torch.float32)
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batch = collator(rows).to(device)
        with autocast():
            values = reference_logps(reference, policy, batch).float().cpu()
        n = len(rows)
        out[start : start + n, 0], out[start : start + n, 1] = values[:n], values[n:]
    return out


def with_reference_logps(
    splits: dict[str, Any],
    columns: tuple[str, str],
    cache_dir: Path,
    reference_identity: dict[str, Any],
    compute_split: Callable[[Any], torch.Tensor],
) -> dict[str, Any]:
    """Each split with its two reference columns added (the names of the rows' first and second
    sequence, in the collated order), read from the cache or computed and saved."""
    out = {}
    for name, dataset in splits.items():
        if dataset is None:
            out[name] = None
            continue
        path = cache_dir / f"ref_logps-{cache_key(dataset, reference_identity)}.safetensors"
        if path.is_file():
            values = load_file(path)["logps"]
            logger.info("reference log-probs (%s, %d rows): cache hit %s", name, len(dataset), path)
        else:
            logger.info("precomputing reference log-probs of %d %s rows", len(dataset), name)
            values = compute_split(dataset)
            tmp = path.with_name(f".tmp-{path.name}")
            save_file({"logps": values.contiguous()}, tmp)
            os.replace(tmp, path)
        first, second = columns
        dataset = dataset.remove_columns([c for c in (first, second) if c in dataset.column_names])
        out[name] = dataset.add_column(first, values[:, 0].tolist()).add_column(second, values[:, 1].tolist())
    return out
