"""Where the time of a training step goes: wall time by phase, and torch's operator profile of a few steps.

    python benchmarks/profile_train.py [--workload W1|W2|W3|W4|W5] [--steps 8] [--profile-steps 2] [key=value ...]

Runs the workload of benchmarks/train_throughput.py in this process (the built-in model, LlamaFactory's demo data)
and prints one JSON line: seconds per step by phase (data: collating and moving the batch; forward; backward;
optimizer: clipping, the step, zeroing), tokens/s of the steps after the first two, padding (tokens the batches
hold beyond their samples' own), and the operators that took the most self CPU time over --profile-steps steps
(by name, and by name and input shapes). docs/performance.md is written from it. Timing is measured, never
asserted; compare figures only within one sitting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import DEFAULT_DATA, WORKLOADS  # noqa: E402


def timed(phases: dict[str, float], name: str, fn):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start
    return run


def operator_rows(profile, by_shape: bool, limit: int) -> list[dict]:
    events = profile.key_averages(group_by_input_shape=by_shape)
    total = sum(e.self_cpu_time_total for e in events) or 1
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:limit]
    return [{"op": e.key, **({"shapes": str(e.input_shapes)[:120]} if by_shape else {}), "calls": e.count,
             "self_ms": round(e.self_cpu_time_total / 1000, 1), "share": round(e.self_cpu_time_total / total, 3)}
            for e in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--steps", type=int, default=8, help="steps in all: 2 warm-up, then timed, then profiled")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler (the last ones)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    from tuneforge import workflow
    from tuneforge.config.loader import build, parse_overrides
    from tuneforge.train import trainer as trainer_module

    out = Path(f"/tmp/tuneforge-profile-{args.workload.lower()}")
    raw = {**WORKLOADS[args.workload], "dataset_dir": str(DEFAULT_DATA), "output_dir": str(out),
           "max_steps": args.steps, "logging_steps": args.steps, **parse_overrides(args.overrides)}
    cfg = build(raw)
    phases: dict[str, float] = defaultdict(float)
    steps: list[tuple[float, int]] = []
    padding = {"held": 0, "samples": 0}
    profiles = []
    Trainer = trainer_module.Trainer
    original_train, original_step = Trainer.train, Trainer._optimizer_step

    def train(self):
        collate = self.collator

        def collator(rows):
            batch = collate(rows)
            padding["held"] += int(batch.model_inputs["input_ids"].numel())
            padding["samples"] += int(batch.num_tokens)
            return batch

        self.collator = timed(phases, "data", collator)
        self._to_device = timed(phases, "data", self._to_device)
        self.step_module = timed(phases, "forward", self.step_module)
        self.strategy.backward = timed(phases, "backward", self.strategy.backward)
        self.strategy.step = timed(phases, "optimizer", self.strategy.step)
        return original_train(self)

    def step(self, group, **kwargs):
        number = self.state.global_step + 1
        start = time.perf_counter()
        if number > args.steps - args.profile_steps:  # the profiler's overhead stays out of the timings
            before = dict(phases)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as p:
                result = original_step(self, group, **kwargs)
            profiles.append(p)
            phases.clear()
            phases.update(before)
            return result
        result = original_step(self, group, **kwargs)
        steps.append((time.perf_counter() - start, result.tokens))
        if number == 2:  # the first steps warm up (allocator, oneDNN primitives): not counted
            phases.clear()
        return result

    Trainer.train, Trainer._optimizer_step = train, step
    try:
        workflow.train(cfg)
    finally:
        Trainer.train, Trainer._optimizer_step = original_train, original_step
    counted = steps[2:]
    seconds = sum(s for s, _ in counted)
    report = {
        "workload": args.workload, "overrides": args.overrides, "threads": torch.get_num_threads(),
        "tokens_per_sec": round(sum(t for _, t in counted) / seconds, 1) if seconds else None,
        "seconds_per_step": round(seconds / max(len(counted), 1), 3),
        "phase_seconds_per_step": {k: round(v / len(counted), 3) for k, v in phases.items()},
        "padding_share": round(1 - padding["samples"] / max(padding["held"], 1), 4),
        "timed_steps": len(counted), "profiled_steps": len(profiles),
    }
    if profiles:
        report["operators"] = operator_rows(profiles[-1], by_shape=False, limit=args.top)
        report["operators_by_shape"] = operator_rows(profiles[-1], by_shape=True, limit=args.top)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
