"""New tokens: the tokenizer numbers them as single ids, the embeddings (and an untied head) grow and start as
init_special_tokens says (numbers worked out by hand), and they train beside an adapter or frozen layers."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from model_helpers import input_and_output_embeddings, loss_and_backward, trainable_names
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tuneforge.errors import ConfigError
from tuneforge.model import load_model, load_tokenizer
from tuneforge.model.vocab import init_rows

SPECIAL = "<|think|>,<|/think|>,<|tool|>"
DESCRIBED = {"<|think|>": "start thinking", "<|/think|>": "end thinking", "<|tool|>": "<|think|> tool"}


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory, tokenizer):
    """The tiny Llama with its own (untied) output head."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    out = tmp_path_factory.mktemp("tiny-untied")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ---------------------------------------------------------------- the starting rows, by hand


WEIGHT = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0], [0.0, 0.0], [0.0, 0.0]])  # rows 3, 4 are new


def draws(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 2, generator=torch.Generator().manual_seed(seed)) / math.sqrt(2)


def test_noise_init_is_the_mean_row_plus_noise_of_std_one_over_sqrt_d():
    rows = init_rows(WEIGHT, [3, 4], [0, 1, 2], "noise_init", {}, torch.Generator().manual_seed(0))
    mean = torch.tensor([3.0, 5.0])  # (1 + 3 + 5) / 3, (2 + 4 + 9) / 3
    torch.testing.assert_close(rows, mean + draws(2), rtol=0, atol=0)


def test_desc_init_is_the_mean_row_of_the_description_tokens():
    described = {3: [0, 2], 4: []}  # 4's description has no token with a trained row
    rows = init_rows(WEIGHT, [3, 4], [0, 1, 2], "desc_init", described, torch.Generator().manual_seed(0))
    torch.testing.assert_close(rows, torch.tensor([[3.0, 5.5], [3.0, 5.0]]), rtol=0, atol=0)
    noisy = init_rows(WEIGHT, [3, 4], [0, 1, 2], "desc_init_w_noise", described, torch.Generator().manual_seed(0))
    torch.testing.assert_close(noisy, torch.tensor([[3.0, 5.5], [3.0, 5.0]]) + draws(2), rtol=0, atol=0)
    plain = init_rows(WEIGHT, [3, 4], [0, 1, 2], "desc_init", {3: [1]}, torch.Generator().manual_seed(0))
    torch.testing.assert_close(plain[0], torch.tensor([3.0, 4.0]), rtol=0, atol=0)
    torch.testing.assert_close(plain[1], torch.tensor([3.0, 5.0]) + draws(2)[1], rtol=0, atol=0)  # no description


# ---------------------------------------------------------------- tokenizer


def test_new_tokens_are_single_ids_and_an_existing_token_is_kept(make_cfg, tokenizer, caplog):
    cfg = make_cfg(add_tokens="<tool>,hello", add_special_tokens=SPECIAL)
    with caplog.at_level(logging.WARNING, logger="tuneforge"):
        tok = load_tokenizer(cfg.model)
    assert "hello already in the vocabulary (ids 28120): not added" in caplog.text
    assert len(tok) == len(tokenizer) + 4
    assert tok.convert_tokens_to_ids(["<tool>", "<|think|>", "<|/think|>", "<|tool|>"]) == [49152, 49153, 49154, 49155]
    (a,), (b,), hello = (tokenizer(text)["input_ids"] for text in ("a", "b", "hello"))
    assert tok("a<|think|>b<tool>hello")["input_ids"] == [a, 49153, b, 49152, *hello]
    assert {i: t.special for i, t in tok.added_tokens_decoder.items() if i >= 49152} == {
        49152: False, 49153: True, 49154: True, 49155: True}
    assert tok.decode([a, 49153, 49152], skip_special_tokens=True) == "a<tool>"


def test_the_descriptions_file_names_the_special_tokens(make_cfg, tmp_path, caplog):
    path = tmp_path / "tokens.yaml"
    path.write_text("".join(f"'{k}': '{v}'\n" for k, v in DESCRIBED.items()))
    with caplog.at_level(logging.WARNING, logger="tuneforge"):
        cfg = make_cfg(new_special_tokens_config=str(path), add_special_tokens="<other>", init_special_tokens="desc_init")
    assert "adding the config's tokens ['<|think|>', '<|/think|>', '<|tool|>']" in caplog.text
    tok = load_tokenizer(cfg.model)
    assert tok.convert_tokens_to_ids(list(DESCRIBED)) == [49152, 49153, 49154]
    assert "<other>" not in tok.get_vocab()


