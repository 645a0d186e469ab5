"""The web UI (`tuneforge webui`, `pip install 'tuneforge[webui]'`): forms from the config schema, runs as processes
of the CLI's own `tuneforge train`, views from the runs' own files. `form`, `runs` and `process` import no gradio."""
