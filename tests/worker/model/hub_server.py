"""A local stand-in for the Hugging Face Hub: the routes `snapshot_download` uses, on loopback.

Serves repositories whose files a test puts in memory, per commit: `GET /api/models/{repo}/
revision/{rev}` (resolves a branch or tag to its commit), `GET /api/models/{repo}/tree/{rev}`
(the file listing), and `HEAD`/`GET /{repo}/resolve/{rev}/{file}` with the headers huggingface_hub
checks (X-Repo-Commit, ETag, Content-Length). Errors carry the Hub's X-Error-Code so the client
raises its typed errors. With `token` set, every route wants `Authorization: Bearer <token>` and
answers like the Hub does for a private repository otherwise.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    missing: set[str] = field(default_factory=set)  # listed in the tree, 404 on download

    def add_commit(self, files: dict[str, bytes], *refs: str) -> str:
        sha = hashlib.sha1(
            json.dumps(sorted(files)).encode() + bytes(len(self.commits))
        ).hexdigest()
        self.commits[sha] = dict(files)
        for ref in refs:
            self.refs[ref] = sha
        return sha

    def resolve(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


class HubServer:
    """Start with `with HubServer() as hub:`; `hub.url` is what HF_ENDPOINT should be."""

    def __init__(self, token: str | None = None) -> None:
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.downloads: list[str] = []  # paths of GET .../resolve/... requests
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # ---- routing --------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            # The Hub answers a private repository without a valid token like a missing one.
            return _error(h, 401, "RepoNotFound", body)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            return self._info(h, "/".join(parts[2:4]), parts[5], body)
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            return self._tree(h, "/".join(parts[2:4]), parts[5], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        return _error(h, 404, "RepoNotFound", body)

    def _lookup(
        self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, body: bool
    ) -> tuple[Repo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(h, 401, "RepoNotFound", body)
            return None
        sha = repo.resolve(rev)
        if sha is None:
            _error(h, 404, "RevisionNotFound", body)
            return None
        return repo, sha

    def _info(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, body: bool) -> None:
        found = self._lookup(h, repo_id, rev, body)
        if found is not None:
            repo, sha = found
            siblings = [{"rfilename": p} for p in sorted(repo.commits[sha])]
            _json(h, {"id": repo_id, "sha": sha, "siblings": siblings, "private": False}, body)

    def _tree(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, body: bool) -> None:
        found = self._lookup(h, repo_id, rev, body)
        if found is not None:
            repo, sha = found
            entries = [
                {"type": "file", "path": p, "size": len(data), "oid": _oid(data)}
                for p, data in sorted(repo.commits[sha].items())
            ]
            _json(h, entries, body)

    def _file(
        self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, name: str, body: bool
    ) -> None:
        found = self._lookup(h, repo_id, rev, body)
        if found is None:
            return
        repo, sha = found
        data = repo.commits[sha].get(name)
        if data is None or name in repo.missing:
            return _error(h, 404, "EntryNotFound", body)
        if body:
            self.downloads.append(f"{repo_id}/{name}")
        h.send_response(200)
        h.send_header("X-Repo-Commit", sha)
        h.send_header("ETag", f'"{_oid(data)}"')
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if body:
            h.wfile.write(data)


def _oid(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json(h: BaseHTTPRequestHandler, obj: Any, body: bool) -> None:
    data = json.dumps(obj).encode()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)


def _error(h: BaseHTTPRequestHandler, status: int, code: str, body: bool) -> None:
    data = json.dumps({"error": code}).encode()
    h.send_response(status)
    h.send_header("X-Error-Code", code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)
