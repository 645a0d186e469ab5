"""The sft loss variants (use_dft_loss, use_eaft_loss, use_asft_loss): each a pure per-token function checked by
hand, the same through the chunked head paths, ASFT's KL against the starting model, and their config rules.
(Accumulation = one full batch for dft / eaft: tests/train/test_trainer.py; packed rows: test_objectives.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_helpers import as_batch, collate, load_model, random_dataset

from tuneforge.config import from_dict
from tuneforge.errors import ConfigError
from tuneforge.train.objectives import AdapterReference, ModelReference
from tuneforge.train.objectives.lm import LMObjective
from tuneforge.train.objectives.sft_losses import TokenLoss, asft, dft, eaft, kl_from_reference, top_k_entropy

REPO_DATA = Path(__file__).resolve().parents[2] / "data"
LOGITS = torch.tensor([[2.0, 0.0, -1.0, 1.0], [0.5, 0.5, 0.0, -2.0]])
TARGETS = torch.tensor([0, 2])


def softmax(row):
    exps = [math.exp(x) for x in row]
    return [e / sum(exps) for e in exps]


def test_dft_weights_each_tokens_cross_entropy_by_its_probability():
    by_hand = []
    for row, target in zip(LOGITS.tolist(), TARGETS.tolist(), strict=True):
        p = softmax(row)[target]
        by_hand.append(-math.log(p) * p)
    torch.testing.assert_close(dft(LOGITS, TARGETS), torch.tensor(by_hand))


def test_dft_gradient_is_the_cross_entropy_gradient_times_the_constant_probability():
    logits = LOGITS.clone().requires_grad_(True)
    dft(logits, TARGETS).sum().backward()
    p = torch.softmax(LOGITS, -1)
    expected = p.gather(-1, TARGETS[:, None]) * (p - torch.nn.functional.one_hot(TARGETS, 4))
    torch.testing.assert_close(logits.grad, expected)


def test_eaft_weights_by_the_top_20_entropy_over_3_to_the_alpha():
    # vocabulary of 4: the top 20 are all of it
    by_hand = []
    for row, target in zip(LOGITS.tolist(), TARGETS.tolist(), strict=True):
        p = softmax(row)
        entropy = -sum(q * math.log(q) for q in p)
        by_hand.append(-math.log(p[target]) * (entropy / 3.0) ** 0.5)
    torch.testing.assert_close(eaft(LOGITS, TARGETS, alpha=0.5), torch.tensor(by_hand))
    # alpha 0: plain cross-entropy
    torch.testing.assert_close(eaft(LOGITS, TARGETS, alpha=0.0), TokenLoss()(LOGITS, TARGETS))


def test_eaft_entropy_reads_only_the_20_largest_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    smallest = logits.argsort(dim=-1)[:, :30]  # outside the top 20
    moved = logits.scatter(-1, smallest, logits.gather(-1, smallest) - 5.0)
    torch.testing.assert_close(top_k_entropy(moved), top_k_entropy(logits))
    top = torch.softmax(logits.topk(20, dim=-1).values, -1)
    torch.testing.assert_close(top_k_entropy(logits), -(top * top.log()).sum(-1))


def test_asft_is_dft_plus_alpha_times_kl_of_the_reference_to_the_policy():
    ref = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    kl = []
    for row, ref_row in zip(LOGITS.tolist(), ref.tolist(), strict=True):
        p, q = softmax(row), softmax(ref_row)
        kl.append(sum(qi * (math.log(qi) - math.log(pi)) for pi, qi in zip(p, q, strict=True)))
    torch.testing.assert_close(kl_from_reference(LOGITS, ref), torch.tensor(kl))
    torch.testing.assert_close(asft(LOGITS, TARGETS, ref, alpha=0.1), dft(LOGITS, TARGETS) + 0.1 * torch.tensor(kl))
    assert float(kl_from_reference(LOGITS, LOGITS).abs().max()) < 1e-6  # no distance to itself


def test_token_loss_rules():
    assert TokenLoss().is_nll and not TokenLoss(label_smoothing=0.1).is_nll and not TokenLoss("dft").is_nll
    assert TokenLoss("asft", alpha=0.1).needs_reference and not TokenLoss("eaft", alpha=1.0).needs_reference
    with pytest.raises(ValueError, match="label smoothing applies to cross_entropy"):
        TokenLoss("dft", label_smoothing=0.1)
    with pytest.raises(ValueError, match="kind must be one of"):
        TokenLoss("focal")
    with pytest.raises(ValueError, match="needs a reference model"):
        LMObjective(loss=TokenLoss("asft", alpha=0.1))


@pytest.fixture
def batch():
    return collate([random_dataset([6, 4, 7], seed=3)[i] for i in range(3)])


def full_logits_at_targets(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits (fp32) predicting each supervised target and the targets, from the model's whole forward."""
    with torch.no_grad():
        logits = model(**batch.model_inputs).logits[:, :-1].float()
    labels = batch.targets["labels"][:, 1:]
    keep = labels != -100
    return logits[keep], labels[keep]


@pytest.mark.parametrize("kind", ["dft", "eaft"])
@pytest.mark.parametrize("head,chunk", [("fused", 2), ("forward", 3), ("auto", None)])
def test_the_objective_sums_the_token_loss_on_every_head_path(tiny_model_dir, batch, kind, head, chunk):
    model = load_model(tiny_model_dir)
    loss = TokenLoss(kind, alpha=0.7)
    logits, targets = full_logits_at_targets(model, batch)
    with torch.no_grad():
        got = LMObjective(head=head, chunk_tokens=chunk, loss=loss)(model, batch).loss_sum
    assert float(got) == pytest.approx(float(loss(logits, targets).sum()), rel=1e-5)


