"""Helpers for the training tests: random token datasets, a right-padding collate, tiny models, configs."""

from __future__ import annotations

import torch
from datasets import Dataset

from tuneforge.batch import Batch, Layout

PAD_ID = 2  # <|im_end|>, the built-in tokenizer's pad token
# the columns of a hand-built batch that go to the model (the rest are the objective's targets)
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
              "max_length_k", "shared_prefix")


def as_batch(columns: dict, layout: Layout | None = None, num_rows: int | None = None) -> Batch:
    """A hand-built dict of collated columns as a tuneforge.batch.Batch (model inputs split from targets)."""
    model_inputs = {k: v for k, v in columns.items() if k in MODEL_KEYS}
    targets = {k: v for k, v in columns.items() if k not in MODEL_KEYS}
    ids = model_inputs["input_ids"]
    mask = model_inputs.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None else int(ids.numel())
    return Batch(model_inputs, targets, layout or Layout(), num_rows=num_rows or int(ids.shape[0]), num_tokens=tokens)


def collate(rows: list[dict]) -> Batch:
    """Right-pad to the longest row: pad id in input_ids, 0 in attention_mask, -100 in labels."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for r in rows:
        pad = width - len(r["input_ids"])
        out["input_ids"].append(list(r["input_ids"]) + [PAD_ID] * pad)
        out["attention_mask"].append(list(r["attention_mask"]) + [0] * pad)
        out["labels"].append(list(r["labels"]) + [-100] * pad)
    return as_batch({k: torch.tensor(v) for k, v in out.items()}, num_rows=len(rows))


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
