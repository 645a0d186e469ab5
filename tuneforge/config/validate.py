"""Cross-field checks that run before any model or data loads."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from tuneforge.config.deepspeed import DEEPSPEED_CHECKPOINT, DEEPSPEED_LAYOUT, deepspeed_settings
from tuneforge.config.fsdp import SHARDED_CHECKPOINT, fsdp_settings
from tuneforge.config.kernels import check_kernels
from tuneforge.config.low_memory import check_low_memory
from tuneforge.config.new_tokens import check_new_tokens
from tuneforge.config.optimizers import OPTIMIZERS, check_optimizer
from tuneforge.config.processes import planned_processes
from tuneforge.config.rl import check_rl
from tuneforge.config.schedules import check_scheduler
from tuneforge.config.schema import RunConfig
from tuneforge.config.tracking import check_tracking
from tuneforge.errors import ConfigError
from tuneforge.stages import (
    REFERENCE_BY_ASFT,
    REFERENCE_BY_KL,
    REFERENCE_NEVER,
    STAGES,
    built_stages,
    preference_problem,
    stage_of,
    stages_where,
    words,
)
from tuneforge.stages import uses_reference as stage_uses_reference

CHECKPOINT_PREFIX = "checkpoint-"


def checkpoints_in(output_dir: str | Path) -> list[Path]:
    """Finished checkpoint folders in output_dir, oldest first (by step number)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = p.name[len(CHECKPOINT_PREFIX):]
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and step.isdigit():
            found.append((int(step), p))
    return [p for _, p in sorted(found)]


