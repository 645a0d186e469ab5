"""Checkpoints: rotation, atomic writes, exact resume (in-process and after SIGKILL), mismatches."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import collate, load_model, make_cfg, random_dataset, trainable_state

from tuneforge.atomic import atomic_folder, is_partial
from tuneforge.config import checkpoints_in
from tuneforge.errors import TrainingError
from tuneforge.train import Trainer
from tuneforge.train.checkpoint import capture_rng, restore_rng

ADAPTER_FILES = {
    "adapter_model.safetensors",
    "adapter_config.json",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pt",
    "trainer_state.json",
}
FULL_FILES = {
    "model.safetensors",
    "config.json",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pt",
    "trainer_state.json",
}
LENGTHS = [5, 8, 6, 9, 4, 7, 10, 6, 5, 8]  # 10 rows: 5 micro-batches of 2, 3 steps per epoch (the last short)


def run_cfg(out, model_dir, **keys):
    base = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=7,
        save_steps=2,
        save_strategy="steps",
        learning_rate=1e-2,
    )
    return make_cfg(out, model_dir, **{**base, **keys})


def assert_same_weights(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


def test_rotation_keeps_the_newest(tmp_path, tiny_model_dir, tokenizer):
    out = tmp_path / "out"
    cfg = run_cfg(out, tiny_model_dir, finetuning_type="lora", max_steps=8, save_total_limit=2)
    Trainer(
        cfg, load_model(tiny_model_dir, lora={}), tokenizer, random_dataset(LENGTHS), None, collate
    ).train()
    assert [p.name for p in checkpoints_in(out)] == ["checkpoint-6", "checkpoint-8"]
    assert not [p.name for p in out.iterdir() if is_partial(p) or p.name.startswith(".tmp-")]
    for folder in checkpoints_in(out):
        names = {p.name for p in folder.iterdir()}
        assert ADAPTER_FILES | {"tokenizer.json"} <= names
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["global_step"] == int(folder.name.split("-")[1])


def test_atomic_folder_leaves_nothing_when_the_write_fails(tmp_path):
    final = tmp_path / "checkpoint-3"
    with pytest.raises(RuntimeError), atomic_folder(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-save")
    assert list(tmp_path.iterdir()) == []
    with atomic_folder(final) as tmp:
        (tmp / "a").write_text("old")
    with atomic_folder(final) as tmp:  # an existing folder is replaced as a whole
        (tmp / "b").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3"]
    assert [p.name for p in final.iterdir()] == ["b"]


def test_rng_states_round_trip(tmp_path):
    state = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.save(state, tmp_path / "rng_state.pt")
    restore_rng(torch.load(tmp_path / "rng_state.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize("lora", [None, {"lora_dropout": 0.1}], ids=["full", "lora-with-dropout"])
def test_resume_in_process_is_exact(tmp_path, tiny_model_dir, lora):
    kind = "full" if lora is None else "lora"
    data = random_dataset(LENGTHS)
    first = load_model(tiny_model_dir, lora=lora, seed=0)
    Trainer(
        run_cfg(tmp_path / "a", tiny_model_dir, finetuning_type=kind), first, None, data, None, collate
    ).train()
    expected = trainable_state(first)
    assert (FULL_FILES if lora is None else ADAPTER_FILES) <= {
        p.name for p in (tmp_path / "a" / "checkpoint-4").iterdir()
    }
    # resume from step 4 (mid-epoch 1) into a model that starts from other weights: all must be restored
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    second = load_model(tiny_model_dir, lora=lora, seed=1)
    cfg = run_cfg(tmp_path / "b", tiny_model_dir, finetuning_type=kind, resume_from_checkpoint=True)
    results = Trainer(cfg, second, None, data, None, collate).train()
    assert results["global_step"] == 7
    assert_same_weights(trainable_state(second), expected)
    a_log = (tmp_path / "a" / "trainer_state.json").read_text()
    b_log = (tmp_path / "b" / "trainer_state.json").read_text()
    a_loss = [e["loss"] for e in json.loads(a_log)["log_history"]]
    assert [e["loss"] for e in json.loads(b_log)["log_history"]] == pytest.approx(a_loss, abs=1e-6)


SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {helpers!r})
    from train_helpers import collate, load_model, make_cfg, random_dataset
    from tuneforge.train import Trainer

    def build(out, model_dir, resume=False, delay=0.0):
        def slow_collate(rows):  # slows the run so that the test can kill it between two saves
            time.sleep(delay)
            return collate(rows)
        cfg = make_cfg(out, model_dir, finetuning_type="lora", per_device_train_batch_size=2,
                       gradient_accumulation_steps=2, max_steps=9, save_strategy="steps", save_steps=2,
                       learning_rate=1e-2, resume_from_checkpoint=True if resume else None)
        model = load_model(model_dir, lora={{"lora_dropout": 0.1}})
        return Trainer(cfg, model, None, random_dataset({lengths!r}), None, slow_collate)

    if __name__ == "__main__":
        build(sys.argv[1], sys.argv[2], delay=float(sys.argv[3])).train()
""")


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, tiny_model_dir):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(helpers=str(Path(__file__).parent), lengths=LENGTHS))
    out = tmp_path / "killed"
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(out), str(tiny_model_dir), "0.15"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        deadline = time.monotonic() + 90
        while not (out / "checkpoint-2").exists():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint-2 appeared"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "adapter_model.safetensors").exists()  # killed before the end
    for folder in checkpoints_in(out):  # whatever was on disk at the kill is complete
        assert ADAPTER_FILES <= {p.name for p in folder.iterdir()}

    spec = importlib.util.spec_from_file_location("killed_run", script)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)  # the same builder, in this process, without the delay
    resumed = run.build(out, tiny_model_dir, resume=True)
    resumed.train()
    reference = run.build(tmp_path / "uninterrupted", tiny_model_dir)
    reference.train()
    assert_same_weights(trainable_state(resumed.model), trainable_state(reference.model))
    steps = [
        json.loads(line)["current_steps"] for line in (out / "trainer_log.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, 10))  # one line per step, none repeated after the resume
    assert not [p.name for p in out.iterdir() if is_partial(p) or p.name.startswith(".tmp-")]


def test_checkpoint_of_another_adapter_is_refused(tmp_path, tiny_model_dir):
    data = random_dataset(LENGTHS)
    cfg = run_cfg(tmp_path / "out", tiny_model_dir, finetuning_type="lora", max_steps=2)
    Trainer(cfg, load_model(tiny_model_dir, lora={"r": 4}), None, data, None, collate).train()
    cfg = run_cfg(
        tmp_path / "out", tiny_model_dir, finetuning_type="lora", max_steps=4, resume_from_checkpoint=True
    )
    with pytest.raises(
        TrainingError, match=r"checkpoint .*checkpoint-2 does not match the model \(shape differs"
    ):
        Trainer(cfg, load_model(tiny_model_dir, lora={"r": 8}), None, data, None, collate).train()
    other_targets = load_model(tiny_model_dir, lora={"target_modules": ["q_proj"]})
    with pytest.raises(TrainingError, match=r"checkpoint-2 does not match the model \(unexpected: "):
        Trainer(cfg, other_targets, None, data, None, collate).train()


def test_resume_from_a_folder_that_is_not_a_checkpoint(tmp_path, tiny_model_dir):
    (tmp_path / "somewhere").mkdir()
    cfg = run_cfg(tmp_path / "out", tiny_model_dir, resume_from_checkpoint=str(tmp_path / "somewhere"))
    with pytest.raises(TrainingError, match="somewhere is not a tuneforge checkpoint"):
        Trainer(cfg, load_model(tiny_model_dir), None, random_dataset(LENGTHS), None, collate).train()


# ---------------------------------------------------------------- full resume through weight conversions


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """A tiny random Mixtral: transformers 5 fuses its experts in memory (mlp.experts.gate_up_proj) and
    save_pretrained writes them back per expert (block_sparse_moe.experts.N.w1 / w3), so the names differ."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2, tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("tiny-mixtral")
    MixtralForCausalLM(config).save_pretrained(out)
    return out


def test_full_weights_saved_under_checkpoint_names_load_back_in_place(tmp_path, tiny_moe_dir):
    from safetensors.torch import load_file

    from tuneforge.train.checkpoint import load_trainable_weights

    saved_model = load_model(tiny_moe_dir)
    saved_model.save_pretrained(tmp_path)
    on_disk = set(load_file(tmp_path / "model.safetensors"))
    in_memory = set(saved_model.state_dict())
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in on_disk - in_memory
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory - on_disk

    model = load_model(tiny_moe_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    model.model.layers[0].self_attn.requires_grad_(False)  # as freeze leaves it
    before = dict(model.named_parameters())
    load_trainable_weights(tmp_path, model)
    assert_same_weights(model.state_dict(), saved_model.state_dict(), atol=0)
    # filled in place: the optimizer's tensors, requires_grad and the tied head are the same objects
    assert all(before[name] is param for name, param in model.named_parameters())
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_full_resume_of_a_model_saved_under_other_names_is_exact(tmp_path, tiny_moe_dir):
    data = random_dataset(LENGTHS)
    first = load_model(tiny_moe_dir, seed=0)
    Trainer(run_cfg(tmp_path / "a", tiny_moe_dir), first, None, data, None, collate).train()
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    second = load_model(tiny_moe_dir, seed=1)
    with torch.no_grad():
        for param in second.parameters():
            param.normal_()
    cfg = run_cfg(tmp_path / "b", tiny_moe_dir, resume_from_checkpoint=True)
    Trainer(cfg, second, None, data, None, collate).train()
    assert_same_weights(trainable_state(second), trainable_state(first))


def test_full_checkpoint_of_another_architecture_is_refused(tmp_path, tiny_moe_dir, tiny_model_dir):
    from tuneforge.train.checkpoint import load_trainable_weights

    load_model(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(TrainingError, match=r"checkpoint .* does not match the model \(unexpected: "):
        load_trainable_weights(tmp_path, load_model(tiny_moe_dir))
