"""The process group of a multi-process run, and the data that only one process per node prepares.

A process that torchrun started (tuneforge/train/launch.py) joins the group here: gloo on CPU, nccl on CUDA
(each process on the device of its LOCAL_RANK); a Ray Train worker (tuneforge/train/ray_launch.py) finds
the group Ray set up and uses it. Besides it, a gloo group with its own, long timeout
(`data_timeout`) carries one barrier: the main process of each node tokenizes and caches the data while
the others wait on that barrier, not on a collective of the training group, whose watchdog would end a
job whose tokenization takes longer than a collective may wait.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from tuneforge.train.launch import free_port, under_torchrun

logger = logging.getLogger(__name__)

_state: dict[str, object] = {}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def setup(timeout_s: int, data_timeout_s: int, alone: bool = False) -> bool:
    """Join the process group when torchrun started this process with WORLD_SIZE > 1; True when joined.

    A group that the launcher already set up (Ray Train's workers) is used as it is: only the data group
    is added, and teardown leaves the launcher's group to the launcher. alone: a single process that still
    needs a group of its own (DeepSpeed's engine runs on one), on a free local port."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() <= 1 or "data_group" in _state:
            return False
        _state["data_group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=data_timeout_s))
        _state["launcher_group"] = True
        logger.info("rank %d of %d uses the launcher's process group (%s)", dist.get_rank(), dist.get_world_size(),
                    dist.get_backend())
        return True
    if alone and not under_torchrun():  # a group of one, set up as torchrun would (DeepSpeed reads LOCAL_RANK)
        single = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
        os.environ.update(single)
        _state["set_env"] = list(single)  # removed again by teardown
    if not under_torchrun() or (int(os.environ["WORLD_SIZE"]) <= 1 and not alone):
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank())
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    _state["data_group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=data_timeout_s))
    logger.info("rank %d of %d joined the process group (%s)", dist.get_rank(), dist.get_world_size(), backend)
    return True


def teardown(wait_for_others: bool = True) -> None:
    """Leave the process group, after every rank got here (so none tears down under another's collective);
    wait_for_others false: at once (this process failed, and the others will never reach the barrier)."""
    if not dist.is_initialized():
        return
    group = _state.get("data_group")
    if wait_for_others:
        dist.barrier(group=group)
    launcher_group = _state.get("launcher_group", False)
    releases = _state.get("releases", [])
    for key in _state.get("set_env", []):
        os.environ.pop(key, None)
    _state.clear()
    if releases:  # FSDP2 ran: let go of the groups, so that destroying them below really ends them
        for release in releases:
            release()
        gc.collect()  # the trainer's sharded modules, unreachable since training returned, hold groups too
    if not launcher_group:
        dist.destroy_process_group()
    elif group is not None:
        dist.destroy_process_group(group)


def release_before_teardown(release: Callable[[], None]) -> None:
    """Have teardown call release() before it destroys the process groups.

    A process group ends (its gloo threads joined, its connections closed) when its last reference goes.
    FSDP2's device mesh holds its groups and outlives training in DTensor's global caches, so without this
    destroy_process_group() would leave the group running until the interpreter exits."""
    _state.setdefault("releases", []).append(release)


@contextlib.contextmanager
def node_leader_first() -> Iterator[bool]:
    """Run the body on each node's LOCAL_RANK 0 first and on the others after it finished (they then find
    its cache). Yields True on the leaders. Without a process group the body just runs."""
    group = _state.get("data_group")
    if not is_distributed() or group is None:
        yield True
        return
    leader = local_rank() == 0
    if not leader:
        dist.barrier(group=group)  # released when every leader has finished the body
    yield leader
    if leader:
        dist.barrier(group=group)


class ObjectiveStep(torch.nn.Module):
    """A micro-batch's objective as one module call, so a data-parallel wrapper sees the whole forward.

    Objectives call parts of the model (its decoder, then the head on the supervised positions only), not
    its forward; DistributedDataParallel only syncs gradients of what ran inside its own forward, so it
    wraps this module, whose forward is the objective."""

    def __init__(self, model: torch.nn.Module, objective) -> None:
        super().__init__()
        self.model = model
        self.__dict__["objective"] = objective  # not a submodule: a frozen reference is no parameter of ours

    def forward(self, batch):
        return self.objective(self.model, batch)


def data_parallel(model: torch.nn.Module, objective, device: torch.device) -> torch.nn.Module:
    """ObjectiveStep(model, objective), under DistributedDataParallel when several processes train."""
    step = ObjectiveStep(model, objective)
    if not is_distributed() or not any(p.requires_grad for p in model.parameters()):
        return step
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        step, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False
    )
