"""A stage rm output (full and lora) as a reward: its scores equal the value head computed by hand."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tuneforge.rewards import build_rewards
from tuneforge.rewards.model import RewardModel

TEXTS = ["user: 6 x 7?\nassistant: 42", "user: hi\nassistant: hello there, how can I help you today?", "a b"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run fastest on one thread
    yield
    torch.set_num_threads(before)


def random_head(model: torch.nn.Module):
    from tuneforge.model.value_head import ValueHeadModel

    scorer = ValueHeadModel(model)
    torch.nn.init.normal_(scorer.v_head.weight)
    with torch.no_grad():
        scorer.v_head.bias.fill_(0.25)  # a saved bias is read back too
    return scorer


@pytest.fixture(scope="module")
def full_rm(tiny_model_dir, tokenizer, tmp_path_factory):
    torch.manual_seed(1)
    scorer = random_head(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    out = tmp_path_factory.mktemp("full-rm")
    scorer.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, scorer.eval()


@pytest.fixture(scope="module")
def lora_rm(tiny_model_dir, tmp_path_factory):
    torch.manual_seed(2)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    scorer = random_head(get_peft_model(base, config))
    out = tmp_path_factory.mktemp("lora-rm")
    scorer.save_pretrained(out)
    return out, scorer.eval()


def by_hand(scorer, tokenizer, texts):
    """Each text alone, no padding: the head on the decoder's last hidden state."""
    return by_hand_ids(scorer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])


def by_hand_ids(scorer, rows):
    values = []
    with torch.no_grad():
        for ids in rows:
            hidden = scorer.model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            values.append(float(scorer.v_head(hidden)))
    return torch.tensor(values)


def scores_of(rewards, texts):
    n = len(texts)
    return rewards([""] * n, texts, [{}] * n, [[1]] * n).per_reward[:, 0]


def test_a_full_reward_model_scores_like_its_value_head(full_rm, tiny_model_dir, tokenizer, rl_cfg):
    folder, scorer = full_rm
    cfg = rl_cfg(model=str(tiny_model_dir), reward_model=str(folder), reward_model_type="full")
    rewards = build_rewards(cfg, tokenizer, device="cpu")
    assert rewards.names == ["reward_model"]
    reward_model = rewards.functions[0]
    assert not reward_model.model.training
    assert not any(p.requires_grad for p in reward_model.model.parameters())
    reward_model.batch_size = 2  # two batches, the first padded
    expected = by_hand(scorer, tokenizer, TEXTS)
    torch.testing.assert_close(scores_of(rewards, TEXTS), expected, atol=1e-5, rtol=1e-5)
    # the reward model reads `texts` when given, not prompt + completion
    got = rewards(["x"] * 3, ["y"] * 3, [{}] * 3, [[1]] * 3, texts=TEXTS).per_reward[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_long_text_keeps_its_end(full_rm, tokenizer):
    _, scorer = full_rm
    ids = tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    assert len(ids) > 5
    short = RewardModel(scorer, tokenizer, max_length=5)
    expected = by_hand_ids(scorer, [ids[-5:]])
    torch.testing.assert_close(torch.tensor(short.score([TEXTS[1]])), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("given", ["base_and_adapter", "adapter_folder"])
def test_a_lora_reward_model_scores_like_its_value_head(lora_rm, tiny_model_dir, tokenizer, rl_cfg, given):
    folder, scorer = lora_rm
    if given == "base_and_adapter":
        cfg = rl_cfg(model=str(tiny_model_dir), reward_model=str(tiny_model_dir), reward_model_adapters=[str(folder)])
    else:  # the base is read from the adapter's adapter_config.json
        cfg = rl_cfg(model="unused-policy", reward_model=str(folder))
    rewards = build_rewards(cfg, tokenizer, device="cpu")
    expected = by_hand(scorer, tokenizer, TEXTS)
    torch.testing.assert_close(scores_of(rewards, TEXTS), expected, atol=1e-5, rtol=1e-5)
    assert isinstance(scorer.model, PeftModel)  # by hand: the unmerged adapter
