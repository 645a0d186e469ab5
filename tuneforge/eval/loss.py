"""Loss and perplexity of a model (or base + adapter) on evaluation data, as training measures eval_loss.

The rows come from the training data pipeline (same encoder, template, cutoff_len and packing as the
config trains with): the eval split when there is one (eval_dataset, or the val_size hold-out that training
evaluated on), else every row of dataset. The loss is the lm objective's: next-token cross-entropy summed
over the supervised tokens of all rows, divided by their count (a token-weighted mean, not a mean of
per-row means); perplexity = exp(loss). The weights run in infer_dtype (auto: fp32 on CPU).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from tuneforge.errors import ConfigError, DataError
from tuneforge.stages import stage_of, stages_where, words

logger = logging.getLogger(__name__)

RESULTS_FILE = "eval_results.json"


@torch.no_grad()
def token_loss(model: torch.nn.Module, rows: Any, collator: Any, batch_size: int, accuracy: bool = False
               ) -> tuple[float, int, float, int]:
    """(summed loss, supervised tokens, summed per-sample accuracy, samples) of token rows under the lm objective,
    batch_size rows at a time (the accuracy figures are 0 unless accuracy: compute_accuracy)."""
    from tuneforge.train.objectives import LMObjective

    objective = LMObjective(accuracy=accuracy)
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in rows["input_ids"]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # similar lengths share a batch
    loss_sum, units, right, samples = 0.0, 0, 0.0, 0
    for start in range(0, len(order), batch_size):
        batch = collator([rows[i] for i in order[start : start + batch_size]])
        units += objective.count(batch)
        out = objective(model, batch.to(device))
        loss_sum += float(out.loss_sum)
        right += float(out.metrics.get("accuracy", 0.0))
        samples += int(out.counts.get("accuracy", 0))
    return loss_sum, units, right, samples


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def evaluate_loss(cfg: Any, out_dir: Path) -> dict[str, Any]:
    """eval_loss, perplexity, eval_tokens, eval_samples of cfg's model on its eval data -> eval_results.json."""
    import json

    from tuneforge.data.collate import Collator
    from tuneforge.model.inference import load_inference_model
    from tuneforge.model.multimodal import rope_positions
    from tuneforge.workflow import batch_layout, prepare_data

    d = cfg.data
    if not stage_of(cfg.method.stage).perplexity:
        raise ConfigError(
            f"{cfg.source}: tuneforge eval measures the language-model loss of stages "
            f"{words(stages_where(lambda s: s.perplexity))}; stage {cfg.method.stage} has another objective "
            f"(evaluate it with eval_strategy while training), or set stage: sft to measure the loss of the answers"
        )
    if not (d.dataset or d.eval_dataset or d.tokenized_path):
        raise ConfigError(f"{cfg.source}: set eval_dataset (or dataset) to the data to measure the loss on, "
                          f"or task to run a multiple-choice benchmark")
    tokenizer, splits = prepare_data(cfg)  # bad rows and templates fail before the weights load
    rows, which = (splits.eval, "the eval split") if splits.eval is not None else (splits.train, "dataset")
    if rows is None or len(rows) == 0:
        raise DataError(f"{cfg.source}: no evaluation rows; check eval_dataset / dataset and max_samples")
    logger.info("loss on %s: %d rows", which, len(rows))
    model = load_inference_model(cfg, value_head=False)
    collator = Collator(tokenizer.pad_token_id, batch_layout(cfg, splits),  # padded, packed as the data is
                        rope=rope_positions(model) if splits.processor is not None else None)
    started = time.perf_counter()
    # eval_on_each_dataset: each eval dataset's rows apart (training's eval_<name>_ figures), then all together
    parts = splits.stats.get("eval_parts") if splits.eval is not None else None
    sums = {name: token_loss(model, rows.select(range(start, stop)), collator, cfg.train.per_device_eval_batch_size,
                             cfg.train.compute_accuracy)
            for name, (start, stop) in (parts or {"": (0, len(rows))}).items()}
    runtime = time.perf_counter() - started
    loss_sum, units, right, samples = (sum(column) for column in zip(*sums.values(), strict=True))
    if units == 0:
        raise DataError(f"{cfg.source}: the evaluation rows have no supervised tokens (every label is -100)")
    loss = loss_sum / units
    results = {
        "eval_loss": loss,
        "perplexity": _perplexity(loss),
        "eval_tokens": units,
        "eval_samples": len(rows),
        "eval_runtime": round(runtime, 3),
        "eval_samples_per_second": round(len(rows) / runtime, 3) if runtime > 0 else 0.0,
    }
    if samples:
        results["eval_accuracy"] = right / samples
    for name, (part_sum, part_units, part_right, part_samples) in sums.items() if parts else ():
        if part_units:
            results.update({f"eval_{name}_loss": part_sum / part_units,
                            f"eval_{name}_perplexity": _perplexity(part_sum / part_units)})
        if part_samples:
            results[f"eval_{name}_accuracy"] = part_right / part_samples
        results[f"eval_{name}_tokens"] = part_units
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    summary = [
        f"eval_loss {loss:.4f}, perplexity {results['perplexity']:.4f} over {units} supervised tokens "
        f"({len(rows)} rows of {which}, stage {cfg.method.stage})"
        + (f", accuracy {results['eval_accuracy']:.4f}" if "eval_accuracy" in results else ""),
        f"results in {path}",
    ]
    return {**results, "files": [str(path)], "summary": summary}
