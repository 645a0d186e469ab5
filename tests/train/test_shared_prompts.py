"""Shared-prompt preference batches: each pair's prompt runs once, and every number equals the unshared
batch's (log-probs, their gradients, value-head scores), for pairwise and feedback rows."""

from __future__ import annotations

import pytest
import torch
from preference_helpers import PAD_ID, brute_force_logps, pairwise_sequences
from train_helpers import load_model

from tuneforge.batch import Layout
from tuneforge.data.collate import Collator
from tuneforge.model import attention
from tuneforge.model.value_head import ValueHeadModel
from tuneforge.train.objectives.logps import sequence_logps

# 3 pairs: prompts of 3, 5 and 1 tokens; first answers of 4, 2, 5 and second answers of 3, 6, 1 tokens
SHAPE = ([3, 5, 1], [4, 2, 5], [3, 6, 1])
PREFIXES = {"pairwise": ("chosen_", "rejected_"), "feedback": ("", "kl_")}


def rows_of(sequences, kind: str) -> list[dict]:
    """The data pipeline's token rows for sequences in contract order (all first answers, then all second)."""
    count = len(sequences) // 2
    first, second = PREFIXES[kind]
    rows = []
    for b in range(count):
        row = {}
        for prefix, (ids, labels) in ((first, sequences[b]), (second, sequences[count + b])):
            row.update({f"{prefix}input_ids": ids, f"{prefix}labels": labels, f"{prefix}attention_mask": [1] * len(ids)})
        if kind == "feedback":
            row["kto_tag"] = b % 2
        rows.append(row)
    return rows


@pytest.fixture
def model(tiny_model_dir):
    attention.register()
    m = load_model(tiny_model_dir)
    m.set_attn_implementation(attention.PACKED_SDPA)
    return m


@pytest.fixture
def sequences():
    return pairwise_sequences(*SHAPE, seed=3)


def shared(kind: str) -> Layout:
    return Layout(rows=kind, flat=True, shared_prefix=True)


def test_the_prompt_is_in_the_row_once(sequences):
    collated = Collator(PAD_ID, shared("pairwise"))(rows_of(sequences, "pairwise"))
    batch = {**collated.model_inputs, **collated.targets}
    prompts = sum(SHAPE[0])
    assert batch["input_ids"].shape == (1, sum(len(ids) for ids, _ in sequences) - prompts)
    assert batch["shared_prefix"].tolist() == [[0, 3, 4, 3], [10, 5, 2, 6], [23, 1, 5, 1]]
    # the second answer's positions continue from its prompt
    assert batch["position_ids"][0, 7:10].tolist() == [3, 4, 5]
    assert "cu_seq_lens_q" not in batch  # the attention reads shared_prefix instead


@pytest.mark.parametrize("kind", ["pairwise", "feedback"])
@pytest.mark.parametrize("head", ["fused", "forward"])
def test_logps_and_gradients_equal_the_brute_force(tiny_model_dir, model, sequences, kind, head):
    batch = Collator(PAD_ID, shared(kind))(rows_of(sequences, kind))
    expected_model = load_model(tiny_model_dir)
    expected, counts = brute_force_logps(expected_model, sequences)
    got = sequence_logps(model, batch, head=head, chunk_tokens=3)
    assert got.counts.tolist() == counts.tolist()
    torch.testing.assert_close(got.logps, expected, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1.0, 2.0, len(sequences))  # a token credited to the wrong sequence shows
    (weights * expected).sum().backward()
    (weights * got.logps).sum().backward()
    want = {n: p.grad for n, p in expected_model.named_parameters()}
    for name, param in model.named_parameters():
        scale = float(want[name].abs().max())
        # fp32 sums in another order (the shared prompt adds both answers' gradients at once)
        torch.testing.assert_close(param.grad, want[name], rtol=0, atol=5e-5 * max(scale, 1.0))


def test_value_head_scores_equal_the_unshared_batch(model, sequences):
    torch.manual_seed(0)
    scorer = ValueHeadModel(model).eval()
    rows = rows_of(sequences, "pairwise")
    with torch.no_grad():
        one_prompt = scorer.score(Collator(PAD_ID, shared("pairwise"))(rows))
        separate = scorer.score(Collator(PAD_ID, Layout(rows="pairwise", flat=True))(rows))
    torch.testing.assert_close(one_prompt, separate, rtol=1e-5, atol=1e-5)


# ---- an RL group's answers share their prompt ------------------------------------------------------------

@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_an_rl_group_shares_its_prompt_with_the_same_numbers(tmp_path, tiny_model_dir, tokenizer, stage):
    from test_grpo import PROMPTS, ToyRewardRollouts, grpo_cfg
    from test_ppo import ppo_cfg

    from tuneforge.batch import Batch, sample_seed
    from tuneforge.train.objectives import GRPOObjective, ModelReference, PPOObjective
    from tuneforge.train.objectives.grpo import GRPOSettings
    from tuneforge.train.objectives.ppo import PPOSettings

    def packed(model):
        attention.register()
        model.set_attn_implementation(attention.PACKED_SDPA)
        return model

    runs = {}
    for share in (False, True):
        torch.manual_seed(0)  # the same fresh critic head both times
        if stage == "grpo":
            cfg = grpo_cfg(tmp_path, tiny_model_dir, num_generations=3, loss_type="grpo")
            model = packed(load_model(tiny_model_dir))
            objective = GRPOObjective(GRPOSettings.from_config(cfg), ToyRewardRollouts(cfg, tokenizer))
        else:
            cfg = ppo_cfg(tmp_path, tiny_model_dir, num_generations=3)
            model = ValueHeadModel(packed(load_model(tiny_model_dir)), critic=True)
            objective = PPOObjective(PPOSettings.from_config(cfg), ToyRewardRollouts(cfg, tokenizer),
                                     ModelReference(packed(load_model(tiny_model_dir, seed=1))))
        prompts = Batch({}, {"prompt_ids": PROMPTS[:3], "columns": [{}] * 3},
                        Layout(rows="prompt", flat=True, shared_prefix=share), num_rows=3,
                        sample_seeds=tuple(sample_seed(42, 0, i) for i in range(3)))
        with torch.no_grad():
            (batch,) = objective.prepare_step(model, [prompts])
        out = objective(model, batch)
        (out.loss_sum / objective.count(batch)).backward()
        runs[share] = (batch, float(out.loss_sum.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})
    (plain, loss, grads), (shared_batch, shared_loss, shared_grads) = runs[False], runs[True]
    assert shared_batch.model_inputs["input_ids"].numel() < plain.model_inputs["input_ids"].numel() - 2 * 9
    assert shared_batch.num_tokens == plain.num_tokens  # throughput counts every sequence's tokens
    assert shared_loss == pytest.approx(loss, rel=1e-4, abs=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-3, atol=1e-6, msg=name)
    if stage == "ppo":
        for key in ("old_logps", "old_values", "returns", "advantages"):
            torch.testing.assert_close(shared_batch.targets[key], plain.targets[key], rtol=1e-4, atol=1e-5, msg=key)
