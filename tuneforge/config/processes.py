"""How many processes `tuneforge train` will start, read before any starts: Ray's keys and the launch variables."""

from __future__ import annotations

import os
from collections.abc import Mapping

from tuneforge.config.schema import RunConfig
from tuneforge.flags import env_flag


def ray_requested(cfg: RunConfig, env: Mapping[str, str] = os.environ) -> bool:
    """use_ray: true in the config, or USE_RAY=1 in the environment (as in LlamaFactory)."""
    return cfg.ray.use_ray or env_flag("USE_RAY", env)


def planned_processes(cfg: RunConfig, env: Mapping[str, str] = os.environ) -> int | None:
    """How many processes `tuneforge train` will run (None when the launch variables are malformed)."""
    if ray_requested(cfg, env):
        return cfg.ray.ray_num_workers  # the Ray Train workers are the processes
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:  # started by torchrun
        return int(env["WORLD_SIZE"])
    if env_flag("FORCE_TORCHRUN", env):
        nproc, nnodes = env.get("NPROC_PER_NODE", "").strip(), env.get("NNODES", "1").strip() or "1"
        return int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None
    import torch  # only sharded runs ask: several visible GPUs start one process each

    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
