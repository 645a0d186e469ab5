"""The README.md model card of a training output_dir and of an export_dir, in the Hugging Face format: YAML metadata
(base_model, library_name, tags, datasets, license when the base model's own card states one, pipeline_tag), then
what was trained, the results, the framework versions and how to load it with transformers / peft alone.

The card carries MARKER. A README.md without it was written by someone else and is left alone; ours is rewritten
by the next run or export (as transformers' Trainer rewrites the card it generated).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import ModelCard, ModelCardData

from tuneforge.atomic import write_file
from tuneforge.stages import stage_of

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

logger = logging.getLogger(__name__)

CARD = "README.md"
MARKER = "<!-- written by tuneforge: remove this line to keep your edits (tuneforge then leaves this file alone) -->"
BUILTIN_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the built-in smollm2-135m-instruct was converted from
BUILTIN_LICENSE = "apache-2.0"
ADAPTERS = ("lora", "oft")
STAGE_NAMES = {"pt": "continued pre-training", "sft": "supervised fine-tuning", "rm": "reward modelling",
               "dpo": "preference optimization", "kto": "KTO", "ppo": "PPO", "grpo": "GRPO"}
MEDIA_FILES = ("preprocessor_config.json", "processor_config.json")
VERSIONS = ("tuneforge", "transformers", "peft", "torch", "datasets", "huggingface-hub")


def base_model_id(name: str | None) -> str | None:
    """The hub id of model_name_or_path: the id itself, the built-in alias's source, or the repository a hub
    download's cache folder (models--owner--name/snapshots/...) came from; None for another local folder."""
    from tuneforge.model.hub import BUILTIN_ALIASES

    if not name:
        return None
    if name.lower() in BUILTIN_ALIASES:
        return BUILTIN_HUB_ID
    path = Path(name).expanduser()
    if path.exists():
        cached = [p for p in path.resolve().parts if p.startswith("models--")]
        return cached[-1].removeprefix("models--").replace("--", "/") if cached else None
    return name if not name.startswith((".", "/", "~")) and name.count("/") == 1 else None


def base_license(cfg: RunConfig) -> dict[str, str]:
    """license (and license_name / license_link for "other") from the base model folder's own card, if it has one."""
    name = cfg.model.model_name_or_path or ""
    from tuneforge.model.hub import BUILTIN_ALIASES

    if name.lower() in BUILTIN_ALIASES:
        return {"license": BUILTIN_LICENSE}
    readme = Path(name).expanduser() / CARD
    if not readme.is_file():
        return {}
    try:
        data = ModelCard.load(readme).data.to_dict()
    except Exception:  # noqa: BLE001 - someone else's card: an unreadable one only costs us its license
        return {}
    return {k: data[k] for k in ("license", "license_name", "license_link") if data.get(k)}


def is_ours(folder: Path) -> bool:
    """Whether folder/README.md may be (re)written: absent, or written by tuneforge."""
    path = folder / CARD
    return not path.exists() or MARKER in path.read_text(encoding="utf-8", errors="replace")


def save(card: ModelCard, folder: Path) -> Path | None:
    """Write folder/README.md atomically, unless a README.md not written by tuneforge is there (kept)."""
    if not is_ours(folder):
        logger.info("%s is not tuneforge's model card: kept as it is", folder / CARD)
        return None
    return write_file(folder / CARD, str(card))


