"""FSDP2 through the CLI, as a user runs it: FORCE_TORCHRUN=1 NPROC_PER_NODE=2 fsdp=full_shard on the CPU (gloo).

With the same global batch (2 processes x 2 rows, or x 1 row x 2 accumulated micro-batches, = 1 process x 4
rows) a sharded run trains what one process trains. Tolerance, fp32: FSDP2 reduce-scatters each gradient as the
sum of the ranks' parts, another order of float additions than one process's batch sum, so values differ by
rounding (measured: losses 7e-7, weights 4e-8 after 3 AdamW steps). 1e-5 leaves 10-100x room and is still
~1000x below one step's change of a weight at learning_rate 1e-2 (1e-3 for full), which a wrong gradient
scale or a missing reduction would show. Every run must end with exit status 0: torchrun returns 0 only when
every rank did, so a rank aborting at exit ("terminate called without an active exception") fails the test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tuneforge.atomic import is_partial

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

FAST = ["max_steps=3", "cutoff_len=64", "logging_steps=1", "disable_tqdm=true", "bf16=false", "val_size=0",
        "eval_strategy=no", "plot_loss=false"]
TOL = 1e-5


def train(out, model_dir, *overrides, processes=1):
    env = {**os.environ, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(processes)} if processes > 1 else None
    sharding = ["fsdp=full_shard"] if processes > 1 else []
    r = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "train", "examples/sft_lora.yaml", f"output_dir={out}",
         f"model_name_or_path={model_dir}", *FAST, *sharding, *overrides],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]  # every rank exited 0 (torchrun's status)
    assert "terminate called" not in r.stderr
    return r


def logged_steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def assert_same_steps(one: Path, two: Path) -> None:
    a, b = logged_steps(one), logged_steps(two)
    assert [r["current_steps"] for r in a] == [r["current_steps"] for r in b] == [1, 2, 3]
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a["total_tokens"] == row_b["total_tokens"]
        assert row_b["loss"] == pytest.approx(row_a["loss"], abs=TOL)
        # the clipped norm is the global one (over every rank's shards), not this rank's part of it
        assert row_b["grad_norm"] == pytest.approx(row_a["grad_norm"], rel=TOL)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = TOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=atol, rtol=0, msg=name)


def test_fsdp_lora_trains_what_one_process_trains(tmp_path, tiny_model_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, tiny_model_dir, "per_device_train_batch_size=4", "learning_rate=1e-2", "save_strategy=no")
    # 2 processes x 1 row x 2 accumulated micro-batches: the first micro-batch's gradients stay unreduced (no_sync)
    r = train(two, tiny_model_dir, "per_device_train_batch_size=1", "gradient_accumulation_steps=2",
              "learning_rate=1e-2", "save_strategy=no", processes=2)
    assert "fsdp: 2 LlamaDecoderLayer units + the root over 2 processes" in r.stderr
    assert r.stdout.count("adapter saved in") == 1
    assert_same_steps(one, two)
    # the consolidated adapter: a plain peft folder, only the adapter's weights
    assert_same_weights(load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors"))
    assert json.loads((two / "adapter_config.json").read_text())["r"] == 8


def test_fsdp_full_saves_a_hugging_face_model_and_resumes_to_the_same_weights(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    full = ["finetuning_type=full", "learning_rate=1e-3"]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    train(one, tiny_model_dir, *full, "per_device_train_batch_size=4", "save_strategy=no")
    train(two, tiny_model_dir, *full, "per_device_train_batch_size=2", "save_steps=2", processes=2)
    assert_same_steps(one, two)

    # checkpoint-2: the shards of each rank (torch.distributed.checkpoint), no whole model in it
    ckpt = two / "checkpoint-2"
    assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "rng_state_0.pt").is_file() and (ckpt / "rng_state_1.pt").is_file()
    assert not (ckpt / "model.safetensors").exists()
    assert not [p for p in tmp_path.glob("*/.*") if is_partial(p) or p.name.startswith(".tmp-")]

    # the final folder loads with plain transformers, tied embeddings written once, as one process writes them
    assert load_file(two / "model.safetensors").keys() == load_file(one / "model.safetensors").keys()
    loaded = {name: AutoModelForCausalLM.from_pretrained(folder).state_dict() for name, folder in
              (("one", one), ("two", two))}
    assert_same_weights(loaded["one"], loaded["two"])

    # resuming the sharded checkpoint (a killed run) ends where the uninterrupted run ended
    r = train(resumed, tiny_model_dir, *full, "per_device_train_batch_size=2", "save_strategy=no",
              f"resume_from_checkpoint={ckpt}", processes=2)
    assert "resumed from" in r.stderr and "at step 2" in r.stderr
    assert logged_steps(resumed)[-1]["loss"] == pytest.approx(logged_steps(two)[-1]["loss"], abs=1e-6)
    assert_same_weights(load_file(two / "model.safetensors"), load_file(resumed / "model.safetensors"), atol=1e-6)


TEARDOWN = """
import os, torch
from torch.distributed.fsdp import fully_shard
from tuneforge.config.fsdp import FsdpSettings
from tuneforge.train import dist
from tuneforge.train.fsdp import device_mesh

dist.setup(60, 60)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
fully_shard(model, mesh=device_mesh(FsdpSettings(), torch.device("cpu")))
model(torch.ones(2, 4)).sum().backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DTensor ops: their caches keep the mesh alive
del model
dist.teardown()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
# one file per rank: two ranks printing at once can interleave their lines
with open(os.path.join(os.environ["OUT_DIR"], f"rank{os.environ['RANK']}.txt"), "w") as f:
    f.write(str(sum("gloo" in n for n in names)))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_teardown_ends_the_process_groups_fsdp_used(tmp_path):
    """FSDP2's device mesh outlives training in DTensor's caches and holds the world group: unless teardown lets
    go of it, destroy_process_group() leaves the group's gloo threads running into interpreter shutdown (the
    suspected ground of the rare "terminate called without an active exception" at exit)."""
    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--log-dir", str(tmp_path / "torchrun"), str(script)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "OUT_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    counts = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert counts == {0: "0", 1: "0"}, f"gloo threads left after teardown: {counts}"
