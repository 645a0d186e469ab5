"""Sequence parallelism (Ulysses) on 2 CPU processes (gloo): a row split over 2 ranks gives the loss and the gradients
one process gets on the whole row; the shards, the all-to-all and the config checks on their own."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tuneforge.batch import Batch, Layout
from tuneforge.config import from_dict
from tuneforge.data.collate import flatten
from tuneforge.errors import ConfigError
from tuneforge.train import sequence_parallel
from tuneforge.train.launch import free_port
from tuneforge.train.objectives.lm import LMObjective
from tuneforge.train.objectives.token_logps import supervised_targets


def flat_batch(lengths=(7, 12, 4), prompt=3, seed=0) -> Batch:
    """Padding-free row of samples of these lengths (23 tokens: odd, so the shards need padding), the first
    `prompt` tokens of each unsupervised."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, 2000, (n,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    model_inputs, targets = flatten(rows)
    return Batch(model_inputs, targets, Layout(flat=True), num_rows=len(rows), num_tokens=sum(lengths))


def test_shards_keep_the_targets_of_the_whole_row_in_order():
    batch = flat_batch()
    keep, targets = supervised_targets(batch)
    pieces = [sequence_parallel.shard(batch, rank, 3) for rank in range(3)]  # 23 tokens -> 3 shards of 8
    assert [p.model_inputs["input_ids"].shape[1] for p in pieces] == [8, 8, 8]
    assert pieces[0].model_inputs["cu_seq_lens_q"].tolist() == [0, 7, 19, 23, 24]  # the padding: its own sequence
    torch.testing.assert_close(torch.cat([supervised_targets(p)[1] for p in pieces]), targets)
    assert sum(int(supervised_targets(p)[0].sum()) for p in pieces) == int(keep.sum())
    assert torch.cat([p.model_inputs["position_ids"] for p in pieces], 1)[0, :23].tolist() == (
        batch.model_inputs["position_ids"][0].tolist())
    assert [p.num_rows for p in pieces] == [3, 0, 0] and sum(p.num_tokens for p in pieces) == 23


def _worker(rank: int, port: int, model_dir: str, head: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from tuneforge.model import load_model

        cfg = from_dict({"model_name_or_path": model_dir, "finetuning_type": "full", "sequence_parallel_size": 2},
                        for_training=False)
        torch.manual_seed(0)
        model = load_model(cfg, device="cpu")
        objective, batch = LMObjective(head=head), flat_batch()
        units = objective.count(batch)
        (objective(model, batch).loss_sum / units).backward()  # one process, the whole row
        expected_loss = float(objective(model, batch).loss_sum.detach()) / units
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        prompt = batch.model_inputs["input_ids"][:, :7]
        with torch.no_grad():
            plain = model(input_ids=prompt).logits

        group = sequence_parallel.setup(cfg, model)
        assert (group.size, group.rank, group.data_rank, group.data_ranks) == (2, rank, 0, 1)
        local = group.shard(batch)
        counted = torch.tensor(float(objective.count(local)))
        dist.all_reduce(counted)
        assert int(counted) == units  # each rank counts its shard's tokens: the sum is the row's
        loss_sum = objective(model, local).loss_sum
        (loss_sum / units).backward()
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        assert abs(float(total) / units - expected_loss) < 1e-5, (float(total) / units, expected_loss)
        for name, param in model.named_parameters():
            dist.all_reduce(param.grad)  # what DDP's average x world_size gives
            torch.testing.assert_close(param.grad, expected[name], atol=1e-5, rtol=0, msg=name)
        with torch.no_grad():  # evaluation runs the same sharded forward
            evaluated = objective(model, local).loss_sum
        dist.all_reduce(evaluated)
        assert abs(float(evaluated) / units - expected_loss) < 1e-5
        with torch.no_grad():  # a call that is no shard (generation, --ask) attends over its own whole sequence
            torch.testing.assert_close(model(input_ids=prompt).logits, plain)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("head", ["fused", "forward"])
def test_a_row_split_over_two_ranks_has_the_loss_and_gradients_of_the_whole_row(tiny_model_dir, head):
    mp.spawn(_worker, args=(free_port(), str(tiny_model_dir), head), nprocs=2)


def _all_to_all_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # (1, heads 4, shard 3, d 2): value = 100 * rank + 10 * head + position
        x = (100 * rank + 10 * torch.arange(4)[:, None, None] + torch.arange(3)[None, :, None]).float()
        x = x.expand(4, 3, 2)[None].clone().requires_grad_(True)
        y = sequence_parallel._AllToAll.apply(x, 1, 2, None)  # heads scattered, sequence gathered
        assert y.shape == (1, 2, 6, 2)
        heads = [2 * rank, 2 * rank + 1]
        want = torch.tensor([[10 * h + p + 100 * r for r in (0, 1) for p in range(3)] for h in heads]).float()
        torch.testing.assert_close(y[0, :, :, 0], want)
        (y * y).sum().backward()  # the gradient comes back to the rank and place each value came from
        torch.testing.assert_close(x.grad, 2 * x.detach())
    finally:
        dist.destroy_process_group()


def test_all_to_all_swaps_heads_for_sequence_and_back():
    mp.spawn(_all_to_all_worker, args=(free_port(),), nprocs=2)


@pytest.mark.parametrize(("keys", "message"), [
    ({"stage": "dpo", "dataset": "x"}, "stage dpo: it runs the lm objective of stages pt and sft"),
    ({"padding_free": False}, "set padding_free: true"),
    ({"fsdp": True}, "not yet with deepspeed or fsdp"),
    ({"flash_attn": "eager"}, "set flash_attn: auto or sdpa"),
    ({"sequence_parallel_size": 0}, "must be >= 1"),
    ({"neftune_noise_alpha": 5}, "drop neftune_noise_alpha"),
])
def test_what_sequence_parallelism_does_not_run_is_refused_before_loading(tiny_model_dir, keys, message):
    with pytest.raises(ConfigError, match=message) as e:
        from_dict({"model_name_or_path": str(tiny_model_dir), "sequence_parallel_size": 2, **keys},
                  for_training=False)
    assert "sequence_parallel_size" in str(e.value.key)


def test_a_process_count_the_groups_cannot_divide_is_refused_before_loading(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    monkeypatch.setenv("NPROC_PER_NODE", "3")
    keys = {"model_name_or_path": str(tiny_model_dir), "sequence_parallel_size": 2, "dataset": "identity",
            "output_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="starts 3 process.*NPROC_PER_NODE=2"):
        from_dict(keys)
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    assert from_dict(keys).train.sequence_parallel_size == 2
