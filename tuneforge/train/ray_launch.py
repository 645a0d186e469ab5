"""Run `tuneforge train` in Ray Train workers: `use_ray: true`, or LlamaFactory's USE_RAY=1.

The `tuneforge train` process is Ray's driver: it calls `ray.init(**ray_init_kwargs)` (a new local cluster by
default; `{address: auto}` or `{address: HOST:PORT}` joins a running one), and Ray Train's TorchTrainer starts
ray_num_workers workers, each holding resources_per_worker, placed over the nodes by placement_strategy.
Ray joins the workers in one torch process group (gloo on CPU, nccl when they hold GPUs) and sets RANK,
LOCAL_RANK and WORLD_SIZE, so every worker runs the same `tuneforge.workflow.run` a torchrun process runs:
the same data split, the same loss reduced over the ranks, the same files in output_dir (rank 0 writes
them). The driver gets rank 0's results back and prints the usual summary; a worker's error comes back as
a TrainingError naming its rank, and the cluster the driver started is shut down either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tuneforge.config import RunConfig
from tuneforge.errors import ConfigError, TrainingError, TuneforgeError
from tuneforge.flags import env_flag
from tuneforge.train.launch import under_torchrun

logger = logging.getLogger(__name__)

# the driver's variables a worker needs to find the same caches and models (a cluster the driver did not
# start has its own environment); secrets (…TOKEN, …KEY) go through ray_init_kwargs' runtime_env instead
SHARED_ENV_PREFIXES = ("HF_", "TUNEFORGE_", "TRANSFORMERS_", "TOKENIZERS_", "WANDB_")
SHARED_ENV_NAMES = ("MPLCONFIGDIR", "XDG_CACHE_HOME")


def check(env: Mapping[str, str] = os.environ) -> None:
    """What must hold before Ray starts anything: no torchrun launch competing, Ray Train importable."""
    if env_flag("FORCE_TORCHRUN", env) or under_torchrun(env):
        raise ConfigError(
            "use_ray (or USE_RAY=1) and torchrun (FORCE_TORCHRUN=1, or a process torchrun started) both start "
            "the training processes; choose one: Ray starts ray_num_workers workers itself, so unset "
            "FORCE_TORCHRUN / run `tuneforge train` directly, or drop use_ray"
        )
    try:
        import ray.train.torch  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"use_ray needs Ray Train: pip install 'tuneforge[ray]' ({e})") from None


def worker_resources(requested: Mapping[str, float], cluster: Mapping[str, float]) -> dict[str, float]:
    """resources_per_worker, or by default 1 CPU, plus 1 GPU when the cluster has GPUs."""
    if requested:
        return dict(requested)
    return {"CPU": 1, "GPU": 1} if cluster.get("GPU", 0) >= 1 else {"CPU": 1}


def shared_env(env: Mapping[str, str], user_env_vars: Mapping[str, str]) -> dict[str, str]:
    """The driver's variables that the workers get too (the user's runtime_env env_vars win)."""
    return {
        k: v for k, v in env.items()
        if (k.startswith(SHARED_ENV_PREFIXES) or k in SHARED_ENV_NAMES)
        and "TOKEN" not in k and "KEY" not in k and k not in user_env_vars
    }


def storage_path(cfg: RunConfig) -> str:
    """Where Ray Train keeps its run records: ray_storage_path, else the tuneforge cache (never ~/ray_results)."""
    from tuneforge.paths import tuneforge_home

    path = cfg.ray.ray_storage_path or str(tuneforge_home() / "ray_results")
    return path if "://" in path else Path(path).expanduser().absolute().as_posix()


def run_on_ray(cfg: RunConfig, train: Callable[..., dict[str, Any]], ask: str | None = None) -> dict[str, Any]:
    """Run train(cfg, ask=ask) (the caller passes `workflow.run`, which train must not import) in
    ray_num_workers Ray Train workers; returns rank 0's results."""
    check()
    import ray
    from ray.train import RunConfig as RayRunConfig
    from ray.train import ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    r = cfg.ray
    init_kwargs = dict(r.ray_init_kwargs or {})
    try:
        ray.init(**init_kwargs)
    except (TypeError, ValueError) as e:  # an argument ray.init does not take, a malformed address
        raise ConfigError(f"{cfg.source}: ray_init_kwargs {init_kwargs}: {e}") from None
    except Exception as e:  # no cluster at the address, or a local one that did not start
        raise TrainingError(f"Ray did not start or connect (ray_init_kwargs {init_kwargs}): {e}") from None
    try:
        resources = worker_resources(r.resources_per_worker, ray.cluster_resources())
        _warn_if_short(resources, r.ray_num_workers, ray.cluster_resources())
        user_env = ((init_kwargs.get("runtime_env") or {}).get("env_vars") or {})
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config={"cfg": cfg, "train": train, "ask": ask, "cwd": os.getcwd()},
            torch_config=TorchConfig(timeout_s=cfg.train.ddp_timeout),
            scaling_config=ScalingConfig(
                num_workers=r.ray_num_workers, use_gpu=resources.get("GPU", 0) > 0,
                resources_per_worker=resources, placement_strategy=r.placement_strategy,
            ),
            run_config=RayRunConfig(
                name=r.ray_run_name, storage_path=storage_path(cfg),
                worker_runtime_env={"env_vars": shared_env(os.environ, user_env)},
            ),
        )
        logger.info("Ray: %d workers, %s each, placement %s", r.ray_num_workers, resources, r.placement_strategy)
        try:
            result = trainer.fit()
        except TrainingFailedError as e:
            raise worker_error(e) from None
        return result.return_value
    finally:
        ray.shutdown()


