"""Held-out rewards of an RL stage's policy (grpo, ppo): sample answers to the eval prompts and score them with the
run's rewards, as training's evaluation does.

The prompts come from the training data pipeline (the eval split, else every row of dataset); each gets
num_generations completions, sampled with the same per-prompt seeds as training's evaluation (from `seed`), so
`seed=1`, `seed=2`, ... give independent samples of the same figures (the run-to-run noise). Results:
eval_results.json (eval_reward, eval_reward_std, eval_rewards/NAME/mean and /std, completion lengths) and
generated_completions.jsonl (each prompt, completion and its rewards) in save_dir or output_dir.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from tuneforge.batch import Layout, sample_seed
from tuneforge.errors import DataError
from tuneforge.train.objectives.sampling import SamplingObjective

logger = logging.getLogger(__name__)

RESULTS_FILE = "eval_results.json"
COMPLETIONS_FILE = "generated_completions.jsonl"


class RewardSampler(SamplingObjective):
    """What the RL objectives sample and score with, without a loss."""

    def __init__(self, rollouts: Any, num_generations: int, max_completion_length: int) -> None:
        self.rollouts, self.num_generations, self.max_completion_length = rollouts, num_generations, max_completion_length
        self.samples = []


@torch.no_grad()
def evaluate_rewards(cfg: Any, out_dir: Path) -> dict[str, Any]:
    from dataclasses import replace

    from tuneforge.config.rl import resolved_rl
    from tuneforge.data.collate import Collator
    from tuneforge.model.inference import load_inference_model
    from tuneforge.model.packed_linear import pack_for_generation
    from tuneforge.rollout import Rollouts
    from tuneforge.train.trainer import add_into, metric_means
    from tuneforge.workflow import check_reward_columns, prepare_data

    tokenizer, splits = prepare_data(cfg)  # bad rows, templates and missing reward columns fail before the weights load
    check_reward_columns(cfg, splits)
    rows, which = (splits.eval, "the eval split") if splits.eval is not None else (splits.train, "dataset")
    if rows is None or len(rows) == 0:
        raise DataError(f"{cfg.source}: no evaluation prompts; check eval_dataset / dataset and max_samples")
    rl = resolved_rl(cfg)
    logger.info("rewards on %s: %d prompts x %d completions", which, len(rows), rl.num_generations)
    model = load_inference_model(cfg, value_head=False)
    pack_for_generation(model)
    sampler = RewardSampler(Rollouts(cfg, tokenizer, splits.processor), rl.num_generations, rl.max_completion_length)
    collator = Collator(tokenizer.pad_token_id, Layout(rows="prompt"))
    size, sums, counts, lines = cfg.train.per_device_eval_batch_size, {}, {}, []
    started = time.perf_counter()
    for start in range(0, len(rows), size):
        indices = list(range(start, min(start + size, len(rows))))
        batch = collator([rows[i] for i in indices])  # the seeds of training's evaluation, row for row
        batch = replace(batch, sample_seeds=tuple(sample_seed(cfg.train.seed, "eval", i) for i in indices))
        r = sampler._sample(model, batch)
        metrics, metric_counts = sampler._rollout_metrics(r)
        add_into(sums, metrics)
        add_into(counts, metric_counts)
        names = sampler.rollouts.reward_names
        for b, text, total, scores in zip(r["owners"], r["texts"], r["rewards"].tolist(), r["per_reward"].tolist(),
                                          strict=True):
            lines.append({"prompt": r["prompt_texts"][b], "completion": text, "reward": total,
                          "rewards": {n: None if math.isnan(v) else v for n, v in zip(names, scores, strict=True)}})
    runtime = time.perf_counter() - started
    means = sampler.finish_metrics(metric_means(sums, counts, units=0), evaluating=True)  # every metric has a count
    results = {f"eval_{k}": v for k, v in means.items()}
    results.update(eval_samples=len(rows), eval_completions=len(lines), eval_runtime=round(runtime, 3))
    out_dir.mkdir(parents=True, exist_ok=True)
    path, completions = out_dir / RESULTS_FILE, out_dir / COMPLETIONS_FILE
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    completions.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    per_reward = ", ".join(f"{k.removeprefix('eval_rewards/').removesuffix('/mean')} {v:.4f}"
                           for k, v in results.items() if k.startswith("eval_rewards/") and k.endswith("/mean"))
    summary = [
        f"eval_reward {results['eval_reward']:.4f} (std {results.get('eval_reward_std_all', 0.0):.4f}) over "
        f"{len(lines)} completions of {len(rows)} prompts ({which}, stage {cfg.method.stage}, seed {cfg.train.seed})"
        + (f": {per_reward}" if per_reward else ""),
        f"results in {path}, completions in {completions}",
    ]
    return {**results, "files": [str(path), str(completions)], "summary": summary}