def validate(cfg: RunConfig, *, for_training: bool = True) -> None:
    """Raise ConfigError for the first combination that cannot work, saying what to change."""
    m, me, d, t = cfg.model, cfg.method, cfg.data, cfg.train
    src = cfg.source

    def fail(msg: str, key: str | tuple[str, ...] | None = None) -> None:
        raise ConfigError(f"{src}: {msg}", key=key)

    if not m.model_name_or_path:
        fail("model_name_or_path is required (a local folder, a hub id, or smollm2-135m-instruct)", key="model_name_or_path")
    if me.stage not in STAGES:  # a RunConfig built in code skips the loader's choices check
        fail(f"stage '{me.stage}' is not a stage; available: {', '.join(built_stages())}", key="stage")
    if stage_of(me.stage).planned:
        fail(f"stage '{me.stage}' is not implemented yet; available: {', '.join(built_stages())}", key="stage")

    # method
    if me.lora_rank <= 0:
        fail(f"lora_rank must be > 0 (got {me.lora_rank})", key="lora_rank")
    if me.lora_alpha is not None and me.lora_alpha <= 0:
        fail(f"lora_alpha must be > 0 (got {me.lora_alpha})", key="lora_alpha")
    if not 0.0 <= me.lora_dropout < 1.0:
        fail(f"lora_dropout must be in [0, 1) (got {me.lora_dropout})", key="lora_dropout")
    if me.loraplus_lr_ratio is not None and me.loraplus_lr_ratio <= 0:
        fail(f"loraplus_lr_ratio must be > 0 (got {me.loraplus_lr_ratio})", key="loraplus_lr_ratio")
    if me.finetuning_type == "oft" and (me.oft_rank > 0) == (me.oft_block_size > 0):
        fail("oft: set exactly one of oft_rank and oft_block_size > 0 (the other 0)", key=("oft_rank", "oft_block_size"))
    if me.use_dora and me.pissa_init:
        fail("use_dora and pissa_init cannot be combined; choose one", key=("use_dora", "pissa_init"))
    if me.use_llama_pro:
        if me.finetuning_type == "full":
            fail("use_llama_pro trains only the added blocks: use finetuning_type freeze (the blocks) or lora / oft "
                 "(adapters on them), not full", key=("use_llama_pro", "finetuning_type"))
        if me.freeze_trainable_layers <= 0:
            fail(f"use_llama_pro: freeze_trainable_layers is the number of blocks `tuneforge llama-pro` added "
                 f"(--num-expand), > 0 (got {me.freeze_trainable_layers})",
                 key=("use_llama_pro", "freeze_trainable_layers"))
    if m.quantization_bit is not None:
        if me.finetuning_type not in ("lora", "oft"):
            fail(
                f"quantization_bit {m.quantization_bit} needs finetuning_type lora or oft "
                f"(a quantized base cannot be trained with '{me.finetuning_type}')", key=("quantization_bit", "finetuning_type")
            )
        if me.pissa_init:
            fail("pissa_init cannot initialize from a quantized base; drop quantization_bit or pissa_init", key=("pissa_init", "quantization_bit"))
        if importlib.util.find_spec("bitsandbytes") is None:
            fail("quantization_bit needs bitsandbytes: pip install 'tuneforge[qlora]'", key="quantization_bit")
    if m.flash_attn == "fa2" and importlib.util.find_spec("flash_attn") is None:
        fail("flash_attn: fa2 needs the flash-attn package; use flash_attn: sdpa or install flash-attn", key="flash_attn")
    if m.adapter_name_or_path and me.finetuning_type not in ("lora", "oft"):
        fail("adapter_name_or_path needs finetuning_type lora or oft", key=("adapter_name_or_path", "finetuning_type"))
    if not 0 < m.image_min_pixels <= m.image_max_pixels:
        fail(f"image_min_pixels must be > 0 and at most image_max_pixels (got {m.image_min_pixels} and "
             f"{m.image_max_pixels})", key=("image_min_pixels", "image_max_pixels"))
    if m.audio_sampling_rate <= 0:
        fail(f"audio_sampling_rate must be > 0 (got {m.audio_sampling_rate})", key="audio_sampling_rate")
    if not 0 < m.video_min_pixels <= m.video_max_pixels:
        fail(f"video_min_pixels must be > 0 and at most video_max_pixels (got {m.video_min_pixels} and "
             f"{m.video_max_pixels})", key=("video_min_pixels", "video_max_pixels"))
    if m.video_fps <= 0 or m.video_maxlen < 1:
        fail(f"video_fps must be > 0 and video_maxlen at least 1 (got {m.video_fps} and {m.video_maxlen})",
             key=("video_fps", "video_maxlen"))
    check_new_tokens(cfg, fail)
    _check_preference(cfg, fail)
    check_rl(cfg, fail)
    if for_training and t.do_train:  # chat / export / eval of a run trained under DeepSpeed do not need it
        deepspeed_settings(cfg)
    _check_fsdp(cfg, fail, for_training)
    _check_long_context(cfg, fail, for_training)

    # data
    if for_training and t.do_train and not d.dataset and not d.tokenized_path:
        fail("dataset is required for training (names from dataset_info.json, comma-separated)", key="dataset")
    if d.cutoff_len <= 0:
        fail(f"cutoff_len must be > 0 (got {d.cutoff_len})", key="cutoff_len")
    if d.max_samples is not None and d.max_samples <= 0:
        fail(f"max_samples must be > 0 (got {d.max_samples})", key="max_samples")
    if d.val_size < 0 or (d.val_size >= 1 and not float(d.val_size).is_integer()):
        fail(f"val_size must be a share in [0, 1) or a whole number of rows (got {d.val_size})", key="val_size")
    if d.interleave_probs is not None:
        if d.mix_strategy == "concat":
            fail("interleave_probs needs mix_strategy interleave_under or interleave_over", key=("interleave_probs", "mix_strategy"))
        if len(d.interleave_probs) != len(d.dataset or []):
            fail(f"interleave_probs has {len(d.interleave_probs)} values for {len(d.dataset or [])} datasets", key="interleave_probs")
        if abs(sum(d.interleave_probs) - 1.0) > 1e-6 or min(d.interleave_probs) < 0:
            fail(f"interleave_probs must be >= 0 and sum to 1 (got {d.interleave_probs})", key="interleave_probs")
    if d.train_on_prompt and d.mask_history:
        fail("mask_history supervises only the last answer and train_on_prompt every token; choose one", key=("train_on_prompt", "mask_history"))
    if d.eval_dataset and d.val_size > 0:
        fail(f"val_size {d.val_size} splits the training data, but eval_dataset is set too; drop one of them", key=("val_size", "eval_dataset"))
    if d.preprocessing_num_workers is not None and d.preprocessing_num_workers < 1:
        fail("preprocessing_num_workers must be >= 1", key="preprocessing_num_workers")

    # training
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                "logging_steps", "save_steps"):
        if getattr(t, key) < 1:
            fail(f"{key} must be >= 1 (got {getattr(t, key)})", key=key)
    if t.learning_rate <= 0:
        fail(f"learning_rate must be > 0 (got {t.learning_rate})", key="learning_rate")
    if t.max_steps <= 0 and t.num_train_epochs <= 0:
        fail("set num_train_epochs > 0 or max_steps > 0", key=("num_train_epochs", "max_steps"))
    if not 0.0 <= t.warmup_ratio <= 1.0:
        fail(f"warmup_ratio must be in [0, 1] (got {t.warmup_ratio})", key="warmup_ratio")
    if t.warmup_steps < 0 or t.weight_decay < 0 or t.max_grad_norm < 0:
        fail("warmup_steps, weight_decay and max_grad_norm must be >= 0", key=("warmup_steps", "weight_decay", "max_grad_norm"))
    if t.bf16 and t.fp16:
        fail("bf16 and fp16 are both true; choose one", key=("bf16", "fp16"))
    if t.ddp_timeout < 1 or t.data_wait_timeout < 1:
        fail("ddp_timeout and data_wait_timeout are seconds and must be >= 1", key=("ddp_timeout", "data_wait_timeout"))
    if t.eval_steps is not None and t.eval_steps < 1:
        fail(f"eval_steps must be >= 1 (got {t.eval_steps})", key="eval_steps")
    has_eval = bool(d.eval_dataset) or d.val_size > 0  # training's evaluation (tuneforge eval falls back to dataset)
    if for_training and t.eval_strategy != "no" and not has_eval:
        fail(f"eval_strategy {t.eval_strategy} needs evaluation data: set val_size or eval_dataset", key="eval_strategy")
    if for_training and t.eval_on_start and not has_eval:
        fail("eval_on_start needs evaluation data: set val_size or eval_dataset", key="eval_on_start")
    if (t.save_strategy == "best" or t.load_best_model_at_end) and t.eval_strategy == "no":
        fail("save_strategy: best and load_best_model_at_end rank evaluations: set eval_strategy (steps or epoch) "
             "and val_size or eval_dataset", key=("eval_strategy", "save_strategy", "load_best_model_at_end"))
    if t.load_best_model_at_end and t.save_strategy not in ("best", t.eval_strategy):
        fail(f"load_best_model_at_end needs a checkpoint at every evaluation: set save_strategy: best (or "
             f"{t.eval_strategy}, as eval_strategy)", key=("load_best_model_at_end", "save_strategy"))
    if (t.load_best_model_at_end and t.save_strategy == "steps" == t.eval_strategy
            and t.save_steps % (t.eval_steps or t.logging_steps)):
        fail(f"load_best_model_at_end needs a checkpoint at every evaluation: save_steps {t.save_steps} must be a "
             f"multiple of eval_steps {t.eval_steps or t.logging_steps}", key=("save_steps", "eval_steps"))
    if t.early_stopping_steps is not None:
        if t.early_stopping_steps < 1:
            fail("early_stopping_steps must be >= 1", key="early_stopping_steps")
        if t.eval_strategy == "no":
            fail("early_stopping_steps watches the evaluation (metric_for_best_model, default eval_loss): set "
                 "eval_strategy: steps and val_size or eval_dataset", key=("early_stopping_steps", "eval_strategy"))
    check_tracking(cfg, fail, for_training)  # report_to's trackers, the hub keys' values
    if not 0.0 <= t.label_smoothing_factor < 1.0:
        fail(f"label_smoothing_factor must be in [0, 1) (got {t.label_smoothing_factor})", key="label_smoothing_factor")
    _check_token_loss(cfg, fail)
    check_scheduler(cfg, fail)
    check_optimizer(cfg, fail)
    check_kernels(cfg, fail, for_training)  # torch_compile, tf32, liger-kernel, fp8: what they need
    if for_training and t.do_train:
        check_low_memory(cfg, fail)

    _check_ray(cfg, fail)
    if d.streaming and for_training and t.do_train:
        _check_streaming(cfg, fail)

    if for_training and t.do_train:
        _check_output_dir(cfg, fail)


