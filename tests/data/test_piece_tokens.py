"""piece_tokens: SentencePiece-style pipelines (Llama 2, Mistral v0.x, Gemma) a word at a time, with the tokenizer's own
ids and offsets; pipelines it cannot split safely go to the tokenizer."""

from __future__ import annotations

import json

import pytest
from test_word_tokens import HARD, _assert_as_the_tokenizer, _rendered, _tokenizer_call
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tuneforge.data import piece_tokens, word_tokens

SPACE = "▁"
REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}


def metaspace(prepend: str, split: bool = False) -> dict:
    return {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": prepend, "split": split}


# (normalizer, pre-tokenizer) as the families' tokenizer.json files write them
PIPELINES = {
    "mistral (transformers' conversion)": (None, metaspace("first")),
    "metaspace, always": (None, metaspace("always")),
    "metaspace, never": (None, metaspace("never")),
    "metaspace that splits": (None, metaspace("always", split=True)),
    "llama 2 (Prepend, Replace)": ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE},
                                                                         REPLACE]}, None),
    "gemma (Replace)": (REPLACE, None),
    "gemma (Replace, a Split at spaces)": (REPLACE, {"type": "Split", "pattern": {"String": " "},
                                                     "behavior": "MergedWithPrevious", "invert": False}),
}


def _rows(lf_data_dir) -> list[dict]:
    rows = []
    for name in ("alpaca_en_demo.json", "alpaca_zh_demo.json", "glaive_toolcall_en_demo.json", "identity.json"):
        rows += json.loads((lf_data_dir / name).read_text(encoding="utf-8"))[:150]
    return rows


def _texts(lf_data_dir) -> list[str]:
    """The demo rows as Mistral's chat format writes them, their raw JSON, and the hard cases."""
    texts = list(HARD) + ["<s>[INST] Hello [/INST] Hi there</s>", " <s> x", "<s>", "a<s>b</s>  c", "\n\nfoo", "<s>\n"]
    for row in _rows(lf_data_dir):
        texts.append(json.dumps(row, ensure_ascii=False))
        texts.append(f"<s>[INST] {row.get('instruction', row)} [/INST] {row.get('output', '')}</s>")
    return texts


@pytest.fixture(scope="module", params=[True, False], ids=["newline token", "newline as a byte"])
def trained(request, lf_data_dir) -> dict:
    """A SentencePiece-style BPE trained here on the demo rows, as transformers converts Llama 2's and Mistral's:
    words that begin with ▁, byte fallback (<0x00> ... <0xFF> in the vocabulary), <unk> <s> </s> added. Without a
    newline token (Llama 2's and Mistral's vocabularies) a newline is a byte."""
    texts = ["\n".join(map(str, row.values())) for row in _rows(lf_data_dir)]
    if not request.param:
        texts = [text.replace("\n", " ") for text in texts]
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    learner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2500, special_tokens=["<unk>", "<s>", "</s>"],
                                                           limit_alphabet=300, show_progress=False))
    spec = json.loads(learner.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    assert ("\n" in vocab) is request.param
    return spec


def _tokenizer(spec: dict, normalizer=None, pre_tokenizer=None, **model) -> PreTrainedTokenizerFast:
    spec = json.loads(json.dumps(spec))
    spec.update(normalizer=normalizer, pre_tokenizer=pre_tokenizer)
    spec["model"].update(model)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_the_pipelines_ids_and_offsets(trained, lf_data_dir, pipeline):
    tokenizer = _tokenizer(trained, *PIPELINES[pipeline])
    assert isinstance(word_tokens.for_tokenizer(tokenizer), piece_tokens.PieceTokens)
    texts = _texts(lf_data_dir)
    _assert_as_the_tokenizer(tokenizer, texts, least_taken=0.55)  # (not the Chinese rows)
    assert word_tokens.encode_documents(tokenizer, texts) == tokenizer(texts, add_special_tokens=True)["input_ids"]


def test_a_space_put_before_the_text_shares_the_first_characters_offsets(trained):
    """Metaspace's "first" puts a ▁ before the text's first stretch only; alone it is a token of its own, which the
    tokenizers library gives the first character's offsets, as it gives the token after it."""
    tokenizer = _tokenizer(trained, *PIPELINES["mistral (transformers' conversion)"])
    texts = ["\nfoo", "<s>\nfoo", "the end", "<s> the end"]
    ids, offsets = _rendered(tokenizer, texts)
    assert (ids, offsets) == _tokenizer_call(tokenizer, texts)
    if "\n" in trained["model"]["vocab"]:  # the ▁ joins the newline
        assert tokenizer.convert_ids_to_tokens(ids[0][0]) == SPACE + "\n" and offsets[0][0] == (0, 1)
    else:
        assert tokenizer.convert_ids_to_tokens(ids[0][:2]) == [SPACE, "<0x0A>"] and offsets[0][:2] == [(0, 1), (0, 1)]
    assert tokenizer.convert_ids_to_tokens(ids[1][1])[0] != SPACE  # after <s>: no ▁ put there
    assert tokenizer.convert_ids_to_tokens(ids[2][0]) == tokenizer.convert_ids_to_tokens(ids[3][1]) == SPACE + "the"
    assert offsets[2][0] == (0, 3) and offsets[3][1] == (3, 7)  # "▁the": "the" at the start, " the" after <s>


def test_a_token_across_a_word_boundary_leaves_the_pipeline_to_the_tokenizer(trained):
    """A token holding a ▁ after another character could span the places this module splits at: not read."""
    spec = json.loads(json.dumps(trained))
    spec["model"]["vocab"]["e" + SPACE] = len(spec["model"]["vocab"])
    spec["model"]["merges"].insert(0, ["e", SPACE])
    tokenizer = _tokenizer(spec, *PIPELINES["mistral (transformers' conversion)"])
    assert word_tokens.for_tokenizer(tokenizer) is None
    text = ["<s>[INST] the tree here [/INST] one more</s>"]
    assert tokenizer.convert_tokens_to_ids("e" + SPACE) in _tokenizer_call(tokenizer, text)[0][0]
    assert _rendered(tokenizer, text) == _tokenizer_call(tokenizer, text)
    splitting = _tokenizer(spec, *PIPELINES["metaspace that splits"])  # it splits before every ▁ itself
    assert isinstance(word_tokens.for_tokenizer(splitting), piece_tokens.PieceTokens)
    assert _rendered(splitting, text) == _tokenizer_call(splitting, text)


@pytest.mark.parametrize("change", ["ignore_merges", "dropout", "a normalized added token", "lowercase"])
def test_pipelines_it_does_not_read_go_to_the_tokenizer(trained, change):
    normalizer, pre = PIPELINES["llama 2 (Prepend, Replace)"]
    model = {"ignore_merges": True} if change == "ignore_merges" else {"dropout": 0.1} if change == "dropout" else {}
    if change == "lowercase":
        normalizer = {"type": "Sequence", "normalizers": [*normalizer["normalizers"], {"type": "Lowercase"}]}
    tokenizer = _tokenizer(trained, normalizer, pre, **model)
    if change == "a normalized added token":
        tokenizer.add_tokens(["<tool call>"])  # matched on the normalized text, where its space is a ▁
    assert word_tokens.for_tokenizer(tokenizer) is None
    if change != "dropout":  # (dropout draws its merges at random)
        text = ["<s>[INST] Hello There <tool call> [/INST]</s>"]
        assert _rendered(tokenizer, text) == _tokenizer_call(tokenizer, text)
