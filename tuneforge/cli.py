"""The command line: parse, call one function, print. Errors a user caused print without a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tuneforge import __version__
from tuneforge.errors import TuneforgeError

USAGE = """\
tuneforge train CONFIG [key=value ...]        train any stage as CONFIG (YAML or JSON) says
tuneforge preprocess CONFIG [key=value ...]   tokenize and cache the data only (saves tokenized_path if set)
tuneforge chat CONFIG [key=value ...]         chat with the model (and adapter) in the terminal
tuneforge api CONFIG [key=value ...]          serve it behind an OpenAI-compatible API (API_HOST, API_PORT, API_KEY)
tuneforge export CONFIG [key=value ...]       merge the adapter into the base; write export_dir (or a GGUF file)
tuneforge eval CONFIG [key=value ...]         loss / perplexity, generated answers (BLEU, ROUGE), or a benchmark (task)
tuneforge data preview CONFIG [-n N]          show rendered samples with the supervised spans marked
tuneforge llama-pro MODEL OUTPUT --num-expand N   LLaMA Pro: add N blocks that start as identities (use_llama_pro)
tuneforge webui [--host H --port P --root D]  train, watch, chat, evaluate and export in the browser
tuneforge env                                 versions, device, threads
tuneforge version
"""


def _setup_logging(verbose: bool) -> None:
    from tuneforge import logs

    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun, the other ranks log warnings only
    logs.setup(logging.DEBUG if verbose else logging.INFO if main_process else logging.WARNING)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML or JSON config file (LlamaFactory files work unchanged)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tuneforge", usage=USAGE, description="Fine-tune language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model")
    _config_args(train)
    train.add_argument("--ask", metavar="QUESTION",
                       help="ask the model this before and after training and print both answers")
    _config_args(sub.add_parser("preprocess", help="tokenize and cache the data"))
    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    _config_args(chat)
    chat.add_argument("--system", help="system prompt (default: default_system from the config)")
    api = sub.add_parser("api", help="OpenAI-compatible API server")
    _config_args(api)
    api.add_argument("--host", help="address to listen on (default: $API_HOST, else 0.0.0.0)")
    api.add_argument("--port", type=int, help="port (default: $API_PORT, else 8000)")
    _config_args(sub.add_parser("export", help="merge and export the model"))
    _config_args(sub.add_parser("eval", help="evaluate the model"))
    data = sub.add_parser("data", help="inspect data").add_subparsers(dest="data_command", required=True)
    preview = data.add_parser("preview", help="rendered samples, supervised spans marked")
    _config_args(preview)
    preview.add_argument("-n", type=int, default=3, help="number of samples (default 3)")
    pro = sub.add_parser("llama-pro", help="LLaMA Pro block expansion: a model with N added identity blocks")
    pro.add_argument("model", help="model folder or built-in alias")
    pro.add_argument("output", help="new folder for the expanded model")
    pro.add_argument("--num-expand", type=int, required=True, help="blocks to add (a divisor of the layer count)")
    pro.add_argument("--trust-remote-code", action="store_true", help="allow model code from the model folder")
    webui = sub.add_parser("webui", help="the web UI")
    webui.add_argument("--host", help="address to listen on (default: $GRADIO_SERVER_NAME, else 127.0.0.1)")
    webui.add_argument("--port", type=int, help="port (default: $GRADIO_SERVER_PORT, else 7860)")
    webui.add_argument("--share", action="store_true", default=None, help="a public gradio link ($GRADIO_SHARE)")
    webui.add_argument("--root", default="saves", help="the folder runs go to and are listed from (default saves)")
    sub.add_parser("env", help="versions, device, threads")
    sub.add_parser("version", help="print the version")
    return parser


def cmd_webui(args) -> None:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a training machine
    try:
        from tuneforge.webui.app import launch
    except ImportError as e:
        raise TuneforgeError(f"the web UI needs gradio: pip install 'tuneforge[webui]' ({e})") from None
    launch(args.host, args.port, args.share, args.root)


def cmd_train(args) -> int:
    from tuneforge.config import load

    cfg = load(args.config, args.overrides)  # every config error before the heavy imports
    from tuneforge.allocator import describe, install_advice
    from tuneforge.stages import stage_of

    logging.getLogger(__name__).info("memory allocator: %s", describe())
    if advice := install_advice():
        logging.getLogger(__name__).warning(advice)
    from tuneforge.workflow import train

    r = train(cfg, ask=args.ask, argv=args.argv)
    if r is None:  # relaunched under torchrun (rank 0 reported), or another rank
        return 0
    if not cfg.train.do_train:  # evaluated or predicted, LlamaFactory's way
        for line in r.get("summary", []):
            print(line)
        return 0
    if r.get("status") == "stopped":
        print(f"\nstopped at step {r.get('global_step', '?')} of a planned run; checkpoint saved in {r['output_dir']}. "
              f"Continue it with resume_from_checkpoint=true")
        return 0
    what = "adapter" if cfg.method.finetuning_type in ("lora", "oft") else "model"
    if stage_of(cfg.method.stage).value_head:
        what += " and critic head" if stage_of(cfg.method.stage).critic else " and value head"
    print(f"\n{what} saved in {r['output_dir']}")
    if "first_loss" in r:
        print(f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} over {r.get('global_step', '?')} steps")
    for key, (first, last) in r.get("metric_curves", {}).items():
        print(f"{key} {first:.4f} -> {last:.4f}")
    if "eval_loss" in r:
        perplexity = f" (perplexity {r['perplexity']:.2f})" if "perplexity" in r else ""
        shown = [f"{k} {r[k]:.4f}" for k in ("eval_rewards/accuracies", "eval_rewards/margins") if k in r]
        print(", ".join([f"eval_loss {r['eval_loss']:.4f}{perplexity}", *shown]))
    speed = f"{r.get('train_tokens_per_second', 0):.1f} tokens/s, {r.get('train_runtime', 0):.1f} s"
    if "train_peak_memory_mb" in r:
        per_rank = r.get("train_peak_memory_mb_per_rank")
        speed += f", peak memory {r['train_peak_memory_mb']:.0f} MiB" + (" (largest process)" if per_rank else "")
    print(speed)
    if "answers" in r:
        a = r["answers"]
        print(f"\nQ: {a['question']}\nbefore training: {a['before']}\nafter training:  {a['after']}")
    if "predict" in r:  # do_predict beside do_train
        print("\n" + "\n".join(r["predict"].get("summary", [])))
    return 0


def cmd_preprocess(args) -> None:
    from tuneforge.config import load
    from tuneforge.errors import ConfigError

    cfg = load(args.config, args.overrides, for_training=False)
    if not cfg.data.dataset:
        raise ConfigError(f"{cfg.source}: dataset is required to preprocess")
    from tuneforge.workflow import prepare_data

    _, splits = prepare_data(cfg)
    s = splits.stats
    print(f"train rows: {len(splits.train) if splits.train is not None else 0}, "
          f"eval rows: {len(splits.eval) if splits.eval is not None else 0}")
    print(f"tokens: {s.get('tokens', '?')}, supervised tokens: {s.get('supervised_tokens', '?')}")
    if cfg.data.tokenized_path:
        print(f"saved to {cfg.data.tokenized_path}")


def cmd_data_preview(args) -> None:
    from tuneforge.config import load
    from tuneforge.data import preview
    from tuneforge.model import load_model_processor, load_tokenizer

    cfg = load(args.config, args.overrides, for_training=False)
    processor = load_model_processor(cfg.model)
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(cfg.model)
    for i, text in enumerate(preview(cfg, tokenizer, n=args.n, processor=processor)):
        print(f"--- sample {i} (supervised spans between ⟦ and ⟧) ---\n{text}\n")


def _config_for_use(args):
    """The config of chat / api / export / eval: loaded for use (no training checks), and pointed at its own
    training run's output when output_dir holds a finished one."""
    from tuneforge.config import load

    cfg = load(args.config, args.overrides, for_training=False)
    from tuneforge.model.inference import use_trained_output

    return use_trained_output(cfg)


