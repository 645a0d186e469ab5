"""When and how `tuneforge train` relaunches itself under torchrun (LlamaFactory's variables)."""

import pytest

from tuneforge.errors import ConfigError
from tuneforge.train.launch import launch_plan, under_torchrun


def test_one_device_runs_in_this_process():
    assert launch_plan({}, device_count=0) is None
    assert launch_plan({}, device_count=1) is None
    assert launch_plan({"FORCE_TORCHRUN": "0"}, device_count=1) is None


def test_several_devices_start_one_process_each():
    plan = launch_plan({"MASTER_PORT": "29511"}, device_count=4)
    assert plan.torchrun_args() == [
        "--nnodes", "1", "--nproc-per-node", "4", "--node-rank", "0", "--master-addr", "127.0.0.1",
        "--master-port", "29511",
    ]


def test_a_process_torchrun_started_does_not_launch_again():
    env = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    assert under_torchrun(env) and launch_plan(env, device_count=4) is None


def test_forced_on_a_cpu_needs_the_process_count():
    with pytest.raises(ConfigError, match="set NPROC_PER_NODE"):
        launch_plan({"FORCE_TORCHRUN": "1"}, device_count=0)
    plan = launch_plan({"FORCE_TORCHRUN": "true", "NPROC_PER_NODE": "2"}, device_count=0)
    assert plan.nproc_per_node == 2 and 0 < plan.master_port < 65536  # a free port when none is given


def test_multi_node_takes_llamafactorys_variables():
    env = {"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    plan = launch_plan(env, device_count=8)
    assert plan.torchrun_args() == [
        "--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1", "--master-addr", "10.0.0.1",
        "--master-port", "29500",
    ]


def test_elastic_jobs_rendezvous_on_the_master():
    env = {"RDZV_ID": "job7", "MIN_NNODES": "1", "MAX_NNODES": "3", "MAX_RESTARTS": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    plan = launch_plan(env, device_count=2)
    assert plan.torchrun_args() == [
        "--nnodes", "1:3", "--nproc-per-node", "2", "--rdzv-id", "job7", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "10.0.0.1:29500", "--max-restarts", "2",
    ]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE='0' must be a whole number >= 1"),
        ({"NPROC_PER_NODE": "8"}, "has 2 CUDA devices"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "NODE_RANK=2 must be below NNODES=2"),
        ({"NNODES": "2"}, "set MASTER_ADDR and MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "not a port number"),
        ({"RDZV_ID": "x", "MIN_NNODES": "3", "MAX_NNODES": "2"}, "MIN_NNODES=3 is above MAX_NNODES=2"),
    ],
)
def test_malformed_topology_is_refused_before_any_process_starts(env, message):
    with pytest.raises(ConfigError, match=message):
        launch_plan(env, device_count=2)


def test_the_root_cause_of_torchruns_report_names_the_rank():
    from tuneforge.train.launch import failed_rank

    report = (
        "Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 7)  (SIGTERM)\n"
        "------\nRoot Cause (first observed failure):\n[0]:\n  time      : 2026-12-03_11:38:13\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: 8)\n"
    )
    assert failed_rank(report) == ("1", "3")
    assert failed_rank("killed") == (None, None)
