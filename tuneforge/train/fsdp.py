"""FSDP2 (torch's fully_shard): each process holds 1/world of every parameter, gradient and optimizer state.

`fsdp: full_shard` (config/fsdp.py reads the keys) shards each decoder layer as its own unit, then the
ObjectiveStep around the model as the root, so the root's hooks gather the embeddings, final norm and head
around the objective's forward (objectives call the decoder and the head, not model.forward). The layers
gather their weights just before they run and free them after (full_shard) or after the backward
(shard_grad_op). The optimizer is built after sharding and holds the shards (DTensors).

- Mixed precision: with bf16 the gathered weights are bf16 and the gradients are reduced in fp32 into the fp32
  shards the optimizer steps (MixedPrecisionPolicy). A reward model's value head stays fp32 (its own unit).
- Gradient accumulation: every micro-batch but the last accumulates unreduced gradients (`no_sync`, through
  set_requires_gradient_sync); the last one reduce-scatters the step's sum. FSDP2 averages over ranks as DDP
  does, so the trainer's scale (world_size / units) is the same for both.
- QLoRA: bitsandbytes' 4-bit weights cannot be split into DTensor shards (their quantization state belongs to
  the whole packed tensor), so they stay whole on every process (ignored_params); they are frozen, so no
  gradient of theirs is reduced. Everything else (adapters, norms, embeddings, head) is sharded.
- References: the policy with its adapters disabled runs through the same sharded layers; a separate frozen
  reference model is sharded the same way (layers, then a root around its log-prob forward), so it takes
  1/world of its memory on each process, and is gathered layer by layer under no_grad.
- Checkpoints: torch.distributed.checkpoint writes the trainable weights and the optimizer state, one file per
  rank, into checkpoint-N/sharded, beside the scheduler, the per-rank RNG states and trainer_state.json; the
  folder is written under a temporary name and renamed by rank 0 once every rank has written its part. A
  checkpoint resumes on any number of processes (DCP reshards on load).
- The final save gathers the full state dict onto rank 0 (on the CPU), which writes the usual Hugging Face
  folder: an adapter for lora / oft, the whole model otherwise, plus value_head.safetensors for rm.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from tuneforge.config import RunConfig
from tuneforge.config.fsdp import SHARDED_CHECKPOINT, FsdpSettings, fsdp_settings
from tuneforge.errors import ConfigError, TrainingError
from tuneforge.train import checkpoint
from tuneforge.train.dist import ObjectiveStep, release_before_teardown
from tuneforge.train.objectives import ModelReference
from tuneforge.train.objectives.logps import sequence_logps
from tuneforge.train.objectives.reference import eval_mode
from tuneforge.train.strategy import LocalStrategy, MakeOptimizer

logger = logging.getLogger(__name__)

QUANTIZED = ("Params4bit", "Int8Params")  # bitsandbytes' parameter types: kept whole on every process


def enabled(cfg: RunConfig) -> bool:
    return fsdp_settings(cfg) is not None


class ShardedStep(ObjectiveStep):
    """The ObjectiveStep that fully_shard makes the root unit; `no_sync` as DDP has it."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate this micro-batch's gradients unreduced; the next backward outside reduces the sum."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)


def require_group(cfg: RunConfig) -> None:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        raise ConfigError(f"{cfg.source}: fsdp shards over several processes, but this one runs alone; start "
                          f"several (FORCE_TORCHRUN=1 NPROC_PER_NODE=2) or set fsdp: false")


def offload_policy(settings: FsdpSettings, device: torch.device) -> OffloadPolicy:
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if settings.cpu_offload else OffloadPolicy()


