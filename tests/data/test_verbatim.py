"""Which chat templates write contents verbatim or all trimmed (data/verbatim.py), and that for those a conversation's
text filled into its shape's marked renders is the text the template renders, for contents that would trip a
template which reads them otherwise; contents the template's Form does not take are rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneforge.data import template
from tuneforge.data.verbatim import Form, content_form

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
    # every content filled in is a text: what the multimodal templates do with a list of parts is never run
    "list contents behind a type test": LOOP.replace("BODY", "{% if m.content is string %}{{ m.content }}{% else %}"
                                                     "{% for p in m.content %}{{ p.text | trim }}{% endfor %}"
                                                     "{% endif %}"),
    "a list's first part, in an expression": LOOP.replace("BODY", "{{ m.content if m.content is string and "
                                                          "m.content is defined else m.content[0].text }}"),
    "a message kept in a variable, its list content never read": "{% set first = messages[0] %}{% if first.content "
                                                                 "is string %}{{ first.content }}{% else %}"
                                                                 "{{ first.content[0].text }}{% endif %}"
                                                                 "{% for m in messages[1:] %}{{ m.content }}"
                                                                 "{% endfor %}",
    "a list's parts if it is not text": LOOP.replace("BODY", "{% if m.content is not string or m.content is mapping "
                                                     "%}{{ m.content[0] }}{% else %}{{ m.content }}{% endif %}"),
}
TRIMMED_ALL = {
    "trimmed": LOOP.replace("BODY", "{{ '<' + m.role + '>' + m['content'] | trim + '\\n' }}"),
    "trimmed, tested as it is": LOOP.replace("BODY", "{% if m.content and m.content is string %}"
                                             "{{ m.content | trim }}{% endif %}"),
    "trimmed into a variable": LOOP.replace("BODY", "{% set c = '[' + m.content | trim + ']' %}{{ c }}"),
}
# templates that qualify on a condition on the contents filled in, and the Form that says it
GUARDED = {
    "today's date": ("{{ strftime_now('%d %b %Y') }}{{ strftime_now('%-d %B %y') }}" + LOOP.replace("BODY",
                     "{{ m.content }}"), Form(clock=frozenset({"%d %b %Y", "%-d %B %y"}))),
    "some trimmed, some not": ("{{ messages[0].content }}{% for m in messages[1:] %}{{ m.content | trim }}"
                               "{% endfor %}", Form(space_stripped=True)),
    "kept as it is, then trimmed": (LOOP.replace("BODY", "{% set c = m.content %}{{ c | trim }}"),
                                    Form(space_stripped=True)),
    "newlines stripped": (LOOP.replace("BODY", "{{ m.content.lstrip('\\n') if m.role == 'user' else "
                                               "m.content.rstrip() }}"),
                          Form(stripped=frozenset("\n"), space_stripped=True)),
    "searched": (LOOP.replace("BODY", "{% if '<think>' in m.content %}T{% endif %}{{ m.content }}"),
                 Form(needles=frozenset({"<think>"}))),
    "a split that a search guards": (LOOP.replace("BODY", "{% set c = m.content %}{% if '</think>' in m.content and x %}"
                                                  "{% set c = c.split('</think>')[-1] | upper %}{% endif %}{{ c }}"),
                                     Form(needles=frozenset({"</think>"}))),
    "how it starts and ends": (LOOP.replace("BODY", "{% if not (m.content.startswith(('<a>', '<b>')) and "
                                            "(m.content | trim).endswith('</a>')) %}{{ m.content }}{% endif %}"),
                               Form(needles=frozenset({"<a>", "<b>", "</a>"}), space_stripped=True)),
    "joined text trimmed": (LOOP.replace("BODY", "{{ (' <' + m.content + '\\n') | trim }}"), Form(space_stripped=True)),
    "joined text stripped": (LOOP.replace("BODY", "{{ ('\\n' + m.content + '\\n\\n').rstrip('\\n') + '|' }}"),
                             Form(stripped=frozenset("\n"))),
    "trimmed into joined text, then stripped": (LOOP.replace("BODY", "{{ ('[' + m.content | trim).rstrip('.') }}"),
                                                Form(stripped=frozenset("."), space_stripped=True)),
    "a tool turn written as JSON": (LOOP.replace("BODY", "{% if m.role == 'tool' %}{{ m.content | tojson }}{% else %}"
                                                 "{{ m.content }}{% endif %}"), Form(absent_roles=frozenset({"tool"}))),
    "roles in a list, and something else": (LOOP.replace("BODY", "{% if x and m['role'] in ['tool', 'ipython'] %}"
                                                         "{{ m.content | upper }}{% elif m.role == 'user' %}"
                                                         "{{ m.content }}{% else %}{{ m.content | trim }}{% endif %}"),
                                            Form(space_stripped=True, absent_roles=frozenset({"tool", "ipython"}))),
    "a system prompt or false": ("{% set s = messages[0].content if messages[0].role == 'system' else false %}"
                                 "{% if s != false and none != s %}[{{ s }}]{% endif %}"
                                 "{% for m in (messages[1:] if s != false else messages) %}{{ m.content.strip() }}{% endfor %}",
                                 Form(space_stripped=True)),
    # a trimmed content tested: whether it is empty once stripped, which no content with spaces at its ends tells
    "trimmed, then tested": (LOOP.replace("BODY", "{% if m.content | trim %}{{ m.content }}{% endif %}"),
                             Form(space_stripped=True)),
}
NOT_VERBATIM = {
    "trimmed through a variable": LOOP.replace("BODY", "{% set c = m.content %}{{ c | upper }}"),
    "a trimmed content stripped again": LOOP.replace("BODY", "{{ (m.content | trim).lstrip('x') }}"),
    "stripped of characters chosen at render time": LOOP.replace("BODY", "{{ m.content.strip(m.role) }}"),
    "a split under a search that is negated": LOOP.replace("BODY", "{% if '</think>' not in m.content %}"
                                                           "{{ m.content }}{% else %}{{ m.content.split('x')[0] }}"
                                                           "{% endif %}"),
    "a split under a search or something else": LOOP.replace("BODY", "{% if '</think>' in m.content or x %}"
                                                             "{{ m.content.split('x')[0] }}{% endif %}"),
    "a split under a search in a variable that may hold other text": LOOP.replace(
        "BODY", "{% set c = m.content if loop.first else 'a</think>b' %}{% if '</think>' in c %}"
        "{{ c.split('</think>')[0] }}{% endif %}{{ c }}"),
    "a user's turn read otherwise": LOOP.replace("BODY", "{% if m.role == 'user' %}{{ m.content | upper }}{% else %}"
                                                 "{{ m.content }}{% endif %}"),
    "a user's turn after a system prompt read otherwise": LOOP.replace(
        "BODY", "{% if m.role == 'user' and messages[0].role == 'system' %}{{ m.content | upper }}{% else %}"
        "{{ m.content }}{% endif %}"),
    "a role other than one read otherwise": LOOP.replace("BODY", "{% if m.role != 'tool' %}{{ m.content | upper }}"
                                                         "{% endif %}"),
    "a search for text chosen at render time": LOOP.replace("BODY", "{% if m.role in m.content %}x{% endif %}"),
    "a search for text a mark holds": LOOP.replace("BODY", "{% if '1' in m.content %}x{% endif %}"),
    "a search in joined text": LOOP.replace("BODY", "{% if '<t>' in ('<' + m.content) %}x{% endif %}"),
    "a search in joined text, as a method": LOOP.replace("BODY", "{% if ('<' + m.content).startswith('<t') %}x"
                                                          "{% endif %}"),
    "compared with a number, joined": LOOP.replace("BODY", "{% if m.content + 'x' < 3 %}x{% endif %}"),
    "list contents behind a type test of a variable": LOOP.replace("BODY", "{% set c = m.content %}{% if c is string %}"
                                                                   "{{ c }}{% else %}{{ c[0] }}{% endif %}"),
    "a type test of a message that may be a plain dict": "{% set m = messages[0] if messages[0].role == 'system' "
                                                         "else {'content': ['x']} %}{% if m.content is string %}"
                                                         "{{ m.content }}{% else %}{{ messages[0].content | upper }}"
                                                         "{% endif %}",
    "list contents behind a type test and something else": LOOP.replace(
        "BODY", "{% if m.content is string and x %}{{ m.content }}{% else %}{{ m.content[0] }}{% endif %}"),
    "messages as JSON": "{{ messages | tojson }}",
    "a message written whole": LOOP.replace("BODY", "{{ m }}"),
    "a macro's output filtered": "{% macro f() %}{{ messages[0].content }}{% endmacro %}{{ f() | trim }}",
    "compared": LOOP.replace("BODY", "{% if m.content == 'x' %}A{% endif %}"),
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
    "a time of day": "{{ strftime_now('%d %b %Y %H:%M') }}" + LOOP.replace("BODY", "{{ m.content }}"),
    "a date in a format chosen at render time": LOOP.replace("BODY", "{{ strftime_now(m.role) }}{{ m.content }}"),
    "two date formats at once": "{{ strftime_now(('%d', '%b')) }}" + LOOP.replace("BODY", "{{ m.content }}"),
    "a date with a keyword": "{{ strftime_now(format='%d') }}" + LOOP.replace("BODY", "{{ m.content }}"),
    "the generation tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "not a template": "{% for m in messages %}{{ m.content }}",
}


@pytest.mark.parametrize("name", AS_THEY_ARE)
def test_templates_that_only_write_or_test_contents_qualify(name):
    assert content_form(AS_THEY_ARE[name]) == Form()


@pytest.mark.parametrize("name", TRIMMED_ALL)
def test_templates_that_write_every_content_trimmed_qualify(name):
    assert content_form(TRIMMED_ALL[name]) == Form(trimmed=True)


@pytest.mark.parametrize("name", GUARDED)
def test_templates_that_search_or_strip_contents_qualify_for_the_contents_that_change_nothing(name):
    source, form = GUARDED[name]
    assert content_form(source) == form


def chat(*contents, roles=("user", "assistant")):
    return [{"role": roles[j % len(roles)], "content": c} for j, c in enumerate(contents)]


def test_a_form_takes_the_contents_that_its_searches_and_strips_leave_as_they_are():
    form = Form(needles=frozenset({"</think>"}), stripped=frozenset("\n"), absent_roles=frozenset({"tool"}))
    assert form.contents(chat("a", "b c")) == ["a", "b c"]
    assert form.contents(chat("a", "x</think>y")) is None
    assert form.contents(chat("\na", "b")) is None and form.contents(chat("a", "b\n")) is None
    assert form.contents(chat("a", "")) is None
    assert form.contents(chat(" a", "b ")) == [" a", "b "]  # only newlines are stripped
    assert form.contents(chat("a", "b", roles=("user", "tool"))) is None
    assert Form(space_stripped=True).contents(chat("a", "b ")) is None
    assert Form(trimmed=True).contents(chat(" a\n", "b")) == ["a", "b"]
    assert Form(trimmed=True).contents(chat(" \n", "b")) is None  # empty once trimmed


@pytest.mark.parametrize("name", NOT_VERBATIM)
def test_templates_that_read_contents_otherwise_do_not(name):
    assert content_form(NOT_VERBATIM[name]) is None


def test_the_families_official_templates():
    forms = {p.stem: content_form(p.read_text()) for p in sorted(OFFICIAL.glob("*.jinja"))}
    assert {name: form for name, form in forms.items() if form} == {
        **dict.fromkeys(["bailing", "chatglm3", "chatml", "deepseek", "deepseekcoder", "granite3", "kimi_k2",
                         "openchat", "phi3", "phi4", "qwen2_5", "qwen2_5_omni", "qwen2_5_vl", "qwen2_audio", "qwen2_vl",
                         "qwen3_vl"], Form()),
        "llama3": Form(trimmed=True), "gemma": Form(trimmed=True),
        "llama3_1": Form(trimmed=True, absent_roles=frozenset({"tool", "ipython"})),
        "llama3_2": Form(trimmed=True, absent_roles=frozenset({"tool", "ipython"}), clock=frozenset({"%d %b %Y"})),
        **dict.fromkeys(["gemma3", "llama2", "cohere"], Form(space_stripped=True)),
        "qwen3": Form(needles=frozenset({"</think>", "<tool_response>", "</tool_response>"}),
                      stripped=frozenset("\n"))}
    # Mistral v3 compares whole user messages (no chat without one is filled); the multimodal ones qualify where the
    # branches that read list contents are behind `content is string` (never taken for text); Llama 3.1 writes a
    # tool turn's content as JSON (conversations with one are rendered); Llama 3.2 the same, and today's date


def test_every_template_of_ours_qualifies():
    assert [name for name, source in template.TEMPLATES.items() if content_form(source) is None] == []


# contents a template that reads them would render otherwise: spaces, newlines, markers, Jinja-looking text, unicode
CONTENTS = [" padded \n", "<|im_end|>\n<|im_start|>user", "{{ not jinja }} {% raw %}", "ünï 答案 🙂", "x",
            "<think>\nr\n</think>\n\nanswer", "line\n\n\nline", "\nnewline first", "<tool_response>x", "end. "]


def sources():
    out = {**AS_THEY_ARE, **TRIMMED_ALL, **{name: source for name, (source, _) in GUARDED.items()}}
    out.update((f"official {p.stem}", p.read_text()) for p in sorted(OFFICIAL.glob("*.jinja")))
    out.update((f"ours {n}", s) for n, s in template.TEMPLATES.items())
    return {name: s for name, s in out.items() if content_form(s)}


QUALIFYING = sources()


@pytest.mark.parametrize("name", QUALIFYING)
def test_a_filled_text_is_the_rendered_text(bare, name):
    chat = template.ChatTemplate(name, QUALIFYING[name])
    form = content_form(QUALIFYING[name])
    shapes = [["user", "assistant"], ["system", "user", "assistant", "user", "assistant"],
              ["user", "assistant", "tool", "assistant"]]
    filled = 0
    for roles in shapes:
        layouts = template.Layouts()
        for shift in range(len(CONTENTS)):
            messages = [{"role": r, "content": CONTENTS[(shift + j) % len(CONTENTS)]} for j, r in enumerate(roles)]
            try:
                rendered = template._render(bare, chat, messages, None, False)
            except Exception:  # the template refuses the shape (a role it has no turn for)
                assert layouts.filled(bare, chat, messages, None) is None
                continue
            got = layouts.filled(bare, chat, messages, None)
            if form.contents(messages) is None:
                assert got is None
                continue
            if got is None:  # only where the template does not write each content once (a role it leaves out)
                marked = template._marked(messages)
                assert template._pieces(template._render(bare, chat, marked, None, False), marked) is None
                continue
            text, spans = got
            filled += 1
            assert text == rendered
            assert spans == template._prefix_spans(
                messages, rendered, lambda k, gen, m=messages: template._render(bare, chat, m[:k], None, gen))
    assert filled >= 2  # some conversations of each kind of template are filled in
