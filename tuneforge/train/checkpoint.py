"""Checkpoints that a killed run can resume from exactly, and final outputs that are never half-written.

A checkpoint-N folder holds the model (adapter or full, via save_pretrained), the tokenizer, optimizer.pt,
scheduler.pt (scaler.pt with fp16), rng_state.pt and trainer_state.json. It is written with
tuneforge.atomic.atomic_folder (a temporary sibling renamed into place), so a checkpoint-N folder, once it
exists, is complete.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from tuneforge.atomic import atomic_folder, partial_folder, remove_partials
from tuneforge.config import RunConfig, checkpoints_in
from tuneforge.config.validate import CHECKPOINT_PREFIX
from tuneforge.errors import TrainingError
from tuneforge.train import pissa

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
RNG_STATE = "rng_state.pt"
TMP_PREFIX = ".tmp-"


@dataclass
class TrainerState:
    """Where training stands; enough (with the files beside it) to continue as if never stopped."""

    global_step: int = 0
    total_steps: int = 0
    epoch: int = 0  # the epoch in progress
    batches_in_epoch: int = 0  # micro-batches of that epoch already consumed
    epoch_progress: float = 0.0  # epoch + batches_in_epoch / micro-batches per epoch, for people
    total_tokens: int = 0  # non-padding tokens seen, all ranks
    loss_sum: float = 0.0  # over the whole run, for train_loss
    loss_units: int = 0
    best_metric: float | None = None  # metric_for_best_model's best value so far (default eval_loss)
    best_step: int | None = None  # the step it was reached at
    evals_without_improvement: int = 0
    last_eval_step: int | None = None
    status: str = "running"  # then "completed", or "stopped" (a stop request; resume continues the run)
    log_history: list[dict[str, Any]] = field(default_factory=list)
    objective: dict[str, Any] = field(default_factory=dict)  # the objective's running state (ppo's KL coefficient)

    def save(self, path: Path) -> None:
        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> TrainerState:
        raw = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def folder_at(output_dir: Path, step: int) -> Path:
    """The checkpoint folder of a step (checkpoints_in finds them)."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"


def write_json(path: Path, data: Any) -> None:
    """Write JSON to a temporary file and rename it over path."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.write_text(json.dumps(data, indent=2, default=float) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@contextmanager
def folder_of_all_ranks(final: Path, is_main: bool) -> Iterator[Path]:
    """A temporary folder every rank writes its part into (a sharded checkpoint); rank 0 renames it to `final`
    once all have written (collective: every rank enters and leaves it)."""
    import torch.distributed as dist

    with atomic_folder(final) if is_main else contextlib.nullcontext() as folder:
        where = [str(folder) if is_main else None]
        dist.broadcast_object_list(where, src=0)  # the folder exists; every rank learns its name
        yield Path(where[0])
        dist.barrier()  # every rank has written its part


def remove_stale_temporaries(output_dir: Path) -> None:
    """Temporary files and folders a killed run left behind (never a finished checkpoint)."""
    remove_partials(output_dir)
    if output_dir.is_dir():
        for path in output_dir.iterdir():
            if path.name.startswith(TMP_PREFIX) and path.is_file():
                logger.info("removing %s, left by an interrupted save", path)
                path.unlink()


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA generator states, in types torch.load(weights_only=True) reads."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), pos, has_gauss, cached),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def adapter_save_args(model: torch.nn.Module) -> dict[str, Any]:
    """save_pretrained's arguments for a peft model whose embeddings train in full (modules_to_save, as with new
    tokens): the trained copy is what reloads, so peft's `auto`, which for a resized vocabulary also saves the base
    embeddings and head (several copies), is turned off. {} for anything else."""
    from peft import PeftModel
    from peft.utils import ModulesToSaveWrapper

    for _ in range(3):  # a value-head or DDP wrapper around the PeftModel
        if isinstance(model, PeftModel):
            embed = model.get_input_embeddings()
            return {"save_embedding_layers": False} if isinstance(embed, ModulesToSaveWrapper) else {}
        model = getattr(model, "module", None) or getattr(model, "model", None)
    return {}


def save_checkpoint(
    output_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler,
    state: TrainerState,
) -> Path:
    """Write output_dir/checkpoint-{global_step} atomically and return it."""
    final = folder_at(output_dir, state.global_step)
    with atomic_folder(final) as tmp:
        model.save_pretrained(tmp, **adapter_save_args(model))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch.save(scheduler.state_dict(), tmp / SCHEDULER)
        if scaler.is_enabled():
            torch.save(scaler.state_dict(), tmp / SCALER)
        torch.save(capture_rng(), tmp / RNG_STATE)
        state.save(tmp / TRAINER_STATE)
    logger.info("saved %s", final)
    return final


def rotate_checkpoints(output_dir: Path, save_total_limit: int | None, keep: Path | None = None) -> None:
    """Delete the oldest checkpoint-N folders beyond save_total_limit (never `keep`: the best one)."""
    if not save_total_limit or save_total_limit < 1:
        return
    found = checkpoints_in(output_dir)
    for old in [p for p in found[:-save_total_limit] if keep is None or p.name != keep.name]:
        logger.info("deleting %s (save_total_limit %d)", old, save_total_limit)
        shutil.rmtree(old)


def resume_folder(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from: the latest in output_dir (true), a given folder (a path), or None."""
    resume = cfg.train.resume_from_checkpoint
    if resume is None or resume is False:
        return None
    if resume is True:
        found = checkpoints_in(cfg.train.output_dir)
        if not found:
            raise TrainingError(
                f"resume_from_checkpoint: true, but {cfg.train.output_dir} holds no checkpoint-N"
            )
        return found[-1]
    folder = Path(resume)
    if not (folder / TRAINER_STATE).is_file():
        raise TrainingError(
            f"resume_from_checkpoint: {folder} is not a tuneforge checkpoint (no {TRAINER_STATE}); "
            f"point it at a checkpoint-N folder written by tuneforge"
        )
    return folder


