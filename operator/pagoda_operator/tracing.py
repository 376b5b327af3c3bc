"""The operator's reconcile passes as OpenTelemetry spans, under one trace per rollout.

A rollout is one generation of one InferenceService, from the first pass that sees it to the
pass that finds it Ready. Its trace id and its root span's id are derived from the object's uid
and the generation, so every pass (on any replica of the operator, after any restart) files its
span under the same trace without storing anything; the root span itself, ``rollout``, is
exported when the generation becomes Ready, spanning the time from the first pass that saw it
(``metadata.creationTimestamp`` for generation 1 after an operator restart).

Off unless an OTLP endpoint is configured by the standard variables
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``); the protocol is
``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` (``grpc``, the default, or ``http/protobuf``).
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from pagoda_operator.autoscaler import from_iso
from pagoda_operator.status import condition

log = logging.getLogger(__name__)

SERVICE_NAME = "pagoda-operator"
MAX_ROLLOUTS = 10_000  # rollouts in progress remembered (their first pass's time)
_FIXED_IDS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("pagoda_fixed_ids", default=None)


def rollout_ids(uid: str, generation: int) -> tuple[int, int]:
    """(trace id, root span id) of a rollout: the same in every process, never zero."""
    digest = hashlib.sha256(f"{uid}/{generation}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


class _RolloutIds(IdGenerator):
    """Random ids, except for the span a rollout's fixed ids are asked for (``_FIXED_IDS``)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_trace_id(self) -> int:
        fixed = _FIXED_IDS.get()
        return fixed[0] if fixed else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        fixed = _FIXED_IDS.get()
        return fixed[1] if fixed else self._random.generate_span_id()


def _exporter_from_env(env: Mapping[str, str]) -> SpanExporter | None:
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()  # reads the endpoint, headers and TLS settings from the same variables
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r}: the operator speaks grpc or http/protobuf")


def _iso_seconds(stamp: str | None) -> float | None:
    try:
        return from_iso(stamp) if stamp else None
    except ValueError:
        return None


def _ready(status: Mapping[str, Any] | None) -> bool:
    return (condition(status, "Ready") or {}).get("status") == "True"


class OperatorTracer:
    """One span per reconcile pass (``reconcile``), filed under its rollout's trace, and the
    rollout's root span when the generation becomes Ready."""

    def __init__(self, exporter: SpanExporter, service_name: str = SERVICE_NAME) -> None:
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        id_generator=_RolloutIds())
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagoda.operator")
        self._first_seen: dict[tuple[str, int], float] = {}  # rollouts in progress: when a pass first saw them
        self._guard = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorTracer | None:
        exporter = _exporter_from_env(env)
        return cls(exporter) if exporter is not None else None

    def reconciled(self, namespace: str, name: str, trigger: str, started_s: float, ended_s: float,
                   body: Mapping[str, Any], status: Mapping[str, Any], wrote: list[str]) -> None:
        """A pass over ``body`` (the InferenceService as it read it) ended with ``status``."""
        meta = body.get("metadata") or {}
        uid, generation = str(meta.get("uid") or ""), int(meta.get("generation") or 1)
        if not uid:
            return
        trace_id, root_id = rollout_ids(uid, generation)
        attributes: dict[str, Any] = {"k8s.namespace.name": namespace, "pagoda.inferenceservice": name,
                      "pagoda.generation": generation, "pagoda.trigger": trigger, "pagoda.wrote": wrote,
                      "pagoda.ready": _ready(status)}
        parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
            trace_id, root_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        span = self._tracer.start_span("reconcile", context=parent, kind=SpanKind.INTERNAL,
                                       attributes=attributes, start_time=int(started_s * 1e9))
        span.end(end_time=int(ended_s * 1e9))
        key = (uid, generation)
        with self._guard:
            first = self._first_seen.setdefault(key, started_s)
            while len(self._first_seen) > MAX_ROLLOUTS:  # objects deleted before Ready: forget the oldest
                del self._first_seen[next(iter(self._first_seen))]
            became_ready = _ready(status) and not _ready(body.get("status"))
            if became_ready:
                del self._first_seen[key]
            for stale in [k for k in self._first_seen if k[0] == uid and k[1] < generation]:
                del self._first_seen[stale]  # a newer generation supersedes an unfinished rollout
        if not became_ready:
            return
        created = _iso_seconds(meta.get("creationTimestamp")) if generation == 1 else None
        start = min(first, created) if created is not None else first
        token = _FIXED_IDS.set((trace_id, root_id))
        try:
            root = self._tracer.start_span(
                "rollout", context=trace.set_span_in_context(trace.INVALID_SPAN), kind=SpanKind.INTERNAL,
                attributes={**attributes, "pagoda.trigger": "ready"}, start_time=int(start * 1e9))
        finally:
            _FIXED_IDS.reset(token)
        root.end(end_time=int(ended_s * 1e9))

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()