def _check_streaming(cfg: RunConfig, fail) -> None:
    """What a streamed run needs: a length (max_steps) and nothing that reads the whole training set first."""
    d, t = cfg.data, cfg.train
    if t.max_steps <= 0:
        fail("streaming has no length to count epochs in: set max_steps (the optimizer steps to train)",
             key=("streaming", "max_steps"))
    if d.buffer_size < 1:
        fail(f"buffer_size must be >= 1 (got {d.buffer_size})", key="buffer_size")
    if d.val_size > 0:
        fail("streaming cannot hold out val_size rows of a stream; name the evaluation data in eval_dataset",
             key=("streaming", "val_size"))
    if d.tokenized_path:
        fail("streaming tokenizes while training, so there is nothing to save in tokenized_path; drop one of them",
             key=("streaming", "tokenized_path"))
    if stage_of(cfg.method.stage).samples:
        fail(f"stage {cfg.method.stage} samples answers to prompts, which are few; set streaming: false",
             key=("streaming", "stage"))
    if cfg.method.precompute_ref_log_probs:
        fail("precompute_ref_log_probs computes the reference over the whole training set first; it cannot with "
             "streaming", key=("streaming", "precompute_ref_log_probs"))


def _check_token_loss(cfg: RunConfig, fail) -> None:
    """At most one of the sft loss variants, not with label smoothing; their alphas and NEFTune's in range."""
    me, t = cfg.method, cfg.train
    chosen = [k for k in ("use_dft_loss", "use_eaft_loss", "use_asft_loss") if getattr(me, k)]
    if len(chosen) > 1:
        fail(f"{' and '.join(chosen)} are different losses; choose one", key=tuple(chosen))
    if chosen and t.label_smoothing_factor:
        fail(f"{chosen[0]} weights each token's plain cross-entropy; it does not smooth labels: drop "
             f"label_smoothing_factor", key=(chosen[0], "label_smoothing_factor"))
    for key in ("eaft_alpha", "asft_alpha"):
        if getattr(me, key) < 0 or not math.isfinite(getattr(me, key)):
            fail(f"{key} must be a finite number >= 0 (got {getattr(me, key)})", key=key)
    if t.neftune_noise_alpha is not None and not (t.neftune_noise_alpha >= 0 and math.isfinite(t.neftune_noise_alpha)):
        fail(f"neftune_noise_alpha must be a finite number >= 0 (got {t.neftune_noise_alpha}); LlamaFactory's "
             f"examples use 5", key="neftune_noise_alpha")