def _mismatch(folder: Path, missing: list[str], unexpected: list[str], shapes: list[str]) -> TrainingError:
    parts = [
        f"{name}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
        for name, keys in (("missing", missing), ("unexpected", unexpected), ("shape differs", shapes))
        if keys
    ]
    return TrainingError(
        f"checkpoint {folder} does not match the model ({'; '.join(parts)}). Resume with the same "
        f"model_name_or_path, finetuning_type and adapter settings it was saved with, or start afresh "
        f"(overwrite_output_dir: true, without resume_from_checkpoint)"
    )


def _check_keys(
    folder: Path, saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tied_ok: bool
) -> None:
    saved_ptrs = {expected[k].data_ptr() for k in saved if k in expected}
    missing = [
        k for k in expected if k not in saved and not (tied_ok and expected[k].data_ptr() in saved_ptrs)
    ]
    unexpected = [k for k in saved if k not in expected]
    shapes = [k for k in saved if k in expected and tuple(saved[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or shapes:
        raise _mismatch(folder, missing, unexpected, shapes)


def _read_safetensors(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return load_file(single)
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(folder / shard))
        return out
    raise TrainingError(
        f"checkpoint {folder} has no {stem}.safetensors; it is incomplete or not a checkpoint"
    )


def load_trainable_weights(folder: Path, model: torch.nn.Module) -> None:
    """Put the checkpoint's weights into the model: the adapter for peft, the full state dict otherwise."""
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

    if hasattr(model, "load_value_head_from"):  # a reward model: the wrapped model, then its value head
        load_trainable_weights(folder, model.model)
        model.load_value_head_from(folder)
        return
    if isinstance(model, PeftModel):
        adapter = model.active_adapter
        sub = folder if adapter == "default" else folder / adapter
        saved = _read_safetensors(sub, "adapter_model")
        expected = get_peft_model_state_dict(model, adapter_name=adapter, **adapter_save_args(model))
        _check_keys(folder, saved, expected, tied_ok=False)
        set_peft_model_state_dict(model, saved, adapter_name=adapter)
        return
    saved = _in_memory_names(folder, model, _read_safetensors(folder, "model"))
    _check_keys(folder, saved, model.state_dict(), tied_ok=True)
    model.load_state_dict(saved, strict=False)  # tied weights share storage: the saved copy fills both


def _in_memory_names(
    folder: Path, model: torch.nn.Module, saved: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The saved weights under the model's own parameter names.

    transformers' save_pretrained reverts its weight conversions: a model whose checkpoints use other names or
    layouts than its modules (Mixtral's fused experts.gate_up_proj is saved as per-expert w1 / w3) is written in
    the checkpoint layout. A checkpoint whose names are the model's own loads as it is. One in another layout is
    read back through the public from_pretrained (with the weights given as state_dict, so it applies the same
    conversions as any load) into a second copy of the model; load_state_dict then copies the values into the
    real parameters in place, which keeps the optimizer's references, requires_grad and tied weights. The copy
    costs the weights' memory once more, for such models only.
    """
    from transformers import PreTrainedModel

    own = model.state_dict()
    if not isinstance(model, PreTrainedModel) or set(saved) <= set(own):
        return saved
    dtype = next(model.parameters()).dtype
    quiet = logging.getLogger("transformers.modeling_utils")  # its load report: mismatches are reported below
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        converted, info = type(model).from_pretrained(
            None, config=copy.deepcopy(model.config), state_dict=saved, dtype=dtype, output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    finally:
        quiet.setLevel(level)
    unexpected = sorted(info["unexpected_keys"])  # saved, with no place here
    shapes = sorted(key for key, *_ in info["mismatched_keys"])
    if unexpected or shapes:
        raise _mismatch(folder, [], unexpected, shapes)
    missing = set(info["missing_keys"])  # left for _check_keys to report
    return {k: v for k, v in converted.state_dict().items() if k in own and k not in missing}


def load_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler,
) -> TrainerState:
    """Restore weights, optimizer, scheduler, scaler and RNG from folder; return its TrainerState."""
    load_trainable_weights(folder, model)
    device = next(model.parameters()).device
    try:
        optimizer.load_state_dict(torch.load(folder / OPTIMIZER, map_location=device, weights_only=True))
    except (ValueError, KeyError) as e:
        raise TrainingError(
            f"checkpoint {folder}: {OPTIMIZER} does not fit this model's optimizer ({e}); "
            f"resume with the settings it was saved with"
        ) from None
    scheduler.load_state_dict(torch.load(folder / SCHEDULER, weights_only=True))
    if scaler.is_enabled() and (folder / SCALER).is_file():
        scaler.load_state_dict(torch.load(folder / SCALER, weights_only=True))
    restore_rng(torch.load(folder / RNG_STATE, weights_only=True))
    return TrainerState.load(folder / TRAINER_STATE)


def keep_pissa_init(
    model: torch.nn.Module, output_dir: Path, resume_from: Path | None, *, write: bool
) -> Path | None:
    """output_dir/pissa_init for a PiSSA model (None for any other), before any step or checkpoint load.

    A fresh run saves its initial adapter there. A resumed run checks that the model was rebuilt from the
    initial adapter beside its checkpoint (so it trains on the same residual base) and copies that folder
    into output_dir when it resumes from another folder. write: False on ranks other than the main one.
    """
    name = pissa.pissa_adapter_name(model)
    if name is None:
        return None
    target = output_dir / pissa.PISSA_INIT
    if resume_from is not None:
        initial = resume_from.parent / pissa.PISSA_INIT
        pissa.check_rebuilt_from(model, name, initial, resume_from)
        if write and initial.resolve() != target.resolve():
            with atomic_folder(target) as tmp:
                shutil.copytree(initial, tmp, dirs_exist_ok=True)
        return target
    if write:
        output_dir.mkdir(parents=True, exist_ok=True)
        with atomic_folder(target) as tmp:
            pissa.save_initial_adapter(model, name, tmp)
        logger.info("saved the initial PiSSA adapter to %s (for the final conversion and resume)", target)
    return target


def save_final_model(
    model: torch.nn.Module,
    tokenizer: Any,
    output_dir: Path,
    pissa_init: Path | None = None,
    pissa_convert: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """save_pretrained into a temporary folder, then move file by file into output_dir (each a rename).

    With pissa_init (the run's initial PiSSA adapter) the adapter is saved converted for the original base
    model, or, with pissa_convert false, as trained (for the residual base). state_dict: the weights to save
    instead of the model's own (fsdp gathers them from the ranks' shards)."""
    tmp = partial_folder(output_dir / "final-model")  # a scratch folder; its files move into output_dir
    if pissa_init is not None:
        pissa.save_adapter(model, tmp, pissa_init, convert=pissa_convert)
    else:
        model.save_pretrained(tmp, **adapter_save_args(model), **({} if state_dict is None else {"state_dict": state_dict}))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    # peft's save_pretrained writes a template README.md: the model card is written after training (and a user's
    # README.md in output_dir must survive the save)
    (tmp / "README.md").unlink(missing_ok=True)
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        dest = output_dir / path.relative_to(tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
    shutil.rmtree(tmp)
    logger.info("saved the %s to %s", "adapter" if hasattr(model, "peft_config") else "model", output_dir)


def is_eval_metric(key: str) -> bool:
    return key.startswith("eval_") or key == "perplexity"


def write_results(output_dir: Path, results: dict[str, Any], state: TrainerState) -> None:
    """train_results.json, eval_results.json (when evaluated), all_results.json and trainer_state.json."""
    write_json(output_dir / "train_results.json", {k: v for k, v in results.items() if not is_eval_metric(k)})
    if "eval_loss" in results:
        evaluated = {k: v for k, v in results.items() if is_eval_metric(k)}
        write_json(output_dir / "eval_results.json", {"epoch": results["epoch"], **evaluated})
    write_json(output_dir / "all_results.json", results)
    state.save(output_dir / TRAINER_STATE)
