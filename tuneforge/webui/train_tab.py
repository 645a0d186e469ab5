"""The Train tab: the schema's form, the YAML it runs, start / stop / resume, and a live view of the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from tuneforge.config.schema import GROUPS
from tuneforge.errors import TuneforgeError
from tuneforge.webui import form
from tuneforge.webui.process import Launcher
from tuneforge.webui.runs import RunState, log_tail, run_state

ERROR_CLASS = "tf-error"  # a field the validator named: outlined in red (app.CSS)
LIST_FIELDS = ("dataset", "eval_dataset")  # picked from dataset_info.json, several at once


def _dataset_names(dataset_dir: str) -> list[str]:
    from tuneforge.data.registry import read_dataset_info

    try:
        return sorted(read_dataset_info(dataset_dir or "data"))
    except (TuneforgeError, OSError):
        return []


def _component(spec: form.FieldSpec, value: Any, dataset_dir: str) -> Any:
    label, info, elem_id = spec.key, spec.help or None, f"field-{spec.key}"
    if spec.kind == "bool":
        return gr.Checkbox(value=value, label=label, info=info, elem_id=elem_id)
    if spec.kind == "choice":
        return gr.Dropdown(choices=list(spec.choices), value=value, label=label, info=info, elem_id=elem_id)
    if spec.key in LIST_FIELDS:
        return gr.Dropdown(choices=_dataset_names(dataset_dir), value=_component_value(spec.key, value),
                           multiselect=True, allow_custom_value=True, label=label, info=info, elem_id=elem_id)
    return gr.Textbox(value=value, label=label, info=info, elem_id=elem_id, max_lines=1)


def _form_value(key: str, value: Any) -> Any:
    if key in LIST_FIELDS:  # the multiselect's list, as the command line writes it
        return ",".join(value or [])
    return value


def _component_value(key: str, value: Any) -> Any:
    if key in LIST_FIELDS:
        return [v for v in str(value or "").split(",") if v]
    return value


def plot_frame(state: RunState) -> pd.DataFrame:
    """The run's curves as one long table (step, value, series) for a line plot."""
    rows = [(s, v, "loss") for s, v in state.loss] + [(s, v, "eval_loss") for s, v in state.eval_loss]
    rows += [(s, v, "reward") for s, v in state.rewards]
    return pd.DataFrame(rows, columns=["step", "value", "series"])


