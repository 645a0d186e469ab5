"""`tuneforge chat`: a terminal conversation with the model, streamed token by token.

The loop reads lines through `read` and writes text through `write` (the CLI passes input and print),
so it is library code that never prints. `clear` forgets the history, `exit` (or end of input) ends the
chat, Ctrl-C during an answer stops that answer and keeps the chat going. With a vision- or audio-language
model, `image PATH` / `audio PATH` attaches a file to the next question (several lines attach several, in order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneforge.infer.engine import Engine
from tuneforge.infer.job import Delta
from tuneforge.infer.request import PromptTooLongError, RequestError

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

logger = logging.getLogger(__name__)

WELCOME = "Chat with {name}. Type `clear` to forget the conversation, `exit` to leave.\n"
WELCOME_MEDIA = "Type `image PATH` (or `audio PATH`) to attach a file to your next question.\n"
ATTACH = {"image": "images", "audio": "audios"}  # chat command -> the message key the engine reads


def chat_loop(
    cfg: RunConfig,
    *,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], Any],
    engine: Engine | None = None,
) -> list[dict[str, Any]]:
    """Chat until `exit` or end of input; returns the conversation as it stood at the end.

    system: the system prompt (default: the config's default_system). engine: a loaded one to reuse
    (default: load cfg's model, and close it at the end)."""
    own = engine is None
    engine = engine or Engine.from_config(cfg)
    system = system if system is not None else cfg.data.default_system
    head = [{"role": "system", "content": system}] if system else []
    history: list[dict[str, Any]] = []
    attached: dict[str, list[str]] = {}  # images / audios attached to the next question
    write(WELCOME.format(name=engine.name) + (WELCOME_MEDIA if engine.processor is not None else ""))
    try:
        while True:
            try:
                line = read("\nUser: ")
            except EOFError:
                write("\n")
                break
            command = line.strip()
            if command == "exit":
                break
            if command == "clear":
                history, attached = [], {}
                write("History cleared.\n")
                continue
            kind = command.split(" ", 1)[0]
            if kind in ATTACH and engine.processor is not None:
                path = Path(command[len(kind) + 1:].strip()).expanduser()
                if path.is_file():
                    attached.setdefault(ATTACH[kind], []).append(str(path.resolve()))
                    write(f"{kind.capitalize()} attached: {path} (with your next question).\n")
                else:
                    write(f"No such file: {path}\n")
                continue
            if not command:
                continue
            question: dict[str, Any] = {"role": "user", "content": command, **attached}
            attached = {}
            answer = _answer(engine, head + history + [question], write)
            if answer is not None:
                history += [question, {"role": "assistant", "content": answer}]
    finally:
        if own:
            engine.close()
    return head + history


def _answer(engine: Engine, messages: list[dict[str, Any]], write: Callable[[str], Any]) -> str | None:
    """Stream one answer; None when it did not happen (too long a conversation, or interrupted)."""
    try:
        events = engine.stream(messages)
    except PromptTooLongError as e:
        write(f"The conversation is too long for the model ({e.prompt_tokens} tokens, context {e.context}); "
              f"type `clear` to start over.\n")
        return None
    except RequestError as e:  # e.g. an attached image that cannot be read
        write(f"{e}\n")
        return None
    write("Assistant: ")
    pieces: list[str] = []
    try:
        for event in events:
            if isinstance(event, Delta):
                pieces.append(event.text)
                write(event.text)
    except KeyboardInterrupt:
        events.close()  # cancels the generation
        write(" [stopped]\n")
        return None
    write("\n")
    return "".join(pieces)
