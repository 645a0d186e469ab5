"""Uploads to the Hugging Face hub (push_to_hub for a training run, export_hub_model_id for `tuneforge export`).

`check_access` runs before any expensive work: the hub must be reachable (not HF_HUB_OFFLINE, HF_ENDPOINT
answering) and the token must be accepted and not read-only. `Repo` creates the repository (exist_ok, with
hub_private_repo's visibility and hub_revision's branch) and uploads folders with huggingface_hub's HfApi, in the
background when asked (HfApi runs those one after another). The hub is HF_ENDPOINT when set, read when a call is
made (huggingface_hub reads it once, at import).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tuneforge.errors import ConfigError, HubError
from tuneforge.flags import env_flag

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
TOKEN_SOURCES = "HF_TOKEN or `hf auth login`"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _api(token: str | None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token)


def check_access(token: str | None, key: str, token_key: str, source: str) -> str:
    """The hub is reachable and `token` (else HF_TOKEN / the saved login) may write; returns the account name.
    key: the config key that asks for the upload, token_key: the key that holds its token (both named in errors)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    where = f"{source}: {key}"
    if env_flag("HF_HUB_OFFLINE"):
        raise ConfigError(f"{where} needs the Hugging Face hub, which is offline here (HF_HUB_OFFLINE=1): unset "
                          f"HF_HUB_OFFLINE to upload, or drop {key} (the files are written locally either way)",
                          key=key)
    try:
        info = _api(token).whoami(token=token)
    except LocalTokenNotFoundError:
        raise ConfigError(f"{where} needs a hub token that can write: set {token_key}, or {TOKEN_SOURCES}",
                          key=(key, token_key)) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise ConfigError(f"{where}: the hub at {endpoint()} refused the token (401 Unauthorized): set "
                              f"{token_key} (or {TOKEN_SOURCES}) to a valid token with write access",
                              key=(key, token_key)) from None
        raise ConfigError(f"{where}: the hub at {endpoint()} answered {status} when asked who the token belongs to: "
                          f"{e}", key=key) from None
    except Exception as e:  # noqa: BLE001 - any transport failure (refused, DNS, TLS, timeout) means: unreachable
        raise ConfigError(f"{where}: cannot reach the Hugging Face hub at {endpoint()} ({type(e).__name__}: {e}); "
                          f"check the network (or HF_ENDPOINT), or drop {key}", key=key) from None
    role = ((info.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise ConfigError(f"{where}: the token of {info.get('name')} is read-only; set {token_key} (or "
                          f"{TOKEN_SOURCES}) to a token with write access", key=(key, token_key))
    return str(info.get("name", ""))


class Repo:
    """One hub repository to upload into: created on the first `create()` (exist_ok), then uploaded to."""

    def __init__(self, repo_id: str, *, token: str | None, private: bool | None = None,
                 revision: str | None = None) -> None:
        self.repo_id, self.token, self.private, self.revision = repo_id, token, private, revision
        self.api = _api(token)

    @property
    def url(self) -> str:
        return f"{endpoint()}/{self.repo_id}" + (f"/tree/{self.revision}" if self.revision else "")

    def create(self) -> str:
        """Create the repository (an existing one is kept, visibility included) and hub_revision's branch."""
        self.repo_id = self.api.create_repo(self.repo_id, private=self.private, exist_ok=True).repo_id
        if self.revision:
            self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)
        return self.repo_id

    def upload(self, folder: Path, message: str, *, path_in_repo: str | None = None,
               ignore: list[str] | None = None, background: bool = False) -> Any:
        """upload_folder: the commit's info, or a Future of it (background)."""
        return self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                      revision=self.revision, commit_message=message, ignore_patterns=ignore,
                                      run_as_future=background)

    def failed(self, what: str, local: Path, error: BaseException) -> HubError:
        said = " ".join(str(error).split())  # huggingface_hub's messages span lines
        return HubError(f"{what} is complete in {local}, but the upload to {self.url} failed "
                        f"({type(error).__name__}: {said}); the local files are kept: upload them later with "
                        f"`hf upload {self.repo_id} {local}`" + (f" --revision {self.revision}" if self.revision else ""))


def wait(futures: list[Future]) -> list[BaseException]:
    """Wait for background uploads; their errors."""
    return [e for e in (f.exception() for f in futures) if e is not None]
