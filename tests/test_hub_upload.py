"""push_to_hub / export_hub_model_id: checked before the model loads (offline, unreachable, a refused or read-only
token), then uploaded with huggingface_hub's HfApi to a hub served on 127.0.0.1 (tests/hub_server.py), which keeps
every commit: what arrives is compared with the local files byte for byte."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from hub_server import GOOD, READ_ONLY, USER, serve

from tuneforge import workflow
from tuneforge.config import from_dict
from tuneforge.errors import ConfigError, HubError

REPO_DATA = Path(__file__).resolve().parents[1] / "data"


def train_cfg(tmp_path, model_dir, **keys):
    raw = {"model_name_or_path": str(model_dir), "dataset_dir": str(REPO_DATA), "dataset": "alpaca_demo",
           "output_dir": str(tmp_path / "out"), "max_samples": 8, "cutoff_len": 64, "max_steps": 2,
           "per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "steps",
           "save_steps": 1, "disable_tqdm": True, "push_to_hub": True, "hub_token": GOOD, **keys}
    return from_dict(raw, source="push.yaml")


@pytest.fixture
def online(monkeypatch):
    """The tests' HF_HUB_OFFLINE=1 lifted, for huggingface_hub too (it reads the variable once, at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture
def hub(online, monkeypatch, tmp_path):
    hub, server = serve()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # hf_xet keeps its cache there
    yield hub
    server.shutdown()


def never_loads(monkeypatch):
    monkeypatch.setattr(workflow, "run", lambda *a, **k: pytest.fail("nothing may load before the hub check"))


def test_push_to_hub_offline_fails_at_once(tmp_path, tiny_model_dir, monkeypatch):
    never_loads(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"^push.yaml: push_to_hub needs the Hugging Face hub, which is offline here "
                                          r"\(HF_HUB_OFFLINE=1\): unset HF_HUB_OFFLINE") as e:
        workflow.train(train_cfg(tmp_path, tiny_model_dir))
    assert e.value.keys == ("push_to_hub",)


def test_push_to_hub_with_the_hub_unreachable_fails_before_loading(tmp_path, tiny_model_dir, monkeypatch, online):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    never_loads(monkeypatch)
    with pytest.raises(ConfigError, match=rf"push_to_hub: cannot reach the Hugging Face hub at http://127.0.0.1:{port} "
                                          r"\(.*\); check the network \(or HF_ENDPOINT\), or drop push_to_hub"):
        workflow.train(train_cfg(tmp_path, tiny_model_dir))


@pytest.mark.parametrize(("token", "message", "keys"), [
    ("hf_wrong", r"refused the token \(401 Unauthorized\): set hub_token", ("push_to_hub", "hub_token")),
    (READ_ONLY, "the token of me is read-only; set hub_token", ("push_to_hub", "hub_token")),
])
def test_a_token_that_cannot_write_is_refused_before_loading(tmp_path, tiny_model_dir, monkeypatch, hub, token,
                                                            message, keys):
    never_loads(monkeypatch)
    with pytest.raises(ConfigError, match=message) as e:
        workflow.train(train_cfg(tmp_path, tiny_model_dir, hub_token=token))
    assert e.value.keys == keys


