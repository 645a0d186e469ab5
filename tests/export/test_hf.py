"""save_weights: shards + index under a small max_shard_size, and the legacy pytorch_model.bin layout."""

from __future__ import annotations

import json

import pytest
import torch
from export_helpers import hf_logits
from transformers import AutoModelForCausalLM

from tuneforge.export.hf import save_weights


@pytest.mark.parametrize("legacy", [False, True])
def test_small_shards_write_an_index_and_load_back(tiny_model_dir, tmp_path, input_ids, legacy):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    files = save_weights(model, tmp_path, max_shard_size="40KB", legacy=legacy)
    assert len(files) >= 3
    suffix, index_name = (".bin", "pytorch_model.bin.index.json") if legacy else (".safetensors", "model.safetensors.index.json")
    assert sorted(p.name for p in tmp_path.glob(f"*{suffix}")) == sorted(files)
    assert all(f.endswith(suffix) and "-of-" in f for f in files)
    index = json.loads((tmp_path / index_name).read_text())
    assert set(index["weight_map"].values()) == set(files)
    if legacy:
        assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / "model.safetensors.index.json").exists()
    torch.testing.assert_close(hf_logits(tmp_path, input_ids), hf_logits(tiny_model_dir, input_ids), atol=0, rtol=0)
