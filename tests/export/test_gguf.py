"""export_format gguf: transformers loads the file back (gguf_file=) with the source's logits within the
format's tolerance, and with the source's tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import hf_logits, siblings
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneforge.errors import ConfigError
from tuneforge.export import export_model

# largest |difference| from the source's logits, as a share of its largest |logit|
TOLERANCE = {"f32": 1e-5, "f16": 1e-2, "bf16": 5e-2, "q8_0": 5e-2}


def _round(weight: torch.Tensor, gguf_type: str) -> torch.Tensor:
    """A matrix stored as gguf_type and read back (what the file should hold)."""
    from gguf import GGMLQuantizationType, quants

    if gguf_type == "f16":
        return weight.half().float()
    if gguf_type == "bf16":
        return weight.bfloat16().float()
    q8 = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(quants.dequantize(q8, GGMLQuantizationType.Q8_0))


@pytest.fixture(scope="module")
def merged(small_vocab_dir, small_lora_dir):
    """Random input, and the merged source model through peft."""
    from peft import PeftModel

    ids = torch.randint(3, 322, (2, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(small_vocab_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, small_lora_dir).merge_and_unload().eval()
    return ids, model


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_loads_back_with_the_sources_logits(make_cfg, small_vocab_dir, small_lora_dir, merged, gguf_type):
    ids, source = merged
    cfg = make_cfg(model_name_or_path=str(small_vocab_dir), adapter_name_or_path=str(small_lora_dir),
                   export_format="gguf", export_gguf_type=gguf_type)
    result = export_model(cfg)
    out, gguf_file = Path(cfg.export.export_dir), Path(result["gguf_file"])
    assert gguf_file.parent == out and gguf_file.name == f"out-{gguf_type}.gguf"
    assert sorted(p.name for p in out.iterdir()) == sorted(["Modelfile", "README.md", gguf_file.name])
    assert siblings(out) == []
    card = (out / "README.md").read_text()
    assert "- gguf" in card and f"as `{gguf_file.name}` (GGUF)" in card and "library_name" not in card
    assert f"FROM ./{gguf_file.name}\n" in (out / "Modelfile").read_text()
    logits = hf_logits(out, ids, gguf_file=gguf_file.name)
    with torch.no_grad():
        expected = source(input_ids=ids).logits
        error = (logits - expected).abs().max().item()
        assert error <= TOLERANCE[gguf_type] * expected.abs().max().item()
        if gguf_type == "f32":
            return
        assert error > 0  # really stored in the smaller type
        # exactly what the source gives with its matrices stored as gguf_type (1-D tensors stay f32)
        rounded = {k: _round(v, gguf_type) if v.dim() > 1 else v for k, v in source.state_dict().items()}
        copy = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32).eval()
        copy.load_state_dict(rounded)
        torch.testing.assert_close(logits, copy(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_gguf_tokenizer_round_trip_on_the_small_vocab(make_cfg, small_vocab_dir):
    cfg = make_cfg(model_name_or_path=str(small_vocab_dir), adapter_name_or_path=None, export_format="gguf")
    result = export_model(cfg)
    source = AutoTokenizer.from_pretrained(small_vocab_dir)
    loaded = AutoTokenizer.from_pretrained(cfg.export.export_dir, gguf_file=Path(result["gguf_file"]).name)
    for text in ["The lazy fox, it's 42!", "  odd\tspacing\nhere <|im_end|> ünïcode"]:
        assert loaded(text)["input_ids"] == source(text)["input_ids"]
    assert loaded.chat_template == source.chat_template


def test_gguf_carries_the_smollm2_tokenizer_and_chat_template(make_cfg, eos_differs_dir, tokenizer):
    """The 49k-token vocabulary, merges and special ids as written (transformers takes ~10 s to rebuild a
    tokenizer that size from GGUF; the round trip through it is the small-vocab test above)."""
    import json

    from transformers.integrations.gguf.reader import read_gguf_metadata

    cfg = make_cfg(model_name_or_path=str(eos_differs_dir), export_format="gguf", export_gguf_type="q8_0")
    result = export_model(cfg)
    metadata, _ = read_gguf_metadata(result["gguf_file"], ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    assert list(metadata["tokenizer.ggml.tokens"]) == sorted(vocab, key=vocab.get)
    assert list(metadata["tokenizer.ggml.merges"]) == [" ".join(m) for m in spec["model"]["merges"]]
    assert metadata["tokenizer.chat_template"] == tokenizer.chat_template
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert metadata["tokenizer.ggml.eos_token_id"] == ids[0]  # this copy's eos
    assert metadata["tokenizer.ggml.eot_token_id"] == ids[2]  # the template's end of turn
    assert metadata["tokenizer.ggml.bos_token_id"] == ids[1] and metadata["tokenizer.ggml.add_bos_token"] is False
    assert metadata["tokenizer.ggml.pre"] == "gpt-2" and metadata["general.architecture"] == "llama"
    assert metadata["llama.context_length"] == 512 and metadata["llama.block_count"] == 2
    assert metadata["llama.attention.head_count_kv"] == 2 and np.isclose(metadata["llama.rope.freq_base"], 10000.0)


def test_gguf_of_an_unsupported_architecture_fails_before_loading(tmp_path, tokenizer, make_cfg):
    from transformers import Qwen2Config

    folder = tmp_path / "qwen2"  # config and tokenizer only: an export that loaded weights would fail otherwise
    Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match="model_type is 'qwen2'.*export_format: safetensors"):
        export_model(make_cfg(model_name_or_path=str(folder), adapter_name_or_path=None, export_format="gguf"))


def test_gguf_refuses_a_reward_model(make_cfg, rm_lora_dir):
    with pytest.raises(ConfigError, match="value head"):
        export_model(make_cfg(adapter_name_or_path=str(rm_lora_dir), stage="rm", export_format="gguf"))
