"""The lm objective against hand-computed log-softmax sums, on every head path and chunk size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from train_helpers import as_batch, collate, load_model, random_dataset

from tuneforge.batch import Layout
from tuneforge.train.objectives import Objective, ObjectiveOutput, lm_objective
from tuneforge.train.objectives.lm import LMObjective, can_fuse_head
from tuneforge.train.objectives.sft_losses import TokenLoss


def manual_loss_sum(model, batch) -> tuple[float, int]:
    """-sum log p(label[t+1] | tokens <= t) over supervised targets, one row at a time without padding."""
    batch = {**batch.model_inputs, **batch.targets}
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(batch["input_ids"].shape[0]):
            n = int(batch["attention_mask"][b].sum())
            logits = model(input_ids=batch["input_ids"][b : b + 1, :n]).logits[0]
            logp = torch.log_softmax(logits.double(), dim=-1)
            for t in range(n - 1):
                target = int(batch["labels"][b, t + 1])
                if target != -100:
                    total -= float(logp[t, target])
                    count += 1
    return total, count


@pytest.fixture
def batch():
    # lengths 6 and 4, first 2 labels masked: targets at positions 2..5 and 2..3 -> 4 + 2 = 6 units
    return collate([random_dataset([6, 4], seed=3)[i] for i in range(2)])


def test_lm_objective_satisfies_the_protocol():
    assert isinstance(lm_objective, Objective)
    assert lm_objective.reports_perplexity and lm_objective.name == "lm"


@pytest.mark.parametrize("head,chunk", [("auto", None), ("fused", 2), ("forward", None), ("forward", 4)])
def test_loss_sum_and_count_match_manual_log_softmax(tiny_model_dir, batch, head, chunk):
    model = load_model(tiny_model_dir)
    expected, expected_count = manual_loss_sum(model, batch)
    objective = LMObjective(head=head, chunk_tokens=chunk)
    assert objective.count(batch) == expected_count == 6
    out = objective(model, batch)
    assert isinstance(out, ObjectiveOutput)
    assert out.loss_sum.dtype == torch.float32
    assert float(out.loss_sum.detach()) == pytest.approx(expected, rel=1e-5)


def test_gradients_match_transformers_mean_loss(tiny_model_dir, batch):
    """loss_sum / count has the gradient of the model's own labels= loss, on both paths and in chunks."""
    grads = {}
    for key in ("reference", "fused", "forward"):
        model = load_model(tiny_model_dir)
        if key == "reference":
            loss = model(**batch.model_inputs, labels=batch.targets["labels"]).loss
        else:
            objective = LMObjective(head=key, chunk_tokens=2)
            loss = objective(model, batch).loss_sum / objective.count(batch)
        loss.backward()
        grads[key] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for key in ("fused", "forward"):
        for name, grad in grads["reference"].items():
            torch.testing.assert_close(grads[key][name], grad, rtol=1e-5, atol=1e-5, msg=f"{key} {name}")


def test_lora_model_takes_the_fused_path_and_matches(tiny_model_dir, batch):
    model = load_model(tiny_model_dir, lora={})
    assert can_fuse_head(model)
    with torch.no_grad():
        fused = LMObjective(head="fused")(model, batch).loss_sum
        forward = LMObjective(head="forward")(model, batch).loss_sum
    assert float(fused) == pytest.approx(float(forward), rel=1e-6)


@pytest.mark.parametrize("objective", [lm_objective, LMObjective(label_smoothing=0.2), LMObjective(loss=TokenLoss("dft")),
                                       LMObjective(loss=TokenLoss("eaft", alpha=0.5))],
                         ids=["plain", "smoothed", "dft", "eaft"])