def cmd_chat(args) -> None:
    import contextlib

    cfg = _config_for_use(args)
    from tuneforge.infer.chat import chat_loop

    with contextlib.suppress(ImportError):  # line editing and history for input(), where the platform has it
        import readline  # noqa: F401

    def write(text: str) -> None:
        print(text, end="", flush=True)

    chat_loop(cfg, system=args.system, read=input, write=write)


def cmd_api(args) -> None:
    from tuneforge.errors import ConfigError

    cfg = _config_for_use(args)
    host = args.host or os.environ.get("API_HOST") or "0.0.0.0"
    port = args.port
    if port is None:
        raw = os.environ.get("API_PORT") or "8000"
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ConfigError(f"API_PORT={raw!r} is not a port number (1-65535)")
        port = int(raw)
    from tuneforge.infer.api import serve

    serve(cfg, host=host, port=port, api_key=os.environ.get("API_KEY") or None)


def cmd_export(args) -> None:
    cfg = _config_for_use(args)
    from tuneforge.export import export_model

    result = export_model(cfg)
    for line in result.get("summary", []):
        print(line)


def cmd_eval(args) -> None:
    cfg = _config_for_use(args)
    from tuneforge.eval import evaluate

    result = evaluate(cfg)
    for line in result.get("summary", []):
        print(line)


