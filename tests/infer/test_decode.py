"""Incremental detokenization and stop handling (tuneforge/infer/decode.py) on the built-in tokenizer."""

from tuneforge.infer.decode import REPLACEMENT, Detokenizer, Output, held_back


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_streamed_pieces_are_whole_characters_and_join_to_the_decoded_text(tokenizer):
    text = "héllo 你好 🎉 world — ünïcödé"
    ids = ids_of(tokenizer, text)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)  # some tokens hold half a character
    detok = Detokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids("<|im_start|>"), *ids_of(tokenizer, "Hi")]
    assert "".join(Detokenizer(tokenizer).push(i) for i in ids) == "Hi"
    kept = Detokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(kept.push(i) for i in ids) == "<|im_start|>Hi"


def test_held_back_is_the_longest_suffix_that_may_start_a_stop():
    assert held_back("Hello wor", ["world"]) == 3
    assert held_back("Hello", ["xyz", "lo!", "llo?"]) == 3
    assert held_back("Hello", ["abc"]) == 0
    assert held_back("", ["abc"]) == 0


def stream(output, ids):
    return [output.push(i) for i in ids]


def test_a_stop_string_is_cut_and_never_half_shown(tokenizer):
    out = Output(tokenizer, stop_strings=["STOP"])
    pieces = stream(out, ids_of(tokenizer, "Hello world, then STOP and more"))
    assert "".join(pieces) == "Hello world, then "
    assert out.finish_reason == "stop" and out.text == "Hello world, then "
    assert out.finish("length") == "" and out.finish_reason == "stop"


def test_a_stop_string_inside_one_token_and_the_earliest_of_several(tokenizer):
    out = Output(tokenizer, stop_strings=["and", "the"])
    assert "".join(stream(out, ids_of(tokenizer, "Hello world, then STOP and more"))) == "Hello world, "
    assert out.finish_reason == "stop"


def test_a_partial_stop_string_is_released_when_the_answer_ends(tokenizer):
    out = Output(tokenizer, stop_strings=["STOP!"])
    shown = "".join(stream(out, ids_of(tokenizer, "Hello ST")))
    assert shown == "Hello " or shown == "Hello"  # the possible start of the stop string waits
    assert shown + out.finish("length") == "Hello ST"
    assert out.finish_reason == "length" and out.text == "Hello ST"


def test_a_stop_token_ends_the_answer_and_is_counted(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = Output(tokenizer, stop_token_ids=[eos])
    ids = ids_of(tokenizer, "Fine, thanks.")
    shown = "".join(stream(out, [*ids, eos, *ids]))
    assert shown == "Fine, thanks." and out.finish_reason == "stop"
    assert out.tokens == len(ids) + 1  # the answer's tokens and the stop token; nothing after it