def test_the_tokenized_data_cache_key_follows_the_new_tokens(make_cfg):
    from tuneforge.data.cache import tokenizer_fingerprint

    def key(**keys):
        return tokenizer_fingerprint(load_tokenizer(make_cfg(**keys).model))

    assert len({key(), key(add_tokens="<a>"), key(add_special_tokens="<a>"), key(add_tokens="<a>,<b>")}) == 4
    assert key(add_tokens="<a>") == key(add_tokens="<a>")


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("init", ["noise_init", "desc_init", "desc_init_w_noise"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embeddings_grow_and_start_as_init_special_tokens_says(make_cfg, tiny_model_dir, untied_dir, tokenizer,
                                                                init, tied):
    folder = tiny_model_dir if tied else untied_dir
    cfg = make_cfg(model_name_or_path=str(folder), finetuning_type="full", new_special_tokens_config=DESCRIBED,
                   add_tokens="<tool>", init_special_tokens=init, seed=7)
    model, tok = load_model(cfg), load_tokenizer(cfg.model)
    embed, head = input_and_output_embeddings(model)
    assert embed.weight.shape == (49156, 32) and head.weight.shape == (49156, 32)
    assert model.config.vocab_size == 49156 and (head.weight is embed.weight) == tied
    original = AutoModelForCausalLM.from_pretrained(folder)
    ids = [49152, 49153, 49154, 49155]  # <tool> (plain tokens first, as LlamaFactory adds them), <|think|>, ...
    for new, old in ((embed, original.get_input_embeddings()), (head, original.get_output_embeddings())):
        old = old.weight.detach()
        torch.testing.assert_close(new.weight[:49152], old, rtol=0, atol=0)  # the trained rows are untouched
        noise = torch.randn(4, 32, generator=torch.Generator().manual_seed(7)) / math.sqrt(32)  # the run's seed
        expected = old.mean(0) + noise  # noise_init; <tool> (no description) starts so with every method
        if init != "noise_init":
            for k, text in enumerate(DESCRIBED.values()):
                source = tok(text, add_special_tokens=False)["input_ids"]
                if k == 2:  # "<|think|> tool": the new token has no trained row yet and is left out
                    assert source[0] == 49153 and len(source) > 1
                start = old[[i for i in source if i < 49152]].mean(0)
                expected[k + 1] = start + noise[k + 1] if init == "desc_init_w_noise" else start
        torch.testing.assert_close(new.weight[ids], expected, rtol=0, atol=1e-6)


def test_tokens_already_in_the_vocabulary_change_nothing(make_cfg, tiny_model_dir):
    model = load_model(make_cfg(finetuning_type="lora", add_special_tokens="<|im_end|>,<|im_start|>"))
    embed, _ = input_and_output_embeddings(model)
    assert embed.weight.shape[0] == 49152
    assert model.peft_config["default"].modules_to_save is None  # nothing new: the embeddings stay frozen


def test_lora_trains_the_embeddings_in_full_and_keeps_them_tied(make_cfg, batch):
    model = load_model(make_cfg(finetuning_type="lora", lora_target="q_proj", add_special_tokens=SPECIAL))
    assert "base_model.model.model.embed_tokens.modules_to_save.default.weight" in trainable_names(model)
    embed, head = input_and_output_embeddings(model)
    assert head.weight is embed.weight and embed.weight.shape[0] == 49155
    loss_and_backward(model, torch.cat([batch, torch.tensor([[49152, 49153], [49154, 49152]])], dim=1))
    assert embed.weight.grad[49152:].abs().sum() > 0  # the new rows learn


def test_lora_and_oft_on_an_untied_model_train_embeddings_and_head(make_cfg, untied_dir):
    for kind, keys in (("lora", {"additional_target": "norm"}), ("oft", {})):
        model = load_model(make_cfg(model_name_or_path=str(untied_dir), finetuning_type=kind, add_tokens="<tool>",
                                    **keys))
        saved = set(model.peft_config["default"].modules_to_save)
        assert {"embed_tokens", "lm_head"} <= saved and ("norm" in saved) == (kind == "lora")


def test_oft_on_a_tied_model_refuses_new_tokens_clearly(make_cfg):
    with pytest.raises(ConfigError, match="ties its head to its embeddings, and peft's OFT cannot train the two"):
        load_model(make_cfg(finetuning_type="oft", add_tokens="<tool>"))


def test_freeze_trains_the_embeddings_beside_the_layers(make_cfg):
    model = load_model(make_cfg(finetuning_type="freeze", freeze_trainable_layers=1, resize_vocab=True))
    assert "model.embed_tokens.weight" in trainable_names(model)


def test_the_reference_starts_from_the_policys_rows(make_cfg):
    from tuneforge.model import load_reference

    cfg = make_cfg(finetuning_type="full", stage="dpo", add_special_tokens=SPECIAL, seed=3)
    policy, reference = load_model(cfg), load_reference(cfg)
    torch.testing.assert_close(reference.get_input_embeddings().weight, policy.get_input_embeddings().weight,
                               rtol=0, atol=0)


def test_the_saved_tokenizer_of_an_adapter_brings_its_tokens(make_cfg, tmp_path, tokenizer):
    """chat / export of an adapter trained with new tokens, from a config without the token keys."""
    trained = load_model(make_cfg(finetuning_type="lora", lora_target="q_proj", add_special_tokens=SPECIAL))
    trained.save_pretrained(tmp_path)
    load_tokenizer(make_cfg(add_special_tokens=SPECIAL).model).save_pretrained(tmp_path)
    tok = load_tokenizer(make_cfg(adapter_name_or_path=str(tmp_path)).model)
    assert tok.convert_tokens_to_ids(SPECIAL.split(",")) == [49152, 49153, 49154]
    assert AutoTokenizer.from_pretrained(tmp_path).added_tokens_decoder[49153].special
