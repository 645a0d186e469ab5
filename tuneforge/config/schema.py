"""The run configuration: every YAML key is a field here, grouped by what it configures.

Keys are flat in the YAML file and use LlamaFactory's names; each name lives in exactly one group,
so `cfg.train.learning_rate` is found by grepping for `learning_rate`. Defaults follow LlamaFactory /
Hugging Face where they define one. `choices` in a field's metadata are checked when the file loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tuneforge.config.optimizers import OPTIMIZER_CHOICES
from tuneforge.config.optimizers import REFUSED as REFUSED_OPTIMIZERS
from tuneforge.config.schedules import SCHEDULER_CHOICES
from tuneforge.stages import PREF_LOSS_CHOICES, STAGE_CHOICES


def opt(default: Any = None, *, choices: tuple | None = None, refused: dict | None = None, help: str = "") -> Any:
    """A field with a default, optional choices, and a line of help for the README / errors. refused: values that
    are known but not built -> why (the loader says so instead of "not one of")."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if refused is not None:
        meta["refused"] = refused
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


FINETUNING_TYPES = ("full", "freeze", "lora", "oft")
FLASH_ATTN = ("auto", "disabled", "sdpa", "fa2", "eager")
MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")
INFER_BACKENDS = ("huggingface", "vllm")
INFER_DTYPES = ("auto", "float32", "bfloat16", "float16")
EXPORT_FORMATS = ("safetensors", "gguf")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
SWANLAB_MODES = ("cloud", "online", "local", "offline", "disabled")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
UNSLOTH = ("needs the unsloth package, which replaces transformers' model code with its own CUDA kernels; tuneforge "
           "does not load it. Its LoRA is tuneforge's own (finetuning_type: lora) with gradient checkpointing (per layer by "
           "memory by default); on CUDA, enable_liger_kernel and torch_compile give fused kernels. Remove use_unsloth")
UNSLOTH_GC = ("is Unsloth's gradient checkpointing (saved activations offloaded to CPU memory), which tuneforge does not "
              "have; torch's gradient checkpointing is chosen per layer by memory by default (every layer with "
              "disable_gradient_checkpointing: false). Remove use_unsloth_gc")
MOD = ("needs the mixture-of-depth package, whose last release (1.2.0) does not import with transformers 5 "
       "(it reads transformers.TRANSFORMERS_CACHE, which is gone) and wraps decoder layers by transformers 4's call "
       "convention; remove mixture_of_depths")
FP8_OTHER = "is not supported (Transformer Engine / MS-AMP are not wired in); use fp8_backend: torchao (or auto)"


