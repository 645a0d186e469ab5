"""A reward server (reward_model_type api): texts scored over HTTP by LlamaFactory's score route.

POST {url} with {"model": ..., "messages": [text, ...]} answers {"scores": [float, ...]}; a URL without a
path gets /v1/score/evaluation. `tuneforge api` on a stage rm output serves it. The standard library's
urllib does the requests (tuneforge declares no HTTP client). The bearer key comes from
TUNEFORGE_REWARD_API_KEY, else API_KEY (the variable `tuneforge api` reads its own key from).
"""

from __future__ import annotations

import json
import logging
import math
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tuneforge.errors import TrainingError
from tuneforge.rewards.inputs import RewardInputs

logger = logging.getLogger(__name__)

SCORE_PATH = "/v1/score/evaluation"
MODEL_NAME = "reward"  # what LlamaFactory's clients send; a server that checks it is asked for its own name
KEY_VARIABLES = ("TUNEFORGE_REWARD_API_KEY", "API_KEY")


def is_http_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def score_endpoint(url: str) -> str:
    """url, with /v1/score/evaluation as its path when it has none."""
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        return urlunsplit(parts._replace(path=SCORE_PATH))
    return url


def models_endpoint(endpoint: str) -> str:
    """The server's GET /v1/models beside its score route."""
    parts = urlsplit(endpoint)
    prefix = parts.path[: -len("/score/evaluation")] if parts.path.endswith("/score/evaluation") else "/v1"
    return urlunsplit(parts._replace(path=prefix + "/models", query=""))


def api_key_from_environment() -> str | None:
    return next((os.environ[v] for v in KEY_VARIABLES if os.environ.get(v)), None)


class RewardServer:
    """score(texts) -> one float per text, asked of the server batch_size texts at a time."""

    def __init__(self, url: str, *, api_key: str | None = None, batch_size: int = 64, timeout: float = 60.0) -> None:
        self.endpoint = score_endpoint(url)
        self.api_key, self.batch_size, self.timeout = api_key, batch_size, timeout
        self.model_name = MODEL_NAME
        self.asked_for_name = False

    def __call__(self, inputs: RewardInputs) -> list[float]:
        return self.score(inputs.texts)

    def score(self, texts: Sequence[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            scores += self._score_batch(list(texts[start : start + self.batch_size]))
        return scores

    def _score_batch(self, texts: list[str]) -> list[float]:
        status, reply = self._request(self.endpoint, {"model": self.model_name, "messages": texts})
        if status == 404 and _error_code(reply) == "model_not_found" and not self.asked_for_name:
            self.asked_for_name = True  # tuneforge api checks the model name: ask it which one it serves
            self.model_name = self._served_name()
            status, reply = self._request(self.endpoint, {"model": self.model_name, "messages": texts})
        if status != 200:
            raise TrainingError(f"the reward server {self.endpoint} answered HTTP {status}: {_error_text(reply)}")
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list):
            raise TrainingError(f"the reward server {self.endpoint} answered without a list of scores "
                                f"(expected {{\"scores\": [...]}}, got {_short(reply)})")
        if len(scores) != len(texts):
            raise TrainingError(f"the reward server {self.endpoint} returned {len(scores)} scores for {len(texts)} "
                                f"texts")
        bad = [s for s in scores if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)]
        if bad:
            raise TrainingError(f"the reward server {self.endpoint} returned a score that is not a finite number: "
                                f"{bad[0]!r}")
        return [float(s) for s in scores]

    def _served_name(self) -> str:
        url = models_endpoint(self.endpoint)
        status, reply = self._request(url, None)
        try:
            return str(reply["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise TrainingError(f"the reward server {self.endpoint} does not serve the model {MODEL_NAME!r}, and "
                                f"{url} (HTTP {status}) names no other: {_short(reply)}") from None

    def _request(self, url: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        """(HTTP status, decoded JSON reply); TrainingError when there is no reply or it is not JSON."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise TrainingError(f"cannot reach the reward server {url}: {reason}. Is it running (e.g. tuneforge api "
                                f"on the rm output's config), and is reward_model its address?") from e
        try:
            return status, json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise TrainingError(f"the reward server {url} answered HTTP {status} with something that is not JSON: "
                                f"{raw[:200]!r}") from None


def _error_code(reply: Any) -> str | None:
    error = reply.get("error") if isinstance(reply, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _error_text(reply: Any) -> str:
    error = reply.get("error") if isinstance(reply, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return _short(reply)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 200 else text[:200] + "..."
