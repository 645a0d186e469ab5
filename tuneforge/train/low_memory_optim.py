"""The memory-efficient optimizers of LlamaFactory's keys, each from its own package: GaLore (galore-torch), APOLLO
(apollo-torch), BAdam (badam), Adam-mini (adam-mini) and Muon (torch.optim.Muon beside AdamW). tuneforge/config/
low_memory.py checks their keys, packages and strategies when the config loads; build_optimizer calls
build_low_memory_optimizer.

Each is one torch.optim.Optimizer to the loop: its param_groups are the groups the learning-rate schedule sets
(shared with the optimizers it holds), and its state_dict holds everything a resumed run needs to step exactly as
the uninterrupted one (GaLore's / APOLLO's projectors, BAdam's active block and its fp32 copy).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from tuneforge.config import RunConfig
from tuneforge.config.low_memory import layerwise, low_memory_method
from tuneforge.errors import ConfigError
from tuneforge.model.adapters import target_modules
from tuneforge.train.optim import optimizer_class_and_kwargs, param_groups

logger = logging.getLogger(__name__)


def build_low_memory_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer | None:
    """The optimizer of the use_* key that is on, or None when none is."""
    method = low_memory_method(cfg)
    if method is None:
        return None
    return {
        "use_galore": _galore, "use_apollo": _apollo, "use_badam": _badam, "use_adam_mini": _adam_mini,
        "use_muon": _muon,
    }[method](model, cfg)


# ---------------------------------------------------------------- GaLore / APOLLO


def projected_params(model: nn.Module, cfg: RunConfig, key: str) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of the trainable nn.Linear layers galore_target / apollo_target name (all: every linear layer
    but the output head)."""
    names = target_modules(model, getattr(cfg.memory, key), key, cfg.method)
    out = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(path == n or path.endswith("." + n) for n in names):
            if module.weight.requires_grad:
                out.append((f"{path}.weight", module.weight))
    if not out:
        raise ConfigError(f"{cfg.source}: {key} {getattr(cfg.memory, key)} names no trainable linear layer",
                          key=key)
    return out


