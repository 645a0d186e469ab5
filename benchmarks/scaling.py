"""W1 on one process and on several, under each multi-process strategy: throughput and memory per rank, as JSON.

    python benchmarks/scaling.py [--processes 2] [--strategies ddp,fsdp,zero3] [--fp32] [--dataset-dir DIR]
                                 [key=value ...]

Every run keeps W1's global batch (4 samples per step): one process with batch 4, N processes with batch 4 / N
each (FORCE_TORCHRUN=1 NPROC_PER_NODE=N, gloo on a CPU), so they take the same steps on the same rows and end at
the same loss. The strategies: ddp (a whole copy per process), fsdp (fsdp=full_shard: FSDP2, each process holds
1/N of the weights, gradients and optimizer states), zero2 / zero3 (DeepSpeed with examples/deepspeed's configs).
Memory per rank is each process's peak during training (tuneforge's train_peak_memory_mb_per_rank: the resident
set on a CPU, allocated memory on CUDA); the peak over the whole process, loading included, of the largest process
is read by a small wrapper process (RUSAGE_CHILDREN). Prints one JSON line per run and a last one with the ratios
against the single process. Timing is measured, never asserted.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import DEFAULT_DATA, ROOT, W1  # noqa: E402

# runs argv[2:], then writes the largest peak RSS among its descendants to argv[1]
PEAK_WRAPPER = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[2:]).returncode; "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(code)"
)


STRATEGIES = {
    "ddp": [],
    "fsdp": ["fsdp=full_shard"],
    "zero2": ["deepspeed=examples/deepspeed/ds_z2_config.json"],
    "zero3": ["deepspeed=examples/deepspeed/ds_z3_config.json"],
}


def run(processes: int, dataset_dir: str, overrides: list[str], strategy: str = "one process") -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"tuneforge-scaling-{processes}-"))
    batch = W1["per_device_train_batch_size"] // processes
    cfg = {**W1, "dataset_dir": dataset_dir, "output_dir": str(out / "run"), "per_device_train_batch_size": batch}
    (out / "workload.json").write_text(json.dumps(cfg, indent=2))
    env = dict(os.environ)
    if processes > 1:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
    peak_file = out / "peak_kb"
    cmd = [sys.executable, "-c", PEAK_WRAPPER, str(peak_file),
           sys.executable, "-m", "tuneforge.cli", "train", str(out / "workload.json"), *overrides]
    start = time.time()
    with open(out / "log.txt", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    wall = time.time() - start
    if code != 0:
        sys.exit(f"tuneforge failed ({code}); see {out / 'log.txt'}")
    res = json.loads((out / "run" / "train_results.json").read_text())
    peak_kb = int(peak_file.read_text())  # kilobytes on Linux
    return {
        "strategy": strategy,
        "processes": processes,
        "per_device_batch": batch,
        "effective_tokens_per_sec": res.get("train_tokens_per_second"),
        "train_runtime_s": res.get("train_runtime"),
        "wall_s": round(wall, 1),
        "training_peak_memory_per_rank_mb": res.get("train_peak_memory_mb_per_rank", [res.get("train_peak_memory_mb")]),
        "peak_rss_largest_process_with_loading_mb": round(peak_kb / 1024, 1),
        "train_loss": res.get("train_loss"),
        "log": str(out / "log.txt"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--dataset-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--strategies", default="ddp,fsdp,zero3", help=f"comma-separated, of {', '.join(STRATEGIES)}")
    parser.add_argument("--fp32", action="store_true", help="fp32 (for CPUs without native bf16)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    if W1["per_device_train_batch_size"] % args.processes:
        sys.exit(f"--processes must divide W1's batch of {W1['per_device_train_batch_size']}")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        sys.exit(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    overrides = (["bf16=false"] if args.fp32 else []) + args.overrides
    one = run(1, args.dataset_dir, overrides)
    print(json.dumps(one), flush=True)
    ratios = {}
    for strategy in strategies:
        many = run(args.processes, args.dataset_dir, overrides + STRATEGIES[strategy], strategy)
        print(json.dumps(many), flush=True)
        ratios[strategy] = {
            "tokens_per_sec_ratio": round(many["effective_tokens_per_sec"] / one["effective_tokens_per_sec"], 3),
            "largest_rank_memory_ratio": round(
                max(many["training_peak_memory_per_rank_mb"]) / one["training_peak_memory_per_rank_mb"][0], 3
            ),
            "same_train_loss": abs(many["train_loss"] - one["train_loss"]) < 1e-4,
        }
    print(json.dumps({"processes": args.processes, "against_one_process": ratios}))


if __name__ == "__main__":
    main()
