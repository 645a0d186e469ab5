"""DPO / hinge / IPO / ORPO / SimPO: the loss functions against hand arithmetic, the objective on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from preference_helpers import (
    brute_force_logps,
    collate_sequences,
    pairwise_batch,
    pairwise_sequences,
    with_targets,
)
from train_helpers import load_model

from tuneforge.config import RunConfig
from tuneforge.errors import ConfigError
from tuneforge.train.objectives import (
    AdapterReference,
    ModelReference,
    Objective,
    PreferenceObjective,
    build_objective,
    lm_objective,
    reference_logps,
)
from tuneforge.train.objectives.logps import sequence_logps
from tuneforge.train.objectives.losses import (
    dpo_hinge_loss,
    dpo_sigmoid_loss,
    ipo_loss,
    log1mexp,
    orpo_loss,
    simpo_loss,
)

SHAPE = ([3, 5], [4, 2], [3, 6])  # 2 pairs: prompt, chosen and rejected completion lengths


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def softplus(x: float) -> float:
    """-log σ(-x) = log(1 + e^x), written out for the hand-computed references."""
    return math.log(1 + math.exp(x))


# ---- the loss functions ------------------------------------------------------------------------------
def test_dpo_sigmoid_by_hand():
    # pair 0: π_c −10, π_r −12, ref −11, −11 → Δ = (1) − (−1) = 2; pair 1: Δ = (−1) − (0) = −1
    out = dpo_sigmoid_loss(t(-10, -6), t(-12, -4), t(-11, -5), t(-11, -4), beta=0.1)
    # −log σ(0.1·2) = log(1 + e^−0.2) = 0.59814; −log σ(−0.1) = log(1 + e^0.1) = 0.74440
    assert out.losses.tolist() == pytest.approx([softplus(-0.2), softplus(0.1)], rel=1e-6)
    assert out.losses.tolist() == pytest.approx([0.598139, 0.744397], abs=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx([0.1, -0.1], abs=1e-6)  # 0.1·(−10 + 11), 0.1·(−6 + 5)
    assert out.rejected_rewards.tolist() == pytest.approx([-0.1, 0.0], abs=1e-6)


def test_dpo_label_smoothing_by_hand():
    out = dpo_sigmoid_loss(t(-10), t(-12), t(-11), t(-11), beta=0.1, label_smoothing=0.1)
    # −0.9·log σ(0.2) − 0.1·log σ(−0.2) = 0.9·log(1 + e^−0.2) + 0.1·log(1 + e^0.2)
    assert float(out.losses[0]) == pytest.approx(0.9 * softplus(-0.2) + 0.1 * softplus(0.2), rel=1e-6)


def test_hinge_by_hand():
    # Δ = 2 → relu(1 − 0.2) = 0.8; Δ = 20 → relu(1 − 2) = 0
    out = dpo_hinge_loss(t(-10, -1), t(-12, -21), t(-11, -1), t(-11, -1), beta=0.1)
    assert out.losses.tolist() == pytest.approx([0.8, 0.0], abs=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx([0.1, 0.0], abs=1e-6)


def test_ipo_by_hand():
    # averages: Δ = (−1.0 − −1.5) − (−2.0 − −1.0) = 0.5 + 1.0 = 1.5; β = 0.1 → (1.5 − 1/(2·0.1))² = (−3.5)² = 12.25
    out = ipo_loss(t(-1.0), t(-2.0), t(-1.5), t(-1.0), beta=0.1)
    assert float(out.losses[0]) == pytest.approx(12.25, rel=1e-6)
    assert float(out.chosen_rewards[0]) == pytest.approx(0.05, abs=1e-6)  # 0.1·0.5
    assert float(out.rejected_rewards[0]) == pytest.approx(-0.1, abs=1e-6)  # 0.1·(−1.0)


def test_orpo_by_hand():
    # p_c = 0.5: log-odds log(0.5/0.5) = 0; p_r = 0.2: log-odds log(0.2/0.8) = −log 4
    # loss = −log 0.5 − 0.1·log σ(log 4) = log 2 − 0.1·log(4/5) = 0.693147 + 0.022314 = 0.715461
    out = orpo_loss(t(math.log(0.5)), t(math.log(0.2)), beta=0.1)
    assert float(out.losses[0]) == pytest.approx(math.log(2) - 0.1 * math.log(0.8), rel=1e-6)
    assert float(out.losses[0]) == pytest.approx(0.715461, abs=1e-6)
    assert float(out.chosen_rewards[0]) == pytest.approx(0.1 * math.log(0.5), rel=1e-6)


def test_orpo_is_finite_for_a_certain_completion():
    out = orpo_loss(t(0.0), t(-1e-8), beta=0.1)
    assert torch.isfinite(out.losses).all()


def test_log1mexp_near_zero_and_far_below():
    x = torch.tensor([-1e-6, -0.5, -1.0, -30.0])
    expected = torch.log(-torch.expm1(x.double()))  # float64 reference
    torch.testing.assert_close(log1mexp(x).double(), expected, rtol=1e-6, atol=1e-12)


def test_simpo_by_hand():
    # −log σ(2·(−1 − −2) − 0.5) = log(1 + e^−1.5) = 0.201413
    out = simpo_loss(t(-1.0), t(-2.0), beta=2.0, gamma=0.5)
    assert float(out.losses[0]) == pytest.approx(softplus(-1.5), rel=1e-6)
    assert float(out.losses[0]) == pytest.approx(0.201413, abs=1e-6)
    assert out.chosen_rewards.tolist() == [-2.0] and out.rejected_rewards.tolist() == [-4.0]


# ---- the objective on a tiny model ---------------------------------------------------------------------
@pytest.fixture
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def policy_and_ref(model, shifts=(0.5, -1.0, -0.25, 2.0)):
    """The brute-force policy log-probs of the SHAPE pairs and reference log-probs = policy − shifts, so
    the log-ratios are the shifts: chosen 0.5, −1.0; rejected −0.25, 2.0."""
    with torch.no_grad():
        logps, counts = brute_force_logps(model, pairwise_sequences(*SHAPE))
    return logps, counts, logps - t(*shifts)


def test_objective_protocol_and_pair_count():
    objective = PreferenceObjective()
    assert isinstance(objective, Objective) and not objective.reports_perplexity
    assert objective.count(pairwise_batch(*SHAPE)) == 2  # S = 4 sequences → 2 pairs


@pytest.mark.parametrize("padding_free", [False, True])
def test_sigmoid_objective_loss_and_metrics(model, padding_free):
    logps, _, ref = policy_and_ref(model)
    batch = with_targets(pairwise_batch(*SHAPE, padding_free=padding_free), ref_logps=ref)
    out = PreferenceObjective(pref_beta=0.1)(model, batch)
    # Δ_0 = 0.5 − (−0.25) = 0.75, Δ_1 = −1 − 2 = −3: loss = log(1 + e^−0.075) + log(1 + e^0.3)
    assert float(out.loss_sum.detach()) == pytest.approx(softplus(-0.075) + softplus(0.3), rel=1e-5)
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["rewards/chosen"] == pytest.approx(0.05 - 0.1, abs=1e-5)  # 0.1·0.5 + 0.1·(−1)
    assert m["rewards/rejected"] == pytest.approx(-0.025 + 0.2, abs=1e-5)
    assert m["rewards/margins"] == pytest.approx(0.075 - 0.3, abs=1e-5)
    assert m["rewards/accuracies"] == 1.0  # pair 0 ranks chosen higher, pair 1 does not
    assert m["logps/chosen"] == pytest.approx(float(logps[:2].sum()), rel=1e-5)
    assert m["logps/rejected"] == pytest.approx(float(logps[2:].sum()), rel=1e-5)


def test_ftx_adds_the_chosen_mean_nll(model):
    logps, counts, ref = policy_and_ref(model)
    batch = with_targets(pairwise_batch(*SHAPE), ref_logps=ref)
    plain = float(PreferenceObjective()(model, batch).loss_sum.detach())
    mixed = float(PreferenceObjective(pref_ftx=0.5)(model, batch).loss_sum.detach())
    nll_chosen = -(logps[:2] / counts[:2]).sum()  # chosen completions of 4 and 2 tokens
    assert mixed - plain == pytest.approx(0.5 * float(nll_chosen), rel=1e-5)


def test_ipo_objective_uses_per_token_averages(model):
    logps, counts, ref = policy_and_ref(model)
    batch = with_targets(pairwise_batch(*SHAPE), ref_logps=ref)
    out = PreferenceObjective(pref_loss="ipo", pref_beta=0.5)(model, batch)
    # log-ratios / counts: chosen 0.5/4, −1/2; rejected −0.25/3, 2/6; (Δ − 1/(2·0.5))² = (Δ − 1)²
    deltas = [0.5 / 4 + 0.25 / 3, -1 / 2 - 2 / 6]
    assert float(out.loss_sum.detach()) == pytest.approx(sum((d - 1) ** 2 for d in deltas), rel=1e-5)


@pytest.mark.parametrize("pref_loss", ["orpo", "simpo"])
def test_reference_free_losses_never_call_the_reference(model, pref_loss):
    class Forbidden:
        def logps(self, policy_model, batch):
            raise AssertionError("the reference must not run")

    logps, counts, _ = policy_and_ref(model)
    averages = logps / counts
    out = PreferenceObjective(pref_loss=pref_loss, pref_beta=0.2, reference=Forbidden())(model, pairwise_batch(*SHAPE))
    if pref_loss == "orpo":
        expected = orpo_loss(averages[:2], averages[2:], 0.2).losses.sum()
    else:
        expected = simpo_loss(averages[:2], averages[2:], 0.2, 0.5).losses.sum()
    assert float(out.loss_sum.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert float(out.metrics["rewards/chosen"]) == pytest.approx(0.2 * float(averages[:2].sum()), rel=1e-5)


def test_precomputed_ref_logps_equal_the_reference_on_the_fly(tiny_model_dir):
    policy = load_model(tiny_model_dir, lora={})
    with torch.no_grad():  # move the policy away from its base so the reference matters
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    batch = pairwise_batch(*SHAPE, padding_free=True)
    reference = AdapterReference()
    precomputed = reference_logps(reference, policy, batch)
    on_the_fly = PreferenceObjective(reference=reference)(policy, batch).loss_sum.detach()
    from_batch = PreferenceObjective(reference=None)(policy, with_targets(batch, ref_logps=precomputed)).loss_sum.detach()
    assert float(on_the_fly) == pytest.approx(float(from_batch), abs=1e-6)
    assert float(on_the_fly) != pytest.approx(2 * math.log(2), abs=1e-3)  # policy ≠ reference


def test_adapter_reference_is_the_base_model_and_restores_train_mode(tiny_model_dir):
    base = load_model(tiny_model_dir)
    policy = load_model(tiny_model_dir, lora={"lora_dropout": 0.5})
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    batch = pairwise_batch(*SHAPE)
    policy.train()
    seen_training = []  # the mode of a decoder layer while the reference runs (dropout must be off)
    layer = policy.get_decoder().layers[0]
    hook = layer.register_forward_pre_hook(lambda module, args: seen_training.append(module.training))
    got = AdapterReference().logps(policy, batch)
    hook.remove()
    assert seen_training == [False]
    assert policy.training and all(m.training for m in policy.modules())
    assert not got.requires_grad
    with torch.no_grad():
        expected = sequence_logps(base, batch).logps
        adapted = sequence_logps(policy.eval(), batch).logps
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (adapted - expected).abs().max() > 1e-3  # the adapters were really switched off


def test_adapter_reference_needs_adapters(model):
    with pytest.raises(ConfigError, match="ref_model"):
        AdapterReference().logps(model, pairwise_batch(*SHAPE))


def test_model_reference_is_frozen_and_in_eval_mode(tiny_model_dir, model):
    ref_model = load_model(tiny_model_dir, seed=1)
    with torch.no_grad():
        ref_model.model.embed_tokens.weight.mul_(1.5)  # a different model from the policy
    ref_model.train()
    reference = ModelReference(ref_model)
    batch = pairwise_batch(*SHAPE)
    got = reference.logps(model, batch)
    assert not ref_model.training and not any(p.requires_grad for p in ref_model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(got, sequence_logps(ref_model, batch).logps, rtol=1e-6, atol=1e-6)


def test_missing_reference_is_a_config_error(model):
    with pytest.raises(ConfigError, match="ref_logps"):
        PreferenceObjective()(model, pairwise_batch(*SHAPE))


def test_invalid_settings_are_config_errors():
    with pytest.raises(ConfigError, match="dpo_label_smoothing"):
        PreferenceObjective(pref_loss="hinge", dpo_label_smoothing=0.1)
    with pytest.raises(ConfigError, match="pref_loss"):
        PreferenceObjective(pref_loss="kto_pair")
    with pytest.raises(ConfigError, match="pref_beta"):
        PreferenceObjective(pref_beta=0.0)


def test_one_dpo_step_lowers_the_loss_and_raises_the_margin(tiny_model_dir):
    torch.manual_seed(0)
    policy = load_model(tiny_model_dir, lora={})
    objective = PreferenceObjective(pref_beta=0.1, reference=AdapterReference())
    batch = collate_sequences(pairwise_sequences([4, 3, 5], [5, 4, 3], [3, 6, 4], seed=7), padding_free=True)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    before = objective(policy, batch)
    # LoRA starts as the identity, so the policy is its reference: every pair's loss is log 2, margin 0
    assert float(before.loss_sum.detach()) == pytest.approx(3 * math.log(2), rel=1e-6)
    (before.loss_sum / objective.count(batch)).backward()
    optimizer.step()
    with torch.no_grad():
        after = objective(policy, batch)
    assert float(after.loss_sum) < float(before.loss_sum.detach()) - 1e-3
    assert float(after.metrics["rewards/margins"]) > float(before.metrics["rewards/margins"]) + 1e-3


def test_build_objective_reads_the_keys():
    cfg = RunConfig()
    sft = build_objective(cfg)
    assert sft.name == "lm" and sft.loss == lm_objective.loss  # plain cross-entropy
    cfg.method.stage = "dpo"
    objective = build_objective(cfg)
    assert isinstance(objective, PreferenceObjective)
    assert (objective.pref_loss, objective.pref_beta, objective.simpo_gamma) == ("sigmoid", 0.1, 0.5)
    cfg.method.pref_loss, cfg.method.pref_beta, cfg.method.pref_ftx = "simpo", 2.0, 0.3
    reference = AdapterReference()
    objective = build_objective(cfg, reference)
    assert (objective.pref_loss, objective.pref_beta, objective.pref_ftx) == ("simpo", 2.0, 0.3)
    assert objective.reference is None  # simpo has no reference
    cfg.method.stage = "rm"
    assert build_objective(cfg).name == "rm"
    cfg.method.stage = "kto"
    assert build_objective(cfg, reference).reference is reference
    cfg.method.stage = "ppo"
    with pytest.raises(ValueError, match="ppo needs a reference"):
        build_objective(cfg)


def test_ref_model_quantization_bit_loads_the_reference_in_4_bit(smol_dir):
    import bitsandbytes as bnb

    from tuneforge.config import from_dict
    from tuneforge.model import load_reference

    # the built-in model: bitsandbytes' CPU 4-bit inference kernel needs real layer widths (the tiny model's 32 fail)
    keys = {"model_name_or_path": str(smol_dir), "stage": "dpo", "ref_model": str(smol_dir),
            "bf16": False, "dataset": "d"}
    quantized = load_reference(from_dict({**keys, "ref_model_quantization_bit": 4}, for_training=False), device="cpu")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in quantized.modules())
    plain = load_reference(from_dict(keys, for_training=False), device="cpu")
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in plain.modules())
    batch = pairwise_batch(*SHAPE)
    with torch.no_grad():
        q, p = sequence_logps(quantized, batch).logps, sequence_logps(plain, batch).logps
    # the same model, rounded to 4 bits: close log-probs, not equal ones
    assert not torch.equal(q, p)
    torch.testing.assert_close(q, p, rtol=0.15, atol=1.0)  # random tokens: log-probs near -45, within 10%
