"""export_model: the merged folder loads with plain transformers and matches base + adapter through peft;
it carries the tokenizer, generation_config and Modelfile; bad configs fail before any weight loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from export_helpers import hf_logits, peft_logits, siblings
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneforge.config import from_dict
from tuneforge.data.template import TEMPLATES
from tuneforge.errors import ConfigError
from tuneforge.export import export_dtype, export_model


def test_merged_folder_matches_base_plus_adapter_through_peft(make_cfg, tiny_model_dir, lora_dir, input_ids):
    cfg = make_cfg()
    result = export_model(cfg)
    out = cfg.export.export_dir
    assert result["export_dir"].endswith("out") and result["weights"] == ["model.safetensors"]
    expected = peft_logits(tiny_model_dir, lora_dir, input_ids)
    base = hf_logits(tiny_model_dir, input_ids)
    assert (expected - base).abs().max() > 1e-2  # the adapter does change the model
    torch.testing.assert_close(hf_logits(out, input_ids), expected, atol=1e-4, rtol=0)
    # a plain folder: no adapter files, the usual Hugging Face names
    names = {p.name for p in Path(out).iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "Modelfile"} <= names
    assert not any(n.startswith("adapter_") for n in names)
    assert siblings(Path(out)) == []
    assert any(str(out) in line for line in result["summary"])


def test_tokenizer_template_and_generation_config(make_cfg, eos_differs_dir, tokenizer):
    cfg = make_cfg(model_name_or_path=str(eos_differs_dir), temperature=0.6, top_p=0.9, top_k=20,
                   max_new_tokens=77, repetition_penalty=1.1)
    export_model(cfg)
    out = cfg.export.export_dir
    exported = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert exported.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)
    gen = json.loads((Path(out) / "generation_config.json").read_text())
    endoftext, im_end = exported.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert gen["eos_token_id"] == [endoftext, im_end]  # eos, then the template's end of turn
    assert gen["pad_token_id"] == exported.pad_token_id
    assert (gen["do_sample"], gen["temperature"], gen["top_p"], gen["top_k"]) == (True, 0.6, 0.9, 20)
    assert (gen["max_new_tokens"], gen["repetition_penalty"]) == (77, 1.1)
    modelfile = (Path(out) / "Modelfile").read_text()
    assert modelfile.count("\nFROM .\n") == 1
    assert 'PARAMETER stop "<|endoftext|>"' in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "PARAMETER temperature 0.6" in modelfile and "PARAMETER num_predict 77" in modelfile
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in modelfile  # the template's own default


def test_named_template_becomes_the_chat_template(make_cfg, tokenizer):
    # alpaca: one of our own templates (chatml / llama3 name families: the tokenizer's own template wins)
    cfg = make_cfg(template="alpaca", do_sample=False, default_system="Be brief.", export_device="auto")
    result = export_model(cfg)
    assert result["device"] == (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    out = Path(cfg.export.export_dir)
    exported = AutoTokenizer.from_pretrained(out)
    assert exported.chat_template == TEMPLATES["alpaca"]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    trained = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES["alpaca"], tokenize=False,
                                            add_generation_prompt=True)
    assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == trained
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is False and "temperature" not in gen
    modelfile = (out / "Modelfile").read_text()
    assert 'SYSTEM """Be brief."""' in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "### Instruction:" in modelfile
    assert "PARAMETER temperature 0\n" in modelfile and "top_p" not in modelfile


def test_reward_model_export_carries_the_value_head(make_cfg, rm_lora_dir, input_ids):
    from tuneforge.model.inference import load_inference_model
    from tuneforge.model.value_head import VALUE_HEAD_FILE, attach_value_head

    cfg = make_cfg(adapter_name_or_path=str(rm_lora_dir), stage="rm")
    result = export_model(cfg)
    out = cfg.export.export_dir
    assert result["value_head"].endswith(VALUE_HEAD_FILE)
    exported = attach_value_head(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), out).eval()
    source = load_inference_model(cfg, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=input_ids), source(input_ids=input_ids), atol=1e-5, rtol=0)


def test_legacy_format_writes_pytorch_model_bin(make_cfg, tiny_model_dir, lora_dir, input_ids, monkeypatch):
    from tuneforge.export import hf

    seen = {}
    original = hf.save_weights
    monkeypatch.setattr(hf, "save_weights", lambda *a, **k: seen.update(k) or original(*a, **k))
    cfg = make_cfg(export_legacy_format=True, export_size=2)
    result = export_model(cfg)
    assert seen["max_shard_size"] == "2GB" and result["weights"] == ["pytorch_model.bin"]
    out = Path(cfg.export.export_dir)
    assert not list(out.glob("*.safetensors"))
    torch.testing.assert_close(hf_logits(out, input_ids), peft_logits(tiny_model_dir, lora_dir, input_ids),
                               atol=1e-4, rtol=0)


def test_a_qlora_config_merges_into_the_full_precision_base(make_cfg, tmp_path, caplog):
    from safetensors.torch import load_file

    with caplog.at_level("INFO", logger="tuneforge.export"):
        export_model(make_cfg(quantization_bit=4, export_dir=str(tmp_path / "from-qlora")))
    assert "merging into the full-precision base" in caplog.text
    export_model(make_cfg(export_dir=str(tmp_path / "plain")))
    merged, plain = (load_file(tmp_path / d / "model.safetensors") for d in ("from-qlora", "plain"))
    assert merged.keys() == plain.keys() and all(torch.equal(merged[k], plain[k]) for k in plain)
    assert "quantization_config" not in json.loads((tmp_path / "from-qlora" / "config.json").read_text())


@pytest.mark.parametrize(("keys", "words"), [
    ({"export_dir": None}, "export_dir is required"),
    ({"export_size": 0}, "export_size must be >= 1"),
])
def test_config_mistakes_fail_before_loading(make_cfg, keys, words):
    with pytest.raises(ConfigError, match=words):
        export_model(make_cfg(**keys))


def test_export_dir_that_holds_other_files_or_the_source_is_refused(make_cfg, tmp_path, lora_dir):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="holds other files"):
        export_model(make_cfg(export_dir=str(precious)))
    assert (precious / "thesis.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match="holds the model being exported"):
        export_model(make_cfg(export_dir=str(lora_dir)))
    with pytest.raises(ConfigError, match="holds the model being exported"):
        export_model(make_cfg(export_dir=str(lora_dir.parent)))


def test_export_dtype_is_the_checkpoints_unless_infer_dtype_says(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)

    def cfg(path, **keys):
        return from_dict({"model_name_or_path": str(path), **keys}, for_training=False)

    assert export_dtype(cfg(bf16_dir)) == torch.bfloat16  # auto on a CPU: still the saved dtype
    assert export_dtype(cfg(tiny_model_dir)) == torch.float32
    assert export_dtype(cfg(bf16_dir, infer_dtype="float16")) == torch.float16
