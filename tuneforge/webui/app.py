"""`tuneforge webui`: a browser front end over the same config, the same run function and the same outputs as the
CLI. Train (the schema's form, start / stop / resume, a live view), Runs, Chat, Evaluate and Export."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gradio as gr

from tuneforge.model.hub import BUILTIN_NAME as BUILTIN_ALIAS
from tuneforge.webui import chat_tab, tools_tab, train_tab
from tuneforge.webui.chat_tab import ChatSession
from tuneforge.webui.process import Launcher

CSS = f".{train_tab.ERROR_CLASS} {{ outline: 2px solid #d03030; border-radius: 6px; }}"


def start_values(root: Path) -> dict[str, Any]:
    """What the form starts with: the built-in model on the project's identity data, into a fresh folder of root."""
    return {"model_name_or_path": BUILTIN_ALIAS, "dataset_dir": "data", "dataset": ["identity"],
            "output_dir": str(root / "run"), "logging_steps": 1}


def build_app(root: str | Path = "saves", launcher: Launcher | None = None,
              session: ChatSession | None = None) -> gr.Blocks:
    root = Path(root)
    launcher = launcher or Launcher()
    session = session or ChatSession()
    with gr.Blocks(title="tuneforge") as app:
        gr.Markdown("# tuneforge\nFine-tune, watch, chat, evaluate and export — every form is a YAML file the CLI "
                    "runs the same way.")
        with gr.Tab("Train", elem_id="tab-train"):
            train_tab.build(launcher, start_values(root))
        with gr.Tab("Runs", elem_id="tab-runs"):
            tools_tab.build_runs(root)
        with gr.Tab("Chat", elem_id="tab-chat"):
            chat_tab.build(session, BUILTIN_ALIAS)
        with gr.Tab("Evaluate", elem_id="tab-eval"):
            tools_tab.build_eval(BUILTIN_ALIAS)
        with gr.Tab("Export", elem_id="tab-export"):
            tools_tab.build_export(BUILTIN_ALIAS)
    app.launcher, app.session = launcher, session  # for shutdown
    return app


def launch(host: str | None = None, port: int | None = None, share: bool | None = None,
           root: str | Path = "saves") -> None:
    """Serve the UI until Ctrl-C (LlamaFactory's GRADIO_SERVER_NAME / GRADIO_SERVER_PORT / GRADIO_SHARE are
    honoured when the flags are not given); runs started from it are stopped with a checkpoint on the way out."""
    from tuneforge.flags import parse_flag

    host = host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    port = port or int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
    share = share if share is not None else bool(parse_flag(os.environ.get("GRADIO_SHARE", "false")))
    app = build_app(root)
    try:
        app.queue().launch(server_name=host, server_port=port, share=share, css=CSS, show_error=True,
                           prevent_thread_lock=False)
    finally:
        app.session.close()
        app.launcher.close()
