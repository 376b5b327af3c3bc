"""spec.disaggregation.prefill.autoscaling: the prefill pods' own autoscaler. The field (spec.autoscaling's
rule and dataclass, its refusals named, the CRD's bounds and the webhook), the starting size, and
whole passes whose prefill and decode engines are real HTTP servers on loopback serving /metrics:
the prefill queue sizes the prefill Deployment and not the replicas, a trough only after the down
window, silent pods counted as the replica autoscaler counts them, one decision, one Event, and no
write of a child when nothing changed."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from pagoda_operator import autoscaler, webhook
from pagoda_operator.admission import Policy
from pagoda_operator.builders import Settings
from pagoda_operator.handlers import keeps_time
from pagoda_operator.reconcile import Context, decide, reconcile
from pagoda_operator.spec import (
    AUTOSCALING_KEYS,
    DEFAULT_TARGETS,
    MAX_PREFILL_REPLICAS,
    MAX_STABILIZATION_S,
    METRICS,
    PREFILL_METRIC,
    Autoscaling,
    InvalidSpec,
    prefill_replicas,
)
from pagoda_operator.telemetry import REGISTRY, forget
from tests.operator.operator_fakes import FakeKube, every_capability, isvc, topology
from tests.operator.test_decide import NOW, observed
from tests.operator.test_disaggregation import ONE_GPU_EACH, parsed
from tests.operator.test_manifests import ISVC_CRD, validate
from tests.operator.test_model_sources import everyone_can, review_request
from tests.operator.test_reconcile import Clock, children_writes, settle, status

PREFILL_FIELD = "spec.disaggregation.prefill.autoscaling"


def prefill(**autoscaling: Any) -> dict[str, Any]:
    return {"kvDiskGiB": 2, "prefill": {"replicas": 1, "autoscaling": {"maxReplicas": 4, **autoscaling}}}


def rule_of(**autoscaling: Any) -> Autoscaling | None:
    return parsed(disaggregation=prefill(**autoscaling), **ONE_GPU_EACH).disaggregation.prefill.autoscaling


# ---- the field --------------------------------------------------------------------------------


def test_the_field_is_spec_autoscalings_rule_with_the_prefill_queue_by_default():
    assert rule_of() == Autoscaling(min_replicas=1, max_replicas=4, metric="requestsWaiting", target=2.0,
                                    tolerance=0.1, scale_up_window_s=0, scale_down_window_s=300)
    assert PREFILL_METRIC == "requestsWaiting" and DEFAULT_TARGETS[PREFILL_METRIC] == 2.0
    assert rule_of(minReplicas=2, maxReplicas=1024, metric="kvCacheUsage", target=0.7, tolerance=0,
                   scaleUpStabilizationSeconds=30, scaleDownStabilizationSeconds=3600) == Autoscaling(
        2, 1024, "kvCacheUsage", 0.7, 0.0, 30, 3600)
    assert rule_of(metric="requestsRunning") == Autoscaling(1, 4, "requestsRunning", 16.0)  # its default target
    assert rule_of(enabled=False) is None  # as spec.autoscaling: off, the fixed prefill.replicas
    # the replicas' autoscaler is the same dataclass, read from spec.autoscaling by the same rule
    s = parsed(autoscaling={"maxReplicas": 4, "metric": "requestsWaiting"}, disaggregation=prefill(),
               **ONE_GPU_EACH)
    assert s.autoscaling == s.disaggregation.prefill.autoscaling


@pytest.mark.parametrize("disaggregation, message", [
    ({"kvDiskGiB": 2, "prefill": {"autoscaling": {"maxReplicas": 4}}},
     f"{PREFILL_FIELD} needs spec.disaggregation.prefill.replicas"),
    ({"kvDiskGiB": 2, "prefill": {"replicas": 1}, "decode": {"autoscaling": {"maxReplicas": 4}}},
     "spec.disaggregation.decode.autoscaling is not set here: the decode engines are spec.replicas, autoscaled "
     "by spec.autoscaling"),
    (prefill(minReplicas=0), f"{PREFILL_FIELD}.minReplicas must be 1 to 1024; got 0"),
    (prefill(maxReplicas=1025), f"{PREFILL_FIELD}.maxReplicas must be 1 to 1024; got 1025"),
    (prefill(maxReplicas=None), f"{PREFILL_FIELD}.maxReplicas is required"),
    (prefill(minReplicas=3, maxReplicas=2), f"{PREFILL_FIELD}.minReplicas (3) is larger than maxReplicas (2)"),
    (prefill(maxReplicas="4"), f"{PREFILL_FIELD}.maxReplicas must be an integer, not str '4'"),
    (prefill(minReplicas=1.0), f"{PREFILL_FIELD}.minReplicas must be an integer, not float"),
    (prefill(metric="expertLoad"), f"{PREFILL_FIELD}.metric must be one of kvCacheUsage, requestsWaiting, "
                                   "requestsRunning; got 'expertLoad'"),
    (prefill(metric=["requestsWaiting"]), f"{PREFILL_FIELD}.metric must be one of"),
    (prefill(target=0), f"{PREFILL_FIELD}.target must be above 0; got 0"),
    (prefill(target=float("inf")), f"{PREFILL_FIELD}.target must be above 0; got inf"),
    (prefill(target="2"), f"{PREFILL_FIELD}.target must be a number, not str '2'"),
    (prefill(target=True), f"{PREFILL_FIELD}.target must be a number, not bool True"),
    (prefill(metric="kvCacheUsage", target=80), f"{PREFILL_FIELD}.target for kvCacheUsage is a fraction in (0, 1]"),
    (prefill(tolerance=1.5), f"{PREFILL_FIELD}.tolerance must be at least 0 and at most 1; got 1.5"),
    (prefill(scaleUpStabilizationSeconds=-1), f"{PREFILL_FIELD}.scaleUpStabilizationSeconds must be 0 to 3600; got -1"),
    (prefill(scaleDownStabilizationSeconds=3601),
     f"{PREFILL_FIELD}.scaleDownStabilizationSeconds must be 0 to 3600; got 3601"),
    (prefill(scaleDownStabilizationSeconds="5m"),
     f"{PREFILL_FIELD}.scaleDownStabilizationSeconds must be an integer, not str"),
    (prefill(enabled="yes"), f"{PREFILL_FIELD}.enabled must be true or false, not str 'yes'"),
    (prefill(behavior={}), f"{PREFILL_FIELD}.behavior is not a field"),
    ({"kvDiskGiB": 2, "prefill": {"replicas": 1, "autoscaling": 4}}, f"{PREFILL_FIELD} must be an object, not int"),
])
def test_a_wrong_type_bound_or_place_is_refused_naming_the_field(disaggregation, message):
    with pytest.raises(InvalidSpec) as e:
        parsed(disaggregation=disaggregation, **ONE_GPU_EACH)
    assert message in str(e.value)
    # and by the admission webhook at apply time, as invalid (422)
    spec = {"model": {"name": "m", "pvc": {"claimName": "w"}}, "disaggregation": disaggregation}
    out = webhook.decide(review_request(spec), Policy(), everyone_can)["response"]
    assert out["allowed"] is False and out["status"]["code"] == 422 and message in out["status"]["message"]


def test_the_webhook_admits_a_good_one():
    spec = {"model": {"name": "m", "pvc": {"claimName": "w"}}, "disaggregation": prefill(minReplicas=2)}
    assert webhook.decide(review_request(spec), Policy(), everyone_can)["response"]["allowed"] is True


@pytest.mark.parametrize("start, rule, autoscaled, expected", [
    (1, {"maxReplicas": 4}, None, 1),  # before the first decision: prefill.replicas
    (1, {"minReplicas": 2, "maxReplicas": 4}, None, 2),  # ... clamped to [min, max]
    (9, {"maxReplicas": 4}, None, 4),
    (1, {"maxReplicas": 4}, 3, 3),  # the autoscaler's count wins over prefill.replicas
    (1, {"maxReplicas": 2}, 3, 2),  # ... within the bounds the spec has now
    (3, None, 1, 3),  # no autoscaler: prefill.replicas
])
def test_the_prefill_pods_count(start, rule, autoscaled, expected):
    p = {"replicas": start, **({"autoscaling": rule} if rule else {})}
    s = parsed(disaggregation={"kvDiskGiB": 2, "prefill": p}, **ONE_GPU_EACH)
    assert prefill_replicas(s, autoscaled) == expected
    assert prefill_replicas(parsed(disaggregation={"kvDiskGiB": 2}, **ONE_GPU_EACH), 3) is None  # none apart


def test_the_ticker_steps_an_inferenceservice_with_a_prefill_autoscaler_only():
    assert keeps_time(isvc(disaggregation=prefill()))
    assert not keeps_time(isvc(disaggregation={"kvDiskGiB": 2, "prefill": {"replicas": 1}}))
    assert not keeps_time(isvc(disaggregation=[1]))  # malformed: the pass says why, not the ticker


def test_the_step_is_the_replica_autoscalers_rule_over_the_prefill_pods_and_their_history():
    """decide() alone (pure): the prefill step is autoscaler.evaluate over the prefill pods' samples,
    from the count and recommendations the status holds, and the replicas take no part in it."""
    then = NOW - 100
    body = isvc(replicas=2, disaggregation=prefill(scaleDownStabilizationSeconds=300), **ONE_GPU_EACH)
    body["status"] = {"disaggregation": {"prefill": {"autoscaling": {
        "desiredReplicas": 3, "recommendations": [{"time": autoscaler.to_iso(then), "replicas": 3}]}}}}
    samples = {"p0": {"requestsWaiting": 0.0}, "p1": {"requestsWaiting": 1.0}}
    d = decide(dataclasses.replace(observed(body, supports=every_capability), prefill_signals=samples),
               Settings(daemon_image="img:1"), NOW)
    rule = d.spec.disaggregation.prefill.autoscaling
    ev = autoscaler.evaluate(rule, 3, [0.0, 1.0], [(then, 3)], NOW)
    assert d.prefill_scale == (3, ev) and ev.desired == 3 and ev.reason == "ScaleDownStabilizing"
    assert d.prefill_replicas == 3 and d.children.prefill[1]["spec"]["replicas"] == 3
    assert d.prefill_autoscaling["desiredReplicas"] == 3 and d.replicas == 2 and d.scale is None
    # without this pass's scrape: no step, the count and state as the status left them
    d = decide(observed(body, supports=every_capability), Settings(daemon_image="img:1"), NOW)
    assert d.prefill_scale is None and d.prefill_replicas == 3
    assert d.prefill_autoscaling == body["status"]["disaggregation"]["prefill"]["autoscaling"]
    # a generation blocked (a valid spec no node can hold) takes no step and writes no child
    blocked = isvc(replicas=2, disaggregation=prefill(), resources={"gpusPerReplica": 8}, parallelism={"tensor": 4})
    d = decide(dataclasses.replace(observed(blocked, supports=every_capability, topologies=[topology("n", 4)]),
                                   prefill_signals=samples), Settings(daemon_image="img:1"), NOW)
    assert d.spec is not None and d.blocker is not None and "larger than any node" in d.blocker.message
    assert d.prefill_scale is None and d.children is None and d.prefill_replicas == 1


# ---- the CRD ------------------------------------------------------------------------------------


def crd_spec_and_status() -> tuple[dict[str, Any], dict[str, Any]]:
    (version,) = yaml.safe_load(ISVC_CRD.read_text())["spec"]["versions"]
    props = version["schema"]["openAPIV3Schema"]["properties"]
    return props["spec"]["properties"], props["status"]["properties"]


def test_the_crd_declares_spec_autoscalings_shape_with_the_operators_bounds():
    spec, status_ = crd_spec_and_status()
    ours = spec["disaggregation"]["properties"]["prefill"]["properties"]["autoscaling"]
    theirs = spec["autoscaling"]
    assert tuple(ours["properties"]) == AUTOSCALING_KEYS == tuple(theirs["properties"])
    assert ours["required"] == theirs["required"] == ["maxReplicas"]
    for key in ("minReplicas", "maxReplicas"):
        assert (ours["properties"][key]["minimum"], ours["properties"][key]["maximum"]) == (1, MAX_PREFILL_REPLICAS)
    for key in ("scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds"):
        assert ours["properties"][key]["maximum"] == MAX_STABILIZATION_S == theirs["properties"][key]["maximum"]
    assert ours["properties"]["metric"]["enum"] == list(METRICS)
    assert ours["properties"]["metric"]["default"] == PREFILL_METRIC
    for key in ("enabled", "target", "tolerance", "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds"):
        same = {k: v for k, v in ours["properties"][key].items() if k != "description"}
        assert same == {k: v for k, v in theirs["properties"][key].items() if k != "description"}, key
    assert all(node.get("description") for node in (ours, ours["properties"]["metric"]))
    # status: the same keys as status.autoscaling, so nothing the operator writes is pruned
    written = status_["disaggregation"]["properties"]["prefill"]["properties"]["autoscaling"]
    assert {k: v for k, v in written.items() if k != "description"} == status_["autoscaling"]


@pytest.mark.parametrize("autoscaling, fragment", [
    ({"maxReplicas": 1025}, ".autoscaling.maxReplicas: above maximum"),
    ({"maxReplicas": 4, "minReplicas": 0}, ".autoscaling.minReplicas: below minimum"),
    ({"maxReplicas": 4, "metric": "expertLoad"}, ".autoscaling.metric: 'expertLoad' not in"),
    ({"maxReplicas": 4, "scaleDownStabilizationSeconds": 3601}, ".scaleDownStabilizationSeconds: above maximum"),
    ({"minReplicas": 2}, ".autoscaling.maxReplicas: required"),
    ({"maxReplicas": 4, "behavior": {}}, ".autoscaling.behavior: unknown field"),
])
def test_the_api_server_refuses_what_the_schema_bounds(autoscaling, fragment):
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "x"},
            "spec": {"model": {"name": "m", "uri": "hf://a"},
                     "disaggregation": {"kvDiskGiB": 2, "prefill": {"replicas": 1, "autoscaling": autoscaling}}}}
    (version,) = yaml.safe_load(ISVC_CRD.read_text())["spec"]["versions"]
    errors = validate(body, version["schema"]["openAPIV3Schema"])
    assert any(fragment in e for e in errors), errors


# ---- whole passes against real /metrics -----------------------------------------------------------


class Daemons:
    """Real HTTP servers on loopback standing in for the engines: one per pod IP (127.0.0.x; a
    pod's port is its role's), each answering /metrics with the text set for it."""

    def __init__(self) -> None:
        self.servers: list[ThreadingHTTPServer] = []
        self.texts: dict[tuple[str, int], str] = {}
        self.hits: list[tuple[str, int, str]] = []

    def serve(self, ip: str, port: int = 0) -> int:
        daemons = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                key = self.server.server_address[:2]
                daemons.hits.append((*key, self.path))
                body = daemons.texts.get(key, "").encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer((ip, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        self.servers.append(server)
        return server.server_address[1]

    def waiting(self, ip: str, port: int, n: float) -> None:
        self.texts[(ip, port)] = (f'vllm:num_requests_waiting{{model_name="llama-3-8b"}} {n}\n'
                                  f'vllm:num_requests_running{{model_name="llama-3-8b"}} 1\n')

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    yield d
    d.close()
    forget("default", "llama")


DECODE_IP = "127.0.0.1"


def prefill_ip(i: int) -> str:
    return f"127.0.1.{i + 1}"


class Service:
    """An InferenceService with prefill pods apart: replicas (decode engine + proxy, at DECODE_IP on
    spec.port) autoscaled on requestsWaiting, prefill pods (at prefill_ip(i) on the prefill port)
    autoscaled on their own. ``up`` prefill daemons answer; the other pod IPs refuse connections."""

    def __init__(self, kube: FakeKube, daemons: Daemons, up: int = 4, start: int = 1, **rule: Any) -> None:
        self.kube, self.daemons, self.clock = kube, daemons, Clock()
        self.port = daemons.serve(DECODE_IP)
        self.prefill_port = daemons.serve(prefill_ip(0))
        for i in range(1, up):
            daemons.serve(prefill_ip(i), self.prefill_port)
        self.up = up
        daemons.waiting(DECODE_IP, self.port, 2)  # the replicas at their target: they stay
        kube.put(isvc(replicas=2, port=self.port, **ONE_GPU_EACH,
                      autoscaling={"maxReplicas": 8, "metric": "requestsWaiting", "target": 2},
                      disaggregation={"kvDiskGiB": 2, "prefill": {
                          "replicas": start, "port": self.prefill_port,
                          "autoscaling": {"maxReplicas": 6, "target": 2, "scaleDownStabilizationSeconds": 60,
                                          **rule}}}))
        self.ctx = self.context()
        reconcile(self.ctx, "default", "llama", "create")
        self.settle()

    def context(self) -> Context:
        """A fresh operator process: nothing in memory but what the status holds."""
        return Context(kube=self.kube, settings=Settings(daemon_image="img:1"), clock=self.clock,
                       supports=every_capability, scrape_timeout=2.0)

    def queue(self, n: float) -> None:
        """Every prefill daemon's queue."""
        for i in range(self.up):
            self.daemons.waiting(prefill_ip(i), self.prefill_port, n)

    def settle(self) -> None:
        """Play the Deployment controllers and kubelet: the replicas' and prefill pods Ready."""
        settle(self.kube)
        for key, pod in self.kube.objects.items():
            if key[0] == "Pod":
                pod["status"]["podIP"] = DECODE_IP
        d = self.kube.objects[("Deployment", "default", "llama-prefill")]
        labels = d["spec"]["template"]["metadata"]["labels"]
        for i in range(d["spec"]["replicas"]):
            self.kube.put({"kind": "Pod", "metadata": {"name": f"llama-prefill-{i}", "namespace": "default",
                                                       "labels": labels},
                           "spec": {"nodeName": "node-2"},
                           "status": {"podIP": prefill_ip(i), "containerStatuses": [{"name": "prefill", "ready": True}],
                                      "conditions": [{"type": "Ready", "status": "True"}]}})

    def tick(self, dt: float = 15) -> Any:
        """One ticker pass ``dt`` seconds on."""
        self.clock.t += dt
        self.kube.writes.clear()
        return reconcile(self.ctx, "default", "llama", "timer", autoscale=True)

    def replicas(self, name: str) -> int:
        return self.kube.objects[("Deployment", "default", name)]["spec"]["replicas"]

    def autoscaling(self) -> dict[str, Any]:
        return status(self.kube)["disaggregation"]["prefill"]["autoscaling"]


