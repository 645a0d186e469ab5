"""Whether a Jinja chat template writes each message's content verbatim (or trimmed), read from its syntax tree.

A template qualifies when nothing it does depends on a content but whether it is empty: every read of a content (a
message's `content` key) is written out (alone or joined by `+` / `~` to other text), tested for truthiness or type,
or kept in a variable (or a namespace's attribute) that is itself only used so; and no message or list of messages
reaches anything that could read its content (a filter, a call, a comparison, the output). Then, for non-empty text
contents, the template takes the same branches whatever the contents are, and its text is one rendering's text with
the contents swapped: template.Layouts renders a conversation shape once, with marks for its contents, and fills in
each conversation's contents instead of rendering it (the render was about a sixth of a chat dataset's
preprocessing). A template that writes every content through `| trim` (Llama 3's, Gemma's) qualifies too, its
contents filled in stripped.

More reads are allowed with a condition on the contents that are filled in (Form.contents; any other conversation
is rendered): looking for fixed text in a content (`'</think>' in content`, `content.startswith(...)`, `endswith`),
where no content may hold that text, so the test is false as it is for the marks (and what a positive test guards,
such as Qwen3's reasoning split, is never run: it is not read); and stripping the ends of a content or of joined
text (`content.lstrip('\n')`, `(system + content).strip()`, or `| trim` where other writes keep contents as they
are), where no content may begin or end with what is stripped, so the strip stops where it stops at a mark. Two more
are the same for every text: a type test of a content (`content is string`: what a multimodal template does with a
list of parts is never run, so it is not read either), and equality with a constant that is not text
(`system_message != false`). A branch run only for turns of some roles (`message.role == "tool"`) that reads a
content otherwise is left unread, with those roles added to the condition (Llama 3.1 writes tool results as JSON).
Today's date through `strftime_now` (Llama 3.2's system header), a format of date fields only, is text like any
constant for one day: Form.clock names the formats, and template.Layouts starts its layouts again when the date they
give changes.

The reading is conservative: a node, filter, call or statement it does not know makes the template not qualify,
and such templates render every conversation, as before. ChatML's family, Qwen3's, Llama's and Gemma's qualify;
templates that dump messages as JSON, compare contents or slice them do not.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from jinja2 import Environment, TemplateSyntaxError, nodes

# the kinds of value an expression gives: a content as it is, a content trimmed, text holding contents
OTHER, CONTENT, TRIMMED, TEXT, MESSAGE, MESSAGES = "other", "content", "trimmed", "text", "message", "messages"
TEXTUAL = frozenset({CONTENT, TRIMMED, TEXT})
# where an expression's value goes: written, tested, trimmed, kept or passed
OUTPUT, TEST, TRIM, VALUE = "output", "test", "trim", "value"

# the type tests, and what each gives for a text: every content filled in is one (template._shape)
_OF_TEXT = {"string": True, "defined": True, "sequence": True, "iterable": True, "undefined": False, "none": False,
            "mapping": False, "number": False}
_TYPE_TESTS = frozenset(_OF_TEXT)
_LIST_FILTERS = {"length": OTHER, "count": OTHER, "first": MESSAGE, "last": MESSAGE, "list": MESSAGES,
                 "reverse": MESSAGES, "selectattr": MESSAGES, "rejectattr": MESSAGES}
_GLOBAL_CALLS = frozenset({"raise_exception", "namespace", "range", "dict"})
# strftime_now's fields that a day fixes (a format with a time of day would change the text every minute)
_DATE_FIELDS = re.compile(r"%-?[aAbBdejmuUwWyY%]")
_DICT_METHODS = frozenset(dir(dict))
_SEARCHES = frozenset({"startswith", "endswith"})  # and `in`: tests for fixed text in a content
_STRIPS = frozenset({"strip", "lstrip", "rstrip"})
_MARK_CHARS = frozenset("0123456789\ue000\ue001")  # what template.Layouts' marks are made of


@dataclass(frozen=True)
class Form:
    """How a qualifying template's text depends on its contents: which contents can be filled in, and how."""

    trimmed: bool = False  # every content is written through `| trim`: the contents go in stripped
    needles: frozenset[str] = frozenset()  # text the template looks for in a content
    stripped: frozenset[str] = frozenset()  # characters some write strips from a content's ends
    space_stripped: bool = False  # some write strips whitespace from a content's ends (`| trim`, `strip()`)
    absent_roles: frozenset[str] = frozenset()  # roles whose turns the template writes otherwise (Llama 3.1's tool)
    clock: frozenset[str] = frozenset()  # strftime_now's formats: the text holds today's date (Llama 3.2)

    def contents(self, messages: list[dict]) -> list[str] | None:
        """The texts to fill in for these messages' contents; None where the conversation must be rendered: a
        content is empty (stripped, for a trimmed template), holds a needle, or begins or ends with what a write
        strips, or a message has an absent role."""
        if any(m["role"] in self.absent_roles for m in messages):
            return None
        contents = [m["content"] for m in messages]
        for c in contents:
            if not c or any(n in c for n in self.needles):
                return None
            if self.space_stripped and (c[0].isspace() or c[-1].isspace()) or c[0] in self.stripped \
                    or c[-1] in self.stripped:
                return None
        if self.trimmed:
            contents = [c.strip() for c in contents]
            return contents if all(contents) else None
        return contents


