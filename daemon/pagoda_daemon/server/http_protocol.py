"""uvicorn adapted to the daemon: its h11 protocol with deadlines on reading a request and a
cap on open connections, and a server whose SIGTERM starts a drain.

uvicorn times out idle keep-alive connections but not a request being read: a client
that sends its headers a byte at a time, or a Content-Length it never completes, holds a
connection (and its buffers) forever, and a few hundred of them starve the server
("slowloris"). `GuardedH11Protocol` gives the headers of each request `header_timeout_s`
from the moment the connection is ready for them, and its body `body_timeout_s` from the
end of the headers (total, not per byte: trickling bytes does not extend it). A request
that misses its deadline gets a 408 in the OpenAI error shape and the connection is
closed. Connections beyond `max_connections` get a 503 and are closed at once.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import h11
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from pagoda_daemon.server.errors import APIError
from pagoda_daemon.server.limits import ConnectionLimits


def raw_error_response(error: APIError) -> bytes:
    """A complete HTTP/1.1 response for `error` that ends the connection; for the moments
    when no request cycle can answer (no request read yet, or a request abandoned)."""
    body = json.dumps(error.body()).encode()
    phrase = {408: b"Request Timeout", 503: b"Service Unavailable"}.get(error.status, b"Error")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (error.status, phrase, len(body))) + body


_HEADER_TIMEOUT = APIError("the request headers were not received in time", 408, code="request_timeout")
_BODY_TIMEOUT = APIError("the request body was not received in time", 408, code="request_timeout")
_TOO_MANY_CONNECTIONS = APIError("the server has too many open connections; retry later", 503,
                                 code="too_many_connections")


class GuardedH11Protocol(H11Protocol):
    """One connection: uvicorn's h11 handling plus a read deadline for whichever part of
    a request (headers or body) the client owes."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: type | None = None  # the client state the deadline was set for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(raw_error_response(_TOO_MANY_CONNECTIONS))
            transport.close()
            return
        self._follow_client_state()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_client_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_client_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _follow_client_state(self) -> None:
        """Keep a running deadline while the client stays in the same state (more bytes do
        not extend it); start a new one when it moves on to owing headers or a body."""
        state = self.conn.their_state
        if state is self._deadline_for or self.transport.is_closing():
            return
        self._cancel_deadline()
        self._deadline_for = state
        if state is h11.IDLE:
            self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._expire, _HEADER_TIMEOUT)
        elif state is h11.SEND_BODY:
            self._deadline = self.loop.call_later(self.limits.body_timeout_s, self._expire, _BODY_TIMEOUT)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, error: APIError) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if error is _BODY_TIMEOUT and cycle is not None:
            owes_answer = not cycle.response_started  # a 413 or 401 already went out: just close
            if not cycle.response_complete:
                cycle.disconnected = True  # the application's reads see a disconnect, its writes go nowhere
                cycle.message_event.set()
        else:
            owes_answer = bool(self.conn.trailing_data[0])  # part of a request came; an idle connection just closes
        if owes_answer:
            self.transport.write(raw_error_response(error))
        self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM (or ^C) starts Pagoda's drain instead of
    uvicorn's shutdown: the port stays open so that new requests get a clear 503 while
    in-flight ones finish; a second ^C stops at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stop_requested = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.stop_requested.is_set() and sig == signal.SIGINT:
            self.force_exit = self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self.stop_requested.set)
