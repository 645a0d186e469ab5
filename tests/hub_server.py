"""A Hugging Face hub on 127.0.0.1 for upload tests: the endpoints huggingface_hub's HfApi calls for whoami,
create_repo, create_branch and upload_folder (validate-yaml for a README.md's metadata; preupload answered "regular", so file contents come inline in the
commit), keeping what was committed in memory. Tokens: GOOD may write, READ_ONLY may not, any other is refused (401).
"""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

GOOD, READ_ONLY, USER = "hf_good_token", "hf_read_token", "me"


@dataclass
class Commit:
    repo: str
    revision: str
    message: str
    files: dict[str, bytes]


@dataclass
class Hub:
    repos: dict[str, dict] = field(default_factory=dict)  # repo id -> {"private": ..., "branches": [...]}
    commits: list[Commit] = field(default_factory=list)
    fail_commits: bool = False
    url: str = ""

    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        """The repository's files at the revision: every commit's files, later ones over earlier ones."""
        out: dict[str, bytes] = {}
        for c in self.commits:
            if c.repo == repo and c.revision == revision:
                out.update(c.files)
        return out

    def messages(self, repo: str) -> list[str]:
        return [c.message for c in self.commits if c.repo == repo]


def _handler(hub: Hub, lock: threading.Lock):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _token(self) -> str:
            return self.headers.get("Authorization", "").removeprefix("Bearer ")

        def do_GET(self):
            if self.path != "/api/whoami-v2":
                return self._reply(404, {"error": f"not here: {self.path}"})
            if self._token() not in (GOOD, READ_ONLY):
                return self._reply(401, {"error": "Invalid credentials in Authorization header"})
            role = "write" if self._token() == GOOD else "read"
            return self._reply(200, {"type": "user", "name": USER, "auth": {"accessToken": {"role": role}}})

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self._token() != GOOD:
                return self._reply(401, {"error": "Invalid credentials in Authorization header"})
            host = f"http://{self.headers['Host']}"
            if self.path == "/api/validate-yaml":  # a README.md's metadata, checked before its upload
                text = json.loads(body)["content"]
                try:
                    yaml.safe_load(text.split("---")[1]) if text.startswith("---") else None
                except (yaml.YAMLError, IndexError) as e:
                    return self._reply(400, {"errors": [{"message": str(e)}]})
                return self._reply(200, {"errors": [], "warnings": []})
            with lock:
                if self.path == "/api/repos/create":
                    spec = json.loads(body)
                    repo = f"{spec.get('organization') or USER}/{spec['name']}"
                    hub.repos.setdefault(repo, {"private": spec.get("visibility") == "private", "branches": ["main"]})
                    return self._reply(200, {"url": f"{host}/{repo}"})
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/(.+)", self.path)
                if not match or match.group(1) not in hub.repos:
                    return self._reply(404, {"error": f"Repository not found: {self.path}"})
                repo, action, revision = match.groups()
                if action == "branch":
                    hub.repos[repo]["branches"].append(revision)
                    return self._reply(200, {})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False} for f in files]})
                if hub.fail_commits:
                    return self._reply(403, {"error": "You don't have the rights to create a commit here"})
                if revision not in hub.repos[repo]["branches"]:
                    return self._reply(404, {"error": f"Revision not found: {revision}"})
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                header = next(x["value"] for x in lines if x["key"] == "header")
                files = {x["value"]["path"]: base64.b64decode(x["value"]["content"])
                         for x in lines if x["key"] == "file"}
                hub.commits.append(Commit(repo, revision, header["summary"], files))
                oid = f"{len(hub.commits):040x}"
                return self._reply(200, {"commitUrl": f"{host}/{repo}/commit/{oid}", "commitOid": oid})

    return Handler


def serve() -> tuple[Hub, ThreadingHTTPServer]:
    """Start a hub on a free local port (hub.url); stop it with server.shutdown()."""
    hub = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, threading.Lock()))
    hub.url = f"http://127.0.0.1:{server.server_port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return hub, server
