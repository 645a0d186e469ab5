"""The README.md model card of a training run's output_dir and of an export_dir: Hugging Face metadata, the
results, and usage code that runs with transformers / peft alone; a README.md someone else wrote is kept."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from tuneforge.config import from_dict
from tuneforge.export import card

REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def train(tmp_path, model_dir, monkeypatch, **keys):
    from tuneforge.workflow import run

    monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "home"))
    raw = {"model_name_or_path": str(model_dir), "dataset_dir": str(REPO_DATA), "dataset": "alpaca_demo",
           "output_dir": str(tmp_path / "out"), "max_samples": 16, "cutoff_len": 64, "max_steps": 4,
           "per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no",
           "disable_tqdm": True, "val_size": 4, "eval_strategy": "steps", "eval_steps": 2, **keys}
    return run(from_dict(raw, source="card.yaml"))


def usage_code(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_training_writes_a_card_whose_code_loads_the_adapter_with_peft_alone(tmp_path, tiny_model_dir, monkeypatch):
    train(tmp_path, tiny_model_dir, monkeypatch)
    out = tmp_path / "out"
    text = (out / "README.md").read_text()
    loaded = ModelCard.load(out / "README.md")
    assert loaded.data.library_name == "peft" and loaded.data.pipeline_tag == "text-generation"
    assert loaded.data.tags == ["tuneforge", "sft", "lora", "llama-factory-compatible"]
    assert loaded.data.datasets == ["alpaca_demo"]
    assert loaded.data.base_model is None and loaded.data.license is None  # a local folder with no card of its own
    assert card.MARKER in text
    results = json.loads((out / "all_results.json").read_text())
    assert f"| train_loss | {results['train_loss']:.6g} |" in text
    assert f"| eval_loss | {results['eval_loss']:.6g} |" in text
    assert re.search(r"\| step \| epoch \| eval_loss \| perplexity \|\n\|---\|---\|---\|---\|\n\| 2 \|.*\n\| 4 \|", text)
    assert "| lora_rank | 8 |" in text and "| lora_alpha | 16 |" in text and "| total_batch_size | 4 |" in text
    scope: dict = {}
    exec(usage_code(text).replace("max_new_tokens=64", "max_new_tokens=2"), scope)  # noqa: S102 - the card's code
    assert type(scope["model"]).__name__ == "PeftModelForCausalLM"
    assert scope["model"].peft_config["default"].r == 8


def test_a_readme_someone_else_wrote_is_kept(tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("# my notes\n")
    train(tmp_path, tiny_model_dir, monkeypatch, max_steps=1, val_size=0, eval_strategy="no")
    assert (out / "README.md").read_text() == "# my notes\n"  # neither peft's template nor our card replaced it


def test_a_full_fine_tune_of_the_built_in_model_names_its_hub_base_and_license(tmp_path):
    cfg = from_dict({"model_name_or_path": "smollm2-135m-instruct", "finetuning_type": "full", "stage": "dpo",
                     "dataset": "dpo_demo", "output_dir": str(tmp_path / "o")})
    made = card.training_card(cfg, tmp_path, {"train_loss": 0.5}, [], processes=2)
    assert made.data.base_model == card.BUILTIN_HUB_ID and made.data.license == "apache-2.0"
    assert made.data.library_name == "transformers"
    assert "| pref_loss | sigmoid |" in made.content and "| processes | 2 |" in made.content
    assert f'AutoModelForCausalLM.from_pretrained("{tmp_path.resolve()}")' in made.content


def test_base_model_is_a_hub_id_or_nothing(tmp_path):
    snapshot = tmp_path / "hub" / "models--org--base-7b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert card.base_model_id("org/base-7b") == "org/base-7b"
    assert card.base_model_id(str(snapshot)) == "org/base-7b"  # a hub download's cache folder
    assert card.base_model_id(str(tmp_path)) is None
    assert card.base_model_id("./relative/name") is None


def test_the_license_comes_from_the_base_models_own_card(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: my-license\n---\n# base\n")
    cfg = from_dict({"model_name_or_path": str(base), "dataset": "d", "output_dir": str(tmp_path / "o")})
    data = card.training_card(cfg, tmp_path, {}, []).data
    assert (data.license, data.license_name) == ("other", "my-license")


def test_export_writes_a_transformers_card_whose_code_loads_the_merged_model(make_cfg, tmp_path):
    from tuneforge.export import export_model

    result = export_model(make_cfg())
    out = Path(result["export_dir"])
    loaded = ModelCard.load(out / "README.md")
    assert loaded.data.library_name == "transformers" and "merged" in loaded.data.tags
    assert result["model_card"] == str(out / "README.md")
    scope: dict = {}
    exec(usage_code(loaded.content).replace("max_new_tokens=64", "max_new_tokens=2"), scope)  # noqa: S102
    assert type(scope["model"]).__name__ == "LlamaForCausalLM"


def test_export_keeps_a_readme_the_user_put_in_export_dir(make_cfg, tmp_path):
    from tuneforge.export import export_model

    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("# ours\n")
    export_model(make_cfg())
    assert (out / "README.md").read_text() == "# ours\n"
    assert (out / "model.safetensors").is_file()
    export_model(make_cfg())  # the folder is an export now; the card stays theirs
    assert (out / "README.md").read_text() == "# ours\n"


@pytest.mark.parametrize("written_by_us", [True, False])
def test_save_rewrites_only_its_own_card(tmp_path, written_by_us):
    (tmp_path / "README.md").write_text(f"{card.MARKER}\nold\n" if written_by_us else "theirs\n")
    made = ModelCard("---\nlibrary_name: peft\n---\n" + card.MARKER + "\nnew\n")
    assert (card.save(made, tmp_path) is not None) is written_by_us
    assert ("new" in (tmp_path / "README.md").read_text()) is written_by_us
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no temporary file left


@pytest.mark.parametrize(("stage", "pipeline", "head_note"), [("rm", None, True), ("ppo", "text-generation", False),
                                                              ("sft", "text-generation", False)])
def test_the_card_says_what_kind_of_model_the_stage_made(tmp_path, stage, pipeline, head_note):
    keys = {"reward_model": "http://127.0.0.1:1/score", "reward_model_type": "api"} if stage == "ppo" else {}
    cfg = from_dict({"model_name_or_path": "org/base", "stage": stage, "dataset": "d", "output_dir": str(tmp_path / "o"),
                     **keys}, for_training=False)
    made = card.training_card(cfg, tmp_path, {}, [])
    assert made.data.pipeline_tag == pipeline and made.data.base_model == "org/base"
    assert ("value_head.safetensors" in made.content) is head_note
    assert ("model.generate(" in made.content) is (pipeline is not None)
