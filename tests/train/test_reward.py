"""The rm objective: −log σ(r_c − r_r) on the value head's scores, its metrics, padded and padding-free."""

from __future__ import annotations

import math

import pytest
import torch
from preference_helpers import pairwise_batch, pairwise_sequences
from train_helpers import load_model

from tuneforge.model.value_head import ValueHeadModel
from tuneforge.train.objectives import Objective, RewardObjective
from tuneforge.train.objectives.losses import pairwise_reward_loss

SHAPE = ([3, 5], [4, 2], [3, 6])  # 2 pairs


def test_pairwise_reward_loss_by_hand():
    # −log σ(1.5 − 0.5) = log(1 + e^−1) = 0.313262; −log σ(−2 − 1) = log(1 + e^3) = 3.048587
    losses = pairwise_reward_loss(torch.tensor([1.5, -2.0]), torch.tensor([0.5, 1.0]))
    assert losses.tolist() == pytest.approx([math.log(1 + math.exp(-1)), math.log(1 + math.exp(3))], rel=1e-6)
    assert losses.tolist() == pytest.approx([0.313262, 3.048587], abs=1e-6)


@pytest.fixture
def reward_model(tiny_model_dir):
    torch.manual_seed(0)
    return ValueHeadModel(load_model(tiny_model_dir, lora={})).eval()


def scores_one_at_a_time(model: ValueHeadModel) -> torch.Tensor:
    """Each sequence alone: the value head on the decoder's hidden state at its last token."""
    out = []
    for ids, _ in pairwise_sequences(*SHAPE):
        hidden = model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        out.append(model.v_head(hidden)[0])
    return torch.stack(out)


def test_protocol_and_pair_count():
    objective = RewardObjective()
    assert isinstance(objective, Objective) and not objective.reports_perplexity
    assert objective.count(pairwise_batch(*SHAPE)) == 2


@pytest.mark.parametrize("padding_free", [False, True])
def test_loss_and_metrics(reward_model, padding_free):
    with torch.no_grad():
        scores = scores_one_at_a_time(reward_model)
        out = RewardObjective()(reward_model, pairwise_batch(*SHAPE, padding_free=padding_free))
    chosen, rejected = scores[:2], scores[2:]
    expected = sum(math.log(1 + math.exp(-(float(c) - float(r)))) for c, r in zip(chosen, rejected, strict=True))
    assert float(out.loss_sum) == pytest.approx(expected, rel=1e-5)
    m = {k: float(v) for k, v in out.metrics.items()}
    assert set(m) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    assert m["rewards/chosen"] == pytest.approx(float(chosen.sum()), rel=1e-5, abs=1e-6)
    assert m["rewards/rejected"] == pytest.approx(float(rejected.sum()), rel=1e-5, abs=1e-6)
    assert m["rewards/margins"] == pytest.approx(float((chosen - rejected).sum()), rel=1e-5, abs=1e-6)
    assert m["rewards/accuracies"] == float((chosen > rejected).sum())


def test_one_step_raises_the_margin(reward_model):
    reward_model.train()
    batch = pairwise_batch(*SHAPE, padding_free=True)
    objective = RewardObjective()
    optimizer = torch.optim.AdamW([p for p in reward_model.parameters() if p.requires_grad], lr=1e-2)
    before = objective(reward_model, batch)
    (before.loss_sum / objective.count(batch)).backward()
    optimizer.step()
    with torch.no_grad():
        after = objective(reward_model, batch)
    assert float(after.loss_sum) < float(before.loss_sum.detach()) - 1e-3
    assert float(after.metrics["rewards/margins"]) > float(before.metrics["rewards/margins"])
