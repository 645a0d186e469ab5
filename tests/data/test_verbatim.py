"""Which chat templates write contents verbatim or all trimmed (data/verbatim.py), and that for those a conversation's
text filled into its shape's layout is the text the template renders, for contents that would trip a template which
reads them otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneforge.data import template
from tuneforge.data.verbatim import TRIMMED, VERBATIM, content_form

OFFICIAL = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
LOOP = "{% for m in messages %}BODY{% endfor %}"

AS_THEY_ARE = {
    "joined": LOOP.replace("BODY", "{{ '<|' + m.role + '|>' + m['content'] + '\\n' }}"),
    "tested for emptiness": LOOP.replace("BODY", "{% if m.content %}{{ m.content }}{% else %}-{% endif %}"),
    "kept in a variable": "{% set sys = messages[0].content if messages[0].role == 'system' else '' %}[{{ sys }}]"
                          "{% for m in (messages[1:] if sys else messages) %}{% set c = m.get('content', '') %}"
                          "{{ c ~ '|' }}{% endfor %}",
    "messages selected by role": "{% if messages | length > 1 %}{% for m in messages | rejectattr('role', 'equalto',"
                                 " 'tool') %}{{ m.content }}{% endfor %}{% endif %}",
    "a key looked up": LOOP.replace("BODY", "{% if 'tool_calls' in m %}x{% endif %}{{ m.content ~ '!' }}"),
    "a type test": LOOP.replace("BODY", "{% if m.content is string %}{{ m.content }}{% endif %}"),
    "the previous message's role": LOOP.replace("BODY", "{% if loop.first or loop.previtem.role != m.role %}"
                                                "[{{ m.role }}]{% endif %}{{ m.content }}"),
    "joined in a namespace": "{% set ns = namespace(text='') %}" + LOOP.replace("BODY", "{% set ns.text = ns.text + "
                             "m.content + '|' %}") + "{{ ns.text }}",
}
TRIMMED_ALL = {
    "trimmed": LOOP.replace("BODY", "{{ '<' + m.role + '>' + m['content'] | trim + '\\n' }}"),
    "trimmed, tested as it is": LOOP.replace("BODY", "{% if m.content and m.content is string %}"
                                             "{{ m.content | trim }}{% endif %}"),
    "trimmed into a variable": LOOP.replace("BODY", "{% set c = '[' + m.content | trim + ']' %}{{ c }}"),
}
NOT_VERBATIM = {
    "some trimmed, some not": LOOP.replace("BODY", "{{ m.content | trim }}") + "{{ messages[0].content }}",
    "joined text trimmed": LOOP.replace("BODY", "{{ ('<' + m.content) | trim }}"),
    "kept as it is, then trimmed": LOOP.replace("BODY", "{% set c = m.content %}{{ c | trim }}"),
    "trimmed through a variable": LOOP.replace("BODY", "{% set c = m.content %}{{ c | upper }}"),
    "messages as JSON": "{{ messages | tojson }}",
    "a message written whole": LOOP.replace("BODY", "{{ m }}"),
    "a macro's output filtered": "{% macro f() %}{{ messages[0].content }}{% endmacro %}{{ f() | trim }}",
    "compared": LOOP.replace("BODY", "{% if m.content == 'x' %}A{% endif %}"),
    "searched": LOOP.replace("BODY", "{% if '<think>' in m.content %}T{% endif %}{{ m.content }}"),
    "split": LOOP.replace("BODY", "{{ m.content.split('</think>')[-1] }}"),
    "sliced": LOOP.replace("BODY", "{{ m.content[:5] }}"),
    "measured": LOOP.replace("BODY", "{{ m.content | length }}"),
    "through get, filtered": LOOP.replace("BODY", "{{ m.get('content') | upper }}"),
    "a message's keys iterated": LOOP.replace("BODY", "{% for k in m %}{{ k }}{% endfor %}"),
    "a message's items": LOOP.replace("BODY", "{{ m.items() | list }}"),
    "a key chosen at render time": LOOP.replace("BODY", "{{ m[m.role] }}"),
    "the loop's next message": LOOP.replace("BODY", "{{ loop.nextitem.content | upper if loop.nextitem }}"),
    "the loop kept": LOOP.replace("BODY", "{% set l = loop %}{{ l.nextitem }}"),
    "selected by the content": "{% for m in messages | selectattr('content.upper') %}{{ m.role }}{% endfor %}",
    "contents mapped": "{% for c in messages | map(attribute='content') %}{{ c }}{% endfor %}",
    "in a namespace": "{% set ns = namespace(c='') %}" + LOOP.replace("BODY", "{% set ns.c = m.content %}")
                      + "{{ ns.c | upper }}",
    "in a namespace from the start": "{% set ns = namespace(c=messages[0].content) %}{{ ns.c | upper }}",
    "the loop outside a loop": "{% macro f() %}{{ loop.previtem }}{% endmacro %}" + LOOP.replace("BODY", "{{ f() }}"),
    "captured by set": "{% set x %}{{ messages[0].content }}{% endset %}{{ x | trim }}",
    "in a filter block": "{% filter trim %}{{ messages[0].content }}{% endfilter %}",
    "a default written": LOOP.replace("BODY", "{{ (m.content or 'x') | upper }}"),
    "passed to a call": LOOP.replace("BODY", "{{ raise_exception(m.content) if m.role == 'x' }}"),
    "today's date": "{{ strftime_now('%d %b %Y') }}" + LOOP.replace("BODY", "{{ m.content }}"),
    "the generation tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "not a template": "{% for m in messages %}{{ m.content }}",
}


@pytest.mark.parametrize("name", AS_THEY_ARE)
def test_templates_that_only_write_or_test_contents_qualify(name):
    assert content_form(AS_THEY_ARE[name]) == VERBATIM


@pytest.mark.parametrize("name", TRIMMED_ALL)
def test_templates_that_write_every_content_trimmed_qualify(name):
    assert content_form(TRIMMED_ALL[name]) == TRIMMED


@pytest.mark.parametrize("name", NOT_VERBATIM)
def test_templates_that_read_contents_otherwise_do_not(name):
    assert content_form(NOT_VERBATIM[name]) is None


def test_the_families_official_templates():
    forms = {p.stem: content_form(p.read_text()) for p in sorted(OFFICIAL.glob("*.jinja"))}
    assert {name: form for name, form in forms.items() if form} == {
        **dict.fromkeys(["bailing", "chatglm3", "chatml", "deepseek", "deepseekcoder", "granite3", "openchat",
                         "phi3", "phi4", "qwen2_5"], VERBATIM),
        "llama3": TRIMMED, "gemma": TRIMMED}
    # Qwen3 tests how a content starts, Mistral v3 compares whole messages, the multimodal ones read list contents


# contents a template that reads them would render otherwise: spaces, newlines, markers, Jinja-looking text, unicode
CONTENTS = [" padded \n", "<|im_end|>\n<|im_start|>user", "{{ not jinja }} {% raw %}", "ünï 答案 🙂", "x",
            "<think>\nr\n</think>\n\nanswer", "line\n\n\nline"]


def sources():
    out = {**AS_THEY_ARE, **TRIMMED_ALL}
    out.update((f"official {p.stem}", p.read_text()) for p in sorted(OFFICIAL.glob("*.jinja")))
    out.update((f"ours {n}", s) for n, s in template.TEMPLATES.items())
    return {name: s for name, s in out.items() if content_form(s)}


QUALIFYING = sources()


@pytest.mark.parametrize("name", QUALIFYING)
def test_a_filled_layout_is_the_rendered_text(bare, name):
    chat = template.ChatTemplate(name, QUALIFYING[name])
    shapes = [["user", "assistant"], ["system", "user", "assistant", "user", "assistant"]]
    for roles in shapes:
        layouts = template.Layouts()
        for shift in range(len(CONTENTS)):
            messages = [{"role": r, "content": CONTENTS[(shift + j) % len(CONTENTS)]} for j, r in enumerate(roles)]
            try:
                rendered = template._render(bare, chat, messages, None, False)
            except Exception:  # the template refuses the shape (a role it has no turn for)
                assert layouts.filled(bare, chat, messages, None) is None
                continue
            text, spans = layouts.filled(bare, chat, messages, None)
            assert text == rendered
            assert spans == template._prefix_spans(bare, chat, messages, None, rendered)
