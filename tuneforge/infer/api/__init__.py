"""`tuneforge api`: the model behind an OpenAI-compatible HTTP server (FastAPI + uvicorn, extra `api`).

FastAPI is imported only when the server starts, so the rest of tuneforge works without the extra.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

from tuneforge.errors import ConfigError

if TYPE_CHECKING:
    from tuneforge.config import RunConfig
    from tuneforge.infer.engine import Engine

logger = logging.getLogger(__name__)


def check_installed() -> None:
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"tuneforge api needs {' and '.join(missing)}: pip install 'tuneforge[api]'")


def create_app(engine: Engine, *, api_key: str | None = None) -> Any:
    """The FastAPI app serving engine (see tuneforge/infer/api/app.py)."""
    check_installed()
    from tuneforge.infer.api.app import create_app as _create_app

    return _create_app(engine, api_key=api_key)


def serve(cfg: RunConfig, *, host: str = "0.0.0.0", port: int = 8000, api_key: str | None = None) -> None:
    """Load the model of cfg once and serve it until interrupted."""
    check_installed()  # before the model loads
    import uvicorn

    from tuneforge.infer.engine import Engine

    engine = Engine.from_config(cfg)
    try:
        app = create_app(engine, api_key=api_key)
        logger.info("serving %s on http://%s:%d/v1 (%s)", engine.name, host, port,
                    "Bearer API_KEY required" if api_key else "no API key")
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.close()
