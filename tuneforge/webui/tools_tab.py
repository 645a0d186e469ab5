"""The Evaluate, Export and Runs tabs: `tuneforge eval` and `tuneforge export` run as the CLI runs them (a process
of their own, their log streamed into the page), and the runs under the output root with their state."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from tuneforge.webui import form
from tuneforge.webui.runs import find_runs, run_state
from tuneforge.webui.train_tab import plot_frame


def run_command(command: str, raw: dict[str, Any]) -> Iterator[str]:
    """`tuneforge COMMAND config.yaml` on the mapping (checked first, as the CLI checks it); the log so far."""
    cfg, errors, general = form.check(raw, for_training=False)
    if cfg is None:
        yield "cannot run: " + (general or "; ".join(f"{k}: {m}" for k, m in errors.items()))
        return
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(form.to_yaml(raw))
    process = subprocess.Popen([sys.executable, "-m", "tuneforge.cli", command, f.name], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            yield "\n".join(lines[-200:])
        code = process.wait()
    finally:
        if process.poll() is None:  # the page went away: the command goes too
            process.kill()
        Path(f.name).unlink(missing_ok=True)
    yield "\n".join(lines[-200:] + [f"[tuneforge {command} {'finished' if code == 0 else f'failed (exit {code})'}]"])


def _folder_size(path: Path) -> str:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return f"{sum(p.stat().st_size for p in files) / 2**20:.1f} MiB"


def build_eval(model: str) -> None:
    with gr.Row():
        model_box = gr.Textbox(value=model, label="model_name_or_path", elem_id="eval-model")
        adapter_box = gr.Textbox(label="adapter_name_or_path (or a run's output_dir)", elem_id="eval-adapter")
    with gr.Row():
        dataset_dir = gr.Textbox(value="data", label="dataset_dir")
        dataset = gr.Textbox(label="eval_dataset (names, comma-separated)", elem_id="eval-dataset")
        task = gr.Textbox(label="task (a multiple-choice benchmark, e.g. mmlu_test)")
        generate = gr.Checkbox(label="predict_with_generate (BLEU / ROUGE of generated answers)")
        max_samples = gr.Textbox(label="max_samples")
        save_dir = gr.Textbox(label="save_dir", value="saves/eval", elem_id="eval-save-dir")
    run = gr.Button("Evaluate", variant="primary", elem_id="eval-run")
    log = gr.Textbox(label="log", lines=12, interactive=False, elem_id="eval-log")
    results = gr.JSON(label="results", elem_id="eval-results")

    def evaluate(*values: Any) -> Iterator[tuple[str, Any]]:
        m, a, ddir, ds, t, gen, ms, sd = values
        raw = {"model_name_or_path": m, "adapter_name_or_path": a or None, "dataset_dir": ddir,
               "eval_dataset": ds or None, "task": t or None, "predict_with_generate": gen,
               "max_samples": ms or None, "save_dir": sd}
        raw = {k: v for k, v in raw.items() if v not in (None, "", False)}
        for text in run_command("eval", raw):
            yield text, gr.update()
        found = Path(sd) / "eval_results.json" if sd else None
        yield text, json.loads(found.read_text()) if found is not None and found.is_file() else None

    run.click(evaluate, [model_box, adapter_box, dataset_dir, dataset, task, generate, max_samples, save_dir],
              [log, results])


def build_export(model: str) -> None:
    with gr.Row():
        model_box = gr.Textbox(value=model, label="model_name_or_path", elem_id="export-model")
        adapter_box = gr.Textbox(label="adapter_name_or_path (or a run's output_dir)", elem_id="export-adapter")
        export_dir = gr.Textbox(label="export_dir", value="saves/export", elem_id="export-dir")
    with gr.Row():
        export_format = gr.Dropdown(["safetensors", "gguf"], value="safetensors", label="export_format")
        gguf_type = gr.Dropdown(["f32", "f16", "bf16", "q8_0"], value="f16", label="export_gguf_type")
    run = gr.Button("Export", variant="primary", elem_id="export-run")
    log = gr.Textbox(label="log", lines=10, interactive=False, elem_id="export-log")
    result = gr.Markdown(elem_id="export-result")

    def export(m: str, a: str, out: str, fmt: str, gguf: str) -> Iterator[tuple[str, str]]:
        raw = {"model_name_or_path": m, "adapter_name_or_path": a or None, "export_dir": out,
               "export_format": fmt, "export_gguf_type": gguf}
        text = ""
        for text in run_command("export", {k: v for k, v in raw.items() if v}):
            yield text, ""
        target = Path(out)
        made = sorted(target.glob("*.gguf")) if fmt == "gguf" and target.is_dir() else [target]
        done = [p for p in made if p.exists()] if text.endswith("finished]") else []
        yield text, "".join(f"**{p}**: {_folder_size(p)}\n\n" for p in done) or "no export written"

    run.click(export, [model_box, adapter_box, export_dir, export_format, gguf_type], [log, result])


def build_runs(root: Path) -> None:
    refresh = gr.Button("Refresh", elem_id="runs-refresh")
    table = gr.Dataframe(headers=["output_dir", "status", "step", "loss", "results"], interactive=False,
                         elem_id="runs-table")
    chosen = gr.Textbox(label="a run's output_dir (click a row)", elem_id="runs-chosen")
    details = gr.Markdown(elem_id="runs-details")
    plot = gr.LinePlot(x="step", y="value", color="series", label="curves", elem_id="runs-plot")

    def listing() -> pd.DataFrame:
        rows = []
        for state in find_runs(root):
            last = f"{state.loss[-1][1]:.4f}" if state.loss else ""
            results = ", ".join(f"{k}={v:.4f}" for k, v in state.results.items()
                                if k in ("train_loss", "eval_loss") and isinstance(v, (int, float)))
            rows.append([str(state.output_dir), state.status, f"{state.step}/{state.total_steps}", last, results])
        return pd.DataFrame(rows, columns=["output_dir", "status", "step", "loss", "results"])

    def pick(frame: pd.DataFrame, event: gr.SelectData) -> str:
        return str(frame.iloc[event.index[0], 0])

    def show(output_dir: str) -> tuple[str, Any]:
        if not output_dir.strip():
            return "", None
        state = run_state(output_dir.strip())
        text = f"**{state.summary}**\n\n" + "".join(f"- {k}: {v}\n" for k, v in state.results.items())
        if state.error:
            text += f"\n```\n{state.error}\n```"
        return text, plot_frame(state)

    refresh.click(listing, None, table)
    table.select(pick, table, chosen)
    chosen.change(show, chosen, [details, plot])
