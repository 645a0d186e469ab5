"""Run hooks and a clean stop: output_dir/STOP or SIGINT / SIGTERM end the run after the current optimizer step
with a checkpoint (status "stopped"), and resume_from_checkpoint: true continues it exactly."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import collate, load_model, make_cfg, random_dataset, trainable_state

from tuneforge.config import checkpoints_in
from tuneforge.train import Trainer
from tuneforge.train.callbacks import STOP_FILE, Callback

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [5, 8, 6, 9, 4, 7, 10, 6, 5, 8]  # 10 rows: 5 micro-batches of 2, 3 steps per epoch


def cfg_of(out, model_dir, **keys):
    base = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6, learning_rate=1e-2)
    return make_cfg(out, model_dir, **{**base, **keys})


class At(Callback):
    """Calls action(trainer_state) when step `step` is logged."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action = step, action

    def on_log(self, state, entry) -> None:
        if entry["step"] == self.step:
            self.action(state)


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_begin(self, state, resumed_from):
        self.events.append(("begin", state.global_step, resumed_from))

    def on_log(self, state, entry):
        self.events.append(("log", entry["step"]))

    def on_evaluate(self, state, entry):
        self.events.append(("evaluate", entry["step"]))

    def on_save(self, state, path):
        self.events.append(("save", state.global_step, Path(path).name))

    def on_end(self, state, results):
        self.events.append(("end", results.get("status", "completed")))


def losses(log_history):
    return {e["step"]: e["loss"] for e in log_history if "loss" in e}


