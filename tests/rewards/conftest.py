"""Fixtures for the reward tests: a RunConfig builder for the RL stages (no validation, no files needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuneforge.config.schema import RunConfig


@pytest.fixture
def rl_cfg():
    """rl_cfg(stage="grpo", model="base", key=value, ...) -> a RunConfig with those rl keys (not validated: the
    reward checks are what is tested)."""

    def build(*, stage: str = "grpo", model: str = "base", **rl):
        cfg = RunConfig(source="rl.yaml")
        return replace(cfg, model=replace(cfg.model, model_name_or_path=model),
                       method=replace(cfg.method, stage=stage), rl=replace(cfg.rl, **rl))

    return build
