"""GRPO: the pure pieces against numbers worked out by hand, seeded sampling, the gradient of the simplest case
(REINFORCE with group-normalized advantages), exact accumulation and num_iterations in the trainer."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from train_helpers import load_model, make_cfg, trainable_state

from tuneforge.batch import Batch, Layout, sample_seed
from tuneforge.infer.generation import completion_generator
from tuneforge.model.packed_linear import ENV, PackedLinear
from tuneforge.rollout import Rollouts
from tuneforge.train import Trainer
from tuneforge.train.objectives.grpo import GRPOObjective, GRPOSettings
from tuneforge.train.objectives.policy import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    k3_kl,
    loss_units,
)
from tuneforge.train.objectives.token_logps import supervised_targets, token_logps

PROMPTS = [[11, 12, 13, 14], [23, 22, 21], [32, 31, 33, 34, 35], [44, 42]]


# ---- the pure pieces ------------------------------------------------------------------------------------

def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    group_std = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected std of (1, 0, 0, 1)
    expected = [0.5 / (group_std + 1e-4), -0.5 / (group_std + 1e-4)] * 2
    torch.testing.assert_close(group_advantages(rewards, 4, "group")[:4], torch.tensor(expected)[[0, 1, 1, 0]])
    assert group_advantages(rewards, 4, "group")[4:].abs().max() == 0  # a group of equal rewards learns nothing
    torch.testing.assert_close(group_advantages(rewards, 4, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    torch.testing.assert_close(group_advantages(rewards, 4, "batch", batch_std=2.0)[:2],
                               torch.tensor([0.5 / 2.0001, -0.5 / 2.0001]))
    with pytest.raises(ValueError, match="standard deviation"):
        group_advantages(rewards, 4, "batch")


def test_clipped_surrogate_by_hand():
    old = torch.zeros(4)
    logps = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))  # ratios 1.5, 1.5, 0.5, 0.5
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    losses, clipped = clipped_surrogate(logps, old, advantages, 0.2, 0.2)
    # A > 0 above 1 + eps: clipped at 1.2; A < 0 above: 1.5 A is smaller; A > 0 below: 0.5 A; A < 0 below: 0.8 A
    torch.testing.assert_close(losses, torch.tensor([-1.2, 1.5, -0.5, 0.8]))
    assert clipped.tolist() == [True, False, False, True]
    losses, _ = clipped_surrogate(logps, old, advantages, 0.2, 0.6)  # a wider upper range (DAPO's clip-higher)
    assert losses[0] == pytest.approx(-1.5)


def test_k3_kl_by_hand():
    kl = k3_kl(torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3])))
    assert kl[0] == pytest.approx(0.5 - math.log(0.5) - 1) and kl[1] == pytest.approx(0.0)


@pytest.mark.parametrize("loss_type, loss, units", [("grpo", 6 / 3 + 4, 2), ("dr_grpo", 10 / 4, 2), ("dapo", 10, 4),
                                                    ("bnpo", 10 / 4, 1)])
def test_aggregate_by_hand(loss_type, loss, units):
    tokens, owners = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 0, 1])
    assert float(aggregate(tokens, owners, 2, loss_type, max_completion_length=4)) == pytest.approx(loss)
    assert loss_units(loss_type, 2, 4) == units


def test_sample_seeds_are_stable_and_distinct():
    assert sample_seed(42, 0, 7) == sample_seed(42, 0, 7)
    assert len({sample_seed(42, e, i) for e in range(3) for i in range(100)}) == 300
    assert 0 <= sample_seed("eval", 3) < 2**63


# ---- sampling -------------------------------------------------------------------------------------------

def test_a_seeded_completion_does_not_depend_on_its_batch(tmp_path, tiny_model_dir, tokenizer):
    cfg = grpo_cfg(tmp_path, tiny_model_dir)
    generate = completion_generator(cfg, tokenizer)
    model = load_model(tiny_model_dir)
    alone = generate(model, [PROMPTS[0]], num_return_sequences=2, max_new_tokens=8, seeds=[1, 2])
    batched = generate(model, [PROMPTS[1], PROMPTS[0]], num_return_sequences=2, max_new_tokens=8, seeds=[3, 4, 1, 2])
    assert batched[2:] == alone  # the same seeds, other prompts beside it and left padding: the same completions
    again = generate(model, [PROMPTS[0]], num_return_sequences=2, max_new_tokens=8, seeds=[5, 6])
    assert again != alone  # other seeds sample otherwise (a random 49k-vocabulary model: never the same 8 tokens)
    assert alone[0] != alone[1]


def test_rollouts_sample_with_packed_copies_of_the_policy_and_the_same_completions(tmp_path, tiny_model_dir, tokenizer,
                                                                                   monkeypatch):
    cfg = grpo_cfg(tmp_path, tiny_model_dir)
    model = load_model(tiny_model_dir, lora={}).train()
    for name, param in model.named_parameters():
        if "lora_B" in name:  # a policy its adapters change
            torch.nn.init.normal_(param, std=0.05)
    rollouts, packed_layers = Rollouts(cfg, tokenizer), []
    generate = rollouts._generator()

    def spy(model, prompts, **overrides):
        packed_layers.append(sum(isinstance(m, PackedLinear) for m in model.modules()))
        return generate(model, prompts, **overrides)

    rollouts._generate = spy
    kwargs = {"num_return_sequences": 2, "max_new_tokens": 8, "seeds": [1, 2, 3, 4]}
    packed = rollouts(model, [PROMPTS[0], PROMPTS[1]], **kwargs)
    monkeypatch.setenv(ENV, "0")
    dense = rollouts(model, [PROMPTS[0], PROMPTS[1]], **kwargs)
    assert packed_layers == [7 * model.config.num_hidden_layers + 1, 0]  # LoRA merged into each packed copy
    assert packed == dense
    assert model.training and not any(isinstance(m, PackedLinear) for m in model.modules())


# ---- the objective --------------------------------------------------------------------------------------

def toy_reward(ids: list[int]) -> float:
    return sum(ids) % 7 / 7


class ToyRewardRollouts(Rollouts):
    """The real rollouts with a simple reward scored in the test (that varies between random completions)."""

    reward_names = ["toy"]

    def score(self, prompts, completions, columns, completion_ids, device):
        values = torch.tensor([[toy_reward(ids)] for ids in completion_ids], device=device)
        return values, values[:, 0]


def grpo_cfg(out, model_dir, **keys):
    keys = {"stage": "grpo", "num_generations": 4, "max_completion_length": 6, "temperature": 1.0, "top_p": 1.0,
            "top_k": 0, "reward_funcs": ["length"], "cutoff_len": 64, **keys}
    return make_cfg(out, model_dir, **keys)


def prompt_batch(indices: list[int], epoch: int = 0) -> Batch:
    return Batch({}, {"prompt_ids": [PROMPTS[i] for i in indices], "columns": [{} for _ in indices]},
                 Layout(rows="prompt"), num_rows=len(indices),
                 sample_seeds=tuple(sample_seed(42, epoch, i) for i in indices))


def test_one_iteration_without_kl_is_reinforce_with_group_normalized_advantages(tmp_path, tiny_model_dir, tokenizer):
    cfg = grpo_cfg(tmp_path, tiny_model_dir, loss_type="grpo")
    model = load_model(tiny_model_dir)
    objective = GRPOObjective(GRPOSettings.from_config(cfg), ToyRewardRollouts(cfg, tokenizer))
    with torch.no_grad():
        (batch,) = objective.prepare_step(model, [prompt_batch([0, 1])])
    out = objective(model, batch)
    (out.loss_sum / objective.count(batch)).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}

    # by hand: -(1/S) sum_s A_s * mean over s's tokens of log p(token)
    model.zero_grad()
    rewards = batch.targets["metrics"]["reward"]
    logps = token_logps(model, batch)
    keep, _ = supervised_targets(batch)
    owners = batch.targets["sequence_ids"][keep]
    S = 8
    per_sequence = torch.zeros(S).index_add(0, owners, logps) / torch.bincount(owners, minlength=S)
    completion_rewards = torch.tensor([toy_reward(ids) for ids in completions_of(batch, tokenizer)])
    assert float(completion_rewards.sum()) == pytest.approx(rewards)
    groups = completion_rewards.view(2, 4)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    assert advantages.abs().sum() > 0  # the completions differ, so there is something to learn
    (-(advantages * per_sequence).mean()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def completions_of(batch: Batch, tokenizer) -> list[list[int]]:
    """Each sequence's supervised tokens (its completion), read back from the collated batch."""
    labels, ids = batch.targets["labels"], batch.targets["sequence_ids"]
    return [labels[(ids == s) & (labels != -100)].tolist() for s in range(int(ids.max()) + 1)]