def test_packed_row_loss_equals_the_separate_rows(tiny_model_dir, objective):
    """A packed row (position ids restart at 0) never predicts the next sample's first token (every token loss)."""
    model = load_model(tiny_model_dir)
    a, b = [11, 12, 13, 14], [21, 22, 23]
    packed = as_batch({
        "input_ids": torch.tensor([a + b]),
        "labels": torch.tensor([a + b]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
    }, Layout(packed=True))
    assert objective.count(packed) == 3 + 2
    with torch.no_grad():
        separate = sum(
            float(objective(model, as_batch({"input_ids": torch.tensor([row]), "labels": torch.tensor([row]),
                                             "attention_mask": torch.ones(1, len(row), dtype=torch.long)})).loss_sum)
            for row in (a, b)
        )
        assert float(objective(model, packed).loss_sum) == pytest.approx(separate, rel=1e-5)


def test_soft_capped_head_uses_the_model_forward():
    """Gemma 2 soft-caps its logits: the objective must use the model's forward to include that."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=2.0,
    )
    model = Gemma2ForCausalLM(config)
    assert not can_fuse_head(model)
    ids = torch.randint(0, 64, (1, 6))
    batch = as_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    expected, _ = manual_loss_sum(model, batch)
    assert float(LMObjective()(model, batch).loss_sum) == pytest.approx(expected, rel=1e-5)


def test_batch_without_targets_gives_zero_loss_that_backpropagates(tiny_model_dir):
    model = load_model(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7]])
    batch = as_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100)})
    assert lm_objective.count(batch) == 0
    out = lm_objective(model, batch)
    out.loss_sum.backward()
    assert float(out.loss_sum) == 0.0


# ---- label_smoothing_factor: transformers' smoothed cross-entropy on the shifted labels ----


@pytest.mark.parametrize("head,chunk", [("auto", None), ("fused", 2), ("forward", 4)])
def test_label_smoothing_is_torchs_and_transformers_smoothed_cross_entropy(tiny_model_dir, batch, head, chunk):
    from transformers.trainer_pt_utils import LabelSmoother

    model = load_model(tiny_model_dir)
    objective = LMObjective(head=head, chunk_tokens=chunk, label_smoothing=0.1)
    assert not objective.reports_perplexity  # a smoothed loss is no mean negative log-likelihood
    with torch.no_grad():
        ours = float(objective(model, batch).loss_sum)
        outputs = model(**batch.model_inputs)
        labels = batch.targets["labels"]  # -100 on the prompts and the padding
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        by_hand = F.cross_entropy(logits, labels[:, 1:].reshape(-1), label_smoothing=0.1, reduction="sum")
        transformers_mean = LabelSmoother(epsilon=0.1)(outputs, labels, shift_labels=True)
        plain = float(lm_objective(model, batch).loss_sum)
    assert ours == pytest.approx(float(by_hand), rel=1e-5)
    assert ours / objective.count(batch) == pytest.approx(float(transformers_mean), rel=1e-5)
    assert ours > plain  # smoothing spreads mass onto wrong tokens of a random model: a larger loss


def test_the_lm_objective_takes_label_smoothing_from_the_config(tmp_path, tiny_model_dir):
    from train_helpers import make_cfg

    from tuneforge.train.objectives import build_objective

    plain = build_objective(make_cfg(tmp_path, tiny_model_dir))
    assert isinstance(plain, LMObjective) and plain.loss == TokenLoss() and plain.reports_perplexity
    objective = build_objective(make_cfg(tmp_path, tiny_model_dir, label_smoothing_factor=0.1))
    assert objective.loss == TokenLoss(label_smoothing=0.1) and not objective.reports_perplexity


@pytest.mark.parametrize("head", ["fused", "forward"])
def test_compute_accuracy_is_each_samples_share_of_right_guesses_averaged_over_samples(tiny_model_dir, head):
    model = load_model(tiny_model_dir)
    a, b = [11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24]
    with torch.no_grad():
        guess_a, guess_b = (model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist() for ids in (a, b))
    # labels: the model's own guess where it should be right, another token where not (the prompt unsupervised)
    labels_a = [-100, -100, guess_a[1], guess_a[2] + 1, guess_a[3], guess_a[4], guess_a[5] + 1]  # 3 of 5 right
    labels_b = [-100, guess_b[0], guess_b[1] + 1, guess_b[2] + 1]  # 1 of 3 right
    packed = as_batch({"input_ids": torch.tensor([a + b]), "labels": torch.tensor([labels_a + labels_b]),
                       "position_ids": torch.tensor([list(range(len(a))) + list(range(len(b)))])},
                      Layout(packed=True))
    padded = as_batch({"input_ids": torch.tensor([a, b + [0] * 3]), "labels": torch.tensor([labels_a, labels_b + [-100] * 3]),
                       "attention_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3])})
    for batch in (packed, padded):
        with torch.no_grad():
            out = LMObjective(head=head, accuracy=True)(model, batch)
        assert out.counts["accuracy"] == 2 and out.metrics["accuracy"] == pytest.approx(3 / 5 + 1 / 3, rel=1e-6)
    assert not LMObjective(accuracy=True)(model, packed).metrics  # with gradients (training): no accuracy