def shard(model: torch.nn.Module, objective: Any, cfg: RunConfig, device: torch.device,
          mesh: DeviceMesh | None = None) -> ShardedStep:
    """ShardedStep(model, objective) with model's layers and the step itself under fully_shard."""
    require_group(cfg)
    settings = fsdp_settings(cfg)
    mesh = mesh if mesh is not None else device_mesh(settings, device)
    bf16 = cfg.train.bf16
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    offload = offload_policy(settings, device)
    ignored = {p for p in model.parameters() if type(p).__name__ in QUANTIZED} or None
    common = dict(mesh=mesh, offload_policy=offload, ignored_params=ignored)
    step = ShardedStep(model, objective)
    layers = layers_to_shard(model, settings)
    layer_names = "/".join(sorted({type(x).__name__ for x in layers})) or "no layer"
    for layer in reversed(layers):  # inner units first, should the classes nest
        fully_shard(layer, reshard_after_forward=settings.reshard_after_forward, mp_policy=mixed, **common)
    head = getattr(model, "v_head", None)
    if isinstance(head, torch.nn.Module):  # a reward model's value head computes in fp32
        fully_shard(head, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32), **common)
    fully_shard(step, mp_policy=mixed, **common)  # the root keeps its weights gathered until the backward
    logger.info(
        "fsdp: %d %s units + the root over %s processes (%s%s%s), %s",
        len(layers), layer_names,
        "x".join(map(str, mesh.shape)), "hybrid, " if settings.hybrid else "",
        "reshard after forward" if settings.reshard_after_forward else "keep gathered until backward",
        ", cpu offload" if settings.cpu_offload else "",
        "bf16 weights, fp32 gradient reduction" if bf16 else "fp32",
    )
    if ignored:
        logger.info("fsdp: %d quantized weights stay whole on every process (not sharded)", len(ignored))
    return step


class FsdpStrategy(LocalStrategy):
    """FSDP2: the model sharded before the optimizer is built (it steps the shards); a frozen reference model
    sharded like it; sharded checkpoints; the full weights gathered onto rank 0 for the final save."""

    gathers_weights = True  # every forward all-gathers each unit's weights from every rank

    def __init__(self, cfg: RunConfig, model: torch.nn.Module) -> None:
        super().__init__(cfg, model)
        self.settings = fsdp_settings(cfg)
        self._mesh: DeviceMesh | None = None

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            require_group(self.cfg)
            self._mesh = device_mesh(self.settings, self.device)
        return self._mesh

    def place_reference(self, reference: Any) -> Any:
        if not isinstance(reference, ModelReference):
            return reference  # the policy without adapters runs through the policy's own shards
        sharded = ShardedReference(reference, self.settings, self.mesh, offload_policy(self.settings, self.device))
        logger.info("fsdp: the frozen reference model is sharded like the policy (%s units + its root)",
                    sharded.units)
        return sharded

    def wrap(self, objective: Any, make_optimizer: MakeOptimizer) -> torch.nn.Module:
        self.objective = objective
        # before the optimizer: fully_shard replaces the parameters by the shards it steps
        self.step_module = shard(self.model, objective, self.cfg, self.device, self.mesh)
        self.optimizer = make_optimizer()
        return self.step_module

    def eval_forward(self, batch: Any):
        return self.step_module(batch)  # through the root, which gathers its weights

    @contextlib.contextmanager
    def weights_usable(self) -> Iterator[None]:
        """The root's own weights (embeddings, norm, head) gathered; each layer gathers its own when it runs."""
        root = self.step_module
        state = root._get_fsdp_state()
        if getattr(state, "_is_root", True) is None:  # no forward ran yet: make the step the root first
            state._lazy_init()
        root.unshard()
        try:
            yield
        finally:
            root.reshard()

    def save_checkpoint(self, output_dir: Path, tokenizer: Any, scheduler: Any, state: checkpoint.TrainerState,
                        *, is_main: bool) -> Path:
        return save_checkpoint(output_dir, self.model, tokenizer, self.optimizer, scheduler, self.scaler, state,
                               is_main=is_main)

    def load_checkpoint(self, folder: Path, scheduler: Any) -> checkpoint.TrainerState:
        return load_checkpoint(folder, self.model, self.optimizer, scheduler, self.scaler)

    def save_final(self, tokenizer: Any, output_dir: Path, pissa_init: Path | None, pissa_convert: bool,
                   *, is_main: bool) -> None:
        save_final_model(self.model, tokenizer, output_dir, is_main=is_main)  # every rank sends its shards