def test_prepared_batch_counts_and_logs(tmp_path, tiny_model_dir, tokenizer):
    cfg = grpo_cfg(tmp_path, tiny_model_dir, mask_truncated_completions=True)
    model = load_model(tiny_model_dir)
    objective = GRPOObjective(GRPOSettings.from_config(cfg), ToyRewardRollouts(cfg, tokenizer))
    with torch.no_grad():
        (batch,) = objective.prepare_step(model, [prompt_batch([0, 2])])
    counts = batch.targets["counts"]
    assert counts["reward"] == 8 and counts["reward_std"] == 2
    metrics = batch.targets["metrics"]
    # a random tiny model rarely says <|im_end|> within 6 tokens: the truncated completions get no loss
    truncated = metrics["completions/clipped_ratio"]
    lengths = [len(c) for c in completions_of(batch, tokenizer)]
    assert sum(1 for n in lengths if n == 0) == truncated
    assert objective.count(batch) == sum(lengths)  # dapo: the loss tokens
    assert batch.num_rows == 2 and batch.num_tokens >= 2 * (len(PROMPTS[0]) + len(PROMPTS[2]))
    means = objective.finish_metrics({"reward": 0.5, "reward/sq": 0.5, "rewards/toy/mean": 0.2,
                                      "rewards/toy/sq": 0.05}, evaluating=False)
    assert means["rewards/toy/std"] == pytest.approx(0.1) and means["reward_std_all"] == pytest.approx(0.5)
    assert "rewards/toy/sq" not in means and len(means["samples"]) == 2


