"""The GRPO / PPO reward server client (tuneforge.rewards.server) against the real `tuneforge api` score route."""

from __future__ import annotations

import pytest
from infer_helpers import api_server

from tuneforge.errors import TrainingError
from tuneforge.rewards.server import RewardServer

TEXTS = ["user: 6 x 7?\nassistant: 42", "user: hi\nassistant: hello", "a b c"]


def test_the_client_scores_on_tuneforge_api_with_its_key(rm_engine, monkeypatch):
    with api_server(rm_engine, api_key="secret") as url:
        root = url.removesuffix("/v1")  # a URL without a path gets /v1/score/evaluation
        # tuneforge api serves its model under its own name: the client asks /v1/models for it
        server = RewardServer(root, api_key="secret", batch_size=2)
        assert server.score(TEXTS) == pytest.approx(rm_engine.score(TEXTS), abs=1e-6)
        assert server.model_name == rm_engine.name
        with pytest.raises(TrainingError, match=r"answered HTTP 401: invalid API key"):
            RewardServer(root, api_key="wrong").score(TEXTS)
