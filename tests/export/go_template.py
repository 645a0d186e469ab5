"""A small renderer of Go's text/template, for the constructs Ollama templates use.

Enough to check a Modelfile TEMPLATE against the Jinja chat template: text, `{{ .Field }}`, `$.Field`,
variables (`$x := ...`, `range $i, $v := ...`), `if` / `else if` / `else` / `end`, `range`, the functions
eq / ne / not / and / or / len / slice, parentheses, string and integer constants, and the `{{-` / `-}}`
whitespace trimming. Anything else raises, so a construct this renderer does not know fails the test.
"""

from __future__ import annotations

import re
from typing import Any

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TERM = re.compile(r'\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+')


def _lex(source: str) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(source):
        text = source[pos:m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        items.append(("text", text))
        items.append(("action", m.group(2).strip()))
        pos, trim_next = m.end(), bool(m.group(3))
    tail = source[pos:]
    items.append(("text", tail.lstrip() if trim_next else tail))
    return items


def _parse(items: list[tuple[str, str]], i: int, stop: tuple[str, ...]) -> tuple[list, int, str | None]:
    """Nodes until an action starting with one of `stop`; returns (nodes, next index, the stop action)."""
    nodes: list = []
    while i < len(items):
        kind, body = items[i]
        i += 1
        if kind == "text":
            if body:
                nodes.append(("text", body))
            continue
        if body == "end" or body == "else" or body.startswith("else if "):
            if body.split(" ")[0] in stop or body in stop:
                return nodes, i, body
            raise ValueError(f"unexpected {{{{ {body} }}}}")
        if body.startswith("if "):
            branches, else_body = [], []
            cond = body[3:]
            while True:
                inner, i, ended = _parse(items, i, ("end", "else"))
                branches.append((cond, inner))
                if ended == "end":
                    break
                if ended.startswith("else if "):
                    cond = ended[len("else if "):]
                    continue
                else_body, i, _ = _parse(items, i, ("end",))
                break
            nodes.append(("if", branches, else_body))
        elif body.startswith("range "):
            spec = body[len("range "):]
            names: list[str] = []
            if ":=" in spec:
                left, spec = spec.split(":=", 1)
                names = [n.strip() for n in left.split(",")]
            inner, i, _ = _parse(items, i, ("end",))
            nodes.append(("range", names, spec.strip(), inner))
        elif re.match(r"^\$\w+\s*:?=", body):
            name, expr = re.split(r"\s*:?=\s*", body, maxsplit=1)
            nodes.append(("set", name, expr))
        else:
            nodes.append(("print", body))
    if stop:
        raise ValueError("missing {{ end }}")
    return nodes, i, None


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "") and not (isinstance(value, (list, dict)) and not value)


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


FUNCS = {
    "eq": lambda a, *bs: any(a == b for b in bs),
    "ne": lambda a, b: a != b,
    "not": lambda a: not _truthy(a),
    "and": lambda *xs: next((x for x in xs if not _truthy(x)), xs[-1]),
    "or": lambda *xs: next((x for x in xs if _truthy(x)), xs[-1]),
    "len": len,
    "slice": lambda x, *ij: x[ij[0]:ij[1]] if len(ij) == 2 else x[ij[0]:] if ij else x,
}


class _Expr:
    def __init__(self, source: str, dot: Any, scope: dict[str, Any]) -> None:
        self.tokens, self.i, self.dot, self.scope = _TERM.findall(source), 0, dot, scope

    def value(self) -> Any:
        result = self._command()
        if self.i != len(self.tokens):
            raise ValueError(f"cannot parse {' '.join(self.tokens)}")
        return result

    def _command(self) -> Any:
        first = self.tokens[self.i]
        if first in FUNCS:
            self.i += 1
            args = []
            while self.i < len(self.tokens) and self.tokens[self.i] != ")":
                args.append(self._term())
            return FUNCS[first](*args)
        return self._term()

    def _term(self) -> Any:
        tok = self.tokens[self.i]
        self.i += 1
        if tok == "(":
            value = self._command()
            assert self.tokens[self.i] == ")", "missing )"
            self.i += 1
            return value
        if tok.startswith('"'):
            return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        if tok == ".":
            return self.dot
        if tok.startswith("$."):
            return _field(self.scope["$"], tok[2:])
        if tok.startswith("$"):
            return self.scope[tok]
        if tok.startswith("."):
            return _field(self.dot, tok[1:])
        raise ValueError(f"unknown term {tok!r}")


def _run(nodes: list, dot: Any, scope: dict[str, Any]) -> str:
    out = []
    scope = dict(scope)  # variables set in a block stay in it
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "print":
            out.append(str(_Expr(node[1], dot, scope).value()))
        elif kind == "set":
            scope[node[1]] = _Expr(node[2], dot, scope).value()
        elif kind == "if":
            for cond, body in node[1]:
                if _truthy(_Expr(cond, dot, scope).value()):
                    out.append(_run(body, dot, scope))
                    break
            else:
                out.append(_run(node[2], dot, scope))
        elif kind == "range":
            names, expr, body = node[1], node[2], node[3]
            for index, item in enumerate(_Expr(expr, dot, scope).value()):
                inner = dict(scope)
                if len(names) == 2:
                    inner[names[0]], inner[names[1]] = index, item
                elif names:
                    inner[names[0]] = item
                out.append(_run(body, item, inner))
    return "".join(out)


def render_go(source: str, data: dict[str, Any]) -> str:
    nodes, _, _ = _parse(_lex(source), 0, ())
    return _run(nodes, data, {"$": data})


def modelfile_blocks(text: str) -> dict[str, str]:
    """TEMPLATE and SYSTEM of a Modelfile (their triple-quoted values)."""
    return {m.group(1): m.group(2) for m in re.finditer(r'^(TEMPLATE|SYSTEM) """(.*?)"""', text, re.S | re.M)}


def ollama_prompt(modelfile_text: str, messages: list[dict[str, str]]) -> str:
    """The prompt Ollama builds for a chat request: the request's system message, else the Modelfile's
    SYSTEM, as .System; every message (system ones included) in .Messages."""
    blocks = modelfile_blocks(modelfile_text)
    systems = [m["content"] for m in messages if m["role"] == "system"]
    if not systems and blocks.get("SYSTEM"):
        systems = [blocks["SYSTEM"]]
        messages = [{"role": "system", "content": systems[0]}, *messages]
    data = {"System": "\n\n".join(systems), "Messages": [dict(m, Role=m["role"], Content=m["content"]) for m in messages]}
    return render_go(blocks["TEMPLATE"], data)
