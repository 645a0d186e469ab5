"""LLaMA Pro: `tuneforge llama-pro` adds blocks that start as identities (the expanded model computes what the
original did, in plain transformers), and use_llama_pro trains only those blocks (freeze) or adapters on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from tuneforge.cli import main
from tuneforge.config import from_dict
from tuneforge.errors import ConfigError
from tuneforge.model import load_model
from tuneforge.model.llama_pro import expand_model, expanded_layer_ids

REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def test_the_added_blocks_are_the_last_of_each_group():
    assert expanded_layer_ids(4, 2) == [1, 3]
    assert expanded_layer_ids(3, 1) == [2]
    assert expanded_layer_ids(40, 8) == [4, 9, 14, 19, 24, 29, 34, 39]  # 32 layers + 8 (LlamaFactory's example)
    with pytest.raises(ConfigError, match="positive divisor of the model's 4 layers"):
        expanded_layer_ids(4, 3)


@pytest.fixture(scope="module")
def expanded(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pro") / "tiny-pro"
    return expand_model(str(tiny_model_dir), out, num_expand=2), out


def test_expanded_model_computes_what_the_original_did(tiny_model_dir, expanded):
    result, out = expanded
    assert (result["layers"], result["expanded_layers"], result["new_blocks"]) == (2, 4, [1, 3])
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # plain transformers
    assert model.config.num_hidden_layers == 4
    ids = torch.tensor([[5, 17, 300, 42, 7, 9000]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=1e-5)
    weights, source = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    for new, copied_from in ((1, 0), (3, 1)):  # each new block: a copy of the one before, outputs zeroed
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj", "input_layernorm"):
            assert torch.equal(weights[f"model.layers.{new}.{name}.weight"],
                               source[f"model.layers.{copied_from}.{name}.weight"])
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert not weights[f"model.layers.{new}.{name}.weight"].any()
    assert torch.equal(weights["model.layers.2.self_attn.o_proj.weight"], source["model.layers.1.self_attn.o_proj.weight"])
    assert (out / "tokenizer.json").exists()


def test_per_layer_settings_follow_their_block(tmp_path, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "qwen3")
    tokenizer.save_pretrained(tmp_path / "qwen3")
    expand_model(str(tmp_path / "qwen3"), tmp_path / "qwen3-pro", num_expand=1)  # checks the logits itself
    saved = AutoConfig.from_pretrained(tmp_path / "qwen3-pro")
    assert saved.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]


def test_the_command_line_and_its_refusals(tiny_model_dir, tmp_path, capsys):
    assert main(["llama-pro", str(tiny_model_dir), str(tmp_path / "pro"), "--num-expand", "1"]) == 0
    assert "2 -> 3 layers" in capsys.readouterr().out
    assert main(["llama-pro", str(tiny_model_dir), str(tmp_path / "pro"), "--num-expand", "1"]) == 2
    assert "is not empty" in capsys.readouterr().err  # nothing a user has is overwritten
    assert main(["llama-pro", str(tiny_model_dir), str(tmp_path / "other"), "--num-expand", "3"]) == 2
    assert "positive divisor of the model's 2 layers" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def config(model_dir, tmp_path, **keys):
    return from_dict({"model_name_or_path": str(model_dir), "dataset": "identity", "dataset_dir": str(REPO_DATA),
                      "output_dir": str(tmp_path / "out"), "use_llama_pro": True, "freeze_trainable_layers": 2,
                      **keys}, source="pro.yaml")


def test_freeze_trains_only_the_added_blocks(expanded, tmp_path):
    _, out = expanded
    model = load_model(config(out, tmp_path, finetuning_type="freeze"))
    trainable = {n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"1", "3"}
    assert all(n.startswith(("model.layers.1.", "model.layers.3.")) for n, p in model.named_parameters()
               if p.requires_grad)


@pytest.mark.parametrize("kind", ["lora", "oft"])
def test_adapters_go_on_the_added_blocks_only(expanded, tmp_path, kind):
    _, out = expanded
    model = load_model(config(out, tmp_path, finetuning_type=kind, oft_block_size=8))
    adapted = {n.split("layers.")[1].split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"1", "3"}


def test_configs_that_cannot_work(expanded, tmp_path):
    _, out = expanded
    with pytest.raises(ConfigError, match="not full") as raised:
        config(out, tmp_path, finetuning_type="full")
    assert raised.value.keys == ("use_llama_pro", "finetuning_type")
    with pytest.raises(ConfigError, match="positive divisor of the model's 4 layers"):
        load_model(config(out, tmp_path, finetuning_type="freeze", freeze_trainable_layers=3))


def test_a_family_whose_blocks_would_not_start_as_identities_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    from tuneforge.errors import ModelError
    from tuneforge.model import llama_pro

    monkeypatch.setattr(llama_pro, "OUTPUT_PROJECTIONS", ("down_proj",))  # as if o_proj had another name
    with pytest.raises(ModelError, match="does not compute what the original did"):
        expand_model(str(tiny_model_dir), tmp_path / "bad", num_expand=1)
    assert not (tmp_path / "bad").exists()
