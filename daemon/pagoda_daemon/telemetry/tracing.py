"""OpenTelemetry request tracing: one span per request, exported over OTLP, gRPC or HTTP
(protobuf), as the standard variables or the endpoint's port say (:func:`otlp_protocol`).

`RequestTracer.from_config` returns None when tracing is off, and the server then skips
every tracing call (`if tracer is not None`), so a daemon without tracing does no tracer
work per request and never imports the OpenTelemetry SDK: it is imported lazily, only when
tracing is on.

Each tracer owns its `TracerProvider` (the global one is never touched), so one process can
hold several (tests do). Spans go through a `BatchSpanProcessor`: ending a span only queues
it; a background thread exports batches; `shutdown()` flushes.

The span follows the OpenTelemetry GenAI semantic conventions; docs/tracing.md lists the
attributes, the events and the configuration.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

DEFAULT_TRACES_PATH = "/v1/traces"
GRPC, HTTP_PROTOBUF = "grpc", "http/protobuf"
# The port every OTLP peer (collectors, Jaeger, Tempo, vLLM's default) serves gRPC on; 4318 is HTTP.
OTLP_GRPC_PORT = 4317
_TRACE_HEADERS = ("traceparent", "tracestate")


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def otlp_protocol(endpoint: str | None) -> str:
    """``grpc`` or ``http/protobuf``: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
    OTEL_EXPORTER_OTLP_PROTOCOL, else gRPC for an endpoint on port 4317 (`--otlp-traces-endpoint`
    or the endpoint variables) and HTTP otherwise. ``http/json`` is exported as protobuf."""
    protocol = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")).lower()
    if protocol in (GRPC, HTTP_PROTOBUF):
        return protocol
    if protocol:
        logger.warning("OTLP protocol %r is not one Pagoda exports; using %s", protocol, HTTP_PROTOBUF)
        return HTTP_PROTOBUF
    target = endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")
    if target:
        try:
            port = urlsplit(_with_scheme(target)).port
        except ValueError:
            port = None
        if port == OTLP_GRPC_PORT:
            return GRPC
    return HTTP_PROTOBUF


def _with_scheme(endpoint: str) -> str:
    """`collector:4318` -> `http://collector:4318` (no scheme means plain HTTP, no TLS)."""
    endpoint = endpoint.strip()
    return endpoint if "://" in endpoint else "http://" + endpoint


def normalize_traces_endpoint(endpoint: str) -> str:
    """`collector:4318` -> `http://collector:4318/v1/traces`; a URL with a path is kept as given."""
    endpoint = _with_scheme(endpoint)
    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + DEFAULT_TRACES_PATH
    return endpoint


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """Look a header up case-insensitively (Starlette's Headers already are; a plain dict may not be)."""
    value = headers.get(name)
    if value is None:
        for key, v in headers.items():
            if key.lower() == name:
                return v
    return value


class SpanHandle:
    """One request's span. `event` marks lifecycle points; `end` closes the span once.

    Times are wall-clock seconds since the epoch (`time.time()`), so timestamps taken in
    the engine process can be passed in and land on the same clock as the span.
    """

    __slots__ = ("_ended", "_marks", "_span", "_start")

    def __init__(self, span: Any, start: float) -> None:
        self._span = span
        self._start = start
        self._marks: dict[str, float] = {}
        self._ended = False

    @property
    def trace_id(self) -> int:
        return self._span.get_span_context().trace_id

    @property
    def span_id(self) -> int:
        return self._span.get_span_context().span_id

    def event(self, name: str, attributes: dict | None = None, timestamp: float | None = None) -> None:
        """Add an event ("queued", "scheduled", "first_token", ...) at `timestamp` (default: now)."""
        if self._ended:
            return
        t = time.time() if timestamp is None else timestamp
        self._marks.setdefault(name, t)  # the first "scheduled" counts (preemption may repeat it)
        self._span.add_event(name, _clean(attributes) if attributes else None, timestamp=int(t * 1e9))

    def end(
        self,
        finish_reason: str | Sequence[str] | None,
        input_tokens: int,
        output_tokens: int,
        error: str | None = None,
        end_time: float | None = None,
    ) -> None:
        """Set usage, finish reasons and latencies, mark an error if any, and end the span.
        Calling it again does nothing.

        `finish_reason` is one reason, a comma-separated string of them, or a sequence (one
        per choice when n > 1); empty entries are dropped."""
        if self._ended:
            return
        self._ended = True
        t_end = time.time() if end_time is None else end_time
        attrs: dict[str, Any] = {
            "gen_ai.usage.input_tokens": int(input_tokens),
            "gen_ai.usage.output_tokens": int(output_tokens),
            "gen_ai.latency.e2e": max(t_end - self._start, 0.0),
        }
        reasons = _finish_reasons(finish_reason)
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = reasons
        marks = self._marks
        if "first_token" in marks:
            attrs["gen_ai.latency.time_to_first_token"] = max(marks["first_token"] - self._start, 0.0)
        if "scheduled" in marks:
            attrs["gen_ai.latency.time_in_queue"] = max(
                marks["scheduled"] - marks.get("queued", self._start), 0.0
            )
        self._span.set_attributes(attrs)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_attribute("error.type", "_OTHER")
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end(end_time=int(t_end * 1e9))


def _finish_reasons(finish_reason: str | Sequence[str] | None) -> list[str]:
    if finish_reason is None:
        return []
    items = finish_reason.split(",") if isinstance(finish_reason, str) else finish_reason
    return [r.strip() for r in items if r and r.strip()]


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry rejects None values: drop them."""
    return {k: v for k, v in attributes.items() if v is not None}


class RequestTracer:
    """Starts request spans on a private TracerProvider with an OTLP exporter."""

    def __init__(self, exporter: Any, service_name: str = "pagoda") -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win over our default name.
        attributes = {} if _env("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
        # The sampler comes from OTEL_TRACES_SAMPLER; the default honours the parent's
        # sampled flag (parentbased_always_on).
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagoda_daemon.telemetry")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER

    @classmethod
    def from_config(
        cls, otlp_traces_endpoint: str | None, service_name: str = "pagoda"
    ) -> RequestTracer | None:
        """The tracer the daemon's settings ask for, or None when tracing is off.

        On when `otlp_traces_endpoint` is given (`--otlp-traces-endpoint`), or else when the
        environment names an OTLP endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
        OTEL_EXPORTER_OTLP_ENDPOINT) or sets OTEL_TRACES_EXPORTER=otlp, unless
        OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true.
        """
        endpoint: str | None = None
        if otlp_traces_endpoint:
            endpoint = normalize_traces_endpoint(otlp_traces_endpoint)
        else:
            if _env("OTEL_SDK_DISABLED").lower() == "true":
                return None
            exporters = {e.strip().lower() for e in _env("OTEL_TRACES_EXPORTER").split(",") if e.strip()}
            if "none" in exporters:
                return None
            if exporters - {"otlp"}:
                logger.warning(
                    "OTEL_TRACES_EXPORTER=%s: Pagoda only exports OTLP", _env("OTEL_TRACES_EXPORTER")
                )
            has_env_endpoint = bool(
                _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")
            )
            if not has_env_endpoint and "otlp" not in exporters:
                return None
            # endpoint stays None: the exporter resolves the OTEL_* variables itself
            # (endpoint, headers, certificates, compression, timeout).
        protocol = otlp_protocol(otlp_traces_endpoint)
        try:
            if protocol == GRPC:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )

                # An http:// endpoint means no TLS, https:// TLS; None: the exporter reads the variables.
                target = _with_scheme(otlp_traces_endpoint) if otlp_traces_endpoint else None
                return cls(GrpcExporter(endpoint=target), service_name=service_name)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                f"tracing over OTLP {protocol} is configured but its OpenTelemetry packages are missing: pip install "
                "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-grpc"
            ) from e
        return cls(OTLPSpanExporter(endpoint=endpoint), service_name=service_name)

    def start_request_span(
        self,
        headers: Mapping[str, str],
        request_id: str,
        attributes: dict,
        start_time: float | None = None,
    ) -> SpanHandle:
        """Start the request's span, child of the W3C `traceparent` in `headers` if there is one.

        `attributes` holds GenAI keys (gen_ai.request.model, gen_ai.request.max_tokens,
        gen_ai.request.temperature, gen_ai.request.top_p, gen_ai.operation.name (default
        "chat"), ...); None values are dropped. The span is named "{operation} {model}".
        `start_time` (epoch seconds) defaults to now.
        """
        carrier = {}
        for name in _TRACE_HEADERS:
            value = _header(headers, name)
            if value is not None:
                carrier[name] = value
        parent = self._propagator.extract(carrier) if carrier else None
        attrs = _clean(attributes)
        operation = attrs.setdefault("gen_ai.operation.name", "chat")
        model = attrs.get("gen_ai.request.model")
        attrs["gen_ai.response.id"] = request_id
        start = time.time() if start_time is None else start_time
        span = self._tracer.start_span(
            f"{operation} {model}" if model else str(operation),
            context=parent,
            kind=self._kind,
            attributes=attrs,
            start_time=int(start * 1e9),
        )
        return SpanHandle(span, start)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export every ended span still queued, then stop the exporter thread."""
        self._provider.shutdown()