def sample(name: str, **labels: str) -> float | None:
    """The operator's own series ``name`` of default/llama."""
    return REGISTRY.get_sample_value(f"pagoda_operator_{name}", {"namespace": "default", "name": "llama", **labels})


def test_a_prefill_queue_above_target_scales_the_prefill_pods_and_not_the_replicas(fake_kube, daemons, caplog):
    svc = Service(fake_kube, daemons)
    assert svc.replicas("llama-prefill") == 1 and svc.autoscaling()["desiredReplicas"] == 1
    svc.queue(5)  # 2.5 times the target over the one prefill pod
    ups = sample("prefill_autoscaling_decisions_total", direction="up") or 0
    with caplog.at_level(logging.INFO, logger="pagoda_operator"):
        r = svc.tick()
    assert svc.replicas("llama-prefill") == 3 and svc.replicas("llama") == 2
    assert ("replace", "Deployment", "llama-prefill") in children_writes(fake_kube)
    assert ("replace", "Deployment", "llama") not in children_writes(fake_kube)
    line = "1 -> 3 replicas (ScaleUp): requestsWaiting 5 above target 2 over 1 pods"
    assert r.events == [("Normal", "Autoscaled", f"prefill: {line}")]
    assert [m for m in caplog.messages if m.startswith("autoscale")] == [f"autoscale default/llama prefill: {line}"]
    a = svc.autoscaling()
    assert a["desiredReplicas"] == 3 and a["reason"] == "ScaleUp" and a["value"] == 5
    assert a["metric"] == "requestsWaiting" and a["target"] == 2
    assert a["signals"] == {"pods": 1, "requestsWaiting": 5.0, "requestsRunning": 1.0}
    assert a["decisions"] == [{"time": autoscaler.to_iso(svc.clock.t), "from": 1, "to": 3, "metric": "requestsWaiting",
                               "reason": "ScaleUp", "target": 2, "value": 5}]
    assert a["lastScaleTime"] == a["decisions"][0]["time"]
    assert status(fake_kube)["disaggregation"]["prefill"]["replicas"] == 3
    assert status(fake_kube)["autoscaling"]["reason"] == "WithinTolerance"  # the replicas' own step
    assert sample("prefill_autoscaling_decisions_total", direction="up") == ups + 1
    assert sample("prefill_desired_replicas") == 3 and sample("desired_replicas") == 2
    assert sample("prefill_autoscaling_signal", metric="requestsWaiting") == 5
    assert sample("autoscaling_signal", metric="requestsWaiting") == 2  # the replicas'
    # the prefill daemons were read on the prefill port, the replicas' on theirs
    assert (prefill_ip(0), svc.prefill_port, "/metrics") in daemons.hits
    assert (DECODE_IP, svc.port, "/metrics") in daemons.hits
    assert {(ip, port) for ip, port, _ in daemons.hits} <= {(DECODE_IP, svc.port), (prefill_ip(0), svc.prefill_port)}

    # passes between ticks (a pod's event, a restarted operator) keep the autoscaler's count
    fake_kube.writes.clear()
    reconcile(svc.ctx, "default", "llama", "pod")
    reconcile(svc.context(), "default", "llama", "resume")
    assert fake_kube.writes == [] and svc.replicas("llama-prefill") == 3

    # the three pods up: their events' pass lists them for the proxies, and rolls no replica
    template = fake_kube.objects[("Deployment", "default", "llama")]["spec"]["template"]
    svc.settle()
    fake_kube.writes.clear()
    reconcile(svc.ctx, "default", "llama", "pod")
    assert children_writes(fake_kube) == [("replace", "ConfigMap", "llama-prefill-instances")]
    listed = fake_kube.objects[("ConfigMap", "default", "llama-prefill-instances")]["data"]["prefill"]
    assert listed == "".join(f"http://{prefill_ip(i)}:{svc.prefill_port}\n" for i in range(3))
    assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["template"] == template
    # at target: no child, no decision, no Event
    svc.queue(2)
    r = svc.tick()
    assert children_writes(fake_kube) == [] and r.events == []
    assert svc.autoscaling()["reason"] == "WithinTolerance" and len(svc.autoscaling()["decisions"]) == 1
    assert svc.autoscaling()["signals"]["pods"] == 3
    assert sample("prefill_autoscaling_decisions_total", direction="up") == ups + 1


