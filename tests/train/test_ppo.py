"""PPO: the pure pieces against numbers worked out by hand, one decoder pass for log-probs and values, the
rollout's rewards and returns against a plain re-computation, and the rollout shape in the trainer (ppo_epochs x
ppo_buffer_size steps per rollout, checkpoints between rollouts with the KL coefficient, exact resume)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from test_grpo import PROMPTS, ToyRewardRollouts, collate, prompt_batch, prompts_dataset, toy_reward
from train_helpers import load_model, make_cfg

from tuneforge.batch import Batch, Layout
from tuneforge.data.collate import Collator
from tuneforge.model.value_head import CRITIC_HEAD_FILE, VALUE_HEAD_FILE, ValueHeadModel
from tuneforge.train import Trainer
from tuneforge.train.objectives import ModelReference
from tuneforge.train.objectives.policy import (
    RunningMoments,
    adaptive_kl_coef,
    clipped_value_loss,
    gae,
    kl_shaped_rewards,
    whiten,
)
from tuneforge.train.objectives.ppo import PPOObjective, PPOSettings
from tuneforge.train.objectives.token_logps import supervised_targets, token_logps, token_logps_and_values

# ---- the pure pieces ------------------------------------------------------------------------------------


def test_gae_by_hand():
    # sequence 0: rewards (0, 0, 1), values (0.5, 0.2, 0.1), gamma 1, lam 0.5
    #   A2 = 1 - 0.1 = 0.9; A1 = (0 + 0.1 - 0.2) + 0.5 * 0.9 = 0.35; A0 = (0 + 0.2 - 0.5) + 0.5 * 0.35 = -0.125
    # sequence 1: reward 2, value 0.5: A = 1.5
    rewards, values = torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([0.5, 0.2, 0.1, 0.5])
    advantages, returns = gae(rewards, values, [3, 1], gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([-0.125, 0.35, 0.9, 1.5]))
    torch.testing.assert_close(returns, torch.tensor([0.375, 0.55, 1.0, 2.0]))
    # lam 1: the discounted return less the value: A0 = 1 + 0.5 * 2 - 0 = 2
    advantages, _ = gae(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), [2], gamma=0.5, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([2.0, 1.0]))


def test_kl_shaped_rewards_by_hand():
    logps, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    rewards = kl_shaped_rewards(torch.tensor([1.0, -2.0]), logps, ref, [2, 1], kl_coef=0.1)
    # -0.1 * (0.5, -1, 0), plus each score at its sequence's last token
    torch.testing.assert_close(rewards, torch.tensor([-0.05, 1.1, -2.0]))


def test_whiten_by_hand():
    torch.testing.assert_close(whiten(torch.tensor([1.0, 2.0, 3.0]), 2.0, 4.0), torch.tensor([-0.5, 0.0, 0.5]))
    torch.testing.assert_close(whiten(torch.tensor([1.0, 2.0, 3.0]), 2.0, 4.0, shift_mean=False),
                               torch.tensor([1.5, 2.0, 2.5]))


def test_clipped_value_loss_by_hand():
    values, old, returns = torch.tensor([1.0, 0.4]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.0])
    losses, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # token 0: clipped value 0.7, (0.7 - 2)^2 = 1.69 > (1 - 2)^2; token 1: inside the range, 0.4^2
    torch.testing.assert_close(losses, torch.tensor([0.845, 0.08]))
    assert clipped.tolist() == [True, False]


@pytest.mark.parametrize("kl, expected", [(12.0, 0.2004), (3.0, 0.1996), (6.6, 0.2002)])
def test_adaptive_kl_coef_by_hand(kl, expected):
    # error clipped to +-0.2, times 100 samples / horizon 10000
    assert adaptive_kl_coef(0.2, kl, target=6.0, steps=100, horizon=10000) == pytest.approx(expected)


def test_running_moments_merge_batches_exactly():
    m = RunningMoments()
    m.update(2.0, 1.0, 2)  # scores 1, 3
    m.update(6.0, 0.0, 1)  # score 6
    assert m.mean == pytest.approx(10 / 3) and m.count == 3
    assert m.variance == pytest.approx(torch.tensor([1.0, 3.0, 6.0]).var(unbiased=False).item())
    assert m.std == pytest.approx(torch.tensor([1.0, 3.0, 6.0]).std().item())
    assert RunningMoments().std == 1.0


# ---- one pass for log-probs and values -------------------------------------------------------------------

@pytest.mark.parametrize("head", ["fused", "forward"])
def test_log_probs_and_values_come_from_one_pass(tiny_model_dir, head):
    model = ValueHeadModel(load_model(tiny_model_dir), critic=True)
    batch = fixed_batch()
    logps, values = token_logps_and_values(model, batch, head=head)
    torch.testing.assert_close(logps, token_logps(model.model, batch, head="fused"))
    keep, _ = supervised_targets(batch)
    every = model(**batch.model_inputs)  # the value head at every position
    torch.testing.assert_close(values, every[keep], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no value head"):
        token_logps_and_values(model.model, batch)


def test_a_critic_trains_its_bias_and_saves_beside_the_policy(tmp_path, tiny_model_dir):
    critic = ValueHeadModel(load_model(tiny_model_dir), critic=True)
    assert critic.v_head.bias.requires_grad and not ValueHeadModel(critic.model).v_head.bias.requires_grad
    critic.save_pretrained(tmp_path)
    assert (tmp_path / CRITIC_HEAD_FILE).is_file() and not (tmp_path / VALUE_HEAD_FILE).exists()


# ---- the rollout -----------------------------------------------------------------------------------------

def ppo_cfg(out, model_dir, **keys):
    keys = {"stage": "ppo", "max_completion_length": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "reward_funcs": ["length"], "cutoff_len": 64, **keys}
    return make_cfg(out, model_dir, **keys)


def ppo_objective(cfg, model_dir, tokenizer) -> PPOObjective:
    return PPOObjective(PPOSettings.from_config(cfg), ToyRewardRollouts(cfg, tokenizer),
                        ModelReference(load_model(model_dir, seed=1)))  # a reference that differs: KL is not 0


def prepared_batch(model, objective):
    with torch.no_grad():
        return objective.prepare_step(model, [prompt_batch([0, 1, 2])])[0]


def fixed_batch() -> Batch:
    """Two prompts with the completion 5 6 7."""
    sequences = [{"input_ids": p + [5, 6, 7], "labels": [-100] * len(p) + [5, 6, 7]} for p in PROMPTS[:2]]
    inputs, targets = Collator(0, Layout(rows="plain")).sequences(sequences)
    return Batch(inputs, targets, Layout(rows="plain"))


def test_the_rollout_rewards_and_returns_match_a_plain_computation(tmp_path, tiny_model_dir, tokenizer):
    cfg = ppo_cfg(tmp_path, tiny_model_dir, ppo_kl_coef=0.3, ppo_gamma=0.9, ppo_lam=0.8, ppo_adaptive_kl=False)
    model = ValueHeadModel(load_model(tiny_model_dir), critic=True)
    objective = ppo_objective(cfg, tiny_model_dir, tokenizer)
    batch = prepared_batch(model, objective)
    t = batch.targets
    keep, _ = supervised_targets(batch)
    owners = t["sequence_ids"][keep].tolist()
    with torch.no_grad():
        logps, values = token_logps_and_values(model, batch)
        ref = objective.reference.token_logps(model, batch)
    torch.testing.assert_close(t["old_logps"], logps)
    torch.testing.assert_close(t["old_values"], values)
    labels = t["labels"]
    completions = [labels[(t["sequence_ids"] == s) & (labels != -100)].tolist() for s in range(3)]
    expected_returns = []
    for s, completion in enumerate(completions):  # the per-token rewards and GAE, one token at a time
        idx = [i for i, o in enumerate(owners) if o == s]
        r = [-0.3 * float(logps[i] - ref[i]) for i in idx]
        r[-1] += toy_reward(completion)
        v = [float(values[i]) for i in idx] + [0.0]
        running, advantages = 0.0, []
        for k in reversed(range(len(idx))):
            running = r[k] + 0.9 * v[k + 1] - v[k] + 0.9 * 0.8 * running
            advantages.insert(0, running)
        expected_returns += [a + v[k] for k, a in enumerate(advantages)]
    torch.testing.assert_close(t["returns"], torch.tensor(expected_returns), rtol=1e-4, atol=1e-5)
    assert float(t["advantages"].mean()) == pytest.approx(0.0, abs=1e-5)  # whitened over the rollout
    assert float(t["advantages"].std()) == pytest.approx(1.0, abs=1e-3)
    assert objective.count(batch) == len(owners) and t["counts"]["kl"] == 3
    out = objective(model, batch)  # the first pass: the ratio is 1, nothing is clipped
    assert float(out.metrics["clip_ratio"]) == 0 and float(out.metrics["value_clip_ratio"]) == 0
    value_loss = 0.5 * ((values - t["returns"]) ** 2).sum()
    assert float(out.metrics["value_loss"]) == pytest.approx(float(value_loss), rel=1e-4)
    expected = -t["advantages"].sum() + 0.1 * value_loss
    assert float(out.loss_sum.detach()) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)


def test_score_norm_and_the_kl_coefficient_move_only_while_training(tmp_path, tiny_model_dir, tokenizer):
    cfg = ppo_cfg(tmp_path, tiny_model_dir, ppo_score_norm=True, ppo_target=0.001, ppo_kl_horizon=10)
    model = ValueHeadModel(load_model(tiny_model_dir), critic=True)
    objective = ppo_objective(cfg, tiny_model_dir, tokenizer)
    model.eval()
    prepared_batch(model, objective)
    assert objective.state_dict() == {"kl_coef": 0.2, "score_moments": {"mean": 0.0, "variance": 1.0, "count": 0.0}}
    model.train()
    batch = prepared_batch(model, objective)
    scores = torch.tensor([toy_reward(c) for c in completions_of(batch)])
    state = objective.state_dict()
    kl = batch.targets["metrics"]["kl"] / batch.targets["counts"]["kl"]  # the rollout's mean KL per completion
    assert abs(kl / 0.001 - 1) > 0.2  # far from the target: the coefficient moves by 20% x 3 samples / 10
    assert state["kl_coef"] == pytest.approx(0.2 * (1 + math.copysign(0.2, kl - 0.001) * 3 / 10))
    assert batch.targets["metrics"]["kl_coef"] == 0.2  # this rollout's rewards used the coefficient before it
    assert state["score_moments"]["mean"] == pytest.approx(float(scores.mean()))
    assert state["score_moments"]["count"] == 3


def completions_of(batch) -> list[list[int]]:
    labels, ids = batch.targets["labels"], batch.targets["sequence_ids"]
    return [labels[(ids == s) & (labels != -100)].tolist() for s in range(int(ids.max()) + 1)]


# ---- in the trainer ------------------------------------------------------------------------------------

def ppo_trainer(out, model_dir, tokenizer, calls=None, **keys):
    cfg = ppo_cfg(out, model_dir, per_device_train_batch_size=1, ppo_epochs=2, ppo_buffer_size=2, max_steps=8,
                  learning_rate=1e-2, ppo_target=0.01, ppo_kl_horizon=20, save_strategy="steps", save_steps=3, **keys)
    objective = ppo_objective(cfg, model_dir, tokenizer)
    if calls is not None:
        original = objective.prepare_step
        objective.prepare_step = lambda model, batches: calls.append(len(batches)) or original(model, batches)
    model = ValueHeadModel(load_model(model_dir), critic=True)
    return Trainer(cfg, model, tokenizer, prompts_dataset(), None, collate, objective=objective)


def test_a_rollout_is_stepped_ppo_epochs_times_and_resumes_exactly(tmp_path, tiny_model_dir, tokenizer):
    calls = []
    trainer = ppo_trainer(tmp_path / "a", tiny_model_dir, tokenizer, calls)
    assert trainer.total_steps == 8  # 4 prompts, a micro-batch per step: 4 groups x 2 epochs
    trainer.train()
    assert calls == [2, 2]  # two rollouts of ppo_buffer_size 2 micro-batches, each stepped 2 x 2 times
    log = [e for e in trainer.state.log_history if "loss" in e]
    assert log[0]["clip_ratio"] == 0 and log[2]["reward"] == log[0]["reward"]  # step 3: epoch 2, first group again
    assert {"reward", "kl", "kl_coef", "policy_loss", "value_loss", "value_clip_ratio", "samples"} <= set(log[0])
    # save_steps 3 falls inside the first rollout: the checkpoint is written at its end, step 4
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert (tmp_path / "a" / "checkpoint-4" / CRITIC_HEAD_FILE).is_file()
    assert log[-1]["kl_coef"] != log[0]["kl_coef"]  # the KL is far from ppo_target: the coefficient moved

    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    resumed = ppo_trainer(tmp_path / "b", tiny_model_dir, tokenizer, resume_from_checkpoint=True)
    resumed.train()
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert resumed.objective.kl_coef == trainer.objective.kl_coef
    assert math.isfinite(resumed.state.log_history[-1].get("loss", 0.0))
