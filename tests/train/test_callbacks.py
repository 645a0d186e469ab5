"""trainer_log.jsonl, log lines, plots: what a user sees of a run."""

from __future__ import annotations

import json
import logging

import pytest
from train_helpers import collate, load_model, make_cfg, random_dataset

from tuneforge.train import Trainer
from tuneforge.train.callbacks import EVAL_LOSS_PLOT, LOSS_PLOT, TrainerLog, format_time, smooth

TRAIN_FIELDS = {
    "current_steps",
    "total_steps",
    "loss",
    "lr",
    "epoch",
    "percentage",
    "elapsed_time",
    "remaining_time",
    "throughput",
    "total_tokens",
    "grad_norm",
}
EVAL_FIELDS = {
    "current_steps",
    "total_steps",
    "eval_loss",
    "epoch",
    "percentage",
    "elapsed_time",
    "remaining_time",
    "throughput",
    "total_tokens",
}


def test_format_time_is_h_mm_ss():
    assert format_time(3725.9) == "1:02:05"
    assert format_time(59.9) == "0:00:59"


def test_smooth_keeps_constants_and_starts_at_the_first_value():
    assert smooth([2.0] * 5) == pytest.approx([2.0] * 5)
    curve = smooth([4.0, 0.0, 0.0])
    assert curve[0] == 4.0 and 0.0 < curve[-1] < curve[1] < 4.0


@pytest.fixture
def run(tmp_path, tiny_model_dir, caplog):
    lengths = [5, 6, 7, 8, 4, 9]
    cfg = make_cfg(
        tmp_path / "out",
        tiny_model_dir,
        per_device_train_batch_size=1,
        max_steps=6,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=3,
        plot_loss=True,
    )
    with caplog.at_level(logging.INFO, logger="tuneforge"):
        Trainer(
            cfg,
            load_model(tiny_model_dir),
            None,
            random_dataset(lengths),
            random_dataset([5, 6], seed=1),
            collate,
        ).train()
    return tmp_path / "out", lengths, caplog.text


def test_trainer_log_has_llamafactory_fields_per_log_and_eval(run):
    out, lengths, _ = run
    lines = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    train = [line for line in lines if "loss" in line]
    evals = [line for line in lines if "eval_loss" in line]
    assert [line["current_steps"] for line in train] == [2, 4, 6]
    assert [line["current_steps"] for line in evals] == [3, 6]
    assert all(set(line) == TRAIN_FIELDS for line in train)
    assert all(set(line) == EVAL_FIELDS for line in evals)
    assert [line["percentage"] for line in train] == [33.33, 66.67, 100.0]
    assert all(line["total_steps"] == 6 for line in lines)
    assert train[-1]["total_tokens"] == sum(lengths)  # one epoch of 6 rows, padding not counted
    assert train[-1]["epoch"] == 1.0
    assert train[-1]["remaining_time"] == "0:00:00"
    assert all(len(line["elapsed_time"].split(":")) == 3 for line in lines)


def test_info_line_per_logging_step_without_a_terminal(run):
    _, _, text = run
    assert text.count("step 2/6 (33%)") == 1 and text.count("step 6/6 (100%)") == 1
    assert "step 1/6" not in text and "eval at step 3: eval_loss" in text


def test_steps_after_the_last_logging_multiple_are_logged_once_at_the_end(tmp_path, tiny_model_dir, caplog):
    # rows of one length, one per step: every step has the same token count, so a window's loss (their
    # token-weighted mean) is the plain mean of its steps' losses
    data = random_dataset([7] * 10)

    def lines(logging_steps: int) -> list[dict]:
        out = tmp_path / f"every-{logging_steps}"
        cfg = make_cfg(out, tiny_model_dir, per_device_train_batch_size=1, max_steps=10,
                       logging_steps=logging_steps)
        Trainer(cfg, load_model(tiny_model_dir), None, data, None, collate).train()
        return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]

    per_step = lines(1)
    with caplog.at_level(logging.INFO, logger="tuneforge"):
        windows = lines(4)
    assert [line["current_steps"] for line in windows] == [4, 8, 10]
    losses = [line["loss"] for line in per_step]
    assert windows[1]["loss"] == pytest.approx(sum(losses[4:8]) / 4, abs=1e-6)
    assert windows[2]["loss"] == pytest.approx((losses[8] + losses[9]) / 2, abs=1e-6)
    assert windows[2]["grad_norm"] == pytest.approx(per_step[9]["grad_norm"], abs=1e-6)
    assert windows[2]["epoch"] == 1.0 and windows[2]["percentage"] == 100.0
    assert caplog.text.count("step 10/10 (100%)") == 1 and caplog.text.count("step 8/10 (80%)") == 1


def test_plots_are_pngs(run):
    out, _, _ = run
    for name in (LOSS_PLOT, EVAL_LOSS_PLOT):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_eval_plot_without_evaluations_and_no_plots_unless_asked(tmp_path, tiny_model_dir):
    for plot in (True, False):
        out = tmp_path / f"plot-{plot}"
        cfg = make_cfg(out, tiny_model_dir, max_steps=2, plot_loss=plot)
        Trainer(cfg, load_model(tiny_model_dir), None, random_dataset([5, 6]), None, collate).train()
        assert (out / LOSS_PLOT).exists() is plot
        assert not (out / EVAL_LOSS_PLOT).exists()


def test_resumed_log_keeps_only_lines_up_to_the_checkpoint(tmp_path):
    log = TrainerLog(tmp_path, total_steps=10)
    log.path.write_text("".join(json.dumps({"current_steps": s, "loss": 1.0}) + "\n" for s in range(1, 7)))
    log.start(resumed_step=4)
    assert [json.loads(line)["current_steps"] for line in log.path.read_text().splitlines()] == [1, 2, 3, 4]
    log.start(resumed_step=None)
    assert not log.path.exists()