def nudge_lora(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)


@pytest.mark.parametrize("head,chunk", [("fused", 2), ("forward", 4)])
def test_asft_with_adapters_measures_the_kl_to_the_base_model(tiny_model_dir, batch, head, chunk):
    model = load_model(tiny_model_dir, lora={})
    reference = AdapterReference(head=head)
    objective = LMObjective(head=head, chunk_tokens=chunk, loss=TokenLoss("asft", alpha=0.3), reference=reference)
    dft_only = LMObjective(head=head, chunk_tokens=chunk, loss=TokenLoss("dft"))
    with torch.no_grad():  # a fresh adapter (lora_B = 0) is the base model: no KL
        assert float(objective(model, batch).loss_sum) == pytest.approx(float(dft_only(model, batch).loss_sum),
                                                                        rel=1e-6)
    with torch.no_grad():
        with model.disable_adapter():
            base_logits, targets = full_logits_at_targets(model, batch)
    nudge_lora(model)
    logits, _ = full_logits_at_targets(model, batch)
    by_hand = (dft(logits, targets) + 0.3 * kl_from_reference(logits, base_logits)).sum()
    model.train()
    out = objective(model, batch)
    assert float(out.loss_sum) == pytest.approx(float(by_hand), rel=1e-5)
    assert float(out.loss_sum) > float(dft_only(model, batch).loss_sum) + 1e-3
    out.loss_sum.backward()  # the KL's gradient reaches the adapter, never the frozen base
    assert all(p.grad is None for n, p in model.named_parameters() if "lora" not in n)
    assert any(float(p.grad.abs().sum()) > 0 for n, p in model.named_parameters() if "lora_A" in n)
    assert model.training  # the reference put the model back in training mode


def test_asft_with_a_separate_reference_model(tiny_model_dir, batch):
    reference_model, model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    ref_logits, targets = full_logits_at_targets(reference_model, batch)
    logits, _ = full_logits_at_targets(model, batch)
    objective = LMObjective(chunk_tokens=3, loss=TokenLoss("asft", alpha=0.5), reference=ModelReference(reference_model))
    with torch.no_grad():
        got = objective(model, batch).loss_sum
    assert float(got) == pytest.approx(float((dft(logits, targets) + 0.5 * kl_from_reference(logits, ref_logits))
                                             .sum()), rel=1e-5)


def test_packed_asft_equals_the_separate_rows(tiny_model_dir):
    model = load_model(tiny_model_dir, lora={})
    nudge_lora(model)
    objective = LMObjective(loss=TokenLoss("asft", alpha=0.2), reference=AdapterReference(), chunk_tokens=2)
    a, b = [11, 12, 13, 14], [21, 22, 23]
    from tuneforge.batch import Layout

    packed = as_batch({"input_ids": torch.tensor([a + b]), "labels": torch.tensor([a + b]),
                       "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]])}, Layout(packed=True))
    with torch.no_grad():
        separate = sum(float(objective(model, as_batch({
            "input_ids": torch.tensor([row]), "labels": torch.tensor([row]),
            "attention_mask": torch.ones(1, len(row), dtype=torch.long)})).loss_sum) for row in (a, b))
        # the KL is a small difference of log-probs: fp32 rounding of the packed attention shows at ~2e-5
        assert float(objective(model, packed).loss_sum) == pytest.approx(separate, rel=1e-4)


def config(tmp_path, **keys):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path), **keys},
                     source="losses.yaml")


@pytest.mark.parametrize(
    ("keys", "message", "fields"),
    [
        ({"use_dft_loss": True, "use_eaft_loss": True}, "use_dft_loss and use_eaft_loss are different losses",
         ("use_dft_loss", "use_eaft_loss")),
        ({"use_dft_loss": True, "label_smoothing_factor": 0.1}, "does not smooth labels",
         ("use_dft_loss", "label_smoothing_factor")),
        ({"use_eaft_loss": True, "eaft_alpha": -1}, "eaft_alpha must be a finite number >= 0", ("eaft_alpha",)),
        ({"use_asft_loss": True, "precompute_ref_log_probs": True}, "cannot be precomputed",
         ("use_asft_loss", "precompute_ref_log_probs")),
        ({"ref_model": "m"}, "only for ASFT's KL", ("ref_model", "use_asft_loss")),
        ({"stage": "pt", "use_dft_loss": True}, "use_dft_loss", ("use_dft_loss",)),
        ({"neftune_noise_alpha": -5}, "neftune_noise_alpha must be", ("neftune_noise_alpha",)),
    ],
)
def test_configs_that_cannot_work_are_refused_naming_the_keys(tmp_path, keys, message, fields):
    with pytest.raises(ConfigError, match=message) as raised:
        config(tmp_path, **keys)
    assert set(fields) <= set(raised.value.keys)


def test_asft_builds_its_reference_and_trains(tmp_path, tiny_model_dir, home):
    """A LoRA sft run with use_asft_loss: the reference is the base (adapters disabled); the adapter learns."""
    from safetensors.torch import load_file

    from tuneforge.config.validate import uses_reference
    from tuneforge.workflow import run

    cfg = from_dict({
        "model_name_or_path": str(tiny_model_dir), "dataset": "identity", "dataset_dir": str(REPO_DATA),
        "output_dir": str(tmp_path / "out"), "use_asft_loss": True, "asft_alpha": 0.1, "max_samples": 8,
        "cutoff_len": 64, "max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 5e-3,
        "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True}, source="asft.yaml")
    assert uses_reference(cfg)
    result = run(cfg)
    assert math.isfinite(result["train_loss"]) and "eval_perplexity" not in result
    weights = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert any(float(w.abs().sum()) > 0 for name, w in weights.items() if "lora_B" in name)
