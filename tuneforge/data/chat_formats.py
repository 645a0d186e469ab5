"""Our own chat templates for base models whose tokenizer has none: one Jinja template per chat format.

LlamaFactory names ~125 templates; most of them are one of a few dozen formats (ChatML with or without a
default system prompt, Llama 3's headers, Gemma's turns, ...). A `Format` says where each role's text goes and
`Format.jinja()` writes the Jinja template that `tokenizer.apply_chat_template(chat_template=...)` renders; names
that write the same text share one Format (and so one template).

Every template here keeps the property the span search in template.render relies on: the text of `messages[:i]`
with the generation prompt is a prefix of the text of the whole conversation. So a system prompt is written once,
before the first turn (or into the first user message), tools are shown there too, and an assistant turn is the
generation prompt + content + the family's end-of-turn marker. Where a family's official template moves text
(Mistral's v3 puts the system prompt into the *last* user message) ours keeps it in the first one, as
LlamaFactory does. Reasoning families read `enable_thinking` as their official templates do (`Format.think`):
Qwen3's rule, thinking on (the default), writes an empty think block (`<think>\n\n</think>\n\n`) before the last
answer when it has none; off writes it at the end of the generation prompt, and so before every answer (the
official template writes earlier answers without it, which would break the prefix property). GLM-4.5 writes one
before every answer; Gemma 4 thinks only when asked and writes its empty thought channel in the non-thinking
generation prompt.

Messages with non-text content (images, audio) need the model's own (processor's) template: ours raise a clear
error for them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

# Placeholders in a Format's text: the tokenizer's bos / eos token as apply_chat_template passes them.
BOS, EOS = "{bos}", "{eos}"


@dataclass(frozen=True)
class Format:
    """Where each role's text goes; the pairs are (text before the content, text after it)."""

    user: tuple[str, str]
    assistant: tuple[str, str]  # [0] is the generation prompt, [1] the end-of-turn marker
    lead: str = ""  # written between the generation prompt and an answer (Vicuna's "ASSISTANT:" + " " + answer)
    system: tuple[str, str] | None = None  # None: the system text goes into the first user message
    system_in_user: tuple[str, str] = ("", "\n\n")  # how it is written there
    tool: tuple[str, str] | None = None  # an observation (tool result) turn; None: as a user turn
    prefix: str = ""  # written once, first (BOS, [gMASK]<sop>, ...)
    default_system: str = ""
    tools: str = "json"  # how the tools JSON is shown: "json" (in the system text) or "hermes" (Qwen's block)
    tools_intro: str = "You can call these tools:\n"  # "json": the line before the JSON
    strip: bool = False  # the family's template strips each message's content
    think: tuple[str, str] | None = None  # (the empty reasoning block, its opening tag): see _compile
    think_answer: str = "last"  # which answers (without reasoning) get the block: "last" (Qwen3), "every"
    # (GLM-4.5) or "none" (Gemma 4: only the non-thinking generation prompt has it)
    thinking_default: bool = True  # enable_thinking when the caller leaves it undefined (Gemma 4: false)
    system_think: str = ""  # written first in the system turn when thinking, which then always has one (Gemma 4)
    nothink_suffix: str = ""  # appended to user messages when enable_thinking is false (GLM-4.5's /nothink)
    hermes_tool_turn: bool = False  # tool results grouped into one user turn of <tool_response> blocks

    def jinja(self, name: str) -> str:
        return _compile(self, name)


def _expr(text: str) -> str:
    """A Jinja expression for text with {bos} / {eos} placeholders."""
    tokens = {BOS: "(bos_token or '')", EOS: "(eos_token or '')"}
    parts = [
        tokens.get(p) or json.dumps(p, ensure_ascii=False) for p in re.split(r"(\{bos\}|\{eos\})", text) if p
    ]
    return " + ".join(parts) or "''"


_HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_HERMES_CALL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def _compile(f: Format, name: str) -> str:
    content = "m['content'] | trim" if f.strip else "m['content']"
    lines = [
        f"{{#- tuneforge's chat template '{name}' (tuneforge/data/chat_formats.py) -#}}",
        "{%- set has_system = messages and messages[0]['role'] == 'system' -%}",
        f"{{%- set system = messages[0]['content'] if has_system else {_expr(f.default_system)} -%}}",
        "{%- set rest = messages[1:] if has_system else messages -%}",
        "{%- set thinking = enable_thinking if enable_thinking is defined else "
        + ("true" if f.thinking_default else "false")
        + " -%}",
    ]
    if f.tools == "hermes":
        lines.append(
            "{%- if tools -%}{%- set ns = namespace(text=(system + '\\n\\n' if system else '') + "
            + _expr(_HERMES_TOOLS)
            + ") -%}{%- for t in tools -%}{%- set ns.text = ns.text + '\\n' + (t | tojson) -%}{%- endfor -%}"
            + "{%- set system = ns.text + "
            + _expr(_HERMES_CALL)
            + " -%}{%- endif -%}"
        )
    else:
        lines.append(
            "{%- if tools -%}{%- set system = (system + '\\n\\n' if system else '') + "
            + _expr(f.tools_intro)
            + " + (tools | tojson) -%}{%- endif -%}"
        )
    lines.append("{{- " + _expr(f.prefix) + " -}}")
    if f.system_think:
        lines.append(f"{{%- set system = ({_expr(f.system_think)} if thinking else '') + system -%}}")
    if f.system is not None:
        lines.append(
            "{%- if system -%}{{- "
            + _expr(f.system[0])
            + " + system + "
            + _expr(f.system[1])
            + " -}}{%- endif -%}"
        )
    # Reasoning families: see the module docstring. With enable_thinking false the empty block is part of the
    # generation prompt (the model is told not to think); otherwise it belongs to the answer (the model learns
    # to write it) in the last answer.
    gen, answer = _expr(f.assistant[0]), _expr(f.lead) + " + c"
    if f.think:
        block, tag = _expr(f.think[0]), json.dumps(f.think[1])
        gen = f"{gen} + ('' if thinking else {block})"
        where = {"every": "thinking", "last": "thinking and loop.last", "none": "false"}[f.think_answer]
        answer = f"({block} if {where} and {tag} not in c else '') + {answer}"
    tool = f.tool or f.user
    lines += [
        "{%- for m in rest -%}",
        "{%- if m['content'] is not string or system is not string -%}{{ raise_exception(\"tuneforge's chat format '"
        + name
        + "' renders text only; a message with images, videos or audio needs the model's own chat template "
        '(leave template unset)") }}{%- endif -%}',
        f"{{%- set c = {content} -%}}",
    ]
    if f.system is None:
        lines.append(
            "{%- if loop.first and system -%}{%- set c = "
            + _expr(f.system_in_user[0])
            + " + system + "
            + _expr(f.system_in_user[1])
            + " + c -%}{%- endif -%}"
        )
    lines += [
        "{%- if m['role'] == 'user' -%}{{- "
        + _expr(f.user[0])
        + " + c + "
        + (f"('' if thinking else {_expr(f.nothink_suffix)}) + " if f.nothink_suffix else "")
        + _expr(f.user[1])
        + " -}}",
        "{%- elif m['role'] == 'assistant' -%}{{- " + gen + " + " + answer + " + " + _expr(f.assistant[1]) + " -}}",
    ]
    if f.hermes_tool_turn:
        lines.append(
            "{%- elif m['role'] == 'tool' -%}"
            "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
            "{{- '\\n<tool_response>\\n' + c + '\\n</tool_response>' -}}"
            "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        )
    else:
        lines.append(
            "{%- elif m['role'] == 'tool' -%}{{- " + _expr(tool[0]) + " + c + " + _expr(tool[1]) + " -}}"
        )
    lines += [
        "{%- else -%}{{ raise_exception(\"template '" + name + "' has no role '\" + m['role'] + \"'\") }}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{- " + gen + " -}}{%- endif -%}",
    ]
    return "\n".join(lines)


# ---- the formats --------------------------------------------------------------------------------------------

CHATML = Format(
    user=("<|im_start|>user\n", "<|im_end|>\n"),
    assistant=("<|im_start|>assistant\n", "<|im_end|>\n"),
    system=("<|im_start|>system\n", "<|im_end|>\n"),
    tool=("<|im_start|>tool\n", "<|im_end|>\n"),
    tools_intro="# Tools\n",
)
# Qwen (1.5 - 3), MiMo, Keye, ...: ChatML + the Hermes tool block + tool results as <tool_response> user turns.
QWEN = replace(CHATML, tool=None, tools="hermes", hermes_tool_turn=True)
QWEN3 = replace(QWEN, think=("<think>\n\n</think>\n\n", "<think>"))
LLAMA3 = Format(
    user=("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
    assistant=("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    system=("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
    tool=("<|start_header_id|>ipython<|end_header_id|>\n\n", "<|eot_id|>"),
    prefix=BOS,
    strip=True,
)
LLAMA4 = Format(
    user=("<|header_start|>user<|header_end|>\n\n", "<|eot|>"),
    assistant=("<|header_start|>assistant<|header_end|>\n\n", "<|eot|>"),
    system=("<|header_start|>system<|header_end|>\n\n", "<|eot|>"),
    tool=("<|header_start|>ipython<|header_end|>\n\n", "<|eot|>"),
    prefix=BOS,
    strip=True,
)
# Llama 2 chat: every exchange opens with BOS; the system prompt in <<SYS>> inside the first [INST].
LLAMA2 = Format(
    user=(BOS + "[INST] ", " [/INST]"),
    assistant=("", " " + EOS),
    lead=" ",
    system_in_user=("<<SYS>>\n", "\n<</SYS>>\n\n"),
    strip=True,
)
_TOOL_RESULTS = ('[TOOL_RESULTS] {"content": ', "}[/TOOL_RESULTS]")
MISTRAL = Format(  # Mistral's v3 tokenizer (7B v0.3, Mixtral 8x22B, Large 2407)
    user=("[INST] ", "[/INST]"),
    assistant=("", EOS),
    lead=" ",
    tool=_TOOL_RESULTS,
    prefix=BOS,
    tools_intro="[AVAILABLE_TOOLS] ",
)
MINISTRAL = Format(  # v3 tekken (Nemo, Ministral, Pixtral): no spaces
    user=("[INST]", "[/INST]"),
    assistant=("", EOS),
    tool=('[TOOL_RESULTS]{"content": ', "}[/TOOL_RESULTS]"),
    prefix=BOS,
    tools_intro="[AVAILABLE_TOOLS]",
)
MISTRAL_SMALL = replace(MINISTRAL, system=("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"))
GEMMA = Format(
    user=("<start_of_turn>user\n", "<end_of_turn>\n"),
    assistant=("<start_of_turn>model\n", "<end_of_turn>\n"),
    tool=("<start_of_turn>tool\n", "<end_of_turn>\n"),
    prefix=BOS,
    strip=True,
)
GEMMA4 = Format(  # thinking is off unless asked for; on, <|think|> opens the system turn
    user=("<|turn>user\n", "<turn|>\n"),
    assistant=("<|turn>model\n", "<turn|>\n"),
    system=("<|turn>system\n", "<turn|>\n"),
    tool=("<|turn>tool\n", "<turn|>\n"),
    prefix=BOS,
    strip=True,
    think=("<|channel>thought\n<channel|>", "<|channel>"),
    think_answer="none",
    thinking_default=False,
    system_think="<|think|>",
)
PHI3 = Format(
    user=("<|user|>\n", "<|end|>\n"),
    assistant=("<|assistant|>\n", "<|end|>\n"),
    system=("<|system|>\n", "<|end|>\n"),
)
PHI4 = Format(
    user=("<|im_start|>user<|im_sep|>", "<|im_end|>"),
    assistant=("<|im_start|>assistant<|im_sep|>", "<|im_end|>"),
    system=("<|im_start|>system<|im_sep|>", "<|im_end|>"),
    tool=("<|im_start|>tool<|im_sep|>", "<|im_end|>"),
)
PHI4_MINI = Format(
    user=("<|user|>", "<|end|>"),
    assistant=("<|assistant|>", "<|end|>"),
    system=("<|system|>", "<|end|>"),
    tool=("<|tool_response|>", "<|end|>"),
    tools_intro="<|tool|>",
)
GLM4 = Format(  # GLM-4 / GLM-4.5 / GLM-Z1: the next role token ends a turn; we add EOS so the model learns to stop
    user=("<|user|>\n", ""),
    assistant=("<|assistant|>\n", EOS),
    system=("<|system|>\n", ""),
    tool=("<|observation|>\n", ""),
    prefix="[gMASK]<sop>",
)
# GLM-4.5 / 4.6 / 4.7: every answer opens with a think block (empty when it has none); thinking off
# appends /nothink to user messages and closes the block in the generation prompt.
GLM4_THINK = replace(
    GLM4,
    assistant=("<|assistant|>", EOS),
    lead="\n",
    think=("\n<think></think>", "<think>"),
    think_answer="every",
    nothink_suffix="/nothink",
    strip=True,
)
CHATGLM3 = replace(
    GLM4,
    user=("<|user|>\n ", ""),
    assistant=("<|assistant|>", EOS),
    lead="\n ",
    system=("<|system|>\n ", ""),
    tool=("<|observation|>\n ", ""),
    prefix="[gMASK]sop",
)
VICUNA = Format(  # Vicuna v1.1, LLaVA 1.5 / NeXT (Vicuna), Video-LLaVA
    user=("USER: ", " "),
    assistant=("ASSISTANT:", EOS),
    lead=" ",
    system=("", " "),
    default_system=(
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions."
    ),
)
DEEPSEEK3 = Format(  # DeepSeek V3 / R1 (and the R1 distills)
    user=("<｜User｜>", ""),
    assistant=("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    system=("", ""),
    tool=("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>", "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"),
    prefix=BOS,
)
DEEPSEEK_R1 = replace(DEEPSEEK3, think=("<think>\n\n</think>\n\n", "<think>"))
GRANITE3 = Format(
    user=("<|start_of_role|>user<|end_of_role|>", "<|end_of_text|>\n"),
    assistant=("<|start_of_role|>assistant<|end_of_role|>", "<|end_of_text|>\n"),
    system=("<|start_of_role|>system<|end_of_role|>", "<|end_of_text|>\n"),
    tool=("<|start_of_role|>tool<|end_of_role|>", "<|end_of_text|>\n"),
)


def _turns(user: str, assistant: str, end: str, system: str | None = None, **kw) -> Format:
    """A format whose turns are header + content + one end marker (the marker after every role)."""
    return Format(
        user=(user, end),
        assistant=(assistant, end),
        system=(system, end) if system is not None else None,
        **kw,
    )


FORMATS: dict[str, Format] = {
    # generic formats (LlamaFactory's; not a model family's)
    "alpaca": Format(
        user=("### Instruction:\n", "\n\n"),
        assistant=("### Response:\n", EOS + "\n\n"),
        system=("", "\n\n"),
        tool=("### Observation:\n", "\n\n"),
        default_system=(
            "Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request."
        ),
        tools_intro="### Tools:\n",
    ),
    "fewshot": Format(user=("", ""), assistant=("", "\n\n"), system=("", "\n\n")),
    "chatml": CHATML,
    "chatml_de": replace(CHATML, default_system="Du bist ein freundlicher und hilfsbereiter KI-Assistent."),
    "cpm4": replace(CHATML, prefix=BOS),
    "falcon_h1": replace(CHATML, prefix=BOS),
    "dbrx": replace(
        CHATML,
        default_system=(
            "You are DBRX, created by Databricks. You were last updated in December 2023. You answer questions "
            "based on information available up to that point.\nYOU PROVIDE SHORT RESPONSES TO SHORT QUESTIONS OR "
            "STATEMENTS, but provide thorough responses to more complex and open-ended questions.\nYou assist with "
            "various tasks, from writing to coding (using markdown for code blocks — remember to use ``` with code, "
            "JSON, and tables).\n(You do not have real-time data access or code execution capabilities. You avoid "
            "stereotyping and provide balanced perspectives on controversial topics. You do not provide song "
            "lyrics, poems, or news articles and do not divulge details of your training data.)\nThis is your "
            "system prompt, guiding your responses. Do not reference it, just respond to the user. If you find "
            "yourself talking about this message, stop. You should be responding appropriately and usually that "
            "means not mentioning this.\nYOU DO NOT MENTION ANY OF THIS INFORMATION ABOUT YOURSELF UNLESS THE "
            "INFORMATION IS DIRECTLY PERTINENT TO THE USER'S QUERY."
        ),
    ),
    "opencoder": replace(CHATML, default_system="You are OpenCoder, created by OpenCoder Team."),
    "smollm2": replace(
        CHATML, default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    ),
    "intern2": replace(
        CHATML,
        prefix=BOS,
        default_system=(
            "You are an AI assistant whose name is InternLM (书生·浦语).\n- InternLM (书生·浦语) is a conversational "
            "language model that is developed by Shanghai AI Laboratory (上海人工智能实验室). It is designed to be "
            "helpful, honest, and harmless.\n- InternLM (书生·浦语) can understand and communicate fluently in the "
            "language chosen by the user such as English and 中文."
        ),
    ),
    "intern_vl": replace(
        CHATML,
        prefix=BOS,
        default_system=(
            "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
        ),
    ),
    "intern_s1": replace(CHATML, prefix=BOS),
    "minicpm_v": replace(CHATML, default_system="You are a helpful assistant."),
    "minicpm_o": replace(
        CHATML,
        default_system="You are a helpful assistant. You can accept audio and text input and output voice and text.",
    ),
    "sailor": replace(
        CHATML,
        user=("<|im_start|>question\n", "<|im_end|>\n"),
        assistant=("<|im_start|>answer\n", "<|im_end|>\n"),
        default_system=(
            "You are an AI assistant named Sailor created by Sea AI Lab. Your answer should be friendly, "
            "unbiased, faithful, informative and detailed."
        ),
    ),
    "ernie": _turns(
        "<|im_start|>user\n",
        "<|im_start|>assistant\n",
        "<|im_end|>\n\n",
        "<|im_start|>system\n",
        tool=("<|im_start|>tool\n", "<|im_end|>\n\n"),
        default_system="<global_setting>\nthink_mode=True\n</global_setting>",
        tools_intro="# Tools\n",
    ),
    "lfm2": replace(
        CHATML,
        prefix=BOS,
        tool=("<|im_start|>tool\n<|tool_response_start|>", "<|tool_response_end|><|im_end|>\n"),
        default_system="You are a helpful AI assistant.",
        tools_intro="List of tools: ",
    ),
    "qwen": replace(
        QWEN, default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    ),
    "qwen2_vl": replace(QWEN, default_system="You are a helpful assistant."),
    "qwen3": QWEN3,
    "qwen3_nothink": QWEN,
    "mimo": replace(QWEN3, default_system="You are a helpful assistant."),
    "mimo_v2": replace(QWEN3, default_system="You are MiMo, a helpful AI assistant engineered by Xiaomi."),
    "mimo_vl": replace(QWEN3, default_system="You are MiMo, an AI assistant developed by Xiaomi."),
    "llama3": LLAMA3,
    "openchat-3.6": replace(
        LLAMA3,
        user=("<|start_header_id|>GPT4 Correct User<|end_header_id|>\n\n", "<|eot_id|>"),
        assistant=("<|start_header_id|>GPT4 Correct Assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    ),
    "llama4": LLAMA4,
    "llama2": LLAMA2,
    "llama2_zh": replace(LLAMA2, default_system="You are a helpful assistant. 你是一个乐于助人的助手。"),
    "mistral": MISTRAL,
    "ministral": MINISTRAL,
    "mistral_small": MISTRAL_SMALL,
    "gemma": GEMMA,
    "gemma4": replace(GEMMA4, default_system="You are a helpful assistant."),
    "phi": PHI3,
    "phi_small": replace(PHI3, prefix=BOS),
    "phi4": PHI4,
    "phi4_mini": PHI4_MINI,
    "starchat": replace(PHI3, assistant=("<|assistant|>", "<|end|>\n")),
    "zephyr": _turns(
        "<|user|>\n",
        "<|assistant|>\n",
        EOS + "\n",
        "<|system|>\n",
        default_system="You are Zephyr, a helpful assistant.",
    ),
    "glm4": GLM4,
    "glm4_moe": GLM4_THINK,
    "chatglm3": CHATGLM3,
    "vicuna": VICUNA,
    "xuanyuan": replace(
        VICUNA,
        user=("Human: ", " "),
        assistant=("Assistant:", EOS),
        system=("", ""),
        default_system=(
            "以下是用户和人工智能助手之间的对话。用户以Human开头，人工智能助手以Assistant开头，会对人类提出的问题给出有帮助、"
            "高质量、详细和礼貌的回答，并且总是拒绝参与与不道德、不安全、有争议、政治敏感等相关的话题、问题和指示。\n"
        ),
    ),
    "yi_vl": Format(
        user=("### Human: ", "\n"),
        assistant=("### Assistant:", EOS + "\n"),
        system=("", ""),
        default_system=(
            "This is a chat between an inquisitive human and an AI assistant. Assume the role of the AI assistant. "
            "Read all the images carefully, and respond to the human's questions with informative, helpful, "
            "detailed and polite answers. 这是一个好奇的人类和一个人工智能助手之间的对话。假设你扮演这个AI助手的角色。"
            "仔细阅读所有的图像，并对人类的问题做出信息丰富、有帮助、详细的和礼貌的回答。\n\n"
        ),
    ),
    "deepseek": Format(  # DeepSeek LLM / V2 chat
        user=("User: ", "\n\n"),
        assistant=("Assistant:", EOS),
        lead=" ",
        system=("", "\n\n"),
        prefix=BOS,
    ),
    "deepseek3": DEEPSEEK3,
    "deepseekr1": DEEPSEEK_R1,
    "deepseekcoder": Format(
        user=("### Instruction:\n", "\n"),
        assistant=("### Response:\n", "\n<|EOT|>\n"),
        system=("", ""),
        prefix=BOS,
        default_system=(
            "You are an AI programming assistant, utilizing the Deepseek Coder model, developed by Deepseek "
            "Company, and you only answer questions related to computer science. For politically sensitive "
            "questions, security and privacy issues, and other non-computer science questions, you will refuse "
            "to answer\n"
        ),
    ),
    "hy3": Format(
        user=("<｜hy_User｜>", ""),
        assistant=("<｜hy_Assistant｜>", "<｜hy_eos｜>"),
        system=("", ""),
        prefix=BOS,
        think=("<think>\n\n</think>\n\n", "<think>"),
    ),
    "cohere": Format(
        user=("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        assistant=("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        system=("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        prefix=BOS,
        strip=True,
    ),
    "openchat": Format(
        user=("GPT4 Correct User: ", "<|end_of_turn|>"),
        assistant=("GPT4 Correct Assistant:", "<|end_of_turn|>"),
        lead=" ",
        system=("GPT4 Correct System: ", "<|end_of_turn|>"),
        prefix=BOS,
    ),
    "granite3": GRANITE3,
    "granite4": replace(
        GRANITE3, default_system="You are Granite, developed by IBM. You are a helpful AI assistant."
    ),
    "granite3_vision": Format(
        user=("<|user|>\n", "\n"),
        assistant=("<|assistant|>\n", EOS + "\n"),
        system=("<|system|>\n", "\n"),
        default_system=(
            "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
            "detailed, and polite answers to the user's questions."
        ),
    ),
    "bailing": Format(
        user=("<role>HUMAN</role>", ""),
        assistant=("<role>ASSISTANT</role>", EOS),
        system=("<role>SYSTEM</role>", ""),
        tool=("<role>OBSERVATION</role>", ""),
    ),
    "bailing_v2": Format(
        user=("<role>HUMAN</role>", "<|role_end|>"),
        assistant=("<role>ASSISTANT</role>", "<|role_end|>"),
        system=("<role>SYSTEM</role>", "<|role_end|>"),
        tool=("<role>OBSERVATION</role>\n<tool_response>\n", "\n</tool_response><|role_end|>"),
    ),
    "breeze": Format(user=("[INST] ", " [/INST] "), assistant=("", EOS), system=("", " "), prefix=BOS),
    "dots_ocr": Format(
        user=("<|user|>", "<|endofuser|>"),
        assistant=("<|assistant|>", "<|endofassistant|>"),
        system=("<|system|>", "<|endofsystem|>\n"),
    ),
    "ernie_nothink": Format(
        user=("User: ", "\n"),
        assistant=("Assistant: ", "<|end_of_sentence|>"),
        system=("", "\n"),
        prefix="<|begin_of_sentence|>",
    ),
    "ernie_vl": Format(
        user=("User: ", ""),
        assistant=("\nAssistant: ", "<|end_of_sentence|>"),
        system=("", "\n"),
    ),
    "exaone": Format(
        user=("[|user|]", "\n"),
        assistant=("[|assistant|]", "[|endofturn|]\n"),
        system=("[|system|]", "[|endofturn|]\n"),
    ),
    "falcon": Format(user=("User: ", "\n"), assistant=("Falcon:", EOS + "\n"), system=("", "\n")),
    "index": Format(user=("reserved_0", ""), assistant=("reserved_1", EOS), system=("<unk>", "")),
    "hunyuan": Format(
        user=("", "<|extra_0|>"),
        assistant=("", "<|eos|>"),
        system=("", "<|extra_4|>"),
        prefix="<|startoftext|>",
    ),
    "hunyuan_small": Format(
        user=("<｜hy_User｜>", "<｜hy_place▁holder▁no▁8｜>"),
        assistant=("", "<｜hy_place▁holder▁no▁2｜>"),
        system=("", "<｜hy_place▁holder▁no▁3｜>"),
        prefix="<｜hy_begin▁of▁sentence｜>",
    ),
    "hy_dense_1_8b": Format(
        user=("<｜hy_User｜>", ""),
        assistant=("<｜hy_Assistant｜>", "<｜hy_place▁holder▁no▁2｜>"),
        system=("", "<｜hy_place▁holder▁no▁3｜>"),
        prefix=BOS,
    ),
    "hy_dense_7b": Format(
        user=("", "<|extra_0|>"), assistant=("", "<|eos|>"), system=("", "<|extra_4|>"), prefix=BOS
    ),
    "kimi_vl": Format(
        user=("<|im_user|>user<|im_middle|>", "<|im_end|>"),
        assistant=("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
        system=("<|im_system|>system<|im_middle|>", "<|im_end|>"),
        tool=("<|im_system|>tool<|im_middle|>", "<|im_end|>"),
        default_system="You are a helpful assistant",
    ),
    "moonlight": Format(
        user=("<|im_user|>user<|im_middle|>", "<|im_end|>"),
        assistant=("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
        system=("<|im_system|>system<|im_middle|>", "<|im_end|>"),
        tool=("<|im_system|>tool<|im_middle|>", "<|im_end|>"),
        default_system="You are a helpful assistant provided by Moonshot-AI.",
    ),
    "minimax1": Format(
        user=("<beginning_of_sentence>user name=user\n", "<end_of_sentence>\n"),
        assistant=("<beginning_of_sentence>ai name=assistant\n", "<end_of_sentence>\n"),
        system=("<beginning_of_sentence>system ai_setting=assistant\n", "<end_of_sentence>\n"),
        tool=("<beginning_of_sentence>tool name=tools\n", "<end_of_sentence>\n"),
        default_system="You are a helpful assistant.",
    ),
    "minimax2": Format(
        user=("]~b]user\n", "[e~[\n"),
        assistant=("]~b]ai\n", "[e~[\n"),
        system=("]~!b[]~b]system\n", "[e~[\n"),
        tool=("]~b]tool\n<response>", "</response>[e~[\n"),
        default_system="You are a helpful assistant. Your name is MiniMax-M2.1 and is built by MiniMax.",
    ),
    "olmo": Format(
        user=("<|user|>\n", ""), assistant=("<|assistant|>\n", EOS), system=("<|system|>\n", ""), prefix=EOS
    ),
    "seed_coder": Format(
        user=(BOS + "user\n", EOS),
        assistant=(BOS + "assistant\n", EOS),
        system=(BOS + "system\n", EOS),
        default_system=(
            "You are an AI programming assistant, utilizing the Seed-Coder model, developed by ByteDance Seed, "
            "and you only answer questions related to computer science. For politically sensitive questions, "
            "security and privacy issues, and other non-computer science questions, you will refuse to answer.\n\n"
        ),
    ),
    "seed_oss": Format(
        user=(BOS + "user\n", EOS),
        assistant=(BOS + "assistant\n", EOS),
        system=(BOS + "system\n", EOS),
        tool=(BOS + "tool\n", EOS),
    ),
    "solar": Format(
        user=("### User:\n", "\n\n"),
        assistant=("### Assistant:\n", EOS + "\n\n"),
        system=("### System:\n", "\n\n"),
    ),
    "telechat2": Format(
        user=("<_user>", ""),
        assistant=("<_bot>", EOS),
        system=("<_system>", ""),
        default_system=(
            "你是中国电信星辰语义大模型，英文名是TeleChat，你是由中电信人工智能科技有限公司和中国电信人工智能研究院（TeleAI）"
            "研发的人工智能助手。"
        ),
    ),
    "youtu": Format(
        user=("<|User|>", ""),
        assistant=("<|Assistant|>", "<|end_of_text|>"),
        system=("", ""),
        tool=("<tool_response>\n", "\n</tool_response>"),
        prefix=BOS,
        think=("<think>\n\n</think>\n\n", "<think>"),
    ),
    "youtu_vl": _turns(
        "<|begin_of_text|>user\n",
        "<|begin_of_text|>assistant\n",
        "<|end_of_text|>\n",
        "<|begin_of_text|>system\n",
        default_system="You are a helpful assistant.",
    ),
    "yuan": Format(user=("", "<sep>"), assistant=("", "<eod>\n"), system=("", "")),
    "aeva": replace(
        GLM4_THINK,
        default_system=(
            "You are an AI assistant named Aeva created by Zongzhi Lou. Your answer should be friendly, unbiased, "
            "faithful, informative and detailed."
        ),
    ),
    "baichuan2": Format(user=("<reserved_106>", ""), assistant=("<reserved_107>", EOS), system=("", "")),
}

# Names that write exactly what another name writes.
ALIASES: dict[str, str] = {
    # ChatML without a default system prompt
    "yi": "chatml",
    "smollm": "chatml",
    "llava_next_yi": "chatml",
    "llava_next_video_yi": "chatml",
    # ChatML with "You are a helpful assistant."
    "minicpm_v_4_6": "minicpm_v",
    # LFM2
    "lfm2_vl": "lfm2",
    # Qwen
    "qwen2": "qwen2_vl",
    "qwen2_audio": "qwen2_vl",
    "qwen2_omni": "qwen2_vl",
    "llava_next_qwen": "qwen2_vl",
    "keye_vl": "qwen3",
    "moss_vl": "qwen3_nothink",
    "qwen3_vl": "qwen3",
    "qwen3_omni": "qwen3",
    "qwen3_5": "qwen3",
    "qwen3_6": "qwen3",
    "qwen3_vl_nothink": "qwen3_nothink",
    "qwen3_omni_nothink": "qwen3_nothink",
    "qwen3_5_nothink": "qwen3_nothink",
    # Llama 3 / 4
    "mllama": "llama3",
    "llava_next_llama3": "llama3",
    # Mistral
    "llava_next_mistral": "mistral",
    "llava_next_video_mistral": "mistral",
    "ministral3": "ministral",
    "pixtral": "ministral",
    # Gemma
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "paligemma_chat": "gemma",
    "gemma4n": "gemma4",
    # GLM
    "glm4v": "glm4_moe",
    "glm4_5v": "glm4_moe",
    "glm4_7": "glm4_moe",
    "glmz1": "glm4_moe",
    "glm_ocr": "glm4",
    # Vicuna-style (LLaVA)
    "llava": "vicuna",
    "llava_next": "vicuna",
    "llava_next_video": "vicuna",
    "video_llava": "vicuna",
    # names tuneforge accepted before LlamaFactory renamed them
    "internvl": "intern_vl",
    "intern3": "intern2",
    "telechat": "telechat2",
}

# Names whose chat format we do not write: they need the model's own template.
MODEL_ONLY: dict[str, str] = {
    "gpt_oss": "gpt-oss speaks the harmony format (channels, a dated system header), which only its own "
    "chat template writes",
    "paligemma": "PaliGemma is a prefix language model, not a chat format: its processor builds the prompt",
}


def source(name: str) -> str | None:
    """The Jinja text of our template for `name`, or None when we have none."""
    key = ALIASES.get(name, name)
    fmt = FORMATS.get(key)
    return _cached(key) if fmt is not None else None


_SOURCES: dict[str, str] = {}


def _cached(key: str) -> str:
    if key not in _SOURCES:
        _SOURCES[key] = FORMATS[key].jinja(key)
    return _SOURCES[key]


def names() -> list[str]:
    """Every name that has a template of ours."""
    return sorted([*FORMATS, *ALIASES])
