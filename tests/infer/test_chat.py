"""`tuneforge chat` (tuneforge/infer/chat.py) with scripted input on the tiny model."""

from infer_helpers import infer_cfg

from tuneforge.infer.chat import chat_loop


class Script:
    """read() answers the scripted lines (then end of input); write() records what the chat shows."""

    def __init__(self, *lines):
        self.lines, self.prompts, self.shown = list(lines), [], []

    def read(self, prompt):
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)

    def write(self, text):
        self.shown.append(text)


def spy_on(engine, monkeypatch):
    """The conversations the chat sends to the engine."""
    sent, stream = [], engine.stream

    def recording(messages, **options):
        sent.append([dict(m) for m in messages])
        return stream(messages, **options)

    monkeypatch.setattr(engine, "stream", recording)
    return sent


def test_chat_streams_keeps_history_clears_and_exits(rm_model_dir, rm_engine, monkeypatch):
    system = {"role": "system", "content": "You are terse."}
    first = rm_engine.complete([system, {"role": "user", "content": "Hello"}]).choices[0].text
    sent = spy_on(rm_engine, monkeypatch)
    script = Script("Hello", "  And then?  ", "clear", "", "Fresh start", "exit", "never read")
    cfg = infer_cfg(rm_model_dir, default_system="You are terse.")
    final = chat_loop(cfg, read=script.read, write=script.write, engine=rm_engine)

    assert sent[0] == [system, {"role": "user", "content": "Hello"}]
    assert sent[1] == [system, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "And then?"}]
    assert sent[2] == [system, {"role": "user", "content": "Fresh start"}]  # `clear` forgot the history
    assert len(sent) == 3 and script.lines == ["never read"]  # the empty line asked nothing; exit ended it
    assert final[:2] == [system, {"role": "user", "content": "Fresh start"}]

    shown = "".join(script.shown)
    assert "History cleared." in shown and f"Assistant: {first}\n" in shown
    assert len(script.shown) > 12  # the answers came in pieces, as they were generated


def test_system_flag_and_end_of_input(rm_model_dir, rm_engine, monkeypatch):
    sent = spy_on(rm_engine, monkeypatch)
    script = Script("Hi")  # then end of input (Ctrl-D)
    chat_loop(infer_cfg(rm_model_dir, default_system="unused"), system="Answer in French.",
              read=script.read, write=script.write, engine=rm_engine)
    assert sent[0][0] == {"role": "system", "content": "Answer in French."}
    assert script.prompts == ["\nUser: ", "\nUser: "]


def test_a_conversation_over_the_context_asks_to_clear(rm_model_dir, rm_engine):
    script = Script("word " * 5000, "exit")
    history = chat_loop(infer_cfg(rm_model_dir), read=script.read, write=script.write, engine=rm_engine)
    assert "type `clear` to start over" in "".join(script.shown)
    assert history == []