@dataclass
class ModelArgs:
    model_name_or_path: str | None = opt(help="local folder, hub id, or built-in alias (smollm2-135m-instruct)")
    adapter_name_or_path: list[str] | None = opt(help="adapter folder(s) to load and continue training")
    template: str | None = opt(help="chat template name; default: the tokenizer's own chat_template")
    trust_remote_code: bool = opt(False, help="allow model code from the model folder / hub")
    cache_dir: str | None = opt(help="where hub downloads are cached")
    model_revision: str = opt("main", help="hub revision (branch, tag or commit)")
    hf_hub_token: str | None = opt(help="hub token for downloads (gated / private models and adapters) and "
                                        "export_hub_model_id's upload (default: HF_TOKEN or `hf auth login`'s)")
    resize_vocab: bool = opt(False, help="grow the embeddings (and head) to the tokenizer and train them (on "
                                         "by itself when add_tokens / add_special_tokens add a token)")
    add_tokens: list[str] | None = opt(help="plain tokens to add to the tokenizer, comma-separated")
    add_special_tokens: list[str] | None = opt(help="special tokens to add to the tokenizer, comma-separated (older "
                                                    "name: new_special_tokens)")
    new_special_tokens_config: dict | str | None = opt(help="special tokens with descriptions: a YAML / JSON file (or "
                                                            "a mapping) token -> description; wins over "
                                                            "add_special_tokens")
    init_special_tokens: str = opt("noise_init", choices=("noise_init", "desc_init", "desc_init_w_noise"),
                                   help="new tokens' embedding rows: noise_init (the mean row + noise), desc_init "
                                        "(the mean row of the description's tokens), desc_init_w_noise (that + noise)")
    flash_attn: str = opt("auto", choices=FLASH_ATTN, help="attention: auto (sdpa), disabled/eager, sdpa, fa2")
    use_kernels: bool = opt(False, help="let transformers swap in Hugging Face hub kernels (downloaded code, GPU "
                                        "only; off: transformers' own layers, which work offline)")
    disable_gradient_checkpointing: bool | None = opt(
        None, help="unset (null): per decoder layer from a memory estimate, the fastest the budget holds — "
                   "none, else selective checkpointing (keeps the matrix products' outputs, recomputes the rest), "
                   "else full; false: full on every layer (the least memory); true: off")
    # kernels and precision of the model's own layers (tuneforge/model/kernels.py)
    upcast_layernorm: bool = opt(False, help="keep the norm layers' weights in fp32 when the model loads in bf16 / fp16")
    upcast_lmhead_output: bool = opt(False, help="the vocabulary head's output in fp32 under bf16 / fp16 (tuneforge's "
                                                 "loss already casts each logits chunk to fp32)")
    enable_liger_kernel: bool = opt(False, help="CUDA: patch the model family's layers with liger-kernel's Triton "
                                                "kernels (RMSNorm, SwiGLU, rotary; pip install 'tuneforge[liger]')")
    use_unsloth: bool = opt(False, choices=(False,), refused={True: UNSLOTH}, help="not supported: " + UNSLOTH)
    use_unsloth_gc: bool = opt(False, choices=(False,), refused={True: UNSLOTH_GC}, help="not supported: " + UNSLOTH_GC)
    mixture_of_depths: str | None = opt(None, choices=(None,), refused={"convert": MOD, "load": MOD},
                                        help="not supported: " + MOD)
    # long context
    rope_scaling: str | None = opt(None, choices=(None, "linear", "dynamic", "yarn", "llama3"),
                                   help="stretch RoPE to model_max_length: linear, dynamic (NTK), yarn or llama3")
    model_max_length: int | None = opt(help="the context length rope_scaling stretches the model to "
                                            "(default: cutoff_len)")
    shift_attn: bool = opt(False, help="LongLoRA's shifted sparse attention (S²-Attn) in training: groups of a "
                                       "quarter of each sequence (pt / sft, padding-free)")
    quantization_bit: int | None = opt(None, choices=(None, 4, 8), help="QLoRA: load the base in 4 or 8 bit")
    quantization_type: str = opt("nf4", choices=("nf4", "fp4"), help="4-bit data type")
    double_quantization: bool = opt(True, help="4-bit: quantize the quantization constants too")
    quantization_method: str = opt("bnb", choices=("bnb",), help="quantization backend (bitsandbytes)")
    # vision- / audio-language models: how media are prepared before the model's own processor sees them
    image_max_pixels: int = opt(768 * 768, help="images larger than this many pixels are scaled down to it")
    image_min_pixels: int = opt(32 * 32, help="images smaller than this many pixels are scaled up to it")
    image_do_pan_and_scan: bool = opt(False, help="Gemma 3: also read crops of large images (pan and scan)")
    crop_to_patches: bool = opt(False, help="InternVL-style processors: split images into patches")
    video_max_pixels: int = opt(256 * 256, help="video frames larger than this many pixels are scaled down")
    video_min_pixels: int = opt(16 * 16, help="video frames smaller than this many pixels are scaled up")
    video_fps: float = opt(2.0, help="frames sampled per second of video")
    video_maxlen: int = opt(128, help="at most this many frames per video")
    audio_sampling_rate: int = opt(16000, help="audio is resampled to this rate")
    use_audio_in_video: bool = opt(False, help="omni models (Qwen2.5-Omni): hear each video with its sound (the row's audios, one per video, "
                                    "else the video's own audio track), interleaved with its frames")