def _split_projected(model: nn.Module, cfg: RunConfig, key: str, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The usual groups without the projected weights, plus one group of those with the projection's settings
    (and weight decay)."""
    projected = projected_params(model, cfg, key)
    ids = {id(p) for _, p in projected}
    groups = []
    for group in param_groups(model, cfg):
        kept = [(n, p) for n, p in zip(group["param_names"], group["params"], strict=True) if id(p) not in ids]
        if kept:
            groups.append({**group, "param_names": [n for n, _ in kept], "params": [p for _, p in kept]})
    t = cfg.train
    groups.append({"name": key.removesuffix("_target"), "params": [p for _, p in projected],
                   "param_names": [n for n, _ in projected], "lr": t.learning_rate, "lr_scale": 1.0,
                   "weight_decay": t.weight_decay, **extra})
    return groups


def _galore(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    import galore_torch

    m = cfg.memory
    cls = {"adamw_torch": galore_torch.GaLoreAdamW, "adafactor": galore_torch.GaLoreAdafactor}.get(
        cfg.train.optim, galore_torch.GaLoreAdamW8bit)  # the 8-bit AdamW names (checked at load)
    _, kwargs = optimizer_class_and_kwargs(cfg)
    if cls is galore_torch.GaLoreAdamW:
        kwargs["no_deprecation_warning"] = True  # its note about torch's AdamW, which has no projection
    groups = _split_projected(model, cfg, "galore_target", {
        "rank": m.galore_rank, "update_proj_gap": m.galore_update_interval, "scale": m.galore_scale,
        "proj_type": m.galore_proj_type})
    _allow_projectors_in_checkpoints()
    logger.info("GaLore (%s) on %d matrices: rank %d, new projection every %d steps%s", cls.__name__,
                len(groups[-1]["params"]), m.galore_rank, m.galore_update_interval,
                ", layer-wise" if m.galore_layerwise else "")
    return _maybe_layerwise(cfg, cls, groups, kwargs)


def _apollo(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    from apollo_torch import APOLLOAdamW

    m = cfg.memory
    _, kwargs = optimizer_class_and_kwargs(cfg)
    kwargs["scale_front"] = m.apollo_scale_front  # a constructor argument of APOLLO's AdamW, not a group's
    groups = _split_projected(model, cfg, "apollo_target", {
        "rank": m.apollo_rank, "proj": m.apollo_proj, "proj_type": m.apollo_proj_type,
        "update_proj_gap": m.apollo_update_interval, "scale": m.apollo_scale, "scale_type": m.apollo_scale_type})
    _allow_projectors_in_checkpoints()
    logger.info("APOLLO on %d matrices: rank %d, %s projection every %d steps, %s scaling%s",
                len(groups[-1]["params"]), m.apollo_rank, m.apollo_proj, m.apollo_update_interval,
                m.apollo_scale_type, ", layer-wise" if m.apollo_layerwise else "")
    return _maybe_layerwise(cfg, APOLLOAdamW, groups, kwargs)


def _allow_projectors_in_checkpoints() -> None:
    """The projectors live in the optimizer state as plain objects (their matrices, seeds and counters); let
    checkpoints load them under torch.load(weights_only=True)."""
    import importlib

    for module, names in (("galore_torch.galore_projector", ["GaLoreProjector"]),
                          ("apollo_torch.random_projector", ["GradientProjector"]),
                          ("apollo_torch.svd_projector", ["GaLoreProjector"])):
        try:  # one of the two packages may be missing
            found = importlib.import_module(module)
        except ImportError:
            continue
        torch.serialization.add_safe_globals([getattr(found, name) for name in names])


def _maybe_layerwise(cfg: RunConfig, cls: type, groups: list[dict[str, Any]],
                     kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    if not layerwise(cfg):
        optimizer = cls(groups, **kwargs)
        optimizer.register_step_post_hook(compact_projectors)
        return optimizer
    per_param = [cls([{**group, "params": [p], "param_names": [n]}], **kwargs)
                 for group in groups for n, p in zip(group["param_names"], group["params"], strict=True)]
    for optimizer in per_param:
        optimizer.register_step_post_hook(compact_projectors)
    return LayerwiseOptimizer(per_param)


def compact_projectors(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The SVD projectors keep their rank-r matrix as a slice of the whole SVD factor, which keeps the factor alive
    (36x the slice for a 576 x 576 factor at rank 16); after each step, keep a copy of the slice alone (the same
    values)."""
    for state in optimizer.state.values():
        projector = state.get("projector")
        matrix = getattr(projector, "ortho_matrix", None)
        if isinstance(matrix, list):  # proj_type full: two matrices
            projector.ortho_matrix = [_alone(m) for m in matrix]
        elif isinstance(matrix, torch.Tensor):
            projector.ortho_matrix = _alone(matrix)


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    shares = tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
    return tensor.clone(memory_format=torch.contiguous_format) if shares else tensor


class LayerwiseOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped inside the backward as soon as that parameter's gradient is ready
    (then the gradient is freed): only one weight's gradient exists at a time. step() has nothing left to do.
    Its param_groups are the per-parameter optimizers' own, so the schedule sets each one's learning rate."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        super().__init__([g for o in optimizers for g in o.param_groups], optimizers[0].defaults)
        owner = {p: o for o in optimizers for g in o.param_groups for p in g["params"]}

        def step_now(param: torch.Tensor) -> None:
            if param.grad is not None:
                owner[param].step()
                owner[param].zero_grad(set_to_none=True)

        self.hooks = [p.register_post_accumulate_grad_hook(step_now) for p in owner]

    def step(self, closure: Any = None) -> None:  # noqa: ARG002 - each parameter stepped in its backward hook
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"layerwise": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["layerwise"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"{len(saved)} per-parameter optimizers saved, {len(self.optimizers)} here")
        for optimizer, state in zip(self.optimizers, saved, strict=True):
            optimizer.load_state_dict(state)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]  # loading made new group dicts


# ---------------------------------------------------------------- BAdam