def test_a_trough_scales_the_prefill_pods_down_only_after_the_down_window(fake_kube, daemons):
    svc = Service(fake_kube, daemons, start=3)
    svc.queue(2)
    svc.tick()  # at target: it recommends 3
    svc.queue(0.5)  # a quarter of the target over three pods: one would do
    for _ in range(4):  # 60 s down window: the highest recommendation in it is still 3
        r = svc.tick()
        assert svc.replicas("llama-prefill") == 3 and r.events == []
        assert children_writes(fake_kube) == []
    assert svc.autoscaling()["reason"] == "ScaleDownStabilizing"
    assert len(svc.autoscaling()["recommendations"]) == 5  # the one of the first pass (3), four of 1
    svc.ctx = svc.context()  # an operator restart: the window is in the status
    r = svc.tick(15.5)  # 61.5 s after the last recommendation of 3
    assert svc.replicas("llama-prefill") == 1 and svc.replicas("llama") == 2
    assert [e[2] for e in r.events] == [
        "prefill: 3 -> 1 replicas (ScaleDown): requestsWaiting 0.5 below target 2 over 3 pods"]
    assert [(d["from"], d["to"]) for d in svc.autoscaling()["decisions"]] == [(3, 1)]


def test_pods_that_did_not_answer_count_as_the_replica_autoscalers_rule_says(fake_kube, daemons):
    """One of three prefill pods answers (the others refuse connections): scaling up, the silent
    ones count as idle; scaling down, as at target."""
    svc = Service(fake_kube, daemons, up=1, start=3, scaleDownStabilizationSeconds=0)
    svc.queue(6)  # three times the target, but over 1 of 3 pods: (6 + 0 + 0) / (2 × 3) = 1
    r = svc.tick()
    assert svc.replicas("llama-prefill") == 3 and r.events == []
    a = svc.autoscaling()
    assert a["reason"] == "WithinTolerance" and "over 1/3 pods" in a["message"] and a["signals"]["pods"] == 1
    svc.queue(0)  # idle, over 1 of 3: (0 + 2 + 2) / (2 × 3) = 2/3 -> ceil(2) pods, not 1
    r = svc.tick()
    assert svc.replicas("llama-prefill") == 2
    assert [e[2] for e in r.events] == [
        "prefill: 3 -> 2 replicas (ScaleDown): requestsWaiting 0 below target 2 over 1 pods"]
    # no prefill pod answers: hold
    fake_kube.objects[("Pod", "default", "llama-prefill-0")]["status"]["conditions"][0]["status"] = "False"
    svc.tick()
    assert svc.replicas("llama-prefill") == 2 and svc.autoscaling()["reason"] == "NoMetrics"


