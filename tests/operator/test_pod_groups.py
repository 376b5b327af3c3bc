"""Replicas that span pods (resources.podsPerReplica > 1): what the operator renders, how a
group's status is counted, and the objects it removes, against the in-memory API."""

from __future__ import annotations

import pytest
import yaml

from pagoda_operator import pod_groups
from pagoda_operator.builders import HASH_ANNOTATION, ROLE_LABEL, Settings, selector_labels
from pagoda_operator.reconcile import Context, reconcile
from pagoda_operator.spec import InvalidSpec, parse
from pagoda_operator.status import Workload, condition
from tests.operator.operator_fakes import FakeKube, every_capability, isvc

SETTINGS = Settings(daemon_image="img:1", network_policy=True)
GROUPED = {"resources": {"gpusPerReplica": 8, "podsPerReplica": 2}, "parallelism": {"tensor": 8}}


def grouped(replicas: int = 2, **extra):
    return isvc(replicas=replicas, **{**GROUPED, **extra})


def spec_of(body):
    return parse(body["metadata"]["name"], "default", body["spec"], every_capability)


@pytest.mark.parametrize("resources, parallelism, name, message", [
    ({"gpusPerReplica": 8, "podsPerReplica": 3}, {"tensor": 8}, "llama", "must divide parallelism.tensor"),
    ({"gpusPerReplica": 0, "podsPerReplica": 4}, {"tensor": 2}, "llama", "must divide parallelism.tensor"),
    ({"gpusPerReplica": 8, "podsPerReplica": 0}, {"tensor": 8}, "llama", "must be 1 to 64"),
    ({"gpusPerReplica": 8, "podsPerReplica": 65}, {"tensor": 8}, "llama", "must be 1 to 64"),
    ({"gpusPerReplica": 8, "podsPerReplica": 2}, {"tensor": 4, "data": 2}, "llama", "needs parallelism.data 1"),
    ({"gpusPerReplica": 8, "podsPerReplica": 2}, {"tensor": 8}, "l" * 41, "at most 40 characters"),
])
def test_layouts_a_group_cannot_run_are_refused(resources, parallelism, name, message):
    with pytest.raises(InvalidSpec, match=message):
        parse(name, "default", {"model": {"name": "m", "pvc": {"claimName": "w"}}, "resources": resources,
                                "parallelism": parallelism}, every_capability)


def test_a_group_renders_leaders_workers_and_a_headless_service():
    body = grouped()
    spec = spec_of(body)
    kids = pod_groups.children(spec, body, 2, SETTINGS, {0: "10.244.0.17"})
    assert [(c["kind"], c["metadata"]["name"]) for c in kids.all()] == [
        ("ConfigMap", "llama-config"), ("Service", "llama"), ("Service", "llama-group"), ("StatefulSet", "llama"),
        ("StatefulSet", "llama-0"), ("NetworkPolicy", "llama")]  # group 1's leader has no IP yet: no workers
    assert kids.service["spec"]["selector"][ROLE_LABEL] == "leader"  # the API reaches leaders only
    assert kids.group_service["spec"]["clusterIP"] == "None"
    leaders, (workers,) = kids.workload, kids.workers
    assert leaders["spec"]["replicas"] == 2 and workers["spec"]["replicas"] == 1
    for sts in (leaders, workers):
        assert sts["spec"]["serviceName"] == "llama-group"
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4  # 8 GPUs over 2 pods
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert sts["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    (worker,) = workers["spec"]["template"]["spec"]["containers"]
    assert worker["args"][-5:] == ["--node-rank-from-hostname", "--master-addr", "10.244.0.17",
                                   "--node-ready-port", "29500"]
    assert not {"livenessProbe", "startupProbe"} & worker.keys()
    assert worker["ports"] == [{"name": "ready", "containerPort": 29500, "protocol": "TCP"}]  # no API port
    assert worker["readinessProbe"]["tcpSocket"] == {"port": "ready"}
    (leader,) = leaders["spec"]["template"]["spec"]["containers"]
    assert "readinessProbe" in leader and "--node-rank-from-hostname" not in leader["args"]
    engine = yaml.safe_load(kids.config_map["data"]["engine.yaml"])
    assert engine["nnodes"] == 2 and engine["master_port"] == 29500 and engine["tensor_parallel_size"] == 8
    # the members reach each other on every port; others reach only the API port
    rules = kids.network_policy["spec"]["ingress"]
    assert rules[1] == {"from": [{"podSelector": {"matchLabels": selector_labels("llama")}}]}
    assert rules[0]["ports"] == [{"protocol": "TCP", "port": 8000}]
    # a leader recreated with another IP rolls its workers
    again = pod_groups.children(spec, body, 2, SETTINGS, {0: "10.244.0.99"})
    assert again.workers[0]["metadata"]["annotations"][HASH_ANNOTATION] != \
        workers["metadata"]["annotations"][HASH_ANNOTATION]


def _pod(name, role, group=None, ready=True, restarts=0, revision="r1", message=None):
    labels = {ROLE_LABEL: role, "controller-revision-hash": revision}
    if group is not None:
        labels["pagoda.dev/group"] = str(group)
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}], "podIP": "10.0.0.1"}
    if restarts:
        status["containerStatuses"] = [{"name": "daemon", "restartCount": restarts, "lastState": {
            "terminated": {"exitCode": 1, "message": message or ""}}}]
    return {"metadata": {"name": name, "labels": labels}, "status": status}


