"""Hostile clients and dying processes against a real `pagoda serve` on loopback.

Raw sockets play the clients that no HTTP library would be (slowloris, smuggling); httpx
plays the rest. Each test names what it guards against.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess

BODY_LIMIT = 4096
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def guarded(tiny_models, tmp_path_factory):
    """A server with short read deadlines and a small body limit."""
    srv = ServerProcess(tiny_models["llama"], "--max-model-len", "512",
                        "--header-read-timeout", str(READ_TIMEOUT_S), "--body-read-timeout", str(READ_TIMEOUT_S),
                        "--max-request-body-bytes", str(BODY_LIMIT), log_dir=tmp_path_factory.mktemp("guarded"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _connect(srv: ServerProcess, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)


def _read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (TimeoutError if it does not)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _assert_error_shape(body: dict, code: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body


def _completion(max_tokens: int = 1) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": max_tokens}).encode()


# ---- connections that never finish a request ---------------------------------------------


@pytest.mark.serial  # a wall-clock bound: runs alone, after the parallel pass
def test_slowloris_connections_are_closed_after_the_read_deadlines_while_health_answers(guarded):
    """500 half-open connections (headers a byte at a time, or a body that never completes)
    must not be held forever, and the server must keep answering meanwhile."""
    trickling_headers = []
    trickling_bodies = []
    for _ in range(250):
        s = _connect(guarded)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pagoda\r\nX-Slow: ")
        trickling_headers.append(s)
        s = _connect(guarded)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pagoda\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        trickling_bodies.append(s)
    silent = [_connect(guarded) for _ in range(10)]  # connected, never a byte: closed without an answer
    opened = time.monotonic()
    everyone = trickling_headers + trickling_bodies
    try:
        t0 = time.monotonic()
        health = httpx.get(guarded.url + "/health", timeout=5)
        assert health.status_code == 200 and time.monotonic() - t0 < 1.0
        closed: dict[socket.socket, bytes] = {}
        while time.monotonic() - opened < READ_TIMEOUT_S + 3 and len(closed) < len(everyone):
            for s in everyone:  # one more byte each: a deadline that restarted on every byte would never come
                if s in closed:
                    continue
                try:
                    s.sendall(b"a")
                except OSError:
                    closed[s] = b""
            time.sleep(0.25)
            for s in everyone:
                if s not in closed:
                    s.setblocking(False)
                    try:
                        data = s.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    closed[s] = data + _read_until_closed(s, 2) if data else b""
        assert len(closed) == len(everyone), f"{len(everyone) - len(closed)} connections still open"
        answered = [data for data in closed.values() if data]
        assert answered and all(data.startswith(b"HTTP/1.1 408 ") for data in answered)
        _assert_error_shape(_status_and_json(answered[0])[1], "request_timeout")
        assert all(_read_until_closed(s, timeout=1) == b"" for s in silent)
        assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
    finally:
        for s in everyone + silent:
            s.close()


def test_connections_beyond_the_cap_get_503_and_are_closed(start_server):
    srv = start_server("--max-connections", "20", "--header-read-timeout", "30")
    held = [_connect(srv) for _ in range(20)]
    try:
        time.sleep(0.2)
        extra = _connect(srv)
        status, body = _status_and_json(_read_until_closed(extra))
        assert status == 503
        _assert_error_shape(body, "too_many_connections")
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert srv.health().status_code == 200


# ---- framing, media type, size --------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused(guarded):
    """Two framings in one request (request smuggling): 400 and the connection closes, so
    the bytes after it are never read as a second request."""
    body = _completion()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with _connect(guarded) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pagoda\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
                  + b"GET /v1/models HTTP/1.1\r\nHost: pagoda\r\n\r\n")
        response = _read_until_closed(s)
    status, error = _status_and_json(response)
    assert status == 400
    _assert_error_shape(error, "ambiguous_framing")
    assert response.count(b"HTTP/1.1 ") == 1  # the smuggled request got no answer


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/jsonx", None])
def test_post_bodies_that_are_not_json_get_415(guarded, content_type):
    """A browser posts text/plain, forms and multipart cross-site without a CORS preflight."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    resp = httpx.post(guarded.url + "/v1/completions", content=_completion(), headers=headers, timeout=10)
    if content_type is None:  # httpx sends none for raw content
        assert "content-type" not in resp.request.headers
    assert resp.status_code == 415
    _assert_error_shape(resp.json(), "unsupported_media_type")


def test_json_with_a_charset_is_served(guarded):
    resp = httpx.post(guarded.url + "/v1/completions", content=_completion(),
                      headers={"Content-Type": "application/json; charset=utf-8"}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_body_over_the_limit_gets_413_from_content_length(guarded):
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (2 * BODY_LIMIT)}).encode()
    resp = httpx.post(guarded.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"},
                      timeout=10)
    assert resp.status_code == 413
    _assert_error_shape(resp.json(), "request_too_large")
    assert httpx.post(guarded.url + "/v1/completions", content=_completion(),
                      headers={"Content-Type": "application/json"}, timeout=30).status_code == 200