def uses_reference(cfg: RunConfig) -> bool:
    """True when the stage's loss compares the policy with a reference model (the stage table's row says
    always, never, as its pref_loss row says (dpo except orpo / simpo; kto), or when beta > 0 (grpo))."""
    return stage_uses_reference(cfg.method.stage, cfg.method.pref_loss, cfg.rl.beta, cfg.method.use_asft_loss)


def _check_preference(cfg: RunConfig, fail) -> None:
    """The stage's rules from its row, and the objectives' rules for the preference keys (the one place of
    those: stages.preference_problem, which the objectives' constructors only re-assert)."""
    me, d = cfg.method, cfg.data
    stage = stage_of(me.stage)
    if not stage.can_pack and (d.packing or d.neat_packing):
        fail(f"packing joins samples into one row; stage {me.stage} compares whole sequences, so set packing: false", key="packing")
    problem = preference_problem(
        pref_loss=me.pref_loss, pref_beta=me.pref_beta, pref_ftx=me.pref_ftx, simpo_gamma=me.simpo_gamma,
        dpo_label_smoothing=me.dpo_label_smoothing, kto_chosen_weight=me.kto_chosen_weight,
        kto_rejected_weight=me.kto_rejected_weight,
    )
    if problem:
        fail(problem, key=problem.keys)
    if me.ref_model_adapters and not me.ref_model:
        fail("ref_model_adapters needs ref_model (the base model the adapters belong to)", key=("ref_model_adapters", "ref_model"))
    if me.ref_model_quantization_bit is not None:
        if not me.ref_model:
            fail("ref_model_quantization_bit applies to ref_model (without one, the reference is the initial policy "
                 "as it loads); set ref_model or drop ref_model_quantization_bit",
                 key=("ref_model_quantization_bit", "ref_model"))
        if cfg.train.fsdp or cfg.train.deepspeed:
            fail("ref_model_quantization_bit with fsdp / deepspeed is not supported yet (the strategies shard the "
                 "reference, and bitsandbytes' weights do not shard); run without it, or under DDP",
                 key="ref_model_quantization_bit")
        if importlib.util.find_spec("bitsandbytes") is None:
            fail("ref_model_quantization_bit needs bitsandbytes: pip install 'tuneforge[qlora]'",
                 key="ref_model_quantization_bit")
    if stage.reference == REFERENCE_NEVER:
        if me.ref_model or me.precompute_ref_log_probs:
            key = "ref_model" if me.ref_model else "precompute_ref_log_probs"
            with_reference = words(stages_where(lambda s: s.reference != REFERENCE_NEVER))
            fail(f"{key} is for stages {with_reference}; stage {me.stage} has no reference model", key=key)
        return
    if not uses_reference(cfg):
        if me.ref_model or me.precompute_ref_log_probs:
            key = "ref_model" if me.ref_model else "precompute_ref_log_probs"
            if stage.reference == REFERENCE_BY_KL:
                fail(f"stage {me.stage} uses a reference only for its KL penalty, and beta is 0; set beta > 0 or "
                     f"drop {key}", key=(key, "beta"))
            if stage.reference == REFERENCE_BY_ASFT:
                fail(f"stage {me.stage} uses a reference only for ASFT's KL (use_asft_loss); set use_asft_loss: true "
                     f"or drop {key}", key=(key, "use_asft_loss"))
            fail(f"pref_loss {me.pref_loss} uses no reference model; drop {key}", key=key)
        return
    if me.use_asft_loss and me.precompute_ref_log_probs:
        fail("ASFT's KL compares the whole next-token distributions with the reference's, which cannot be precomputed "
             "as log-probs; drop precompute_ref_log_probs", key=("use_asft_loss", "precompute_ref_log_probs"))
    if me.pissa_init and me.finetuning_type == "lora" and not me.ref_model:
        fail(
            "with pissa_init the policy without its adapter is the residual of the base, not the base, so it "
            "cannot be the reference; set ref_model: to the base model, or drop pissa_init", key=("pissa_init", "ref_model")
        )


