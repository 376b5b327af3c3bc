"""RequestTracer against real OTLP receivers on loopback, over HTTP (protobuf) and gRPC: the
exported span has the incoming traceparent's trace id and parent, the GenAI attributes and the
lifecycle events."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from pagoda_daemon.telemetry.tracing import RequestTracer, normalize_traces_endpoint, otlp_protocol

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
OTEL_VARS = [
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
]


class Receiver:
    """A minimal OTLP/HTTP trace receiver: POST /v1/traces with a protobuf body."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.paths.append(self.path)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                msg = ExportTraceServiceRequest()
                msg.ParseFromString(body)
                receiver.requests.append(msg)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received."""
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                resource = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    out.extend((resource, span) for span in ss.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class GrpcReceiver:
    """An OTLP/gRPC trace receiver: the collector's TraceService on a grpcio server."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self.requests: list[ExportTraceServiceRequest] = []
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.requests.append(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.base_url = f"http://127.0.0.1:{self.port}"

    spans = Receiver.spans

    def close(self) -> None:
        self.server.stop(grace=None)


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind)


def attrs(kvs) -> dict:
    return {kv.key: value(kv.value) for kv in kvs}


@pytest.fixture
def clean_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_span_exported_with_parent_attributes_and_events(clean_env, receiver):
    tracer = RequestTracer.from_config(receiver.base_url, service_name="pagoda-test")
    assert tracer is not None
    t0 = time.time()
    # Header names as a client may spell them; the lookup is case-insensitive.
    headers = {"Traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=abc", "x-other": "1"}
    span = tracer.start_request_span(
        headers,
        "chatcmpl-123",
        {
            "gen_ai.request.model": "tiny-llama",
            "gen_ai.request.max_tokens": 16,
            "gen_ai.request.temperature": 0.7,
            "gen_ai.request.top_p": 0.9,
            "gen_ai.request.seed": None,  # dropped, not an error
        },
        start_time=t0,
    )
    assert f"{span.trace_id:032x}" == TRACE_ID
    span.event("queued", timestamp=t0 + 0.001)
    span.event("scheduled", {"num_computed_tokens": 0}, timestamp=t0 + 0.011)
    span.event("first_token", timestamp=t0 + 0.051)
    span.end("stop", input_tokens=7, output_tokens=16, end_time=t0 + 0.251)
    span.end("length", 0, 0)  # a second end is ignored

    # A request without traceparent starts its own trace; an error is marked on the span.
    root = tracer.start_request_span({}, "cmpl-9", {"gen_ai.operation.name": "text_completion"})
    root.end(None, input_tokens=3, output_tokens=0, error="engine process died")
    tracer.shutdown()  # flushes the batch processor

    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    spans = {s.name: (res, s) for res, s in receiver.spans()}
    assert set(spans) == {"chat tiny-llama", "text_completion"}

    resource, s = spans["chat tiny-llama"]
    assert resource["service.name"] == "pagoda-test"
    assert s.trace_id.hex() == TRACE_ID
    assert s.parent_span_id.hex() == PARENT_ID
    assert s.trace_state == "vendor=abc"
    assert s.kind == s.SPAN_KIND_SERVER
    a = attrs(s.attributes)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "tiny-llama"
    assert a["gen_ai.request.max_tokens"] == 16
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.response.id"] == "chatcmpl-123"
    assert a["gen_ai.usage.input_tokens"] == 7
    assert a["gen_ai.usage.output_tokens"] == 16
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.010, abs=1e-4)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.051, abs=1e-4)
    assert a["gen_ai.latency.e2e"] == pytest.approx(0.251, abs=1e-4)
    assert "gen_ai.request.seed" not in a
    assert [e.name for e in s.events] == ["queued", "scheduled", "first_token"]
    assert attrs(s.events[1].attributes) == {"num_computed_tokens": 0}
    assert s.events[2].time_unix_nano - s.start_time_unix_nano == pytest.approx(51_000_000, abs=1000)
    assert s.end_time_unix_nano - s.start_time_unix_nano == pytest.approx(251_000_000, abs=1000)
    assert s.status.code == s.status.STATUS_CODE_UNSET

    _, e = spans["text_completion"]
    assert len(e.parent_span_id) == 0
    assert e.trace_id.hex() != TRACE_ID
    assert e.status.code == e.status.STATUS_CODE_ERROR
    assert e.status.message == "engine process died"
    ea = attrs(e.attributes)
    assert ea["gen_ai.response.id"] == "cmpl-9"
    assert ea["error.type"] == "_OTHER"
    assert "gen_ai.response.finish_reasons" not in ea


