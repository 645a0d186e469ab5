"""Loading a trained model to use it: merged adapters, value heads, and the training YAML's own output."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tuneforge.errors import ConfigError
from tuneforge.model.inference import inference_dtype, load_inference_model, use_trained_output
from tuneforge.model.value_head import ValueHeadModel


def save_lora(base_dir, folder, seed):
    """A LoRA adapter with non-zero B (so it changes the logits), saved in folder."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(folder)
    return folder


def finished_run(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "all_results.json").write_text(json.dumps({"train_loss": 1.0}))
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_merged_adapters_give_the_peft_logits(tiny_model_dir, tmp_path, make_cfg, batch):
    first = save_lora(tiny_model_dir, tmp_path / "a", seed=1)
    second = save_lora(tiny_model_dir, tmp_path / "b", seed=2)
    model = load_inference_model(make_cfg(adapter_name_or_path=f"{first},{second}"), device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"  # merged: no peft wrapper left
    assert not model.training and model.config.use_cache

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(reference, first).merge_and_unload()
    reference = PeftModel.from_pretrained(reference, second).eval()
    with torch.no_grad():
        expected = reference(batch).logits
        got = model(batch).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(batch).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)


def test_unmerged_keeps_the_peft_model(tiny_model_dir, tmp_path, make_cfg):
    adapter = save_lora(tiny_model_dir, tmp_path / "a", seed=1)
    model = load_inference_model(make_cfg(adapter_name_or_path=str(adapter)), device="cpu", merge=False)
    assert isinstance(model, PeftModel)


def test_a_reward_model_folder_comes_with_its_value_head(tiny_model_dir, tmp_path, make_cfg, batch):
    adapter = save_lora(tiny_model_dir, tmp_path / "rm", seed=3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trained = ValueHeadModel(PeftModel.from_pretrained(base, adapter))
    torch.nn.init.normal_(trained.v_head.weight)
    trained.save_pretrained(adapter)

    model = load_inference_model(make_cfg(adapter_name_or_path=str(adapter)), device="cpu")
    assert isinstance(model, ValueHeadModel)
    with torch.no_grad():
        torch.testing.assert_close(model(batch), trained.eval()(batch), atol=1e-5, rtol=1e-5)
    plain = load_inference_model(make_cfg(adapter_name_or_path=str(adapter)), device="cpu", value_head=False)
    assert not isinstance(plain, ValueHeadModel)


def test_asking_for_a_value_head_where_there_is_none_names_the_folder(tiny_model_dir, make_cfg):
    with pytest.raises(ConfigError, match="value_head.safetensors.*stage rm"):
        load_inference_model(make_cfg(), device="cpu", value_head=True)


def test_dtype_auto_is_fp32_on_cpu_and_explicit_wins(make_cfg):
    assert inference_dtype(make_cfg(), torch.device("cpu")) == torch.float32
    assert inference_dtype(make_cfg(infer_dtype="bfloat16"), torch.device("cpu")) == torch.bfloat16


def test_the_training_yaml_uses_its_own_trained_adapter(tmp_path, make_cfg):
    out = finished_run(tmp_path / "out", **{"adapter_config.json": "{}"})
    cfg = use_trained_output(make_cfg(output_dir=str(out)))
    assert cfg.model.adapter_name_or_path == [str(out)]
    # continuing adapter a: the run merged nothing and went on training a, so its output replaces a
    cfg = use_trained_output(make_cfg(output_dir=str(out), adapter_name_or_path="a"))
    assert cfg.model.adapter_name_or_path == [str(out)]
    # a new adapter on top of a and b: both stay, the trained one goes last
    cfg = use_trained_output(make_cfg(output_dir=str(out), adapter_name_or_path="a,b", create_new_adapter=True))
    assert cfg.model.adapter_name_or_path == ["a", "b", str(out)]


def test_full_finetuning_uses_the_trained_model_and_unfinished_runs_change_nothing(tmp_path, make_cfg):
    out = finished_run(tmp_path / "full", **{"config.json": "{}"})
    cfg = use_trained_output(make_cfg(output_dir=str(out), finetuning_type="full"))
    assert cfg.model.model_name_or_path == str(out)

    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoint-5").mkdir(parents=True)
    cfg = make_cfg(output_dir=str(unfinished))
    assert use_trained_output(cfg) is cfg
    assert use_trained_output(make_cfg()).model.adapter_name_or_path is None
