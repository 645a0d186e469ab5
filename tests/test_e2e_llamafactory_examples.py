"""LlamaFactory's published example configs (examples/train_lora/qwen3_lora_{sft,reward,dpo,kto,pretrain}.yaml,
examples/merge_lora/qwen3_lora_sft.yaml, examples/extras/nlg_eval/llama3_lora_predict.yaml at hiyouga/LLaMA-Factory
ff6d4d12e) run with `tuneforge` as they are, with only the model, the data folder and the output paths changed and
the run cut short on the command line (2 steps of 2 samples, at most 512 tokens each: the same code paths, minutes
less on a CPU). The keys and values below are those files' own. On a CPU without native bf16 (AVX2) the runs are in
fp32: there bf16 products take torch's reference kernel, and the runs took 7-9 minutes each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tuneforge.train.trainer import cpu_has_native_bf16

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]

COMMON = {  # what every qwen3_lora_*.yaml holds besides its stage and data
    "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507", "trust_remote_code": True, "do_train": True,
    "finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "template": "qwen3_nothink",
    "cutoff_len": 2048, "max_samples": 1000, "preprocessing_num_workers": 16, "dataloader_num_workers": 4,
    "logging_steps": 10, "save_steps": 500, "plot_loss": True, "overwrite_output_dir": True, "save_only_model": False,
    "report_to": "none", "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8,
    "learning_rate": 1.0e-4, "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1,
    "bf16": True, "ddp_timeout": 180000000, "resume_from_checkpoint": None,
}
EXAMPLES = {
    "sft": {"stage": "sft", "dataset": "identity,alpaca_en_demo"},
    "reward": {"stage": "rm", "dataset": "dpo_en_demo"},
    "dpo": {"stage": "dpo", "pref_beta": 0.1, "pref_loss": "sigmoid", "dataset": "dpo_en_demo",
            "learning_rate": 5.0e-6},
    "kto": {"stage": "kto", "pref_beta": 0.1, "dataset": "kto_en_demo", "learning_rate": 5.0e-6,
            "save_only_model": None, "resume_from_checkpoint": None},
    "pretrain": {"stage": "pt", "dataset": "c4_demo", "template": None},
}


SHORT = ("max_steps=2", "gradient_accumulation_steps=2", "cutoff_len=512",
         *(() if cpu_has_native_bf16() else ("bf16=false",)))


def tuneforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuneforge.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=900)


def write(path: Path, keys: dict) -> Path:
    path.write_text(yaml.safe_dump({k: v for k, v in keys.items() if v is not None}, sort_keys=False))
    return path


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_a_llamafactory_example_trains_as_it_is(name, tmp_path, lf_data_dir, smol_dir):
    config = write(tmp_path / f"qwen3_lora_{name}.yaml", {**COMMON, **EXAMPLES[name]})
    out = tmp_path / "saves"
    r = tuneforge("train", str(config), "model_name_or_path=smollm2-135m-instruct", f"dataset_dir={lf_data_dir}",
                  f"output_dir={out}", *SHORT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file() and "finished 2 steps" in r.stderr
    assert (out / "training_loss.png").is_file()  # plot_loss
    if name != "sft":
        return
    # examples/merge_lora/qwen3_lora_sft.yaml on that adapter
    merge = write(tmp_path / "merge.yaml", {
        "model_name_or_path": "smollm2-135m-instruct", "adapter_name_or_path": str(out), "template": "qwen3_nothink",
        "trust_remote_code": True, "export_dir": str(tmp_path / "merged"), "export_size": 5, "export_device": "cpu",
        "export_legacy_format": False})
    r = tuneforge("export", str(merge))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    # examples/extras/nlg_eval/llama3_lora_predict.yaml (do_predict without do_train) on the adapter too
    predict = write(tmp_path / "predict.yaml", {
        "model_name_or_path": "smollm2-135m-instruct", "adapter_name_or_path": str(out), "trust_remote_code": True,
        "stage": "sft", "do_predict": True, "finetuning_type": "lora", "eval_dataset": "identity,alpaca_en_demo",
        "dataset_dir": str(lf_data_dir), "template": "llama3", "cutoff_len": 2048, "max_samples": 50,
        "overwrite_cache": True, "preprocessing_num_workers": 16, "dataloader_num_workers": 4,
        "output_dir": str(tmp_path / "predict"), "overwrite_output_dir": True, "report_to": "none",
        "per_device_eval_batch_size": 1, "predict_with_generate": True, "ddp_timeout": 180000000})
    r = tuneforge("train", str(predict), "max_samples=2", "max_new_tokens=8")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (tmp_path / "predict" / "generated_predictions.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(set(json.loads(x)) == {"prompt", "predict", "label"} for x in lines)