@dataclass
class MethodArgs:
    stage: str = opt("sft", choices=STAGE_CHOICES, help="training stage (the rows of tuneforge/stages.py)")
    finetuning_type: str = opt("lora", choices=FINETUNING_TYPES, help="full, freeze, lora or oft")
    lora_rank: int = opt(8, help="LoRA rank r")
    lora_alpha: int | None = opt(None, help="LoRA alpha; default 2 x lora_rank")
    lora_dropout: float = opt(0.0, help="dropout on the LoRA input")
    lora_target: list[str] = opt(["all"], help="modules to adapt: all (every linear but the head) or names")
    additional_target: list[str] | None = opt(help="extra modules trained in full beside the adapter")
    use_dora: bool = opt(False, help="weight-decomposed LoRA")
    use_rslora: bool = opt(False, help="rank-stabilized scaling alpha / sqrt(r)")
    pissa_init: bool = opt(False, help="initialize LoRA from the principal singular vectors")
    pissa_iter: int = opt(16, help="fast-SVD iterations for PiSSA; -1 = exact SVD")
    pissa_convert: bool = opt(True, help="save the PiSSA adapter converted to apply to the original base")
    loraplus_lr_ratio: float | None = opt(help="LoRA+: learning rate of B = ratio x learning_rate")
    loraplus_lr_embedding: float = opt(1e-6, help="LoRA+: learning rate of embedding adapters")
    create_new_adapter: bool = opt(False, help="stack a new adapter on top of adapter_name_or_path")
    freeze_trainable_layers: int = opt(2, help="freeze: train the last N layers (negative: the first N)")
    freeze_trainable_modules: list[str] = opt(["all"], help="freeze: module names inside those layers")
    freeze_extra_modules: list[str] | None = opt(help="freeze: extra modules to train (e.g. embed_tokens)")
    use_llama_pro: bool = opt(False, help="LLaMA Pro: train only the blocks `tuneforge llama-pro` added (freeze: the "
                                          "blocks; lora / oft: adapters on them), freeze_trainable_layers of them")
    oft_rank: int = opt(0, help="OFT rank (number of blocks); set this or oft_block_size")
    oft_block_size: int = opt(32, help="OFT block size; set this or oft_rank")
    oft_target: list[str] = opt(["all"], help="modules to adapt with OFT")
    # vision- / audio-language models (full / freeze): which parts stay frozen
    freeze_vision_tower: bool = opt(True, help="keep the vision / audio encoder frozen")
    freeze_multi_modal_projector: bool = opt(True, help="keep the projector into the language model frozen")
    freeze_language_model: bool = opt(False, help="keep the language model frozen (train the media side only)")
    # preference stages (rm, dpo, kto); orpo and simpo are stage dpo with that pref_loss, as in LlamaFactory
    pref_loss: str = opt("sigmoid", choices=PREF_LOSS_CHOICES, help="dpo loss: sigmoid, hinge, ipo, orpo, simpo")
    pref_beta: float = opt(0.1, help="beta of the preference loss (lambda for orpo)")
    pref_ftx: float = opt(0.0, help="weight of the SFT loss on the chosen answer mixed into dpo")
    simpo_gamma: float = opt(0.5, help="simpo: target reward margin gamma")
    dpo_label_smoothing: float = opt(0.0, help="cDPO: share of preference labels assumed flipped (sigmoid)")
    kto_chosen_weight: float = opt(1.0, help="kto: weight of the desirable samples' loss")
    kto_rejected_weight: float = opt(1.0, help="kto: weight of the undesirable samples' loss")
    ref_model: str | None = opt(help="reference model for dpo / kto / grpo / ppo (default: the initial policy)")
    ref_model_adapters: list[str] | None = opt(help="adapter folder(s) applied to ref_model")
    ref_model_quantization_bit: int | None = opt(None, choices=(None, 4, 8), help="load ref_model in 4 or 8 bit "
                                                 "(bitsandbytes; quantization_type and double_quantization apply)")
    precompute_ref_log_probs: bool = opt(False, help="compute reference log-probs once, cache them, free the reference")
    use_dft_loss: bool = opt(False, help="sft: DFT, each token's cross-entropy weighted by its probability")
    use_eaft_loss: bool = opt(False, help="sft: EAFT, each token's cross-entropy weighted by (top-20 entropy / 3) "
                                          "** eaft_alpha")
    eaft_alpha: float = opt(1.0, help="sft: the exponent of EAFT's entropy weight")
    use_asft_loss: bool = opt(False, help="sft: ASFT, the DFT loss plus asft_alpha x KL(starting model || policy)")
    asft_alpha: float = opt(0.1, help="sft: the weight of ASFT's KL to the starting model")


@dataclass
class DataArgs:
    dataset: list[str] | None = opt(help="dataset name(s) from dataset_info.json, comma-separated")
    eval_dataset: list[str] | None = opt(help="evaluation dataset name(s)")
    eval_on_each_dataset: bool = opt(False, help="evaluate each eval_dataset apart too (eval_<name>_loss, ...)")
    dataset_dir: str = opt("data", help="folder holding dataset_info.json")
    cutoff_len: int = opt(2048, help="maximum tokens per sample (or per packed row)")
    max_samples: int | None = opt(help="use at most this many rows of each dataset")
    val_size: float = opt(0.0, help="hold out this share (0-1) or count (>1) of rows for evaluation")
    train_on_prompt: bool = opt(False, help="supervise prompt tokens too")
    mask_history: bool = opt(False, help="supervise only the last assistant turn")
    packing: bool | None = opt(None, help="pack samples into cutoff_len rows (default: on for pt)")
    neat_packing: bool = opt(False, help="pack without attention across samples (always the case here)")
    padding_free: bool = opt(True, help="train on each micro-batch as one row without padding tokens")
    mix_strategy: str = opt("concat", choices=MIX_STRATEGIES, help="how several datasets are mixed")
    interleave_probs: list[float] | None = opt(help="sampling probabilities for interleave strategies")
    tokenized_path: str | None = opt(help="save tokenized data here, or load it from here if it exists")
    overwrite_cache: bool = opt(False, help="re-tokenize even if a cached copy exists")
    preprocessing_num_workers: int | None = opt(
        help="processes for tokenization (unset: one per 2,000 rows, at most one per core)")
    preprocessing_batch_size: int = opt(1000, help="rows per tokenization batch")
    streaming: bool = opt(False, help="read, shuffle, tokenize and pack the training data while training (local "
                                      "files; needs max_steps), for corpora that do not fit on disk or in memory")
    buffer_size: int = opt(16384, help="streaming: rows in the shuffle buffer")
    skip_bad_rows: bool = opt(False, help="skip (and count) malformed rows instead of stopping")
    default_system: str | None = opt(help="system prompt for rows that have none")
    enable_thinking: bool | None = opt(help="reasoning models: true trains / answers with thinking, false without "
                                            "(answers' reasoning dropped, the template's empty thought in the prompt); "
                                            "unset: the template's default (LlamaFactory's true) or, for chat / api / "
                                            "eval / export, what the adapter was trained with; saved with the model")
    tool_format: str | None = opt(None, choices=(None, "default", "qwen", "qwen3_5", "llama3", "mistral", "ling"),
                                  help="write tools and tool calls into the text in this format (LlamaFactory's), for "
                                       "templates that do not render tools themselves")
    preserve_thinking: bool = opt(False, help="reasoning models: passed to chat templates that can keep earlier "
                                              "turns' reasoning")
    media_dir: str | None = opt(help="folder that relative image / video / audio paths start from (default: dataset_dir)")


