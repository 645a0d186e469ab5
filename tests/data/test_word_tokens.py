"""word_tokens: the tokenizer's own ids and offsets, a word at a time, for the texts it takes; the rest go to the
tokenizer."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from tuneforge.data import template, word_tokens
from tuneforge.errors import DataError

# the pre-tokenizer regexes of Llama 3's and Qwen2's tokenizer.json
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

HARD = [
    "It's THE cat's toy; IT'S 'S 'll 'D ſ K",
    "naïve café — “quoted” … ½ 3.14 10,000 1234567 x²",
    "e\u0301 is not é", "the ﬁ ligature", "Å and Å", "Kelvin K, long ſ",
    "tabs\tand\r\nnewlines\n\n\n  spaces   \u00a0nbsp \u2003em\u2028line",
    "emoji 🙂👍🏽 and 中文 mixed, Привет мир, ελληνικά, עברית, العربية",
    "emoji 🙂👍🏽 ❤️ 👨‍👩‍👧 🚀🚀 alone", "Привет мир, ελληνικά, שלום עולם, مرحبا بالعالم",
    "control \x00\x04\x1c\x1d\x7f characters",
    "<|im_start|>user\nhi<|im_end|>\n<|im_end|><|im_end|>a<|im_start|>b",
    "", " ", "\n", "  leading", "trailing  ", "   \n  \n",
]


def _texts(tokenizer, lf_data_dir) -> list[str]:
    """LlamaFactory's demo rows rendered with the chat template, and their raw JSON, and the hard cases."""
    texts = list(HARD)
    for name in ("alpaca_en_demo.json", "alpaca_zh_demo.json", "glaive_toolcall_en_demo.json", "identity.json"):
        rows = json.loads((lf_data_dir / name).read_text(encoding="utf-8"))[:150]
        texts += [json.dumps(row, ensure_ascii=False) for row in rows]
        texts += [tokenizer.apply_chat_template(
            [{"role": "user", "content": str(row.get("instruction", row))},
             {"role": "assistant", "content": str(row.get("output", ""))}], tokenize=False) for row in rows]
    return texts


def _tokenizer_call(tokenizer, texts):
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    return enc["input_ids"], [[tuple(pair) for pair in offsets] for offsets in enc["offset_mapping"]]


def _rendered(tokenizer, texts):
    ids, offsets = template.tokenize_rendered(tokenizer, texts)
    return ids, [[tuple(pair) for pair in text_offsets] for text_offsets in offsets]


