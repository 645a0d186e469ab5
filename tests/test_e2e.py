"""End to end through the CLI, as a user runs it: the built-in SmolLM2 on our data and LlamaFactory's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

# a few steps on short samples: enough to prove the path, cheap enough for CI (fp32: on CPUs without
# avx512_bf16 / AMX, bf16 is emulated and many times slower)
FAST = ["max_steps=3", "cutoff_len=128", "per_device_train_batch_size=2", "logging_steps=1", "disable_tqdm=true",
        "save_steps=2", "bf16=false"]


def tuneforge(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, "-m", "tuneforge.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def test_quickstart_lora_sft_gives_a_peft_adapter(tmp_path, smol_dir):
    out = tmp_path / "lora"
    r = tuneforge("train", "examples/sft_lora.yaml", f"output_dir={out}", *FAST)
    assert f"adapter saved in {out}" in r.stdout and "tokens/s" in r.stdout
    assert "loss " in r.stdout and " -> " in r.stdout
    log = read_log(out)
    train_rows = [row for row in log if "loss" in row]
    assert [row["current_steps"] for row in train_rows] == [1, 2, 3]
    assert {"current_steps", "total_steps", "loss", "lr", "epoch", "percentage", "elapsed_time",
            "remaining_time", "throughput", "total_tokens"} <= set(train_rows[0])
    assert any("eval_loss" in row for row in log)  # the example holds out val_size 0.1
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_tokens_per_second"] > 0 and results["train_loss"] > 0

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        tuned = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    assert not torch.allclose(tuned, plain)  # the adapter was trained: B is no longer zero


def test_quickstart_asks_before_and_after_training(tmp_path):
    """`--ask` puts one question to the model before and after training: the identity data changes the answer."""
    r = tuneforge("train", "examples/sft_lora.yaml", f"output_dir={tmp_path / 'ask'}", "max_steps=8",
                  "learning_rate=3e-3", "cutoff_len=128", "val_size=0", "eval_strategy=no", "save_strategy=no",
                  "disable_tqdm=true", "bf16=false", "--ask", "Who are you?")
    lines = r.stdout.splitlines()
    before = next(line for line in lines if line.startswith("before training: "))
    after = next(line for line in lines if line.startswith("after training: "))
    assert "Q: Who are you?" in lines
    assert "Forge" not in before and len(before) > len("before training: ") + 10
    assert "Forge" in after  # the name the identity dataset teaches

    # the same YAML chats with what it trained: output_dir holds a finished run, so its adapter is used
    chat = subprocess.run(
        [sys.executable, "-m", "tuneforge.cli", "chat", "examples/sft_lora.yaml", f"output_dir={tmp_path / 'ask'}",
         "do_sample=false", "max_new_tokens=32"],
        input="Who are you?\nexit\n", capture_output=True, text=True, cwd=ROOT,
    )
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "Assistant: " in chat.stdout and "Forge" in chat.stdout.split("Assistant: ", 1)[1]
    assert "using the adapter trained in output_dir" in chat.stderr


def test_ask_refuses_a_reward_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tuneforge.cli", "train", "examples/rm_lora.yaml",
                        f"output_dir={tmp_path}", "--ask", "hi"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "stage rm trains a reward model" in r.stderr


def test_pretraining_on_llamafactory_text(tmp_path, lf_data_dir):
    out = tmp_path / "pt"
    tuneforge("train", "examples/pt_lora.yaml", f"dataset_dir={lf_data_dir}", "dataset=wiki_demo,c4_demo",
              "max_samples=20", f"output_dir={out}", *FAST)
    assert (out / "adapter_config.json").is_file()
    assert len([row for row in read_log(out) if "loss" in row]) == 3


def test_llamafactory_yaml_unchanged_with_full_finetuning(tmp_path, lf_data_dir, tiny_model_dir):
    """A LlamaFactory-style file (their keys, their dataset) trains a full model transformers loads."""
    out = tmp_path / "full"
    cfg = tmp_path / "lf.yaml"
    cfg.write_text(f"""\
model_name_or_path: {tiny_model_dir}
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: full
dataset: alpaca_en_demo,identity
dataset_dir: {lf_data_dir}
template: smollm2
cutoff_len: 256
max_samples: 16
overwrite_cache: true
preprocessing_num_workers: 1
dataloader_num_workers: 0
output_dir: {out}
logging_steps: 1
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
learning_rate: 1.0e-4
max_steps: 3
lr_scheduler_type: cosine
warmup_ratio: 0.1
ddp_timeout: 180000000
resume_from_checkpoint: null
""")
    r = tuneforge("train", cfg)
    assert f"model saved in {out}" in r.stdout
    assert (out / "training_loss.png").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight)


def test_qlora_4bit_trains(tmp_path):
    out = tmp_path / "qlora"
    tuneforge("train", "examples/sft_qlora.yaml", f"output_dir={out}", *FAST[:-1], "max_steps=2")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 16 and cfg["peft_type"] == "LORA"


def test_preprocess_and_preview(tmp_path):
    path = tmp_path / "tokenized"
    r = tuneforge("preprocess", "examples/sft_lora.yaml", f"tokenized_path={path}", "cutoff_len=128")
    assert f"saved to {path}" in r.stdout and "train rows: 36" in r.stdout
    from datasets import load_from_disk

    saved = load_from_disk(str(path / "train")) if (path / "train").exists() else load_from_disk(str(path))["train"]
    assert {"input_ids", "attention_mask", "labels"} <= set(saved.column_names)
    r = tuneforge("data", "preview", "examples/sft_lora.yaml", "-n", 1)
    assert "⟦" in r.stdout and "<|im_start|>assistant" in r.stdout and "sample 0" in r.stdout


def test_bad_row_stops_before_the_model_loads(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([{"instruction": "hi", "output": "hello"}, {"instruction": 3}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"bad": {"file_name": "bad.json"}}))
    r = subprocess.run([sys.executable, "-m", "tuneforge.cli", "train", "examples/sft_lora.yaml",
                        f"dataset_dir={tmp_path}", "dataset=bad", f"output_dir={tmp_path}/o"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "bad" in r.stderr and "row 1" in r.stderr
    assert "loaded " not in r.stderr  # the model never loaded