def cmd_llama_pro(args) -> None:
    from tuneforge.config import ModelArgs
    from tuneforge.model.llama_pro import expand_model
    from tuneforge.model.load import resolve_model_path

    source = resolve_model_path(ModelArgs(model_name_or_path=args.model))
    r = expand_model(str(source), args.output, args.num_expand, trust_remote_code=args.trust_remote_code)
    print(f"{r['layers']} -> {r['expanded_layers']} layers in {r['output']}; new blocks {r['new_blocks']} (logits "
          f"unchanged: max difference {r['max_logit_difference']:.1g})")
    print(f"train it with: model_name_or_path: {r['output']}, finetuning_type: freeze (or lora), "
          f"freeze_trainable_layers: {args.num_expand}, use_llama_pro: true")


def cmd_env(_args) -> None:
    import importlib.metadata as md
    import platform

    import torch

    print(f"tuneforge {__version__}")
    print(f"python {platform.python_version()} on {platform.platform()}")
    for pkg in ("torch", "transformers", "peft", "datasets", "accelerate", "safetensors", "bitsandbytes",
                "flash-attn", "deepspeed", "ray", "fastapi", "uvicorn", "tensorboard", "wandb"):
        try:
            print(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            print(f"{pkg} not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"device cuda:{i} {torch.cuda.get_device_name(i)} bf16={torch.cuda.is_bf16_supported()}")
    else:
        from tuneforge.train.trainer import cpu_has_native_bf16

        native = "native" if cpu_has_native_bf16() else "emulated, slow: prefer fp32"
        print(f"device cpu (no CUDA device visible), {torch.backends.cpu.get_cpu_capability()}, bf16 {native}")
    print(f"threads {torch.get_num_threads()} (cpu count {os.cpu_count()})")
    from tuneforge.allocator import ENV, describe, describe_kernel_caches, install_advice

    print(f"allocator {describe()} ({ENV}={os.environ.get(ENV, 'auto')})")
    if advice := install_advice():
        print(f"  {advice}")
    print(f"kernel caches {describe_kernel_caches()}")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line itself (not a call from Python): tcmalloc / jemalloc first (allocator.py)
        from tuneforge.allocator import bound_kernel_caches, reexec_with_allocator

        bound_kernel_caches()
        try:
            reexec_with_allocator()
        except TuneforgeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # key=value after an option (`train cfg.yaml --ask "..." bf16=false`): argparse leaves it over; it is an override
    stray = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra != stray or (stray and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if stray:
        args.overrides = [*args.overrides, *stray]
    args.argv = argv  # to run the same command again under torchrun
    if args.command == "version":
        print(f"tuneforge {__version__}")
        return 0
    _setup_logging(args.verbose)
    command = {
        "train": cmd_train, "preprocess": cmd_preprocess, "chat": cmd_chat, "api": cmd_api,
        "export": cmd_export, "eval": cmd_eval, "env": cmd_env, "webui": cmd_webui, "llama-pro": cmd_llama_pro,
    }.get(args.command)
    if args.command == "data":
        command = cmd_data_preview
    try:
        status = command(args)
    except TuneforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