# ---- in the trainer ------------------------------------------------------------------------------------

def prompts_dataset() -> Dataset:
    return Dataset.from_dict({"input_ids": PROMPTS, "columns": ["{}"] * len(PROMPTS)})


def collate(rows):
    return Batch({}, {"prompt_ids": [r["input_ids"] for r in rows], "columns": [{} for _ in rows]},
                 Layout(rows="prompt"), num_rows=len(rows), num_tokens=sum(len(r["input_ids"]) for r in rows))


def one_step(tmp_path, model_dir, tokenizer, name, **keys):
    cfg = grpo_cfg(tmp_path / name, model_dir, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                   max_grad_norm=0.0, **keys)
    model = load_model(model_dir)
    before = trainable_state(model)
    objective = GRPOObjective(GRPOSettings.from_config(cfg), ToyRewardRollouts(cfg, tokenizer))
    trainer = Trainer(cfg, model, tokenizer, prompts_dataset(), None, collate, objective=objective)
    trainer.train()
    step = {n: before[n] - p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return step, trainer.state.log_history


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_accumulation_is_exact_for_sampled_units(tmp_path, tiny_model_dir, tokenizer, loss_type):
    whole, log = one_step(tmp_path, tiny_model_dir, tokenizer, "whole", max_steps=1, per_device_train_batch_size=2,
                          loss_type=loss_type, scale_rewards="batch")
    split, split_log = one_step(tmp_path, tiny_model_dir, tokenizer, "split", max_steps=1,
                                per_device_train_batch_size=1, gradient_accumulation_steps=2, loss_type=loss_type,
                                scale_rewards="batch")
    assert split_log[0]["loss"] == pytest.approx(log[0]["loss"], rel=1e-5, abs=1e-7)
    assert split_log[0]["reward"] == pytest.approx(log[0]["reward"])
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(s.abs().max() > 0 for s in whole.values())
    assert {"reward", "reward_std", "rewards/toy/mean", "rewards/toy/std", "clip_ratio",
            "completions/mean_length", "frac_reward_zero_std", "samples"} <= set(log[0])


def test_num_iterations_steps_again_on_the_same_completions(tmp_path, tiny_model_dir, tokenizer):
    cfg = grpo_cfg(tmp_path / "it", tiny_model_dir, num_iterations=2, max_steps=4, per_device_train_batch_size=2,
                   learning_rate=1e-2)
    objective = GRPOObjective(GRPOSettings.from_config(cfg), ToyRewardRollouts(cfg, tokenizer))
    sampled = []
    original = objective.prepare_step
    objective.prepare_step = lambda model, batches: sampled.append(1) or original(model, batches)
    trainer = Trainer(cfg, load_model(tiny_model_dir), tokenizer, prompts_dataset(), None, collate, objective=objective)
    assert trainer.total_steps == 4  # max_steps wins
    trainer.train()
    assert len(sampled) == 2  # steps 1-2 on the first completions, 3-3 on the next
    log = [e for e in trainer.state.log_history if "loss" in e]
    assert log[0]["reward"] == log[1]["reward"] and log[0]["clip_ratio"] == 0  # step 2 re-uses step 1's samples
    assert trainer.state.epoch == 1  # 4 prompts, 2 per step, each batch twice: one epoch in 4 steps
