"""spec.disaggregation.prefill.replicas: prefill engines in pods of their own. The field's bounds,
the rendered objects (prefill Deployment, the replicas' decode engine and proxy, the proxies'
list of prefill pods, the transfer key's Secret, the NetworkPolicy), the list following the
prefill pods without rolling the replicas, the status, and the other layout's objects removed
when the field changes."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from pagoda_operator import builders, disaggregation
from pagoda_operator.builders import INSTANCE_LABEL, Settings
from pagoda_operator.kube import ApiError
from pagoda_operator.reconcile import reconcile
from pagoda_operator.spec import KV_TRANSFER_PORT, InvalidSpec, Role
from pagoda_operator.watch_cache import matches
from tests.operator.operator_fakes import isvc
from tests.operator.test_disaggregation import ONE_GPU_EACH, parsed
from tests.operator.test_reconcile import children_writes, make, settle, status

APART = {"kvDiskGiB": 2, "prefill": {"replicas": 3}}


def pass_(kube, why: str = "pod") -> Any:
    return reconcile(make(kube), "default", "llama", why)


def selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def put_prefill_pods(kube, ready: list[bool], deleting: int | None = None) -> None:
    """Play the Deployment controller and kubelet for the prefill Deployment: one pod per entry,
    pod i at 10.1.0.(i + 1), Ready as given; ``deleting``: the index of one being deleted."""
    d = kube.objects[("Deployment", "default", "llama-prefill")]
    labels = d["spec"]["template"]["metadata"]["labels"]
    for key in [k for k in kube.objects if k[0] == "Pod" and k[2].startswith("llama-prefill-")]:
        del kube.objects[key]
    for i, ok in enumerate(ready):
        meta: dict[str, Any] = {"name": f"llama-prefill-{i}", "namespace": "default", "labels": labels}
        if i == deleting:
            meta["deletionTimestamp"] = "2026-11-28T10:00:00Z"
        kube.put({"kind": "Pod", "metadata": meta, "spec": {"nodeName": "node-2"},
                  "status": {"podIP": f"10.1.0.{i + 1}", "containerStatuses": [{"name": "prefill", "ready": ok}],
                             "conditions": [{"type": "Ready", "status": "True" if ok else "False"}]}})


def listed(kube) -> str:
    return kube.objects[("ConfigMap", "default", "llama-prefill-instances")]["data"]["prefill"]


# ---- the field --------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 7, 1024])
def test_prefill_replicas_within_bounds_put_the_prefill_engines_in_pods_of_their_own(replicas):
    d = parsed(disaggregation={"kvDiskGiB": 2, "prefill": {"replicas": replicas}}, **ONE_GPU_EACH).disaggregation
    assert d.prefill == Role(8100, replicas=replicas) and d.prefill_pods
    assert not parsed(disaggregation={"kvDiskGiB": 2}, **ONE_GPU_EACH).disaggregation.prefill_pods


@pytest.mark.parametrize("prefill, message", [
    ({"replicas": 0}, "spec.disaggregation.prefill.replicas must be 1 to 1024; got 0"),
    ({"replicas": -1}, "spec.disaggregation.prefill.replicas must be 1 to 1024; got -1"),
    ({"replicas": 1025}, "spec.disaggregation.prefill.replicas must be 1 to 1024; got 1025"),
    ({"replicas": 2**63}, "spec.disaggregation.prefill.replicas must be 1 to 1024"),
    ({"replicas": "2"}, "spec.disaggregation.prefill.replicas must be an integer, not str '2'"),
    ({"replicas": 1.5}, "spec.disaggregation.prefill.replicas must be an integer, not float"),
    ({"replicas": True}, "spec.disaggregation.prefill.replicas must be an integer, not bool"),
    ({"replicas": 2, "port": KV_TRANSFER_PORT}, f"prefill.port must not be {KV_TRANSFER_PORT}"),
])
def test_a_bad_prefill_replicas_is_refused_by_name(prefill, message):
    with pytest.raises(InvalidSpec) as e:
        parsed(disaggregation={"kvDiskGiB": 2, "prefill": prefill}, **ONE_GPU_EACH)
    assert message in str(e.value)


def test_decode_replicas_are_the_services_replicas_not_a_field_of_their_own():
    with pytest.raises(InvalidSpec, match=r"spec\.disaggregation\.decode\.replicas is not set here: the decode "
                                          r"engines are spec\.replicas"):
        parsed(disaggregation={"kvDiskGiB": 2, "decode": {"replicas": 2}}, **ONE_GPU_EACH)


def test_a_replica_group_over_pods_is_still_refused_and_says_what_to_use():
    with pytest.raises(InvalidSpec, match=r"podsPerReplica 1.*set spec\.disaggregation\.prefill\.replicas"):
        parsed(disaggregation=APART, resources={"gpusPerReplica": 4, "podsPerReplica": 2}, parallelism={"tensor": 2})


# ---- the objects of a pass ----------------------------------------------------------------------


def test_a_pass_renders_prefill_pods_decode_replicas_their_list_and_the_key(fake_kube):
    fake_kube.put(isvc(replicas=2, disaggregation=APART, **ONE_GPU_EACH))
    pass_(fake_kube, "create")
    objs = fake_kube.objects
    replicas = objs[("Deployment", "default", "llama")]
    prefill = objs[("Deployment", "default", "llama-prefill")]
    assert replicas["spec"]["replicas"] == 2 and prefill["spec"]["replicas"] == 3
    assert [c["name"] for c in replicas["spec"]["template"]["spec"]["containers"]] == ["decode", "proxy"]
    assert [c["name"] for c in prefill["spec"]["template"]["spec"]["containers"]] == ["prefill"]
    # nothing ready yet: the proxies' list is empty (they pass prompts to the decode engine meanwhile)
    assert listed(fake_kube) == ""
    # the list is written before the Deployment whose pods mount it
    kinds = [(k, n) for v, k, n in children_writes(fake_kube) if v == "create"]
    assert kinds.index(("ConfigMap", "llama-prefill-instances")) < kinds.index(("Deployment", "llama"))
    secret = objs[("Secret", "default", "llama-kv-transfer")]
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) == 64 and int(key, 16) >= 0  # 256 random bits, hex
    assert secret["metadata"]["ownerReferences"][0]["uid"] == objs[("InferenceService", "default", "llama")][
        "metadata"]["uid"]
    for obj in (prefill, objs[("ConfigMap", "default", "llama-prefill-instances")], secret):
        assert obj["metadata"]["ownerReferences"][0]["controller"] is True


def test_no_selector_of_the_replicas_takes_a_prefill_pod_or_the_other_way_round(fake_kube):
    fake_kube.put(isvc(disaggregation=APART, **ONE_GPU_EACH))
    pass_(fake_kube, "create")
    objs = fake_kube.objects
    replicas, prefill = objs[("Deployment", "default", "llama")], objs[("Deployment", "default", "llama-prefill")]
    prefill_labels = prefill["spec"]["template"]["metadata"]["labels"]
    decode_labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert matches(prefill_labels, selector(prefill["spec"]["selector"]["matchLabels"]))
    assert matches(decode_labels, selector(replicas["spec"]["selector"]["matchLabels"]))
    assert not matches(prefill_labels, selector(replicas["spec"]["selector"]["matchLabels"]))
    assert not matches(decode_labels, selector(prefill["spec"]["selector"]["matchLabels"]))
    assert not matches(prefill_labels, selector(objs[("Service", "default", "llama")]["spec"]["selector"]))
    assert not matches(prefill_labels, builders.selector_string("llama"))  # not among the replicas' pods
    # but of this InferenceService: its events reach the pass, and its pods are listed by it
    assert prefill_labels[INSTANCE_LABEL] == "llama"
    assert prefill_labels["app.kubernetes.io/managed-by"] == "pagoda-operator"
    assert matches(prefill_labels, disaggregation.prefill_pods_selector("llama"))


def test_the_prefill_pod_serves_blocks_under_its_pod_ip_with_the_key():
    s = parsed(disaggregation={"kvDiskGiB": 2, "prefill": {"replicas": 2, "maxNumBatchedTokens": 8192}},
               **ONE_GPU_EACH)
    pod = disaggregation.prefill_pod(s, Settings(daemon_image="img:1"), "h")
    (c,) = pod["spec"]["containers"]
    assert c["args"][-8:] == ["--kv-offload-disk-path", "/var/cache/pagoda-kv", "--kv-transfer-port", "8300",
                              "--kv-transfer-host", "$(POD_IP)", "--max-num-batched-tokens", "8192"]
    assert c["ports"] == [{"name": "http", "containerPort": 8100, "protocol": "TCP"},
                          {"name": "kv-transfer", "containerPort": 8300, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    assert env["PAGODA_KV_TRANSFER_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "llama-kv-transfer", "key": "key"}}  # not optional: no key, no start
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8100"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kv"] == {"name": "kv", "emptyDir": {"sizeLimit": "2048Mi"}}  # one tier
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert all("hostPort" not in p for p in c["ports"])


def test_the_replicas_pod_is_a_decode_engine_fetching_per_request_and_a_proxy_following_the_list():
    s = parsed(disaggregation=APART, port=9000, **ONE_GPU_EACH)
    pod = disaggregation.pod(s, Settings(daemon_image="img:1"), "h")
    decode, proxy = pod["spec"]["containers"]
    assert decode["args"][-5:] == ["2.0", "--kv-offload-disk-path", "/var/cache/pagoda-kv",
                                   "--kv-offload-disk-source", "request"]
    assert {"name": "PAGODA_KV_TRANSFER_KEY", "valueFrom": {"secretKeyRef": {
        "name": "llama-kv-transfer", "key": "key"}}} in decode["env"]
    assert proxy["args"] == ["pd-proxy", "--prefill-file", "/etc/pagoda-pd/prefill", "--decode",
                             "http://127.0.0.1:8200", "--host", "0.0.0.0", "--port", "9000"]
    assert {"name": "prefill-instances", "mountPath": "/etc/pagoda-pd", "readOnly": True} in proxy["volumeMounts"]
    assert not any("subPath" in m for m in proxy["volumeMounts"])  # a sub-path mount is never refreshed
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["prefill-instances"] == {"name": "prefill-instances",
                                            "configMap": {"name": "llama-prefill-instances"}}
    assert volumes["kv"] == {"name": "kv", "emptyDir": {"sizeLimit": "2048Mi"}}
    assert proxy["env"] == [{"name": "TMPDIR", "value": "/tmp"}]  # no key: it forwards requests only


def test_the_list_follows_ready_prefill_pods_and_rolls_nothing(fake_kube):
    fake_kube.put(isvc(replicas=2, disaggregation=APART, **ONE_GPU_EACH))
    pass_(fake_kube, "create")
    settle(fake_kube)
    put_prefill_pods(fake_kube, [True, False, True])
    template = fake_kube.objects[("Deployment", "default", "llama")]["spec"]["template"]
    pass_(fake_kube)
    assert listed(fake_kube) == "http://10.1.0.1:8100\nhttp://10.1.0.3:8100\n"
    assert status(fake_kube)["disaggregation"]["prefill"] == {"port": 8100, "gpus": 1, "replicas": 3,
                                                              "readyPods": 2}
    # a prefill pod going away, another becoming ready: the list changes, the replicas' pods do not
    put_prefill_pods(fake_kube, [True, True, True], deleting=0)
    fake_kube.writes.clear()
    pass_(fake_kube)
    assert listed(fake_kube) == "http://10.1.0.2:8100\nhttp://10.1.0.3:8100\n"
    assert fake_kube.objects[("Deployment", "default", "llama")]["spec"]["template"] == template
    assert [(v, k, n) for v, k, n in children_writes(fake_kube)] == [
        ("replace", "ConfigMap", "llama-prefill-instances")]
    # nothing changed: nothing written
    fake_kube.writes.clear()
    pass_(fake_kube)
    assert children_writes(fake_kube) == []


def test_the_key_secret_is_created_once_and_one_that_exists_is_taken(fake_kube):
    fake_kube.put(isvc(disaggregation=APART, **ONE_GPU_EACH))
    ctx = make(fake_kube)
    reconcile(ctx, "default", "llama", "create")
    key = fake_kube.objects[("Secret", "default", "llama-kv-transfer")]["data"]["key"]
    reconcile(ctx, "default", "llama", "pod")
    assert [w for w in fake_kube.writes if w[1] == "Secret"] == [("create", "Secret", "llama-kv-transfer")]
    # another operator process (after a restart): the Secret exists, its key stays
    reconcile(make(fake_kube), "default", "llama", "pod")
    assert fake_kube.objects[("Secret", "default", "llama-kv-transfer")]["data"]["key"] == key


def test_a_secret_that_cannot_be_created_is_an_event_and_the_pass_goes_on(fake_kube):
    fake_kube.put(isvc(disaggregation=APART, **ONE_GPU_EACH))
    create = fake_kube.create

    def refuse_secrets(obj):
        if obj["kind"] == "Secret":
            raise ApiError(403, 'secrets is forbidden: exceeded quota: "no-secrets"')
        return create(obj)

    fake_kube.create = refuse_secrets
    r = pass_(fake_kube, "create")
    (event,) = [e for e in r.events if e[1] == "KVTransferKeySecret"]
    assert event[0] == "Warning" and "cannot create Secret llama-kv-transfer for the KV transfer key" in event[2]
    assert ("Deployment", "default", "llama-prefill") in fake_kube.objects


def test_dropping_the_field_removes_the_prefill_pods_and_their_list(fake_kube):
    fake_kube.put(isvc(disaggregation=APART, **ONE_GPU_EACH))
    pass_(fake_kube, "create")
    obj = fake_kube.objects[("InferenceService", "default", "llama")]
    obj["spec"]["disaggregation"] = {"kvDiskGiB": 2}
    obj["metadata"]["generation"] += 1
    pass_(fake_kube, "update")
    assert ("Deployment", "default", "llama-prefill") not in fake_kube.objects
    assert ("ConfigMap", "default", "llama-prefill-instances") not in fake_kube.objects
    containers = fake_kube.objects[("Deployment", "default", "llama")]["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["prefill", "decode", "proxy"]


def test_the_network_policy_covers_the_prefill_pods_and_opens_them_to_the_services_own_pods():
    body = isvc(disaggregation=APART, **ONE_GPU_EACH)
    s = parsed(disaggregation=APART, **ONE_GPU_EACH)
    policy = builders.network_policy(s, body, Settings(network_policy=True))["spec"]
    assert policy["podSelector"] == {"matchLabels": {INSTANCE_LABEL: "llama"}}
    http, own = policy["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": 8100}]
    assert own == {"from": [{"podSelector": {"matchLabels": {INSTANCE_LABEL: "llama"}}}]}
    # one pod per replica: as before, the proxy's port only
    one_pod = builders.network_policy(parsed(disaggregation={"kvDiskGiB": 2}, **ONE_GPU_EACH), body,
                                      Settings(network_policy=True))["spec"]
    assert one_pod["podSelector"] == {"matchLabels": builders.selector_labels("llama")}
    assert [r["ports"] for r in one_pod["ingress"]] == [[{"protocol": "TCP", "port": 8000}]]


def test_a_failing_prefill_pod_is_named_in_degraded(fake_kube):
    """The replicas' pods may all run while no prefill pod can (a bad image, a key Secret that is
    not there): Degraded names the prefill pod and why, not only the proxies' 503s."""
    fake_kube.put(isvc(disaggregation=APART, **ONE_GPU_EACH))
    pass_(fake_kube, "create")
    settle(fake_kube)
    put_prefill_pods(fake_kube, [False])
    pod = fake_kube.objects[("Pod", "default", "llama-prefill-0")]
    pod["status"]["containerStatuses"] = [{
        "name": "prefill", "ready": False, "restartCount": 4,
        "state": {"waiting": {"reason": "CreateContainerConfigError",
                              "message": 'secret "llama-kv-transfer" not found'}}}]
    pass_(fake_kube)
    degraded = next(c for c in status(fake_kube)["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ContainerConfigError"
    assert degraded["message"].startswith("pod llama-prefill-0 container prefill: CreateContainerConfigError")
    assert 'secret "llama-kv-transfer" not found' in degraded["message"]
