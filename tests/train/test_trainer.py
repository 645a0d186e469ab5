"""The loop: accumulation equals the full batch, the loss drops, eval, early stopping, errors, outputs."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from train_helpers import collate, load_model, make_cfg, random_dataset, trainable_state
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.atomic import is_partial
from tuneforge.data.collate import Collator
from tuneforge.errors import ConfigError, TrainingError
from tuneforge.train import Trainer
from tuneforge.train.trainer import epoch_micro_batches

LENGTHS = [5, 9, 3, 7]  # unequal, so padding and per-sample means would show up


def one_sgd_step(tmp_path, model_dir, name, **keys):
    """Weights before and after one SGD step with lr 1 (so the step is minus the gradient) and its log."""
    model = load_model(model_dir)
    before = trainable_state(model)
    cfg = make_cfg(
        tmp_path / name,
        model_dir,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        max_steps=1,
        **keys,
    )
    trainer = Trainer(cfg, model, None, random_dataset(LENGTHS, seed=5), None, collate)
    trainer.train()
    grads = {n: before[n] - p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return grads, trainer.state.log_history[0]["loss"]


def weighted_token_mean(model, batch, weight) -> torch.Tensor:
    """The mean over the batch's supervised tokens of cross-entropy x weight(logits, targets) (a constant), by hand:
    LlamaFactory's DFT / EAFT loss functions on the shifted labels."""
    logits = model(**batch.model_inputs).logits[:, :-1].float()
    labels = batch.targets["labels"][:, 1:]
    keep = labels != -100
    logits, targets = logits[keep], labels[keep]
    ce = -torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    return (ce * weight(logits.detach(), targets)).mean()


def dft_weight(logits, targets):
    return torch.softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def eaft_weight(logits, targets, alpha=0.5):
    top = torch.softmax(logits.topk(20, dim=-1).values, -1)
    return (-(top * top.log()).sum(-1) / 3.0) ** alpha


@pytest.mark.parametrize("keys", [{}, {"label_smoothing_factor": 0.1}, {"use_dft_loss": True},
                                  {"use_eaft_loss": True, "eaft_alpha": 0.5}],
                         ids=["plain", "label-smoothing", "dft", "eaft"])