class _Unfit(Exception):
    """The template may read a content in a way that changes with it."""


@functools.lru_cache(maxsize=64)
def content_form(source: str) -> Form | None:
    """The Form of a template whose text, for the contents Form.contents takes, is a function of its messages'
    roles and its other inputs with each content written as it is (or each trimmed: `| trim`, which is str.strip);
    None for any other template (see the module's docstring)."""
    try:
        tree = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except TemplateSyntaxError:  # extensions of the tokenizer's own ({% generation %}): not read here
        return None
    reader = _Reader(tree)
    try:
        for _ in range(8):  # variables take the kinds of what they are set to, which may be set later in the text
            before = {name: set(kinds) for name, kinds in reader.bound.items()}
            reader.statements(tree.body, capturing=False)
            if reader.bound == before:
                form = reader.form()
                return None if form.absent_roles & {"user", "assistant"} else form  # it fills in no chat
    except _Unfit:
        return None
    return None


class _Reader:
    def __init__(self, tree: nodes.Template) -> None:
        self.bound: dict[str, set[str]] = {"messages": {MESSAGES}}  # every kind a name is ever set to
        self.macros = {m.name for m in tree.find_all(nodes.Macro)}
        self.capturing = False
        self.loops: list[str] = []  # the kind of item of each loop around the statement being read, innermost last
        self.reads: set[str] = set()  # how contents are written: CONTENT (as they are), TRIMMED
        self.needles: set[str] = set()
        self.stripped: set[str] = set()
        self.space_stripped = False
        self.clock: set[str] = set()  # strftime_now's formats
        self.searches: set[int] = set()  # the ids of tests for a needle (false for the contents filled in)
        self.absent_roles: set[str] = set()

    def form(self) -> Form:
        trimmed = self.reads == {TRIMMED}  # some written trimmed and some not: trimming must change none
        return Form(trimmed, frozenset(self.needles), frozenset(self.stripped),
                    self.space_stripped or TRIMMED in self.reads and not trimmed, frozenset(self.absent_roles),
                    frozenset(self.clock))

    def kind_of_value(self, node: nodes.Node) -> tuple[str, bool]:
        """The kind of a value kept in a variable, and whether it is surely of that kind (see surely)."""
        kind = self.kind(node, VALUE)
        return kind, kind not in (MESSAGE, MESSAGES) or self.surely(node, kind)

    def bind(self, target: nodes.Node, kind: str, sure: bool = True) -> None:
        """Record that a name (or a namespace's attribute) is set to a value of this kind; not sure: messages or a
        plain value (`m if x else {...}`), which surely() reads from the name's kinds."""
        if not sure:
            self.bind(target, OTHER)
        if isinstance(target, nodes.Name):
            self.bound.setdefault(target.name, set()).add(kind)
        elif isinstance(target, nodes.Tuple) and kind == OTHER:
            for item in target.items:
                self.bind(item, OTHER)
        elif isinstance(target, nodes.NSRef):  # a namespace's attribute: by its name, whichever namespace it is in
            self.bound.setdefault("." + target.attr, set()).add(kind)
        else:
            raise _Unfit

    def statements(self, body: list[nodes.Node], capturing: bool) -> None:
        outer, self.capturing = self.capturing, capturing or self.capturing
        try:
            for node in body:
                self.statement(node)
        finally:
            self.capturing = outer

    def statement(self, node: nodes.Node) -> None:
        if isinstance(node, nodes.Output):
            for item in node.nodes:
                if not isinstance(item, nodes.TemplateData):
                    self.kind(item, OUTPUT)
        elif isinstance(node, nodes.If):
            self.kind(node.test, TEST)
            truth = self.truth(node.test)  # a branch never run for the contents filled in is not read
            roles = self.roles_tested(node.test) if truth is None else None
            if roles is not None:
                self.for_roles(node.body, roles)
            elif truth is not False:
                self.statements(node.body, False)
            if truth is not True:
                for part in (*([e] for e in node.elif_), node.else_):
                    self.statements(part, False)
        elif isinstance(node, nodes.For):
            if node.recursive:
                raise _Unfit
            item = {MESSAGES: MESSAGE, OTHER: OTHER}.get(self.kind(node.iter, VALUE)) or _unfit()
            self.bind(node.target, item, sure=self.surely(node.iter, MESSAGES))
            if node.test is not None:
                self.kind(node.test, TEST)
            self.loops.append(item)  # loop.previtem / loop.nextitem in the body
            try:
                self.statements(node.body, False)
            finally:
                self.loops.pop()
            self.statements(node.else_, False)
        elif isinstance(node, nodes.Assign):
            self.bind(node.target, *self.kind_of_value(node.node))
        elif isinstance(node, (nodes.AssignBlock, nodes.FilterBlock)):  # the text written inside is kept or filtered
            if node.filter is not None:
                self.kind(node.filter, VALUE)
            self.statements(node.body, True)
            if isinstance(node, nodes.AssignBlock):
                self.bind(node.target, OTHER)
        elif isinstance(node, nodes.Macro):  # what a macro writes is a value its caller may change
            for arg in node.args:
                self.bind(arg, OTHER)
            for default in node.defaults:
                self.expect_other(default)
            self.statements(node.body, True)
        elif isinstance(node, nodes.CallBlock):
            self.expect_other(node.call)
            self.statements(node.body, True)
        elif isinstance(node, nodes.With):
            for target, value in zip(node.targets, node.values, strict=True):
                self.bind(target, *self.kind_of_value(value))
            self.statements(node.body, False)
        elif isinstance(node, nodes.Scope):
            self.statements(node.body, False)
        elif not isinstance(node, (nodes.Break, nodes.Continue)):  # includes, imports, blocks, autoescape
            raise _Unfit

    def for_roles(self, body: list[nodes.Node], roles: frozenset[str]) -> None:
        """A branch run only for messages of these roles: read, or, where it reads a content otherwise, left unread
        and the roles added to the condition (conversations with such a turn are rendered)."""
        saved = ({name: set(kinds) for name, kinds in self.bound.items()}, set(self.reads), set(self.needles),
                 set(self.stripped), self.space_stripped, set(self.searches))
        try:
            self.statements(body, False)
        except _Unfit:
            self.bound, self.reads, self.needles, self.stripped, self.space_stripped, self.searches = saved
            self.absent_roles |= roles

    def roles_tested(self, test: nodes.Node) -> frozenset[str] | None:
        """Roles such that the test is false where no message has one of them: `m.role == 'tool'` or
        `m['role'] in ['tool', 'ipython']` of a message, `or` of such tests (all their roles), `and` with one (the
        fewer of its sides' roles); None for a test that may be true whatever the roles."""
        if isinstance(test, (nodes.And, nodes.Or)):
            left, right = self.roles_tested(test.left), self.roles_tested(test.right)
            if isinstance(test, nodes.Or):
                return None if left is None or right is None else left | right
            return min((side for side in (left, right) if side is not None), key=len, default=None)
        if not (isinstance(test, nodes.Compare) and len(test.ops) == 1 and test.ops[0].op in ("eq", "in")):
            return None
        role, op = test.expr, test.ops[0]
        if not isinstance(role, (nodes.Getattr, nodes.Getitem)) or _key(role) != "role" \
                or not self.surely(role.node, MESSAGE):
            return None
        names = [op.expr] if op.op == "eq" else op.expr.items if isinstance(op.expr, (nodes.List, nodes.Tuple)) else []
        if not names or not all(isinstance(n, nodes.Const) and isinstance(n.value, str) for n in names):
            return None
        return frozenset(n.value for n in names)

    def truth(self, test: nodes.Node) -> bool | None:
        """What a test gives for every conversation filled in, None where it may differ: a search for a needle in a
        content is false, a type test of one is what it is for a text, and so are `not`, `and` and `or` of those."""
        if id(test) in self.searches:
            return False
        if isinstance(test, nodes.Test) and test.name in _OF_TEXT and self.read_directly(test.node):
            return _OF_TEXT[test.name]
        if isinstance(test, nodes.Not):
            inner = self.truth(test.node)
            return None if inner is None else not inner
        if isinstance(test, (nodes.And, nodes.Or)):
            left, right = self.truth(test.left), self.truth(test.right)
            decides = isinstance(test, nodes.Or)  # the value that decides it alone: true for `or`, false for `and`
            if decides in (left, right):
                return decides
            return None if left is None or right is None else not decides
        return None

    def expect_other(self, node: nodes.Node | None) -> None:
        if node is not None and self.kind(node, VALUE) != OTHER:
            raise _Unfit

    def kind(self, node: nodes.Node, where: str) -> str:
        """The kind of value the expression gives, where it goes being `where`; _Unfit when the value may depend on
        a content other than by being written or tested."""
        kind = self._kind(node, where)
        if kind in TEXTUAL and self.capturing or kind in (MESSAGE, MESSAGES) and where == OUTPUT:
            raise _Unfit
        if kind == CONTENT and where not in (TEST, TRIM):  # a test reads no more than a trimmed content's emptiness
            self.reads.add(CONTENT)
        return kind

    def _kind(self, node: nodes.Node, where: str) -> str:
        if isinstance(node, (nodes.Const, nodes.TemplateData)):
            return OTHER
        if isinstance(node, nodes.Name):
            if node.name == "loop":  # its previtem / nextitem may be messages: only its fields are read
                raise _Unfit
            return self.named(node.name)
        if isinstance(node, (nodes.Getattr, nodes.Getitem)):
            return self.item(node)
        if isinstance(node, (nodes.Add, nodes.Concat)):  # joined text: a content inside it is written as it is
            parts = [node.left, node.right] if isinstance(node, nodes.Add) else node.nodes
            kinds = {self.kind(part, OUTPUT if where == OUTPUT else VALUE) for part in parts} - {OTHER}
            if kinds - TEXTUAL:
                raise _Unfit
            return TEXT if kinds else OTHER
        if isinstance(node, nodes.Not):
            self.kind(node.node, TEST)
            return OTHER
        if isinstance(node, (nodes.And, nodes.Or)):  # one of the two, chosen by the left one's truthiness
            return self.either([node.left, node.right], where)
        if isinstance(node, nodes.CondExpr):
            self.kind(node.test, TEST)
            truth = self.truth(node.test)
            return self.either([node.expr1 if truth is not False else None,
                                node.expr2 if truth is not True else None], where)
        if isinstance(node, nodes.Test):
            kind = self.kind(node.node, TEST if node.name in _TYPE_TESTS else VALUE)
            if kind != OTHER and node.name not in _TYPE_TESTS:
                raise _Unfit
            self.arguments(node)
            return OTHER
        if isinstance(node, nodes.Filter):
            return self.filtered(node)
        if isinstance(node, nodes.Call):
            return self.call(node)
        if isinstance(node, nodes.Compare):
            return self.compared(node)
        if isinstance(node, (nodes.BinExpr, nodes.UnaryExpr, nodes.Tuple, nodes.List, nodes.Dict, nodes.Pair,
                             nodes.Slice)):  # arithmetic, literals and slices: of plain values only
            for child in node.iter_child_nodes():
                self.expect_other(child)
            return OTHER
        raise _Unfit  # context references, markup, extension nodes

    def named(self, name: str) -> str:
        """The kind of a variable (or of a namespace's attribute, ".name"): what it is ever set to."""
        return _joined(self.bound.get(name, {OTHER}))

    def either(self, parts: list[nodes.Node | None], where: str) -> str:
        return _joined({self.kind(part, where) for part in parts if part is not None})

    def item(self, node: nodes.Getattr | nodes.Getitem) -> str:
        """`x.key` / `x[key]`: a message's content, a message of a list, or a plain value."""
        key = node.arg if isinstance(node, nodes.Getitem) and not isinstance(node.arg, nodes.Const) else _key(node)
        if isinstance(node.node, nodes.Name) and node.node.name == "loop":
            if not isinstance(key, str) or not self.loops:
                raise _Unfit
            return self.loops[-1] if key in ("previtem", "nextitem") else OTHER
        of = self.kind(node.node, VALUE)
        if of == MESSAGES and isinstance(node, nodes.Getitem) and not isinstance(key, str):
            if isinstance(key, nodes.Slice):
                self.kind(key, VALUE)
                return MESSAGES
            if isinstance(key, nodes.Node):
                self.expect_other(key)
            return MESSAGE
        if of == MESSAGE and isinstance(key, str) and key not in _DICT_METHODS:
            return CONTENT if key == "content" else OTHER
        if of == OTHER:
            if isinstance(key, nodes.Node):
                self.expect_other(key)
            return self.named("." + key) if isinstance(key, str) else OTHER
        raise _Unfit  # a content's characters or methods, a message's methods, a key not known before rendering

    def filtered(self, node: nodes.Filter) -> str:
        if node.name == "trim" and node.node is not None and not (node.args or node.kwargs or node.dyn_args
                                                                  or node.dyn_kwargs):
            of = self.kind(node.node, TRIM)
            if of in (CONTENT, TRIMMED):
                self.reads.add(TRIMMED)
                return TRIMMED
            if of == TEXT:
                return self.stripped_text(None)
            if of != OTHER:  # a message
                raise _Unfit
            return OTHER
        of = self.kind(node.node, VALUE) if node.node is not None else OTHER
        self.arguments(node)
        if of == MESSAGES and node.name in _LIST_FILTERS:
            if node.name in ("selectattr", "rejectattr") and not (node.args and _plain_key(node.args[0])):
                raise _Unfit  # selected by a key known before rendering, not by the content
            return _LIST_FILTERS[node.name]
        if of != OTHER or node.name == "random":
            raise _Unfit
        return OTHER

    def call(self, node: nodes.Call) -> str:
        func = node.node
        if isinstance(func, nodes.Getattr) and func.attr in _SEARCHES | _STRIPS:
            of = self.kind(func.node, TRIM)  # read here; what the method gives is counted where it goes
            if of == OTHER:
                self.arguments(node)
                return OTHER
            if of not in TEXTUAL or node.kwargs or node.dyn_args or node.dyn_kwargs or len(node.args) > 1:
                raise _Unfit
            if func.attr in _SEARCHES:
                if of == TEXT:
                    raise _Unfit  # a needle could start in one part and end in the next
                if not node.args:
                    raise _Unfit
                for needle in _constants(node.args[0]):
                    self.needle(needle)
                if self.read_directly(func.node):
                    self.searches.add(id(node))
                return OTHER
            if of == TRIMMED:
                raise _Unfit  # a trimmed content stripped again: its new ends are not the ones checked
            chars = _constants(node.args[0]) if node.args else [None]
            if len(chars) != 1 or not (chars[0] is None or isinstance(chars[0], str)):
                raise _Unfit
            if of == TEXT:
                return self.stripped_text(chars[0])
            self.strips(chars[0])
            return CONTENT
        if isinstance(func, nodes.Getattr) and func.attr == "get" and self.kind(func.node, VALUE) == MESSAGE:
            if 1 <= len(node.args) <= 2 and not node.kwargs and isinstance(node.args[0], nodes.Const):
                self.arguments(node)  # the default (every message has a content)
                key = node.args[0].value
                return CONTENT if key == "content" else OTHER if isinstance(key, str) else _unfit()
            raise _Unfit
        if isinstance(func, nodes.Name) and func.name == "namespace" and not (node.args or node.dyn_args
                                                                            or node.dyn_kwargs):
            for keyword in node.kwargs:  # namespace(text=...): the attributes' first values
                self.bind(nodes.NSRef("", keyword.key), *self.kind_of_value(keyword.value))
            return OTHER
        if isinstance(func, nodes.Name) and func.name == "strftime_now" and func.name not in self.macros:
            formats = _constants(node.args[0]) if len(node.args) == 1 and not (node.kwargs or node.dyn_args
                                                                               or node.dyn_kwargs) else []
            if len(formats) != 1 or not isinstance(formats[0], str) or _DATE_FIELDS.sub("", formats[0]).count("%"):
                raise _Unfit  # a format chosen at render time, or one with a time of day
            self.clock.add(formats[0])
            return OTHER
        if isinstance(func, nodes.Name):
            if func.name not in self.macros and func.name not in _GLOBAL_CALLS and func.name != "caller":
                raise _Unfit  # lipsum, names the template does not define
        else:
            self.expect_other(func)
        self.arguments(node)
        return OTHER

    def arguments(self, node: nodes.Call | nodes.Filter | nodes.Test) -> None:
        for arg in (*node.args, *(k.value for k in node.kwargs), node.dyn_args, node.dyn_kwargs):
            self.expect_other(arg)

    def compared(self, node: nodes.Compare) -> str:
        left, left_node = self.kind(node.expr, VALUE), node.expr
        for operand in node.ops:
            searched = operand.op in ("in", "notin")
            right = self.kind(operand.expr, TEST if searched else VALUE)
            if searched and left == OTHER and right in (CONTENT, TRIMMED):  # `'</think>' in content`
                for needle in _constants(left_node):
                    self.needle(needle)
                if operand.op == "in" and len(node.ops) == 1 and self.read_directly(operand.expr):
                    self.searches.add(id(node))
            elif operand.op in ("eq", "ne") and _not_text(left_node if right in TEXTUAL else operand.expr) \
                    and OTHER in (left, right) and {left, right} <= TEXTUAL | {OTHER}:
                pass  # text against `false`, `none`, a number: equal for no text (Llama 2's system_message != false)
            elif not (searched and left == OTHER and right == MESSAGE) and (left, right) != (OTHER, OTHER):
                raise _Unfit  # a key looked up in a message, or plain values compared, are all it may be
            left, left_node = right, operand.expr
        return OTHER

    def strips(self, chars: str | None) -> None:
        """A content's ends stripped of these characters (None: whitespace)."""
        if chars is None:
            self.space_stripped = True
        else:
            self.stripped.update(chars)

    def stripped_text(self, chars: str | None) -> str:
        """Joined text stripped at its ends: the strip stops at a content's first or last character, which the
        condition keeps from being stripped (a mark's are not either), so it takes the same text off both; the
        contents go in as they are (a trimmed one too, which the condition leaves unchanged)."""
        self.strips(chars)
        self.reads.add(CONTENT)
        return TEXT

    def read_directly(self, node: nodes.Node) -> bool:
        """Whether an expression is a message's content itself (`m.content`, `m['content']`, trimmed or not), so a
        search in it is false for the contents filled in, and a type test of it is a text's; a variable may hold
        other values."""
        if isinstance(node, nodes.Filter) and node.name == "trim" and node.node is not None:
            node = node.node
        return _key(node) == "content" and self.surely(node.node, MESSAGE)

    def surely(self, node: nodes.Node, kind: str) -> bool:
        """Whether an expression always gives the conversation's messages (kind MESSAGES) or one of them (MESSAGE),
        never a plain value such as a dict with a content of its own: the kinds of values lose that (`m if x else
        {...}` is a MESSAGE), so this follows the expression itself."""
        if isinstance(node, nodes.Name):
            return self.bound.get(node.name) == {kind}
        if isinstance(node, nodes.Getitem) and not isinstance(_key(node), str):  # messages[i], messages[1:]
            return (kind == MESSAGES) == isinstance(node.arg, nodes.Slice) and self.surely(node.node, MESSAGES)
        if isinstance(node, nodes.Filter):  # messages | last, messages | selectattr(...)
            return node.node is not None and _LIST_FILTERS.get(node.name) == kind and self.surely(node.node, MESSAGES)
        if isinstance(node, (nodes.Getattr, nodes.Getitem)) and not (isinstance(node.node, nodes.Name)
                                                                      and node.node.name == "loop"):
            return self.bound.get("." + str(_key(node))) == {kind}  # a namespace's attribute
        return False  # loop.previtem, conditional and other expressions

    def needle(self, needle: object) -> None:
        """Text looked for in a content: a content holding it is rendered, so no mark may hold it."""
        if not isinstance(needle, str) or not set(needle) - _MARK_CHARS:
            raise _Unfit
        self.needles.add(needle)


