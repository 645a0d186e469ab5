"""neftune_noise_alpha: uniform noise of scale alpha / sqrt(sample length x hidden size) on the input embeddings of the
training forward only (never evaluation, and gone after training)."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import as_batch, collate, load_model, make_cfg, random_dataset

from tuneforge.batch import Layout
from tuneforge.train import Trainer
from tuneforge.train.neftune import NEFTune, sample_lengths

HIDDEN = 32  # the tiny model's hidden size


def embedding_noise(model, neftune, batch) -> torch.Tensor:
    embed = model.get_input_embeddings()
    ids = batch.model_inputs["input_ids"]
    with neftune.noising(batch):
        noisy = embed(ids)
    return (noisy - embed.weight[ids]).detach()


def test_each_token_gets_noise_bounded_by_its_samples_length(tiny_model_dir):
    model = load_model(tiny_model_dir)
    model.train()
    neftune = NEFTune(model, alpha=5.0)
    # a padded batch: samples of 6 and 4 tokens (rows of 6); a packed row holding the same two samples
    padded = collate([random_dataset([6, 4], seed=1)[i] for i in range(2)])
    ids = padded.model_inputs["input_ids"]
    packed = as_batch({"input_ids": torch.cat([ids[0], ids[1, :4]])[None],
                       "labels": torch.cat([ids[0], ids[1, :4]])[None],
                       "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])}, Layout(packed=True))
    assert sample_lengths(padded).tolist() == [[6] * 6, [4] * 6]
    assert sample_lengths(packed).tolist() == [[6] * 6 + [4] * 4]
    bound6, bound4 = 5.0 / math.sqrt(6 * HIDDEN), 5.0 / math.sqrt(4 * HIDDEN)
    torch.manual_seed(0)
    padded_noise, packed_noise = embedding_noise(model, neftune, padded), embedding_noise(model, neftune, packed)
    for first, second in ((padded_noise[0], padded_noise[1, :4]), (packed_noise[0, :6], packed_noise[0, 6:])):
        # uniform in [-bound, bound]: never above it, and with 192 / 128 draws, near it
        assert float(first.abs().max()) <= bound6 and float(first.abs().max()) > 0.95 * bound6
        assert float(second.abs().max()) <= bound4 and float(second.abs().max()) > 0.95 * bound4
        assert abs(float(first.mean())) < 0.1 * bound6  # centred
    # the draw: U(-1, 1) x the sample's scale, from torch's generator (so a resumed run draws the same)
    torch.manual_seed(7)
    noise = embedding_noise(model, neftune, padded)
    torch.manual_seed(7)
    expected = torch.empty(2, 6, HIDDEN).uniform_(-1.0, 1.0) * torch.tensor([bound6, bound4])[:, None, None]
    torch.testing.assert_close(noise, expected)


def test_no_noise_in_eval_mode_outside_the_training_forward_or_after_removal(tiny_model_dir):
    model = load_model(tiny_model_dir)
    neftune = NEFTune(model, alpha=5.0)
    batch = collate([random_dataset([5], seed=2)[0]])
    model.eval()
    assert float(embedding_noise(model, neftune, batch).abs().max()) == 0.0
    model.train()
    embed, ids = model.get_input_embeddings(), batch.model_inputs["input_ids"]
    assert torch.equal(embed(ids), embed.weight[ids])  # outside noising()
    neftune.remove()
    assert float(embedding_noise(model, neftune, batch).abs().max()) == 0.0


def test_training_is_noised_and_evaluation_is_not(tmp_path, tiny_model_dir):
    """One step at lr 1e-12: the training loss moves with the noise, the evaluation of the same weights does not, and
    the model is left without the hook."""
    data = random_dataset([6, 8, 5, 7], seed=4)
    results = {}
    for alpha in (None, 15.0):
        model = load_model(tiny_model_dir)
        cfg = make_cfg(tmp_path / str(alpha), tiny_model_dir, neftune_noise_alpha=alpha, learning_rate=1e-12, optim="sgd",
                       max_steps=1, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=1)
        trainer = Trainer(cfg, model, None, data, data, collate)
        trainer.train()
        history = trainer.state.log_history
        results[alpha] = (next(r["loss"] for r in history if "loss" in r),
                          next(r["eval_loss"] for r in history if "eval_loss" in r))
        model.train()
        ids = torch.tensor([[5, 6, 7]])
        assert torch.equal(model.get_input_embeddings()(ids), model.get_input_embeddings().weight[ids])
    (plain_loss, plain_eval), (noisy_loss, noisy_eval) = results[None], results[15.0]
    assert abs(noisy_loss - plain_loss) > 1e-4
    assert noisy_eval == pytest.approx(plain_eval, abs=1e-7)
