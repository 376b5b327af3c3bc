"""A small, real Hugging Face Hub-compatible HTTP server on loopback, for `huggingface_hub`
pointed at it with ``HF_ENDPOINT`` (the protocol a mirror speaks; no mocks of the client).

It answers what `HfApi.model_info(files_metadata=True)` and `hf_hub_download` ask:

    GET  /api/models/{repo}[/revision/{rev}]     id, sha, siblings (size, blobId, lfs sha256)
    HEAD /{repo}/resolve/{rev}/{file}           X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size
    GET  /{repo}/resolve/{rev}/{file}           the bytes, with Range support (206)

``*.safetensors`` are served as LFS files (their ETag is the sha256, as on the Hub), the
others as git blobs (ETag: the git blob id). No X-Xet-* headers, so the client takes the plain
HTTP path. Every request is recorded (``requests``) so that tests can count downloads. Fault
knobs: ``token`` (401 with a JSON error without it), unknown repos (404, the Hub's error shape),
``cut_after`` (close the connection after N bytes of a file, once), ``corrupt`` (flip a byte
of a file while advertising its real sha256 and git blob id), ``fail_first`` (answer 500 to the first N
requests whose path contains a string).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    branches: dict[str, str] = field(default_factory=dict)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".gguf"))


class HubServer:
    def __init__(self, token: str | None = None, host: str = "127.0.0.1") -> None:
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.cut_after: dict[str, int] = {}  # file name -> bytes sent before the connection is cut (once)
        self.corrupt: set[str] = set()
        self.fail_first: dict[str, int] = {}  # path substring -> requests still to answer with 500
        self.delay_s = 0.0  # before each file body: makes concurrent fetches overlap
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, 0), self._handler())  # host: where pods reach this machine (e2e)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def add_repo(self, repo_id: str, directory: str | Path, extra: dict[str, bytes] | None = None) -> str:
        """Serve the files of ``directory`` (plus ``extra``) as ``repo_id`` at branch main; the commit sha."""
        root = Path(directory)
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        files.update(extra or {})
        digest = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())).encode())
        sha = digest.hexdigest()
        self.repos[repo_id] = Repo(files, sha, {"main": sha})
        return sha

    def file_requests(self, name: str, method: str = "GET") -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == method and "/resolve/" in r[1] and r[1].endswith("/" + name)]

    def resolve_requests(self) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if "/resolve/" in r[1]]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(head=False)

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def _json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _error(self, status: int, message: str, code: str | None = None) -> None:
                headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
                self._json(status, {"error": message}, headers)

            def _answer(self, head: bool) -> None:
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                with hub._lock:
                    hub.requests.append((self.command, path, self.headers.get("Range")))
                    failing = next((k for k, n in hub.fail_first.items() if k in path and n > 0), None)
                    if failing is not None:
                        hub.fail_first[failing] -= 1
                if failing is not None:
                    return self._error(500, "Internal Error - the mirror is having a bad day")
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._error(401, "Invalid credentials in Authorization header")
                if path.startswith("/api/models/"):
                    return self._model_info(path.removeprefix("/api/models/"))
                m = re.match(r"^/(.+?)/resolve/([^/]+)/(.+)$", path)
                if m:
                    return self._file(m.group(1), m.group(2), m.group(3), head)
                return self._error(404, "Not found")

            def _repo(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "Repository not found", "RepoNotFound")
                    return None
                sha = repo.branches.get(rev, rev if rev == repo.sha else None)
                if sha is None:
                    self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
                    return None
                return repo, sha

            def _model_info(self, rest: str) -> None:
                repo_id, _, rev = rest.partition("/revision/")
                found = self._repo(repo_id, urllib.parse.unquote(rev) or "main")
                if found is None:
                    return
                repo, sha = found
                siblings = []
                for name, data in repo.files.items():
                    sibling: dict[str, object] = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
                    if is_lfs(name):
                        sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                          "pointerSize": 134}
                    siblings.append(sibling)
                self._json(200, {"_id": "x", "id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                                 "disabled": False, "gated": False, "tags": [], "siblings": siblings})

            def _file(self, repo_id: str, rev: str, name: str, head: bool) -> None:
                found = self._repo(repo_id, rev)
                if found is None:
                    return
                repo, sha = found
                data = repo.files.get(name)
                if data is None:
                    return self._error(404, f"Entry not found: {name}", "EntryNotFound")
                etag = hashlib.sha256(data).hexdigest() if is_lfs(name) else git_blob_id(data)
                if name in hub.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start = 0
                rng = self.headers.get("Range")
                if rng and not head:
                    m = re.match(r"bytes=(\d+)-$", rng)
                    start = int(m.group(1)) if m else 0
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("X-Repo-Commit", sha)
                self.send_header("ETag", f'"{etag}"')
                if is_lfs(name):
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                time.sleep(hub.delay_s)
                with hub._lock:
                    cut = hub.cut_after.pop(name, None)
                if cut is not None:
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        return Handler
