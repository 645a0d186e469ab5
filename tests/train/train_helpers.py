"""Helpers for the training tests: random token datasets, a right-padding collate, tiny models, configs."""

from __future__ import annotations

import torch
from datasets import Dataset

PAD_ID = 2  # <|im_end|>, the built-in tokenizer's pad token


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: pad id in input_ids, 0 in attention_mask, -100 in labels."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for r in rows:
        pad = width - len(r["input_ids"])
        out["input_ids"].append(list(r["input_ids"]) + [PAD_ID] * pad)
        out["attention_mask"].append(list(r["attention_mask"]) + [0] * pad)
        out["labels"].append(list(r["labels"]) + [-100] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


def random_dataset(
    lengths: list[int], seed: int = 0, prompt_len: int = 2, low: int = 3, high: int = 1000
) -> Dataset:
    """Rows of random token ids with the given lengths; the first prompt_len labels are -100."""
    g = torch.Generator().manual_seed(seed)
    cols = {"input_ids": [], "attention_mask": [], "labels": []}
    for n in lengths:
        ids = torch.randint(low, high, (n,), generator=g).tolist()
        cols["input_ids"].append(ids)
        cols["attention_mask"].append([1] * n)
        cols["labels"].append([-100] * min(prompt_len, n) + ids[prompt_len:])
    return Dataset.from_dict(cols)


def load_model(model_dir, lora: dict | None = None, seed: int = 0):
    """The tiny fp32 Llama, optionally wrapped in a peft LoRA adapter (lora = LoraConfig kwargs)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **lora})
        )
    return model


def make_cfg(output_dir, model_dir, **keys):
    """A validated RunConfig for a short run on the tiny model (flat keys as in YAML)."""
    from tuneforge.config import from_dict

    raw = {
        "model_name_or_path": str(model_dir),
        "dataset": ["random"],
        "output_dir": str(output_dir),
        "finetuning_type": "full",
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-3,
        "max_steps": 4,
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
    }
    raw.update(keys)
    if raw.get("eval_strategy", "no") != "no":
        raw.setdefault("val_size", 0.1)
    return from_dict(raw, source="test.yaml")


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
