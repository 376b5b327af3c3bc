"""One reconcile pass against an in-memory API: creation, no-op passes, rollouts, invalid specs,
placement blockers, conflicts and autoscaling through the status."""

from __future__ import annotations

import pytest

from pagoda_daemon.capabilities import supported
from pagoda_operator.builders import HASH_ANNOTATION, Settings
from pagoda_operator.reconcile import Context, reconcile
from pagoda_operator.status import condition
from tests.operator.operator_fakes import FakeKube, every_capability, isvc, topology


class Clock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(kube: FakeKube, metrics: dict[str, str] | None = None, clock: Clock | None = None) -> Context:
    def fetcher(url: str, timeout: float) -> str:
        return (metrics or {}).get("text", "")

    return Context(
        kube=kube, settings=Settings(daemon_image="img:1"), clock=clock or Clock(), fetcher=fetcher,
        supports=every_capability,
    )


def children_writes(kube: FakeKube) -> list:
    return [w for w in kube.writes if w[1] != "InferenceService"]


def settle(kube: FakeKube, name: str = "llama", namespace: str = "default") -> None:
    """Play the Deployment controller and kubelet: every desired pod exists, is updated and Ready."""
    d = kube.objects[("Deployment", namespace, name)]
    n = d["spec"]["replicas"]
    d["status"] = {
        "observedGeneration": d["metadata"]["generation"],
        "replicas": n,
        "readyReplicas": n,
        "updatedReplicas": n,
        "availableReplicas": n,
    }
    for key in [k for k in kube.objects if k[0] == "Pod"]:
        del kube.objects[key]
    labels = d["spec"]["template"]["metadata"]["labels"]
    for i in range(n):
        kube.put(
            {
                "kind": "Pod",
                "metadata": {"name": f"{name}-{i}", "namespace": namespace, "labels": labels},
                "spec": {"nodeName": "node-1"},
                "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
            }
        )


def edit(kube: FakeKube, name: str = "llama", **spec) -> None:
    obj = kube.objects[("InferenceService", "default", name)]
    obj["spec"].update(spec)
    obj["metadata"]["generation"] += 1


def status(kube: FakeKube, name: str = "llama") -> dict:
    return kube.objects[("InferenceService", "default", name)].get("status") or {}


def test_create_then_ready_then_no_writes(fake_kube):
    fake_kube.put(isvc(replicas=2))
    ctx = make(fake_kube)
    r = reconcile(ctx, "default", "llama", "create")
    assert sorted(r.wrote) == ["ConfigMap", "Deployment", "Service", "status"]
    assert {(v, k) for v, k, _ in children_writes(fake_kube)} == {
        ("create", "ConfigMap"),
        ("create", "Service"),
        ("create", "Deployment"),
    }
    st = status(fake_kube)
    assert condition(st, "Ready")["status"] == "False" and condition(st, "Progressing")["status"] == "True"
    assert st["selector"].startswith("app.kubernetes.io/instance=llama")
    assert st["endpoint"] == "http://llama.default.svc:8000"
    assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["replicas"] == 2

    settle(fake_kube)
    reconcile(ctx, "default", "llama", "deployment")
    st = status(fake_kube)
    assert (
        condition(st, "Ready")["status"] == "True"
        and st["readyReplicas"] == 2
        and st["observedGeneration"] == 1
    )
    assert [p["pod"] for p in st["placement"]] == ["llama-0", "llama-1"]

    before = list(fake_kube.writes)
    for trigger in ("resume", "timer", "pod", "update"):
        r = reconcile(ctx, "default", "llama", trigger)
        assert r.wrote == []
    assert fake_kube.writes == before  # no update storm