def test_off_unless_configured(clean_env):
    assert RequestTracer.from_config(None) is None
    assert RequestTracer.from_config("") is None
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert RequestTracer.from_config(None) is None
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    assert RequestTracer.from_config(None) is None


def test_environment_turns_it_on(clean_env, receiver):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)  # the exporter appends /v1/traces
    clean_env.setenv("OTEL_SERVICE_NAME", "from-env")
    tracer = RequestTracer.from_config(None, service_name="pagoda")
    assert tracer is not None
    tracer.start_request_span({}, "r1", {"gen_ai.request.model": "m"}).end("stop,length", 1, 2)
    tracer.shutdown()
    ((resource, span),) = receiver.spans()
    assert span.name == "chat m"
    assert resource["service.name"] == "from-env"
    # n > 1: one finish reason per choice, given comma-joined (or as a list).
    assert attrs(span.attributes)["gen_ai.response.finish_reasons"] == ["stop", "length"]


def test_explicit_endpoint_wins_over_exporter_none(clean_env):
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    tracer = RequestTracer.from_config("127.0.0.1:9")
    assert tracer is not None
    tracer.shutdown()


def test_normalize_traces_endpoint():
    assert normalize_traces_endpoint("collector:4318") == "http://collector:4318/v1/traces"
    assert normalize_traces_endpoint("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert normalize_traces_endpoint("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


def test_importing_telemetry_is_light():
    """The SDK loads only when tracing is on; nothing here pulls torch."""
    code = (
        "import sys\n"
        "import pagoda_daemon.telemetry.tracing, pagoda_daemon.telemetry.metrics, pagoda_daemon.telemetry.kv_events\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy', 'opentelemetry'})\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture
def grpc_receiver():
    r = GrpcReceiver()
    yield r
    r.close()


def test_span_exported_over_grpc(clean_env, grpc_receiver):
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    tracer = RequestTracer.from_config(grpc_receiver.base_url, service_name="pagoda-grpc")
    assert tracer is not None
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    tracer.start_request_span(headers, "cmpl-1", {"gen_ai.request.model": "m"}).end("stop", 3, 4)
    tracer.shutdown()
    ((resource, span),) = grpc_receiver.spans()
    assert resource["service.name"] == "pagoda-grpc" and span.name == "chat m"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert attrs(span.attributes)["gen_ai.usage.output_tokens"] == 4


@pytest.mark.parametrize("env, endpoint, want", [
    ({}, "http://collector:4317", "grpc"),  # the port everyone serves gRPC on
    ({}, "collector:4317", "grpc"),
    ({}, "http://collector:4318", "http/protobuf"),
    ({}, None, "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, None, "grpc"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http://collector:4317", "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http://collector:4318", "grpc"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, None, "grpc"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, None, "http/protobuf"),  # warned, then protobuf
    ({}, "http://collector:notaport", "http/protobuf"),
])
def test_protocol_from_the_variables_or_the_port(clean_env, env, endpoint, want):
    for name, v in env.items():
        clean_env.setenv(name, v)
    assert otlp_protocol(endpoint) == want


def test_pagoda_serve_exports_over_grpc_to_port_4317_style_endpoints(clean_env, grpc_receiver, tiny_models,
                                                                      tmp_path):
    """The daemon's own process, as the example InferenceService configures it (an endpoint and
    the protocol variable): the request's span reaches the gRPC receiver under the caller's trace."""
    import httpx

    from tests.server.conftest import MODEL_NAME, ServerProcess

    srv = ServerProcess(tiny_models["qwen3"], "--otlp-traces-endpoint", grpc_receiver.base_url, log_dir=tmp_path,
                        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    try:
        srv.wait_ready()
        resp = httpx.post(srv.url + "/v1/completions", timeout=60,
                          headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                          json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert resp.status_code == 200
    finally:
        assert srv.stop() == 0  # flushes the batch of spans
    spans = [s for _, s in grpc_receiver.spans()]
    assert [s.trace_id.hex() for s in spans] == [TRACE_ID] and spans[0].parent_span_id.hex() == PARENT_ID