def _sts(name, replicas, group=None, hash_="h"):
    labels = {ROLE_LABEL: "worker" if group is not None else "leader"}
    if group is not None:
        labels["pagoda.dev/group"] = str(group)
    return {"kind": "StatefulSet", "metadata": {"name": name, "generation": 1, "labels": labels,
                                                "annotations": {HASH_ANNOTATION: hash_}},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": replicas, "updateRevision": "r1"}}


def test_a_group_is_one_replica_ready_only_when_every_member_is():
    leaders = _sts("llama", 2)
    workers = {0: _sts("llama-0", 2, 0), 1: _sts("llama-1", 2, 1)}
    hashes = {"llama": "h", "llama-0": "h", "llama-1": "h"}
    pods = [_pod("llama-0", "leader"), _pod("llama-0-0", "worker", 0), _pod("llama-0-1", "worker", 0),
            _pod("llama-1", "leader"), _pod("llama-1-0", "worker", 1),
            _pod("llama-1-1", "worker", 1, ready=False, restarts=2, message="rank 2: lost the other ranks")]
    w = Workload.of_groups("llama", leaders, workers, pods, 2, hashes, 3)
    assert (w.current, w.replicas, w.ready, w.updated) == (True, 2, 1, 2)
    (problem,) = w.problems
    assert problem.reason == "GroupMemberFailed"
    assert problem.message.startswith("replica 1: pod llama-1-1 exited (code 1, restarted 2 times): rank 2: lost")
    # a missing member, a stale revision: not ready, not updated
    w = Workload.of_groups("llama", leaders, workers, pods[:2] + pods[3:5], 2, hashes, 3)
    assert (w.ready, w.updated) == (0, 0)
    stale = [*pods[:2], _pod("llama-0-1", "worker", 0, revision="r0")]
    assert Workload.of_groups("llama", leaders, workers, stale, 1, hashes, 3).updated == 0


def _settle_groups(kube: FakeKube, name="llama", ns="default"):
    """Play the StatefulSet controller and kubelet: every member exists, current and Ready."""
    for key in [k for k in kube.objects if k[0] == "Pod"]:
        del kube.objects[key]
    for (kind, _, sts_name), sts in list(kube.objects.items()):
        if kind != "StatefulSet":
            continue
        n = sts["spec"]["replicas"]
        sts["status"] = {"observedGeneration": sts["metadata"]["generation"], "replicas": n, "readyReplicas": n,
                         "updatedReplicas": n, "updateRevision": "rev"}
        labels = {**sts["spec"]["template"]["metadata"]["labels"], "controller-revision-hash": "rev"}
        for i in range(n):
            kube.put({"kind": "Pod", "metadata": {"name": f"{sts_name}-{i}", "namespace": ns, "labels": labels},
                      "spec": {"nodeName": "node-1"},
                      "status": {"podIP": f"10.0.{len(sts_name)}.{i + 1}",
                                 "conditions": [{"type": "Ready", "status": "True"}]}})


def assert_groups_ready(kube: FakeKube, replicas: int) -> None:
    """The InferenceService is Ready with ``replicas`` groups, its selector naming the leaders."""
    st = kube.objects[("InferenceService", "default", "llama")]["status"]
    assert condition(st, "Ready")["status"] == "True", st["conditions"]
    assert st["readyReplicas"] == replicas and st["selector"].endswith(",pagoda.dev/role=leader")


def test_groups_come_up_scale_down_and_switch_back_to_one_pod():
    kube = FakeKube()
    kube.put(grouped(replicas=2))
    ctx = Context(kube=kube, settings=SETTINGS, supports=every_capability)
    reconcile(ctx, "default", "llama", "create")
    assert ("StatefulSet", "default", "llama") in kube.objects
    assert not [k for k in kube.objects if k[0] == "StatefulSet" and k[2] != "llama"]  # no leader IP yet
    _settle_groups(kube)  # the leaders run and have IPs
    reconcile(ctx, "default", "llama", "pod")
    assert {k[2] for k in kube.objects if k[0] == "StatefulSet"} == {"llama", "llama-0", "llama-1"}
    _settle_groups(kube)
    reconcile(ctx, "default", "llama", "pod")
    assert_groups_ready(kube, 2)

    body = kube.objects[("InferenceService", "default", "llama")]
    body["spec"]["replicas"] = 1
    body["metadata"]["generation"] += 1
    reconcile(ctx, "default", "llama", "update")
    assert ("delete", "StatefulSet", "llama-1") in kube.writes and ("StatefulSet", "default", "llama-0") in \
        kube.objects

    body["spec"]["resources"] = {"gpusPerReplica": 8}
    body["metadata"]["generation"] += 1
    reconcile(ctx, "default", "llama", "update")
    assert [k for k in kube.objects if k[0] == "StatefulSet"] == []
    assert ("Service", "default", "llama-group") not in kube.objects
    assert ("Deployment", "default", "llama") in kube.objects
    assert "pagoda.dev/role" not in kube.objects[("Service", "default", "llama")]["spec"]["selector"]

