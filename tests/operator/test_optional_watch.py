"""The operator's own watch of a kind whose CRD may come and go (optional_watch.py), and
``Kube.watch`` against a real HTTP server on loopback speaking the API server's watch protocol."""

from __future__ import annotations

import http.server
import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from pagoda_operator.kube import ApiError
from pagoda_operator.optional_watch import OptionalWatch
from tests.operator.operator_fakes import kube_for, serving


def lws_event(kind: str, name: str, version: str) -> dict[str, Any]:
    return {"type": kind, "object": {"kind": "LeaderWorkerSet",
                                     "metadata": {"name": name, "namespace": "ns", "resourceVersion": version}}}


class ScriptedWatches:
    """Answers each watch request with the next step of ``script``: a list of events, or an
    exception to raise; stops the watch when the script runs out."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.asked: list[str | None] = []  # the resourceVersion of each request
        self.watch_under_test: OptionalWatch | None = None

    def watch(self, kind: str, namespace: str | None, selector: str | None, resource_version: str | None,
              timeout_s: int) -> Iterator[dict[str, Any]]:
        assert (kind, namespace, selector, timeout_s) == ("LeaderWorkerSet", None, "managed", 300)
        self.asked.append(resource_version)
        if not self.script:
            assert self.watch_under_test is not None
            self.watch_under_test.stop()
            return
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        yield from step


def run_watch(watches: ScriptedWatches, served: Any = lambda: True) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    watch = OptionalWatch(watches, "LeaderWorkerSet", None, "managed", served,
                          lambda e: seen.append((e["type"], e["object"]["metadata"]["name"])),
                          recheck_s=0.01, retry_s=0.01)
    watches.watch_under_test = watch
    watch.start()
    assert watch.thread is not None
    watch.thread.join(timeout=10)
    assert not watch.thread.is_alive()
    return seen


def test_a_404_is_not_served_now_and_the_watch_starts_over_when_it_is_again():
    """The CRD deleted under the watch: the 404 neither ends the watch nor the process; the
    next request, once served again, starts from the current objects (no resourceVersion)."""
    watches = ScriptedWatches([
        [lws_event("ADDED", "a", "5"), lws_event("MODIFIED", "a", "6"),
         {"type": "BOOKMARK", "object": {"kind": "LeaderWorkerSet", "metadata": {"resourceVersion": "9"}}}],
        ApiError(404, "Not Found", {"kind": "Status", "code": 404}),
        [lws_event("ADDED", "b", "12")],
    ])
    assert run_watch(watches) == [("ADDED", "a"), ("MODIFIED", "a"), ("ADDED", "b")]
    assert watches.asked == [None, "9", None, "12"]  # resumed after the bookmark; started over after the 404


def test_a_410_in_the_stream_starts_over_and_other_failures_retry_from_where_it_was():
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
    watches = ScriptedWatches([
        [lws_event("ADDED", "a", "5"), gone, lws_event("DELETED", "never-delivered", "6")],
        [lws_event("ADDED", "a", "20")],
        ConnectionResetError("peer went away"),
        ApiError(503, "Service Unavailable", None),
        [{"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError"}}],
        [lws_event("DELETED", "a", "21")],
    ])
    assert run_watch(watches) == [("ADDED", "a"), ("ADDED", "a"), ("DELETED", "a")]
    assert watches.asked == [None, None, "20", "20", "20", "20", "21"]


def test_nothing_is_asked_while_not_served_and_the_watch_begins_once_it_is():
    answers = iter([False, False, False])
    watches = ScriptedWatches([[lws_event("ADDED", "a", "3")]])
    assert run_watch(watches, served=lambda: next(answers, True)) == [("ADDED", "a")]
    assert watches.asked == [None, "3"]


def test_a_handler_that_raises_does_not_stop_the_watch():
    watches = ScriptedWatches([[lws_event("ADDED", "bad", "1"), lws_event("ADDED", "good", "2")]])
    seen: list[str] = []

    def handle(event: dict[str, Any]) -> None:
        name = event["object"]["metadata"]["name"]
        if name == "bad":
            raise KeyError("instance label")
        seen.append(name)

    watch = OptionalWatch(watches, "LeaderWorkerSet", None, "managed", lambda: True, handle,
                          recheck_s=0.01, retry_s=0.01)
    watches.watch_under_test = watch
    watch.run()
    assert seen == ["good"] and watches.asked == [None, "2"]


class WatchServer(http.server.ThreadingHTTPServer):
    """The API server's watch protocol on loopback: chunked JSON lines for the LeaderWorkerSets
    of namespace ``ns``, a Status 404 for any other path."""

    daemon_threads = True

    def __init__(self, events: list[dict[str, Any]], pause_s: float = 0.01) -> None:
        self.events, self.pause_s = events, pause_s
        self.queries: list[dict[str, list[str]]] = []
        super().__init__(("127.0.0.1", 0), WatchHandler)


class WatchHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: WatchServer

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path != "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ns/leaderworkersets":
            body = json.dumps({"kind": "Status", "status": "Failure", "message": "the server could not find "
                               "the requested resource", "reason": "NotFound", "code": 404}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.server.queries.append(parse_qs(url.query))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in self.server.events:
            line = json.dumps(event).encode() + b"\n"
            # an event split over two chunks, as a proxy may send it
            for part in (line[:7], line[7:]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            time.sleep(self.server.pause_s)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def watch_server() -> Iterator[WatchServer]:
    with serving(WatchServer([lws_event("ADDED", "a", "5"), lws_event("MODIFIED", "a", "6"),
                              lws_event("DELETED", "a", "7")])) as server:
        yield server


def test_kube_watch_reads_the_events_line_by_line_and_asks_as_the_api_server_expects(watch_server):
    kube = kube_for(watch_server)
    events = list(kube.watch("LeaderWorkerSet", "ns", "app=x,owner", "4", 300))
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in events] == [
        ("ADDED", "5"), ("MODIFIED", "6"), ("DELETED", "7")]
    (query,) = watch_server.queries
    assert query == {"watch": ["true"], "allowWatchBookmarks": ["true"], "labelSelector": ["app=x,owner"],
                     "resourceVersion": ["4"], "timeoutSeconds": ["300"]}
    # without a version the request asks for the current objects first: no resourceVersion sent
    list(kube.watch("LeaderWorkerSet", "ns", None, None, 60))
    assert "resourceVersion" not in watch_server.queries[1] and "labelSelector" not in watch_server.queries[1]


def test_kube_watch_raises_the_api_servers_404_with_its_message(watch_server):
    kube = kube_for(watch_server)
    with pytest.raises(ApiError) as raised:
        list(kube.watch("LeaderWorkerSet", "elsewhere", None, None, 60))
    assert raised.value.status == 404 and "could not find the requested resource" in str(raised.value)


def test_the_watch_over_a_real_connection_hands_each_event_on(watch_server):
    seen: list[str] = []
    kube = kube_for(watch_server)
    watch = OptionalWatch(kube, "LeaderWorkerSet", "ns", None, lambda: True,
                          lambda e: seen.append(e["type"]), recheck_s=0.01, retry_s=0.01)
    watch.start()
    deadline = time.monotonic() + 10
    while len(seen) < 3 or len(watch_server.queries) < 2:
        assert time.monotonic() < deadline, (seen, watch_server.queries)
        time.sleep(0.01)
    watch.stop()
    assert seen[:3] == ["ADDED", "MODIFIED", "DELETED"]
    assert watch_server.queries[1]["resourceVersion"] == ["7"]  # the reconnect resumed after the last event


def test_a_watch_left_mid_stream_does_not_hand_its_connection_to_the_next_request():
    """A stream abandoned before its end (a stop, a 410) still has the server's bytes coming: its
    connection is closed, not pooled, or the next request would read them as its answer."""
    events = [lws_event("ADDED", "a", "5"), lws_event("MODIFIED", "a", "6")]
    with serving(WatchServer(events, pause_s=0.5)) as server:
        kube = kube_for(server)
        stream = kube.watch("LeaderWorkerSet", "ns", None, None, 300)
        assert next(stream)["object"]["metadata"]["resourceVersion"] == "5"
        stream.close()  # the server sends the rest in 0.5 s
        with pytest.raises(ApiError) as raised:
            list(kube.watch("LeaderWorkerSet", "elsewhere", None, None, 300))
        assert raised.value.status == 404