@dataclass
class TrainArgs:
    output_dir: str | None = opt(help="where checkpoints and the final model go")
    overwrite_output_dir: bool = opt(False, help="start afresh in an output_dir that has checkpoints")
    do_train: bool = opt(True, help="run training")
    do_eval: bool = opt(False, help="evaluate at the end")
    per_device_train_batch_size: int = opt(8, help="micro-batch size")
    per_device_eval_batch_size: int = opt(8, help="evaluation batch size")
    gradient_accumulation_steps: int = opt(1, help="micro-batches per optimizer step")
    learning_rate: float = opt(5e-5, help="peak learning rate")
    num_train_epochs: float = opt(3.0, help="epochs (ignored when max_steps > 0)")
    max_steps: int = opt(-1, help="optimizer steps; overrides num_train_epochs when > 0")
    lr_scheduler_type: str = opt("linear", choices=SCHEDULER_CHOICES, help="learning-rate schedule (transformers' "
                                 "schedules; reduce_lr_on_plateau and greedy step on evaluations)")
    lr_scheduler_kwargs: dict = opt({}, help="the schedule's own arguments, e.g. {min_lr_rate: 0.1} for "
                                             "cosine_with_min_lr, {num_cycles: 2} for cosine_with_restarts")
    warmup_ratio: float = opt(0.0, help="share of steps spent warming up")
    warmup_steps: int = opt(0, help="warm-up steps (overrides warmup_ratio when > 0)")
    weight_decay: float = opt(0.0, help="weight decay, of every optimizer (never on norms and biases)")
    adam_beta1: float = opt(0.9, help="beta1 of the Adam family (Lion's and AdEMAMix's too)")
    adam_beta2: float = opt(0.999, help="beta2 of the Adam family (Lion's and AdEMAMix's too)")
    adam_epsilon: float = opt(1e-8, help="epsilon of the Adam family (AdEMAMix's too)")
    max_grad_norm: float = opt(1.0, help="gradient clipping norm; 0 disables")
    optim: str = opt("adamw_torch", choices=OPTIMIZER_CHOICES, refused=REFUSED_OPTIMIZERS,
                     help="optimizer (transformers' names: torch, bitsandbytes 8-bit / paged / Lion, Adafactor, "
                          "torchao 4/8-bit)")
    optim_args: str | None = opt(help="the optimizer's own arguments as \"key=value,key2=value2\" (transformers' "
                                      "format), e.g. \"momentum=0.9,nesterov=true\" for sgd")
    neftune_noise_alpha: float | None = opt(help="NEFTune: uniform noise of scale alpha / sqrt(length x hidden size) "
                                                 "added to the input embeddings in training")
    label_smoothing_factor: float = opt(0.0, help="pt / sft: the share of each token's target spread evenly over the "
                                                  "vocabulary (smoothed cross-entropy)")
    bf16: bool = opt(False, help="bfloat16 mixed precision")
    fp16: bool = opt(False, help="float16 mixed precision")
    # kernels and compilation (tuneforge/model/kernels.py)
    tf32: bool | None = opt(None, help="CUDA: true lets fp32 matmuls / convolutions use TF32 (Ampere or newer), false "
                                       "forbids it; unset: torch's default. The CPU has no TF32: ignored there")
    torch_compile: bool = opt(False, help="compile each decoder layer with torch.compile (set by torch_compile_backend "
                                          "/ _mode too)")
    torch_compile_backend: str | None = opt(help="torch.compile backend (default inductor; torch._dynamo.list_backends())")
    torch_compile_mode: str | None = opt(None, choices=COMPILE_MODES, help="torch.compile mode: default, "
                                         "reduce-overhead, max-autotune, max-autotune-no-cudagraphs")
    use_liger_kernel: bool = opt(False, help="transformers' name of enable_liger_kernel")
    liger_kernel_config: dict | None = opt(help="liger-kernel's switches, e.g. {rope: true, rms_norm: true, swiglu: "
                                                "true} (default: its own for the model family)")
    fp8: bool = opt(False, help="CUDA (Ada / Hopper): train the decoder's linear layers with torchao's float8 matmuls")
    fp8_backend: str = opt("auto", choices=("auto", "torchao"), refused={"te": FP8_OTHER, "msamp": FP8_OTHER},
                           help="fp8 implementation: auto = torchao")
    fp8_enable_fsdp_float8_all_gather: bool = opt(False, help="fp8 under fsdp: all-gather the weights in float8")
    pure_bf16: bool = opt(False, help="train in bfloat16 throughout: weights, gradients and optimizer states in bf16, "
                                      "no fp32 master copy (half the memory of bf16 mixed precision's weights)")
    seed: int = opt(42, help="random seed")
    data_seed: int | None = opt(help="seed of the training data's order (default: seed)")
    disable_shuffling: bool = opt(False, help="train on the rows in dataset order, every epoch")
    logging_steps: int = opt(10, help="log every N steps")
    save_steps: int = opt(500, help="checkpoint every N steps")
    save_strategy: str = opt("steps", choices=("steps", "epoch", "best", "no"),
                             help="checkpoint every save_steps steps, at each epoch's end, when the evaluation "
                                  "improves on the best so far, or never")
    metric_for_best_model: str | None = opt(help="the evaluation metric that ranks checkpoints and early stopping "
                                                 "watches (default eval_loss; `eval_` may be left off)")
    greater_is_better: bool | None = opt(help="whether a larger metric_for_best_model is better (default: false "
                                              "for a loss or perplexity, true otherwise)")
    load_best_model_at_end: bool = opt(False, help="the output holds the best checkpoint's weights, not the last")
    save_total_limit: int | None = opt(help="keep at most N checkpoints")
    eval_strategy: str = opt("no", choices=("no", "steps", "epoch"), help="when to evaluate")
    eval_steps: int | None = opt(help="evaluate every N steps (default: logging_steps)")
    eval_on_start: bool = opt(False, help="evaluate once before the first step (the untrained model's figures)")
    early_stopping_steps: int | None = opt(help="stop after N evaluations without a better eval_loss")
    resume_from_checkpoint: bool | str | None = opt(help="true: the latest checkpoint in output_dir; or a path")
    plot_loss: bool = opt(False, help="write training_loss.png (and training_eval_loss.png)")
    report_to: list[str] = opt(["none"], help="none, all, or any of tensorboard, wandb, mlflow, swanlab, trackio "
                                          "(each needs its package: pip install 'tuneforge[tracking]')")
    disable_tqdm: bool = opt(False, help="no progress bar")
    ddp_timeout: int = opt(1800, help="seconds a collective of the training processes may wait")
    sequence_parallel_size: int = opt(1, help="split each sequence over this many processes (DeepSpeed-Ulysses "
                                              "attention); data-parallel degree = processes / this")
    data_wait_timeout: int = opt(86400, help="seconds the other processes wait while the main one tokenizes")
    fsdp: bool | list[str] | None = opt(
        None, help="FSDP2: true, or full_shard / shard_grad_op / hybrid_shard / hybrid_shard_zero2 (+ offload, auto_wrap)"
    )
    fsdp_config: dict | str | None = opt(
        None, help="FSDP2 settings (a mapping or a JSON file): reshard_after_forward, cpu_offload, transformer_layer_cls_to_wrap"
    )
    deepspeed: dict | str | None = opt(
        None, help="DeepSpeed ZeRO: the path of a DeepSpeed JSON config (\"auto\" values are filled) or a mapping"
    )
    do_predict: bool = opt(False, help="generate answers for the eval set (with predict_with_generate)")
    compute_accuracy: bool = opt(False, help="pt / sft evaluations also report accuracy: the share of each sample's "
                                              "answer tokens that are the model's most likely token, over samples")
    predict_with_generate: bool = opt(False, help="eval: generate answers and score them (BLEU-4, ROUGE)")


