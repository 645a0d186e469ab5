"""Many processes through the CLI, as a user runs them: FORCE_TORCHRUN=1 NPROC_PER_NODE=2 on the CPU (gloo).

With the same global batch, two DDP processes must train exactly what one process does: the same logged
losses and metrics step by step, and the same final weights (fp32, 1e-4)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

FAST = ["max_steps=3", "cutoff_len=64", "logging_steps=1", "disable_tqdm=true", "bf16=false", "val_size=0",
        "eval_strategy=no", "save_strategy=no", "plot_loss=false", "learning_rate=1e-2"]


def train(config, out, model_dir, *overrides, processes=1, env=None, ok=True):
    env = {**os.environ, **(env or {})}
    if processes > 1:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
    r = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "train", config, f"output_dir={out}",
         f"model_name_or_path={model_dir}", *FAST, *overrides],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    if ok:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def logged_steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def assert_same_run(one: Path, two: Path, keys: tuple[str, ...]) -> None:
    a, b = logged_steps(one), logged_steps(two)
    assert len(a) == len(b) == 3
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a["total_tokens"] == row_b["total_tokens"]  # every rank's tokens counted once
        for key in keys:
            assert row_b[key] == pytest.approx(row_a[key], abs=1e-4), key
    weights_a, weights_b = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], atol=1e-4, rtol=0)


def test_two_ddp_processes_train_what_one_process_trains_and_resume(tmp_path, tiny_model_dir):
    one = tmp_path / "one"
    train("examples/sft_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4")
    two, temporary = tmp_path / "two", tmp_path / "tmp"
    temporary.mkdir()
    r = train("examples/sft_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2",
              "save_strategy=steps", "save_steps=2", processes=2, env={"TMPDIR": str(temporary)})
    assert r.stdout.count("adapter saved in") == 1  # rank 0 reports for both
    assert not list(temporary.iterdir())  # nothing left behind, torchrun's folder (torchelastic_* by default) too
    assert_same_run(one, two, ("loss", "grad_norm"))

    # two processes resume from the checkpoint of step 2 and end where the uninterrupted run ended
    resumed = tmp_path / "resumed"
    train("examples/sft_lora.yaml", resumed, tiny_model_dir, "per_device_train_batch_size=2",
          f"resume_from_checkpoint={two / 'checkpoint-2'}", processes=2)
    assert [row["current_steps"] for row in logged_steps(resumed)] == [3]
    final, expected = load_file(resumed / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-6, rtol=0)


def test_kto_under_ddp_estimates_kl_over_all_ranks(tmp_path, tiny_model_dir):
    """KTO's KL estimate z is the whole batch's: its sum and count are all-reduced over the ranks."""
    one = tmp_path / "one"
    train("examples/kto_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4",
          "gradient_accumulation_steps=2")
    two = tmp_path / "two"
    train("examples/kto_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2",
          "gradient_accumulation_steps=2", processes=2)
    assert_same_run(one, two, ("loss", "kl", "rewards/chosen", "rewards/rejected"))


def test_dpo_with_precomputed_reference_under_ddp(tmp_path, tiny_model_dir):
    """One process per node computes the reference log-probs; the other reads them from its cache."""
    common = ("precompute_ref_log_probs=true", "cutoff_len=96", f"tokenized_path={tmp_path / 'tokens'}")
    one = tmp_path / "one"
    train("examples/dpo_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4", *common)
    two = tmp_path / "two"
    train("examples/dpo_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2", *common, processes=2)
    assert_same_run(one, two, ("loss", "rewards/accuracies", "rewards/margins"))


def test_a_rank_that_dies_ends_the_job_and_is_named(tmp_path, tiny_model_dir):
    # test-only: rank 1 exits in the middle of step 2, while rank 0 waits for it in a collective
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from tuneforge.train import trainer\n"
        "    step = trainer.Trainer._optimizer_step\n"
        "    def dying(self, group, **kwargs):\n"
        "        if self.state.global_step == 1:\n"
        "            os._exit(3)\n"
        "        return step(self, group, **kwargs)\n"
        "    trainer.Trainer._optimizer_step = dying\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    r = train("examples/sft_lora.yaml", tmp_path / "out", tiny_model_dir, "per_device_train_batch_size=2",
              processes=2, env={"PYTHONPATH": path}, ok=False)
    assert r.returncode == 2
    assert "error: the run failed on rank 1 (exit code 3)" in r.stderr, r.stderr[-3000:]


def test_a_malformed_launch_variable_stops_before_any_process_starts(tmp_path, tiny_model_dir):
    env = {**os.environ, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "two"}
    r = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "train", "examples/sft_lora.yaml", f"output_dir={tmp_path}",
         f"model_name_or_path={tiny_model_dir}"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )
    assert r.returncode == 2 and "NPROC_PER_NODE='two' must be a whole number" in r.stderr


def test_two_processes_stream_their_shares_of_the_data(tmp_path, tiny_model_dir):
    """Unshuffled, rank r streams rows r, r + 2, ...: each global micro-batch holds the rows one process reads."""
    keys = ("streaming=true", "disable_shuffling=true")
    one = tmp_path / "one"
    train("examples/sft_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4", *keys)
    two = tmp_path / "two"
    train("examples/sft_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2", *keys, processes=2)
    assert_same_run(one, two, ("loss", "grad_norm"))


def test_sequence_parallel_over_two_processes_trains_what_one_process_trains(tmp_path, tiny_model_dir):
    """sequence_parallel_size 2: both processes read the same rows, each runs half of every sequence; the losses,
    gradient norms and weights are one process's on the whole sequences."""
    one = tmp_path / "one"
    train("examples/sft_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4")
    two = tmp_path / "two"
    r = train("examples/sft_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=4",
              "sequence_parallel_size=2", processes=2)
    assert "sequence parallel: 2 ranks per sequence" in r.stderr + r.stdout
    assert_same_run(one, two, ("loss", "grad_norm"))
