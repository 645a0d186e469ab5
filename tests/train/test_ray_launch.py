"""use_ray / USE_RAY=1: what is refused before Ray starts, and how a worker's failure reads (no cluster here)."""

import sys
from pathlib import Path

import pytest

from tuneforge.cli import main
from tuneforge.config import from_dict
from tuneforge.config.processes import ray_requested
from tuneforge.errors import ConfigError, DataError
from tuneforge.train.ray_launch import (
    check,
    shared_env,
    storage_path,
    worker_error,
    worker_resources,
)


def cfg(tmp_path, **kw):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **kw})


def test_use_ray_in_the_config_or_use_ray_1_in_the_environment(tmp_path):
    assert not ray_requested(cfg(tmp_path), env={})
    assert ray_requested(cfg(tmp_path, use_ray=True), env={})
    assert ray_requested(cfg(tmp_path), env={"USE_RAY": "1"})  # LlamaFactory's switch
    assert not ray_requested(cfg(tmp_path), env={"USE_RAY": "0"})


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"ray_num_workers": 0}, "ray_num_workers must be >= 1"),
        ({"resources_per_worker": 4}, "key 'resources_per_worker': expected a mapping"),
        ({"resources_per_worker": {"gpu": 1}}, "case-sensitive; write GPU, not gpu"),
        ({"resources_per_worker": {"GPU": -1}}, "GPU must be a number >= 0"),
        ({"resources_per_worker": {"CPU": "four"}}, "CPU must be a number >= 0"),
        ({"placement_strategy": "spread_out"}, "'spread_out' is not one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
        ({"ray_init_kwargs": "address"}, "key 'ray_init_kwargs'"),
        ({"ray_storage_filesystem": "s3"}, "LlamaFactory key 'ray_storage_filesystem' is not supported"),
    ],
)
def test_ray_keys_are_checked_when_the_config_loads(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        cfg(tmp_path, use_ray=True, **kw)


def test_llamafactory_ray_keys_load(tmp_path):
    c = cfg(tmp_path, use_ray=True, ray_num_workers=4, resources_per_worker='{"CPU": 2, "GPU": 1}',
            placement_strategy="SPREAD", ray_init_kwargs={"runtime_env": {"env_vars": {"A": "1"}}},
            ray_run_name="run", ray_storage_path="saves")
    assert (c.ray.ray_num_workers, c.ray.resources_per_worker) == (4, {"CPU": 2, "GPU": 1})
    assert c.ray.placement_strategy == "SPREAD" and c.ray.ray_init_kwargs["runtime_env"]["env_vars"] == {"A": "1"}
    assert storage_path(c) == str(Path.cwd() / "saves")


def test_ray_keeps_its_run_records_in_the_tuneforge_cache_not_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "home"))
    assert storage_path(cfg(tmp_path, use_ray=True)) == str(tmp_path / "home" / "ray_results")


def test_ray_and_torchrun_both_asked_for_is_refused():
    with pytest.raises(ConfigError, match="choose one"):
        check({"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"})
    with pytest.raises(ConfigError, match="choose one"):
        check({"LOCAL_RANK": "0", "WORLD_SIZE": "2"})  # `torchrun ... tuneforge train` with use_ray


def test_ray_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.train.torch", None)  # import fails as if ray were absent
    with pytest.raises(ConfigError, match=r"pip install 'tuneforge\[ray\]'"):
        check({})


def test_the_cli_refuses_before_any_process_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    monkeypatch.setenv("USE_RAY", "1")
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name_or_path: m\ndataset: d\noutput_dir: {tmp_path / 'out'}\n")
    assert main(["train", str(config)]) == 2
    assert "choose one" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_workers_get_a_cpu_each_and_a_gpu_when_the_cluster_has_them():
    assert worker_resources({}, {"CPU": 8}) == {"CPU": 1}
    assert worker_resources({}, {"CPU": 8, "GPU": 2}) == {"CPU": 1, "GPU": 1}
    assert worker_resources({"CPU": 4}, {"CPU": 8, "GPU": 2}) == {"CPU": 4}


def test_workers_share_the_drivers_caches_but_not_its_secrets():
    env = {"HF_HOME": "/h", "HF_TOKEN": "secret", "TUNEFORGE_HOME": "/t", "WANDB_API_KEY": "k", "PATH": "/bin",
           "CUDA_VISIBLE_DEVICES": "0", "HF_HUB_OFFLINE": "1"}
    assert shared_env(env, {}) == {"HF_HOME": "/h", "TUNEFORGE_HOME": "/t", "HF_HUB_OFFLINE": "1"}
    assert "HF_HOME" not in shared_env(env, {"HF_HOME": "/mine"})  # the user's runtime_env wins


class FakeWorkerGroupError(Exception):
    def __init__(self, failures):
        super().__init__("Training failed due to worker errors")
        self.worker_failures = failures


class WorkerHealthCheckFailedError(Exception):
    """What Ray Train reports for a worker whose process died."""


def test_a_workers_error_names_its_rank():
    err = worker_error(FakeWorkerGroupError({1: DataError("data/dataset_info.json has no dataset 'x'")}))
    assert str(err) == "the run failed on rank 1: data/dataset_info.json has no dataset 'x'"
    err = worker_error(FakeWorkerGroupError({1: ValueError("boom"), 0: ValueError("boom")}))
    assert str(err) == "the run failed on ranks 0, 1: ValueError: boom (its traceback is above)"
    assert str(worker_error(RuntimeError("controller died"))) == "the Ray run failed: controller died"


def test_the_rank_that_caused_it_is_named_not_the_ones_left_waiting():
    gloo = RuntimeError("gloo: Connection reset by peer")
    err = worker_error(FakeWorkerGroupError({0: gloo, 1: WorkerHealthCheckFailedError("actor died")}))
    assert str(err) == "the run failed on rank 1: its worker process died (Ray's report is above) (then rank 0 failed too)"
    err = worker_error(FakeWorkerGroupError({0: gloo, 2: gloo, 3: DataError("bad row 7")}))
    assert str(err) == "the run failed on rank 3: bad row 7 (then ranks 0, 2 failed too)"
