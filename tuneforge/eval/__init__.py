"""`tuneforge eval`: measure a model (or base + adapter) with the same config file it was trained with.

One dispatch, three kinds of evaluation:
1. `task` set: a multiple-choice benchmark in the MMLU layout (eval/mc.py, eval/benchmark.py) ->
   results.json, results.log in save_dir (else output_dir, else ./eval_<task>).
2. `predict_with_generate` or `do_predict`: generate an answer for every eval row and score it
   (eval/predict.py) -> generated_predictions.jsonl, predict_results.json in save_dir or output_dir.
3. a stage that samples (grpo, ppo): held-out rewards of sampled answers to the eval prompts (eval/rewards.py)
   -> eval_results.json, generated_completions.jsonl there.
4. otherwise: the loss / perplexity on the eval data (eval/loss.py) -> eval_results.json there.

`evaluate(cfg)` returns the figures, "files" (the paths written) and "summary" (lines for the CLI). It
evaluates the model and adapters cfg names; the CLI (`tuneforge eval`, and `tuneforge train` with
do_train: false) first points a training YAML at its own finished run (model.inference.use_trained_output).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tuneforge.errors import ConfigError
from tuneforge.stages import STAGES

logger = logging.getLogger(__name__)

__all__ = ["eval_kind", "evaluate", "output_folder"]


def eval_kind(cfg: Any) -> str:
    """"mc", "predict", "rewards" or "loss": what evaluate(cfg) runs."""
    if cfg.eval.task:
        return "mc"
    if cfg.train.predict_with_generate or cfg.train.do_predict:
        return "predict"
    stage = STAGES.get(cfg.method.stage)
    if stage is not None and stage.samples:
        return "rewards"
    return "loss"


def output_folder(cfg: Any, kind: str) -> Path:
    """Where the results go: save_dir, else output_dir (else ./eval_<task> for a benchmark)."""
    folder = cfg.eval.save_dir or cfg.train.output_dir
    if folder:
        return Path(folder)
    if kind == "mc":
        return Path(f"eval_{cfg.eval.task}")
    raise ConfigError(f"{cfg.source}: set save_dir (or output_dir): the folder for the evaluation results")


def check(cfg: Any, kind: str) -> None:
    """Config problems of an evaluation, before any data or model loads."""
    from tuneforge.eval.mc import FEWSHOT_TEMPLATE

    e, src = cfg.eval, cfg.source
    if e.batch_size < 1:
        raise ConfigError(f"{src}: batch_size must be >= 1 (got {e.batch_size})")
    if e.n_shot < 0:
        raise ConfigError(f"{src}: n_shot must be >= 0 (got {e.n_shot})")
    if cfg.model.template == FEWSHOT_TEMPLATE and kind != "mc":
        raise ConfigError(
            f"{src}: template fewshot is LlamaFactory's plain-text format for multiple-choice benchmarks "
            f"(task: ...); to measure the {'answers' if kind == 'predict' else 'loss'} use the template the "
            f"model was trained with (leave template unset for the tokenizer's own chat template)"
        )


def evaluate(cfg: Any) -> dict[str, Any]:
    """Run the evaluation cfg asks for (see the module docstring); returns figures, files and summary."""
    kind = eval_kind(cfg)
    check(cfg, kind)
    out_dir = output_folder(cfg, kind)
    logger.info("evaluation: %s, results to %s", kind, out_dir)
    if kind == "mc":
        from tuneforge.eval.mc import evaluate_mc

        result = evaluate_mc(cfg, out_dir)
    elif kind == "predict":
        from tuneforge.eval.predict import predict

        result = predict(cfg, out_dir)
    elif kind == "rewards":
        from tuneforge.eval.rewards import evaluate_rewards

        result = evaluate_rewards(cfg, out_dir)
    else:
        from tuneforge.eval.loss import evaluate_loss

        result = evaluate_loss(cfg, out_dir)
    return {"kind": kind, "output_dir": str(out_dir), **result}
