"""The value head: scores at each sequence's last token, no vocabulary projection, save -> load round trip."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tuneforge.batch import Batch, Layout
from tuneforge.errors import ModelError
from tuneforge.model.value_head import VALUE_HEAD_FILE, ValueHeadModel, attach_value_head, load_value_head

SEQUENCES = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


def padded_batch(sequences=SEQUENCES) -> Batch:
    width = max(map(len, sequences))
    return Batch(
        {
            "input_ids": torch.tensor([s + [2] * (width - len(s)) for s in sequences]),
            "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]),
        },
        {
            "labels": torch.full((len(sequences), width), -100),
            "sequence_ends": torch.tensor([i * width + len(s) - 1 for i, s in enumerate(sequences)]),
        },
        Layout(rows="pairwise"),
    )


def padding_free_batch(sequences=SEQUENCES) -> Batch:
    flat = [t for s in sequences for t in s]
    bounds = torch.tensor([0, *torch.tensor(list(map(len, sequences))).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        {
            "input_ids": torch.tensor([flat]),
            "position_ids": torch.tensor([[p for s in sequences for p in range(len(s))]]),
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
            "max_length_q": max(map(len, sequences)), "max_length_k": max(map(len, sequences)),
        },
        {"labels": torch.full((1, len(flat)), -100), "sequence_ends": (bounds[1:] - 1).long()},
        Layout(rows="pairwise", flat=True),
    )


def load(model_dir, lora: bool = False):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return model


def brute_force_scores(wrapped: ValueHeadModel) -> torch.Tensor:
    """Each sequence alone: the last hidden state of the full model (after the final norm) · v_head."""
    scores = []
    for sequence in SEQUENCES:
        out = wrapped.model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0, -1]
        scores.append(hidden @ wrapped.v_head.weight[0] + wrapped.v_head.bias[0])
    return torch.stack(scores)


@pytest.mark.parametrize("lora", [False, True])
def test_scores_read_the_last_token_padded_and_padding_free(tiny_model_dir, lora):
    wrapped = ValueHeadModel(load(tiny_model_dir, lora)).eval()
    with torch.no_grad():
        expected = brute_force_scores(wrapped)
        padded, flat = wrapped.score(padded_batch()), wrapped.score(padding_free_batch())
    assert padded.shape == (3,) and padded.dtype == torch.float32
    torch.testing.assert_close(padded, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-5)
    assert expected.std() > 1e-3  # the three scores differ: the wrong token would be noticed


def test_no_vocabulary_projection(tiny_model_dir):
    wrapped = ValueHeadModel(load(tiny_model_dir))
    calls = []
    wrapped.model.get_output_embeddings().register_forward_hook(lambda *args: calls.append(1))
    wrapped.score(padded_batch())
    assert calls == []


def test_value_head_is_fp32_zero_mean_and_trainable(tiny_model_dir):
    wrapped = ValueHeadModel(load(tiny_model_dir, lora=True))
    names = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert "v_head.weight" in names and any("lora_" in n for n in names)
    assert "v_head.bias" not in names  # frozen: see test_training_a_reward_model_leaves_the_bias_where_it_was
    assert wrapped.v_head.weight.dtype == torch.float32 and wrapped.v_head.weight.shape == (1, 32)
    assert float(wrapped.v_head.bias.detach()) == 0.0
    weight = wrapped.v_head.weight.detach()
    assert abs(float(weight.mean())) < 0.1 and float(weight.abs().max()) < 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wrapped.score(padded_batch()).dtype == torch.float32


def test_a_fresh_critic_values_every_token_at_zero_and_learns(tiny_model_dir):
    critic = ValueHeadModel(load(tiny_model_dir, lora=True), critic=True).train()
    names = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"v_head.weight", "v_head.bias"} <= names  # values regress on returns: the bias trains
    batch = padding_free_batch()
    values = critic.score(batch)
    assert values.abs().max() == 0  # no noise in the first rollout's advantages
    ((values - 1.0) ** 2).sum().backward()
    assert float(critic.v_head.weight.grad.abs().sum()) > 0 and float(critic.v_head.bias.grad.abs()) > 0


def test_forwards_the_model_attributes(tiny_model_dir):
    inner = load(tiny_model_dir, lora=True)
    wrapped = ValueHeadModel(inner)
    assert wrapped.config is inner.config
    assert wrapped.peft_config is inner.peft_config and wrapped.active_adapter == "default"
    assert wrapped.get_decoder() is inner.get_decoder()
    wrapped.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert inner.get_base_model().is_activation_checkpointing
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute  # noqa: B018


def test_gradients_reach_the_value_head_and_the_adapter(tiny_model_dir):
    wrapped = ValueHeadModel(load(tiny_model_dir, lora=True)).train()
    scores = wrapped.score(padding_free_batch())
    (scores[0] - scores[1]).backward()
    grads = {n: p.grad for n, p in wrapped.named_parameters() if p.requires_grad}
    assert float(grads["v_head.weight"].abs().sum()) > 0
    # LoRA B starts at zero, so the first gradient reaches B (A's is zero until B moves)
    lora_b = [g for n, g in grads.items() if "lora_B" in n]
    assert lora_b and all(g is not None for g in lora_b) and sum(float(g.abs().sum()) for g in lora_b) > 0


@pytest.mark.parametrize("make_batch", [padded_batch, padding_free_batch])
def test_training_a_reward_model_leaves_the_bias_where_it_was(tiny_model_dir, make_batch):
    """The pairwise loss reads only r_chosen - r_rejected, so the bias's gradient is rounding noise (measured
    -1.5e-8 .. 6e-8 here), which AdamW turned into steps of ~lr: the bias ended at +-0.006 .. 0.015 after 3 steps
    at lr 1e-2, with a sign that depended on the batch layout (padded or padding-free). Frozen, it stays put."""
    from tuneforge.train.objectives import RewardObjective

    wrapped = ValueHeadModel(load(tiny_model_dir, lora=True)).train()
    assert not wrapped.v_head.bias.requires_grad and wrapped.v_head.weight.requires_grad
    weight = wrapped.v_head.weight.detach().clone()
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    batch = make_batch([[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20, 21, 22]])  # 2 pairs
    for _ in range(3):
        RewardObjective()(wrapped, batch).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert float(wrapped.v_head.bias.detach()) == 0.0
    assert not torch.equal(wrapped.v_head.weight.detach(), weight)  # the head itself did train


@pytest.mark.parametrize("lora", [False, True])
def test_save_load_round_trip_gives_the_same_scores(tiny_model_dir, tmp_path, lora):
    wrapped = ValueHeadModel(load(tiny_model_dir, lora))
    with torch.no_grad():  # move away from the initial weights so a reload of the base would be noticed
        wrapped.v_head.bias.fill_(0.25)
        for name, param in wrapped.model.named_parameters():
            if "lora_B" in name or (not lora and name.endswith("norm.weight")):
                param.add_(torch.randn_like(param) * 0.3)
        expected = wrapped.eval().score(padded_batch())
    wrapped.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_FILE).is_file()
    assert set(load_value_head(tmp_path)) == {"v_head.weight", "v_head.bias"}
    if lora:
        from peft import PeftModel

        assert (tmp_path / "adapter_model.safetensors").is_file()
        inner = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    else:
        assert (tmp_path / "model.safetensors").is_file()
        inner = AutoModelForCausalLM.from_pretrained(tmp_path)
    reloaded = attach_value_head(inner, tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.score(padded_batch()), expected, rtol=1e-6, atol=1e-6)


def test_loading_a_folder_without_a_value_head_names_it(tmp_path):
    with pytest.raises(ModelError, match=VALUE_HEAD_FILE):
        load_value_head(tmp_path)


def test_a_head_of_another_size_is_refused(tiny_model_dir):
    with pytest.raises(ModelError, match="hidden_size 32"):
        ValueHeadModel(load(tiny_model_dir), {"v_head.weight": torch.zeros(1, 64), "v_head.bias": torch.zeros(1)})