def _check_ray(cfg: RunConfig, fail) -> None:
    """The Ray keys' values; whether Ray is installed and no torchrun competes is checked when a run starts
    (tuneforge/train/ray_launch.py), since USE_RAY=1 in the environment asks for Ray too."""
    r = cfg.ray
    if r.ray_num_workers < 1:
        fail(f"ray_num_workers must be >= 1 (got {r.ray_num_workers}): the number of Ray Train workers", key="ray_num_workers")
    for name, amount in r.resources_per_worker.items():
        if name in ("cpu", "gpu"):
            fail(f"resources_per_worker: Ray's resource names are case-sensitive; write {name.upper()}, not {name}", key="resources_per_worker")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            fail(f"resources_per_worker: {name} must be a number >= 0 (got {amount!r}), e.g. {{CPU: 4, GPU: 1}}", key="resources_per_worker")


def _check_output_dir(cfg: RunConfig, fail) -> None:
    t = cfg.train
    if not t.output_dir:
        fail("output_dir is required (where checkpoints and the final model go)", key="output_dir")
    resume = t.resume_from_checkpoint
    if isinstance(resume, str):
        if not Path(resume).is_dir():
            fail(f"resume_from_checkpoint: {resume} is not a folder; point it at a checkpoint-N folder", key="resume_from_checkpoint")
        _check_checkpoint_kind(cfg, Path(resume), fail)
        return
    found = checkpoints_in(t.output_dir)
    if resume is True and not found:
        fail(f"resume_from_checkpoint: true, but {t.output_dir} holds no checkpoint-N folder", key="resume_from_checkpoint")
    if resume is True and found:
        _check_checkpoint_kind(cfg, found[-1], fail)
    if found and resume is not True and not t.overwrite_output_dir:
        fail(
            f"output_dir {t.output_dir} already holds checkpoints (latest: {found[-1].name}). "
            f"To continue that run set resume_from_checkpoint: true; to start afresh set "
            f"overwrite_output_dir: true, or choose another output_dir", key=("output_dir", "resume_from_checkpoint", "overwrite_output_dir")
        )


