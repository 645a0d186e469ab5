"""`tuneforge chat` and `tuneforge api` through tuneforge.cli.main (in process)."""

import pytest
import yaml

from tuneforge.cli import main


@pytest.fixture
def cfg_file(tmp_path, rm_model_dir):
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(rm_model_dir), "do_sample": False,
                                    "max_new_tokens": 4}))
    return path


def test_chat_command_streams_an_answer(cfg_file, monkeypatch, capsys):
    lines = iter(["Hello", "exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", str(cfg_file), "--system", "Be brief."]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Chat with ") and "Assistant: " in out


def test_chat_with_vllm_names_the_install(cfg_file, capsys):
    assert main(["chat", str(cfg_file), "infer_backend=vllm"]) == 2
    assert "pip install vllm" in capsys.readouterr().err


def test_api_command_reads_host_port_and_key_from_the_environment(cfg_file, monkeypatch):
    seen = {}
    monkeypatch.setattr("tuneforge.infer.api.serve", lambda cfg, **kw: seen.update(kw))
    monkeypatch.setenv("API_HOST", "127.0.0.1")
    monkeypatch.setenv("API_PORT", "8123")
    monkeypatch.setenv("API_KEY", "k")
    assert main(["api", str(cfg_file)]) == 0
    assert seen == {"host": "127.0.0.1", "port": 8123, "api_key": "k"}
    assert main(["api", str(cfg_file), "--port", "9000", "--host", "0.0.0.0"]) == 0
    assert seen == {"host": "0.0.0.0", "port": 9000, "api_key": "k"}


def test_api_command_refuses_a_bad_port(cfg_file, monkeypatch, capsys):
    monkeypatch.setenv("API_PORT", "eighty")
    assert main(["api", str(cfg_file)]) == 2
    assert "API_PORT='eighty'" in capsys.readouterr().err
