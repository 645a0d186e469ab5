"""KTO: the loss against hand arithmetic, the objective's KL estimate, metrics and subset counts."""

from __future__ import annotations

import math

import pytest
import torch
from preference_helpers import feedback_batch
from train_helpers import load_model

from tuneforge.config import RunConfig
from tuneforge.train.objectives import KTOObjective, Objective, build_objective
from tuneforge.train.objectives import kto as kto_module
from tuneforge.train.objectives.logps import sequence_logps
from tuneforge.train.objectives.losses import kto_kl_estimate, kto_loss

KEYS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_by_hand():
    # r = log π − log ref = (−5 − −6) = 1 and (−8 − −6) = −2; z = 0.5; β = 0.1
    losses, rewards = kto_loss(
        torch.tensor([-5.0, -8.0]), torch.tensor([-6.0, -6.0]), torch.tensor(0.5), torch.tensor([1, 0]),
        beta=0.1, chosen_weight=2.0, rejected_weight=3.0,
    )
    # desirable: 2·(1 − σ(0.1·(1 − 0.5))) = 2·(1 − σ(0.05)); undesirable: 3·(1 − σ(0.1·(0.5 − −2))) = 3·(1 − σ(0.25))
    assert losses.tolist() == pytest.approx([2 * (1 - sigmoid(0.05)), 3 * (1 - sigmoid(0.25))], rel=1e-6)
    assert losses.tolist() == pytest.approx([0.975005, 1.313470], abs=1e-6)
    assert rewards.tolist() == pytest.approx([0.1, -0.2], abs=1e-6)


def test_kl_estimate_is_a_clamped_mean():
    assert float(kto_kl_estimate(torch.tensor(3.0), 2)) == 1.5
    assert float(kto_kl_estimate(torch.tensor(-3.0), 2)) == 0.0  # a negative KL estimate counts as 0


# ---- the objective on a tiny model ---------------------------------------------------------------------
PROMPTS, COMPLETIONS = [3, 4, 2], [4, 2, 3]


@pytest.fixture
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def batch_with_ratios(model, tags, completion_ratios, kl_ratios, padding_free=False):
    """A feedback batch whose precomputed ref_logps = policy − ratios: the log-ratios are the given ones."""
    batch = feedback_batch(PROMPTS, COMPLETIONS, tags, padding_free=padding_free)
    with torch.no_grad():
        policy = sequence_logps(model, batch).logps
    batch.targets["ref_logps"] = policy - torch.tensor([*completion_ratios, *kl_ratios])
    return batch, policy


def test_protocol_and_sample_count(model):
    objective = KTOObjective()
    assert isinstance(objective, Objective) and not objective.reports_perplexity
    assert objective.count(feedback_batch(PROMPTS, COMPLETIONS, [1, 0, 1])) == 3  # B samples, S = 6


@pytest.mark.parametrize("padding_free", [False, True])
def test_loss_metrics_and_counts(model, padding_free):
    # r = 1, −2, 0.5 (tags 1, 0, 1); KL log-ratios 0.5, 1.5, 1.0 → z = 1.0
    batch, policy = batch_with_ratios(model, [1, 0, 1], [1.0, -2.0, 0.5], [0.5, 1.5, 1.0], padding_free)
    out = KTOObjective(pref_beta=0.1, kto_chosen_weight=1.0, kto_rejected_weight=2.0)(model, batch)
    # 1 − σ(0.1·(1 − 1)) = 0.5; 2·(1 − σ(0.1·(1 − −2))) = 2·(1 − σ(0.3)); 1 − σ(0.1·(0.5 − 1)) = 1 − σ(−0.05)
    expected = 0.5 + 2 * (1 - sigmoid(0.3)) + (1 - sigmoid(-0.05))
    assert float(out.loss_sum.detach()) == pytest.approx(expected, rel=1e-5)
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["kl"] == pytest.approx(3 * 1.0, rel=1e-5)  # z × B: the trainer's mean over samples is z
    assert m["rewards/chosen"] == pytest.approx(0.1 + 0.05, abs=1e-5)
    assert m["rewards/rejected"] == pytest.approx(-0.2, abs=1e-5)
    assert m["logps/chosen"] == pytest.approx(float(policy[0] + policy[2]), rel=1e-5)
    assert m["logps/rejected"] == pytest.approx(float(policy[1]), rel=1e-5)
    assert {k: float(v) for k, v in out.counts.items()} == {
        "rewards/chosen": 2.0, "logps/chosen": 2.0, "rewards/rejected": 1.0, "logps/rejected": 1.0
    }


def test_only_desirable_samples_still_emit_every_key(model):
    batch, _ = batch_with_ratios(model, [1, 1, 1], [0.0, 0.0, 0.0], [-1.0, -2.0, 0.0])
    out = KTOObjective()(model, batch)
    assert set(out.metrics) == {*KEYS, "kl"} and set(out.counts) == set(KEYS)
    assert float(out.counts["rewards/rejected"]) == float(out.counts["logps/rejected"]) == 0.0
    assert float(out.metrics["rewards/rejected"]) == float(out.metrics["logps/rejected"]) == 0.0
    assert float(out.counts["rewards/chosen"]) == 3.0
    assert float(out.metrics["kl"]) == 0.0  # mean KL log-ratio −1 is clamped to 0
    # r = 0 and z = 0: every loss is 1 − σ(0) = 0.5
    assert float(out.loss_sum.detach()) == pytest.approx(1.5, rel=1e-5)


def test_kl_is_summed_over_ranks_while_training_only(model, monkeypatch):
    """Another rank's KL pairs (log-ratio sum 6.0 over 3 pairs) enter z in training, not in evaluation."""
    monkeypatch.setattr(kto_module, "summed_over_ranks", lambda values: values + torch.tensor([6.0, 3.0]))
    batch, _ = batch_with_ratios(model, [1, 0, 1], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    objective = KTOObjective()
    model.train()
    assert float(objective(model, batch).metrics["kl"]) == pytest.approx(3 * (6.0 / 6), rel=1e-5)
    model.eval()
    assert float(objective(model, batch).metrics["kl"]) == 0.0


def test_kl_is_detached(tiny_model_dir):
    """The gradient is that of the completions' losses with z a constant: none flows through the KL pairs."""
    tags = torch.tensor([1, 0, 1])
    grads = []
    for constant_z in (False, True):
        model = load_model(tiny_model_dir)
        batch, _ = batch_with_ratios(model, tags.tolist(), [0.5, -0.5, 0.0], [2.0, 2.0, 2.0])
        if constant_z:  # z = 2.0, the mean KL log-ratio, as a plain number
            policy = sequence_logps(model, batch).logps
            losses, _ = kto_loss(policy[:3], batch.targets["ref_logps"][:3], torch.tensor(2.0), tags, beta=0.1)
            loss = losses.sum()
        else:
            out = KTOObjective(pref_beta=0.1)(model, batch)
            assert float(out.metrics["kl"]) == pytest.approx(3 * 2.0, rel=1e-5)
            loss = out.loss_sum
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_build_objective_for_kto_reads_the_keys():
    cfg = RunConfig()
    cfg.method.stage = "kto"
    cfg.method.pref_beta, cfg.method.kto_chosen_weight, cfg.method.kto_rejected_weight = 0.3, 1.5, 0.5
    objective = build_objective(cfg)
    assert isinstance(objective, KTOObjective)
    assert (objective.pref_beta, objective.kto_chosen_weight, objective.kto_rejected_weight) == (0.3, 1.5, 0.5)
