"""LlamaFactory keys that are not fields of our schema.

A LlamaFactory file must load unchanged, so every key it may carry (its own argument classes' and the Hugging Face
training arguments they inherit) is in one of three places: our schema (same name, same meaning), IGNORED
(accepted: it changes nothing here), or NOT_YET with LlamaFactory's default value: accepted at that value (a file
that spells out a default runs), an error saying tuneforge does not support it yet at any other (never silently
dropped).
"""

from __future__ import annotations

import math
from typing import Any

from tuneforge.flags import parse_flag

# key -> why it changes nothing in tuneforge
IGNORED: dict[str, str] = {
    "dataloader_num_workers": "data is tokenized ahead of time; batches are built in-process",
    "dataloader_pin_memory": "batches are moved to the device directly",
    "dataloader_persistent_workers": "no dataloader workers",
    "save_only_model": "checkpoints always carry what an exact resume needs",
    "use_cpu": "the device is chosen automatically (CPU when no accelerator is visible)",
    "include_effective_tokens_per_second": "effective tokens/s is always reported",
    "include_num_input_tokens_seen": "total_tokens is always logged",
    "include_tokens_per_second": "tokens/s is always reported",
    "ddp_find_unused_parameters": "set automatically",
    "log_level": "tuneforge logs at INFO on rank 0",
    "log_level_replica": "only rank 0 logs",
    "logging_first_step": "the first step is always logged",
    "logging_strategy": "logging follows logging_steps",
    "logging_dir": "logs go to output_dir",
    "remove_unused_columns": "only input_ids, attention_mask and labels are kept",
    "save_safetensors": "weights are always saved as safetensors",
    "low_cpu_mem_usage": "models always load with low memory use",
    "use_fast_tokenizer": "the fast tokenizer is always used",
    "ignore_pad_token_for_loss": "padding never counts in the loss",
    "gradient_checkpointing": "chosen per layer by memory by default; every layer with "
                              "disable_gradient_checkpointing: false, none with true",
    "print_param_status": "trainable parameters are always summarized",
    "data_shared_file_system": "only the main process tokenizes",
    "trust_remote_code_for_tokenizer": "trust_remote_code covers both",
    "plot_loss_steps": "plots use every logged step",
    "overwrite_cache_dir": "see overwrite_cache",
    "preprocessing_only": "use `tuneforge preprocess`",
    "disable_version_check": "no version check",
    "download_mode": "benchmarks are read from task_dir; nothing is downloaded",
    'batch_eval_metrics': 'evaluation metrics are computed over the whole evaluation set',
    'dataloader_multiprocessing_context': 'no dataloader workers',
    'dataloader_prefetch_factor': 'no dataloader workers',
    'ddp_broadcast_buffers': "tuneforge's DDP strategy sets it",
    'ddp_bucket_cap_mb': "tuneforge's DDP strategy sets it",
    'ddp_static_graph': "tuneforge's DDP strategy sets it",
    'eval_do_concat_batches': 'evaluation results are gathered whole',
    'eval_use_gather_object': 'evaluation results are gathered whole',
    'include_for_metrics': 'each metric gets what it needs',
    'log_on_each_node': 'only rank 0 logs',
    'logging_nan_inf_filter': 'a NaN or infinite loss stops the run with a message instead of being filtered',
    'restore_callback_states_from_checkpoint': 'a resumed run restores its whole state from the checkpoint',
    'skip_memory_metrics': 'peak memory is always reported',
    'use_kv_cache': 'generation always uses the KV cache',
    'master_addr': "Ray Train sets up the process group itself, on its rank-0 worker's node and a free port",
    'master_port': "Ray Train sets up the process group itself, on its rank-0 worker's node and a free port",
    'use_reentrant_gc': "gradient checkpointing is always torch's non-reentrant kind (the same gradients)",
}
# key -> LlamaFactory's default: the value at which the key changes nothing
NOT_YET: dict[str, Any] = {
    'adapter_folder': None,
    'split_special_tokens': False,
    'moe_aux_loss_coef': None,
    'train_from_scratch': False,
    'offload_folder': 'offload',
    'use_cache': False,
    'ms_hub_token': None,
    'om_hub_token': None,
    'quantization_device_map': None,
    'compute_dtype': None,
    'device_map': None,
    'block_diag_attn': False,
    'export_quantization_bit': None,
    'export_quantization_dataset': None,
    'export_quantization_nsamples': 128,
    'export_quantization_maxlen': 1024,
    'sglang_maxlen': 4096,
    'sglang_mem_fraction': 0.7,
    'sglang_tp_size': -1,
    'sglang_config': None,
    'sglang_lora_backend': 'triton',
    'eval_num_beams': None,
    'oft_block_share': False,
    'module_dropout': 0.0,
    'ld_alpha': None,
    'ray_storage_filesystem': None,
    'eval_accumulation_steps': None,
    'eval_delay': 0,
    'local_rank': -1,
    'ddp_backend': None,
    'dataloader_drop_last': False,
    'label_names': None,
    'ignore_data_skip': False,
    'group_by_length': False,
    'prediction_loss_only': False,
    'fp16_full_eval': False,
    'bf16_full_eval': False,
    'torch_empty_cache_steps': None,
    'accelerator_config': None,
    'activation_checkpointing': None,
    'activation_checkpointing_kwargs': None,
    'auto_find_batch_size': False,
    'average_tokens_across_devices': True,
    'dataloader_in_order': True,
    'debug': '',
    'enable_jit_checkpoint': False,
    'enable_torch_profiler': False,
    'full_determinism': False,
    'generation_config': None,
    'generation_max_length': None,
    'generation_num_beams': None,
    'gradient_checkpointing_kwargs': None,
    'hyper_parallel_args': None,
    'hyper_parallel_cp_size': 1,
    'kt_cpu_activation': None,
    'kt_expert_checkpoint_path': None,
    'kt_lora_expert_intermediate_size': None,
    'kt_lora_expert_num': None,
    'kt_non_expert_weight_path': None,
    'kt_use_lora_experts': None,
    'kt_weight_path': None,
    'length_column_name': 'length',
    'megatron_bridge_args': None,
    'optim_target_modules': None,
    'parallelism_config': None,
    'pref_bco_weight': 0.0,
    'profile_modules': None,
    'profiler_active_steps': 1,
    'profiler_output_dir': None,
    'profiler_profile_memory': True,
    'profiler_record_shapes': True,
    'profiler_repeat': 1,
    'profiler_wait_steps': 1,
    'profiler_warmup_steps': 1,
    'profiler_with_stack': True,
    'save_on_each_node': False,
    'sortish_sampler': False,
    'trackio_static_space_id': None,
    'train_sampling_strategy': 'random',
    'use_hyper_parallel': False,
    'use_kt': False,
    'use_mca': False,
    'use_megatron_bridge': False,
    'use_v1_kernels': False,
    # LlamaFactory's Megatron-Core arguments (use_megatron_bridge / use_mca: its Megatron examples carry them);
    # tuneforge trains with DDP, FSDP2 or DeepSpeed, not Megatron-Core
    'tensor_model_parallel_size': 1,
    'pipeline_model_parallel_size': 1,
    'expert_model_parallel_size': 1,
    'context_parallel_size': 1,
    'virtual_pipeline_model_parallel_size': None,
    'sequence_parallel': False,
    'recompute_granularity': None,
    'recompute_method': None,
    'recompute_num_layers': None,
    'account_for_embedding_in_pipeline_split': None,
    'account_for_loss_in_pipeline_split': None,
    'bias_activation_fusion': None,
    'apply_rope_fusion': None,
    'masked_softmax_fusion': None,
    'cross_entropy_loss_fusion': None,
    'moe_grouped_gemm': None,
    'moe_token_dispatcher_type': None,
    'calculate_per_token_loss': None,
    'use_distributed_optimizer': True,
    'overlap_param_gather': True,
    'overlap_grad_reduce': True,
    'use_packed_sequences': False,
    'mixed_precision': 'bf16_mixed',
    'megatron_pretrained_checkpoint': None,
    'export_hf_on_finish': False,
    'extra_config': None,
}
NONE_WORDS = ("", "none", "null")


