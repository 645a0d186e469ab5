"""GRPO throughput on workload R1, beside TRL's GRPOTrainer on the same workload (peer-trl-grpo.sh).

The peer script, ../shared/bench/peer-trl-grpo.sh, runs TRL on R1, so the two can be set side by side in one
sitting.

    python benchmarks/rl_throughput.py [--peer] [--fp32] [--dataset-dir DIR] [key=value ...]

R1 (the peer script's docstring defines it): the built-in SmolLM2-135M-Instruct, LoRA rank 8 on all linear
layers, the first 32 instructions of alpaca_en_demo as prompts (max_samples keeps a dataset's first rows, in
file order; both trainers then shuffle them with seed 42, each its own way), 4 completions per prompt of at
most 64 new tokens sampled at temperature 1.0 (top_p 1.0, top_k 0), 16 completions per step (4 prompts), 8
steps, beta 0, lr 1e-5, seed 42, one reward: -|words - 20| / 20 (benchmarks/rewards_r1.py). Both run in bf16
unless --fp32 (for CPUs without native bf16, where bf16 is emulated).

Runs `tuneforge train` in a child process (so peak RSS is the whole run's) and prints one JSON line with the
peer's keys: completions/s (steps x completions per step / train_runtime), train_runtime, peak RSS, the mean
reward of the first and last step and the last step's mean completion length (from trainer_log.jsonl). With
--peer it then runs the peer script on the built-in model's folder with the same values (overrides of steps,
prompts, generations, length, batch, lr and seed are passed on to it) and prints its line and one with the
ratios. The peer's venv is $PEER_TRL_VENV, else the peer script's own default (built on first use). Timing is
measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from train_throughput import train_child  # benchmarks/ is this script's folder

from tuneforge.config import parse_overrides

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "llamafactory"
PEER_SCRIPT = ROOT.parent / "shared" / "bench" / "peer-trl-grpo.sh"
REWARD = f"{ROOT / 'benchmarks' / 'rewards_r1.py'}:twenty_words"  # absolute: the config is written elsewhere

# the peer script's defaults, key for key (its keys: steps, prompts, generations, max_new, batch, lr, seed)
R1 = {
    "model_name_or_path": "smollm2-135m-instruct",
    "stage": "grpo",
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_target": "all",
    "dataset": "alpaca_en_demo",
    "max_samples": 32,
    "cutoff_len": 1024,
    "overwrite_cache": True,
    "num_generations": 4,
    "max_completion_length": 64,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "reward_funcs": [REWARD],
    "beta": 0.0,
    "per_device_train_batch_size": 4,  # prompts: 4 x 4 = 16 completions per step
    "gradient_accumulation_steps": 1,
    "learning_rate": 1e-5,
    "lr_scheduler_type": "linear",
    "max_steps": 8,
    "bf16": True,
    "seed": 42,
    "logging_steps": 1,
    "save_strategy": "no",
    "overwrite_output_dir": True,
    "report_to": "none",
    "disable_tqdm": True,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--peer", action="store_true", help=f"run {PEER_SCRIPT.name} after tuneforge, then compare")
    parser.add_argument("--fp32", action="store_true",
                        help="both systems in fp32 (for CPUs without native bf16, where bf16 is emulated)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    cfg = {**R1, "dataset_dir": args.dataset_dir, **parse_overrides(args.overrides)}
    if args.fp32:
        cfg["bf16"] = False
    # ours first: its peak RSS is read from RUSAGE_CHILDREN, which the peer would raise
    ours = run_tuneforge(cfg)
    peer = run_peer(cfg) if args.peer else None
    print(json.dumps(ours))
    if peer is not None:
        print(json.dumps(peer))
        print(json.dumps({
            "workload": "R1",
            "completions_per_sec_ratio": ratio(ours["completions_per_sec"], peer["completions_per_sec"]),
            "runtime_ratio": ratio(peer["train_runtime"], ours["train_runtime"]),
            "peak_rss_ratio": ratio(ours["peak_rss_mb"], peer["peak_rss_mb"]),
            "reward_last": {"tuneforge": ours["reward_last"], "peer": peer["reward_last"]},
            "reward_first": {"tuneforge": ours["reward_first"], "peer": peer["reward_first"]},
        }))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def completions_per_step(cfg: dict) -> int:
    return cfg["per_device_train_batch_size"] * cfg["num_generations"] * cfg["gradient_accumulation_steps"]


def peer_args(cfg: dict) -> list[str]:
    """The peer script's key=value arguments for the same workload."""
    values = {
        "steps": cfg["max_steps"], "prompts": cfg["max_samples"], "generations": cfg["num_generations"],
        "max_new": cfg["max_completion_length"], "batch": completions_per_step(cfg), "lr": cfg["learning_rate"],
        "seed": cfg["seed"], "bf16": str(bool(cfg["bf16"])).lower(), "dataset_dir": cfg["dataset_dir"],
    }
    return [f"{k}={v}" for k, v in values.items()]


def run_peer(cfg: dict) -> dict:
    """TRL's GRPOTrainer on the workload, on the built-in model's folder; its stderr goes to a log file."""
    from tuneforge.model.hub import builtin_model_dir

    env = dict(os.environ)
    log = Path(tempfile.mkdtemp(prefix="peer-trl-grpo-log-")) / "stderr.txt"
    env["PEER_LOG"] = str(log)
    cmd = ["bash", str(PEER_SCRIPT), str(builtin_model_dir()), *peer_args(cfg)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not done.stdout.strip():
        sys.exit(f"the peer failed ({done.returncode}); see {log}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_logs(output_dir: Path) -> list[dict]:
    """trainer_log.jsonl's training lines that carry the step's mean reward (evaluation lines do not)."""
    log = output_dir / "trainer_log.jsonl"
    if not log.is_file():
        return []
    return [r for r in map(json.loads, log.read_text().splitlines()) if r.get("reward") is not None]


def run_tuneforge(cfg: dict) -> dict:
    out, res, wall, peak_mb = train_child(cfg, "R1")
    steps = res.get("global_step", cfg["max_steps"])
    runtime = res.get("train_runtime")
    completions = steps * completions_per_step(cfg)
    logs = step_logs(out / "run")
    return {
        "system": "tuneforge",
        "workload": "R1",
        "steps": steps,
        "completions": completions,
        "train_runtime": runtime,
        "completions_per_sec": round(completions / runtime, 3) if runtime else None,
        "peak_rss_mb": round(peak_mb),
        "reward_first": logs[0]["reward"] if logs else None,
        "reward_last": logs[-1]["reward"] if logs else None,
        "mean_completion_length": logs[-1].get("completions/mean_length") if logs else None,
        "wall_s": round(wall, 2),
        "out": str(out),
    }


if __name__ == "__main__":
    main()
