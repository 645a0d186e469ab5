"""DeepSpeed ZeRO through the CLI, as a user runs it: `deepspeed=<config>` on 1 or 2 CPU processes (gloo).

With the same global batch, ZeRO-2 and ZeRO-3 train what one plain process trains. Tolerance, fp32: the
reduce-scatter sums the ranks' gradients in another order than one process's batch sum (measured: losses 7e-7,
LoRA weights 1.2e-7, full-parameter weights 1.2e-7 after 3 AdamW steps); 1e-5 leaves room and stays far below
one step's change of a weight at these learning rates, which a wrong gradient scale or a lost reduction shows.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import logged_steps, train  # FAST: 3 steps, fp32, no eval, no checkpoints, lr 1e-2

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.e2e

TOL = 1e-5
Z3 = "deepspeed=examples/deepspeed/ds_z3_config.json"


def assert_same_steps(one: Path, two: Path, keys=("loss", "grad_norm")) -> None:
    a, b = logged_steps(one), logged_steps(two)
    assert [r["current_steps"] for r in a] == [r["current_steps"] for r in b] == [1, 2, 3]
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a["total_tokens"] == row_b["total_tokens"]
        for key in keys:
            # grad_norm (before clipping): torch's clip_grad_norm_ sums the squares in fp32, DeepSpeed in fp64; over
            # the 1.6M weights of the full tiny model fp32 is 1e-5 (relative) off the fp64 norm (measured 1.2e-5)
            rel = 1e-4 if key == "grad_norm" else TOL
            assert row_b[key] == pytest.approx(row_a[key], abs=TOL, rel=rel), key


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = TOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def plain_sft(tmp_path_factory, tiny_model_dir):
    """One process without DeepSpeed, batch 4: what every sft run below must train."""
    out = tmp_path_factory.mktemp("plain-sft")
    train("examples/sft_lora.yaml", out, tiny_model_dir, "per_device_train_batch_size=4")
    return out


def test_zero3_lora_trains_what_one_process_trains_and_resumes_exactly(tmp_path, tiny_model_dir, plain_sft):
    two = tmp_path / "two"
    # 2 processes x 1 row x 2 accumulated micro-batches: the first backward must not end the accumulation
    r = train("examples/sft_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=1",
              "gradient_accumulation_steps=2", "save_strategy=steps", "save_steps=2", Z3, processes=2)
    assert "deepspeed: ZeRO stage 3 over 2 processes, fp32" in r.stderr
    assert r.stdout.count("adapter saved in") == 1
    peaks = json.loads((two / "train_results.json").read_text())["train_peak_memory_mb_per_rank"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    assert_same_steps(plain_sft, two)
    assert_same_weights(load_file(plain_sft / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors"))
    saved = two / "checkpoint-2"
    assert sorted(p.name for p in (saved / "deepspeed").iterdir()) == [
        f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in (0, 1) for kind in ("model", "optim")
    ]
    assert json.loads((saved / "deepspeed_layout.json").read_text()) == {"zero_stage": 3, "processes": 2}

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(saved, resumed / "checkpoint-2")
    train("examples/sft_lora.yaml", resumed, tiny_model_dir, "per_device_train_batch_size=1",
          "gradient_accumulation_steps=2", "resume_from_checkpoint=true", Z3, processes=2)
    assert [row["current_steps"] for row in logged_steps(resumed)] == [3]
    assert_same_weights(load_file(two / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors"),
                        atol=0.0)

    # the partitions are cut for 2 processes: one process is refused before it loads anything
    r = train("examples/sft_lora.yaml", tmp_path / "other", tiny_model_dir, "per_device_train_batch_size=1",
              f"resume_from_checkpoint={saved}", Z3, ok=False)
    assert r.returncode == 2
    assert "holds ZeRO partitions cut for 2 processes, but this run starts 1" in r.stderr


def test_zero3_full_dpo_partitions_its_reference_and_saves_a_whole_model(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    one, two = tmp_path / "one", tmp_path / "two"
    # 9 held-out pairs, evaluated at the end in batches of 2: under ZeRO-3 rank 0 runs 3 forwards (5 pairs) and
    # rank 1 one more than its 4 pairs need (uncounted), since every forward gathers the weights from both ranks
    common = ("finetuning_type=full", "learning_rate=1e-3", "val_size=9",
              "per_device_eval_batch_size=2")
    train("examples/dpo_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4", *common)
    r = train("examples/dpo_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2", *common, Z3,
              processes=2)
    assert "deepspeed: the reference model is partitioned like the policy (ZeRO-3)" in r.stderr
    assert_same_steps(one, two, ("loss", "grad_norm", "rewards/margins", "rewards/accuracies"))
    evaluated_one, evaluated_two = (json.loads((out / "eval_results.json").read_text()) for out in (one, two))
    for key in ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"):
        assert evaluated_two[key] == pytest.approx(evaluated_one[key], abs=TOL), key
    # the gathered model: every weight (the tied head once), the same as one process's
    assert_same_weights(load_file(one / "model.safetensors"), load_file(two / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(two)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_zero2_with_a_llamafactory_config_trains_a_reward_model_as_one_process_does(tmp_path, tiny_model_dir):
    # the keys and "auto" fields of LlamaFactory's examples/deepspeed/ds_z2_config.json
    config = tmp_path / "ds_z2_config.json"
    config.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                              "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                              "contiguous_gradients": True, "round_robin_gradients": True},
        "comms_config": {"verbose": False},
        "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
    }))
    one, two, alone = tmp_path / "one", tmp_path / "two", tmp_path / "alone"
    train("examples/rm_lora.yaml", one, tiny_model_dir, "per_device_train_batch_size=4")
    r = train("examples/rm_lora.yaml", two, tiny_model_dir, "per_device_train_batch_size=2",
              f"deepspeed={config}", processes=2)
    assert "deepspeed: ZeRO stage 2 over 2 processes" in r.stderr
    keys = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins")
    assert_same_steps(one, two, keys)
    # ZeRO-3 in a single process, everything offloaded: the value head is gathered for the save
    r = train("examples/rm_lora.yaml", alone, tiny_model_dir, "per_device_train_batch_size=4",
              "deepspeed=examples/deepspeed/ds_z3_offload_config.json")
    assert "ZeRO stage 3 over 1 process, optimizer and parameters offloaded to the CPU" in r.stderr
    assert_same_steps(one, alone, keys)
    for out in (two, alone):
        assert_same_weights(load_file(one / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors"),
                            atol=1e-4)
        assert_same_weights(load_file(one / "value_head.safetensors"), load_file(out / "value_head.safetensors"))
