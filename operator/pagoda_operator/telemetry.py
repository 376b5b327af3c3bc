"""The operator's own Prometheus metrics, served by ``--metrics-port``, and ``/healthz`` there:
200 while every registered heartbeat is fresh, 503 naming the one that is not (the chart's
liveness probe then restarts a leader whose kopf loop or periodic pass is stuck)."""

from __future__ import annotations

import contextlib
import json
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "pagoda_operator_reconciles_total",
    "Reconcile passes over InferenceServices, by trigger and result.",
    ["trigger", "result"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "pagoda_operator_reconcile_errors_total",
    "Reconcile passes that raised, by trigger.",
    ["trigger"],
    registry=REGISTRY,
)
DURATION = Histogram(
    "pagoda_operator_reconcile_duration_seconds",
    "Time of one reconcile pass.",
    ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
API_REQUESTS = Counter(
    "pagoda_operator_api_requests_total",
    "Requests to the Kubernetes API server (reads served by the watch cache are not), by HTTP method "
    "(WATCH: a watch the operator holds itself, optional_watch.py; kopf's own are not counted).",
    ["method"],
    registry=REGISTRY,
)
CACHED_OBJECTS = Gauge(
    "pagoda_operator_watch_cache_objects", "Objects the passes' watch cache holds, by kind.", ["kind"], registry=REGISTRY)
CACHED_BYTES = Gauge(
    "pagoda_operator_watch_cache_bytes", "JSON bytes of the objects the passes' watch cache holds, by kind.", ["kind"],
    registry=REGISTRY)
WRITES = Counter(
    "pagoda_operator_writes_total",
    "Objects the operator created, replaced or patched, by kind and verb.",
    ["kind", "verb"],
    registry=REGISTRY,
)


@dataclass(frozen=True)
class ScalingSeries:
    """The series of one kind of pods the operator sizes: how many it wants, the autoscaler's
    signal and its decisions, by InferenceService."""

    desired: Gauge
    signal: Gauge
    decisions: Counter

    @classmethod
    def of(cls, prefix: str, pods: str, autoscaler: str) -> ScalingSeries:
        def first_up(text: str) -> str:
            return text[:1].upper() + text[1:]

        return cls(
            Gauge(f"{prefix}desired_replicas", f"{first_up(pods)} the operator wants for an InferenceService.",
                  ["namespace", "name"], registry=REGISTRY),
            Gauge(f"{prefix}autoscaling_signal", f"Mean per pod of the metric the {autoscaler} scales on.",
                  ["namespace", "name", "metric"], registry=REGISTRY),
            Counter(f"{prefix}autoscaling_decisions_total",
                    f"{first_up(autoscaler)} decisions that changed {pods}, by direction.",
                    ["namespace", "name", "direction"], registry=REGISTRY),
        )


# The replicas (the Service's pods), and with spec.disaggregation.prefill.replicas the prefill pods:
# series of their own with the same labels, so that what reads the replicas' (the chart's
# dashboard) reads what it always did.
REPLICAS = ScalingSeries.of("pagoda_operator_", "replicas", "autoscaler")
PREFILL = ScalingSeries.of("pagoda_operator_prefill_", "prefill pods", "prefill autoscaler")
# What starts a reconcile pass (handlers.py): kopf's reasons, the ticker, the children's events.
TRIGGERS = ("create", "update", "resume", "timer", "deployment", "statefulset", "leaderworkerset", "pod")
for _trigger in TRIGGERS:  # every error series exists from the start, at 0: rate() over it is 0, not "no data"
    ERRORS.labels(_trigger)
DIRECTIONS = ("up", "down")

LEADER = Gauge("pagoda_operator_leader", "1 while this replica holds the leader lease.", registry=REGISTRY)


class Heartbeats:
    """Named heartbeats, each with the silence after which it counts as stuck. None are
    registered until the operator's loops start, so a standby replica waiting for the lease is
    healthy; a beat registered by ``expect`` starts fresh."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._allowed: dict[str, float] = {}

    def expect(self, name: str, within_s: float) -> None:
        with self._lock:
            self._allowed[name] = within_s
            self._last[name] = self.clock()

    def beat(self, name: str) -> None:
        with self._lock:
            self._last[name] = self.clock()

    def forget(self, name: str) -> None:
        with self._lock:
            self._allowed.pop(name, None)
            self._last.pop(name, None)

    def stale(self) -> list[str]:
        """One line per heartbeat silent for longer than it may be."""
        now = self.clock()
        with self._lock:
            return [f"{name}: no heartbeat for {now - self._last[name]:.0f} s (allowed {allowed:.0f} s)"
                    for name, allowed in sorted(self._allowed.items()) if now - self._last[name] > allowed]


HEARTBEATS = Heartbeats()


def app(heartbeats: Heartbeats = HEARTBEATS, registry: CollectorRegistry = REGISTRY) -> Callable[..., Iterable[bytes]]:
    """WSGI: ``/healthz`` from the heartbeats, every other path the Prometheus exposition."""
    metrics = make_wsgi_app(registry)

    def handle(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/healthz":
            return metrics(environ, start_response)
        stale = heartbeats.stale()
        body = json.dumps({"status": "stuck", "stale": stale} if stale else {"status": "ok"}).encode()
        start_response("503 Service Unavailable" if stale else "200 OK",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return handle


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not worth a line
        pass


def serve(port: int, addr: str = "0.0.0.0", heartbeats: Heartbeats = HEARTBEATS) -> WSGIServer:
    """Start /metrics and /healthz in a background thread; the server (``.server_port``)."""
    server = make_server(addr, port, app(heartbeats), _ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="pagoda-metrics", daemon=True).start()
    return server


def autoscaled(namespace: str, name: str, series: ScalingSeries = REPLICAS) -> None:
    """An InferenceService the autoscaler looks after: its decision series exist from now on, at 0
    until a decision, so that a dashboard's increase() over them reads 0 rather than no data."""
    for direction in DIRECTIONS:
        series.decisions.labels(namespace, name, direction)


def forget(namespace: str, name: str, every: Iterable[ScalingSeries] = (REPLICAS, PREFILL)) -> None:
    """Drop the per-object series of a deleted InferenceService (or of the pods it no longer has)."""
    for series in every:
        with contextlib.suppress(KeyError):
            series.desired.remove(namespace, name)
        for direction in DIRECTIONS:
            with contextlib.suppress(KeyError):
                series.decisions.remove(namespace, name, direction)
        for metric in ("kvCacheUsage", "requestsWaiting", "requestsRunning"):
            with contextlib.suppress(KeyError):
                series.signal.remove(namespace, name, metric)