def test_accumulated_micro_batches_equal_one_full_batch(tmp_path, tiny_model_dir, keys):
    full, full_loss = one_sgd_step(tmp_path, tiny_model_dir, "full", per_device_train_batch_size=4, **keys)
    accumulated, acc_loss = one_sgd_step(
        tmp_path, tiny_model_dir, "acc", per_device_train_batch_size=1, gradient_accumulation_steps=4, **keys
    )
    # reference: the model's own mean over every supervised token of the padded batch of 4 (transformers' label
    # smoother on the shifted labels, as its Trainer applies label_smoothing_factor; the weighted means by hand)
    from transformers.trainer_pt_utils import LabelSmoother

    model = load_model(tiny_model_dir)
    data = random_dataset(LENGTHS, seed=5)
    whole = collate([data[i] for i in range(4)])
    if keys.get("label_smoothing_factor"):
        reference = LabelSmoother(epsilon=0.1)(model(**whole.model_inputs), whole.targets["labels"],
                                               shift_labels=True)
    elif keys.get("use_dft_loss"):
        reference = weighted_token_mean(model, whole, dft_weight)
    elif keys.get("use_eaft_loss"):
        reference = weighted_token_mean(model, whole, eaft_weight)
    else:
        reference = model(**whole.model_inputs, labels=whole.targets["labels"]).loss
    reference.backward()
    assert acc_loss == pytest.approx(full_loss, abs=1e-5)
    assert full_loss == pytest.approx(float(reference.detach()), abs=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(full[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(accumulated[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_gradient_clipping_logs_the_norm_and_clips_the_step(tmp_path, tiny_model_dir):
    free, _ = one_sgd_step(tmp_path, tiny_model_dir, "free")
    model = load_model(tiny_model_dir)
    before = trainable_state(model)
    cfg = make_cfg(
        tmp_path / "clip",
        tiny_model_dir,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=1e-3,
        max_steps=1,
    )
    trainer = Trainer(cfg, model, None, random_dataset(LENGTHS, seed=5), None, collate)
    trainer.train()
    step = torch.cat([(before[n] - p.detach()).flatten() for n, p in model.named_parameters()])
    unclipped_norm = float(torch.cat([g.flatten() for g in free.values()]).norm())
    assert trainer.state.log_history[0]["grad_norm"] == pytest.approx(unclipped_norm, rel=1e-4)
    assert float(step.norm()) == pytest.approx(1e-3, rel=1e-4)


def test_a_short_run_lowers_the_loss(tmp_path, tiny_model_dir):
    cfg = make_cfg(
        tmp_path / "out",
        tiny_model_dir,
        learning_rate=3e-3,
        max_steps=12,
        per_device_train_batch_size=4,
        lr_scheduler_type="constant",
    )
    trainer = Trainer(cfg, load_model(tiny_model_dir), None, random_dataset([8] * 4, high=50), None, collate)
    results = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 12
    assert losses[-1] < losses[0] - 1.0
    assert results["global_step"] == 12 and results["epoch"] == 12.0


def test_data_order_is_a_pure_function_of_seed_and_epoch():
    a = epoch_micro_batches(7, 3, seed=1, epoch=0)
    assert a == epoch_micro_batches(7, 3, seed=1, epoch=0)
    assert a != epoch_micro_batches(7, 3, seed=1, epoch=1)
    assert [len(b) for b in a] == [3, 3, 1]  # the last partial micro-batch is kept
    assert sorted(i for b in a for i in b) == list(range(7))


def test_data_order_is_transformers_trainers(tmp_path):
    """The same seed shuffles the rows as transformers' Trainer (so LlamaFactory) does, epoch by epoch: a run
    moved over from LlamaFactory trains the same rows in the same order."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments, set_seed

    class Scalar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, seed=42, use_cpu=True,
                             report_to="none", remove_unused_columns=False)
    set_seed(42)
    rows = [{"row": i} for i in range(30)]
    hf = HFTrainer(model=Scalar(), args=args, train_dataset=rows,
                   data_collator=lambda batch: {"row": [r["row"] for r in batch]})
    loader = hf.get_train_dataloader()
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        assert [b["row"] for b in loader] == epoch_micro_batches(30, 4, seed=42, epoch=epoch)


def test_ranks_split_each_global_micro_batch_and_get_equal_counts():
    one = epoch_micro_batches(8, 4, seed=3, epoch=0)
    ranks = [epoch_micro_batches(8, 2, seed=3, epoch=0, rank=r, world_size=2) for r in range(2)]
    # micro-batch m of the two ranks together is micro-batch m of one process with twice the batch
    for m, rows in enumerate(one):
        assert sorted(ranks[0][m] + ranks[1][m]) == sorted(rows)
    # 7 rows on 2 ranks: padded to 8 by repeating the first row, so no rank runs out a step early
    uneven = [epoch_micro_batches(7, 2, seed=3, epoch=0, rank=r, world_size=2) for r in range(2)]
    assert [len(b) for b in uneven[0]] == [len(b) for b in uneven[1]] == [2, 2]
    seen = [i for rank in uneven for b in rank for i in b]
    assert sorted(set(seen)) == list(range(7)) and len(seen) == 8


def test_partial_accumulation_group_at_epoch_end_still_steps(tmp_path, tiny_model_dir):
    lengths = [4, 5, 6, 7, 8]
    # 5 micro-batches of 1, 2 per step -> 3 steps per epoch (the last with one micro-batch); 2 epochs
    cfg = make_cfg(
        tmp_path / "out",
        tiny_model_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=-1,
        num_train_epochs=2,
    )
    results = Trainer(cfg, load_model(tiny_model_dir), None, random_dataset(lengths), None, collate).train()
    assert results["global_step"] == 6
    assert results["total_tokens"] == 2 * sum(lengths)  # every row seen once per epoch, padding not counted
    assert results["epoch"] == 2.0


def test_fractional_epochs(tmp_path, tiny_model_dir):
    cfg = make_cfg(
        tmp_path / "out", tiny_model_dir, per_device_train_batch_size=1, max_steps=-1, num_train_epochs=1.5
    )
    results = Trainer(cfg, load_model(tiny_model_dir), None, random_dataset([4] * 4), None, collate).train()
    assert results["global_step"] == 6 and results["epoch"] == 1.5


def test_count_tokens_ignores_padding():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7], "attention_mask": [1, 1, 1, 0]}]
    assert Collator(0)(rows).num_tokens == 6  # counted by the collator from the rows, for the trainer


def test_eval_loss_is_the_token_weighted_mean(tmp_path, tiny_model_dir):
    eval_data = random_dataset([4, 9, 6], seed=7)
    model = load_model(tiny_model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in eval_data:
            ids = torch.tensor([row["input_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            for t, target in enumerate(row["labels"][1:]):
                if target != -100:
                    total, count = total - float(logp[t, target]), count + 1
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, per_device_eval_batch_size=2)
    metrics = Trainer(cfg, model, None, random_dataset([4]), eval_data, collate).evaluate()
    assert count == (4 - 2) + (9 - 2) + (6 - 2)  # labels of the first 2 tokens are -100
    assert metrics["eval_loss"] == pytest.approx(total / count, rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)


def test_eval_strategy_epoch_evaluates_at_each_epoch_end(tmp_path, tiny_model_dir):
    # 3 rows in micro-batches of 2: 2 steps per epoch, 3 epochs
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, max_steps=-1, num_train_epochs=3, eval_strategy="epoch")
    trainer = Trainer(
        cfg, load_model(tiny_model_dir), None, random_dataset([4, 5, 6]), random_dataset([5], seed=1), collate
    )
    trainer.train()
    evals = [(e["step"], e["epoch"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert evals == [(2, 1.0), (4, 2.0), (6, 3.0)]  # and no extra evaluation at the end


def test_save_strategy_epoch_saves_at_each_epoch_end(tmp_path, tiny_model_dir):
    # 3 rows in micro-batches of 2: 2 steps per epoch, 3 epochs
    out = tmp_path / "out"
    cfg = make_cfg(out, tiny_model_dir, max_steps=-1, num_train_epochs=3, save_strategy="epoch", save_steps=1)
    Trainer(cfg, load_model(tiny_model_dir), None, random_dataset([4, 5, 6]), None, collate).train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_save_strategy_best_saves_when_the_evaluation_improves(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = make_cfg(out, tiny_model_dir, max_steps=6, eval_strategy="steps", eval_steps=1, save_strategy="best",
                   metric_for_best_model="perplexity")
    trainer = Trainer(cfg, load_model(tiny_model_dir), None, random_dataset([4, 5, 6, 7]),
                      random_dataset([5, 6], seed=1), collate)
    trainer.train()
    evals = [(e["step"], e["perplexity"]) for e in trainer.state.log_history if "eval_loss" in e]
    improving = [step for i, (step, value) in enumerate(evals) if all(value < v for _, v in evals[:i])]
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == improving
    assert trainer.state.best_step == improving[-1]


def test_load_best_model_at_end_outputs_the_best_checkpoints_weights(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    # "best" = the highest eval loss, which the first evaluation has as training lowers it
    cfg = make_cfg(out, tiny_model_dir, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="best",
                   greater_is_better=True, load_best_model_at_end=True)
    trainer = Trainer(cfg, load_model(tiny_model_dir), None, random_dataset([4, 5, 6, 7]),
                      random_dataset([5, 6], seed=1), collate)
    results = trainer.train()
    assert trainer.state.best_step == 1 and results["global_step"] == 4
    final, best = load_file(out / "model.safetensors"), load_file(out / "checkpoint-1" / "model.safetensors")
    assert final.keys() == best.keys()
    assert all(torch.equal(final[k], best[k]) for k in final)


def test_best_model_settings_are_checked_before_training(tmp_path, tiny_model_dir):
    from tuneforge.errors import ConfigError

    with pytest.raises(ConfigError, match="load_best_model_at_end needs a checkpoint at every evaluation"):
        make_cfg(tmp_path / "a", tiny_model_dir, eval_strategy="steps", eval_steps=2, save_steps=3,
                 load_best_model_at_end=True)
    with pytest.raises(ConfigError, match="rank evaluations: set eval_strategy"):
        make_cfg(tmp_path / "b", tiny_model_dir, save_strategy="best")


def test_early_stopping_stops_after_patience_evaluations(tmp_path, tiny_model_dir, caplog):
    # eval tokens never occur in training, so eval_loss soon stops improving
    train, evals = random_dataset([8] * 8, high=500), random_dataset([8] * 4, seed=1, low=500, high=1000)
    common = dict(learning_rate=1e-2, eval_strategy="steps", eval_steps=1, max_steps=10)
    full = Trainer(
        make_cfg(tmp_path / "full", tiny_model_dir, **common),
        load_model(tiny_model_dir),
        None,
        train,
        evals,
        collate,
    )
    full.train()
    history = [e["eval_loss"] for e in full.state.log_history if "eval_loss" in e]
    best, waited, expected = math.inf, 0, None
    for step, loss in enumerate(history, start=1):
        best, waited = (loss, 0) if loss < best else (best, waited + 1)
        if waited == 2:
            expected = step
            break
    assert expected is not None and 2 < expected < 10, history
    cfg = make_cfg(tmp_path / "stop", tiny_model_dir, early_stopping_steps=2, **common)
    with caplog.at_level(logging.INFO, logger="tuneforge"):
        results = Trainer(cfg, load_model(tiny_model_dir), None, train, evals, collate).train()
    assert results["global_step"] == expected
    assert "early stopping: eval_loss has not improved" in caplog.text


def test_nan_loss_names_the_step(tmp_path):
    # untied embeddings, one row NaN: only the sample holding that token gives a NaN loss
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        model.model.embed_tokens.weight[63] = float("nan")
    data = random_dataset([5] * 6, low=3, high=60)
    poisoned = epoch_micro_batches(6, 1, seed=42, epoch=0)[2][0]  # the row of the third step
    rows = [dict(r) for r in data]
    rows[poisoned]["input_ids"] = rows[poisoned]["input_ids"][:-1] + [63]
    cfg = make_cfg(tmp_path / "out", tmp_path, per_device_train_batch_size=1, max_steps=6)
    with pytest.raises(TrainingError, match=r"step 3: the loss is nan\. Lower learning_rate"):
        Trainer(cfg, model, None, rows, None, collate).train()


@pytest.mark.parametrize("order", [{"data_seed": 7}, {"disable_shuffling": True}])
def test_data_seed_and_disable_shuffling_set_the_order_rows_are_trained_in(tmp_path, order):
    """The row that poisons the loss is reached at the step its place in the order says."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    with torch.no_grad():
        model.model.embed_tokens.weight[63] = float("nan")
    batches = epoch_micro_batches(6, 1, seed=7, epoch=0, shuffle="data_seed" in order)
    poisoned = batches[3][0]  # the row of the fourth step
    assert epoch_micro_batches(6, 1, seed=42, epoch=0)[3][0] != poisoned  # not where seed 42's order puts it
    rows = [dict(r) for r in random_dataset([5] * 6, low=3, high=60)]
    rows[poisoned]["input_ids"] = rows[poisoned]["input_ids"][:-1] + [63]
    cfg = make_cfg(tmp_path / "out", tmp_path, per_device_train_batch_size=1, max_steps=6, **order)
    with pytest.raises(TrainingError, match=r"step 4: the loss is nan"):
        Trainer(cfg, model, None, rows, None, collate).train()
    if "disable_shuffling" in order:
        assert poisoned == 3


def test_final_adapter_and_results(tmp_path, tiny_model_dir, tokenizer):
    from peft import PeftModel

    model = load_model(tiny_model_dir, lora={})
    out = tmp_path / "out"
    cfg = make_cfg(
        out, tiny_model_dir, finetuning_type="lora", max_steps=3, eval_strategy="steps", eval_steps=2
    )
    results = Trainer(
        cfg, model, tokenizer, random_dataset([5, 6, 7, 8]), random_dataset([6, 4], seed=2), collate
    ).train()
    loaded = PeftModel.from_pretrained(load_model(tiny_model_dir), out)
    trained = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(p, trained[name], rtol=0, atol=0)
    assert (out / "tokenizer.json").is_file()
    expected_train = {
        "epoch",
        "global_step",
        "total_tokens",
        "train_loss",
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "train_tokens_per_second",
        "train_peak_memory_mb",
    }
    assert set(json.loads((out / "train_results.json").read_text())) == expected_train
    assert set(results) == expected_train | {"eval_loss", "perplexity"}
    assert json.loads((out / "all_results.json").read_text()) == pytest.approx(results)
    evaluated = json.loads((out / "eval_results.json").read_text())
    assert evaluated["eval_loss"] == results["eval_loss"] and evaluated["epoch"] == 1.5
    # evaluations at step 2 and, because step 3 is the end, once more at 3
    assert [
        e["step"]
        for e in json.loads((out / "trainer_state.json").read_text())["log_history"]
        if "eval_loss" in e
    ] == [2, 3]


def test_final_full_model_loads_with_transformers(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_model_dir)
    out = tmp_path / "out"
    Trainer(
        make_cfg(out, tiny_model_dir, max_steps=2), model, None, random_dataset([5, 6]), None, collate
    ).train()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
    assert not [p.name for p in out.iterdir() if is_partial(p) or p.name.startswith(".tmp-")]


def test_bf16_autocast_runs_on_cpu(tmp_path, tiny_model_dir):
    data = random_dataset([6, 7])
    losses = {}
    for bf16 in (False, True):
        cfg = make_cfg(tmp_path / f"bf16-{bf16}", tiny_model_dir, bf16=bf16, max_steps=1)
        losses[bf16] = Trainer(cfg, load_model(tiny_model_dir), None, data, None, collate).train()[
            "train_loss"
        ]
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)


def test_missing_reporter_package_fails_at_construction(tmp_path, tiny_model_dir):
    import importlib.util

    cfg = make_cfg(tmp_path / "out", tiny_model_dir)
    cfg.train.report_to = ["tensorboard"]  # a RunConfig built without config.load's validation
    model = load_model(tiny_model_dir)
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ConfigError, match="pip install tensorboard"):
            Trainer(cfg, model, None, random_dataset([5]), None, collate)
    else:
        Trainer(cfg, model, None, random_dataset([5]), None, collate).train()
        assert list((tmp_path / "out" / "runs").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_native_bf16_warns(tmp_path, tiny_model_dir, caplog, monkeypatch, native):
    from tuneforge.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "cpu_has_native_bf16", lambda: native)
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, bf16=True)
    with caplog.at_level(logging.WARNING, logger="tuneforge"):
        Trainer(cfg, load_model(tiny_model_dir), None, random_dataset([5]), None, collate)
    assert ("is emulated" in caplog.text and "bf16: false" in caplog.text) is not native


def test_eval_on_start_records_the_untrained_model(tmp_path, tiny_model_dir):
    train, evals = random_dataset([6] * 4), random_dataset([5, 7], seed=3)
    before = Trainer(make_cfg(tmp_path / "a", tiny_model_dir), load_model(tiny_model_dir), None, train, evals,
                     collate).evaluate()
    cfg = make_cfg(tmp_path / "b", tiny_model_dir, eval_on_start=True, eval_dataset=["e"], max_steps=2)
    trainer = Trainer(cfg, load_model(tiny_model_dir), None, train, evals, collate)
    trainer.train()
    evaluations = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evaluations] == [0, 2]
    assert evaluations[0]["eval_loss"] == pytest.approx(before["eval_loss"], abs=1e-6)
    assert evaluations[1]["eval_loss"] < evaluations[0]["eval_loss"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux: the peak RSS through /proc")
def test_peak_memory_counts_training_not_what_came_before(tmp_path, tiny_model_dir):
    import resource

    big = torch.ones(512 * 2**20 // 4)  # 512 MiB resident before training, as a model being loaded would be
    del big
    lifetime_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, max_steps=1)
    results = Trainer(cfg, load_model(tiny_model_dir), None, random_dataset(LENGTHS), None, collate).train()
    assert 0 < results["train_peak_memory_mb"] < lifetime_peak_mb - 400
    assert "train_peak_memory_mb_per_rank" not in results  # one process

