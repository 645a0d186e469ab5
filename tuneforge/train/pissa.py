"""PiSSA outputs: the initial adapter a run keeps, and the final adapter converted for the original base.

PiSSA initializes LoRA from the principal singular vectors of each target weight W and trains on the residual
W_res = W - s·B0·A0. The trained adapter (A, B) is therefore only right on top of W_res. Since
W_res + s·B·A = W + s·(B·A - B0·A0) = W + s·[B | -B0]·[A ; A0], peft's save_pretrained with
path_initial_model_for_weight_conversion writes that rank-2r adapter, which applies to the original base
that users load with PeftModel.from_pretrained. It needs the initial adapter (A0, B0), which the trainer saves
once at the start of a run as output_dir/pissa_init; the same folder lets a resumed run rebuild exactly the
residual it trained on (tuneforge.model.adapters reads it), however the SVD would come out today.
Checkpoints keep the adapter as trained (on W_res): resume needs it so; only the final output is converted.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tuneforge.errors import TrainingError

logger = logging.getLogger(__name__)

PISSA_INIT = "pissa_init"  # tuneforge.model.adapters names the same folder (model does not import train)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def pissa_adapter_name(model: torch.nn.Module) -> str | None:
    """The name of the model's active adapter when PiSSA initialized it, else None."""
    configs = getattr(model, "peft_config", None)
    name = getattr(model, "active_adapter", None)
    if not configs or name not in configs:
        return None
    init = getattr(configs[name], "init_lora_weights", None)
    return name if isinstance(init, str) and init.lower().startswith("pissa") else None


def adapter_state(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The adapter's weights as peft saves them (keys without the adapter name)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=name)


def save_initial_adapter(model: torch.nn.Module, name: str, folder: Path) -> None:
    """The adapter as PiSSA initialized it (call before any training step)."""
    model.save_pretrained(folder, selected_adapters=[name])


def check_rebuilt_from(model: torch.nn.Module, name: str, initial: Path, checkpoint: Path) -> None:
    """Refuse to resume a PiSSA model whose initial adapter (so whose residual base) is not the run's."""
    weights = initial / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise TrainingError(
            f"resuming {checkpoint}: it is a PiSSA run, which needs {initial}, the initial adapter the run "
            f"saved at its start, to rebuild the residual base it trained on; it is missing. Restore that "
            f"folder beside the checkpoint, or start afresh without resume_from_checkpoint"
        )
    saved, current = load_file(weights), adapter_state(model, name)
    same = saved.keys() == current.keys() and all(
        torch.equal(saved[k], current[k].detach().to("cpu", saved[k].dtype)) for k in saved
    )
    if not same:
        raise TrainingError(
            f"resuming {checkpoint}: the model's PiSSA initialization differs from the run's initial adapter "
            f"{initial}, so its residual base is not the one the checkpoint was trained on. Build the model "
            f"with tuneforge.model.load_model (with the run's pissa_init, output_dir and "
            f"resume_from_checkpoint), which rebuilds it from that adapter"
        )


def save_adapter(model: torch.nn.Module, folder: Path, initial: Path, convert: bool) -> None:
    """save_pretrained of a PiSSA model: converted for the original base (convert), else as trained."""
    if not convert:
        model.save_pretrained(folder)
        logger.warning(
            "pissa_convert is false: the adapter in %s applies to PiSSA's residual base (each target "
            "weight minus the initial adapter in %s), not to the original model; loading it on the "
            "original model gives wrong outputs. Set pissa_convert: true for an adapter that does",
            folder,
            initial,
        )
        return
    name = model.active_adapter
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".tmp-pissa-") as scratch:
        # peft rewrites the initial adapter's config and loads it as an adapter named after its folder:
        # hand it a copy, so the run's pissa_init stays as saved
        copy = Path(scratch) / PISSA_INIT
        shutil.copytree(initial, copy)
        model.save_pretrained(folder, path_initial_model_for_weight_conversion=str(copy))
    _restore_dropped_weights(model, name, folder)
    logger.info("converted the PiSSA adapter (rank 2r) so that it applies to the original base model")


def _restore_dropped_weights(model: torch.nn.Module, name: str, folder: Path) -> None:
    """peft's conversion keeps only lora_A / lora_B; put back the rest (modules_to_save copies), which
    PiSSA never touched, or the converted adapter would not even load."""
    path = (folder if name == "default" else folder / name) / ADAPTER_WEIGHTS
    converted = load_file(path)
    # cloned: tied copies (embed_tokens / lm_head) share storage, which safetensors refuses
    state = adapter_state(model, name)
    dropped = {k: v.detach().to("cpu").clone() for k, v in state.items() if k not in converted}
    if dropped:
        save_file({**converted, **dropped}, path, metadata={"format": "pt"})
