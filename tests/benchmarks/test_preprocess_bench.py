"""benchmarks/preprocess_throughput.py's --chat-template: the tokenizer folder it times with renders with that
template, the two template options go together, and a missing template file is named before anything runs."""

import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from preprocess_throughput import with_chat_template  # noqa: E402

QWEN3 = ROOT / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"


def test_the_timed_tokenizer_renders_with_the_given_template(smol_dir, tmp_path):
    folder = with_chat_template(str(smol_dir), QWEN3, tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                                         tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nYo<|im_end|>\n"
    assert (Path(folder) / "config.json").read_text() == (smol_dir / "config.json").read_text()


def test_a_chat_template_without_the_peers_template_is_refused():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "preprocess_throughput.py"), "--chat-template",
                           str(QWEN3)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--chat-template and --peer-template go together" in done.stderr


def test_a_missing_chat_template_file_is_named(tmp_path):
    missing = tmp_path / "nope.jinja"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "preprocess_throughput.py"), "--chat-template",
                           str(missing), "--peer-template", "qwen3"], capture_output=True, text=True)
    assert done.returncode == 2
    assert f"--chat-template {missing}: no such file" in done.stderr