GALORE_PROJ_TYPES = ("std", "reverse_std", "right", "left", "full")
BADAM_SWITCH_MODES = ("ascending", "descending", "random", "fixed")


@dataclass
class MemoryArgs:
    """Memory-efficient optimizers for full tuning (LlamaFactory's keys; tuneforge/train/low_memory_optim.py builds
    them, tuneforge/config/low_memory.py checks them): at most one of GaLore, APOLLO, BAdam, Adam-mini, Muon."""

    use_galore: bool = opt(False, help="GaLore: Adam states of the target matrices in a low-rank projection of "
                                       "their gradients (galore-torch; pip install 'tuneforge[low-memory]')")
    galore_target: list[str] = opt(["all"], help="GaLore: the linear layers projected (all: every one but the head)")
    galore_rank: int = opt(16, help="GaLore: rank of the gradient projection")
    galore_update_interval: int = opt(200, help="GaLore: steps between recomputing the projection (an SVD)")
    galore_scale: float = opt(2.0, help="GaLore: scale of the projected-back update")
    galore_proj_type: str = opt("std", choices=GALORE_PROJ_TYPES, help="GaLore: which side(s) are projected")
    galore_layerwise: bool = opt(False, help="GaLore: step each weight during the backward, as its gradient is "
                                             "ready, and free it (one process, no accumulation, no clipping)")
    use_apollo: bool = opt(False, help="APOLLO: AdamW with low-rank auxiliary states that only scale the raw gradient "
                                       "(apollo-torch; pip install 'tuneforge[low-memory]')")
    apollo_target: list[str] = opt(["all"], help="APOLLO: the linear layers projected (all: every one but the head)")
    apollo_rank: int = opt(16, help="APOLLO: rank of the auxiliary projection")
    apollo_update_interval: int = opt(200, help="APOLLO: steps between new projections")
    apollo_scale: float = opt(32.0, help="APOLLO: scale of the gradient scaling factor")
    apollo_proj: str = opt("random", choices=("svd", "random"), help="APOLLO: random projection or SVD")
    apollo_proj_type: str = opt("std", choices=("std", "right", "left"), help="APOLLO: which side is projected")
    apollo_scale_type: str = opt("channel", choices=("channel", "tensor"), help="APOLLO: per-channel or per-tensor "
                                                                              "scaling")
    apollo_layerwise: bool = opt(False, help="APOLLO: step each weight during the backward (as galore_layerwise)")
    apollo_scale_front: bool = opt(False, help="APOLLO: apply the norm-growth limiter before scaling")
    use_badam: bool = opt(False, help="BAdam: block coordinate descent, Adam on one block of layers at a time "
                                      "(badam; pip install 'tuneforge[low-memory]')")
    badam_mode: str = opt("layer", choices=("layer", "ratio"), help="BAdam: one decoder layer at a time (layer) or a "
                                                                   "share of every matrix's entries (ratio)")
    badam_start_block: int | None = opt(help="BAdam layer: the block trained first (default: by badam_switch_mode)")
    badam_switch_mode: str = opt("ascending", choices=BADAM_SWITCH_MODES, help="BAdam layer: order of the blocks")
    badam_switch_interval: int = opt(50, help="BAdam layer: steps before switching to the next block (-1: never)")
    badam_update_ratio: float = opt(0.05, help="BAdam ratio: share of each matrix's entries updated")
    badam_mask_mode: str = opt("adjacent", choices=("adjacent", "scatter"), help="BAdam ratio: adjacent or "
                                                                                "scattered entries")
    badam_verbose: int = opt(0, choices=(0, 1, 2), help="BAdam: 1 prints each active block, 2 its parameters too")
    use_adam_mini: bool = opt(False, help="Adam-mini: one second-moment value per block (head, neuron) instead of "
                                          "per weight (adam-mini; pip install 'tuneforge[low-memory]')")
    use_muon: bool = opt(False, help="Muon (torch.optim.Muon) for the 2-D hidden matrices, AdamW for embeddings, "
                                     "head, norms and biases")