def _check_fsdp(cfg: RunConfig, fail, for_training: bool) -> None:
    settings = fsdp_settings(cfg)
    if settings is None:
        return
    m, me, t = cfg.model, cfg.method, cfg.train
    if t.fp16:
        fail("fsdp with fp16 needs a loss scaler over sharded gradients, which tuneforge does not have; use "
             "bf16: true (or fp32)", key=("fsdp", "fp16"))
    if m.quantization_bit == 8:
        fail("fsdp with quantization_bit 8: bitsandbytes' 8-bit weights cannot be gathered into a checkpoint; "
             "use quantization_bit: 4", key=("fsdp", "quantization_bit"))
    spec = OPTIMIZERS.get(t.optim)
    if spec is not None and not spec.sharded:
        fail(f"optim {t.optim} cannot step FSDP2's sharded weights (its kernels take whole tensors); use adamw_torch, "
             f"adamw_torch_8bit / adamw_torch_4bit (torchao) for low-memory states, or DeepSpeed ZeRO "
             f"(deepspeed: ...) instead of fsdp", key=("optim", "fsdp"))
    if me.pissa_init:
        fail("fsdp with pissa_init is not supported (the PiSSA conversion needs the whole adapter in one "
             "process); drop pissa_init or fsdp", key=("fsdp", "pissa_init"))
    if for_training and t.do_train and planned_processes(cfg) == 1:
        fail("fsdp shards the model over several processes, but this run starts one; start several "
             "(FORCE_TORCHRUN=1 NPROC_PER_NODE=2, several GPUs, or ray_num_workers: 2 with Ray) or set fsdp: false", key="fsdp")


