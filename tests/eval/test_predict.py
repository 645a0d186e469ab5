"""predict_with_generate: batched left-padded generation gives the unbatched greedy answers; the written
predictions and scores; a LlamaFactory predict config (do_train: false, do_predict: true) runs."""

import json

import torch
from eval_helpers import ALPACA_ROWS
from transformers import AutoModelForCausalLM

from tuneforge.config.schema import GenerateArgs
from tuneforge.eval import evaluate, metrics
from tuneforge.eval.predict import generate_batched
from tuneforge.infer.generation import Stops, chat_template, end_of_turn, generate_kwargs, render_prompt

QUESTIONS = ["Hi", "What is the capital of France? Answer in one word.",
             "Write a long sentence about the sea, the sky and the wind over the hills.", "Why?"]


def unbatched(model, tokenizer, prompts, stop_ids):
    """Plain transformers, one prompt at a time, no padding: the generated ids (greedy)."""
    answers = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=10, eos_token_id=list(stop_ids), pad_token_id=tokenizer.pad_token_id)
        answers.append(out[0, len(p):].tolist())
    return answers


def text_before(tokenizer, ids, stop_ids):
    ids = ids[: next((k for k, t in enumerate(ids) if t in stop_ids), len(ids))]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_batched_equals_unbatched_greedy(tiny_model_dir, tokenizer, tiny_cfg):
    """Greedy; then with a stop token that ends one answer early, so finished and running rows share a
    batch (greedy answers with an extra stop token are the answers without it, cut there)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights: the random model then writes varied text, not one repeated token
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.mul_(20)
    template = chat_template(tiny_cfg(), tokenizer)
    prompts = [render_prompt(tokenizer, template, [{"role": "user", "content": x}]) for x in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)
    stops = end_of_turn(tokenizer, template)
    gen = GenerateArgs(do_sample=False, max_new_tokens=10)
    single = unbatched(model, tokenizer, prompts, stops.token_ids)
    batched = generate_batched(model, tokenizer, prompts, generate_kwargs(gen, tokenizer, stops), 3, stops)
    assert batched == [text_before(tokenizer, ids, stops.token_ids) for ids in single] and all(batched)
    early = Stops(stops.token_ids + (single[-1][4],), ())
    batched = generate_batched(model, tokenizer, prompts, generate_kwargs(gen, tokenizer, early), 3, early)
    assert batched == [text_before(tokenizer, ids, early.token_ids) for ids in single]
    assert len(batched[-1]) < len(text_before(tokenizer, single[-1], stops.token_ids))


def test_llamafactory_predict_config(tiny_cfg, alpaca_dir, home, tmp_path, monkeypatch):
    from tuneforge.model import packed_linear

    packed = []
    pack = packed_linear.pack_for_generation
    monkeypatch.setattr(packed_linear, "pack_for_generation", lambda model: packed.append(pack(model)) or packed[-1])
    cfg = tiny_cfg(for_training=True, stage="sft", do_train=False, do_predict=True, predict_with_generate=True,
                   eval_dataset="tiny_alpaca", dataset_dir=str(alpaca_dir), output_dir=str(tmp_path / "out"),
                   per_device_eval_batch_size=2, do_sample=False, max_new_tokens=8)
    result = evaluate(cfg)
    lines = [json.loads(x) for x in (tmp_path / "out" / "generated_predictions.jsonl").read_text().splitlines()]
    assert [x["label"] for x in lines] == [r["output"] for r in ALPACA_ROWS]
    assert lines[1]["prompt"].endswith("Add the numbers.\n2 and 3<|im_end|>\n<|im_start|>assistant\n")
    assert all(set(x) == {"prompt", "predict", "label"} for x in lines)
    saved = json.loads((tmp_path / "out" / "predict_results.json").read_text())
    expected = metrics.similarity([x["predict"] for x in lines], [x["label"] for x in lines])
    for name, value in expected.items():
        assert abs(saved[f"predict_{name}"] - value) < 1e-4
    assert saved["predict_samples"] == 3 and saved["predict_runtime"] > 0 and "predict_samples_per_second" in saved
    assert result["kind"] == "predict" and result["summary"][0].startswith("predict_bleu-4 ")
    assert packed == [7 * 2 + 1]  # the answers came from the model packed for generation: 2 layers and the head


def test_a_file_that_only_sets_do_predict_or_do_eval_does_not_train():
    from tuneforge.config.loader import build

    assert build({"do_predict": True}).train.do_train is False  # LlamaFactory's do_train defaults to false
    assert build({"do_eval": True}).train.do_train is False
    assert build({"do_eval": True, "do_train": True}).train.do_train is True
    assert build({}).train.do_train is True  # a training file need not say so


def test_do_predict_beside_do_train_predicts_with_the_trained_adapter(tiny_cfg, alpaca_dir, home, tmp_path, capsys):
    from tuneforge.cli import main

    out = tmp_path / "out"
    keys = dict(model_name_or_path=str(tiny_cfg().model.model_name_or_path), stage="sft", do_train=True,
                do_predict=True, predict_with_generate=True, dataset="tiny_alpaca", eval_dataset="tiny_alpaca",
                dataset_dir=str(alpaca_dir), output_dir=str(out), max_steps=1, save_strategy="no",
                per_device_train_batch_size=2, do_sample=False, max_new_tokens=4, disable_tqdm=True)
    config = tmp_path / "run.yaml"
    config.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in keys.items()))
    assert main(["train", str(config)]) == 0
    assert (out / "adapter_config.json").is_file()  # trained ...
    lines = [json.loads(x) for x in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert [x["label"] for x in lines] == [r["output"] for r in ALPACA_ROWS]  # ... then predicted
    assert "predict_bleu-4" in capsys.readouterr().out
