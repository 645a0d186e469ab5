"""The Chat tab: load a base model (and a trained adapter, or a run's output folder) into the same engine `tuneforge
chat` and `tuneforge api` use, and talk to it with streaming answers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import gradio as gr

from tuneforge.errors import TuneforgeError


class ChatSession:
    """The one loaded engine of this UI (loading another closes the previous one)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.name = ""
        self._lock = threading.Lock()

    def load(self, model: str, adapter: str, template: str) -> str:
        from tuneforge.config import from_dict
        from tuneforge.infer.engine import Engine
        from tuneforge.model.inference import use_trained_output

        raw = {"model_name_or_path": model.strip() or None, "adapter_name_or_path": adapter.strip() or None,
               "template": template.strip() or None}
        try:
            cfg = use_trained_output(from_dict({k: v for k, v in raw.items() if v}, source="the chat tab",
                                               for_training=False))
            engine = Engine.from_config(cfg)
        except TuneforgeError as e:
            return f"**cannot load:** {e}"
        with self._lock:
            if self.engine is not None:
                self.engine.close()
            self.engine, self.name = engine, cfg.model.model_name_or_path
        adapters = ", ".join(cfg.model.adapter_name_or_path or []) or "no adapter"
        return f"loaded {self.name} ({adapters})"

    def reply(self, messages: list[dict[str, Any]], **options: Any) -> Iterator[str]:
        """The answer so far, growing as tokens arrive."""
        from tuneforge.infer.job import Delta

        if self.engine is None:
            raise gr.Error("load a model first")
        text = ""
        for event in self.engine.stream(messages, **options):
            if isinstance(event, Delta):
                text += event.text
                yield text

    def close(self) -> None:
        with self._lock:
            if self.engine is not None:
                self.engine.close()
            self.engine = None


def _plain(history: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The chatbot's messages as the engine takes them (text content)."""
    out = []
    for m in history:
        content = m["content"]
        if isinstance(content, list):  # gradio may hold content as parts
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        out.append({"role": m["role"], "content": str(content)})
    return out


def build(session: ChatSession, model: str) -> None:
    with gr.Row():
        model_box = gr.Textbox(value=model, label="model_name_or_path", scale=3, elem_id="chat-model")
        adapter_box = gr.Textbox(label="adapter_name_or_path (or a run's output_dir)", scale=3,
                                 elem_id="chat-adapter")
        template_box = gr.Textbox(label="template", placeholder="the model's own", scale=1)
        load_button = gr.Button("Load", scale=1, elem_id="chat-load")
    loaded = gr.Markdown("no model loaded", elem_id="chat-loaded")
    with gr.Row():
        system = gr.Textbox(label="system prompt", scale=3)
        temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0: greedy)")
        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top_p")
        max_tokens = gr.Slider(1, 2048, value=128, step=1, label="max new tokens")
    chatbot = gr.Chatbot(label="chat", elem_id="chatbot", height=360)
    with gr.Row():
        question = gr.Textbox(placeholder="ask something and press Enter", scale=5, show_label=False,
                              elem_id="chat-input")
        image = gr.Image(type="filepath", label="image (vision-language models)", height=120, scale=1,
                         elem_id="chat-image")
        clear = gr.Button("Clear", scale=1, elem_id="chat-clear")

    def ask(text: str, history: list[dict[str, Any]], picture: str | None, system_text: str, temp: float,
            p: float, limit: float) -> Iterator[tuple[str, list[dict[str, Any]], Any]]:
        if not text.strip():
            yield "", history, gr.update()
            return
        history = [*_plain(history), {"role": "user", "content": text}]
        messages = ([{"role": "system", "content": system_text}] if system_text.strip() else []) + history
        if picture:  # the engine places it before the question's text, as `tuneforge chat`'s `image PATH` does
            messages[-1] = {**messages[-1], "images": [picture]}
        answer = {"role": "assistant", "content": ""}
        try:
            for partial in session.reply(messages, temperature=temp, top_p=p, max_tokens=int(limit)):
                answer["content"] = partial
                yield "", [*history, answer], gr.update()
        except TuneforgeError as e:
            raise gr.Error(str(e)) from None
        yield "", [*history, answer], None

    load_button.click(session.load, [model_box, adapter_box, template_box], loaded)
    question.submit(ask, [question, chatbot, image, system, temperature, top_p, max_tokens],
                    [question, chatbot, image])
    clear.click(lambda: [], None, chatbot)
