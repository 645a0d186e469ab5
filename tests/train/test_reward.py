"""The rm objective: −log σ(r_c − r_r) on the value head's scores, its metrics, padded and padding-free."""

from __future__ import annotations

import math

import pytest
import torch
from preference_helpers import PAD_ID, pairwise_batch, pairwise_sequences
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


def pairwise_rows(pairs: int, seed: int = 0):
    """A pairwise token dataset (the data pipeline's row layout) of random pairs."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(pairs):
        (c_ids, c_labels), (r_ids, r_labels) = pairwise_sequences([3], [int(torch.randint(2, 6, (1,), generator=g))],
                                                                  [4], seed=int(torch.randint(0, 10**6, (1,), generator=g)))
        rows.append({"chosen_input_ids": c_ids, "chosen_labels": c_labels, "chosen_attention_mask": [1] * len(c_ids),
                     "rejected_input_ids": r_ids, "rejected_labels": r_labels,
                     "rejected_attention_mask": [1] * len(r_ids)})
    return Dataset.from_list(rows)


def test_resume_restores_the_value_head_and_adapter_exactly(tmp_path, tiny_model_dir):
    """An rm run resumed from its step-2 checkpoint ends with the weights (adapter and value head) of the
    run that was never interrupted; the output folder holds value_head.safetensors."""
    import shutil

    from train_helpers import make_cfg, trainable_state

    from tuneforge.batch import Layout
    from tuneforge.data.collate import Collator
    from tuneforge.train import Trainer

    data, collator = pairwise_rows(8), Collator(PAD_ID, Layout(rows="pairwise", flat=True))
    keys = dict(stage="rm", finetuning_type="lora", max_steps=4, save_steps=2, save_strategy="steps",
                learning_rate=1e-2)

    def model(seed):
        torch.manual_seed(seed)
        return ValueHeadModel(load_model(tiny_model_dir, lora={}, seed=seed))

    first = model(0)
    Trainer(make_cfg(tmp_path / "a", tiny_model_dir, **keys), first, None, data, None, collator,
            objective=RewardObjective()).train()
    assert (tmp_path / "a" / "value_head.safetensors").is_file()
    assert (tmp_path / "a" / "checkpoint-2" / "value_head.safetensors").is_file()
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    second = model(1)  # other initial weights: the checkpoint must restore all of them
    Trainer(make_cfg(tmp_path / "b", tiny_model_dir, resume_from_checkpoint=True, **keys), second, None, data,
            None, collator, objective=RewardObjective()).train()
    expected, got = trainable_state(first), trainable_state(second)
    assert any(name.startswith("v_head.") for name in expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=0)