def _badam(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    m = cfg.memory
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cls, kwargs = optimizer_class_and_kwargs(cfg)
    base = cls(param_groups(model, cfg), **kwargs)
    never = m.badam_switch_interval in (None, -1)  # LlamaFactory's -1: keep the first block
    optimizer = block_adam_class()(base, named, switch_block_every=1 if never else m.badam_switch_interval,
                          start_block=m.badam_start_block, switch_mode="fixed" if never else m.badam_switch_mode,
                          verbose=m.badam_verbose)
    if optimizer.block_num == 0:
        raise ConfigError(f"{cfg.source}: use_badam found no decoder layers (parameters named *layers.N.*) in "
                          f"{type(model).__name__}", key="use_badam")
    logger.info("BAdam (layer): %d blocks, %s, switching every %s steps", optimizer.block_num,
                optimizer.switch_mode, "-" if never else m.badam_switch_interval)
    return optimizer


@functools.cache
def block_adam_class() -> type:
    """BlockAdam, defined on first use so that importing this module needs no badam."""
    from badam import BlockOptimizer

    class BlockAdam(BlockOptimizer):  # type: ignore[misc, valid-type]
        """badam's BlockOptimizer (layer mode) whose state_dict also holds the active block, the block order, the
        step count and the active block's fp32 copy, so a resumed run trains the same block from the same values."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            del self.state_dict  # badam binds the base optimizer's; ours adds the block bookkeeping

        def switch_trainable_params(self, verbose: int | None = None) -> None:
            self.active_block = self.current_block_idx  # switching also moves current_block_idx on to the next
            super().switch_trainable_params(self.verbose if verbose is None else verbose)

        def state_dict(self) -> dict[str, Any]:
            return {"base": self.base_optimizer.state_dict(), "active_block": self.active_block,
                    "next_block": self.current_block_idx, "block_order": list(getattr(self, "block_order", [])),
                    "global_step": self.global_step, "lrs": [g["lr"] for g in self.param_groups],
                    "fp32_block": [hp.detach().clone() for hp in self.param_idx2hp.values()]}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.current_block_idx = state_dict["active_block"]
            self.switch_trainable_params()  # that block trainable, its fp32 copy made, the state cleared
            self.current_block_idx, self.global_step = state_dict["next_block"], state_dict["global_step"]
            if state_dict["block_order"]:
                self.block_order = list(state_dict["block_order"])
            with torch.no_grad():
                for hp, saved in zip(self.param_idx2hp.values(), state_dict["fp32_block"], strict=True):
                    hp.copy_(saved)
            self.base_optimizer.load_state_dict(state_dict["base"])
            for group, lr in zip(self.param_groups, state_dict["lrs"], strict=True):  # what the schedule set
                group["lr"] = lr

    return BlockAdam


# ---------------------------------------------------------------- Adam-mini, Muon


def _adam_mini(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    from adam_mini import Adam_mini

    t = cfg.train
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    optimizer = Adam_mini(
        named_parameters=[(n, p) for n, p in model.named_parameters() if p.requires_grad], lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, weight_decay=t.weight_decay,
        dim=text.hidden_size, n_heads=text.num_attention_heads,
        n_kv_heads=getattr(text, "num_key_value_heads", None), verbose=False)
    logger.info("Adam-mini over %d tensors", len(optimizer.param_groups))
    return optimizer


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """The trainable 2-D hidden matrices: every trainable matrix but the input embeddings and the output head."""
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        skip.add(id(head.weight))
    return [p for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in skip]


def _muon(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    t = cfg.train
    hidden = {id(p) for p in muon_params(model)}
    adamw_groups, muon_group = [], {"name": "muon", "params": [], "param_names": [], "lr": t.learning_rate,
                                    "lr_scale": 1.0, "weight_decay": t.weight_decay}
    for group in param_groups(model, cfg):
        rest = [(n, p) for n, p in zip(group["param_names"], group["params"], strict=True) if id(p) not in hidden]
        for n, p in zip(group["param_names"], group["params"], strict=True):
            if id(p) in hidden:
                muon_group["params"].append(p)
                muon_group["param_names"].append(n)
        if rest:
            adamw_groups.append({**group, "param_names": [n for n, _ in rest], "params": [p for _, p in rest]})
    cls, kwargs = optimizer_class_and_kwargs(cfg)  # adamw_torch (checked at load)
    # match_rms_adamw: Muon's update scaled to AdamW's size, so one learning_rate fits both (as Moonlight's Muon)
    muon = torch.optim.Muon([muon_group], lr=t.learning_rate, adjust_lr_fn="match_rms_adamw")
    logger.info("Muon on %d hidden matrices, AdamW on %d other tensors", len(muon_group["params"]),
                sum(len(g["params"]) for g in adamw_groups))
    return Combined([muon, cls(adamw_groups, **kwargs)]) if adamw_groups else muon


class Combined(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together; their param_groups are this one's."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        super().__init__([g for o in optimizers for g in o.param_groups], {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {"combined": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, state_dict["combined"], strict=True):
            optimizer.load_state_dict(state)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]  # loading made new group dicts
