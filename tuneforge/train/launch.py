"""Run `tuneforge train` on many processes: relaunch the same command under torchrun.

`tuneforge train cfg.yaml` relaunches itself when more than one CUDA device is visible or FORCE_TORCHRUN=1,
with LlamaFactory's variables: NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT, and for an
elastic job RDZV_ID (with MIN_NNODES / MAX_NNODES and MAX_RESTARTS). Each process then runs the command
with torchrun's RANK / LOCAL_RANK / WORLD_SIZE set, which `under_torchrun` recognizes, so nothing launches
twice. The plan is checked before any process starts: a malformed variable is a ConfigError naming it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from tuneforge.errors import ConfigError, TrainingError
from tuneforge.flags import env_flag

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class LaunchPlan:
    nnodes: str  # "2", or "1:4" for an elastic job
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    rdzv_id: str | None = None
    max_restarts: int = 0

    def torchrun_args(self) -> list[str]:
        """torch.distributed.run's arguments for this plan (the command to run comes after them)."""
        args = ["--nnodes", self.nnodes, "--nproc-per-node", str(self.nproc_per_node)]
        if self.rdzv_id is not None:
            return args + [
                "--rdzv-id", self.rdzv_id, "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.master_addr}:{self.master_port}", "--max-restarts", str(self.max_restarts),
            ]
        return args + [
            "--node-rank", str(self.node_rank), "--master-addr", self.master_addr, "--master-port", str(self.master_port),
        ]


def under_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a process that torchrun (or another launcher setting its variables) started."""
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def _whole(env: Mapping[str, str], key: str, default: int, *, least: int) -> int:
    raw = env.get(key, "").strip() or str(default)
    if not raw.isdigit() or int(raw) < least:
        raise ConfigError(f"{key}={raw!r} must be a whole number >= {least}")
    return int(raw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_plan(env: Mapping[str, str] = os.environ, device_count: int | None = None) -> LaunchPlan | None:
    """How to relaunch under torchrun, or None to run in this process (one device, or already launched)."""
    if under_torchrun(env):
        return None
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    forced = env_flag("FORCE_TORCHRUN", env)
    if not forced and device_count <= 1:
        return None
    if device_count == 0 and not env.get("NPROC_PER_NODE", "").strip():
        raise ConfigError("FORCE_TORCHRUN=1 on a machine without CUDA devices: set NPROC_PER_NODE to the number of "
                          "processes to start here (each runs on the CPU, talking over gloo)")
    nproc = _whole(env, "NPROC_PER_NODE", max(device_count, 1), least=1)
    if device_count and nproc > device_count:
        raise ConfigError(f"NPROC_PER_NODE={nproc}, but this machine has {device_count} CUDA devices; "
                          f"start at most one process per device")
    nnodes = _whole(env, "NNODES", 1, least=1)
    node_rank = _whole(env, "NODE_RANK", 0, least=0)
    if node_rank >= nnodes:
        raise ConfigError(f"NODE_RANK={node_rank} must be below NNODES={nnodes} (nodes count from 0)")
    port = _whole(env, "MASTER_PORT", 0, least=0)
    if port > 65535:
        raise ConfigError(f"MASTER_PORT={port} is not a port number (1-65535)")
    if nnodes > 1 and (not port or not env.get("MASTER_ADDR")):
        raise ConfigError(f"NNODES={nnodes}: set MASTER_ADDR and MASTER_PORT to the address of node 0, the same on "
                          f"every node")
    rdzv_id = env.get("RDZV_ID", "").strip() or None
    nodes = str(nnodes)
    if rdzv_id is not None and (env.get("MIN_NNODES") or env.get("MAX_NNODES")):
        low = _whole(env, "MIN_NNODES", nnodes, least=1)
        high = _whole(env, "MAX_NNODES", nnodes, least=1)
        if low > high:
            raise ConfigError(f"MIN_NNODES={low} is above MAX_NNODES={high}")
        nodes = f"{low}:{high}"
    return LaunchPlan(
        nnodes=nodes, node_rank=node_rank, nproc_per_node=nproc,
        master_addr=env.get("MASTER_ADDR", "").strip() or "127.0.0.1", master_port=port or free_port(),
        rdzv_id=rdzv_id, max_restarts=_whole(env, "MAX_RESTARTS", 0, least=0),
    )


def relaunch(plan: LaunchPlan, argv: list[str]) -> int:
    """Run `tuneforge argv...` on plan's processes under torchrun; 0 when every process succeeded.

    torchrun's output streams through as it comes; when a process fails, torchrun stops the others (none
    is left waiting in a collective) and its report's root cause names the rank, which the TrainingError
    repeats in one line."""
    logger.info("starting %d processes per node on %s nodes (master %s:%d)", plan.nproc_per_node, plan.nnodes,
                plan.master_addr, plan.master_port)
    tail: list[str] = []
    # torchrun's own files (each rank's error file) go to a folder removed afterwards; by default torchrun makes a
    # new torchelastic_* folder in the temporary directory for every run and leaves it there
    with tempfile.TemporaryDirectory(prefix="tuneforge-torchrun-") as logs:
        command = [sys.executable, "-m", "torch.distributed.run", *plan.torchrun_args(), "--log-dir", logs,
                   "-m", "tuneforge.cli", *argv]
        with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace") as process:
            for line in process.stderr:
                sys.stderr.write(line)
                tail = (tail + [line])[-200:]
    if process.returncode == 0:
        return 0
    rank, code = failed_rank("".join(tail))
    where = f"on rank {rank} (exit code {code})" if rank is not None else f"(torchrun exit status {process.returncode})"
    raise TrainingError(f"the run failed {where}; that process's own error is above, and torchrun stopped the others")


def failed_rank(report: str) -> tuple[str | None, str | None]:
    """(rank, exit code) of the root cause in torchrun's failure report, or (None, None)."""
    root = report[report.rfind("Root Cause"):] if "Root Cause" in report else ""
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    return (rank.group(1) if rank else None), (code.group(1) if code else None)
