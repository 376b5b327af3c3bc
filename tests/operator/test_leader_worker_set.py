"""Replicas that span pods as one LeaderWorkerSet (leader_worker_set.py), where the cluster serves
that CRD: the object rendered (checked against the vendored CRD's schema, so that no field the
operator sets would be pruned), a group's status read from the pods' LeaderWorkerSet labels, the
switches between layouts, API discovery and its cache, against the in-memory API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pagoda_operator import leader_worker_set as lws
from pagoda_operator import pod_groups
from pagoda_operator.builders import GROUP_LABEL, HASH_ANNOTATION, ROLE_LABEL, Settings, digest
from pagoda_operator.kube import ApiError, Kube, path
from pagoda_operator.reconcile import Context, reconcile
from pagoda_operator.status import Workload, condition
from pagoda_operator.watch_cache import CachedKube
from tests.operator.operator_fakes import FakeKube, every_capability
from tests.operator.test_pod_groups import SETTINGS, _settle_groups, assert_groups_ready, grouped, spec_of

CRD = Path(__file__).resolve().parents[2] / "e2e" / "cluster" / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def rendered(replicas: int = 2, settings: Settings = SETTINGS, **extra: Any):
    body = grouped(**extra)
    return lws.children(spec_of(body), body, replicas, settings)


def test_the_groups_render_as_one_leader_worker_set_from_the_group_pod_templates():
    kids = rendered()
    assert [(c["kind"], c["metadata"]["name"]) for c in kids.all()] == [
        ("ConfigMap", "llama-config"), ("Service", "llama"), ("Service", "llama-group"),
        ("LeaderWorkerSet", "llama-group"), ("NetworkPolicy", "llama")]  # no StatefulSet of ours
    obj = kids.workload
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert obj["metadata"]["ownerReferences"][0]["controller"] is True
    spec = obj["spec"]
    assert spec["replicas"] == 2 and spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"] == {"type": "RollingUpdate",
                                       "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}}
    assert spec["networkConfig"] == {"subdomainPolicy": "Shared"}
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    # the leader's pod is the StatefulSet layout's, with the rendering's hash
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    config_hash = digest(kids.config_map["data"])
    expected = pod_groups.leader_pod(spec_of(grouped()), SETTINGS, config_hash)
    hashes = {p["metadata"]["annotations"].pop(lws.TEMPLATE_HASH_ANNOTATION) for p in (leader, worker)}
    assert leader == expected and len(hashes) == 1
    assert leader["metadata"]["labels"][ROLE_LABEL] == "leader"  # the API Service selects leaders only
    assert kids.service["spec"]["selector"][ROLE_LABEL] == "leader"
    # the worker: rank and leader from the controller's variables, one template for every group
    assert worker["metadata"]["labels"][ROLE_LABEL] == "worker" and GROUP_LABEL not in worker["metadata"]["labels"]
    (c,) = worker["spec"]["containers"]
    assert c["args"][-6:] == ["--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
                              "--node-ready-port", "29500"]
    assert "--node-rank-from-hostname" not in c["args"]
    assert c["readinessProbe"]["tcpSocket"] == {"port": "ready"} and "livenessProbe" not in c
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4  # 8 GPUs over 2 pods
    # the headless Service the controller finds under the object's name: every member, not ready too
    assert kids.group_service["metadata"]["name"] == obj["metadata"]["name"]
    assert kids.group_service["spec"]["clusterIP"] == "None"
    assert kids.group_service["spec"]["publishNotReadyAddresses"] is True


def test_the_template_hash_follows_the_pods_not_the_replicas():
    two, three = rendered(2).workload, rendered(3).workload
    assert lws.template_hash(two) == lws.template_hash(three) is not None
    assert two["metadata"]["annotations"][HASH_ANNOTATION] == three["metadata"]["annotations"][HASH_ANNOTATION]
    other = rendered(2, Settings(daemon_image="img:2", network_policy=True)).workload
    assert lws.template_hash(other) != lws.template_hash(two)


def _schema_misses(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    """The fields of ``value`` the structural ``schema`` would prune or refuse (unknown field, a
    value outside an enum, the wrong type)."""
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, int | str) else [f"{where}: not int-or-string"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} not in {schema['enum']}"]
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return []
        out = []
        for key, item in value.items():
            sub = (schema.get("properties") or {}).get(key) or schema.get("additionalProperties")
            if not isinstance(sub, dict):
                out.append(f"{where}.{key}: not in the schema (pruned)")
                continue
            out += _schema_misses(item, sub, f"{where}.{key}")
        return out
    if kind == "array":
        if not isinstance(value, list):
            return [f"{where}: not an array"]
        return [m for i, item in enumerate(value) for m in _schema_misses(item, schema["items"], f"{where}[{i}]")]
    types = {"string": str, "integer": int, "boolean": bool, "number": int | float}
    if kind in types and not isinstance(value, types[kind]):
        return [f"{where}: {value!r} is not {kind}"]
    return []


def test_every_field_rendered_survives_the_crds_schema():
    crd = yaml.safe_load(CRD.read_text())
    assert crd["metadata"]["name"] == lws.CRD_NAME and crd["spec"]["group"] == lws.GROUP
    (version,) = crd["spec"]["versions"]
    assert version["name"] == lws.VERSION and version["served"] and crd["spec"]["names"]["plural"] == lws.PLURAL
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    # the fullest rendering: every optional part of the pod that applies to a group
    body = grouped(replicas=2)
    body["spec"]["model"] = {"name": "m", "uri": "hf://org/m"}
    body["spec"]["placement"] = {"nodeSelector": {"pool": "gpu"}, "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    body["spec"]["pod"] = {"labels": {"team": "a"}, "annotations": {"note": "x"}, "priorityClassName": "high"}
    body["spec"]["server"] = {"apiKeySecretRef": {"name": "keys", "key": "api-key"}}
    obj = lws.children(spec_of(body), body, 2, Settings(daemon_image="img:1", node_model_cache="/var/cache/m"))
    assert _schema_misses(obj.workload["spec"], schema, "spec") == []
    # the check finds a pruned field
    assert _schema_misses({"replicas": 1, "bogus": 1}, schema, "spec") == ["spec.bogus: not in the schema (pruned)"]


def _pod(name: str, role: str, group: int, worker: int, want: str = "t1", ready: bool = True, restarts: int = 0,
         message: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if restarts:
        status["containerStatuses"] = [{"name": "daemon", "restartCount": restarts, "lastState": {
            "terminated": {"exitCode": 1, "message": message}}}]
    return {"metadata": {"name": name, "labels": {ROLE_LABEL: role, lws.GROUP_INDEX_LABEL: str(group),
                                                  lws.WORKER_INDEX_LABEL: str(worker)},
                         "annotations": {lws.TEMPLATE_HASH_ANNOTATION: want}}, "status": status}


def _live(replicas: int, size: int, template_hash: str = "t1", observed: int = 1) -> dict[str, Any]:
    pod = {"metadata": {"annotations": {lws.TEMPLATE_HASH_ANNOTATION: template_hash}}}
    return {"kind": "LeaderWorkerSet", "metadata": {"name": "llama-group", "generation": 1,
                                                    "annotations": {HASH_ANNOTATION: "h"}},
            "spec": {"replicas": replicas, "leaderWorkerTemplate": {"size": size, "leaderTemplate": pod,
                                                                    "workerTemplate": pod}},
            "status": {"observedGeneration": observed, "replicas": replicas}}


def test_a_group_is_one_replica_ready_only_when_every_member_is_by_the_controllers_labels():
    pods = [_pod("llama-group-0", "leader", 0, 0), _pod("llama-group-0-1", "worker", 0, 1),
            _pod("llama-group-0-2", "worker", 0, 2),
            _pod("llama-group-1", "leader", 1, 0), _pod("llama-group-1-1", "worker", 1, 1),
            _pod("llama-group-1-2", "worker", 1, 2, ready=False, restarts=1, message="rank 5: lost the other ranks")]
    w = Workload.of_leader_worker_set(_live(2, 3), pods, 2, "h", 3)
    assert (w.exists, w.current, w.replicas, w.ready, w.updated) == (True, True, 2, 1, 2)
    (problem,) = w.problems
    assert problem.reason == "GroupMemberFailed"
    assert problem.message.startswith("replica 1: pod llama-group-1-2 exited (code 1, restarted 1 times): rank 5")
    # a missing member: neither ready nor updated; a member of an older rendering: not updated
    assert (Workload.of_leader_worker_set(_live(1, 3), pods[:2], 1, "h", 3).ready,
            Workload.of_leader_worker_set(_live(1, 3), pods[:2], 1, "h", 3).updated) == (0, 0)
    stale = [*pods[:2], _pod("llama-group-0-2", "worker", 0, 2, want="t0")]
    assert Workload.of_leader_worker_set(_live(1, 3), stale, 1, "h", 3).updated == 0
    # no controller has seen the object (none installed, or not yet): not current, so not Ready
    assert not Workload.of_leader_worker_set(_live(2, 3, observed=0), pods, 2, "h", 3).current
    assert not Workload.of_leader_worker_set(None, [], 2, "h", 3).exists


def _play_the_lws_controller(kube: FakeKube, ns: str = "default") -> None:
    """What the LeaderWorkerSet controller and its webhook would do: every group's pods, labelled,
    Ready, carrying the templates' annotations; the object's status observed."""
    for key in [k for k in kube.objects if k[0] == "Pod"]:
        del kube.objects[key]
    for (kind, _, name), obj in list(kube.objects.items()):
        if kind != "LeaderWorkerSet":
            continue
        obj["status"] = {"observedGeneration": obj["metadata"]["generation"], "replicas": obj["spec"]["replicas"]}
        template = obj["spec"]["leaderWorkerTemplate"]
        for g in range(obj["spec"]["replicas"]):
            for i in range(template["size"]):
                pod = template["leaderTemplate" if i == 0 else "workerTemplate"]
                kube.put({"kind": "Pod", "metadata": {
                    "name": f"{name}-{g}" + (f"-{i}" if i else ""), "namespace": ns,
                    "labels": {**pod["metadata"]["labels"], lws.GROUP_INDEX_LABEL: str(g),
                               lws.WORKER_INDEX_LABEL: str(i)},
                    "annotations": dict(pod["metadata"]["annotations"])},
                    "spec": {"nodeName": "node-1"},
                    "status": {"podIP": f"10.0.{g}.{i + 1}", "conditions": [{"type": "Ready", "status": "True"}]}})


def test_layouts_switch_as_the_crd_comes_and_goes_and_as_pods_per_replica_changes():
    kube = FakeKube()
    kube.put(grouped(replicas=2))
    served = [False]
    ctx = Context(kube=kube, settings=SETTINGS, supports=every_capability, leader_worker_sets=lambda: served[0])
    reconcile(ctx, "default", "llama", "create")
    _settle_groups(kube)
    reconcile(ctx, "default", "llama", "pod")
    assert {k[2] for k in kube.objects if k[0] == "StatefulSet"} == {"llama", "llama-0", "llama-1"}

    served[0] = True  # the CRD is installed: one LeaderWorkerSet, none of our StatefulSets
    reconcile(ctx, "default", "llama", "timer")
    assert ("create", "LeaderWorkerSet", "llama-group") in kube.writes
    assert [k for k in kube.objects if k[0] == "StatefulSet"] == []
    assert ("Service", "default", "llama-group") in kube.objects  # the Service the controller uses
    st = kube.objects[("InferenceService", "default", "llama")]["status"]
    assert condition(st, "Ready")["status"] == "False"  # no controller has acted yet
    _play_the_lws_controller(kube)
    reconcile(ctx, "default", "llama", "pod")
    assert_groups_ready(kube, 2)
    # a member restarted and is not Ready: Degraded naming it
    pod = kube.objects[("Pod", "default", "llama-group-1-1")]
    pod["status"] = {"conditions": [{"type": "Ready", "status": "False"}], "containerStatuses": [
        {"name": "daemon", "restartCount": 1, "lastState": {"terminated": {"exitCode": 137}}}]}
    reconcile(ctx, "default", "llama", "pod")
    st = kube.objects[("InferenceService", "default", "llama")]["status"]
    assert condition(st, "Degraded")["reason"] == "GroupMemberFailed"
    assert "pod llama-group-1-1 exited (code 137" in condition(st, "Degraded")["message"]
    _play_the_lws_controller(kube)

    body = kube.objects[("InferenceService", "default", "llama")]
    body["spec"]["replicas"] = 3  # scaling is the object's replicas: no other write
    body["metadata"]["generation"] += 1
    before = len(kube.writes)
    reconcile(ctx, "default", "llama", "update")
    assert kube.objects[("LeaderWorkerSet", "default", "llama-group")]["spec"]["replicas"] == 3
    assert [w for w in kube.writes[before:] if w[0] != "patch/status"] == [("replace", "LeaderWorkerSet",
                                                                             "llama-group")]

    body["spec"]["resources"] = {"gpusPerReplica": 8}  # one pod per replica: the Deployment
    body["metadata"]["generation"] += 1
    reconcile(ctx, "default", "llama", "update")
    assert ("delete", "LeaderWorkerSet", "llama-group") in kube.writes
    assert ("Service", "default", "llama-group") not in kube.objects
    assert ("Deployment", "default", "llama") in kube.objects

    body["spec"]["resources"] = {"gpusPerReplica": 8, "podsPerReplica": 2}  # groups again
    body["metadata"]["generation"] += 1
    reconcile(ctx, "default", "llama", "update")
    assert ("LeaderWorkerSet", "default", "llama-group") in kube.objects
    assert ("Deployment", "default", "llama") not in kube.objects

    served[0] = False  # the CRD removed (and with it every LeaderWorkerSet): StatefulSets again
    del kube.objects[("LeaderWorkerSet", "default", "llama-group")]
    reconcile(ctx, "default", "llama", "timer")
    assert ("StatefulSet", "default", "llama") in kube.objects


def test_a_blocked_spec_leaves_the_leader_worker_set_and_reports_its_groups():
    kube = FakeKube()
    kube.put(grouped(replicas=2))
    ctx = Context(kube=kube, settings=SETTINGS, supports=every_capability, leader_worker_sets=lambda: True)
    reconcile(ctx, "default", "llama", "create")
    _play_the_lws_controller(kube)
    body = kube.objects[("InferenceService", "default", "llama")]
    body["spec"]["resources"]["podsPerReplica"] = 3  # does not divide 8: refused
    body["metadata"]["generation"] += 1
    before = [w for w in kube.writes if w[0] != "patch/status"]
    reconcile(ctx, "default", "llama", "update")
    assert [w for w in kube.writes if w[0] != "patch/status"] == before
    st = kube.objects[("InferenceService", "default", "llama")]["status"]
    assert condition(st, "Degraded")["reason"] == "InvalidSpec" and st["readyReplicas"] == 2


def test_discovery_is_asked_once_per_interval_and_a_failure_keeps_the_last_answer():
    now, answers, asked = [0.0], [True], []

    def ask() -> bool:
        asked.append(now[0])
        if isinstance(answers[0], Exception):
            raise answers[0]
        return bool(answers[0])

    served = lws.Discovery(ask, recheck_s=60, clock=lambda: now[0])
    assert served() and served() and asked == [0.0]
    answers[0] = False
    now[0] = 59.0
    assert served()  # not asked again yet
    now[0] = 60.0
    assert not served() and asked == [0.0, 60.0]
    answers[0], now[0] = ApiError(503, "Unavailable"), 130.0  # type: ignore[list-item]
    assert not served() and not served() and asked == [0.0, 60.0, 130.0, 130.0]  # asked again at once


class _Discovery(Kube):
    def __init__(self, answers: dict[str, Any]) -> None:  # no pool: nothing goes over the network
        self.answers = answers

    def request(self, method: str, url_path: str, body: Any = None, query: Any = None,
                content_type: str = "application/json") -> Any:
        answer = self.answers.get(url_path)
        if isinstance(answer, ApiError):
            raise answer
        if answer is None:
            raise ApiError(404, "NotFound")
        return answer


def test_kube_tells_a_served_resource_by_api_discovery():
    lists = {"/apis/leaderworkerset.x-k8s.io/v1": {"kind": "APIResourceList", "resources": [
        {"name": "leaderworkersets", "kind": "LeaderWorkerSet"}, {"name": "leaderworkersets/status"}]}}
    assert _Discovery(lists).served(lws.API_VERSION, lws.PLURAL)
    assert not _Discovery({}).served(lws.API_VERSION, lws.PLURAL)  # 404: no such group/version
    with pytest.raises(ApiError):
        _Discovery({"/apis/leaderworkerset.x-k8s.io/v1": ApiError(403, "Forbidden")}).served(lws.API_VERSION,
                                                                                              lws.PLURAL)
    assert path("LeaderWorkerSet", "ns", "x") == "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ns/leaderworkersets/x"


def test_passes_read_the_leader_worker_set_from_the_api_server_not_the_cache():
    """kopf's watch of LeaderWorkerSets may start late (handlers.py): a cached copy could miss the
    controller's status for minutes, so each pass asks the API server."""
    at = path("LeaderWorkerSet", "default", "llama-group")
    api = _Discovery({at: {"kind": "LeaderWorkerSet", "metadata": {"name": "llama-group"}}})
    asked: list[str] = []
    request = api.request
    api.request = lambda method, url_path, *a, **k: asked.append(url_path) or request(method, url_path, *a, **k)  # type: ignore[method-assign]
    kube = CachedKube(api)
    for _ in range(2):
        assert kube.get("LeaderWorkerSet", "default", "llama-group")["metadata"]["name"] == "llama-group"
    assert asked == [at, at]
    assert kube.get("LeaderWorkerSet", "default", "other") is None  # 404: none