def training_card(cfg: RunConfig, output_dir: Path, results: dict[str, Any], log_history: list[dict[str, Any]],
                  processes: int = 1, repo_id: str | None = None) -> ModelCard:
    """The card of a finished training run's output_dir (repo_id: where it is uploaded, for the usage lines)."""
    me = cfg.method
    adapter = me.finetuning_type in ADAPTERS
    base = base_model_id(cfg.model.model_name_or_path)
    media = any((output_dir / f).is_file() for f in MEDIA_FILES)
    stage = stage_of(me.stage)
    data = ModelCardData(
        base_model=base, library_name="peft" if adapter else "transformers",
        tags=["tuneforge", me.stage, me.finetuning_type, "llama-factory-compatible"],
        datasets=list(cfg.data.dataset or []) or None, pipeline_tag=_pipeline(stage.writes_text, media),
        **base_license(cfg),
    )
    what = "an adapter" if adapter else "a fine-tune"
    lines = [
        f"# {repo_id or output_dir.name}", "",
        f"This model is {what} ({me.finetuning_type}) of {_base_link(cfg, base)}, trained with tuneforge: stage "
        f"`{me.stage}` ({STAGE_NAMES.get(me.stage, me.stage)}: {stage.summary})"
        + (f" on {', '.join(f'`{d}`' for d in cfg.data.dataset)}." if cfg.data.dataset else "."),
        "", "## Training hyperparameters", "", *_table(hyperparameters(cfg, processes)),
        "", "## Results", "", *_table({k: v for k, v in results.items() if not isinstance(v, (list, dict))}),
        *_evaluations(log_history),
        "", "## How to use", "", *_usage(repo_id or str(output_dir.resolve()), base or cfg.model.model_name_or_path,
                                         adapter, media, value_head=stage.value_head and not stage.critic),
        "", "## Framework versions", "", *_versions(),
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{MARKER}\n\n" + "\n".join(lines) + "\n")


def export_card(cfg: RunConfig, export_dir: Path, adapters: list[Path], gguf_file: str | None = None,
                repo_id: str | None = None, files: Path | None = None) -> ModelCard:
    """The card of an export: the base with its adapters merged (a transformers model), or a GGUF file. files: the
    folder the export is being written in (default export_dir)."""
    base = base_model_id(cfg.model.model_name_or_path)
    media = any(((files or export_dir) / f).is_file() for f in MEDIA_FILES)
    trained = adapters[-1] if adapters else None
    results = _read_json(trained / "all_results.json") if trained else {}
    tags = ["tuneforge", "llama-factory-compatible", *(["merged"] if adapters else []), *(["gguf"] if gguf_file else [])]
    data = ModelCardData(
        base_model=base, library_name=None if gguf_file else "transformers", tags=tags,
        datasets=list(cfg.data.dataset or []) or None, pipeline_tag=_pipeline(True, media), **base_license(cfg),
    )
    merged = (f"{_base_link(cfg, base)} with the adapter(s) {', '.join(f'`{a}`' for a in adapters)} merged in"
              if adapters else _base_link(cfg, base))
    lines = [f"# {repo_id or export_dir.name}", "", f"This model is {merged}, exported by tuneforge"
             + (f" as `{gguf_file}` (GGUF)." if gguf_file else " as a plain transformers model (no peft needed).")]
    if adapters:
        lines[-1] += f" The adapter was trained with stage `{cfg.method.stage}` ({cfg.method.finetuning_type})."
    if results:
        lines += ["", "## Training results (of the adapter)", "",
                  *_table({k: v for k, v in results.items() if not isinstance(v, (list, dict))})]
    lines += ["", "## How to use", ""]
    if gguf_file:
        lines += ["```bash", "ollama create my-model -f Modelfile", "```", "",
                  f"or any GGUF runtime, e.g. `llama-cli -m {gguf_file}`."]
    else:
        lines += _usage(repo_id or str(export_dir.resolve()), None, False, media, value_head=False)
    lines += ["", "## Framework versions", "", *_versions()]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{MARKER}\n\n" + "\n".join(lines) + "\n")


def hyperparameters(cfg: RunConfig, processes: int = 1) -> dict[str, Any]:
    """The settings that shaped the weights (the full config is the run's YAML)."""
    me, t, d, m = cfg.method, cfg.train, cfg.data, cfg.model
    out: dict[str, Any] = {"stage": me.stage, "finetuning_type": me.finetuning_type}
    if me.finetuning_type == "lora":
        out.update(lora_rank=me.lora_rank, lora_alpha=me.lora_alpha or 2 * me.lora_rank, lora_dropout=me.lora_dropout,
                   lora_target=", ".join(me.lora_target))
        out.update({k: True for k in ("use_dora", "use_rslora", "pissa_init") if getattr(me, k)})
    elif me.finetuning_type == "oft":
        out.update(oft_rank=me.oft_rank, oft_block_size=me.oft_block_size, oft_target=", ".join(me.oft_target))
    elif me.finetuning_type == "freeze":
        out.update(freeze_trainable_layers=me.freeze_trainable_layers,
                   freeze_trainable_modules=", ".join(me.freeze_trainable_modules))
    if m.quantization_bit:
        out["quantization_bit"] = m.quantization_bit
    if stage_of(me.stage).pref_loss:
        out.update(pref_loss=me.pref_loss, pref_beta=me.pref_beta, pref_ftx=me.pref_ftx)
    out.update(learning_rate=t.learning_rate, lr_scheduler_type=t.lr_scheduler_type)
    out.update({"warmup_steps": t.warmup_steps} if t.warmup_steps else {"warmup_ratio": t.warmup_ratio})
    out.update({"max_steps": t.max_steps} if t.max_steps > 0 else {"num_train_epochs": t.num_train_epochs})
    batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * processes
    out.update(per_device_train_batch_size=t.per_device_train_batch_size,
               gradient_accumulation_steps=t.gradient_accumulation_steps, processes=processes, total_batch_size=batch,
               optim=t.optim, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
               precision="pure bf16" if t.pure_bf16 else "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32", seed=t.seed, cutoff_len=d.cutoff_len)
    if d.packing:
        out["packing"] = True
    if m.template:
        out["template"] = m.template
    return out


def _pipeline(writes_text: bool, media: bool) -> str | None:
    if not writes_text:
        return None
    return "image-text-to-text" if media else "text-generation"


def _base_link(cfg: RunConfig, base: str | None) -> str:
    return f"[{base}](https://huggingface.co/{base})" if base else f"`{cfg.model.model_name_or_path}`"


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "\\|")