@dataclass
class HubArgs:
    """Uploading to the Hugging Face hub (transformers' / LlamaFactory's keys): the training output (push_to_hub) and
    `tuneforge export`'s folder (export_hub_model_id). Checked (hub reachable, token can write) before the model
    loads."""

    push_to_hub: bool = opt(False, help="upload output_dir (model or adapter, model card, results) to the hub")
    hub_model_id: str | None = opt(help="the hub repository (owner/name, or name in your namespace; default: "
                                        "output_dir's folder name)")
    hub_token: str | None = opt(help="token that can write to hub_model_id (default: HF_TOKEN or `hf auth login`'s)")
    hub_private_repo: bool | None = opt(help="create the repository private (default: the owner's default); an "
                                             "existing repository keeps its visibility")
    hub_strategy: str = opt("every_save", choices=HUB_STRATEGIES,
                            help="end: upload once, at the end; every_save: also the model at each checkpoint (in "
                                 "the background); checkpoint: that plus the latest checkpoint in last-checkpoint/; "
                                 "all_checkpoints: every checkpoint-N folder too")
    hub_revision: str | None = opt(help="the branch to upload to (created from main when missing; default main)")
    hub_always_push: bool = opt(False, help="every_save: upload each checkpoint even while the previous upload runs "
                                            "(default: skip it)")
    export_hub_model_id: str | None = opt(help="tuneforge export: upload export_dir to this hub repository")


@dataclass
class TrackingArgs:
    """The experiment trackers' settings (report_to picks them): run_name for all of them, project and trackio_* for
    trackio (transformers' keys), use_swanlab and swanlab_* for SwanLab (LlamaFactory's keys)."""

    run_name: str | None = opt(help="the run's name in wandb, mlflow, trackio and swanlab (default: theirs)")
    project: str = opt("huggingface", help="trackio: the project the run is logged under")
    trackio_space_id: str | None = opt(help="trackio: log to this Hugging Face Space (default: locally, in "
                                            "TRACKIO_DIR or the Hugging Face cache)")
    trackio_bucket_id: str | None = opt(help="trackio: the hub bucket a trackio Space stores its logs in")
    use_swanlab: bool = opt(False, help="log to SwanLab (as report_to: swanlab)")
    swanlab_project: str | None = opt("llamafactory", help="SwanLab: project name")
    swanlab_workspace: str | None = opt(help="SwanLab: workspace (organization; default: your own)")
    swanlab_run_name: str | None = opt(help="SwanLab: experiment name (default: run_name, else SwanLab's)")
    swanlab_mode: str = opt("cloud", choices=SWANLAB_MODES, help="SwanLab: cloud / online (upload; needs an API key), local "
                            "(swanlab[dashboard]'s local board), offline (files in swanlab_logdir, `swanlab sync` "
                            "later) or disabled")
    swanlab_api_key: str | None = opt(help="SwanLab: API key for cloud mode (default: SWANLAB_API_KEY or `swanlab "
                                           "login`'s)")
    swanlab_logdir: str | None = opt(help="SwanLab: folder of its run files (default: SwanLab's, ./swanlog)")
    swanlab_lark_webhook_url: str | None = opt(help="SwanLab: Lark (Feishu) webhook told when the run starts / ends")
    swanlab_lark_secret: str | None = opt(help="SwanLab: the Lark webhook's signing secret")


REWARD_MODEL_TYPES = ("lora", "full", "api")
SCALE_REWARDS = ("group", "batch", "none")
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


