"""report_to's trackers get the numbers trainer_log.jsonl gets, under train/... and eval/..., and the config without
its secrets. TensorBoard, MLflow (a local file store), SwanLab (offline mode) and trackio (a local database) run here
and are read back; every store lives under tmp_path (HOME too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneforge.config import from_dict
from tuneforge.errors import ConfigError
from tuneforge.train import reporters

REPO_DATA = Path(__file__).resolve().parents[2] / "data"
SECRET = "hf_do_not_log_me"


def test_scalars_are_named_as_tensorboard_names_them():
    entry = {"loss": 2.5, "learning_rate": 1e-3, "grad_norm": 0.7, "epoch": 0.5, "step": 3, "rewards/margins": 0.1,
             "sample": "text", "flag": True}
    assert reporters.scalars(entry) == {"train/loss": 2.5, "train/learning_rate": 1e-3, "train/grad_norm": 0.7,
                                        "train/epoch": 0.5, "train/rewards/margins": 0.1}
    evaluation = {"eval_loss": 2.0, "perplexity": 7.39, "eval_rewards/accuracies": 0.75, "epoch": 1.0, "step": 4}
    assert reporters.scalars(evaluation) == {"eval/loss": 2.0, "eval/perplexity": 7.39,
                                             "eval/rewards/accuracies": 0.75, "train/epoch": 1.0}


def test_the_config_trackers_get_has_no_secrets():
    cfg = from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "hub_token": SECRET,
                     "hf_hub_token": SECRET, "swanlab_api_key": SECRET, "swanlab_lark_secret": SECRET,
                     "swanlab_lark_webhook_url": "https://hook", "learning_rate": 1e-4}, for_training=False)
    config = reporters.public_config(cfg)
    assert config["learning_rate"] == 1e-4 and config["swanlab_project"] == "llamafactory"
    assert SECRET not in json.dumps(config) and "https://hook" not in json.dumps(config)


def test_a_tracker_that_is_not_installed_is_refused_naming_its_package(monkeypatch):
    from tuneforge.config import tracking

    monkeypatch.setattr(tracking, "installed", lambda name: name != "swanlab")
    raw = {"model_name_or_path": "m", "dataset": "d", "output_dir": "o"}
    with pytest.raises(ConfigError, match=r"use_swanlab: swanlab needs the swanlab package: pip install swanlab") as e:
        from_dict({**raw, "use_swanlab": True}, for_training=False)
    assert e.value.keys == ("use_swanlab",)
    with pytest.raises(ConfigError, match=r"report_to: swanlab needs the swanlab package"):
        from_dict({**raw, "report_to": "tensorboard,swanlab"}, for_training=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = from_dict({**raw, "report_to": "all"}, for_training=False)  # all: the installed ones that can run
    wanted = tracking.requested_reporters(cfg)
    assert "swanlab" not in wanted and "trackio" in wanted
    assert ("mlflow" in wanted) is (tracking.mlflow_store_problem() is None)


def test_mlflow_default_store_without_the_full_package_is_refused(monkeypatch):
    import importlib.util

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    raw = {"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "report_to": "mlflow"}
    if importlib.util.find_spec("sqlalchemy") is None:
        with pytest.raises(ConfigError, match=r"needs the full mlflow package: pip install mlflow, or set "
                                              r"MLFLOW_TRACKING_URI"):
            from_dict(raw, for_training=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    from_dict(raw, for_training=False)


@pytest.mark.parametrize(("keys", "message"), [
    ({"use_swanlab": True, "swanlab_mode": "remote"}, "key 'swanlab_mode': 'remote' is not one of cloud, online"),
    ({"use_swanlab": True, "swanlab_lark_secret": "s"}, "set swanlab_lark_webhook_url too"),
    ({"report_to": "comet_ml"}, "report_to: 'comet_ml' is not one of none, all, tensorboard"),
])
def test_tracker_settings_that_cannot_work(keys, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": "o", **keys}, for_training=False)


@pytest.fixture
def local_stores(tmp_path, monkeypatch):
    """MLflow, SwanLab and trackio writing under tmp_path only."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for those who ask
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-settings"))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    import trackio.sqlite_storage
    import trackio.utils

    for module in (trackio.utils, trackio.sqlite_storage):  # trackio reads TRACKIO_DIR once, at import
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    return tmp_path


def test_every_tracker_gets_the_logged_numbers_and_the_config(tiny_model_dir, local_stores, monkeypatch):
    from tuneforge.workflow import run

    tmp_path = local_stores
    monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "tf-home"))
    cfg = from_dict({
        "model_name_or_path": str(tiny_model_dir), "dataset_dir": str(REPO_DATA), "dataset": "alpaca_demo",
        "output_dir": str(tmp_path / "out"), "max_samples": 16, "cutoff_len": 64, "max_steps": 3,
        "per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no",
        "disable_tqdm": True, "val_size": 4, "eval_strategy": "steps", "eval_steps": 3,
        "report_to": ["tensorboard", "mlflow", "trackio"], "use_swanlab": True, "swanlab_mode": "offline",
        "swanlab_logdir": str(tmp_path / "swanlog"), "swanlab_project": "cards", "run_name": "tiny-run",
        "project": "tuneforge-tests", "hub_token": SECRET,
    }, source="trackers.yaml")
    run(cfg)
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    losses = {r["current_steps"]: r["loss"] for r in log if "loss" in r}
    eval_loss = next(r["eval_loss"] for r in log if "eval_loss" in r)
    assert sorted(losses) == [1, 2, 3]

    # TensorBoard: output_dir/runs, the names the other trackers use
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "out" / "runs")).Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(losses)
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([eval_loss])

    # MLflow: one run named run_name, the params, every step's loss, the evaluation
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    [mlrun] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlrun.info.run_name == "tiny-run" and mlrun.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "train/loss")} == pytest.approx(losses)
    assert mlrun.data.metrics["eval/loss"] == pytest.approx(eval_loss)
    assert mlrun.data.params["learning_rate"] == "0.001" and "hub_token" not in mlrun.data.params

    # trackio: the project's local database
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs("tuneforge-tests", "tiny-run")
    assert {r["step"]: r["train/loss"] for r in rows if "train/loss" in r} == pytest.approx(losses)
    assert next(r["eval/loss"] for r in rows if "eval/loss" in r) == pytest.approx(eval_loss)
    config = SQLiteStorage.get_run_config("tuneforge-tests", "tiny-run")
    assert config["learning_rate"] == 1e-3 and "hub_token" not in config

    # SwanLab: the offline run's record file and config
    [folder] = (tmp_path / "swanlog").glob("run-*")
    scalars = swanlab_scalars(next(folder.glob("*.swanlab")))
    assert {step: value for key, step, value in scalars if key == "train/loss"} == pytest.approx(losses)
    assert [value for key, _, value in scalars if key == "eval/loss"] == pytest.approx([eval_loss])
    config_text = (folder / "files" / "config.yaml").read_text()
    assert "swanlab_project" in config_text and SECRET not in config_text


def swanlab_scalars(path: Path) -> list[tuple[str, int, float]]:
    """(key, step, value) of every scalar in a SwanLab run file, read with SwanLab's own reader."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader = DataStoreReader()
    reader.open(path)
    out = []
    try:
        for data in iter(reader.scan, None):
            record = Record()
            record.ParseFromString(data)
            if record.HasField("scalar"):
                out.append((record.scalar.key, record.scalar.step, record.scalar.value.number))
    finally:
        reader.close()
    return out
