"""The RL stages' rules (grpo; ppo later), checked with the rest of the config before anything loads."""

from __future__ import annotations

from collections.abc import Callable

from tuneforge.config.schema import RunConfig
from tuneforge.stages import stage_of, stages_where, words

REWARD_KEYS = ("reward_funcs", "reward_model")


def check_rl(cfg: RunConfig, fail: Callable[..., None]) -> None:
    r, t, g = cfg.rl, cfg.train, cfg.generate
    stage = stage_of(cfg.method.stage)
    if not stage.samples:
        for key in REWARD_KEYS:
            if getattr(r, key):
                fail(f"{key} is for the stages that sample ({words(stages_where(lambda s: s.samples))}); stage "
                     f"{stage.name} does not sample, so drop {key}", key=key)
        return
    if r.num_generations < 2:
        fail(f"num_generations must be >= 2 (got {r.num_generations}): advantages compare the completions of a "
             f"prompt with each other", key="num_generations")
    if r.max_completion_length < 1:
        fail(f"max_completion_length must be >= 1 (got {r.max_completion_length})", key="max_completion_length")
    if r.max_completion_length >= cfg.data.cutoff_len:
        fail(f"max_completion_length {r.max_completion_length} leaves no room for the prompt in cutoff_len "
             f"{cfg.data.cutoff_len}; raise cutoff_len or lower max_completion_length",
             key=("max_completion_length", "cutoff_len"))
    if not g.do_sample or g.temperature <= 0:
        fail(f"stage {stage.name} samples num_generations different answers per prompt: set do_sample: true and "
             f"temperature > 0 (e.g. 1.0)", key=("do_sample", "temperature"))
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
    if r.num_iterations > 1 and t.save_strategy == "steps" and t.save_steps % r.num_iterations:
        fail(f"save_steps {t.save_steps} must be a multiple of num_iterations {r.num_iterations}: a checkpoint "
             f"falls between batches of sampled completions, so that a resumed run samples what this one would",
             key=("save_steps", "num_iterations"))
    if cfg.method.precompute_ref_log_probs:
        fail(f"precompute_ref_log_probs: stage {stage.name} samples its completions during training, so their "
             f"reference log-probs cannot be computed beforehand; drop it", key="precompute_ref_log_probs")
    from tuneforge.rewards import check_rewards  # the rewards' own rules: names, imports, the reward model

    check_rewards(cfg)
