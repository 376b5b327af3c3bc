"""The operator's own Prometheus metrics, served by ``--metrics-port`` (also answers /healthz)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
    "Requests to the Kubernetes API server (reads served by the watch cache are not), by HTTP method.",
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
DECISIONS = Counter(
    "pagoda_operator_autoscaling_decisions_total",
    "Autoscaler decisions that changed replicas, by direction.",
    ["namespace", "name", "direction"],
    registry=REGISTRY,
)
DESIRED = Gauge(
    "pagoda_operator_desired_replicas",
    "Replicas the operator wants for an InferenceService.",
    ["namespace", "name"],
    registry=REGISTRY,
)
SIGNAL = Gauge(
    "pagoda_operator_autoscaling_signal",
    "Mean per pod of the metric the autoscaler scales on.",
    ["namespace", "name", "metric"],
    registry=REGISTRY,
)
# What starts a reconcile pass (handlers.py): kopf's reasons, the ticker, the children's events.
TRIGGERS = ("create", "update", "resume", "timer", "deployment", "statefulset", "pod")
for _trigger in TRIGGERS:  # every error series exists from the start, at 0: rate() over it is 0, not "no data"
    ERRORS.labels(_trigger)
DIRECTIONS = ("up", "down")

LEADER = Gauge("pagoda_operator_leader", "1 while this replica holds the leader lease.", registry=REGISTRY)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the metrics endpoint in a background thread (every path answers, so /healthz works)."""
    start_http_server(port, addr=addr, registry=REGISTRY)


def autoscaled(namespace: str, name: str) -> None:
    """An InferenceService the autoscaler looks after: its decision series exist from now on, at 0
    until a decision, so that a dashboard's increase() over them reads 0 rather than no data."""
    for direction in DIRECTIONS:
        DECISIONS.labels(namespace, name, direction)


def forget(namespace: str, name: str) -> None:
    """Drop the per-object series of a deleted InferenceService."""
    for gauge in (DESIRED,):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for direction in DIRECTIONS:
        with contextlib.suppress(KeyError):
            DECISIONS.remove(namespace, name, direction)
    for metric in ("kvCacheUsage", "requestsWaiting", "requestsRunning"):
        with contextlib.suppress(KeyError):
            SIGNAL.remove(namespace, name, metric)