def _joined(kinds: set[str]) -> str:
    """The kind of a value that may be any of these: text if it may be any text, else the one kind."""
    kinds = kinds - {OTHER}
    if len(kinds) > 1 and not kinds <= TEXTUAL:
        raise _Unfit
    return OTHER if not kinds else kinds.pop() if len(kinds) == 1 else TEXT


def _plain_key(node: nodes.Node) -> bool:
    """A constant key other than the content (no dotted path into it)."""
    return isinstance(node, nodes.Const) and isinstance(node.value, str) and "." not in node.value \
        and node.value != "content"


def _key(node: nodes.Node) -> object:
    """The key of `x.key` or `x['key']` (None for anything else)."""
    if isinstance(node, nodes.Getattr):
        return node.attr
    return node.arg.value if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) else None


def _not_text(node: nodes.Node) -> bool:
    """A constant that is not a str (no text is equal to it)."""
    return isinstance(node, nodes.Const) and not isinstance(node.value, str)


def _constants(node: nodes.Node) -> list[object]:
    """The values of a constant or a tuple of constants (`startswith(('a', 'b'))`); _Unfit for anything else."""
    if isinstance(node, nodes.Const):
        return [node.value]
    if isinstance(node, nodes.Tuple) and all(isinstance(item, nodes.Const) for item in node.items):
        return [item.value for item in node.items]
    raise _Unfit


def _unfit() -> str:
    raise _Unfit
