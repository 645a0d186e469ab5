"""Shared fixtures: the built-in tokenizer and a tiny random Llama that shares it (2 layers, hidden 32)."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "tuneforge-mpl"))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _os_environ_stays_the_process_environment():
    """Put the original os.environ object back after each test.

    datasets' Dataset.map with num_proc >= 1 (our preprocessing_num_workers) replaces os.environ with a deep
    copy of itself (arrow_dataset.py: `prev_env = deepcopy(os.environ)` ... `os.environ = prev_env`).
    monkeypatch undoes a setenv on the object it patched, the old one, so the copy kept the test's value for
    the rest of the session: a data test's private TUNEFORGE_HOME reached tests/model/test_hub.py.
    Autouse fixtures are set up first and torn down last, so this runs after monkeypatch has undone its
    changes on the original object (and, through it, on the process environment).
    """
    environ = os.environ
    yield
    if os.environ is not environ:
        os.environ = environ  # noqa: B003 (the object itself is what we restore)


@pytest.fixture(scope="session", autouse=True)
def _vml_settled():
    """MKL's vector math settled on one thread before any test computes, as tuneforge does before a model loads: tests
    that build models by hand would otherwise meet its first-call race (model/mkl_warmup.py) in a test comparing
    two forwards exactly."""
    from tuneforge.model.mkl_warmup import settle_vml_dispatch

    settle_vml_dispatch()


@pytest.fixture(scope="session")
def smol_dir():
    """The built-in SmolLM2-135M-Instruct folder (converted once into tuneforge's cache)."""
    from tuneforge.model.hub import builtin_model_dir

    return builtin_model_dir()


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture
def home(tokenizer, tmp_path, monkeypatch):
    """A private TUNEFORGE_HOME (set after the tokenizer fixture has found the built-in model)."""
    path = tmp_path / "tf-home"
    monkeypatch.setenv("TUNEFORGE_HOME", str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny random LlamaForCausalLM (fp32) with the built-in tokenizer, saved as a HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def selective_everywhere(monkeypatch):
    """The memory plan of disable_gradient_checkpointing unset, with every layer that its budget leaves without
    checkpointing selectively checkpointed instead (ample memory would leave all of them without)."""
    from tuneforge.model import checkpointing

    chosen = checkpointing.plan
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 1e12)
    monkeypatch.setattr(checkpointing, "plan", lambda *args, **kwargs: dataclasses.replace(
        p := chosen(*args, **kwargs), none=0, selective=p.selective + p.none))


@pytest.fixture(scope="session")
def lf_data_dir():
    """LlamaFactory's own dataset_info.json and demo data (shared, read-only)."""
    import os
    from pathlib import Path

    path = Path(os.environ.get("TUNEFORGE_LF_DATA")  # elsewhere on a machine without the shared folder
                or Path(__file__).resolve().parents[2] / "shared" / "data" / "llamafactory")
    if not path.is_dir():
        pytest.skip(f"LlamaFactory's demo data is not at {path}: this test proves tuneforge reads LlamaFactory's own "
                    f"files, which live beside the project (../shared/data/llamafactory), not in it")
    return path


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory, smol_dir):
    """A tiny random Qwen2-VL (the family's config, processor and chat template) saved as a HF folder."""
    from mm_families import build_family

    return build_family("qwen2_vl", tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="session")
def loud_vlm(vlm_dir, tmp_path_factory):
    """The tiny Qwen2-VL with larger weights, so that its greedy answers are varied text, not one repeated token."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText

    out = tmp_path_factory.mktemp("loud-vlm")
    shutil.copytree(vlm_dir, out, dirs_exist_ok=True)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.mul_(20)
    model.save_pretrained(out)
    return out