def device_mesh(settings: FsdpSettings, device: torch.device) -> DeviceMesh:
    """All processes in one shard group; hybrid_shard: shard within a node, replicate across nodes."""
    world = dist.get_world_size()
    if settings.hybrid:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    release_before_teardown(lambda: forget_process_groups(mesh))
    return mesh


def forget_process_groups(mesh: DeviceMesh) -> None:
    """Drop the mesh's references to its process groups (after training, before the groups are destroyed).

    DTensor's sharding caches (global, thread-local LRU caches of specs that point at the mesh) keep the mesh
    alive until the interpreter exits, and the mesh keeps its groups in `_pg_registry`. Left so, the world
    group survives destroy_process_group(): its gloo threads (two pt_gloo_runloop workers, a gloo_tcp_loop)
    keep running into interpreter shutdown, where its C++ objects are torn down, or not, in no defined
    order. Measured on torch 2.13 with gloo, 2 processes: still running at exit before, none after."""
    registry = getattr(mesh, "_pg_registry", None)  # a private attribute: absent in other versions, no harm
    if isinstance(registry, dict):
        registry.clear()


def layers_to_shard(model: torch.nn.Module, settings: FsdpSettings) -> list[torch.nn.Module]:
    """The modules of the classes in transformer_layer_cls_to_wrap, else of the model's _no_split_modules
    (its decoder layers); none with auto_wrap_policy NO_WRAP."""
    if not settings.wrap_layers:
        return []
    names = set(settings.layer_classes)
    if not names:
        for module in model.modules():
            names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        present = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Module)})
        raise ConfigError(
            f"fsdp: the model has no module of class {', '.join(sorted(names)) or '(none named)'} to shard; set "
            f"fsdp_config.transformer_layer_cls_to_wrap to its decoder layer class (it has: "
            f"{', '.join(n for n in present if 'Layer' in n or 'Block' in n) or ', '.join(present[:8])})"
        )
    return layers


class _ReferenceLogps(torch.nn.Module):
    """A frozen model's per-sequence log-probs as one module call (the root unit of a sharded reference)."""

    def __init__(self, model: torch.nn.Module, head: str, chunk_tokens: int | None) -> None:
        super().__init__()
        self.model, self.head, self.chunk_tokens = model, head, chunk_tokens

    def forward(self, batch):
        return sequence_logps(self.model, batch, head=self.head, chunk_tokens=self.chunk_tokens).logps


class ShardedReference(ModelReference):
    """A ModelReference whose frozen model is sharded like the policy (layers, then a root around its
    log-prob forward; the root frees its weights after each forward, as there is no backward)."""

    def __init__(self, reference: ModelReference, settings: FsdpSettings, mesh: DeviceMesh, offload) -> None:
        self.model, self.head, self.chunk_tokens = reference.model, reference.head, reference.chunk_tokens
        self.step = _ReferenceLogps(self.model, self.head, self.chunk_tokens)
        layers = layers_to_shard(self.model, settings)
        # named before fully_shard, which gives each module a class of its own (FSDPLlamaDecoderLayer)
        self.units = f"{len(layers)} {'/'.join(sorted({type(x).__name__ for x in layers})) or 'no layer'}"
        for layer in reversed(layers):
            fully_shard(layer, mesh=mesh, offload_policy=offload)
        fully_shard(self.step, mesh=mesh, offload_policy=offload, reshard_after_forward=True)

    def logps(self, policy_model: torch.nn.Module, batch) -> torch.Tensor:
        with torch.no_grad(), eval_mode(self.model):
            return self.step(batch).detach()


# ---- checkpoints ------------------------------------------------------------------------------------------

_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