# older names (earlier LlamaFactory or transformers releases) that users' files still carry -> the current key
RENAMED: dict[str, str] = {
    "evaluation_strategy": "eval_strategy",  # transformers 4.46
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "dpo_beta": "pref_beta", "orpo_beta": "pref_beta", "dpo_loss": "pref_loss", "dpo_ftx": "pref_ftx",  # LF 0.8
    "efficient_packing": "neat_packing",
    "new_special_tokens": "add_special_tokens",
    "push_to_hub_model_id": "hub_model_id",
    "push_to_hub_token": "hub_token",
}
# older keys with no same-meaning successor -> (their old default, accepted; what replaced them)
REPLACED: dict[str, tuple[Any, str]] = {
    "image_resolution": (None, "was LlamaFactory's bound on an image's longest side; image_max_pixels now bounds "
                               "its pixel count (e.g. 512 x 512 = 262144): set image_max_pixels"),
    "video_resolution": (None, "was LlamaFactory's bound on a frame's longest side; video_max_pixels now bounds "
                               "its pixel count: set video_max_pixels"),
    "max_source_length": (None, "was replaced by cutoff_len (prompt and answer together): set cutoff_len"),
    "max_target_length": (None, "was replaced by cutoff_len (prompt and answer together): set cutoff_len"),
    "visual_inputs": (False, "was LlamaFactory 0.8's switch for vision-language models; the model's config says so "
                             "now: remove it"),
    "dispatch_batches": (None, "moved into transformers' accelerator_config; tuneforge builds each process's "
                               "batches itself: remove it"),
    "split_batches": (False, "moved into transformers' accelerator_config; tuneforge builds each process's "
                             "batches itself: remove it"),
    "no_cuda": (False, "was replaced by use_cpu; tuneforge picks the device itself (the CPU when no GPU is "
                       "visible; CUDA_VISIBLE_DEVICES= hides them): remove it"),
    "use_mps_device": (False, "is gone from transformers; tuneforge runs on CUDA or the CPU: remove it"),
    "fp16_backend": ("auto", "chose transformers' old mixed-precision backend; tuneforge uses torch's autocast: "
                             "remove it"),
    "tpu_num_cores": (None, "is a TPU setting; tuneforge runs on CUDA or the CPU: remove it"),
    "include_inputs_for_metrics": (False, "was replaced by include_for_metrics, which tuneforge does not need "
                                          "(each metric gets what it reads): remove it"),
}


def at_default(key: str, value: Any) -> bool:
    """Whether a NOT_YET (or REPLACED) key's value is LlamaFactory's default, as a YAML file or a `key=value`
    override may write it (`null` / `none` for None, `false` / `0` for False, `1.0` for 1)."""
    default = NOT_YET[key] if key in NOT_YET else REPLACED[key][0]
    if isinstance(value, str) and value.strip().lower() in NONE_WORDS:
        value = None
    if default is None or value is None:
        return default is None and value is None or default in ([], {}, "") and value is None
    if isinstance(default, bool):
        return parse_flag(value) is default
    if isinstance(default, (int, float)):
        try:
            return not isinstance(value, bool) and math.isclose(float(value), float(default))
        except (TypeError, ValueError):
            return False
    if isinstance(default, str):
        return isinstance(value, str) and value.strip().lower() == default.lower()
    return value == default