def test_scale_changes_replicas_without_rolling(fake_kube):
    fake_kube.put(isvc(replicas=1))
    ctx = make(fake_kube)
    reconcile(ctx, "default", "llama", "create")
    settle(fake_kube)
    reconcile(ctx, "default", "llama", "pod")
    d0 = fake_kube.objects[("Deployment", "default", "llama")]
    tmpl = d0["spec"]["template"]
    edit(fake_kube, replicas=3)  # what `kubectl scale` does through the scale subresource
    r = reconcile(ctx, "default", "llama", "update")
    assert r.wrote == ["Deployment", "status"]
    d = fake_kube.objects[("Deployment", "default", "llama")]
    assert d["spec"]["replicas"] == 3 and d["spec"]["template"] == tmpl
    assert condition(status(fake_kube), "Progressing")["reason"] in ("RollingOut", "ScalingUp")
    settle(fake_kube)
    reconcile(ctx, "default", "llama", "deployment")
    assert (
        condition(status(fake_kube), "Ready")["status"] == "True"
        and status(fake_kube)["observedGeneration"] == 2
    )


def test_spec_change_rolls_once_and_reports_the_new_generation(fake_kube):
    fake_kube.put(isvc())
    ctx = make(fake_kube)
    reconcile(ctx, "default", "llama", "create")
    settle(fake_kube)
    reconcile(ctx, "default", "llama", "pod")
    old_hash = fake_kube.objects[("Deployment", "default", "llama")]["metadata"]["annotations"][
        HASH_ANNOTATION
    ]
    edit(fake_kube, engine={"blockSize": 32})
    r = reconcile(ctx, "default", "llama", "update")
    assert sorted(r.wrote) == ["ConfigMap", "Deployment", "status"]
    d = fake_kube.objects[("Deployment", "default", "llama")]
    assert d["metadata"]["annotations"][HASH_ANNOTATION] != old_hash
    assert (
        "block_size: 32" in fake_kube.objects[("ConfigMap", "default", "llama-config")]["data"]["engine.yaml"]
    )
    st = status(fake_kube)
    assert condition(st, "Progressing")["status"] == "True" and st["observedGeneration"] == 2
    assert condition(st, "Ready")["status"] == "False"
    assert reconcile(ctx, "default", "llama", "timer").wrote == []  # applied once
    settle(fake_kube)
    reconcile(ctx, "default", "llama", "deployment")
    assert condition(status(fake_kube), "Ready")["status"] == "True"