def _trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": the trainable weights' shards, "optimizer": the optimizer's}, keyed by parameter names."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_TRAINABLE)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    # only parameters: a quantized layer's state dict also carries its (frozen) quantization constants
    return {"model": {k: v for k, v in model_state.items() if k in trainable}, "optimizer": optimizer_state}


def save_checkpoint(
    output_dir: Path, model: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
    scaler: torch.amp.GradScaler, state: checkpoint.TrainerState, *, is_main: bool,
) -> Path:
    """output_dir/checkpoint-{global_step}, written by every rank (collective) and renamed into place."""
    final = checkpoint.folder_at(output_dir, state.global_step)
    with checkpoint.folder_of_all_ranks(final, is_main) as folder:
        dcp.save(_trainable_state(model, optimizer), checkpoint_id=folder / SHARDED_CHECKPOINT)
        torch.save(checkpoint.capture_rng(), folder / f"rng_state_{dist.get_rank()}.pt")
        if is_main:
            torch.save(scheduler.state_dict(), folder / checkpoint.SCHEDULER)
            if scaler.is_enabled():
                torch.save(scaler.state_dict(), folder / checkpoint.SCALER)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
            state.save(folder / checkpoint.TRAINER_STATE)
    if is_main:
        logger.info("saved %s (sharded over %d processes)", final, dist.get_world_size())
    return final


def load_checkpoint(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    scaler: torch.amp.GradScaler,
) -> checkpoint.TrainerState:
    """Restore the shards of the weights and optimizer, the scheduler, scaler and this rank's RNG."""
    sharded = folder / SHARDED_CHECKPOINT
    if not sharded.is_dir():
        raise TrainingError(f"checkpoint {folder} was written without fsdp; resume it without fsdp, or start afresh")
    state = _trainable_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=sharded)
    except Exception as e:  # DCP wraps each rank's error (a missing key, a shape) in a CheckpointException
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError(
            f"checkpoint {folder} does not match the model ({first[:300]}). Resume with the same "
            f"model_name_or_path, finetuning_type and adapter settings it was saved with, or start afresh"
        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_TRAINABLE)
    scheduler.load_state_dict(torch.load(folder / checkpoint.SCHEDULER, weights_only=True))
    if scaler.is_enabled() and (folder / checkpoint.SCALER).is_file():
        scaler.load_state_dict(torch.load(folder / checkpoint.SCALER, weights_only=True))
    rng = folder / f"rng_state_{dist.get_rank()}.pt"  # absent when resuming on more processes than saved
    checkpoint.restore_rng(torch.load(rng if rng.is_file() else folder / "rng_state_0.pt", weights_only=True))
    return checkpoint.TrainerState.load(folder / checkpoint.TRAINER_STATE)


def save_final_model(model: torch.nn.Module, tokenizer: Any, output_dir: Path, *, is_main: bool) -> None:
    """Gather the full weights onto rank 0's CPU (collective) and write the Hugging Face folder there:
    the adapter (only trainable weights are gathered) or the whole model, and a reward model's value head."""
    head = getattr(model, "v_head", None)
    head = head if isinstance(head, torch.nn.Module) and hasattr(head, "unshard") else None
    inner = model.model if head is not None else model  # ValueHeadModel.save_pretrained saves .model
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=hasattr(inner, "peft_config"))
    state_dict = get_model_state_dict(inner, options=options)
    first_name: dict[int, str] = {}
    for name, param in inner.named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(param), name)
        if first != name and name in state_dict and first in state_dict:
            # tied weights (embeddings and head) were gathered as two copies: one tensor again, as save_pretrained
            # expects of tied weights (it writes them once)
            state_dict[name] = state_dict[first]
    if head is not None:
        head.unshard()  # value_head_state() reads the gathered head
    try:
        if is_main:
            checkpoint.save_final_model(model, tokenizer, output_dir, state_dict=state_dict)
    finally:
        if head is not None:
            head.reshard()
