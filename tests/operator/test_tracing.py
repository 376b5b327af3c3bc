"""The operator's reconcile passes as OTLP spans, received by a real OTLP/HTTP and OTLP/gRPC
receiver on loopback: every pass of a generation under one trace, whose root span (`rollout`)
arrives when the generation becomes Ready, and a new generation under a trace of its own."""

from __future__ import annotations

import pytest

from pagoda_operator.reconcile import reconcile
from pagoda_operator.tracing import OperatorTracer, rollout_ids
from tests.operator.operator_fakes import isvc
from tests.operator.test_reconcile import Clock, edit, make, settle
from tests.telemetry.test_tracing import GrpcReceiver, Receiver, attrs


@pytest.fixture(params=["http/protobuf", "grpc"])
def otlp(request, monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    receiver = Receiver() if request.param == "http/protobuf" else GrpcReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", request.param)
    yield receiver
    receiver.close()


def test_passes_of_a_rollout_share_its_trace_and_its_root_arrives_at_ready(fake_kube, otlp):
    import os

    tracer = OperatorTracer.from_env(os.environ)
    assert tracer is not None
    clock = Clock()
    ctx = make(fake_kube, clock=clock)
    ctx.tracer = tracer
    fake_kube.put(isvc(replicas=1))
    reconcile(ctx, "default", "llama", "create")
    clock.t += 4.0
    reconcile(ctx, "default", "llama", "timer")  # still starting
    clock.t += 3.0
    settle(fake_kube)
    reconcile(ctx, "default", "llama", "deployment")  # Ready
    clock.t += 1.0
    reconcile(ctx, "default", "llama", "timer")  # Ready already: no second root
    edit(fake_kube, engine={"blockSize": 32})
    reconcile(ctx, "default", "llama", "update")  # generation 2: another trace
    assert tracer.force_flush()
    tracer.shutdown()

    spans = [(resource, span) for resource, span in otlp.spans()]
    assert {r["service.name"] for r, _ in spans} == {"pagoda-operator"}
    trace_1, root_1 = rollout_ids("uid-llama", 1)
    trace_2, _ = rollout_ids("uid-llama", 2)
    first = [s for _, s in spans if int.from_bytes(s.trace_id, "big") == trace_1]
    passes = [s for s in first if s.name == "reconcile"]
    (root,) = [s for s in first if s.name == "rollout"]
    assert [attrs(s.attributes)["pagoda.trigger"] for s in sorted(passes, key=lambda s: s.start_time_unix_nano)] \
        == ["create", "timer", "deployment", "timer"]
    assert all(int.from_bytes(s.parent_span_id, "big") == root_1 for s in passes)
    assert int.from_bytes(root.span_id, "big") == root_1 and not root.parent_span_id
    # from the first pass that saw generation 1 to the pass that found it Ready: 7 s of the clock
    assert root.end_time_unix_nano - root.start_time_unix_nano == pytest.approx(7e9, abs=1e6)
    assert attrs(root.attributes)["pagoda.ready"] is True
    second = [s for _, s in spans if int.from_bytes(s.trace_id, "big") == trace_2]
    assert [s.name for s in second] == ["reconcile"] and attrs(second[0].attributes)["pagoda.generation"] == 2


def test_tracing_is_off_without_an_endpoint_and_refuses_an_unknown_protocol():
    assert OperatorTracer.from_env({}) is None
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        OperatorTracer.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                                 "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})
