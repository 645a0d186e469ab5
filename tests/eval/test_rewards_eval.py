"""`tuneforge eval` on a stage that samples (grpo, ppo): held-out rewards of sampled answers, scored by the run's
rewards; the same seed gives the same figures, another seed another sample of them (the run-to-run noise)."""

import json

import pytest

from tuneforge.errors import DataError
from tuneforge.eval import eval_kind, evaluate

REWARD = '''
def characters(completions, answer, **kwargs):
    return [sum(map(ord, c)) % 7 / 7 for c in completions]
'''
PROMPTS = [{"instruction": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(5)]


@pytest.fixture
def rl_cfg(tiny_cfg, tmp_path, home):
    data = tmp_path / "data"
    data.mkdir()
    (data / "sums.json").write_text(json.dumps(PROMPTS))
    (data / "dataset_info.json").write_text(json.dumps({"sums": {"file_name": "sums.json"}}))
    (tmp_path / "my_rewards.py").write_text(REWARD)

    def make(**keys):
        keys = {"reward_funcs": [f"{tmp_path / 'my_rewards.py'}:characters", "accuracy"], **keys}
        return tiny_cfg(stage="grpo", eval_dataset="sums", dataset_dir=str(data), cutoff_len=64,
                        num_generations=3, max_completion_length=6, temperature=1.0, top_p=1.0, top_k=0,
                        per_device_eval_batch_size=2, **keys)

    return make


def test_rewards_of_sampled_answers_are_measured_and_written(rl_cfg, tmp_path):
    cfg = rl_cfg(save_dir=str(tmp_path / "a"), seed=1)
    assert eval_kind(cfg) == "rewards"
    result = evaluate(cfg)
    lines = [json.loads(line) for line in (tmp_path / "a" / "generated_completions.jsonl").read_text().splitlines()]
    assert len(lines) == 15 and result["eval_completions"] == 15 and result["eval_samples"] == 5
    # the figures are the means of what was written, line for line
    assert result["eval_reward"] == pytest.approx(sum(x["reward"] for x in lines) / 15)
    characters = [x["rewards"]["characters"] for x in lines]
    assert result["eval_rewards/characters/mean"] == pytest.approx(sum(characters) / 15)
    assert all(x["rewards"]["accuracy"] in (0.0, 1.0) for x in lines)
    assert json.loads((tmp_path / "a" / "eval_results.json").read_text())["eval_reward"] == result["eval_reward"]
    assert "eval_reward" in result["summary"][0] and "characters" in result["summary"][0]

    again = evaluate(rl_cfg(save_dir=str(tmp_path / "b"), seed=1))
    assert again["eval_reward"] == result["eval_reward"]  # seeded per prompt: the same answers
    other = evaluate(rl_cfg(save_dir=str(tmp_path / "c"), seed=2))
    other_lines = (tmp_path / "c" / "generated_completions.jsonl").read_text()
    assert other_lines != (tmp_path / "a" / "generated_completions.jsonl").read_text()
    assert other["eval_completions"] == 15


def test_a_reward_column_the_data_lacks_stops_before_the_model_loads(rl_cfg, tmp_path, monkeypatch):
    import tuneforge.model.inference as inference

    monkeypatch.setattr(inference, "load_inference_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(DataError, match="answer"):
        evaluate(rl_cfg(save_dir=str(tmp_path / "x"), reward_funcs=["accuracy"], reward_answer_column="answer2"))
