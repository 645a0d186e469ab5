"""Generation for evaluation: `tuneforge eval` with predict_with_generate (answers + BLEU / ROUGE) at several
per_device_eval_batch_size values, beside LlamaFactory 0.9.5's `do_predict` on the same rows.

    python benchmarks/predict_throughput.py [--peer] [--fp32] [--rows N] [--batch-sizes 1,8,16]
                                            [--max-new-tokens T] [--dataset-dir DIR]

Workload P1: the built-in SmolLM2-135M-Instruct (no adapter) answers the first N (64) instructions of
LlamaFactory's alpaca_en_demo, greedily, at most T (64) new tokens each, cutoff 512. Batch size 1 is generation
one prompt at a time (what the API server did before it batched); the others left-pad each batch (longest prompts
first). LlamaFactory runs at the largest batch size with its `smollm2` template and that template's default system
prompt written as the tokenizer's own template writes it (LlamaFactory's has a final period), so both see the same
prompt tokens and, greedy, write the same answers up to rounding in padded batches: the line reports how many are
identical. LlamaFactory's predict needs jieba, nltk and rouge-chinese; they are installed into the peer script's
venv if missing.

Each run is a child process; prints one JSON line per run (samples/s and runtime of the generation alone, as each
system's predict_results.json reports it; the run's peak RSS) and, with --peer, one with the ratios: tuneforge's
largest batch against LlamaFactory's and against tuneforge's batch of 1. Timing is measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from llamafactory_peer import SMOLLM_SYSTEM, peer_venv  # benchmarks/ is this script's folder

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "llamafactory"

P1 = {
    "model_name_or_path": "smollm2-135m-instruct",
    "stage": "sft",
    "do_predict": True,
    "predict_with_generate": True,
    "eval_dataset": "alpaca_en_demo",
    "cutoff_len": 512,
    "do_sample": False,
    "bf16": True,
}


def run_child(cmd: list, out: Path, **popen: object) -> tuple[float, float]:
    """Run cmd, its output in out/log.txt: (wall seconds, its own peak RSS in MiB). Exits naming the log if it
    fails."""
    start = time.time()
    with open(out / "log.txt", "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{cmd[0]} failed; see {out / 'log.txt'}")
    return time.time() - start, usage.ru_maxrss / 1024  # kilobytes on Linux


def run_tuneforge(cfg: dict, batch_size: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"tuneforge-p1-b{batch_size}-"))
    run = {**cfg, "per_device_eval_batch_size": batch_size, "output_dir": str(out / "run")}
    (out / "p1.json").write_text(json.dumps(run, indent=2))
    wall, peak = run_child([sys.executable, "-m", "tuneforge.cli", "eval", str(out / "p1.json")], out, cwd=ROOT)
    return line("tuneforge", batch_size, out / "run", wall, peak)


def run_peer(cfg: dict, batch_size: int, model_dir: str) -> dict:
    venv = peer_venv(model_dir, installed="import jieba, nltk, rouge_chinese",  # LlamaFactory's predict metrics
                     packages=("jieba", "nltk", "rouge-chinese"))
    out = Path(tempfile.mkdtemp(prefix=f"peer-p1-b{batch_size}-"))
    run = {**cfg, "model_name_or_path": model_dir, "do_train": False, "finetuning_type": "lora",
           "template": "smollm2", "default_system": SMOLLM_SYSTEM, "per_device_eval_batch_size": batch_size,
           "output_dir": str(out / "run"), "overwrite_output_dir": True, "preprocessing_num_workers": 1,
           "report_to": "none", "use_cpu": True}
    (out / "peer.yaml").write_text(yaml.safe_dump(run))  # its CLI cannot read a JSON config file
    env = {**os.environ, "PYTHONPATH": str(venv / "stubs"), "DISABLE_VERSION_CHECK": "1"}  # the peer script's
    cli = str(venv / "bin" / "llamafactory-cli")
    wall, peak = run_child([cli, "train", str(out / "peer.yaml")], out, cwd=out, env=env)
    return line("llamafactory-0.9.5", batch_size, out / "run", wall, peak)


def line(system: str, batch_size: int, run: Path, wall: float, peak_mb: float) -> dict:
    results = json.loads((run / "predict_results.json").read_text())
    return {"system": system, "workload": "P1", "batch_size": batch_size,
            "samples_per_sec": results["predict_samples_per_second"], "predict_runtime_s": results["predict_runtime"],
            "bleu4": round(results["predict_bleu-4"], 2), "rouge_l": round(results["predict_rouge-l"], 2),
            "peak_rss_mb": round(peak_mb, 1), "wall_s": round(wall, 2), "out": str(run)}


def answers(run: str) -> list[str]:
    lines = (Path(run) / "generated_predictions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(row)["predict"].strip() for row in lines]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help="run LlamaFactory's predict at the largest batch size")
    parser.add_argument("--fp32", action="store_true", help="both systems in fp32 (CPUs without native bf16)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dataset-dir", default=str(DEFAULT_DATA))
    args = parser.parse_args()
    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    cfg = {**P1, "dataset_dir": args.dataset_dir, "max_samples": args.rows, "max_new_tokens": args.max_new_tokens,
           "bf16": not args.fp32}
    ours = [run_tuneforge(cfg, b) for b in sizes]
    for result in ours:
        print(json.dumps(result), flush=True)
    if not args.peer:
        return
    from tuneforge.model.hub import builtin_model_dir

    peer = run_peer(cfg, sizes[-1], str(builtin_model_dir()))
    print(json.dumps(peer))
    mine, theirs = answers(ours[-1]["out"]), answers(peer["out"])
    same = sum(a == b for a, b in zip(mine, theirs, strict=True))
    print(json.dumps({"workload": "P1", "batch_size": sizes[-1],
                      "samples_per_sec_ratio": ratio(ours[-1]["samples_per_sec"], peer["samples_per_sec"]),
                      "batched_over_one_at_a_time": ratio(ours[-1]["samples_per_sec"], ours[0]["samples_per_sec"]),
                      "peak_rss_ratio": ratio(ours[-1]["peak_rss_mb"], peer["peak_rss_mb"]),
                      "identical_answers": f"{same}/{len(theirs)}"}))


if __name__ == "__main__":
    main()
