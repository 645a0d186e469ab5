"""Cross-field checks: every combination that cannot work fails before any model or data loads."""

import pytest

from tuneforge.config import checkpoints_in, from_dict
from tuneforge.errors import ConfigError


def cfg(tmp_path, **kw):
    return from_dict({"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "out"), **kw})


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"model_name_or_path": None}, "model_name_or_path is required"),
        ({"stage": "ppo"}, "stage ppo needs a reward: set reward_funcs"),
        ({"stage": "dpo", "ref_model_quantization_bit": 4}, "ref_model_quantization_bit applies to ref_model"),
        ({"stage": "dpo", "ref_model": "m", "ref_model_quantization_bit": 4, "fsdp": "full_shard"},
         "ref_model_quantization_bit with fsdp / deepspeed is not supported yet"),
        ({"stage": "ppo", "reward_funcs": ["length"], "beta": 0.1}, "beta applies to stage grpo, not ppo"),
        ({"stage": "grpo", "reward_funcs": ["length"], "ppo_epochs": 2}, "ppo_epochs applies to stage ppo, not grpo"),
        ({"stage": "sft", "ppo_target": 1.0}, "ppo_target applies to stage ppo, not sft"),
        ({"stage": "ppo", "reward_funcs": ["length"], "ppo_lam": 1.5}, r"ppo_lam must be in \[0, 1\]"),
        ({"stage": "ppo", "reward_funcs": ["length"], "ppo_buffer_size": 0}, "ppo_buffer_size must be >= 1"),
        ({"stage": "ppo", "reward_funcs": ["length"], "max_new_tokens": 4096}, "max_completion_length 4096 leaves no room"),
        ({"lora_rank": 0}, "lora_rank must be > 0"),
        ({"image_max_pixels": 100, "image_min_pixels": 200}, "image_min_pixels must be > 0 and at most image_max"),
        ({"audio_sampling_rate": 0}, "audio_sampling_rate must be > 0"),
        ({"video_max_pixels": 100, "video_min_pixels": 200}, "video_min_pixels must be > 0 and at most video_max"),
        ({"video_maxlen": 0}, "video_maxlen at least 1"),
        ({"lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
        ({"finetuning_type": "full", "quantization_bit": 4}, "quantization_bit 4 needs finetuning_type lora"),
        ({"finetuning_type": "freeze", "quantization_bit": 8}, "needs finetuning_type lora or oft"),
        ({"finetuning_type": "oft", "oft_rank": 4, "oft_block_size": 32}, "exactly one of oft_rank"),
        ({"use_dora": True, "pissa_init": True}, "cannot be combined"),
        ({"bf16": True, "fp16": True}, "choose one"),
        ({"dataset": None}, "dataset is required"),
        ({"cutoff_len": 0}, "cutoff_len must be > 0"),
        ({"val_size": 1.5}, "val_size must be"),
        ({"learning_rate": 0}, "learning_rate must be > 0"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be >= 1"),
        ({"eval_strategy": "steps"}, "needs evaluation data"),
        ({"early_stopping_steps": 3}, "early_stopping_steps watches the evaluation"),
        ({"interleave_probs": "0.5,0.5"}, "needs mix_strategy interleave"),
        ({"mix_strategy": "interleave_under", "interleave_probs": "0.7,0.7", "dataset": "a,b"}, "sum to 1"),
        ({"report_to": "comet_ml"}, "report_to: 'comet_ml' is not one of"),
        ({"adapter_name_or_path": "a", "finetuning_type": "full"}, "adapter_name_or_path needs"),
        ({"max_steps": -1, "num_train_epochs": 0}, "num_train_epochs > 0 or max_steps > 0"),
        ({"train_on_prompt": True, "mask_history": True}, "choose one"),
        ({"val_size": 0.1, "eval_dataset": "e"}, "eval_dataset is set too"),
        # preference stages
        ({"stage": "dpo", "packing": True}, "stage dpo compares whole sequences, so set packing: false"),
        ({"stage": "rm", "neat_packing": True}, "set packing: false"),
        ({"stage": "dpo", "pref_beta": 0}, "pref_beta must be > 0"),
        ({"stage": "kto", "pref_beta": -0.1}, "pref_beta must be > 0"),
        ({"stage": "dpo", "dpo_label_smoothing": 0.6}, r"dpo_label_smoothing must be in \[0, 0.5\)"),
        ({"stage": "dpo", "dpo_label_smoothing": 0.5}, r"dpo_label_smoothing must be in \[0, 0.5\)"),
        ({"stage": "dpo", "pref_loss": "ipo", "dpo_label_smoothing": 0.1}, "sigmoid only"),
        ({"stage": "kto", "kto_rejected_weight": 0}, "must be > 0"),
        ({"stage": "dpo", "ref_model_adapters": "a"}, "ref_model_adapters needs ref_model"),
        ({"stage": "pt", "ref_model": "m"}, "ref_model is for stages sft, ppo, dpo, kto and grpo"),
        ({"stage": "rm", "precompute_ref_log_probs": True}, "stage rm has no reference model"),
        ({"stage": "dpo", "pref_loss": "simpo", "ref_model": "m"}, "simpo uses no reference model"),
        ({"stage": "dpo", "pref_loss": "orpo", "precompute_ref_log_probs": True}, "orpo uses no reference"),
        ({"stage": "dpo", "pissa_init": True}, "set ref_model: to the base model"),
    ],
)
def test_combination_that_cannot_work(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        cfg(tmp_path, **kw)


def test_output_dir_with_checkpoints_says_how_to_resume(tmp_path):
    (tmp_path / "out" / "checkpoint-20").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-100").mkdir()
    with pytest.raises(ConfigError, match="latest: checkpoint-100.*resume_from_checkpoint: true.*overwrite_output_dir"):
        cfg(tmp_path)
    assert cfg(tmp_path, resume_from_checkpoint=True).train.resume_from_checkpoint is True
    assert cfg(tmp_path, overwrite_output_dir=True).train.overwrite_output_dir is True
    assert [p.name for p in checkpoints_in(tmp_path / "out")] == ["checkpoint-20", "checkpoint-100"]


def test_resume_needs_something_to_resume(tmp_path):
    with pytest.raises(ConfigError, match="holds no checkpoint-N folder"):
        cfg(tmp_path, resume_from_checkpoint=True)
    with pytest.raises(ConfigError, match="is not a folder"):
        cfg(tmp_path, resume_from_checkpoint=str(tmp_path / "missing"))
    ckpt = tmp_path / "elsewhere" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    assert cfg(tmp_path, resume_from_checkpoint=str(ckpt)).train.resume_from_checkpoint == str(ckpt)


def test_a_good_config_passes_with_defaults(tmp_path):
    c = cfg(tmp_path)
    assert (c.method.stage, c.method.finetuning_type, c.method.lora_rank) == ("sft", "lora", 8)
    assert c.model.trust_remote_code is False and c.data.cutoff_len == 2048


def test_pref_loss_lists_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="pref_loss.*sigmoid, hinge, ipo, orpo, simpo"):
        cfg(tmp_path, stage="dpo", pref_loss="dpop")


def test_preference_defaults_are_llamafactorys(tmp_path):
    m = cfg(tmp_path, stage="dpo").method
    assert (m.pref_loss, m.pref_beta, m.pref_ftx, m.simpo_gamma, m.dpo_label_smoothing) == ("sigmoid", 0.1, 0.0, 0.5, 0.0)
    assert (m.kto_chosen_weight, m.kto_rejected_weight, m.precompute_ref_log_probs) == (1.0, 1.0, False)
    assert cfg(tmp_path, stage="dpo", pissa_init=True, ref_model="base").method.ref_model == "base"


@pytest.mark.parametrize(
    ("kw", "keys"),
    [
        ({"lora_rank": 0}, ("lora_rank",)),
        ({"bf16": True, "fp16": True}, ("bf16", "fp16")),
        ({"per_device_eval_batch_size": 0}, ("per_device_eval_batch_size",)),
        ({"stage": "sft", "ref_model": "m"}, ("ref_model", "use_asft_loss")),
        ({"stage": "pt", "ref_model": "m"}, ("ref_model",)),
        ({"learnig_rate": 1e-4}, ("learnig_rate",)),  # unknown key (the loader)
        ({"cutoff_len": "long"}, ("cutoff_len",)),  # wrong type (the loader)
        ({"deepspeed": "missing.json"}, ("deepspeed",)),
        ({"fsdp": "full_shard", "fsdp_config": {"version": 1}}, ("fsdp_config",)),
    ],
)
def test_errors_carry_the_keys_at_fault(tmp_path, kw, keys):
    """A form points at the field: the key travels with the error, not only in its message."""
    with pytest.raises(ConfigError) as raised:
        cfg(tmp_path, **kw)
    assert raised.value.keys == keys
    assert raised.value.key == keys[0]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"lr_scheduler_type": "linear", "lr_scheduler_kwargs": {"num_cycles": 0.5}},
         r"\['num_cycles'\] do not apply to linear \(it takes: none\)"),
        ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
         r"\['min_lr_rate'\] do not apply to cosine \(it takes: num_cycles\)"),
        ({"lr_scheduler_type": "cosine_with_min_lr"}, "needs lr_scheduler_kwargs with min_lr_rate"),
        ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-6, "min_lr_rate": 0.1}},
         "only one of min_lr and min_lr_rate"),
    ],
)
def test_schedule_arguments_are_checked_when_the_config_loads(tmp_path, kw, message):
    """transformers would refuse these only once the scheduler is built, after tokenizing and loading."""
    with pytest.raises(ConfigError, match=message):
        cfg(tmp_path, **kw)


def test_schedule_arguments_each_schedule_takes(tmp_path):
    assert cfg(tmp_path, lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycles": 1.5})
    assert cfg(tmp_path, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-6})
