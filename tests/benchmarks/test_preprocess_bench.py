"""benchmarks/preprocess_throughput.py's --chat-template: the tokenizer folder it times with renders with that
template, the two template options go together, and a missing template file is named before anything runs; its pt
corpus and the check that the peer's tokens come in the same order."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from preprocess_throughput import peer_stream_in_ours, with_chat_template, write_pt_corpus  # noqa: E402

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


def test_the_pt_corpus_is_the_demo_documents_over_again(tmp_path):
    source, target = tmp_path / "lf", tmp_path / "pt"
    source.mkdir(), target.mkdir()
    (source / "c4_demo.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    (source / "wiki_demo.txt").write_text("three\n\nfour\n", encoding="utf-8")
    write_pt_corpus(source, target, times=2)
    rows = json.loads((target / "pt_corpus.json").read_text(encoding="utf-8"))
    assert [r["text"] for r in rows] == ["one", "two", "three", "four"] * 2
    assert json.loads((target / "dataset_info.json").read_text())["pt_corpus"]["columns"] == {"prompt": "text"}


def _ids(path, rows):
    np.save(path, np.array([len(rows), *map(len, rows), *(t for r in rows for t in r)], dtype=np.int64))
    return path


def test_the_peers_pt_tokens_are_found_in_order_past_what_it_dropped(tmp_path):
    ours = _ids(tmp_path / "ours.npy", [[1, 2, 3, 4, 5], [6, 7, 8, 9]])
    dropped = _ids(tmp_path / "peer.npy", [[1, 2, 3, 4], [7, 8]])  # it dropped 5 and 6, then 9
    assert peer_stream_in_ours(ours, dropped) == 6
    other = _ids(tmp_path / "other.npy", [[1, 2, 3, 4], [70, 8]])  # 70 is nowhere in ours
    assert peer_stream_in_ours(ours, other) == 4
