"""Read a Jinja chat template's turn format by rendering it: what it writes around each role's content.

Ollama wants the chat template in Go's template syntax. Rather than keep a Go copy of every model's
template by hand, we render the Jinja template on conversations whose contents are unique markers and
cut the text at the markers: the text before the first message (a BOS), each role's prefix and suffix,
the generation prompt, and the system prompt the template injects when a conversation has none
(SmolLM2 does). `render` then rebuilds a conversation from those parts, in exactly the way the Go
template of modelfile.py does, and `derive_turns` only returns a TurnFormat when that rebuild equals the
Jinja rendering on a set of probe conversations: a template that formats turns some other way (tools in
the system prompt, reasoning stripped from history) gets None, never a wrong template.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)

# Markers: letters and digits only, so filters such as trim leave them intact.
SYS, U1, A1, U2, A2, TOOL = (f"Zq{name}7x" for name in ("sysmark", "userone", "asstone", "usertwo", "assttwo", "toolres"))


@dataclass(frozen=True)
class TurnFormat:
    begin: str  # text before the first message (e.g. a BOS); "" when folded into system_prefix
    system: tuple[str, str]  # (prefix, suffix) around the system prompt
    user: tuple[str, str]
    assistant: tuple[str, str]  # the suffix is the end-of-turn text (and what follows it)
    tool: tuple[str, str] | None  # None: the template does not render tool results this way
    generation: str  # the generation prompt (add_generation_prompt=True)
    default_system: str | None  # the system prompt the template writes when a conversation has none


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _between(text: str, start: str, end: str | None) -> str | None:
    """The text after marker `start` up to marker `end` (None: to the end)."""
    i = text.find(start)
    if i < 0:
        return None
    i += len(start)
    if end is None:
        return text[i:]
    j = text.find(end, i)
    return None if j < 0 else text[i:j]


def render(turns: TurnFormat, messages: list[dict[str, str]], system: str | None) -> str:
    """The prompt the Go template of modelfile.py renders (system = Ollama's .System; last turn open)."""
    out = turns.begin
    if system:
        out += turns.system[0] + system + turns.system[1]
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        role = m["role"]
        if role == "user" or (role == "tool" and turns.tool is not None):
            pre, suf = turns.user if role == "user" else turns.tool
            out += pre + m["content"] + suf + (turns.generation if last else "")
        elif role == "assistant":
            out += turns.assistant[0] + m["content"] + ("" if last else turns.assistant[1])
    return out


def _split(apply) -> TurnFormat | None:
    full = apply([_msg("system", SYS), _msg("user", U1), _msg("assistant", A1), _msg("user", U2),
                  _msg("assistant", A2)], False)
    head = full[: full.find(SYS)] if SYS in full else None  # begin + system prefix
    sys_user = _between(full, SYS, U1)  # system suffix + user prefix
    user_asst = _between(full, U1, A1)  # user suffix + assistant prefix
    asst_user = _between(full, A1, U2)  # assistant suffix + user prefix
    if None in (head, sys_user, user_asst, asst_user):
        return None
    upto_user2 = [_msg("system", SYS), _msg("user", U1), _msg("assistant", A1), _msg("user", U2)]
    closed, opened = apply(upto_user2, False), apply(upto_user2, True)
    if not opened.startswith(closed):
        return None
    generation = opened[len(closed):]
    user_suffix = _between(closed, U2, None)
    asst_suffix = _between(apply(upto_user2[:3], False), A1, None)
    if user_suffix is None or asst_suffix is None:
        return None
    if not (user_asst.startswith(user_suffix) and asst_user.startswith(asst_suffix)):
        return None
    asst_prefix = user_asst[len(user_suffix):]
    user_prefix = asst_user[len(asst_suffix):]
    if not sys_user.endswith(user_prefix):
        return None
    sys_suffix = sys_user[: len(sys_user) - len(user_prefix)]
    # Without a system message: the begin text, and the system prompt the template may inject.
    alone = apply([_msg("user", U1)], False)
    block = user_prefix + U1
    rest = alone[: alone.find(block)] if block in alone else None
    if rest is None:
        return None
    default_system, begin, sys_prefix = None, "", head
    inner = len(rest) - len(head) - len(sys_suffix)
    if inner > 0 and rest.startswith(head) and rest.endswith(sys_suffix):
        default_system = rest[len(head): len(rest) - len(sys_suffix)]
    elif head.startswith(rest):
        begin, sys_prefix = rest, head[len(rest):]
    else:
        return None
    tool = _tool_parts(apply, asst_suffix, generation)
    return TurnFormat(begin, (sys_prefix, sys_suffix), (user_prefix, user_suffix), (asst_prefix, asst_suffix),
                      tool, generation, default_system)


def _tool_parts(apply, asst_suffix: str, generation: str) -> tuple[str, str] | None:
    convo = [_msg("system", SYS), _msg("user", U1), _msg("assistant", A1), _msg("tool", TOOL)]
    try:
        closed, opened = apply(convo, False), apply(convo, True)
    except Exception:  # a template that refuses a tool message without a tool call
        return None
    between, after = _between(closed, A1, TOOL), _between(closed, TOOL, None)
    if between is None or after is None or not between.startswith(asst_suffix) or opened != closed + generation:
        return None
    return between[len(asst_suffix):], after


def probe_conversations() -> list[list[dict[str, str]]]:
    """Conversations (each ending where the model answers) on which the derived format is checked."""
    return [
        [_msg("user", "Hi there!")],
        [_msg("system", "You are terse."), _msg("user", "What is 2+2?")],
        [_msg("system", "Be kind."), _msg("user", "Hello"), _msg("assistant", "Hi! How can I help?"),
         _msg("user", "Tell me a joke.")],
        [_msg("user", "One"), _msg("assistant", "Two"), _msg("user", "Three")],
    ]


def _tool_probe() -> list[dict[str, str]]:
    return [_msg("user", "Weather in Paris?"), _msg("assistant", "Let me check."), _msg("tool", "18 C, sunny")]


def derive_turns(tokenizer: Any, template_source: str | None) -> TurnFormat | None:
    """The turn format of the chat template (template_source, else the tokenizer's own), or None when the
    template cannot be expressed as fixed text around each message."""

    def apply(messages: list[dict[str, str]], gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, chat_template=template_source, tokenize=False,
                                             add_generation_prompt=gen)

    try:
        turns = _split(apply)
    except Exception as e:  # the template refused one of the marker conversations
        logger.info("chat template: cannot read its turn format (%s)", e)
        return None
    if turns is None:
        return None
    probes = probe_conversations()
    if turns.tool is not None:
        probes.append(_tool_probe())
    for convo in probes:
        is_tool_probe = turns.tool is not None and convo is probes[-1]
        system = convo[0]["content"] if convo[0]["role"] == "system" else turns.default_system
        rest = convo[1:] if convo[0]["role"] == "system" else convo
        try:
            same = render(turns, rest, system) == apply(convo, True)
        except Exception:
            same = False
        if not same and is_tool_probe:  # tool results rendered some other way: leave them out
            turns = replace(turns, tool=None)
        elif not same:
            logger.info("chat template: its turn format is not fixed text around each message")
            return None
    return turns
