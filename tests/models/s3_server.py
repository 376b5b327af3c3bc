"""moto's S3 server (a real HTTP server speaking the S3 protocol) that also records each request,
as tests/models/hub_server.py does for the Hub: download-once and resume tests count the GETs of
each object at the server."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from moto.server import ThreadedMotoServer

Environ = dict[str, Any]
App = Callable[[Environ, Callable[..., Any]], Iterable[bytes]]


class CountingS3Server(ThreadedMotoServer):
    """``requests``: (method, path, Range header or None) in arrival order; ``delay_s``: a pause
    before each object GET's answer (makes a download slow enough to interrupt)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(ip_address=host, port=port, verbose=False)
        self.requests: list[tuple[str, str, str | None]] = []
        self.delay_s = 0.0
        self.url = f"http://{host}:{port}"

    def object_gets(self, bucket: str, key: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and r[1] == f"/{bucket}/{key}"]

    def _server_entry(self) -> None:  # moto's own, with the app wrapped
        from moto.moto_server.threaded_moto_server import make_server
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

        app = self._counting(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    def _counting(self, app: App) -> App:
        def wrapped(environ: Environ, start_response: Callable[..., Any]) -> Iterable[bytes]:
            method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
            self.requests.append((method, path, environ.get("HTTP_RANGE")))
            if method == "GET" and path.count("/") >= 2 and not environ.get("QUERY_STRING") and self.delay_s:
                time.sleep(self.delay_s)
            return app(environ, start_response)

        return wrapped
