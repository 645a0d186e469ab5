"""benchmarks/train_throughput.py's workloads: the peer gets the same keys as tuneforge, so the two run the same
workload (W3 through the peer script's keys, W4 through the config LlamaFactory is given directly)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_throughput as tt  # noqa: E402
from llamafactory_peer import peer_config  # noqa: E402

# the peer script's key names that differ from LlamaFactory's
SCRIPT_NAMES = {"batch_size": "per_device_train_batch_size"}


@pytest.mark.parametrize("workload", sorted(tt.PEER_ARGS))
def test_peer_script_keys_match_the_workload(workload):
    for arg in tt.PEER_ARGS[workload]:
        key, value = arg.split("=", 1)
        key = SCRIPT_NAMES.get(key, key)
        if key == "template":
            continue  # the peer's own chat template name
        expected = tt.WORKLOADS[workload][key]
        given = value if isinstance(expected, str) else type(expected)(float(value))
        assert given == expected, (workload, key, value)


def test_w3_is_full_fine_tuning_and_w4_qlora(tmp_path):
    assert tt.W3["finetuning_type"] == "full" and "quantization_bit" not in tt.W3
    assert tt.W4["finetuning_type"] == "lora" and tt.W4["quantization_bit"] == 4
    assert "W4" not in tt.PEER_ARGS  # the peer script cannot pass quantization_bit
    cfg = peer_config({**tt.W4, "model_name_or_path": "/m"}, tmp_path, cpu=True)
    assert {k: cfg[k] for k in ("quantization_bit", "finetuning_type", "lora_rank", "max_steps", "use_cpu")} == {
        "quantization_bit": 4, "finetuning_type": "lora", "lora_rank": 8, "max_steps": 10, "use_cpu": True}


def test_dataset_tokens_come_from_the_runs_data_line(tmp_path):
    """tuneforge's tokens/s in LlamaFactory's definition needs the train split's samples and tokens, read from the
    line the run logs (a line of a W1 run)."""
    log = tmp_path / "log.txt"
    log.write_text(
        "07:30:44 INFO __main__: memory allocator: tcmalloc\n"
        "07:30:49 INFO tuneforge.workflow: data: stage=sft, packing=False, rows_read=256, bad_rows=0, "
        "dropped_by_truncation=0, train_samples=256, eval_samples=0, train_rows=256, train_tokens=50927, "
        "train_supervised_tokens=38387, samples=256, tokens=50927\n")
    assert tt.logged_data(log) == {"train_samples": 256, "train_tokens": 50927}
    assert tt.logged_allocator(log) == "tcmalloc"
    log.write_text("no data line\n")
    assert tt.logged_data(log) == {}