def test_streamed_body_over_the_limit_gets_413_before_the_client_finishes(guarded):
    """Without Content-Length the limit holds while the body streams in: the 413 comes
    while the client is still sending, not after buffering all of it."""
    with _connect(guarded) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pagoda\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 1024
        for _ in range(BODY_LIMIT // len(piece) + 1):
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        # no terminating chunk: the body is unfinished
        status, error = _status_and_json(_read_until_closed(s, timeout=READ_TIMEOUT_S / 2))
    assert status == 413
    _assert_error_shape(error, "request_too_large")


# ---- what the server shows ------------------------------------------------------------


def test_api_docs_are_off_and_health_shows_no_pid(guarded):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(guarded.url + path, timeout=5).status_code == 404, path
    health = guarded.health()
    assert health.status_code == 200 and "pid" not in json.dumps(health.json())


def test_docs_flag_default_model_name_and_kv_events_on_loopback(start_server, tiny_models):
    from tests.server.conftest import free_port

    port = free_port()
    srv = start_server("--enable-fastapi-docs", "--kv-events-endpoint", str(port), served_name=None)
    assert httpx.get(srv.url + "/openapi.json", timeout=5).status_code == 200
    assert httpx.get(srv.url + "/docs", timeout=5).status_code == 200
    models = httpx.get(srv.url + "/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [Path(tiny_models["llama"]).name]
    # a bare port binds loopback only: the events carry prompt token ids
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    bound = {row[1] for row in listening if row[3] == "0A" and int(row[1].split(":")[1], 16) == port}
    assert bound == {f"0100007F:{port:04X}"}, bound


def test_kv_events_bind_loopback_unless_all_interfaces_are_named(caplog):
    from pagoda_daemon.telemetry.kv_events import KVEventPublisher

    with KVEventPublisher("tcp://:*") as pub:  # no host
        assert pub.endpoint.startswith("tcp://127.0.0.1:"), pub.endpoint
    assert "every network interface" not in caplog.text
    with KVEventPublisher("tcp://*:*") as pub:
        assert pub.endpoint.startswith("tcp://0.0.0.0:"), pub.endpoint
    assert "every network interface" in caplog.text


# ---- processes that die ----------------------------------------------------------------


def _stream_lines(srv: ServerProcess, body: dict, lines: list[tuple[float, str]], started: threading.Event) -> None:
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line:
                lines.append((time.monotonic(), line))
                started.set()


def _events(lines: list[tuple[float, str]]) -> list:
    return [line.removeprefix("data: ") for _, line in lines]


@pytest.mark.serial  # a wall-clock bound: runs alone, after the parallel pass
def test_engine_killed_streams_end_with_error_event_and_the_daemon_exits_non_zero(start_server):
    srv = start_server()
    lines: list[tuple[float, str]] = []
    started = threading.Event()
    body = {"model": MODEL_NAME, "prompt": "Tell me everything", "max_tokens": 480, "ignore_eos": True}
    reader = threading.Thread(target=_stream_lines, args=(srv, body, lines, started))
    reader.start()
    assert started.wait(30)
    os.kill(srv.engine_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    reader.join(30)
    events = _events(lines)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    _assert_error_shape(error, "engine_dead")
    assert lines[-2][0] - killed_at < 0.5  # the watchdog looks five times a second
    assert srv.proc.wait(10) == 1  # not a live API with frozen gauges: the kubelet restarts the pod


@pytest.mark.serial  # a wall-clock bound: runs alone, after the parallel pass
def test_api_killed_engine_exits_within_a_second_and_removes_its_ipc_files(start_server):
    srv = start_server()
    (ipc_dir,) = srv.ipc_dirs()
    assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700  # the IPC sockets are the owner's only
    assert sorted(p.name for p in ipc_dir.iterdir()) == ["in0", "out0"]  # engine 0's pair
    engine = srv.engine_pid()
    lines: list[tuple[float, str]] = []
    started = threading.Event()
    body = {"model": MODEL_NAME, "prompt": "Keep going", "max_tokens": 480, "ignore_eos": True, "n": 8}

    def stream() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
            _stream_lines(srv, body, lines, started)

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)  # the engine is busy generating
    srv.proc.kill()
    killed_at = time.monotonic()
    while _alive(engine) and time.monotonic() - killed_at < 10:
        time.sleep(0.02)
    gone_after = time.monotonic() - killed_at
    reader.join(10)
    assert gone_after < 1.0, f"the engine outlived the API server by {gone_after:.1f} s"
    assert not ipc_dir.exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_sigterm_past_the_drain_timeout_ends_requests_with_shutdown_errors(start_server):
    """Streams cut by shutdown end with an error event and [DONE], not a truncated body;
    non-streaming ones get a 503; while draining new requests get 503 and /ready 503."""
    srv = start_server("--drain-timeout", "1.5", "--max-model-len", "1024")
    lines: list[tuple[float, str]] = []
    started = threading.Event()
    body = {"model": MODEL_NAME, "prompt": "Count slowly", "max_tokens": 1000, "ignore_eos": True}
    reader = threading.Thread(target=_stream_lines, args=(srv, {**body, "n": 8}, lines, started))
    reader.start()
    plain: dict = {}

    def post() -> None:
        resp = httpx.post(srv.url + "/v1/completions", json={**body, "n": 8}, timeout=60)
        plain["status"], plain["body"], plain["retry"] = resp.status_code, resp.json(), resp.headers.get("retry-after")

    poster = threading.Thread(target=post)
    poster.start()
    assert started.wait(30)
    deadline = time.monotonic() + 10
    while srv.health().json()["engine"].get("num_running", 0) < 16 and time.monotonic() < deadline:
        time.sleep(0.02)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=10)
    assert refused.status_code == 503 and refused.headers.get("retry-after")
    _assert_error_shape(refused.json(), "server_shutting_down")
    ready = httpx.get(srv.url + "/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["reason"] == "the server is shutting down"
    assert srv.health().status_code == 200  # alive: the kubelet must not kill it mid-drain
    assert not lines or _events(lines)[-1] != "[DONE]"  # still streaming: the drain waits for it
    reader.join(30)
    poster.join(30)
    events = _events(lines)
    assert events[-1] == "[DONE]"
    _assert_error_shape(json.loads(events[-2]), "server_shutting_down")
    assert plain["status"] == 503 and plain["retry"]
    _assert_error_shape(plain["body"], "server_shutting_down")
    assert srv.proc.wait(15) == 0
