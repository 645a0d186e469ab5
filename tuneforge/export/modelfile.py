"""The Ollama Modelfile of an export: FROM, TEMPLATE (Go template syntax), SYSTEM, PARAMETERs.

The TEMPLATE is written from the chat template's turn format (turns.py): Ollama passes the system prompt
as .System and the conversation as .Messages; the template writes the system block when there is a
system prompt, each user / assistant / tool message between its role's prefix and suffix, the generation
prompt after the last user or tool message, and leaves a final assistant message open (Ollama continues
it). It uses only `if` / `else if` / `range` / `eq` / `len` / `slice` / `not`, and no whitespace-trimming
markers, so the literal text (newlines included) comes out exactly as written.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tuneforge.export.turns import TurnFormat

if TYPE_CHECKING:
    from tuneforge.config import GenerateArgs

logger = logging.getLogger(__name__)


def _text(literal: str) -> str:
    """Literal text for a Go template: `{{` would open an action, so it is written as a string constant."""
    return literal.replace("{{", '{{ "{{" }}')


def go_template(turns: TurnFormat) -> str:
    """The Ollama TEMPLATE equivalent to the chat template whose turn format is `turns`."""
    t = _text
    out = t(turns.begin)
    out += f"{{{{ if .System }}}}{t(turns.system[0])}{{{{ .System }}}}{t(turns.system[1])}{{{{ end }}}}"
    out += "{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
    gen = f"{{{{ if $last }}}}{t(turns.generation)}{{{{ end }}}}" if turns.generation else ""
    out += f'{{{{ if eq .Role "user" }}}}{t(turns.user[0])}{{{{ .Content }}}}{t(turns.user[1])}{gen}'
    close = f"{{{{ if not $last }}}}{t(turns.assistant[1])}{{{{ end }}}}" if turns.assistant[1] else ""
    out += f'{{{{ else if eq .Role "assistant" }}}}{t(turns.assistant[0])}{{{{ .Content }}}}{close}'
    if turns.tool is not None:
        out += f'{{{{ else if eq .Role "tool" }}}}{t(turns.tool[0])}{{{{ .Content }}}}{t(turns.tool[1])}{gen}'
    out += "{{ end }}{{ end }}"
    return out


def _quoted(value: str) -> str | None:
    """A PARAMETER value in double quotes, or None when it cannot be written on one line."""
    if '"' in value or "\n" in value or "\r" in value:
        return None
    return f'"{value}"'


def _block(value: str) -> str | None:
    """A value in triple quotes (TEMPLATE, SYSTEM), or None when it holds triple quotes itself."""
    return None if '"""' in value else f'"""{value}"""'


def sampling_parameters(gen: GenerateArgs) -> list[tuple[str, str]]:
    """Ollama's names for the generation keys (temperature 0 = greedy, as do_sample: false)."""
    sample = gen.do_sample and gen.temperature > 0
    params = [("temperature", f"{gen.temperature:g}" if sample else "0")]
    if sample:
        params += [("top_p", f"{gen.top_p:g}")]
        if gen.top_k > 0:
            params += [("top_k", str(gen.top_k))]
    params += [("repeat_penalty", f"{gen.repetition_penalty:g}"), ("num_predict", str(gen.max_new_tokens))]
    return params


def modelfile(
    source: str,
    turns: TurnFormat | None,
    *,
    system: str | None,
    stops: list[str],
    gen: GenerateArgs,
) -> tuple[str, list[str]]:
    """The Modelfile text and notes on what it could not carry (for the summary)."""
    notes: list[str] = []
    lines = ["# Ollama Modelfile written by tuneforge export. Use: ollama create NAME -f Modelfile", f"FROM {source}"]
    if turns is None:
        notes.append("Modelfile: the chat template is not fixed text around each message, so there is no "
                     "TEMPLATE line; write one by hand before `ollama create`")
    else:
        block = _block(go_template(turns))
        if block is None:
            notes.append('Modelfile: the chat template contains """, so there is no TEMPLATE line')
        else:
            lines.append(f"TEMPLATE {block}")
    system = system if system is not None else (turns.default_system if turns else None)
    if system:
        block = _block(system)
        if block is None:
            notes.append('Modelfile: the system prompt contains """, so there is no SYSTEM line')
        else:
            lines.append(f"SYSTEM {block}")
    for stop in dict.fromkeys(s for s in stops if s.strip()):
        value = _quoted(stop)
        if value is None:
            notes.append(f"Modelfile: stop text {stop!r} cannot be written as a PARAMETER")
        else:
            lines.append(f"PARAMETER stop {value}")
    lines += [f"PARAMETER {name} {value}" for name, value in sampling_parameters(gen)]
    for note in notes:
        logger.warning("%s", note)
    return "\n".join(lines) + "\n", notes
