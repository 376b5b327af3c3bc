"""Answers the probes on the API port while the model downloads, before the API server exists.

A large model can take longer to fetch than a startup probe waits for a port that refuses
connections; so during the download ``/health`` answers 200 (the process is alive and working)
and ``/ready`` 503 with a ``downloading model`` phase and its progress, in the shape of the API
server's ``/ready``. Everything else gets 503. The port is handed over to the API server once
the download is done. Standard library only.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("pagoda.serve")

PHASE = "downloading model"


class DownloadStatus:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.started = time.monotonic()
        self.progress: dict[str, Any] = {}
        self._httpd: ThreadingHTTPServer | None = None

    def update(self, progress: Any) -> None:
        """A FetchProgress, shown in /ready."""
        self.progress = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(progress).items()}

    def body(self) -> dict[str, Any]:
        phase = {"phase": PHASE, "started_s": 0.0, "elapsed_s": round(time.monotonic() - self.started, 3),
                 **self.progress}
        return {"status": "not ready", "reason": "downloading the model", "startup": [phase]}

    def __enter__(self) -> DownloadStatus:
        status = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    code, body = 200, {"status": "ok", "engine": {}, "startup": status.body()["startup"]}
                elif path == "/ready":
                    code, body = 503, status.body()
                else:
                    code, body = 503, {"error": {"message": "the model is still downloading", "type": "unavailable",
                                                 "code": 503}}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        server_class = type("Server", (ThreadingHTTPServer,), {
            "address_family": socket.AF_INET6 if ":" in self.host else socket.AF_INET, "daemon_threads": True})
        try:
            self._httpd = server_class((self.host, self.port), Handler)
        except OSError as e:  # the probes fail until the API server starts: the download goes on
            log.warning("cannot answer probes on %s:%d during the download: %s", self.host, self.port, e)
            return self
        threading.Thread(target=self._httpd.serve_forever, name="download-status", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()  # the port is free for the API server
            self._httpd = None
