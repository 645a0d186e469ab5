"""Use a trained model: the generation engine (engine.py, job.py, decode.py, request.py), tool calls
(tools.py), the terminal chat (chat.py), the OpenAI-compatible API server (api/); generation.py holds what
chat, api, eval and the quick-start share (prompt tokens, end-of-turn stops, generate kwargs)."""