def _warn_if_short(resources: Mapping[str, float], workers: int, cluster: Mapping[str, float]) -> None:
    short = {k: (v * workers, cluster.get(k, 0)) for k, v in resources.items() if cluster.get(k, 0) < v * workers}
    for name, (need, have) in short.items():
        logger.warning(
            "Ray: %d workers x resources_per_worker %s need %g %s, the cluster has %g; Ray waits until they "
            "appear (an autoscaling cluster adds nodes), else stop it and lower ray_num_workers or "
            "resources_per_worker", workers, dict(resources), need, name, have,
        )


# how Ray Train reports a worker whose process died (killed, out of memory, os._exit) rather than raised
DEAD_WORKER_ERRORS = ("WorkerHealthCheckFailedError", "RayActorError", "ActorDiedError")


def worker_error(error: Exception) -> TrainingError:
    """One line naming the rank that failed first in cause and its error: a worker's own TuneforgeError, then
    a worker whose process died, then any other error (the others' collectives fail because of it)."""
    failures: dict[int, BaseException] = dict(getattr(error, "worker_failures", None) or {})
    if not failures:
        return TrainingError(f"the Ray run failed: {error}")

    def cause(rank: int) -> tuple[int, int]:
        e = failures[rank]
        return (0 if isinstance(e, TuneforgeError) else 1 if type(e).__name__ in DEAD_WORKER_ERRORS else 2), rank

    ranks = sorted(failures, key=cause)
    first = failures[ranks[0]]
    if isinstance(first, TuneforgeError):
        what = str(first)
    elif type(first).__name__ in DEAD_WORKER_ERRORS:
        what = "its worker process died (Ray's report is above)"
    else:
        text = str(first).strip()
        what = f"{type(first).__name__}: {text if len(text) <= 1000 else text[:1000] + ' ...'} (its traceback is above)"
    same = [k for k in ranks if type(failures[k]) is type(first) and str(failures[k]) == str(first)]
    others = [k for k in ranks if k not in same]
    where = f"rank {same[0]}" if len(same) == 1 else "ranks " + ", ".join(map(str, sorted(same)))
    then = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, sorted(others)))} failed too)" if others else ""
    return TrainingError(f"the run failed on {where}: {what}{then}")


def _train_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """One Ray Train worker: the same run a torchrun process does; rank 0 returns the results."""
    import ray.train

    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])  # Ray starts a worker in a folder of its own; relative paths are the driver's
    rank = ray.train.get_context().get_world_rank()
    _worker_logging(rank)
    import torch

    if torch.cuda.is_available():
        from ray.train.torch import get_device

        torch.cuda.set_device(get_device())  # the model loads on the current device
    results = config["train"](config["cfg"], ask=config["ask"])
    return results if rank == 0 else None


def _worker_logging(rank: int) -> None:
    """As the CLI logs: INFO on rank 0, warnings on the others; no progress bars of the libraries."""
    from tuneforge import logs

    logs.setup(logging.INFO if rank == 0 else logging.WARNING, force=True)
