"""Helpers shared by the export tests."""

from __future__ import annotations

import torch


def peft_logits(base_dir, adapter_dir, ids):
    """Logits of base + adapter through plain peft (the reference an export must match)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter_dir)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def hf_logits(folder, ids, **kwargs):
    """Logits of a folder loaded with plain transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def siblings(folder):
    """Names beside folder that an export may leave (temporary or set-aside folders)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))
