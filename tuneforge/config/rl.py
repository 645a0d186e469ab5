"""The RL stages' rules (grpo, ppo), checked with the rest of the config before anything loads, and the rl keys
whose default depends on the stage (the stage row's rl_defaults)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tuneforge.config.schema import RLArgs, RunConfig
from tuneforge.stages import STAGES, stage_of, stages_where, words

REWARD_KEYS = ("reward_funcs", "reward_model")


def resolved_rl(cfg: RunConfig) -> RLArgs:
    """cfg.rl with the rl keys left unset filled in from the stage row's rl_defaults (grpo samples a group of 8
    completions of up to 256 tokens per prompt; ppo one, of up to max_new_tokens, as LlamaFactory's ppo)."""
    flat = cfg.to_dict()
    filled = {}
    for key, default in stage_of(cfg.method.stage).rl_defaults.items():
        if getattr(cfg.rl, key) is None:
            filled[key] = flat[default] if isinstance(default, str) else default
    return dataclasses.replace(cfg.rl, **filled)


def check_rl(cfg: RunConfig, fail: Callable[..., None]) -> None:
    r, g = resolved_rl(cfg), cfg.generate
    stage = stage_of(cfg.method.stage)
    _check_stage_keys(cfg, fail)
    if not stage.samples:
        for key in REWARD_KEYS:
            if getattr(r, key):
                fail(f"{key} is for the stages that sample ({words(stages_where(lambda s: s.samples))}); stage "
                     f"{stage.name} does not sample, so drop {key}", key=key)
        return
    least = 1 if stage.critic else 2  # without a critic, the baseline is the mean reward of a prompt's group
    if r.num_generations < least:
        why = ": advantages compare the completions of a prompt with each other" if least == 2 else ""
        fail(f"num_generations must be >= {least} (got {r.num_generations}){why}", key="num_generations")
    if r.max_completion_length < 1:
        fail(f"max_completion_length must be >= 1 (got {r.max_completion_length})", key="max_completion_length")
    if r.max_completion_length >= cfg.data.cutoff_len:
        fail(f"max_completion_length {r.max_completion_length} leaves no room for the prompt in cutoff_len "
             f"{cfg.data.cutoff_len}; raise cutoff_len or lower max_completion_length",
             key=("max_completion_length", "cutoff_len"))
    if not g.do_sample or g.temperature <= 0:
        fail(f"stage {stage.name} samples its completions: set do_sample: true and temperature > 0 (e.g. 1.0)",
             key=("do_sample", "temperature"))
    if g.num_beams != 1:
        fail(f"stage {stage.name} samples its completions; beam search (num_beams {g.num_beams}) does not: set "
             f"num_beams: 1", key="num_beams")
    if r.epsilon <= 0 or (r.epsilon_high is not None and r.epsilon_high <= 0):
        fail("epsilon and epsilon_high must be > 0 (the clipping range of the probability ratio)",
             key=("epsilon", "epsilon_high"))
    if r.beta < 0:
        fail(f"beta must be >= 0 (got {r.beta})", key="beta")
    if r.num_iterations < 1:
        fail(f"num_iterations must be >= 1 (got {r.num_iterations})", key="num_iterations")
    if cfg.method.precompute_ref_log_probs:
        fail(f"precompute_ref_log_probs: stage {stage.name} samples its completions during training, so their "
             f"reference log-probs cannot be computed beforehand; drop it", key="precompute_ref_log_probs")
    if stage.critic:
        _check_ppo(r, fail)
    from tuneforge.rewards import check_rewards  # the rewards' own rules: names, imports, the reward model

    check_rewards(cfg)


def _check_stage_keys(cfg: RunConfig, fail: Callable[..., None]) -> None:
    """A key only another stage reads, set away from its default, would be ignored: refuse it."""
    mine, values, defaults = stage_of(cfg.method.stage).own_keys, cfg.to_dict(), RunConfig().to_dict()
    for other in STAGES.values():
        for key in other.own_keys:
            if key not in mine and values[key] != defaults[key]:
                owners = [s.name for s in STAGES.values() if key in s.own_keys]
                fail(f"{key} applies to stage{'s' if len(owners) > 1 else ''} {words(owners)}, not "
                     f"{cfg.method.stage}; drop it", key=key)


def _check_ppo(r: RLArgs, fail: Callable[..., None]) -> None:
    for key in ("ppo_epochs", "ppo_buffer_size", "ppo_kl_horizon"):
        if getattr(r, key) < 1:
            fail(f"{key} must be >= 1 (got {getattr(r, key)})", key=key)
    if r.ppo_target <= 0:
        fail(f"ppo_target must be > 0 (got {r.ppo_target}): the KL the adaptive coefficient aims at", key="ppo_target")
    for key in ("ppo_kl_coef", "ppo_vf_coef"):
        if getattr(r, key) < 0:
            fail(f"{key} must be >= 0 (got {getattr(r, key)})", key=key)
    for key in ("ppo_gamma", "ppo_lam"):
        if not 0 <= getattr(r, key) <= 1:
            fail(f"{key} must be in [0, 1] (got {getattr(r, key)})", key=key)
    if r.ppo_value_clip <= 0:
        fail(f"ppo_value_clip must be > 0 (got {r.ppo_value_clip})", key="ppo_value_clip")
