"""The OpenAI-compatible FastAPI app around one Engine.

Routes: GET /v1/models, POST /v1/chat/completions (plain or SSE stream), POST /v1/score/evaluation
(LlamaFactory's reward-model route). Every error a client can cause answers OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status, and the server keeps serving.
With an api key, every route needs `Authorization: Bearer <key>` (compared in constant time), checked
before the request body is read.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from tuneforge import __version__
from tuneforge.data import tool_formats
from tuneforge.errors import TuneforgeError
from tuneforge.infer.api import protocol
from tuneforge.infer.api.messages import template_messages, template_tools
from tuneforge.infer.api.stream import Pending, collect, sse
from tuneforge.infer.engine import Engine
from tuneforge.infer.request import RequestError
from tuneforge.infer.tools import tool_syntax

logger = logging.getLogger(__name__)
STATUS = {"model_not_found": 404, "invalid_api_key": 401}


class BearerAuth:
    """ASGI middleware: 401 unless the Authorization header carries the key."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                message = "missing API key: send Authorization: Bearer <API_KEY>" if not header else "invalid API key"
                body = protocol.error(message, param=None, code="invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(status: int, message: str, **kwargs: Any) -> JSONResponse:
    return JSONResponse(protocol.error(message, **kwargs), status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = protocol.validation_error(list(exc.errors()))
        return _error(400, message, param=param, code=code)

    @app.exception_handler(HTTPException)
    async def http(_request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else None
        return _error(exc.status_code, str(exc.detail), code=kind)

    @app.exception_handler(RequestError)
    async def refused(_request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(protocol.request_error(exc), status_code=STATUS.get(exc.code or "", 400))

    @app.exception_handler(TuneforgeError)
    async def user_error(_request: Request, exc: TuneforgeError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(Exception)
    async def bug(_request: Request, exc: Exception) -> JSONResponse:  # logged by Starlette, with its traceback
        return _error(500, f"the server failed: {type(exc).__name__}: {exc}", type="server_error")


def create_app(engine: Engine, *, api_key: str | None = None) -> FastAPI:
    """The app serving engine (its model under the name engine.name)."""
    app = FastAPI(title="tuneforge", version=__version__, docs_url=None, redoc_url=None)
    app.state.engine = engine
    fmt = engine.template.tool_format  # calls as tool_format writes them, else as the chat template does
    syntax = tool_formats.syntax(fmt) if fmt else tool_syntax(engine.template.text(engine.tokenizer))
    created = protocol.now()
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    def check_model(name: str) -> None:
        if name != engine.name:
            raise RequestError(f"model {name!r} is not served here; this server serves {engine.name!r} "
                               f"(GET /v1/models)", param="model", code="model_not_found")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": engine.name, "object": "model", "created": created, "owned_by": "tuneforge"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        tools = template_tools([t.model_dump() for t in body.tools]) if body.tools else None
        messages = template_messages([m.model_dump() for m in body.messages], syntax,
                                     default_system=engine.default_system, media_root=engine.media_root)
        ids, media = await run_in_threadpool(engine.prompt, messages, tools, body.chat_template_kwargs)
        params = engine.sampling(
            len(ids), max_tokens=body.answer_limit, n=body.n, temperature=body.temperature, top_p=body.top_p,
            stop=body.stop, seed=body.seed,
            skip_special_tokens=False if body.use_tools else None,  # tool-call markers can be special tokens
        )
        names = frozenset(t.function.name for t in body.tools or [])
        parse = syntax if body.use_tools else None
        cid, stamp = protocol.new_id("chatcmpl"), protocol.now()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = sse(engine, ids, params, cid=cid, created=stamp, model=engine.name, syntax=parse, names=names,
                         include_usage=include_usage, media=media)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        choices, done = await collect(Pending(engine, ids, params, media), request, body.n, parse, names)
        return protocol.completion(cid, stamp, engine.name, choices,
                                   protocol.usage(done.prompt_tokens, done.completion_tokens))

    @app.post("/v1/score/evaluation")
    async def score(body: protocol.ScoreRequest) -> dict[str, Any]:
        check_model(body.model)
        scores = await asyncio.wrap_future(engine.score_future(body.messages, body.max_length))
        return {"id": protocol.new_id("scoreval"), "object": "score.evaluation", "model": engine.name,
                "scores": scores}

    return app
