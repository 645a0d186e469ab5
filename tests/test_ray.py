"""Ray Train workers through the CLI, as a user runs them: `tuneforge train cfg.yaml use_ray=true ray_num_workers=2`.

A local Ray cluster on 127.0.0.1 (token auth, its temp dir under pytest's) serves the module and is shut down
after it, leaving no process behind. Two Ray workers with the same global batch train exactly what one
process trains (logged losses and final weights 1e-4, fp32) and write the same files; a worker's error
ends the run with a message naming its rank."""

import os
import secrets
import subprocess
import sys
import time

import psutil
import pytest
from test_distributed import FAST, ROOT, assert_same_run

pytestmark = pytest.mark.e2e

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's switch for a one-machine cluster: nodes take 127.0.0.1
    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),  # a token of our own: none saved in ~/.ray
}


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """The address of a local Ray cluster on 127.0.0.1, this module's (2 CPUs, no dashboard)."""
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)  # also for the raylet's workers and the `tuneforge train` drivers
    import ray
    from ray._private import ray_constants

    cluster_switch = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import: this process may have imported ray already
    temp = tmp_path_factory.mktemp("ray")  # short enough for the cluster's unix sockets
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=str(temp),
                       _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield context.address_info["gcs_address"]
    finally:
        started = psutil.Process().children(recursive=True)  # the cluster's processes and its workers
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=30)
        ray_constants.ENABLE_RAY_CLUSTER = cluster_switch
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert not [(p.pid, p.name()) for p in alive if p.is_running()], "Ray left processes behind"


def train(config, out, model_dir, *overrides, ok=True):
    r = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "train", config, f"output_dir={out}",
         f"model_name_or_path={model_dir}", *FAST, *overrides],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    if ok:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir):
    one = tmp_path_factory.mktemp("one-process") / "one"
    train("examples/sft_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4")
    return one


@pytest.mark.parametrize("strategy", ["ddp", "fsdp=full_shard", "deepspeed=examples/deepspeed/ds_z3_config.json"])
def test_two_ray_workers_train_what_one_process_trains(tmp_path, tiny_model_dir, ray_address, one_process, strategy):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    assert ray_address.startswith("127.0.0.1:")
    two = tmp_path / "two"
    start = time.monotonic()
    r = train("examples/sft_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2", "use_ray=true",
              "ray_num_workers=2", "resources_per_worker={CPU: 1}", "placement_strategy=PACK",
              f"ray_init_kwargs={{address: '{ray_address}'}}", f"ray_storage_path={tmp_path / 'ray_results'}",
              *([] if strategy == "ddp" else [strategy]))
    print(f"ray run: {time.monotonic() - start:.0f} s")
    assert r.stdout.count("adapter saved in") == 1 and "over 3 steps" in r.stdout  # rank 0's summary
    assert_same_run(one_process, two, ("loss", "grad_norm"))
    assert listing(two) == listing(one_process)
    assert (tmp_path / "ray_results").is_dir()  # Ray's run records, outside output_dir


def test_a_workers_error_ends_the_run_naming_its_rank(tmp_path, tiny_model_dir, ray_address):
    r = train("examples/sft_lora.yaml", tmp_path / "out", tiny_model_dir, "dataset=no_such_dataset",
              "use_ray=true", "ray_num_workers=2", "resources_per_worker={CPU: 1}",
              f"ray_init_kwargs={{address: '{ray_address}'}}", f"ray_storage_path={tmp_path / 'ray_results'}",
              ok=False)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run failed on rank 0: ") and "no_such_dataset" in last, last