def _check_long_context(cfg: RunConfig, fail, for_training: bool) -> None:
    """What shift_attn (model/shifted_attention.py) and sequence parallelism (train/sequence_parallel.py) support,
    said before anything loads."""
    if cfg.model.shift_attn:
        if cfg.method.stage not in ("pt", "sft"):
            fail(f"shift_attn trains stages pt and sft (plain sequences), not {cfg.method.stage}", key="shift_attn")
        if not cfg.data.padding_free or cfg.model.flash_attn not in ("auto", "sdpa"):
            fail("shift_attn runs on padding-free rows with sdpa: set padding_free: true and flash_attn: auto",
                 key=("shift_attn", "padding_free", "flash_attn"))
        if cfg.train.sequence_parallel_size > 1:
            fail("shift_attn and sequence_parallel_size > 1 cannot be combined (each replaces the attention); choose "
                 "one", key=("shift_attn", "sequence_parallel_size"))
    size = cfg.train.sequence_parallel_size
    if size < 1:
        fail(f"sequence_parallel_size must be >= 1 (got {size})", key="sequence_parallel_size")
    if size == 1:
        return
    why = None
    if cfg.method.stage not in ("pt", "sft"):
        why = f"stage {cfg.method.stage}: it runs the lm objective of stages pt and sft"
    elif not cfg.data.padding_free:
        why = "it splits padding-free rows: set padding_free: true"
    elif cfg.train.deepspeed or cfg.train.fsdp:
        why = "it runs under DDP here, not yet with deepspeed or fsdp: remove them"
    elif cfg.model.flash_attn not in ("auto", "sdpa"):
        why = "its attention is the padding-free sdpa: set flash_attn: auto or sdpa"
    elif cfg.train.compute_accuracy:
        why = "compute_accuracy scores whole samples, which the shards split: set compute_accuracy: false"
    elif cfg.train.neftune_noise_alpha:
        why = "NEFTune scales its noise by each sample's length, which a shard does not see whole: drop " \
              "neftune_noise_alpha"
    processes = planned_processes(cfg) if for_training and cfg.train.do_train else None
    if not why and processes is not None and processes % size:
        why = (f"this run starts {processes} process(es), which sequence groups of {size} cannot divide; start a "
               f"multiple of {size} (FORCE_TORCHRUN=1 NPROC_PER_NODE={size})")
    if why:
        fail(f"sequence_parallel_size {size}: {why}", key="sequence_parallel_size")


def _check_checkpoint_kind(cfg: RunConfig, folder: Path, fail) -> None:
    """A checkpoint resumes under the strategy that wrote it: sharded (fsdp), DeepSpeed's, or whole."""
    written_by_deepspeed = (folder / DEEPSPEED_CHECKPOINT).is_dir()
    if written_by_deepspeed != bool(cfg.train.deepspeed) and (folder / "trainer_state.json").is_file():
        fail(f"{folder} was written {'with' if written_by_deepspeed else 'without'} deepspeed; resume it "
             f"{'with the same deepspeed config' if written_by_deepspeed else 'without deepspeed'}, or start afresh", key=("resume_from_checkpoint", "deepspeed"))
    layout = folder / DEEPSPEED_LAYOUT
    if written_by_deepspeed and layout.is_file():
        saved = json.loads(layout.read_text()).get("processes")
        planned = planned_processes(cfg)  # (resuming: a training run)
        if saved and planned and saved != planned:
            fail(f"{folder} holds ZeRO partitions cut for {saved} processes, but this run starts {planned}; resume "
                 f"it on {saved} processes (e.g. FORCE_TORCHRUN=1 NPROC_PER_NODE={saved}), or start afresh", key="resume_from_checkpoint")
    sharded = (folder / SHARDED_CHECKPOINT).is_dir()
    if sharded and not cfg.train.fsdp:
        fail(f"{folder} is a sharded checkpoint of an fsdp run; resume it with the same fsdp setting", key=("resume_from_checkpoint", "fsdp"))
    if cfg.train.fsdp and folder.is_dir() and (folder / "trainer_state.json").is_file() and not sharded:
        fail(f"{folder} was written without fsdp; resume it without fsdp (drop fsdp), or start afresh", key=("resume_from_checkpoint", "fsdp"))
