"""pt, rm, dpo, kto, orpo and simpo under DDP, FSDP2 and DeepSpeed ZeRO-3, through the CLI as a user runs it:
FORCE_TORCHRUN=1 NPROC_PER_NODE=2 on the CPU (gloo), `fsdp=full_shard` for FSDP2, `deepspeed=<ds_z3_config.json>`
for ZeRO-3.

Each stage's 1-process run (batch 4) is the reference for its 2-process runs (batch 2 each): the same logged
loss, grad_norm and stage metrics at every step, and the same final weights (the adapter, the reward model's
value head, the full model). Here: rm and dpo (its reference: the policy with its adapters disabled) under
DDP and FSDP2, pt, kto and simpo under FSDP2 and ZeRO-3, orpo under DDP, and full-parameter dpo (a separate frozen
reference, sharded like the policy) under FSDP2. sft under each strategy, kto and dpo with precomputed reference
log-probs under DDP, rm under ZeRO-2 and full-parameter dpo under ZeRO-3 are in test_distributed.py,
test_e2e_fsdp.py and test_e2e_deepspeed.py.

Tolerances, fp32: abs 1e-4 under DDP and 1e-5 under FSDP2 and ZeRO-3, as those files argue. Two additions, from measured
numbers:
- `adam_epsilon=1e-6`: splitting the batch over two processes changes the rounding of the gradients. AdamW
  divides each gradient element by its root mean square + eps, so an element whose gradient is about eps turns
  that rounding into a weight difference of up to lr / eps times it: with the default eps (1e-8), one of orpo's
  LoRA A weights differed by 9.0e-6 (every other weight by <= 3e-7), too close to 1e-5 to hold. With 1e-6 the
  largest difference of every stage is <= 1.8e-6; AdamW still moves a weight by ~lr (1e-2) per step wherever
  its gradient is well above 1e-6.
- `rel=1e-6` besides the absolute tolerance for the logged metrics: logps/* of dpo and kto are per-sequence sums
  of log-probs near -100 .. -260, where one fp32 ulp is 7.6e-6 .. 1.5e-5; they differed by up to 1.5e-5 (6e-8 of
  the value), more than 1e-5. 1e-6 of the value is ~15x that, and a metric reduced wrongly over the ranks (a mean
  of means, a rank counted twice) is off by tens of percent. Values of order 1 keep the absolute tolerance.

Cost: a 2-process launch takes ~20-25 s on 2 cores, nearly all of it imports in the launcher and in each
process; the runs of one test start together, so one launch's single-process phases overlap another's work.
"""

import importlib.util
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import FAST, ROOT, logged_steps

pytestmark = pytest.mark.e2e

ADAM = ("adam_epsilon=1e-6",)
STRATEGIES = {"ddp": (), "fsdp2": ("fsdp=full_shard",), "zero3": ("deepspeed=examples/deepspeed/ds_z3_config.json",)}
TOL = {"ddp": 1e-4, "fsdp2": 1e-5, "zero3": 1e-5}
LOG_LINE = {"fsdp2": "fsdp: 2 LlamaDecoderLayer units + the root over 2 processes",
            "zero3": "deepspeed: ZeRO stage 3 over 2 processes"}
REL = 1e-6

PAIRS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
LOGPS = ("logps/chosen", "logps/rejected")
LIVE_REFERENCE = "reference: the policy with its adapters disabled"
# stage: (example, the metrics it logs besides loss and grad_norm, a line its log must hold)
STAGES = {
    "pt": ("examples/pt_lora.yaml", (), "stage pt: encoder pretrain"),
    "rm": ("examples/rm_lora.yaml", PAIRS, "stage rm: encoder pairwise"),
    "dpo": ("examples/dpo_lora.yaml", PAIRS + LOGPS, LIVE_REFERENCE),
    "kto": ("examples/kto_lora.yaml", ("kl", "rewards/chosen", "rewards/rejected", *LOGPS), LIVE_REFERENCE),
    "orpo": ("examples/orpo_lora.yaml", PAIRS + LOGPS, "stage dpo: encoder pairwise"),
    "simpo": ("examples/simpo_lora.yaml", PAIRS + LOGPS, "stage dpo: encoder pairwise"),
}


@dataclass
class Run:
    out: Path
    process: subprocess.Popen
    log: Path

    def wait(self) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the launcher, torchrun and its processes
            code = self.process.wait()
        return code, self.log.read_text()


def start(config: str, out: Path, model_dir: Path, *overrides: str, processes: int = 1) -> Run:
    """`tuneforge train` in the background (its own process group), stdout and stderr into out.log."""
    env = dict(os.environ)
    if processes > 1:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
    log = out.with_name(f"{out.name}.log")
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "tuneforge.cli", "train", config, f"output_dir={out}",
             f"model_name_or_path={model_dir}", *FAST, *ADAM, *overrides],
            stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, start_new_session=True,
        )
    return Run(out, process, log)