@dataclass
class RLArgs:
    """The RL stages (grpo, ppo): rollouts are sampled with the generate keys (temperature, top_p, top_k, ...)
    and stop at the chat template's end of turn, as chat does."""

    num_generations: int | None = opt(help="completions sampled per prompt (default: grpo 8, a group; ppo 1)")
    max_completion_length: int | None = opt(help="most tokens of one sampled completion (default: grpo 256; ppo "
                                                 "max_new_tokens, as LlamaFactory's ppo)")
    mask_truncated_completions: bool = opt(False, help="grpo: completions cut at max_completion_length get no loss")
    reward_funcs: list[str] | None = opt(help="rewards: built-in names (accuracy, format, think_format, length) "
                                              "or module:function / path/to/file.py:function, called TRL-style "
                                              "f(prompts, completions, completion_ids, **columns) -> a float or "
                                              "None per completion")
    reward_weights: list[float] | None = opt(help="weight of each reward (reward_funcs, then the reward model); default 1 each")
    reward_answer_column: str | None = opt(help="accuracy: the column holding the right answer (default: the first "
                                                "of answer, solution, ground_truth the data has)")
    reward_format_pattern: str | None = opt(help="format: a regular expression the whole completion must match")
    overlong_buffer: int | None = opt(help="length: completions longer than max_completion_length minus this many "
                                           "tokens are penalized linearly, down to -1 (default: a quarter of it)")
    reward_model: str | None = opt(help="a reward model: a stage rm output folder (lora: the adapter folder, or its "
                                        "base model with reward_model_adapters; full: the model folder), or the URL "
                                        "of a score server (reward_model_type api); scored last")
    reward_model_adapters: list[str] | None = opt(help="lora: the rm adapter folder(s) merged into reward_model (the "
                                                       "last holds value_head.safetensors)")
    reward_model_type: str = opt("lora", choices=REWARD_MODEL_TYPES, help="lora, full, or api (an HTTP "
                                 "/v1/score/evaluation server, e.g. tuneforge api on an rm output)")
    reward_model_quantization_bit: int | None = opt(None, choices=(None, 4, 8), help="load the reward model in 4 or 8 bit")
    scale_rewards: str = opt("group", choices=SCALE_REWARDS, help="grpo: divide advantages by the std of the group's "
                             "rewards, of the whole batch's, or none")
    loss_type: str = opt("dapo", choices=GRPO_LOSS_TYPES, help="grpo: how token losses are averaged: grpo (per "
                         "completion), dr_grpo (by max_completion_length), dapo (by the batch's tokens), bnpo (by "
                         "each micro-batch's tokens)")
    epsilon: float = opt(0.2, help="grpo, ppo: clipping range of the probability ratio (lower side)")
    epsilon_high: float | None = opt(help="grpo, ppo: upper clipping range (default: epsilon)")
    num_iterations: int = opt(1, help="grpo: optimizer steps per batch of sampled completions")
    beta: float = opt(0.0, help="grpo: weight of the KL penalty to the reference (0: no reference)")
    ppo_epochs: int = opt(4, help="ppo: passes over each batch of sampled completions (optimizer steps: ppo_epochs "
                                  "x ppo_buffer_size per rollout)")
    ppo_buffer_size: int = opt(1, help="ppo: optimizer steps' worth of micro-batches sampled together (the "
                                       "experience buffer; advantages are whitened over it)")
    ppo_score_norm: bool = opt(False, help="ppo: normalize scores by the running mean and std of all scores so far")
    ppo_whiten_rewards: bool = opt(False, help="ppo: whiten the per-token rewards (keeping their mean) before GAE")
    ppo_target: float = opt(6.0, help="ppo: the KL (summed over a completion) the adaptive KL coefficient aims at")
    ppo_kl_coef: float = opt(0.2, help="ppo: the KL penalty's coefficient (its start, when adaptive)")
    ppo_adaptive_kl: bool = opt(True, help="ppo: adapt ppo_kl_coef towards ppo_target (Ziegler et al.), else fixed")
    ppo_kl_horizon: int = opt(10000, help="ppo: samples over which the adaptive coefficient closes its error")
    ppo_gamma: float = opt(1.0, help="ppo: discount of GAE")
    ppo_lam: float = opt(0.95, help="ppo: lambda of GAE")
    ppo_value_clip: float = opt(0.2, help="ppo: clipping range of the value prediction around the rollout's")
    ppo_vf_coef: float = opt(0.1, help="ppo: weight of the value loss")