def build(launcher: Launcher, start_values: dict[str, Any]) -> None:
    """The tab's components and events, inside the caller's gr.Blocks; the form starts at start_values (a config
    mapping)."""
    specs = form.field_specs()
    initial, _ = form.to_form(start_values)
    dataset_dir = str(start_values.get("dataset_dir", "data"))
    fields: dict[str, Any] = {}
    with gr.Row():
        load_path = gr.Textbox(label="load a config", placeholder="a YAML file: ours, LlamaFactory's, or "
                               "LlamaBoard's training_args.yaml", scale=4, elem_id="load-path")
        load_button = gr.Button("Load", scale=1, elem_id="load-config")
    basics = [s for s in specs if s.key in form.BASIC_KEYS]
    with gr.Group():
        with gr.Row(equal_height=True):
            for spec in sorted(basics, key=lambda s: form.BASIC_KEYS.index(s.key)):
                fields[spec.key] = _component(spec, initial[spec.key], dataset_dir)
    for group in GROUPS:
        rest = [s for s in specs if s.group == group and s.key not in form.BASIC_KEYS]
        with gr.Accordion(f"{group} ({len(rest)} keys)", open=False):
            for spec in rest:
                fields[spec.key] = _component(spec, initial[spec.key], dataset_dir)
    keys = list(fields)
    components = [fields[k] for k in keys]
    helps = {spec.key: spec.help or None for spec in specs}

    with gr.Row():
        preview_button = gr.Button("Preview data", elem_id="preview")
        start_button = gr.Button("Start", variant="primary", elem_id="start")
        stop_button = gr.Button("Stop", variant="stop", elem_id="stop")
        resume_button = gr.Button("Resume", elem_id="resume")
    message = gr.Markdown(elem_id="train-message")
    with gr.Row():
        with gr.Column():
            yaml_view = gr.Code(form.to_yaml(form.from_form(initial)), language="yaml",
                                label="the config it runs (saved to output_dir)", interactive=False,
                                elem_id="config-yaml")
            preview_view = gr.Textbox(label="rendered samples (supervised spans between ⟦ and ⟧)", lines=8,
                                      interactive=False, elem_id="preview-text")
        with gr.Column():
            status = gr.Markdown("no run yet", elem_id="run-status")
            plot = gr.LinePlot(x="step", y="value", color="series", label="loss", elem_id="loss-plot")
            log_view = gr.Textbox(label="log", lines=12, max_lines=12, interactive=False, autoscroll=True,
                                  elem_id="run-log")
    watched = gr.State("")  # the output_dir of the run this tab shows
    timer = gr.Timer(2.0, active=False)

    def current(*values: Any) -> dict[str, Any]:
        return form.from_form({k: _form_value(k, v) for k, v in zip(keys, values, strict=True)})

    def marked(errors: dict[str, str], values: dict[str, Any] | None = None) -> list[Any]:
        """Each field outlined and captioned with the validator's message when it names it, else as it was."""
        updates = []
        for k in keys:
            extra = {} if values is None else {"value": _component_value(k, values[k])}
            if k in errors:
                updates.append(gr.update(elem_classes=[ERROR_CLASS], info=f"⚠ {errors[k]}", **extra))
            else:
                updates.append(gr.update(elem_classes=[], info=helps[k], **extra))
        return updates

    def on_change(*values: Any) -> str:
        return form.to_yaml(current(*values))

    def on_load(path: str) -> list[Any]:
        try:
            raw = form.read_config(path.strip())
        except TuneforgeError as e:
            return [gr.update() for _ in keys] + [f"**cannot load:** {e}"]
        values, errors = form.to_form(raw)
        notes = "".join(f"\n- `{k}`: {m}" for k, m in errors.items())
        return marked(errors, values) + [f"loaded {path}" + (f"; these keys could not be set:{notes}" if notes else "")]

    def on_dataset_dir(dataset_dir: str) -> list[Any]:
        names = _dataset_names(dataset_dir)
        return [gr.update(choices=names) for _ in LIST_FIELDS]

    def start(resume: bool, *values: Any) -> list[Any]:
        raw = current(*values)
        if resume:
            raw["resume_from_checkpoint"] = True
        cfg, errors, general = form.check(raw)
        if cfg is None:
            text = general or "\n".join(f"- `{k}`: {m}" for k, m in errors.items())
            return marked(errors) + [f"**cannot start:**\n{text}", gr.update(), gr.update()]
        try:
            launcher.start(cfg.train.output_dir, form.to_yaml(raw))
        except RuntimeError as e:
            return marked({}) + [f"**cannot start:** {e}", gr.update(), gr.update()]
        return marked({}) + [f"started: `tuneforge train {Path(cfg.train.output_dir) / 'webui_config.yaml'}`",
                             cfg.train.output_dir, gr.Timer(active=True)]

    def stop(output_dir: str) -> str:
        if not output_dir:
            return "no run to stop"
        launcher.stop(output_dir)
        return f"stopping {output_dir} after its current step (a checkpoint is saved)"

    def refresh(output_dir: str) -> list[Any]:
        if not output_dir:
            return [gr.update(), gr.update(), gr.update(), gr.update()]
        state = run_state(output_dir)
        text = f"**{state.summary}**"
        if state.status == "failed":
            text += "\n\nthe run failed; the end of its log is below"
        done = state.status in ("finished", "stopped", "failed")
        return [text, plot_frame(state), log_tail(Path(output_dir)), gr.Timer(active=not done)]

    def preview(*values: Any) -> str:
        from tuneforge.data import preview as render
        from tuneforge.model import load_model_processor, load_tokenizer

        cfg, errors, general = form.check(current(*values), for_training=False)
        if cfg is None:
            return general or "\n".join(f"{k}: {m}" for k, m in errors.items())
        try:
            processor = load_model_processor(cfg.model)
            tokenizer = processor.tokenizer if processor is not None else load_tokenizer(cfg.model)
            samples = render(cfg, tokenizer, n=3, processor=processor)
        except TuneforgeError as e:
            return str(e)
        return "\n\n".join(f"--- sample {i} ---\n{text}" for i, text in enumerate(samples))

    gr.on([c.change for c in components], on_change, components, yaml_view)
    load_button.click(on_load, load_path, [*components, message])
    fields["dataset_dir"].change(on_dataset_dir, fields["dataset_dir"], [fields[k] for k in LIST_FIELDS])
    start_button.click(lambda *v: start(False, *v), components, [*components, message, watched, timer])
    resume_button.click(lambda *v: start(True, *v), components, [*components, message, watched, timer])
    stop_button.click(stop, watched, message)
    timer.tick(refresh, watched, [status, plot, log_view, timer])
    preview_button.click(preview, components, preview_view)