def test_every_save_uploads_each_checkpoint_model_then_the_output(tmp_path, tiny_model_dir, hub):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "webui_config.yaml").write_text(f"hub_token: {GOOD}\n")  # a UI's saved config
    cfg = train_cfg(tmp_path, tiny_model_dir, hub_model_id="tuned", hub_private_repo=True, hub_strategy="every_save",
                    hub_always_push=True)
    workflow.train(cfg)
    repo, out = f"{USER}/tuned", tmp_path / "out"
    assert hub.repos[repo]["private"] is True
    assert hub.messages(repo) == ["Training in progress, step 1", "Training in progress, step 2", "End of training"]
    first = hub.commits[0].files
    assert set(first) == {p.name for p in (out / "checkpoint-1").iterdir()} - {
        "optimizer.pt", "scheduler.pt", "rng_state.pt", "trainer_state.json", "README.md"}  # the card comes last
    files = hub.files(repo)
    assert files["adapter_model.safetensors"] == (out / "adapter_model.safetensors").read_bytes()
    assert files["README.md"] == (out / "README.md").read_bytes()
    assert b"# me/tuned" in files["README.md"]  # the card names the repository it was uploaded to
    for name in ("all_results.json", "trainer_log.jsonl", "adapter_config.json", "tokenizer.json"):
        assert files[name] == (out / name).read_bytes()
    assert not [p for p in files if p.startswith("checkpoint-") or p.startswith(".")]
    assert "webui_config.yaml" not in files  # it spells out the token
    assert not list(out.glob(".hub-upload*"))  # the hard-linked upload folders are gone


@pytest.mark.parametrize(("strategy", "extra"), [
    ("end", set()),
    ("checkpoint", {"last-checkpoint/optimizer.pt", "last-checkpoint/trainer_state.json"}),
    ("all_checkpoints", {"checkpoint-1/optimizer.pt", "checkpoint-2/optimizer.pt"}),
])
def test_hub_strategy_decides_what_goes_up(tmp_path, tiny_model_dir, hub, strategy, extra):
    workflow.train(train_cfg(tmp_path, tiny_model_dir, hub_strategy=strategy, hub_always_push=True,
                             hub_revision="experiment"))
    repo = f"{USER}/out"  # default: output_dir's folder name, in the token owner's namespace
    assert hub.repos[repo]["branches"] == ["main", "experiment"]
    assert hub.files(repo, "main") == {}
    files = hub.files(repo, "experiment")
    assert extra <= set(files)
    assert "optimizer.pt" not in files and "adapter_model.safetensors" in files
    if strategy == "end":
        assert hub.messages(repo) == ["End of training"]
    if strategy == "checkpoint":
        assert files["last-checkpoint/optimizer.pt"] == (tmp_path / "out" / "checkpoint-2" / "optimizer.pt").read_bytes()


def test_a_failed_final_upload_keeps_the_output_and_says_so(tmp_path, tiny_model_dir, hub):
    hub.fail_commits = True
    with pytest.raises(HubError, match=r"training finished: its output is complete in .*out, but the upload to "
                                       rf"{hub.url}/me/out failed .* the local files are kept: upload them later with "
                                       r"`hf upload me/out .*out`"):
        workflow.train(train_cfg(tmp_path, tiny_model_dir))
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file() and (out / "README.md").is_file()
    assert (out / "all_results.json").is_file()


def test_export_uploads_export_dir(tmp_path, make_export_cfg, hub, monkeypatch):
    from tuneforge.export import export_model

    result = export_model(make_export_cfg(export_hub_model_id="org/merged", hf_hub_token=GOOD))
    out = Path(result["export_dir"])
    files = hub.files("org/merged")
    assert files["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert files["README.md"] == (out / "README.md").read_bytes() and b"library_name: transformers" in files["README.md"]
    assert hub.messages("org/merged") == ["Upload model exported by tuneforge"]
    assert result["summary"][-1] == f"uploaded to {hub.url}/org/merged"


def test_export_offline_fails_before_the_weights_load(make_export_cfg, monkeypatch):
    from tuneforge import export
    from tuneforge.model import inference

    monkeypatch.setattr(inference, "load_inference_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ConfigError, match=r"export_hub_model_id needs the Hugging Face hub, which is offline here "
                                          r"\(HF_HUB_OFFLINE=1\)"):
        export.export_model(make_export_cfg(export_hub_model_id="org/merged"))


@pytest.fixture
def make_export_cfg(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                   LoraConfig(r=4, target_modules="all-linear")).save_pretrained(adapter)

    def build(**keys):
        return from_dict({"model_name_or_path": str(tiny_model_dir), "adapter_name_or_path": str(adapter),
                          "export_dir": str(tmp_path / "merged"), **keys}, for_training=False)

    return build