def test_invalid_spec_leaves_children_untouched(fake_kube):
    fake_kube.put(isvc(resources={"gpusPerReplica": 8}, parallelism={"tensor": 8}))
    ctx = make(fake_kube)
    reconcile(ctx, "default", "llama", "create")
    settle(fake_kube)
    reconcile(ctx, "default", "llama", "pod")
    writes = len(children_writes(fake_kube))
    edit(fake_kube, parallelism={"tensor": 3})
    r = reconcile(ctx, "default", "llama", "update")
    assert r.wrote == ["status"] and len(children_writes(fake_kube)) == writes
    st = status(fake_kube)
    deg = condition(st, "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "InvalidSpec")
    assert "tensor (3)" in deg["message"] and "must equal resources.gpusPerReplica (8)" in deg["message"]
    assert st["observedGeneration"] == 1 and st["readyReplicas"] == 1
    assert r.events[0][:2] == ("Warning", "InvalidSpec")
    assert reconcile(ctx, "default", "llama", "timer").wrote == []  # stays quiet while invalid
    edit(fake_kube, parallelism={"tensor": 4, "expert": 2})  # fixed
    reconcile(ctx, "default", "llama", "update")
    assert condition(status(fake_kube), "Degraded")["status"] == "False"
    assert status(fake_kube)["observedGeneration"] == 3


def test_more_gpus_than_any_node_is_invalid(fake_kube):
    fake_kube.put(topology("node-1", 4, [[0, 1, 2, 3]]))
    fake_kube.put(isvc(resources={"gpusPerReplica": 8}, parallelism={"tensor": 8}))
    reconcile(make(fake_kube), "default", "llama", "create")
    deg = condition(status(fake_kube), "Degraded")
    assert deg["reason"] == "InvalidSpec" and "largest NodeTopology shows 4 GPUs" in deg["message"]
    assert children_writes(fake_kube) == []


@pytest.mark.parametrize("groups, eligible", [([[0, 1], [2, 3]], False), ([[0, 1, 2, 3]], True)])
def test_require_nvlink(fake_kube, groups, eligible):
    fake_kube.put(topology("node-1", 4, groups))
    fake_kube.put(
        isvc(resources={"gpusPerReplica": 4}, parallelism={"tensor": 4}, placement={"requireNVLink": True})
    )
    reconcile(make(fake_kube), "default", "llama", "create")
    deg = condition(status(fake_kube), "Degraded")
    if eligible:
        d = fake_kube.objects[("Deployment", "default", "llama")]
        assert d["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        assert deg["status"] == "False"
    else:
        assert deg["reason"] == "NoEligibleNodes" and "4 GPUs connected all-to-all" in deg["message"]
        assert children_writes(fake_kube) == []


def test_foreign_child_is_not_overwritten(fake_kube):
    fake_kube.put(
        {"kind": "Service", "metadata": {"name": "llama", "namespace": "default"}, "spec": {"ports": []}}
    )
    fake_kube.put(isvc())
    reconcile(make(fake_kube), "default", "llama", "create")
    deg = condition(status(fake_kube), "Degraded")
    assert deg["reason"] == "ChildConflict" and "Service llama already exists" in deg["message"]
    assert fake_kube.objects[("Service", "default", "llama")]["spec"] == {"ports": []}


def test_gone_object_is_a_no_op(fake_kube):
    assert reconcile(make(fake_kube), "default", "nothing", "timer") is None
    assert fake_kube.writes == []


def waiting(n: float) -> str:
    return f'vllm:num_requests_waiting{{model_name="llama-3-8b"}} {n}\n'


def test_autoscaling_through_status(fake_kube):
    clock = Clock()
    metrics = {"text": waiting(1)}
    fake_kube.put(
        isvc(
            replicas=1,
            autoscaling={
                "minReplicas": 1,
                "maxReplicas": 4,
                "metric": "requestsWaiting",
                "target": 2,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 60,
            },
        )
    )
    ctx = make(fake_kube, metrics, clock)
    reconcile(ctx, "default", "llama", "create")
    settle(fake_kube)

    def tick(dt: float) -> dict:
        clock.t += dt
        reconcile(ctx, "default", "llama", "timer", autoscale=True)
        settle(fake_kube)
        reconcile(ctx, "default", "llama", "deployment")
        return status(fake_kube)["autoscaling"]

    a = tick(10)  # 1 waiting vs target 2: would go below min; stays at 1
    assert a["desiredReplicas"] == 1 and a["signals"] == {"pods": 1, "requestsWaiting": 1.0}
    metrics["text"] = waiting(6)  # 3x the target: scale up at once (up window 0)
    a = tick(10)
    assert a["desiredReplicas"] == 3 and a["reason"] == "ScaleUp"
    assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["replicas"] == 3
    assert (
        a["decisions"][-1]["from"] == 1 and a["decisions"][-1]["to"] == 3 and a["decisions"][-1]["value"] == 6
    )
    assert (
        fake_kube.objects[("InferenceService", "default", "llama")]["spec"]["replicas"] == 1
    )  # spec untouched
    metrics["text"] = waiting(0.5)  # load gone: scale down only after a full 60 s window
    for _ in range(5):
        a = tick(10)
        assert a["desiredReplicas"] == 3 and a["reason"] == "ScaleDownStabilizing"
    a = tick(11)
    assert a["desiredReplicas"] == 1 and a["reason"] in ("ScaleDown", "BoundedByMin")
    assert [(d["from"], d["to"]) for d in a["decisions"]] == [(1, 3), (3, 1)]
    assert a["lastScaleTime"] == a["decisions"][-1]["time"]
    assert condition(status(fake_kube), "Ready")["status"] == "True"


def test_autoscaling_respects_max_and_keeps_ten_decisions(fake_kube):
    clock = Clock()
    metrics = {"text": waiting(100)}
    fake_kube.put(
        isvc(
            replicas=1,
            autoscaling={
                "maxReplicas": 2,
                "metric": "requestsWaiting",
                "target": 2,
                "scaleDownStabilizationSeconds": 0,
            },
        )
    )
    ctx = make(fake_kube, metrics, clock)
    reconcile(ctx, "default", "llama", "create")
    for i in range(24):
        settle(fake_kube)
        metrics["text"] = waiting(100 if i % 2 == 0 else 0)
        clock.t += 15
        reconcile(ctx, "default", "llama", "timer", autoscale=True)
        assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["replicas"] <= 2
    decisions = status(fake_kube)["autoscaling"]["decisions"]
    assert len(decisions) == 10


def test_turning_autoscaling_off_hands_control_back_to_the_spec(fake_kube):
    clock = Clock()
    fake_kube.put(isvc(replicas=1, autoscaling={"maxReplicas": 4, "metric": "requestsWaiting", "target": 2}))
    ctx = make(fake_kube, {"text": waiting(8)}, clock)
    reconcile(ctx, "default", "llama", "create")
    settle(fake_kube)
    clock.t += 15
    reconcile(ctx, "default", "llama", "timer", autoscale=True)
    assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["replicas"] == 4
    obj = fake_kube.objects[("InferenceService", "default", "llama")]
    del obj["spec"]["autoscaling"]
    obj["metadata"]["generation"] += 1
    reconcile(ctx, "default", "llama", "update")
    assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["replicas"] == 1
    assert "autoscaling" not in status(fake_kube)


def test_child_rejected_by_the_api_server_is_invalid_spec(fake_kube, monkeypatch):
    from pagoda_operator.kube import ApiError

    fake_kube.put(isvc(pod={"labels": {"team": "not a valid label value!"}}))
    real_create = fake_kube.create

    def create(obj):
        if obj["kind"] == "Deployment":
            raise ApiError(
                422,
                "Unprocessable Entity",
                {
                    "message": 'Deployment.apps "llama" is invalid: '
                    "spec.template.metadata.labels: Invalid value"
                },
            )
        return real_create(obj)

    monkeypatch.setattr(fake_kube, "create", create)
    r = reconcile(make(fake_kube), "default", "llama", "create")
    deg = condition(status(fake_kube), "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "InvalidSpec")
    assert (
        "the API server rejected the Deployment" in deg["message"]
        and "labels: Invalid value" in deg["message"]
    )
    assert r.events[0][:2] == ("Warning", "InvalidSpec")


def test_a_volume_that_cannot_be_mounted_is_degraded(fake_kube):
    """A hostPath that is not there: the pod stays ContainerCreating; only an Event says why."""
    fake_kube.put(isvc(replicas=1))
    ctx = make(fake_kube)
    reconcile(ctx, "default", "llama", "create")
    labels = fake_kube.objects[("Deployment", "default", "llama")]["spec"]["template"]["metadata"]["labels"]
    fake_kube.put(
        {
            "kind": "Pod",
            "metadata": {"name": "llama-0", "namespace": "default", "labels": labels, "uid": "u0"},
            "spec": {"nodeName": "node-1"},
            "status": {
                "phase": "Pending",
                "containerStatuses": [
                    {"name": "daemon", "state": {"waiting": {"reason": "ContainerCreating"}}}
                ],
            },
        }
    )
    fake_kube.put(
        {
            "kind": "Event",
            "metadata": {"name": "llama-0.1", "namespace": "default"},
            "involvedObject": {"kind": "Pod", "name": "llama-0", "uid": "u0"},
            "type": "Warning",
            "reason": "FailedMount",
            "message": 'MountVolume.SetUp failed for volume "model" : hostPath type check failed: /m is not a directory',
        }
    )
    r = reconcile(ctx, "default", "llama", "pod")
    deg = condition(status(fake_kube), "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "VolumeMountFailed")
    assert "/m is not a directory" in deg["message"]
    assert ("Warning", "VolumeMountFailed") in [(t, reason) for t, reason, _ in r.events]


def test_network_policy_child_is_created_once_and_follows_the_settings(fake_kube):
    fake_kube.put(isvc())
    ctx = make(fake_kube)
    ctx.settings = Settings(daemon_image="img:1", network_policy=True)
    r = reconcile(ctx, "default", "llama", "create")
    assert "NetworkPolicy" in r.wrote and ("create", "NetworkPolicy", "llama") in fake_kube.writes
    pol = fake_kube.objects[("NetworkPolicy", "default", "llama")]
    assert pol["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    assert pol["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8000}]

    before = list(fake_kube.writes)
    assert reconcile(ctx, "default", "llama", "timer").wrote == []
    assert fake_kube.writes == before

    # New peers (an operator restarted with other flags) replace the policy, and only it.
    team = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    ctx.settings = Settings(daemon_image="img:1", network_policy=True, http_from=(team,))
    assert reconcile(ctx, "default", "llama", "timer").wrote == ["NetworkPolicy"]
    assert fake_kube.objects[("NetworkPolicy", "default", "llama")]["spec"]["ingress"][0]["from"] == [team]


def test_foreign_network_policy_is_not_overwritten(fake_kube):
    fake_kube.put({"kind": "NetworkPolicy", "metadata": {"name": "llama", "namespace": "default"}, "spec": {}})
    fake_kube.put(isvc())
    ctx = make(fake_kube)
    ctx.settings = Settings(daemon_image="img:1", network_policy=True)
    reconcile(ctx, "default", "llama", "create")
    deg = condition(status(fake_kube), "Degraded")
    assert deg["reason"] == "ChildConflict" and "NetworkPolicy llama already exists" in deg["message"]
    assert fake_kube.objects[("NetworkPolicy", "default", "llama")]["spec"] == {}


def test_an_unsupported_capability_is_a_degraded_condition_not_a_crash_loop(fake_kube):
    fake_kube.put(isvc(engine={"kvCacheDtype": "fp8"}))
    ctx = make(fake_kube)
    ctx.supports = supported  # the daemon's own capability list
    r = reconcile(ctx, "default", "llama", "create")
    assert r.wrote == ["status"] and children_writes(fake_kube) == []
    deg = condition(status(fake_kube), "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "InvalidSpec")
    assert "spec.engine.kvCacheDtype: an fp8 KV cache" in deg["message"]


def test_a_starting_pod_shows_its_start_up_phase_in_status(fake_kube):
    import json

    kube = FakeKube()
    kube.put(isvc(resources={"gpusPerReplica": 0}))
    asked: list[str] = []

    def ready_fetcher(url: str, timeout: float) -> str:
        asked.append(url)
        return json.dumps({"status": "not ready", "reason": "the engine is still starting: loading weights",
                           "startup": [{"phase": "loading weights", "started_s": 0.0}]})

    ctx = make(kube)
    ctx.ready_fetcher = ready_fetcher
    reconcile(ctx, "default", "llama", "create")
    settle(kube)
    pod = kube.objects[("Pod", "default", "llama-0")]
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "False"}]}
    reconcile(ctx, "default", "llama", "pod")
    (entry,) = status(kube)["placement"]
    assert entry == {"pod": "llama-0", "node": "node-1", "ready": False, "startupPhase": "loading weights"}
    assert asked == ["http://10.0.0.7:8000/ready"]
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    reconcile(ctx, "default", "llama", "pod")
    assert "startupPhase" not in status(kube)["placement"][0] and len(asked) == 1  # ready pods are not asked


def test_the_revision_each_pod_serves_is_in_its_placement_entry(fake_kube):
    fake_kube.put(isvc(model={"name": "llama", "uri": "hf://org/llama"}))
    metrics = {"text": ('pagoda:placement_info{gpus="0",numa_nodes="0",model_name="llama"} 1.0\n'
                        'pagoda:model_info{model_name="llama",source="hf://org/llama",revision="c0ffee"} 1.0\n')}
    ctx = make(fake_kube, metrics)
    reconcile(ctx, "default", "llama", "create")
    settle(fake_kube)
    reconcile(ctx, "default", "llama", "timer", autoscale=True)
    entries = status(fake_kube)["placement"]
    assert entries and all(e["modelRevision"] == "c0ffee" and e["gpus"] == ["0"] for e in entries), entries
    metrics["text"] = ""  # between scrapes (or a daemon that stops answering) the last report stands
    reconcile(ctx, "default", "llama", "timer", autoscale=True)
    assert [e["modelRevision"] for e in status(fake_kube)["placement"]] == ["c0ffee"] * len(entries)


QUOTA = ('services "llama" is forbidden: exceeded quota: no-services, requested: services=1, '
         'used: services=0, limited: services=0')


@pytest.mark.parametrize("status_code, message, reason", [
    (403, QUOTA, "QuotaExceeded"),
    (403, 'services is forbidden: User "system:serviceaccount:x:y" cannot create resource "services"', "Forbidden"),
    (500, "Internal error occurred: failed to allocate a serviceIP: range is full", "ApiServerError"),
    (503, "the server is currently unable to handle the request", "ApiServerError"),
    (429, "too many requests", "ApiServerError"),
    (410, "gone", "ApiError"),
])
def test_a_refused_child_write_is_a_degraded_condition_with_backoff(fake_kube, monkeypatch, status_code, message,
                                                                    reason):
    """A child the API server refuses for a reason other than the spec (a ResourceQuota, RBAC, a
    full Service IP range, an overloaded server): the InferenceService is Degraded with a reason
    and the server's message, one Warning Event, and the same write is not re-sent every pass
    but after 10 s, 20 s, 40 s, ...; once the write goes through, the problem is gone."""
    from pagoda_operator.kube import ApiError
    from pagoda_operator.reconcile import WRITE_BACKOFF_FIRST_S

    fake_kube.put(isvc(replicas=1))
    real_create = fake_kube.create
    refused = {"on": True, "tries": 0}

    def create(obj):
        if obj["kind"] == "Service" and refused["on"]:
            refused["tries"] += 1
            raise ApiError(status_code, "Refused", {"message": message})
        return real_create(obj)

    monkeypatch.setattr(fake_kube, "create", create)
    clock = Clock()
    ctx = make(fake_kube, clock=clock)
    r = reconcile(ctx, "default", "llama", "create")
    deg = condition(status(fake_kube), "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", reason)
    assert message in deg["message"] and "Service llama" in deg["message"]
    assert condition(status(fake_kube), "Ready")["status"] == "False"
    assert [e[:2] for e in r.events] == [("Warning", reason)]
    assert refused["tries"] == 1

    # passes within the backoff do not send it again, and post no new Event
    for _ in range(3):
        clock.t += 3
        r = reconcile(ctx, "default", "llama", "timer")
        assert r.events == []
    assert refused["tries"] == 1
    clock.t += WRITE_BACKOFF_FIRST_S  # past the first backoff: tried again, refused again
    reconcile(ctx, "default", "llama", "timer")
    assert refused["tries"] == 2
    clock.t += WRITE_BACKOFF_FIRST_S + 1  # the second backoff is twice as long
    reconcile(ctx, "default", "llama", "timer")
    assert refused["tries"] == 2
    clock.t += WRITE_BACKOFF_FIRST_S
    refused["on"] = False  # the quota was raised
    r = reconcile(ctx, "default", "llama", "timer")
    assert refused["tries"] == 2 and ("Service", "default", "llama") in fake_kube.objects
    assert condition(status(fake_kube), "Degraded")["status"] == "False"


def test_a_changed_spec_retries_a_refused_write_at_once(fake_kube, monkeypatch):
    from pagoda_operator.kube import ApiError

    fake_kube.put(isvc(replicas=1))
    real_create = fake_kube.create
    tries = []

    def create(obj):
        if obj["kind"] == "Deployment" and len(tries) < 1:
            tries.append(obj)
            raise ApiError(403, "Forbidden", {"message": QUOTA.replace("services", "pods")})
        return real_create(obj)

    monkeypatch.setattr(fake_kube, "create", create)
    ctx = make(fake_kube)
    reconcile(ctx, "default", "llama", "create")
    assert condition(status(fake_kube), "Degraded")["reason"] == "QuotaExceeded"
    obj = fake_kube.objects[("InferenceService", "default", "llama")]
    obj["spec"]["replicas"] = 2  # another Deployment is wanted: no waiting for the old one's backoff
    obj["metadata"]["generation"] += 1
    reconcile(ctx, "default", "llama", "update")
    assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["replicas"] == 2
    assert not ctx.backoff._failed  # the older content's failure went with its success
