"""Multiple-choice scoring: the prompt LlamaFactory's evaluator builds, letter log-likelihoods equal to plain
transformers on the tiny model, accuracy per subject / category / overall, and the written results."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tuneforge.errors import ConfigError
from tuneforge.eval import evaluate
from tuneforge.eval.benchmark import Benchmark, Question, Subject, load_benchmark
from tuneforge.eval.mc import accuracy_table, build_messages, fewshot_text, letter_ids, prompt_ids, score
from tuneforge.infer.generation import chat_template


def q(text, answer, choices=("w", "x", "y", "z")):
    return Question(text, choices, answer, "here")


def test_prompt_turns_and_plain_fewshot_text():
    shot, target = q("1+1?", "B", ("1", "2", "3", "4")), q("Sky?", "A", ("blue", "red", "green", "pink"))
    messages = build_messages(target, [shot], "trivia", "en")
    assert messages == [
        {"role": "user", "content": "The following are multiple choice questions (with answers) about trivia.\n\n"
                                    "1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "Sky?\nA. blue\nB. red\nC. green\nD. pink\nAnswer:"},
    ]
    assert fewshot_text(messages) == ("The following are multiple choice questions (with answers) about trivia.\n\n"
                                      "1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:B\n\n"
                                      "Sky?\nA. blue\nB. red\nC. green\nD. pink\nAnswer:")
    zh = build_messages(target, [], "常识", "zh")
    assert zh[0]["content"].startswith("以下是关于常识的单项选择题") and zh[0]["content"].endswith("\n答案：")


def test_scores_equal_plain_transformers(tiny_model_dir, tokenizer, tiny_cfg, toy_task):
    """Batched (left padding, batch 2, mixed lengths) letter log-probs == one unpadded forward each."""
    bench = load_benchmark("toy_test", toy_task, n_shot=2)
    template = chat_template(tiny_cfg(), tokenizer)
    prompts = [prompt_ids(tokenizer, template, build_messages(x, s.shots[:k], s.name, "en"), None)
               for s in bench.subjects for k, x in enumerate(s.questions)]
    assert len({len(p) for p in prompts}) > 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    letters = [tokenizer.convert_tokens_to_ids(x) for x in "ABCD"]
    assert letter_ids(tokenizer) == letters
    got = score(model, prompts, letters, tokenizer.pad_token_id, batch_size=2)
    with torch.no_grad():
        want = torch.stack([torch.log_softmax(model(torch.tensor([p])).logits[0, -1], -1)[letters] for p in prompts])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_accuracy_per_subject_category_and_overall():
    subjects = [
        Subject("a", "Subject A", "X", [q("1", "A"), q("2", "B"), q("3", "C")]),
        Subject("b", "Subject B", "X", [q("4", "D"), q("5", "A")]),
        Subject("c", "Subject C", "Y", [q("6", "B")]),
        Subject("d", "Subject D", None, [q("7", "C"), q("8", "C")]),
    ]
    bench = Benchmark("t_test", "t", "test", None, subjects)
    table = accuracy_table(bench, {"a": ["A", "B", "D"], "b": ["D", "C"], "c": ["A"], "d": ["C", "C"]})
    assert {k: (v["correct"], v["total"]) for k, v in table["subjects"].items()} == {
        "a": (2, 3), "b": (1, 2), "c": (0, 1), "d": (2, 2)}
    assert table["subjects"]["a"]["accuracy"] == pytest.approx(2 / 3)
    assert table["categories"] == {"X": {"accuracy": 0.6, "correct": 3, "total": 5},
                                   "Y": {"accuracy": 0.0, "correct": 0, "total": 1}}
    assert (table["accuracy"], table["correct"], table["total"]) == (0.625, 5, 8)  # pooled over questions


def test_evaluate_writes_results(tiny_model_dir, tokenizer, tiny_cfg, toy_task, tmp_path, monkeypatch):
    """0-shot end to end: the predictions are the argmax of plain-transformers scores; default save_dir."""
    monkeypatch.chdir(tmp_path)
    result = evaluate(tiny_cfg(task="toy_test", task_dir=str(toy_task), n_shot=0, batch_size=2))
    assert result["kind"] == "mc" and result["output_dir"] == "eval_toy_test"
    saved = json.loads((tmp_path / "eval_toy_test" / "results.json").read_text())
    bench = load_benchmark("toy_test", toy_task, 0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    letters = [tokenizer.convert_tokens_to_ids(x) for x in "ABCD"]
    correct = 0
    for s in bench.subjects:
        want = ""
        for x in s.questions:
            ids = tokenizer.apply_chat_template(build_messages(x, [], s.name, "en"), add_generation_prompt=True,
                                                tokenize=False)
            with torch.no_grad():
                logits = model(torch.tensor([tokenizer(ids)["input_ids"]])).logits[0, -1, letters]
            want += "ABCD"[int(logits.argmax())]
        assert saved["subjects"][s.key]["predictions"] == want
        correct += sum(p == x.answer for p, x in zip(want, s.questions, strict=True))
    assert (saved["correct"], saved["total"]) == (correct, 5)
    assert math.isclose(saved["accuracy"], correct / 5)
    assert saved["categories"].keys() == {"Perception", "STEM"} and saved["n_shot"] == 0
    log = (tmp_path / "eval_toy_test" / "results.log").read_text()
    assert f"Average: {100 * correct / 5:6.2f}  ({correct}/5)" in log and "colours of things" in log
    assert result["summary"][-2] == log.splitlines()[-1]


def test_fewshot_template(tiny_cfg, toy_task, tmp_path):
    result = evaluate(tiny_cfg(task="toy_test", task_dir=str(toy_task), n_shot=1, template="fewshot",
                               save_dir=str(tmp_path / "out")))
    assert result["total"] == 5 and (tmp_path / "out" / "results.json").is_file()
    with pytest.raises(ConfigError, match="template fewshot is LlamaFactory's plain-text format"):
        evaluate(tiny_cfg(template="fewshot", eval_dataset="x", save_dir=str(tmp_path)))