def test_a_stop_file_stops_with_a_checkpoint_and_resume_continues_exactly(tmp_path, tiny_model_dir, caplog):
    whole_model = load_model(tiny_model_dir)
    whole = Trainer(cfg_of(tmp_path / "whole", tiny_model_dir), whole_model, None, random_dataset(LENGTHS), None,
                    collate)
    whole.train()

    out = tmp_path / "stopped"
    recorder = Recorder()
    create_stop = At(2, lambda state: (out / STOP_FILE).touch())  # seen by step 3, which then ends the run
    stopped = Trainer(cfg_of(out, tiny_model_dir), load_model(tiny_model_dir), None, random_dataset(LENGTHS), None,
                      collate, callbacks=[create_stop, recorder])
    with caplog.at_level(logging.INFO, logger="tuneforge"):
        results = stopped.train()
    assert results["status"] == "stopped" and results["global_step"] == 3
    assert json.loads((out / "all_results.json").read_text())["status"] == "stopped"
    assert json.loads((out / "trainer_state.json").read_text())["status"] == "stopped"
    assert [p.name for p in checkpoints_in(out)] == ["checkpoint-3"]
    assert not (out / STOP_FILE).exists()  # honoured: removed
    assert not (out / "model.safetensors").exists()  # the run is not finished: its weights are in the checkpoint
    assert "resume_from_checkpoint: true" in caplog.text and "stopped at step 3 of 6" in caplog.text
    assert recorder.events == [("begin", 0, None), ("log", 1), ("log", 2), ("log", 3),
                               ("save", 3, "checkpoint-3"), ("end", "stopped")]

    resumed_model = load_model(tiny_model_dir, seed=1)  # other initial weights: the checkpoint's replace them
    resumed = Trainer(cfg_of(out, tiny_model_dir, resume_from_checkpoint=True), resumed_model, None,
                      random_dataset(LENGTHS), None, collate)
    final = resumed.train()
    assert "status" not in final and final["global_step"] == 6
    assert json.loads((out / "trainer_state.json").read_text())["status"] == "completed"
    assert losses(resumed.state.log_history) == pytest.approx(losses(whole.state.log_history), rel=1e-6)
    assert final["train_loss"] == pytest.approx(whole._results()["train_loss"], rel=1e-6)
    expected, got = trainable_state(whole_model), trainable_state(resumed_model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def test_a_signal_stops_after_the_step_and_the_handlers_are_restored(tmp_path, tiny_model_dir):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    interrupt = At(1, lambda state: os.kill(os.getpid(), signal.SIGINT))
    results = Trainer(cfg_of(out, tiny_model_dir, save_strategy="steps", save_steps=2), load_model(tiny_model_dir),
                      None, random_dataset(LENGTHS), None, collate, callbacks=[interrupt]).train()
    assert results["status"] == "stopped" and results["global_step"] == 2
    assert [p.name for p in checkpoints_in(out)] == ["checkpoint-2"]  # the due save is the stop's: written once
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_stop_request_at_the_last_step_just_finishes(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    results = Trainer(cfg_of(out, tiny_model_dir, max_steps=2), load_model(tiny_model_dir), None,
                      random_dataset(LENGTHS), None, collate,
                      callbacks=[At(1, lambda state: (out / STOP_FILE).touch())]).train()
    assert "status" not in results and results["global_step"] == 2
    assert (out / "model.safetensors").is_file() and not checkpoints_in(out)
    assert not (out / STOP_FILE).exists()


def test_sigterm_ends_a_cli_run_with_a_checkpoint_and_exit_status_0(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    args = [sys.executable, "-m", "tuneforge.cli", "train", "examples/sft_lora.yaml", f"output_dir={out}",
            f"model_name_or_path={tiny_model_dir}", "cutoff_len=64", "logging_steps=1", "disable_tqdm=true",
            "bf16=false", "val_size=0", "eval_strategy=no", "save_strategy=no", "plot_loss=false",
            "per_device_train_batch_size=1"]
    proc = subprocess.Popen([*args, "max_steps=100000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        log = out / "trainer_log.jsonl"
        deadline = time.monotonic() + 300
        while not (log.is_file() and log.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM received" in stderr and "resume_from_checkpoint: true" in stderr
    results = json.loads((out / "all_results.json").read_text())
    step = results["global_step"]
    assert results["status"] == "stopped" and [p.name for p in checkpoints_in(out)] == [f"checkpoint-{step}"]

    # and the run continues from there
    r = subprocess.run([*args, f"max_steps={step + 1}", "resume_from_checkpoint=true", "overwrite_output_dir=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {out / f'checkpoint-{step}'} at step {step}" in r.stderr
    assert json.loads((out / "all_results.json").read_text())["global_step"] == step + 1
    assert (out / "adapter_model.safetensors").is_file()


# ---- several processes agree on the step to stop at ---------------------------------------------------------

class StopOnRank1(Callback):
    def __init__(self) -> None:
        self.asked = False

    def on_log(self, state, entry) -> None:
        self.asked = self.asked or (entry["step"] == 1 and int(os.environ["RANK"]) == 1)

    def should_stop(self) -> str | None:
        return "rank 1 asks" if self.asked else None


def _agreeing_worker(rank: int, init_file: str, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg = cfg_of(out, model_dir, per_device_train_batch_size=1)
        results = Trainer(cfg, load_model(model_dir), None, random_dataset(LENGTHS), None, collate,
                          callbacks=[StopOnRank1()]).train()
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_the_ranks_stop_at_the_same_step(tmp_path, tiny_model_dir):
    import torch.multiprocessing as mp

    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_agreeing_worker, args=(str(tmp_path / "init"), str(tiny_model_dir), str(out)), nprocs=2, join=True)
    for rank in (0, 1):
        results = json.loads((out / f"rank{rank}.json").read_text())
        assert results["status"] == "stopped" and results["global_step"] == 2
    assert [p.name for p in checkpoints_in(out)] == ["checkpoint-2"]


def test_stop_requests_the_same_signal_twice_stops_at_once_another_is_ignored(tmp_path):
    from tuneforge.train.callbacks import StopRequests

    # a program's usual handlers beforehand (whatever an earlier test in this process left in place), so that the
    # second Ctrl-C reaches Python's own KeyboardInterrupt
    outer = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    requests = StopRequests(tmp_path)
    requests.install()
    try:
        assert requests.should_stop() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert requests.should_stop() == "SIGTERM received"
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's answer to a Ctrl-C: ignored, the stop is under way
        assert requests.should_stop() == "SIGTERM received"
        requests.received = "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: at once, as Python's own handler does
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    finally:
        requests.restore()
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        signal.signal(signal.SIGINT, outer[0])
        signal.signal(signal.SIGTERM, outer[1])
    requests = StopRequests(tmp_path)  # without signals: the stop file
    (tmp_path / STOP_FILE).touch()
    assert requests.should_stop() == f"{tmp_path / STOP_FILE} found"
    requests.honoured()
    assert not (tmp_path / STOP_FILE).exists()
