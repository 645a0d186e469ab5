"""LlamaFactory keys that are not fields of our schema.

A LlamaFactory file must load unchanged, so every key it may carry is in one of three places:
our schema (same name, same meaning), IGNORED (accepted: it changes nothing here), or
NOT_YET (an error that says tuneforge does not support it yet; never silently dropped).
"""
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
    "run_name": "no run registry",
    "ignore_pad_token_for_loss": "padding never counts in the loss",
    "gradient_checkpointing": "on by default; disable with disable_gradient_checkpointing",
    "print_param_status": "trainable parameters are always summarized",
    "data_shared_file_system": "only the main process tokenizes",
    "trust_remote_code_for_tokenizer": "trust_remote_code covers both",
    "plot_loss_steps": "plots use every logged step",
    "overwrite_cache_dir": "see overwrite_cache",
    "preprocessing_only": "use `tuneforge preprocess`",
    "disable_version_check": "no version check",
    "download_mode": "benchmarks are read from task_dir; nothing is downloaded",
}
# LlamaFactory keys that would change the result and that tuneforge does not implement yet.
NOT_YET: tuple[str, ...] = (
    # model
    "adapter_folder", "resize_vocab", "split_special_tokens", "add_tokens", "add_special_tokens",
    "new_special_tokens_config", "rope_scaling", "shift_attn", "mixture_of_depths", "use_unsloth",
    "use_unsloth_gc", "enable_liger_kernel", "moe_aux_loss_coef", "use_reentrant_gc",
    "upcast_layernorm", "upcast_lmhead_output", "train_from_scratch",
    "offload_folder", "use_cache", "hf_hub_token", "ms_hub_token", "om_hub_token",
    "quantization_device_map", "compute_dtype", "device_map", "model_max_length", "block_diag_attn",
    "export_quantization_bit", "export_quantization_dataset", "export_quantization_nsamples",
    "export_quantization_maxlen", "export_hub_model_id", "sglang_maxlen", "sglang_mem_fraction", "sglang_tp_size", "sglang_config", "sglang_lora_backend",
    # data
    "streaming", "buffer_size", "eval_num_beams", "eval_on_each_dataset",
    "tool_format", "enable_thinking",
    # method
    "oft_block_share", "module_dropout", "use_llama_pro", "use_adam_mini",
    "use_muon", "use_dft_loss", "use_galore", "galore_target", "galore_rank", "galore_update_interval",
    "galore_scale", "galore_proj_type", "galore_layerwise", "use_apollo", "apollo_target",
    "apollo_rank", "apollo_update_interval", "apollo_scale", "apollo_proj", "apollo_proj_type",
    "apollo_scale_type", "apollo_layerwise", "apollo_scale_front", "use_badam", "badam_mode",
    "badam_start_block", "badam_switch_mode", "badam_switch_interval", "badam_update_ratio",
    "badam_mask_mode", "badam_verbose", "use_swanlab", "swanlab_project", "swanlab_workspace",
    "swanlab_run_name", "swanlab_mode", "swanlab_api_key", "swanlab_logdir", "swanlab_lark_webhook_url",
    "swanlab_lark_secret", "pure_bf16", "compute_accuracy", "disable_shuffling",
    "ld_alpha",
    "ray_storage_filesystem",
    # training
    "eval_accumulation_steps", "eval_delay", "tf32", "data_seed",
    "local_rank", "ddp_backend", "dataloader_drop_last", "label_names", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "ignore_data_skip",
    "label_smoothing_factor", "optim_args", "group_by_length", "push_to_hub",
    "hub_model_id", "hub_strategy", "hub_token", "torch_compile", "neftune_noise_alpha",
    "prediction_loss_only", "fp16_full_eval", "bf16_full_eval", "torch_empty_cache_steps",
)