def _table(values: dict[str, Any]) -> list[str]:
    return ["| key | value |", "|---|---|", *(f"| {k} | {_shown(v)} |" for k, v in values.items())]


def _evaluations(log_history: list[dict[str, Any]]) -> list[str]:
    """Every evaluation during training: step, epoch and its figures."""
    evals = [e for e in log_history if "eval_loss" in e]
    if not evals:
        return []
    keys = [k for k in evals[-1] if k not in ("step", "epoch")]
    rows = [f"| {e.get('step')} | {_shown(e.get('epoch'))} | " + " | ".join(_shown(e.get(k, "")) for k in keys) + " |"
            for e in evals]
    return ["", "### Evaluations", "", f"| step | epoch | {' | '.join(keys)} |",
            "|---|---|" + "---|" * len(keys), *rows]


def _usage(where: str, base: str | None, adapter: bool, media: bool, *, value_head: bool) -> list[str]:
    auto = "AutoModelForImageTextToText" if media else "AutoModelForCausalLM"
    files = "AutoProcessor" if media else "AutoTokenizer"
    if adapter:
        code = ["from peft import PeftModel", f"from transformers import {auto}, {files}", "",
                f'base = {auto}.from_pretrained("{base}")', f'model = PeftModel.from_pretrained(base, "{where}")',
                f'{files.removeprefix("Auto").lower()} = {files}.from_pretrained("{where}")']
    else:
        code = [f"from transformers import {auto}, {files}", "", f'model = {auto}.from_pretrained("{where}")',
                f'{files.removeprefix("Auto").lower()} = {files}.from_pretrained("{where}")']
    if not media and not value_head:
        code += ["", 'messages = [{"role": "user", "content": "Hello!"}]',
                 "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
                 "return_dict=True)",
                 "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0], skip_special_tokens=True))"]
    lines = ["```python", *code, "```"]
    if value_head:
        lines += ["", "The reward head is `value_head.safetensors` (a linear layer on the last hidden state); "
                      "`tuneforge api` on this folder serves its scores."]
    return lines


def _versions() -> list[str]:
    out = []
    for name in VERSIONS:
        try:
            out.append(f"- {name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