@dataclass
class GenerateArgs:
    """How chat, api and eval generate text (LlamaFactory's generating arguments and defaults)."""

    do_sample: bool = opt(True, help="sample; false = greedy decoding")
    temperature: float = opt(0.95, help="sampling temperature (0 = greedy)")
    top_p: float = opt(0.7, help="nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = opt(50, help="sample among the k most likely tokens (0 = no limit)")
    num_beams: int = opt(1, help="beam search width (1 = no beam search)")
    max_length: int = opt(1024, help="maximum prompt + answer tokens (max_new_tokens wins when set)")
    max_new_tokens: int = opt(1024, help="maximum tokens of an answer")
    repetition_penalty: float = opt(1.0, help="> 1 discourages repeating tokens")
    length_penalty: float = opt(1.0, help="beam search: exponent of the length normalization")
    skip_special_tokens: bool = opt(True, help="drop special tokens from generated text")
    infer_backend: str = opt("huggingface", choices=INFER_BACKENDS, help="generation engine: huggingface or vllm")
    infer_max_batch: int = opt(32, help="chat / api: answers decoded together (continuous batching); 1 = one request at a time")
    infer_dtype: str = opt("auto", choices=INFER_DTYPES, help="weights' dtype for inference (auto: bf16/fp16 on GPU, fp32 on CPU)")
    vllm_maxlen: int = opt(4096, help="vllm: maximum sequence length (prompt + answer)")
    vllm_gpu_util: float = opt(0.7, help="vllm: share of GPU memory to use (0-1)")
    vllm_enforce_eager: bool = opt(False, help="vllm: disable CUDA graphs")
    vllm_max_lora_rank: int = opt(32, help="vllm: largest LoRA rank to serve")
    vllm_config: dict = opt({}, help="vllm: extra engine arguments")


@dataclass
class ExportArgs:
    """`tuneforge export`: merge the adapters into the base and write a plain Hugging Face (or GGUF) model."""

    export_dir: str | None = opt(help="where the exported model goes")
    export_size: int = opt(5, help="largest safetensors shard, in GB")
    export_device: str = opt("cpu", choices=("cpu", "auto"), help="where to merge: cpu, or auto (the accelerator)")
    export_legacy_format: bool = opt(False, help="write pytorch_model.bin instead of safetensors")
    export_format: str = opt("safetensors", choices=EXPORT_FORMATS, help="safetensors (a HF folder) or gguf (one file)")
    export_gguf_type: str = opt("f16", choices=GGUF_TYPES, help="gguf: tensor type f32, f16, bf16 or q8_0")


@dataclass
class EvalArgs:
    """`tuneforge eval` on a multiple-choice benchmark (MMLU layout) in task_dir."""

    task: str | None = opt(help="benchmark and split, e.g. mmlu_test (task_dir/mmlu, its test split)")
    task_dir: str = opt("evaluation", help="folder holding the benchmark folders")
    batch_size: int = opt(4, help="questions per forward pass")
    lang: str = opt("en", choices=("en", "zh"), help="language of the prompt wording")
    n_shot: int = opt(5, help="solved examples (from the dev split) before each question")
    save_dir: str | None = opt(help="folder for the results files (default: output_dir, else eval_<task>)")


@dataclass
class RayArgs:
    """`tuneforge train` in Ray Train workers (LlamaFactory's Ray keys; USE_RAY=1 also sets use_ray)."""

    use_ray: bool = opt(False, help="train in Ray Train workers instead of this process / torchrun")
    ray_num_workers: int = opt(1, help="Ray Train workers (processes), one rank each")
    resources_per_worker: dict = opt({}, help="Ray resources of each worker, e.g. {CPU: 4, GPU: 1}; default: "
                                              "1 CPU, plus 1 GPU when the cluster has GPUs")
    placement_strategy: str = opt("PACK", choices=PLACEMENT_STRATEGIES, help="how workers spread over the nodes")
    ray_init_kwargs: dict | None = opt(help="arguments of ray.init, e.g. {address: auto} or {runtime_env: ...}")
    ray_run_name: str | None = opt(help="name of the Ray Train run (default: Ray's, with the date)")
    ray_storage_path: str | None = opt(help="where Ray Train keeps its run records (default: the tuneforge "
                                            "cache's ray_results); the model goes to output_dir")


GROUPS = {
    "model": ModelArgs, "method": MethodArgs, "data": DataArgs, "train": TrainArgs,
    "rl": RLArgs, "generate": GenerateArgs, "export": ExportArgs, "eval": EvalArgs, "ray": RayArgs,
    "hub": HubArgs, "tracking": TrackingArgs, "memory": MemoryArgs,
}


@dataclass
class RunConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    method: MethodArgs = field(default_factory=MethodArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    generate: GenerateArgs = field(default_factory=GenerateArgs)
    export: ExportArgs = field(default_factory=ExportArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    ray: RayArgs = field(default_factory=RayArgs)
    hub: HubArgs = field(default_factory=HubArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)
    memory: MemoryArgs = field(default_factory=MemoryArgs)
    source: str = "<overrides>"  # the file the config came from, for messages

    def to_dict(self) -> dict[str, Any]:
        """The flat key -> value mapping, as a user would write it in YAML."""
        return {f.name: getattr(getattr(self, g), f.name) for g, cls in GROUPS.items() for f in fields(cls)}


def key_types() -> dict[str, Any]:
    """Map every flat key to its annotated type (what `key: value` is coerced to)."""
    import typing

    return {key: hint for cls in GROUPS.values() for key, hint in typing.get_type_hints(cls).items()}


def key_index() -> dict[str, tuple[str, Any]]:
    """Map every flat key to (group name, dataclass field)."""
    index: dict[str, tuple[str, Any]] = {}
    for group, cls in GROUPS.items():
        for f in fields(cls):
            assert f.name not in index, f"key {f.name} defined twice"
            index[f.name] = (group, f)
    return index