def _family(tokenizer, split=None, normalizer=None, ignore_merges=False, post_processor=None):
    """The built-in vocabulary in another family's pipeline: a Split by the family's regex before a ByteLevel."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if split is not None:
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    spec["normalizer"] = normalizer
    spec["model"]["ignore_merges"] = ignore_merges
    if post_processor is not None:
        spec["post_processor"] = post_processor
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def _assert_as_the_tokenizer(tokenizer, texts, least_taken):
    words = word_tokens.for_tokenizer(tokenizer)
    assert words is not None
    taken = sum(ids is not None for ids in words.encode(texts)[0])
    assert taken >= least_taken * len(texts), f"took {taken} of {len(texts)} texts"
    ids, offsets = _rendered(tokenizer, texts)
    expected_ids, expected_offsets = _tokenizer_call(tokenizer, texts)
    for n, text in enumerate(texts):
        assert ids[n] == expected_ids[n], text
        assert offsets[n] == expected_offsets[n], text


def test_the_built_in_tokenizers_ids_and_offsets(tokenizer, lf_data_dir):
    _assert_as_the_tokenizer(tokenizer, _texts(tokenizer, lf_data_dir), least_taken=0.55)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_llama3_and_qwen2_pipelines(tokenizer, lf_data_dir, family):
    other = (_family(tokenizer, LLAMA3_SPLIT, ignore_merges=True) if family == "llama3"
             else _family(tokenizer, QWEN2_SPLIT, normalizer={"type": "NFC"},
                          post_processor={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                          "use_regex": False}))
    _assert_as_the_tokenizer(other, _texts(tokenizer, lf_data_dir), least_taken=0.55)


def test_english_chat_texts_are_taken_chinese_ones_left(tokenizer):
    words = word_tokens.for_tokenizer(tokenizer)
    ids, _ = words.encode(["<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n", "naïve café 🚀", "你好，世界"])
    assert ids[0] is not None and ids[1] is not None
    assert ids[2] is None  # long runs of letters that seldom recur: the tokenizer's own call is faster there


def test_an_english_text_with_a_few_chinese_characters_is_taken(tokenizer):
    """A name or a stray symbol in a long English page keeps it here (their characters probed as the others);
    a text where they are more than UNSPACED_SHARE of the characters goes to the tokenizer."""
    english = "The shop on the corner sold tea and books for forty years. " * 4
    few, many = english + "Its sign read 小书店 and \ufffd.", "小书店卖茶和书。" * 3 + english[:60]
    words = word_tokens.for_tokenizer(tokenizer)
    ids, offsets = words.encode([few, many])
    assert ids[1] is None
    assert (ids[0], list(offsets[0])) == tuple(x[0] for x in _tokenizer_call(tokenizer, [few]))


def test_a_character_the_regex_engines_disagree_on_goes_to_the_tokenizer(tokenizer):
    """Here the split reads only ASCII letters as letters, so "é" splits where the tokenizer's does not."""
    backend = tokenizer.backend_tokenizer
    ascii_letters = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[a-zA-Z]+| ?\p{N}+| ?[^\sa-zA-Z\p{N}]+|\s+(?!\S)|\s+"""
    words = word_tokens.WordTokens(backend, ascii_letters, nfc=False,
                                   added=list(backend.get_added_tokens_decoder().values()))
    ids, offsets = words.encode(["the café opens", "the cafe opens"])
    assert ids[0] is None and offsets[0] is None
    assert ids[1] == backend.encode("the cafe opens", add_special_tokens=False).ids
    assert words._checked["é"] is False and words._checked["a"] is True


def test_characters_the_vocabulary_lacks_go_to_the_tokenizer(tokenizer):
    """The built-in vocabulary has no token for some control bytes: the tokenizer drops them and places the rest."""
    words = word_tokens.for_tokenizer(tokenizer)
    ids, _ = words.encode(["a\x04b", "ab"])
    assert ids[0] is None and ids[1] is not None
    assert _rendered(tokenizer, ["a\x04b"]) == _tokenizer_call(tokenizer, ["a\x04b"])


def test_pipelines_it_does_not_read_go_to_the_tokenizer(tokenizer):
    trimmed = _family(tokenizer, post_processor={"type": "ByteLevel", "add_prefix_space": False,
                                                 "trim_offsets": True, "use_regex": True})
    lowercase = _family(tokenizer, normalizer={"type": "Lowercase"})
    for other in (trimmed, lowercase):
        assert word_tokens.for_tokenizer(other) is None
        text = ["<|im_start|>user\n  Hello There<|im_end|>\n"]
        assert _rendered(other, text) == _tokenizer_call(other, text)


def test_tokens_added_later_are_cut_out(tokenizer):
    other = _family(tokenizer)
    before = word_tokens.for_tokenizer(other)
    other.add_tokens(["<tool_call>"])
    after = word_tokens.for_tokenizer(other)
    assert after is not before
    text = ["call<tool_call>{\"name\": \"f\"}<tool_call>"]
    assert _rendered(other, text) == _tokenizer_call(other, text)
    assert other.convert_tokens_to_ids("<tool_call>") in _rendered(other, text)[0][0]


def test_the_word_memory_is_bounded(tokenizer, monkeypatch, lf_data_dir):
    monkeypatch.setattr(word_tokens, "MAX_WORDS", 50)
    other = _family(tokenizer)  # its own WordTokens, built under the small bound
    texts = _texts(tokenizer, lf_data_dir)[:200]
    words = word_tokens.for_tokenizer(other)
    assert _rendered(other, texts) == _tokenizer_call(other, texts)
    per_text = max(len(set(words._words(text))) for text in texts)  # a text's words are all kept while it is read
    assert len(words._ids) <= 50 + len(words._added_ids) + per_text
    assert len({word for text in texts for word in words._words(text)}) > 4 * (50 + per_text)


def test_switched_off_by_the_environment(tokenizer, monkeypatch):
    monkeypatch.setenv("TUNEFORGE_WORD_TOKENS", "off")
    assert word_tokens.for_tokenizer(tokenizer) is None
    monkeypatch.setenv("TUNEFORGE_WORD_TOKENS", "sometimes")
    with pytest.raises(DataError, match="TUNEFORGE_WORD_TOKENS='sometimes' is not on or off"):
        word_tokens.for_tokenizer(tokenizer)


def test_tiled_offsets_find_the_same_token_spans():
    rng = random.Random(0)
    lengths = [rng.randint(1, 6) for _ in range(300)]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    tiled = word_tokens.Tiled(starts)
    pairs = list(zip(starts, starts[1:], strict=False))
    assert list(tiled) == pairs and tiled == pairs and len(tiled) == 300 and tiled[-1] == pairs[-1]
    spans = [(0, 0), (0, starts[-1]), (starts[-1], starts[-1]), (5, 5)]
    spans += [tuple(sorted(rng.sample(range(starts[-1] + 1), 2))) for _ in range(500)]
    assert tiled.token_spans(spans) == template.token_spans(pairs, spans)
    assert word_tokens.Tiled([0]).token_spans([(0, 0), (0, 3)]) == template.token_spans([], [(0, 0), (0, 3)])


@pytest.mark.parametrize("template_processing", [None, "<|im_start|> $A <|im_end|>"])
def test_pretraining_documents_with_the_tokenizers_special_tokens(tokenizer, lf_data_dir, template_processing):
    """The pt encoder's documents: as `tokenizer(texts, add_special_tokens=True)`, the template's tokens around each."""
    post = None
    if template_processing:
        first, body, last = template_processing.split()
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": first, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": last, "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {token: {"id": token, "ids": [tokenizer.convert_tokens_to_ids(token)],
                                           "tokens": [token]} for token in (first, last)}}
    other = _family(tokenizer, post_processor=post)
    documents = (lf_data_dir / "wiki_demo.txt").read_text(encoding="utf-8").splitlines()[:40]
    documents += [json.loads(line)["text"] for line in
                  (lf_data_dir / "c4_demo.jsonl").read_text(encoding="utf-8").splitlines()[:40]]
    documents += HARD
    got = word_tokens.encode_documents(other, documents)
    assert got == other(documents, add_special_tokens=True)["input_ids"]
    if template_processing:
        assert got[0][0] == 1 and got[0][-1] == 2
        assert got[documents.index("")] == [1, 2]  # an empty text: the template's two tokens alone
    assert sum(ids is not None for ids in word_tokens.for_tokenizer(other).encode(documents, with_offsets=False)[0]) > 60


def _leftmost_longest_split(tokens: list[str], text: str) -> list[str]:
    """The text cut at the tokens as the tokenizers library cuts it: at each place from the left, the longest token
    that starts there."""
    out, start, at = [], 0, 0
    while at < len(text):
        found = max((t for t in tokens if text.startswith(t, at)), key=len, default=None)
        if found is None:
            at += 1
            continue
        out += [text[start:at], found]
        start = at = at + len(found)
    return [*out, text[start:]]


def test_added_tokens_are_cut_at_the_leftmost_place_longest_first():
    rng = random.Random(0)
    tokens = ["<s>", "<s>x", "a", "ab", "abc", "abd", "[b]", "[b][c]", "b]", ".*", "(", "\\"]
    cut = word_tokens._alternation(tokens)
    texts = ["".join(rng.choice("ab<>s[]cxd.*(\\ ") for _ in range(rng.randint(0, 30))) for _ in range(3000)]
    texts += ["<s>x<s>abcab[b][c]", "abdabcx", ".*(\\"]
    for text in texts:
        assert cut.split(text) == _leftmost_longest_split(tokens, text), text
    long = word_tokens._alternation(["x" * 3000, "ab"])  # a token longer than Python's recursion limit
    assert long.split("z" + "x" * 3001 + "ab") == ["z", "x" * 3000, "x", "ab", ""]
