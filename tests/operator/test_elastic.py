"""Elastic EP, the operator's half: the decision from the scraped signals and the daemons'
/elastic_ep states (decide() is pure), the replica autoscaler waiting while the expert-parallel
size grows, the Scaling condition, the admin key, and the calls to a real HTTP server on loopback
that answers as the daemon's admin routes do."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from pagoda_operator import autoscaler, elastic
from pagoda_operator.builders import Settings
from pagoda_operator.reconcile import Context, Observed, apply, decide
from pagoda_operator.spec import parse
from tests.operator.operator_fakes import FakeKube, isvc

SETTINGS = Settings(daemon_image="img:1")
NOW = 1_800_000_000.0
ELASTIC = {"minExpert": 2, "maxExpert": 4, "metric": "requestsRunning", "target": 8,
           "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 60}


def body(**extra: Any) -> dict[str, Any]:
    return isvc(resources={"gpusPerReplica": 4}, parallelism={"expert": 2, "elastic": ELASTIC}, **extra)


def observed(b: dict[str, Any], running: list[float], sizes: list[int], phase: str = "done",
             previous_status: dict | None = None) -> Observed:
    meta = b["metadata"]
    if previous_status is not None:
        b = {**b, "status": previous_status}
    spec = parse(meta["name"], meta["namespace"], b["spec"])
    signals = {f"p{i}": {"requestsRunning": r, "expertParallel": sizes[i]} for i, r in enumerate(running)}
    states = {f"p{i}": {"size": s, "phase": phase, "target": s, "is_scaling": False} for i, s in enumerate(sizes)}
    pods = [{"metadata": {"name": f"p{i}"}, "status": {"podIP": "127.0.0.1"}} for i in range(len(sizes))]
    return Observed(b, spec, None, [], None, pods, {"ConfigMap": None, "Service": None}, signals, [],
                    elastic_states=states, admin_key="k")


def test_load_above_the_target_grows_the_expert_parallel_size_and_asks_every_pod():
    d = decide(observed(body(), running=[14, 14], sizes=[2, 2]), SETTINGS, NOW)
    assert d.elastic is not None and d.elastic["desiredExpertParallel"] == 4  # ceil(2 × 14/8)
    assert d.elastic["currentExpertParallel"] == 2 and d.elastic["reason"] == "ScaleUp"
    assert d.elastic["decisions"][-1] | {"time": None} == {"time": None, "from": 2, "to": 4, "reason": "ScaleUp",
                                                          "metric": "requestsRunning", "target": 8.0, "value": 14.0}
    assert d.resizes == [("p0", 4), ("p1", 4)]
    assert d.scaling is not None and d.scaling[:2] == ("True", "Resizing")
    assert d.expert_parallel == 2  # the size served now, not the one asked for


def test_the_expert_load_eplb_measures_sizes_the_group_it_divides():
    """expertLoad: the busiest rank's routed pairs per layer per step, which halves when the
    size doubles: the HPA's rule asks ceil(size × load / target). Elastic EP's choice only."""
    b = isvc(resources={"gpusPerReplica": 4},
             parallelism={"expert": 2, "elastic": {**ELASTIC, "metric": "expertLoad", "target": None}})
    meta = b["metadata"]
    spec = parse(meta["name"], meta["namespace"], b["spec"])
    assert spec.parallelism.elastic is not None and spec.parallelism.elastic.rule.target == 512.0
    signals = {f"p{i}": {"expertLoad": 900.0, "expertParallel": 2} for i in range(2)}
    states = {f"p{i}": {"size": 2, "phase": "done", "target": 2, "is_scaling": False} for i in range(2)}
    pods = [{"metadata": {"name": f"p{i}"}, "status": {"podIP": "127.0.0.1"}} for i in range(2)]
    o = Observed(b, spec, None, [], None, pods, {"ConfigMap": None, "Service": None}, signals, [],
                 elastic_states=states, admin_key="k")
    d = decide(o, SETTINGS, NOW)
    assert d.elastic is not None and d.elastic["desiredExpertParallel"] == 4  # ceil(2 × 900/512)
    with pytest.raises(ValueError, match=r"autoscaling\.metric must be one of"):
        parse("x", "default", isvc(autoscaling={"minReplicas": 1, "maxReplicas": 2, "metric": "expertLoad"})["spec"])


def test_a_pod_that_is_resizing_is_not_asked_again_and_the_condition_says_so():
    d = decide(observed(body(), running=[14], sizes=[2], phase="transferring"), SETTINGS, NOW)
    assert d.resizes == [] and d.scaling == ("True", "Resizing", "expert-parallel resize in progress on p0")


def test_a_failed_transition_is_reported_and_asked_again():
    o = observed(body(), running=[14], sizes=[2], phase="failed")
    assert o.elastic_states is not None
    o.elastic_states["p0"]["last_error"] = "RuntimeError: rank 2 died"
    d = decide(o, SETTINGS, NOW)
    assert d.scaling is not None and d.scaling[1] == "ResizeFailed" and "rank 2 died" in d.scaling[2]
    assert d.resizes == [("p0", 4)]
    assert d.elastic is not None and d.elastic["pods"] == [
        {"pod": "p0", "expertParallel": 2, "phase": "failed", "lastError": "RuntimeError: rank 2 died"}]


def test_idle_shrinks_only_after_the_down_window_and_never_below_min():
    busy = {"elastic": {"recommendations": [{"time": autoscaler.to_iso(NOW - 10), "size": 4}]}}
    first = decide(observed(body(), running=[0], sizes=[4], previous_status=busy), SETTINGS, NOW)
    assert first.elastic is not None and first.elastic["desiredExpertParallel"] == 4  # the window holds it
    assert first.elastic["reason"] == "ScaleDownStabilizing" and first.resizes == []
    later = decide(observed(body(), running=[0], sizes=[4], previous_status={"elastic": first.elastic}), SETTINGS,
                   NOW + 61)
    assert later.elastic is not None and later.elastic["desiredExpertParallel"] == 2  # bounded by minExpert
    assert later.resizes == [("p0", 2)]


def test_growth_goes_to_the_expert_parallel_size_before_the_replicas():
    auto = {"minReplicas": 1, "maxReplicas": 4, "metric": "requestsRunning", "target": 8}
    d = decide(observed(body(replicas=1, autoscaling=auto), running=[14], sizes=[2]), SETTINGS, NOW)
    assert d.scale is not None and d.scale[1].desired == 1 and d.scale[1].reason == "ElasticFirst"
    assert d.replicas == 1 and d.resizes == [("p0", 4)]
    at_max = decide(observed(body(replicas=1, autoscaling=auto), running=[14], sizes=[4]), SETTINGS, NOW)
    assert at_max.scale is not None and at_max.scale[1].desired == 2  # every replica at maxExpert: replicas grow


def test_shrinking_goes_to_the_replicas_before_the_expert_parallel_size():
    auto = {"minReplicas": 1, "maxReplicas": 4, "metric": "requestsRunning", "target": 8,
            "scaleDownStabilizationSeconds": 0}
    el = {**ELASTIC, "scaleDownStabilizationSeconds": 0}
    b = isvc(replicas=2, autoscaling=auto, resources={"gpusPerReplica": 4},
             parallelism={"expert": 2, "elastic": el})
    d = decide(observed(b, running=[0, 0], sizes=[4, 4]), SETTINGS, NOW)
    assert d.elastic is not None and d.elastic["reason"] == "Held" and "ReplicasFirst" in d.elastic["message"]
    assert d.resizes == [] and d.replicas == 1


def test_the_admin_key_is_stable_per_service_and_differs_between_services():
    secret = b"operator-secret"
    assert elastic.admin_key(secret, "ns", "a", "uid-1") == elastic.admin_key(secret, "ns", "a", "uid-1")
    assert len({elastic.admin_key(secret, "ns", "a", "uid-1"), elastic.admin_key(secret, "ns", "a", "uid-2"),
                elastic.admin_key(secret, "ns", "b", "uid-1"), elastic.admin_key(b"other", "ns", "a", "uid-1")}) == 4


def test_the_pod_reads_the_admin_key_from_a_secret_the_operator_only_creates():
    b = body()
    spec = parse("llama", "default", b["spec"])
    o = observed(b, running=[14], sizes=[2])
    kube = FakeKube()
    kube.put(b)
    calls: list[tuple[str, dict | None]] = []

    def call(url, key, timeout, payload=None):
        calls.append((url, payload))
        assert key == "k"
        return {}

    ctx = Context(kube=kube, operator_secret=b"s", elastic_call=call)
    result = apply(ctx, o, decide(o, SETTINGS, NOW), NOW)
    assert result is not None
    secret = kube.get("Secret", "default", elastic.admin_secret_name("llama"))
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    assert calls == [("http://127.0.0.1:8000/scale_elastic_ep", {"new_expert_parallel_size": 4})]
    assert ("Normal", "ElasticResize", "p0: asked for 4 expert-parallel ranks") in result.events
    env = {e["name"]: e for e in decide(o, SETTINGS, NOW).children.workload["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env[elastic.ADMIN_KEY_ENV]["valueFrom"]["secretKeyRef"] == {
        "name": "llama-pagoda-admin", "key": "admin-api-key", "optional": True}
    assert result.status["elastic"]["desiredExpertParallel"] == 4
    assert next(c for c in result.status["conditions"] if c["type"] == "Scaling")["reason"] == "Resizing"
    assert spec.port == 8000


class _Daemon(BaseHTTPRequestHandler):
    """Answers as a daemon's admin routes: the admin key or 401, a bounded JSON state."""

    state: ClassVar[dict] = {"size": 2, "phase": "done", "target": 2}
    posted: ClassVar[list[dict]] = []

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") != "Bearer right":
            self.send_response(401)
            self.end_headers()
            return False
        return True

    def do_GET(self):
        if self._authorised():
            body = json.dumps(self.state).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_POST(self):
        if self._authorised():
            self.posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(202)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def daemon():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Daemon)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _pod(name: str = "p0") -> dict:
    return {"metadata": {"name": name}, "status": {"podIP": "127.0.0.1",
                                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def test_states_and_resizes_go_over_http_with_the_admin_key(daemon):
    assert elastic.read_states([_pod()], daemon, "right", 2.0) == {"p0": {"size": 2, "phase": "done", "target": 2}}
    refused = elastic.read_states([_pod()], daemon, "wrong", 2.0)["p0"]  # a key that is not the daemon's
    assert set(refused) == {"unreachable"} and "401" in refused["unreachable"]
    assert elastic.wanted_resizes({"p0": refused}, 3) == []
    status = elastic.status_of(parse("llama", "default", body()["spec"]).parallelism.elastic, {}, None, 2,
                               {"p0": refused}, NOW)
    assert "401" in status["pods"][0]["lastError"]
    assert elastic.request(_pod(), daemon, "right", 3, 2.0) is None and _Daemon.posted[-1] == {
        "new_expert_parallel_size": 3}
    assert "401" in (elastic.request(_pod(), daemon, "wrong", 3, 2.0) or "")


def test_what_a_daemon_answers_reaches_status_only_in_the_schemas_types():
    el = parse("llama", "default", body()["spec"]).parallelism.elastic
    hostile = {"size": "3", "phase": "evil", "last_seconds": float("nan"), "last_error": "x" * 5000}
    (pod,) = elastic.status_of(el, {}, None, 2, {"p0": hostile}, NOW)["pods"]
    assert pod == {"pod": "p0", "lastError": "x" * 500}
    assert elastic.wanted_resizes({"p0": hostile, "p1": {"size": True}}, 3) == []
