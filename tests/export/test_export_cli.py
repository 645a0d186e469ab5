"""`tuneforge export CONFIG`: exit 0 and where the model went; a bad config exits 2 with the reason."""

from __future__ import annotations

from tuneforge.cli import main


def test_export_command_prints_where_the_model_went(tiny_model_dir, lora_dir, tmp_path, capsys):
    cfg = tmp_path / "export.yaml"
    out = tmp_path / "merged"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\nadapter_name_or_path: {lora_dir}\n"
                   f"finetuning_type: lora\nexport_dir: {out}\n")
    assert main(["export", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert f"model saved in {out}" in printed and "ollama create" in printed
    assert (out / "model.safetensors").is_file()


def test_export_without_export_dir_exits_2(tiny_model_dir, tmp_path, capsys):
    cfg = tmp_path / "export.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\n")
    assert main(["export", str(cfg)]) == 2
    assert "export_dir is required" in capsys.readouterr().err
