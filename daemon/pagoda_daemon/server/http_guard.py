"""The checks every HTTP request passes before any handler sees it (ASGI middleware).

In order, each answered in the OpenAI error shape and with the connection closed, since
the rest of the request is never read:

1. Content-Length together with Transfer-Encoding: 400 (the two framings disagree about
   where the request ends; a proxy in front may pick the other one: request smuggling);
2. no valid API key (when keys are configured): 401 (`server/auth.py`);
3. a POST while the server drains for shutdown: 503 `server_shutting_down`;
4. a POST with a body that is not `application/json`: 415 (a browser sends `text/plain`,
   form and multipart bodies cross-site without asking; JSON needs a CORS preflight,
   which this server never grants);
5. a body over `max_body_bytes`: 413, from Content-Length before reading anything, else as
   soon as the streamed body passes the limit (nothing over the limit is buffered).

The body is then read here, bounded, and handed to the application as one message.

Every response, refusals included, carries ``X-Request-Id``: the client's own when it sent a
usable one (printable ASCII, at most 256 characters), else a fresh one. The handlers name the
request by it (response ids, engine request ids, logs, traces), found in ``scope["state"]``.

When the response has gone out, one access line (logger ``pagoda.access``, INFO): request id,
method, path, status, prompt and completion tokens (where the handler left ``usage`` in the
scope state) and the time from the request's arrival to its last byte.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda_daemon.server.auth import APIKeys
from pagoda_daemon.server.errors import APIError
from pagoda_daemon.server.limits import RequestLimits

access_log = logging.getLogger("pagoda.access")
QUIET_PATHS = frozenset({"/health", "/ready", "/ping", "/metrics", "/version"})


class BodyTooLarge(Exception):
    pass


REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 256
_USABLE_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when usable, else a new random one."""
    values = _header_values(headers, REQUEST_ID_HEADER)
    if len(values) == 1 and _USABLE_REQUEST_ID.fullmatch(values[0]):
        return values[0].decode("ascii")
    return uuid.uuid4().hex


def _header_values(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key.lower() == name]


def is_json_media_type(values: list[bytes]) -> bool:
    """Exactly one Content-Type, `application/json` with or without parameters (charset)."""
    return len(values) == 1 and values[0].split(b";", 1)[0].strip().lower() == b"application/json"


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit} bytes", 413, code="request_too_large")


def header_refusal(scope: Scope, limits: RequestLimits, keys: APIKeys, draining: bool) -> APIError | None:
    """What the headers alone already refuse, in the order of the module docstring."""
    headers = scope["headers"]
    content_length = _header_values(headers, b"content-length")
    if content_length and _header_values(headers, b"transfer-encoding"):
        return APIError("a request must not carry both Content-Length and Transfer-Encoding", 400,
                        code="ambiguous_framing")
    auth = keys.refusal(scope["path"], headers)
    if auth is not None:
        return auth
    if scope["method"] == "POST":
        if draining:
            return APIError("the server is shutting down; retry on another replica", 503,
                            code="server_shutting_down", headers={"Retry-After": "1"})
        has_body = _header_values(headers, b"transfer-encoding") or (content_length and content_length[0] != b"0")
        if has_body and not is_json_media_type(_header_values(headers, b"content-type")):
            return APIError("the request body must be JSON: send 'Content-Type: application/json'", 415,
                            code="unsupported_media_type")
    if content_length and int(content_length[0]) > limits.max_body_bytes:  # h11 checked it is one integer
        return too_large(limits.max_body_bytes)
    return None


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None if the client went away; BodyTooLarge past `limit`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class RequestGuard:
    """ASGI middleware: refuse what the module docstring lists, then pass the request on
    with its body already read."""

    def __init__(self, app: ASGIApp, *, limits: RequestLimits, keys: APIKeys, draining: Callable[[], bool]) -> None:
        self.app = app
        self.limits = limits
        self.keys = keys
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["arrived"] = time.monotonic()  # the handlers' admission time starts here
        send = _observed(send, scope, request_id)
        refusal = header_refusal(scope, self.limits, self.keys, self.draining())
        if refusal is not None:
            await _refuse(refusal, scope, receive, send)
            return
        try:
            body = await read_body(receive, self.limits.max_body_bytes)
        except BodyTooLarge:
            await _refuse(too_large(self.limits.max_body_bytes), scope, receive, send)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)


def _observed(send: Send, scope: Scope, request_id: str) -> Send:
    """`send` that adds X-Request-Id to the response and logs the access line after its last byte."""
    header = (REQUEST_ID_HEADER, request_id.encode("ascii"))
    arrived = scope["state"]["arrived"]
    status = [0]

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
            message = {**message, "headers": [*message.get("headers", []), header]}
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            prompt, completion = scope["state"].get("usage") or ("-", "-")
            # probes and scrapes come every few seconds: DEBUG, so that INFO shows the traffic
            level = logging.DEBUG if scope["path"] in QUIET_PATHS and status[0] == 200 else logging.INFO
            access_log.log(level, "%s %s %s %d prompt_tokens=%s completion_tokens=%s %.1f ms", request_id,
                           scope["method"], scope["path"], status[0], prompt, completion,
                           (time.monotonic() - arrived) * 1000, extra={"request_id": request_id})

    return sending


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = error.response()
    response.headers["Connection"] = "close"  # the unread rest of the request goes with the connection
    await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives the read body first, then whatever the connection says next
    (the disconnect the handlers watch for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
