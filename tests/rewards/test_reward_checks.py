"""check_rewards and required_columns: every refusal names the keys at fault, before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tuneforge.errors import ConfigError, DataError
from tuneforge.rewards import check_rewards, required_columns
from tuneforge.rewards.locate import reward_model_location


def test_checking_rewards_imports_no_torch(tmp_path):
    """Config validation calls check_rewards; it must stay light (as tests/test_stages.py asks of validation)."""
    code = ("import sys; from dataclasses import replace; from tuneforge.config.schema import RunConfig; "
            "from tuneforge.rewards import check_rewards; cfg = RunConfig(); "
            "cfg = replace(cfg, method=replace(cfg.method, stage='grpo'), rl=replace(cfg.rl, "
            "reward_funcs=['accuracy', 'format', 'length'], reward_format_pattern='.*', "
            "reward_model='http://localhost:8000', reward_model_type='api')); check_rewards(cfg); "
            "sys.exit(1 if {'torch', 'datasets', 'transformers'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def rm_folder(path, *, adapter_of=None, head=True):
    """A folder shaped like a stage rm output (the checks read names, not weights)."""
    path.mkdir(parents=True)
    if adapter_of is None:
        (path / "config.json").write_text("{}")
    else:
        (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": adapter_of}))
    if head:
        (path / "value_head.safetensors").write_bytes(b"")
    return path


def refused(cfg) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check_rewards(cfg)
    return info.value


def test_a_valid_config_and_a_stage_without_rewards_pass(rl_cfg, tmp_path):
    check_rewards(rl_cfg(stage="sft"))  # nothing to score
    check_rewards(rl_cfg(reward_funcs=["accuracy", "length"], reward_weights=[1.0, 0.5]))
    check_rewards(rl_cfg(reward_funcs=["format"], reward_format_pattern=r"<think>.*</think>.*"))
    check_rewards(rl_cfg(reward_model=str(rm_folder(tmp_path / "full")), reward_model_type="full"))
    check_rewards(rl_cfg(reward_model="http://localhost:8000", reward_model_type="api"))


def test_no_reward_at_all(rl_cfg):
    error = refused(rl_cfg(stage="grpo"))
    assert error.keys == ("reward_funcs", "reward_model")
    assert "stage grpo needs a reward" in str(error) and str(error).startswith("rl.yaml: ")
    assert refused(rl_cfg(stage="ppo")).key == "reward_funcs"


def test_unknown_builtin_suggests_the_close_one(rl_cfg):
    error = refused(rl_cfg(reward_funcs=["acuracy"]))
    assert error.key == "reward_funcs"
    assert "'acuracy'" in str(error) and "did you mean 'accuracy'" in str(error)


def test_user_functions_that_cannot_be_had(rl_cfg, tmp_path, monkeypatch):
    error = refused(rl_cfg(reward_funcs=["no_such_module_xyz:score"]))
    assert error.key == "reward_funcs" and "no_such_module_xyz:score" in str(error)
    assert "no module no_such_module_xyz" in str(error)

    (tmp_path / "mine.py").write_text("THRESHOLD = 3\n\ndef score(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    check_rewards(rl_cfg(reward_funcs=["mine.py:score"]))  # relative to the working directory
    error = refused(rl_cfg(reward_funcs=["mine.py:THRESHOLD"]))
    assert error.key == "reward_funcs" and "mine.py:THRESHOLD is not a function (its type: int)" in str(error)
    assert "has no attribute 'scor'" in str(refused(rl_cfg(reward_funcs=["mine.py:scor"])))
    assert "there is no file" in str(refused(rl_cfg(reward_funcs=["other.py:score"])))

    (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n")
    error = refused(rl_cfg(reward_funcs=["broken.py:score"]))
    assert error.key == "reward_funcs" and "ModuleNotFoundError" in str(error)
    assert isinstance(error.__cause__, ModuleNotFoundError)

    monkeypatch.syspath_prepend(str(tmp_path))
    check_rewards(rl_cfg(reward_funcs=["mine:score"]))  # an importable module


def test_listing_a_reward_twice(rl_cfg):
    assert "twice" in str(refused(rl_cfg(reward_funcs=["length", "length"])))


def test_one_weight_per_reward_the_reward_model_last(rl_cfg):
    error = refused(rl_cfg(reward_funcs=["accuracy"], reward_weights=[1.0, 2.0]))
    assert error.key == "reward_weights" and "2 weights for 1 rewards" in str(error)
    error = refused(rl_cfg(reward_funcs=["accuracy"], reward_model="http://h:1", reward_model_type="api",
                           reward_weights=[1.0]))
    assert error.key == "reward_weights" and "(accuracy, reward_model)" in str(error)


def test_format_needs_a_valid_pattern(rl_cfg):
    assert refused(rl_cfg(reward_funcs=["format"])).key == "reward_format_pattern"
    error = refused(rl_cfg(reward_funcs=["format"], reward_format_pattern="<answer>(.*"))
    assert error.key == "reward_format_pattern" and "not a valid regular expression" in str(error)


def test_length_buffer_within_the_completion_length(rl_cfg):
    error = refused(rl_cfg(reward_funcs=["length"], max_completion_length=64, overlong_buffer=65))
    assert error.key == "overlong_buffer"


def test_reward_server_needs_an_http_url(rl_cfg):
    error = refused(rl_cfg(reward_model="localhost:8000", reward_model_type="api"))
    assert error.keys == ("reward_model", "reward_model_type") and "http(s) URL" in str(error)
    error = refused(rl_cfg(reward_model="http://h:1", reward_model_type="api", reward_model_adapters=["a"]))
    assert error.key == "reward_model_adapters"


def test_adapters_need_a_reward_model(rl_cfg):
    error = refused(rl_cfg(reward_funcs=["length"], reward_model_adapters=["rm"]))
    assert error.keys == ("reward_model_adapters", "reward_model")


def test_full_reward_model_folders(rl_cfg, tmp_path):
    error = refused(rl_cfg(reward_model=str(tmp_path / "missing"), reward_model_type="full"))
    assert error.key == "reward_model" and "does not exist" in str(error)
    no_head = rm_folder(tmp_path / "sft-out", head=False)
    error = refused(rl_cfg(reward_model=str(no_head), reward_model_type="full"))
    assert error.key == "reward_model" and "no value_head.safetensors" in str(error)
    adapter = rm_folder(tmp_path / "lora-rm", adapter_of="base")
    error = refused(rl_cfg(reward_model=str(adapter), reward_model_type="full"))
    assert "set reward_model_type: lora" in str(error)


def test_lora_reward_models(rl_cfg, tmp_path):
    base = rm_folder(tmp_path / "base", head=False)
    adapter = rm_folder(tmp_path / "rm", adapter_of=str(base))
    # the rm adapter folder itself: its base comes from adapter_config.json
    cfg = rl_cfg(reward_model=str(adapter))
    check_rewards(cfg)
    where = reward_model_location(cfg.rl, source="rl.yaml")
    assert (where.base, where.adapters) == (str(base), (str(adapter),))
    # the base plus the adapter
    check_rewards(rl_cfg(reward_model=str(base), reward_model_adapters=[str(adapter)]))

    plain = rm_folder(tmp_path / "sft-lora", adapter_of=str(base), head=False)
    error = refused(rl_cfg(reward_model=str(base), reward_model_adapters=[str(plain)]))
    assert error.key == "reward_model_adapters" and "no value_head.safetensors" in str(error)
    assert refused(rl_cfg(reward_model=str(plain))).key == "reward_model"
    error = refused(rl_cfg(reward_model=str(base)))  # lora without an adapter
    assert error.key == "reward_model_adapters"
    full = rm_folder(tmp_path / "full-rm")
    assert "set reward_model_type: full" in str(refused(rl_cfg(reward_model=str(full))))


def test_required_columns_names_the_column_and_the_key(rl_cfg):
    cfg = rl_cfg(reward_funcs=["accuracy"])
    required_columns(cfg, ["instruction", "solution"])
    with pytest.raises(DataError, match=r"none of the columns answer, solution, ground_truth; its columns: "
                                        r"instruction, output\. Set reward_answer_column"):
        required_columns(cfg, ["instruction", "output"])
    with pytest.raises(DataError, match=r"column 'gold' \(reward_answer_column\).*its columns: instruction, answer"):
        required_columns(rl_cfg(reward_funcs=["accuracy"], reward_answer_column="gold"), ["instruction", "answer"])
    required_columns(rl_cfg(reward_funcs=["length"]), ["instruction"])  # no reward reads a column