def test_spec_edits_keep_the_count_within_the_new_bounds_and_removing_the_autoscaler_hands_back(fake_kube, daemons):
    svc = Service(fake_kube, daemons)
    svc.queue(8)
    svc.tick()
    assert svc.replicas("llama-prefill") == 4
    obj = fake_kube.objects[("InferenceService", "default", "llama")]
    obj["spec"]["disaggregation"]["prefill"]["autoscaling"]["target"] = 3  # a new generation: no reset
    obj["metadata"]["generation"] += 1
    reconcile(svc.ctx, "default", "llama", "update")
    assert svc.replicas("llama-prefill") == 4
    obj["spec"]["disaggregation"]["prefill"]["autoscaling"]["maxReplicas"] = 2
    obj["metadata"]["generation"] += 1
    reconcile(svc.ctx, "default", "llama", "update")
    assert svc.replicas("llama-prefill") == 2
    del obj["spec"]["disaggregation"]["prefill"]["autoscaling"]
    obj["metadata"]["generation"] += 1
    reconcile(svc.ctx, "default", "llama", "update")
    assert svc.replicas("llama-prefill") == 1  # prefill.replicas again
    assert "autoscaling" not in status(fake_kube)["disaggregation"]["prefill"]
    fake_kube.writes.clear()
    reconcile(svc.ctx, "default", "llama", "pod")
    assert fake_kube.writes == []  # the status without it was written once
    svc.queue(100)
    svc.tick()
    assert svc.replicas("llama-prefill") == 1


def test_the_prefill_series_are_their_own_and_go_with_the_object(fake_kube, daemons):
    svc = Service(fake_kube, daemons)
    svc.queue(2)
    svc.tick()
    text = generate_latest(REGISTRY).decode()
    for direction in ("up", "down"):
        assert (f'pagoda_operator_prefill_autoscaling_decisions_total{{direction="{direction}",name="llama",'
                f'namespace="default"}}') in text
    assert 'pagoda_operator_prefill_desired_replicas{name="llama",namespace="default"} 1.0' in text
    assert 'pagoda_operator_desired_replicas{name="llama",namespace="default"} 2.0' in text
    forget("default", "llama")
    assert not [line for line in generate_latest(REGISTRY).decode().splitlines()
                if 'name="llama",namespace="default"' in line]