def finish(*runs: Run) -> list[str]:
    """Each run's log, once all have ended; every one must have ended with status 0 (torchrun's: every rank)."""
    ended = [run.wait() for run in runs]
    for run, (code, log) in zip(runs, ended, strict=True):
        assert code == 0, f"{run.out.name} exited {code}:\n{log[-4000:]}"
        assert "terminate called" not in log, f"{run.out.name}: a rank aborted at exit"
    return [log for _, log in ended]


def assert_same_training(one: Path, two: Path, metrics: tuple[str, ...], tol: float, files: tuple[str, ...]) -> None:
    a, b = logged_steps(one), logged_steps(two)
    assert [r["current_steps"] for r in a] == [r["current_steps"] for r in b] == [1, 2, 3]
    for key in metrics:  # KTO's subset metrics skip a step without a member, never all of them
        assert any(key in row for row in a), f"{key} never logged"
    for row_a, row_b in zip(a, b, strict=True):
        step = row_a["current_steps"]
        assert row_a["total_tokens"] == row_b["total_tokens"]  # every rank's tokens counted once
        # the norm before clipping, over every rank's gradients (or shards): relative, as test_e2e_fsdp.py has it
        assert row_b["grad_norm"] == pytest.approx(row_a["grad_norm"], rel=tol), f"step {step}: grad_norm"
        for key in ("loss", *metrics):
            assert (key in row_a) == (key in row_b), f"step {step}: {key} logged by one run only"
            if key in row_a:
                assert row_b[key] == pytest.approx(row_a[key], abs=tol, rel=REL), f"step {step}: {key}"
    for file in files:
        weights_a, weights_b = load_file(one / file), load_file(two / file)
        assert weights_a.keys() == weights_b.keys(), file
        for name in weights_a:
            torch.testing.assert_close(weights_b[name], weights_a[name], atol=tol, rtol=0, msg=f"{file}: {name}")


RUNS = [
    # pt is sft's objective (proven under each strategy) on packed rows, which are split over the ranks the same
    # way whatever the strategy: the two sharding ones
    ("pt", ("fsdp2", "zero3")),
    ("rm", ("ddp", "fsdp2")),
    ("dpo", ("ddp", "fsdp2")),
    ("kto", ("fsdp2", "zero3")),  # under DDP: test_distributed.py
    # orpo and simpo run exactly dpo's distributed path without the reference forward; only their loss, a pure
    # function of each pair's log-probs (tests/train), differs: one strategy each
    ("orpo", ("ddp",)),
    ("simpo", ("fsdp2", "zero3")),
]


@pytest.mark.parametrize(("stage", "strategies"), RUNS, ids=["-".join([s, *names]) for s, names in RUNS])
def test_two_processes_train_each_stage_as_one_process_does(tmp_path, tiny_model_dir, stage, strategies):
    config, metrics, expected_line = STAGES[stage]
    if importlib.util.find_spec("deepspeed") is None:
        strategies = tuple(s for s in strategies if s != "zero3")
    one = start(config, tmp_path / "one", tiny_model_dir, "per_device_train_batch_size=4")
    twos = [start(config, tmp_path / name, tiny_model_dir, "per_device_train_batch_size=2", *STRATEGIES[name],
                  processes=2) for name in strategies]
    logs = finish(one, *twos)
    files = ("adapter_model.safetensors", "value_head.safetensors") if stage == "rm" else ("adapter_model.safetensors",)
    trained = load_file(tmp_path / "one" / files[0])
    assert any(float(w.abs().max()) > 0 for name, w in trained.items() if "lora_B" in name)  # B starts at zero
    for name, log in zip(strategies, logs[1:], strict=True):
        assert expected_line in log, f"{name}: no '{expected_line}' in the log"
        if name in LOG_LINE:
            assert LOG_LINE[name] in log
        assert_same_training(tmp_path / "one", tmp_path / name, metrics, TOL[name], files)


def test_full_dpo_under_fsdp2_shards_its_frozen_reference_and_trains_as_one_process_does(tmp_path, tiny_model_dir):
    """finetuning_type full: the reference is a separate frozen copy of the model, sharded like the policy."""
    full = ("finetuning_type=full", "learning_rate=1e-3")
    one = start("examples/dpo_lora.yaml", tmp_path / "one", tiny_model_dir, "per_device_train_batch_size=4", *full)
    two = start("examples/dpo_lora.yaml", tmp_path / "two", tiny_model_dir, "per_device_train_batch_size=2", *full,
                *STRATEGIES["fsdp2"], processes=2)
    _, log = finish(one, two)
    assert "(float32, frozen)" in log and "reference model: " in log
    assert "fsdp: the frozen reference model is sharded like the policy (2 LlamaDecoderLayer units + its root)" in log
    assert logged_steps(tmp_path / "two")[0]["lr"] == pytest.approx(1e-3)
    assert_same_training(tmp_path / "one", tmp_path / "two", PAIRS + LOGPS, TOL["fsdp2"], ("model.safetensors",))
