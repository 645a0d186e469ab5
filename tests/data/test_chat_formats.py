"""Every LlamaFactory template name resolves; our templates render the families' official chat formats token for
token (tests/fixtures/chat_templates/README.md says where each official template comes from)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tuneforge.data import chat_formats, template
from tuneforge.data.formats import BadRow, Conversation
from tuneforge.errors import DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LF_NAMES = json.loads((FIXTURES / "llamafactory_templates.json").read_text())["templates"]
OFFICIAL = FIXTURES / "chat_templates"

SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]


def family_tokenizer(bare, bos: str, eos: str, markers: list[str]):
    """A base-model tokenizer of a family: its bos / eos and its chat markers as special tokens."""
    out = copy.deepcopy(bare)
    out.add_special_tokens({"bos_token": bos, "eos_token": eos})
    out.add_tokens(markers, special_tokens=True)
    return out


def render_text(tok, source, messages, gen, **kw):
    return tok.apply_chat_template(messages, chat_template=source, tokenize=False, add_generation_prompt=gen, **kw)


def test_the_fixture_lists_llamafactorys_names():
    assert len(LF_NAMES) == 124 and {"qwen3_5", "qwen3_vl_nothink", "llama3", "gpt_oss"} <= set(LF_NAMES)


@pytest.mark.parametrize("name", sorted(LF_NAMES))
def test_every_llamafactory_name_resolves(tokenizer, bare, name):
    own = template.resolve_template(name, tokenizer)
    if name in template.GENERIC_TEMPLATES:
        assert own.source == template.TEMPLATES[name]  # a format, not a family: always ours
    else:
        assert (own.name, own.source) == ("tokenizer", None)  # the model's own template, token-exact
        assert own.thinking is (False if name.endswith("_nothink") else None)  # *_nothink: its non-thinking mode
    if name in chat_formats.MODEL_ONLY:
        with pytest.raises(DataError, match=f"template '{name}' needs the model's own chat template"):
            template.resolve_template(name, bare)
        return
    chat = template.resolve_template(name, bare)
    assert chat.name == name and chat.source == template.TEMPLATES[name]
    if name in ("default", "empty"):  # written in template.py, tested in test_template.py
        return
    # the span search finds each answer followed by the family's end-of-turn marker
    conv = Conversation(messages=TURNS, system="Be brief.", tools=json.dumps([t["function"] for t in TOOLS]))
    full, spans = template.render(bare, chat, conv)
    fmt = chat_formats.FORMATS[chat_formats.ALIASES.get(name, name)]
    marker = fmt.assistant[1].replace(chat_formats.EOS, bare.eos_token).rstrip()
    assert [full[a:b] for a, b in spans] == [
        fmt.lead + m["content"] + marker for m in TURNS if m["role"] == "assistant"
    ] or fmt.think  # reasoning families write an empty think block first
    assert all(full[a:b].endswith(m["content"] + marker) for (a, b), m in zip(spans, TURNS[1::2], strict=True))
    assert '"name": "f"' in full  # the tools are shown to the model
    if fmt.default_system:
        assert fmt.default_system in render_text(bare, chat.source, TURNS, False)
    if LF_NAMES[name].get("multimodal"):  # images need the processor's own template
        image = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
        with pytest.raises(BadRow, match="renders text only; a message with images"):
            template.render(bare, chat, conv, [{"role": "user", "content": image}, TURNS[1]])


def test_aliases_share_one_template():
    assert template.TEMPLATES["qwen3_vl"] is template.TEMPLATES["qwen3"]
    assert template.TEMPLATES["llava"] is template.TEMPLATES["vicuna"]
    assert template.TEMPLATES["gemma3"] is template.TEMPLATES["gemma"]
    assert set(chat_formats.ALIASES.values()) <= set(chat_formats.FORMATS)


# (our name, official template, bos, eos, markers, limits). Limits: "no system": the official template refuses a
# system message; "adds eos": ours writes EOS after an answer where the family's format has no end-of-turn marker
# (the next role token ends the turn), so the model learns to stop; "tools": also compared with tools and a tool
# result; "thinking": also with enable_thinking false, where the official template writes earlier answers without
# the empty think block that ours (keeping the prefix property) writes, so on conversations with one answer
# ("thinking always": on all); "system prompt": Mistral's official template writes the system prompt into the
# last message when that is a user message (so not at all in a whole conversation), ours into the first user
# message (the prefix property): with a system prompt only the prompts of one-turn conversations compare;
# "own default system": LlamaFactory's default system prompt for the name is not the official template's (none),
# so only conversations with a system prompt compare; "thinking opt-in" (Gemma 4): also with enable_thinking
# true; off (its default), the official template writes the empty thought channel in the generation prompt but
# not before earlier answers, where ours keeps it (the prefix property), so only first prompts compare.
OFFICIAL_CASES = [
    ("chatml", "chatml.jinja", "<s>", "</s>", ["<|im_start|>", "<|im_end|>"], set()),
    ("qwen", "qwen2_5.jinja", "<|endoftext|>", "<|im_end|>", ["<|im_start|>"], {"tools"}),
    ("qwen2_vl", "qwen2_vl.jinja", "<|endoftext|>", "<|im_end|>", ["<|im_start|>"], set()),
    ("qwen3", "qwen3.jinja", "<|endoftext|>", "<|im_end|>", ["<|im_start|>"], {"tools", "thinking"}),
    ("qwen3_vl_nothink", "qwen3_vl.jinja", "<|endoftext|>", "<|im_end|>", ["<|im_start|>"], {"tools"}),
    ("llama2", "llama2.jinja", "<s>", "</s>", [], set()),
    ("llama3", "llama3.jinja", "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"], set()),
    ("gemma", "gemma.jinja", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], {"no system"}),
    ("gemma3", "gemma3.jinja", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], set()),
    ("phi", "phi3.jinja", "<s>", "<|endoftext|>", ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], set()),
    ("phi4", "phi4.jinja", "<|endoftext|>", "<|im_end|>", ["<|im_start|>", "<|im_sep|>"], set()),
    ("deepseek", "deepseek.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", [], set()),
    ("deepseekcoder", "deepseekcoder.jinja", "<｜begin▁of▁sentence｜>", "<|EOT|>", [], set()),
    ("cohere", "cohere.jinja", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", ["<|START_OF_TURN_TOKEN|>"], set()),
    ("openchat", "openchat.jinja", "<s>", "</s>", ["<|end_of_turn|>"], set()),
    ("granite3", "granite3.jinja", "<|end_of_text|>", "<|end_of_text|>", ["<|start_of_role|>", "<|end_of_role|>"],
     set()),
    ("mistral", "mistral_v3.jinja", "<s>", "</s>", ["[INST]", "[/INST]"], {"system prompt"}),
    ("ministral", "mistral_v3_tekken.jinja", "<s>", "</s>", ["[INST]", "[/INST]"], {"system prompt"}),
    ("kimi_vl", "kimi_k2.jinja", "[BOS]", "[EOS]",
     ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"], set()),
    ("lfm2", "lfm2_5.jinja", "<|startoftext|>", "<|im_end|>", ["<|im_start|>"], {"own default system"}),
    ("gemma4", "gemma4.jinja", "<bos>", "<eos>", ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"],
     {"own default system", "thinking opt-in"}),
    ("chatglm3", "chatglm3.jinja", "<s>", "</s>", ["[gMASK]", "sop", "<|user|>", "<|assistant|>", "<|system|>"],
     {"adds eos"}),
    ("bailing", "bailing.jinja", "<|startoftext|>", "<|endoftext|>", ["<role>", "</role>"], {"adds eos"}),
]


@pytest.mark.parametrize("case", OFFICIAL_CASES, ids=[c[0] for c in OFFICIAL_CASES])
def test_ours_is_token_exact_with_the_official_template(bare, case):
    name, fixture, bos, eos, markers, limits = case
    tok = family_tokenizer(bare, bos, eos, markers)
    ours, official = template.TEMPLATES[name], (OFFICIAL / fixture).read_text()
    conversations = [] if "own default system" in limits else [TURNS, TURNS[:2]]
    if "no system" not in limits:
        conversations += [[SYSTEM, *TURNS[:2]]] + ([] if "system prompt" in limits else [[SYSTEM, *TURNS]])
    if "tools" in limits:
        tool_turns = [*TURNS[:2], {"role": "tool", "content": '{"t": 1}'}, {"role": "assistant", "content": "ok"}]
        conversations.append(tool_turns)
    runs = [(messages, {"tools": TOOLS} if messages[-2]["role"] == "tool" else {}) for messages in conversations]
    if "thinking" in limits or "thinking always" in limits:
        runs += [
            (m, {"enable_thinking": False})
            for m in conversations
            if "thinking always" in limits or sum(x["role"] == "assistant" for x in m) == 1
        ]
    if "thinking opt-in" in limits:
        runs += [(m, {"enable_thinking": True}) for m in conversations]
    checked = 0
    for messages, kw in runs:
        for end in range(1, len(messages) + 1):
            part, gen = messages[:end], messages[end - 1]["role"] != "assistant"
            if not any(m["role"] == "user" for m in part):
                continue
            if "system prompt" in limits and part[0] == SYSTEM and not gen:
                continue
            if "thinking opt-in" in limits and not kw and any(m["role"] == "assistant" for m in part):
                continue
            a, b = render_text(tok, ours, part, gen, **kw), render_text(tok, official, part, gen, **kw)
            if "adds eos" in limits:
                a = a.replace(eos, "")
            assert tok(a, add_special_tokens=False)["input_ids"] == tok(b, add_special_tokens=False)["input_ids"], (
                part
            )
            checked += 1
    assert checked >= 6


def test_smollm2_is_the_built_in_models_own_template(tokenizer, bare):
    for messages in ([*TURNS], [SYSTEM, *TURNS]):
        for gen in (False, True):
            own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert render_text(bare, template.TEMPLATES["smollm2"], messages, gen) == own


def test_enable_thinking_false_writes_an_empty_think_block(bare):
    qwen3 = template.TEMPLATES["qwen3"]
    prompt = render_text(bare, qwen3, TURNS[:1], True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_text(bare, qwen3, TURNS[:1], True).endswith("<|im_start|>assistant\n")  # default: thinking
    # the last answer is the same either way; only where the prompt ends differs (what the model learns)
    for thinking in (True, False):
        full = render_text(bare, qwen3, TURNS[:2], False, enable_thinking=thinking)
        assert full.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello there.<|im_end|>\n")
    # thinking (Qwen3's rule): only the last answer gets the block
    assert render_text(bare, qwen3, TURNS, False).count("<think>") == 1
    assert render_text(bare, qwen3, TURNS, False, enable_thinking=False).count("<think>") == 2
    # an answer that carries its own reasoning is written as it is
    reasoned = [TURNS[0], {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"}]
    assert render_text(bare, qwen3, reasoned, False).count("<think>") == 1
    assert "<think>" not in render_text(bare, template.TEMPLATES["qwen3_nothink"], TURNS[:2], False)


def test_model_only_and_unknown_names(bare):
    with pytest.raises(DataError, match="'gpt_oss' needs the model's own chat template.*harmony"):
        template.resolve_template("gpt_oss", bare)
    with pytest.raises(DataError, match="unknown template 'qwen9'; choose one of default, empty, alpaca, fewshot"):
        template.resolve_template("qwen9", bare)
