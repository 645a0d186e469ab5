"""New tokens, round trip: tokenize, train (lora and full), save, export (merged folder and GGUF), reload with plain
transformers / peft and with tuneforge's loader: the same ids and the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneforge.config import from_dict
from tuneforge.export import export_model
from tuneforge.model.inference import load_inference_model

SPECIAL = ["<|think|>", "<|/think|>", "<|tool|>"]
TEXT = "The <|think|> quick <tool> fox <|/think|> jumps <|tool|> over"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("new-token-data")
    rows = [{"instruction": f"Say {i}: the quick fox", "input": "", "output": TEXT} for i in range(8)]
    (root / "rows.json").write_text(json.dumps(rows))
    (root / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.json"}}))
    return root


def train(tmp_path_factory, model_dir, data_dir, **keys) -> tuple[Path, dict]:
    from tuneforge.workflow import run

    out = tmp_path_factory.mktemp("new-token-run")
    raw = {"model_name_or_path": str(model_dir), "dataset_dir": str(data_dir), "dataset": "rows",
           "output_dir": str(out), "overwrite_output_dir": True, "cutoff_len": 64, "max_steps": 8,
           "per_device_train_batch_size": 4, "learning_rate": 1e-2, "lr_scheduler_type": "constant",
           "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True, "add_tokens": "<tool>",
           "add_special_tokens": ",".join(SPECIAL), **keys}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TUNEFORGE_HOME", str(tmp_path_factory.mktemp("home")))
        result = run(from_dict(raw, source="new-tokens.yaml"))
    return out, result


def single_ids(tokenizer) -> list[int]:
    """TEXT's ids; each new token is one id."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    news = tokenizer.convert_tokens_to_ids(["<tool>", *SPECIAL])
    assert sorted(i for i in ids if i in news) == sorted(news)
    return ids


@torch.no_grad()
def logits(model, ids) -> torch.Tensor:
    return model.eval()(input_ids=torch.tensor([ids])).logits


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, data_dir):
    return train(tmp_path_factory, tiny_model_dir, data_dir, finetuning_type="lora", lora_target="q_proj,v_proj")


def test_lora_round_trip_through_peft_our_loader_and_a_merged_export(lora_run, tiny_model_dir, tmp_path):
    out, result = lora_run
    history = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < losses[0] - 2, losses
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = single_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids(SPECIAL) == [49153, 49154, 49155]
    # the adapter: LoRA plus the trained embedding (tied: the head is it), nothing else of the base
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert {k for k in f.keys() if "lora_" not in k} <= {"base_model.model.model.embed_tokens.weight",
                                                              "base_model.model.lm_head.weight"}
        assert f.get_slice("base_model.model.model.embed_tokens.weight").get_shape() == [49156, 32]
    # plain peft: AutoPeftModel grows the base to the saved tokenizer by itself
    expected = logits(AutoPeftModelForCausalLM.from_pretrained(out), ids)
    assert expected.shape[-1] == 49156
    # tuneforge's loader (chat / api / eval), from a config that names only the base and the adapter
    cfg = from_dict({"model_name_or_path": str(tiny_model_dir), "adapter_name_or_path": str(out),
                     "export_dir": str(tmp_path / "merged")}, for_training=False)
    torch.testing.assert_close(logits(load_inference_model(cfg, device="cpu", dtype=torch.float32), ids), expected,
                               atol=1e-5, rtol=0)
    # the new rows trained: they moved from where they started (the base with the run's tokens and seed)
    start = load_inference_model(from_dict({"model_name_or_path": str(tiny_model_dir), "add_tokens": "<tool>",
                                            "add_special_tokens": ",".join(SPECIAL)}, for_training=False),
                                 device="cpu", dtype=torch.float32).get_input_embeddings().weight
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        rows = f.get_tensor("base_model.model.model.embed_tokens.weight")
    assert (rows[49152:] - start[49152:]).abs().min() > 1e-3
    # the merged export, loaded with plain transformers
    export_model(cfg)
    merged_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert merged_tokenizer(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert merged.config.vocab_size == 49156 and merged.lm_head.weight is merged.model.embed_tokens.weight
    torch.testing.assert_close(logits(merged, ids), expected, atol=1e-5, rtol=0)


def test_full_round_trip_in_the_padded_rows_and_through_gguf(tmp_path_factory, small_vocab_dir, data_dir, tmp_path):
    """The small model pads its vocabulary (~310 tokens) to 336 rows: the new tokens take rows that are there."""
    from gguf import GGUFReader, TokenType

    out, _ = train(tmp_path_factory, small_vocab_dir, data_dir, finetuning_type="full", max_steps=4)
    tokenizer, n = AutoTokenizer.from_pretrained(out), len(AutoTokenizer.from_pretrained(small_vocab_dir))
    ids = single_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids(["<tool>", *SPECIAL]) == [n, n + 1, n + 2, n + 3] and n + 4 < 336
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert trained.get_input_embeddings().weight.shape[0] == 336  # no resize: the rows were there
    expected = logits(trained, ids)
    cfg = from_dict({"model_name_or_path": str(out), "export_dir": str(tmp_path / "gguf"), "export_format": "gguf",
                     "export_gguf_type": "f32", "add_tokens": "<tool>", "add_special_tokens": ",".join(SPECIAL)},
                    for_training=False)
    name = Path(export_model(cfg)["gguf_file"]).name
    reader = GGUFReader(tmp_path / "gguf" / name)
    types = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    assert kinds[n:n + 4] == [TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
    assert kinds[n + 4:] == [TokenType.UNUSED] * (336 - n - 4)
    gguf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "gguf", gguf_file=name)
    assert gguf_tokenizer(TEXT, add_special_tokens=False)["input_ids"] == ids
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file=name, dtype=torch.float32)
    torch.testing.assert_close(logits(loaded, ids), expected, atol=1e-5, rtol=0)
