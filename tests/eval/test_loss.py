"""Loss / perplexity: the token-weighted mean cross-entropy over the supervised tokens, equal to a loss
computed by hand with plain transformers on the chat template's tokens."""

import json
import math

import pytest
import torch
from eval_helpers import ALPACA_ROWS
from transformers import AutoModelForCausalLM

from tuneforge.errors import ConfigError
from tuneforge.eval import evaluate


def hand_loss(model, tokenizer, rows):
    """Sum of -log p over each answer's tokens and its <|im_end|> (not the newline after it), and their count."""
    total, count = 0.0, 0
    for row in rows:
        user = "\n".join(p for p in (row["instruction"], row["input"]) if p)
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(full)["input_ids"]
        start = len(tokenizer(prompt)["input_ids"])
        end = ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>"), start) + 1
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        total -= sum(float(logps[t - 1, ids[t]]) for t in range(start, end))
        count += end - start
    return total, count


def test_loss_equals_hand_computed(tiny_model_dir, tokenizer, tiny_cfg, alpaca_dir, home, tmp_path):
    cfg = tiny_cfg(stage="sft", eval_dataset="tiny_alpaca", dataset_dir=str(alpaca_dir),
                   per_device_eval_batch_size=2, save_dir=str(tmp_path / "out"))
    result = evaluate(cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    total, count = hand_loss(model, tokenizer, ALPACA_ROWS)
    saved = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert saved["eval_tokens"] == count and saved["eval_samples"] == 3
    assert saved["eval_loss"] == pytest.approx(total / count, abs=1e-5)
    assert saved["perplexity"] == pytest.approx(math.exp(saved["eval_loss"]), rel=1e-12)
    assert result["kind"] == "loss" and result["files"] == [str(tmp_path / "out" / "eval_results.json")]


@pytest.mark.parametrize("packing", [True, False])
def test_pretraining_loss_packed_or_not(tiny_model_dir, tokenizer, tiny_cfg, home, tmp_path, packing):
    """stage pt: every token after each document's first, packed rows giving the same loss as separate ones."""
    docs = ["The quick brown fox jumps over the lazy dog.", "Tuneforge trains models.", "One more line of text here."]
    data = tmp_path / "data"
    data.mkdir()
    (data / "docs.json").write_text(json.dumps([{"text": d} for d in docs]))
    (data / "dataset_info.json").write_text(json.dumps({"docs": {"file_name": "docs.json", "columns": {"prompt": "text"}}}))
    cfg = tiny_cfg(stage="pt", dataset="docs", dataset_dir=str(data), packing=packing, cutoff_len=64,
                   per_device_eval_batch_size=2, save_dir=str(tmp_path / "out"))
    result = evaluate(cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for doc in docs:
        ids = tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        total -= sum(float(logps[t - 1, ids[t]]) for t in range(1, len(ids)))
        count += len(ids) - 1
    assert result["eval_tokens"] == count and result["eval_samples"] == (1 if packing else 3)
    assert result["eval_loss"] == pytest.approx(total / count, abs=1e-5)


def test_refuses_other_stages_before_loading(tiny_cfg, tmp_path):
    cfg = tiny_cfg(stage="rm", dataset="anything", output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="stages pt and sft; stage rm has another objective"):
        evaluate(cfg)
    with pytest.raises(ConfigError, match="set save_dir"):
        evaluate(tiny_cfg(eval_dataset="anything"))
