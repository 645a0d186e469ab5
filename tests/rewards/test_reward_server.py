"""The reward server client (reward_model_type api) against a small local HTTP server in a thread."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tuneforge.errors import TrainingError
from tuneforge.rewards import build_rewards
from tuneforge.rewards.server import RewardServer

Answer = Callable[[str, dict[str, Any] | None], tuple[int, Any]]


def lengths(_path, body):
    return 200, {"scores": [float(len(t)) for t in body["messages"]]}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self._reply(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def do_GET(self) -> None:
        self._reply(None)

    def _reply(self, body: dict[str, Any] | None) -> None:
        self.server.requests.append((self.command, self.path, body, self.headers.get("Authorization")))
        status, reply = self.server.answer(self.path, body)
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:  # keep the test output clean
        pass


@pytest.fixture
def serve():
    """serve(answer) -> (base URL, the list of requests it got as (method, path, body, authorization))."""
    servers = []

    def start(answer: Answer):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.answer, server.requests = answer, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server.requests

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_batches_the_texts_and_appends_the_score_path(serve):
    url, requests = serve(lengths)
    texts = [f"text {'x' * i}" for i in range(130)]
    assert RewardServer(url, batch_size=64).score(texts) == [float(len(t)) for t in texts]
    assert [(m, p, len(b["messages"]), b["model"]) for m, p, b, _ in requests] == [
        ("POST", "/v1/score/evaluation", 64, "reward"), ("POST", "/v1/score/evaluation", 64, "reward"),
        ("POST", "/v1/score/evaluation", 2, "reward")]


def test_a_url_with_a_path_is_used_as_it_is(serve):
    url, requests = serve(lengths)
    RewardServer(f"{url}/custom/score").score(["a"])
    assert requests[0][1] == "/custom/score"


def test_build_rewards_scores_prompt_and_completion_with_the_key(serve, rl_cfg, monkeypatch):
    url, requests = serve(lengths)
    monkeypatch.setenv("TUNEFORGE_REWARD_API_KEY", "secret")
    rewards = build_rewards(rl_cfg(reward_funcs=["length"], reward_model=url, reward_model_type="api",
                                   reward_weights=[1.0, 0.5]), None, device="cpu")
    assert rewards.names == ["length", "reward_model"]
    scores = rewards(["ab", "abc"], ["c", "de"], [{}, {}], [[1], [1, 2]])
    assert scores.per_reward[:, 1].tolist() == [3.0, 5.0]
    assert scores.total.tolist() == [1.5, 2.5]
    assert requests[0][2]["messages"] == ["abc", "abcde"] and requests[0][3] == "Bearer secret"


def test_a_server_that_checks_the_model_name_is_asked_for_it(serve):
    def tuneforge_api(path, body):
        if body is None:
            return 200, {"object": "list", "data": [{"id": "saves/rm", "object": "model"}]}
        if body["model"] != "saves/rm":
            return 404, {"error": {"message": "not served", "code": "model_not_found"}}
        return lengths(path, body)

    url, requests = serve(tuneforge_api)
    server = RewardServer(url)
    assert server.score(["ab"]) == [2.0] and server.score(["abc"]) == [3.0]
    assert [(m, p) for m, p, _, _ in requests] == [
        ("POST", "/v1/score/evaluation"), ("GET", "/v1/models"), ("POST", "/v1/score/evaluation"),
        ("POST", "/v1/score/evaluation")]  # the name is asked once


@pytest.mark.parametrize(("answer", "message"), [
    (lambda p, b: (200, {"scores": [1.0]}), r"returned 1 scores for 2 texts"),
    (lambda p, b: (200, {"score": [1.0, 2.0]}), r"answered without a list of scores"),
    (lambda p, b: (200, {"scores": [1.0, None]}), r"a score that is not a finite number: None"),
    (lambda p, b: (500, {"error": {"message": "CUDA out of memory"}}), r"answered HTTP 500: CUDA out of memory"),
    (lambda p, b: (200, b"<html>busy</html>"), r"answered HTTP 200 with something that is not JSON"),
])
def test_bad_answers_name_the_server(serve, answer, message):
    url, _ = serve(answer)
    with pytest.raises(TrainingError, match=rf"reward server {url}/v1/score/evaluation .*{message}"):
        RewardServer(url).score(["a", "b"])


def test_connection_refused_names_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(TrainingError, match=rf"cannot reach the reward server {url}/v1/score/evaluation: .*Is it running"):
        RewardServer(url, timeout=5).score(["a"])
