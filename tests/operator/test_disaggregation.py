"""spec.disaggregation: parsing and every refusal, the rendered pod (prefill engine, decode engine,
pd-proxy sharing one KV emptyDir), the Service on the proxy, the status of the roles, and the
webhook's refusal of a malformed field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pagoda_operator import builders, disaggregation
from pagoda_operator.admission import Policy
from pagoda_operator.builders import Settings, children
from pagoda_operator.reconcile import reconcile
from pagoda_operator.spec import Disaggregation, InvalidSpec, Role, parse
from pagoda_operator.webhook import decide
from tests.operator.operator_fakes import every_capability, isvc
from tests.operator.test_model_sources import everyone_can, review_request
from tests.operator.test_reconcile import make, settle, status

PD = {"kvDiskGiB": 4}
ONE_GPU_EACH = {"resources": {"gpusPerReplica": 2}}


def parsed(name: str = "llama", **spec: Any):
    return parse(name, "default", isvc(name, **spec)["spec"], supports=every_capability)


def build(replicas: int = 1, **spec: Any):
    body = isvc("llama", **spec)
    s = parse("llama", "default", body["spec"], supports=every_capability)
    render = disaggregation.pod if s.disaggregation else builders.one_engine_pod
    return s, children(s, body, replicas, Settings(daemon_image="img:1"), render)


def pod_spec(kids) -> dict[str, Any]:
    return kids.workload["spec"]["template"]["spec"]


def containers(kids) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_spec(kids)["containers"]}


# ---- the field --------------------------------------------------------------------------------


def test_defaults_and_every_field():
    s = parsed(disaggregation=PD, **ONE_GPU_EACH)
    assert s.disaggregation == Disaggregation(4.0, Role(8100), Role(8200))
    assert s.gpus_per_engine == 1
    full = {"enabled": True, "kvDiskGiB": 0.5, "prefill": {"port": 9100, "maxNumSeqs": 4, "maxNumBatchedTokens": 16384},
            "decode": {"port": 9200, "maxNumSeqs": 512}}
    assert parsed(disaggregation=full, **ONE_GPU_EACH).disaggregation == Disaggregation(
        0.5, Role(9100, 4, 16384), Role(9200, 512, None))


def test_absent_or_disabled_is_the_ordinary_one_engine_service():
    assert parsed().disaggregation is None
    s = parsed(disaggregation={"enabled": False, "kvDiskGiB": 4})
    assert s.disaggregation is None and s.gpus_per_engine == 1  # gpusPerReplica 1 is valid again
    _, kids = build(disaggregation={"enabled": False, "kvDiskGiB": 4})
    assert [c["name"] for c in pod_spec(kids)["containers"]] == ["daemon"]


@pytest.mark.parametrize("value, message", [
    ({}, "spec.disaggregation.kvDiskGiB is required"),
    ({"kvDiskGiB": 0}, "spec.disaggregation.kvDiskGiB must be above 0 and at most 65536; got 0"),
    ({"kvDiskGiB": -1}, "spec.disaggregation.kvDiskGiB must be above 0 and at most 65536; got -1"),
    ({"kvDiskGiB": 65536.5}, "spec.disaggregation.kvDiskGiB must be above 0 and at most 65536; got 65536.5"),
    ({"kvDiskGiB": float("nan")}, "spec.disaggregation.kvDiskGiB must be above 0"),
    ({"kvDiskGiB": float("inf")}, "spec.disaggregation.kvDiskGiB must be above 0"),
    ({"kvDiskGiB": "4Gi"}, "spec.disaggregation.kvDiskGiB must be a number, not str '4Gi'"),
    ({"kvDiskGiB": True}, "spec.disaggregation.kvDiskGiB must be a number, not bool True"),
    ({"kvDiskGiB": 4, "enabled": "yes"}, "spec.disaggregation.enabled must be true or false, not 'yes'"),
    ({"kvDiskGiB": 4, "roles": 2}, "spec.disaggregation.roles is not a field"),
    ({"kvDiskGiB": 4, "prefill": {"port": 0}}, "spec.disaggregation.prefill.port must be 1 to 65535; got 0"),
    ({"kvDiskGiB": 4, "decode": {"port": 65536}}, "spec.disaggregation.decode.port must be 1 to 65535; got 65536"),
    ({"kvDiskGiB": 4, "decode": {"port": -5}}, "spec.disaggregation.decode.port must be 1 to 65535; got -5"),
    ({"kvDiskGiB": 4, "prefill": {"port": "8100"}}, "spec.disaggregation.prefill.port must be an integer, not str"),
    ({"kvDiskGiB": 4, "prefill": {"port": 8100.0}}, "spec.disaggregation.prefill.port must be an integer, not float"),
    ({"kvDiskGiB": 4, "prefill": {"maxNumSeqs": 0}}, "spec.disaggregation.prefill.maxNumSeqs must be 1 to 1048576"),
    ({"kvDiskGiB": 4, "decode": {"maxNumBatchedTokens": 2**20 + 1}},
     "spec.disaggregation.decode.maxNumBatchedTokens must be 1 to 1048576; got 1048577"),
    ({"kvDiskGiB": 4, "decode": {"maxNumSeqs": False}}, "spec.disaggregation.decode.maxNumSeqs must be an integer"),
    ({"kvDiskGiB": 4, "decode": {"gpus": 1}}, "spec.disaggregation.decode.gpus is not a field"),
    ({"kvDiskGiB": 4, "prefill": [8100]}, "spec.disaggregation.prefill must be an object, not list"),
    ([4], "spec.disaggregation must be an object, not list"),
])
def test_a_malformed_field_is_refused_by_name(value, message):
    with pytest.raises(InvalidSpec) as e:
        parsed(disaggregation=value, **ONE_GPU_EACH)
    assert message in str(e.value)


def test_null_fields_take_their_defaults():
    d = parsed(disaggregation={"kvDiskGiB": 4, "enabled": None, "prefill": None, "decode": {"port": None}},
               **ONE_GPU_EACH).disaggregation
    assert d == Disaggregation(4.0, Role(8100), Role(8200))


def test_the_largest_and_smallest_values_are_accepted():
    d = parsed(disaggregation={"kvDiskGiB": 65536, "prefill": {"port": 1, "maxNumSeqs": 1},
                               "decode": {"port": 65535, "maxNumBatchedTokens": 2**20}}, **ONE_GPU_EACH).disaggregation
    assert d == Disaggregation(65536.0, Role(1, 1, None), Role(65535, None, 2**20))
    assert parsed(disaggregation={"kvDiskGiB": 1e-3}, **ONE_GPU_EACH).disaggregation.kv_disk_gib == 1e-3


@pytest.mark.parametrize("spec, message", [
    ({"resources": {"gpusPerReplica": 1}},
     "spec.disaggregation needs an even resources.gpusPerReplica (got 1)"),
    ({"resources": {"gpusPerReplica": 4}},  # tensor 1 per engine, but each engine holds 2 GPUs
     "parallelism.tensor (1) × expert (1) × data (1) = 1 must equal resources.gpusPerReplica (4) / 2"),
    ({"resources": {"gpusPerReplica": 4, "podsPerReplica": 2}, "parallelism": {"tensor": 2}},
     "spec.disaggregation needs resources.podsPerReplica 1"),
    ({"resources": {"gpusPerReplica": 4}, "parallelism": {"expert": 2, "elastic": {"minExpert": 1, "maxExpert": 2}}},
     "spec.disaggregation does not combine with parallelism.elastic"),
    ({**ONE_GPU_EACH, "kvOffload": {"cpuGiB": 8}}, "spec.disaggregation renders each engine's disk KV tier itself"),
    ({**ONE_GPU_EACH, "kvOffload": {"disk": {"path": "/kv-cache", "sizeGiB": 8}}},
     "spec.disaggregation renders each engine's disk KV tier itself"),
    ({**ONE_GPU_EACH, "engine": {"enablePrefixCaching": False}},
     "spec.disaggregation needs engine.enablePrefixCaching true"),
    ({**ONE_GPU_EACH, "port": 8100},
     "spec.port (8100), spec.disaggregation.prefill.port (8100), spec.disaggregation.decode.port (8200) must differ"),
])
def test_combinations_that_cannot_work_are_refused(spec, message):
    with pytest.raises(InvalidSpec) as e:
        parsed(disaggregation=PD, **spec)
    assert message in str(e.value)


def test_the_engines_ports_must_differ_from_each_other():
    with pytest.raises(InvalidSpec, match="must differ"):
        parsed(disaggregation={**PD, "prefill": {"port": 9000}, "decode": {"port": 9000}}, **ONE_GPU_EACH)


def test_refused_while_the_daemon_cannot_offload_kv():
    body = isvc(disaggregation=PD, **ONE_GPU_EACH)["spec"]
    with pytest.raises(InvalidSpec, match=r"spec\.disaggregation: KV cache offload to host memory or disk is not"):
        parse("llama", "default", body, supports=lambda name: name != "kv_offload")


def test_cpu_and_tensor_parallel_engines_are_accepted():
    assert parsed(disaggregation=PD, resources={"gpusPerReplica": 0}).gpus_per_engine == 0
    s = parsed(disaggregation=PD, resources={"gpusPerReplica": 4}, parallelism={"tensor": 2})
    assert s.gpus_per_engine == 2 and s.gpus_per_pod == 4  # the node must hold the whole unit


# ---- the pod ----------------------------------------------------------------------------------


def test_one_pod_runs_prefill_decode_and_the_proxy_in_that_order():
    _, kids = build(2, disaggregation=PD, **ONE_GPU_EACH)
    assert kids.workload["kind"] == "Deployment" and kids.workload["spec"]["replicas"] == 2
    assert [c["name"] for c in pod_spec(kids)["containers"]] == ["prefill", "decode", "proxy"]


def test_each_engine_serves_on_its_port_with_its_kv_tier_and_limits():
    _, kids = build(disaggregation={"kvDiskGiB": 4, "prefill": {"maxNumBatchedTokens": 16384},
                                    "decode": {"port": 8300, "maxNumSeqs": 512}}, **ONE_GPU_EACH)
    c = containers(kids)
    common = ["serve", "/models/llama", "--host", "0.0.0.0"]
    tail = ["--served-model-name", "llama-3-8b", "--device", "cuda", "--config", "/etc/pagoda/engine.yaml",
            "--kv-offload-disk-gib", "4.0"]
    assert c["prefill"]["args"] == [*common, "--port", "8100", *tail, "--kv-offload-disk-path",
                                    "/var/cache/pagoda-kv/prefill", "--max-num-batched-tokens", "16384"]
    assert c["decode"]["args"] == [*common, "--port", "8300", *tail, "--kv-offload-disk-path",
                                   "/var/cache/pagoda-kv/decode", "--kv-offload-disk-source",
                                   "/var/cache/pagoda-kv/prefill", "--max-num-seqs", "512"]
    assert c["prefill"]["ports"] == [{"name": "prefill", "containerPort": 8100, "protocol": "TCP"}]
    assert c["decode"]["ports"] == [{"name": "decode", "containerPort": 8300, "protocol": "TCP"}]
    for role in ("prefill", "decode"):
        assert c[role]["command"] == ["pagoda"] and c[role]["image"] == "img:1"
        assert c[role]["startupProbe"]["httpGet"] == {"path": "/health", "port": role}
        startup = c[role]["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == 30 * 60  # loading may take that long
        assert c[role]["livenessProbe"]["httpGet"] == {"path": "/health", "port": role}
        assert c[role]["readinessProbe"]["httpGet"] == {"path": "/ready", "port": role}


def test_the_proxy_fronts_both_engines_on_loopback_on_the_service_port():
    _, kids = build(disaggregation={"kvDiskGiB": 4, "prefill": {"port": 9100}}, port=9000, **ONE_GPU_EACH)
    p = containers(kids)["proxy"]
    assert p["command"] == ["pagoda"] and p["image"] == "img:1"
    assert p["args"] == ["pd-proxy", "--prefill", "http://127.0.0.1:9100", "--decode", "http://127.0.0.1:8200",
                         "--host", "0.0.0.0", "--port", "9000"]
    assert p["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    # alive while it accepts connections (the engines may load for many minutes); ready with both engines
    assert p["livenessProbe"]["tcpSocket"] == {"port": "http"} and "startupProbe" not in p
    assert p["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert "nvidia.com/gpu" not in p["resources"].get("limits", {})
    assert p["resources"]["limits"]["memory"] == "1Gi"
    assert p["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert p["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    # the Service's target port "http" is the proxy's and nothing else's
    svc = kids.service["spec"]
    assert svc["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    named_http = [c["name"] for c in pod_spec(kids)["containers"] for port in c["ports"] if port["name"] == "http"]
    assert named_http == ["proxy"]
    assert svc["selector"] == builders.selector_labels("llama")
    assert kids.workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9000"


@pytest.mark.parametrize("gpus, tensor, each", [(2, 1, 1), (4, 2, 2), (8, 4, 4)])
def test_each_engine_holds_half_the_replicas_gpus(gpus, tensor, each):
    _, kids = build(disaggregation=PD, resources={"gpusPerReplica": gpus}, parallelism={"tensor": tensor})
    c = containers(kids)
    for role in ("prefill", "decode"):
        assert c[role]["resources"]["limits"]["nvidia.com/gpu"] == each
        assert c[role]["resources"]["requests"]["nvidia.com/gpu"] == each
    assert "nvidia.com/gpu" not in c["proxy"]["resources"]["requests"]
    assert sum(x["resources"]["limits"].get("nvidia.com/gpu", 0) for x in c.values()) == gpus
    assert kids.config_map["data"]["engine.yaml"].count(f"tensor_parallel_size: {tensor}\n") == 1


def test_cpu_engines_request_no_gpu_and_get_the_pods_memory_each():
    """Each engine gets the memory the pod's resources give, and the host memory its disk
    tier's reads land in (1 GiB, DISK_READ_AHEAD_GIB) on top."""
    _, kids = build(disaggregation=PD, resources={"gpusPerReplica": 0},
                    pod={"resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}})
    c = containers(kids)
    for role in ("prefill", "decode"):
        assert c[role]["resources"] == {"requests": {"cpu": "1", "memory": "3072Mi"}, "limits": {"memory": "5120Mi"}}
        assert "--device" in c[role]["args"] and c[role]["args"][c[role]["args"].index("--device") + 1] == "cpu"


def test_both_kv_tiers_share_one_disk_backed_volume_seen_through_one_mount_by_decode():
    _, kids = build(disaggregation={"kvDiskGiB": 2.5}, **ONE_GPU_EACH)
    volumes = {v["name"]: v for v in pod_spec(kids)["volumes"]}
    # both tiers: 2 × 2.5 GiB, on disk (a memory-backed one would count against the memory limits)
    assert volumes["kv"] == {"name": "kv", "emptyDir": {"sizeLimit": "5120Mi"}}
    c = containers(kids)
    kv = {role: [m for m in c[role]["volumeMounts"] if m["name"] == "kv"] for role in c}
    assert kv["prefill"] == [{"name": "kv", "mountPath": "/var/cache/pagoda-kv/prefill", "subPath": "prefill"}]
    assert kv["decode"] == [{"name": "kv", "mountPath": "/var/cache/pagoda-kv"}]  # hard links need one mount
    assert kv["proxy"] == []
    # the engines keep every mount of the one-engine pod, model read-only
    _, plain = build()
    plain_mounts = plain.workload["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    for role in ("prefill", "decode"):
        assert [m for m in c[role]["volumeMounts"] if m["name"] != "kv"] == plain_mounts
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in plain_mounts
    assert [v for v in pod_spec(kids)["volumes"] if v["name"] != "kv"] == plain.workload["spec"]["template"][
        "spec"]["volumes"]


def test_every_container_runs_with_least_privilege():
    _, kids = build(disaggregation=PD, **ONE_GPU_EACH)
    ps = pod_spec(kids)
    assert ps["securityContext"] == builders.pod_security_context()
    assert ps["securityContext"]["runAsNonRoot"] is True and ps["automountServiceAccountToken"] is False
    for c in ps["containers"]:
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "privileged": False, "capabilities": {"drop": ["ALL"]}}
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert all("hostPort" not in p for p in c["ports"])
    assert not any("hostPath" in v for v in ps["volumes"] if v["name"] == "kv")


def test_the_engines_get_the_api_key_and_the_users_env_and_the_proxy_neither():
    _, kids = build(disaggregation=PD, server={"apiKeySecretRef": {"name": "key"}},
                    pod={"env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}, **ONE_GPU_EACH)
    c = containers(kids)
    for role in ("prefill", "decode"):
        names = {e["name"] for e in c[role]["env"]}
        assert {"PAGODA_API_KEY", "HF_HUB_OFFLINE", "TRITON_CACHE_DIR"} <= names
    assert c["proxy"]["env"] == [{"name": "TMPDIR", "value": "/tmp"}]  # it forwards the client's key


def test_the_network_policy_opens_the_proxy_port_only():
    body = isvc(disaggregation=PD, **ONE_GPU_EACH)
    s = parse("llama", "default", body["spec"], supports=every_capability)
    kids = children(s, body, 1, Settings(daemon_image="img:1", network_policy=True), disaggregation.pod)
    assert kids.network_policy is not None
    (rule,) = kids.network_policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_a_change_of_a_role_rolls_the_pods_and_the_same_spec_does_not():
    _, a = build(disaggregation=PD, **ONE_GPU_EACH)
    _, same = build(disaggregation=copy.deepcopy(PD), **ONE_GPU_EACH)
    _, other = build(disaggregation={**PD, "decode": {"maxNumSeqs": 8}}, **ONE_GPU_EACH)
    _, plain = build()
    h = builders.HASH_ANNOTATION
    assert a.workload["metadata"]["annotations"][h] == same.workload["metadata"]["annotations"][h]
    assert a.workload["metadata"]["annotations"][h] != other.workload["metadata"]["annotations"][h]
    assert a.workload["metadata"]["annotations"][h] != plain.workload["metadata"]["annotations"][h]


# ---- a reconcile pass and the status -----------------------------------------------------------


def _container_statuses(kube, ready: dict[str, bool]) -> None:
    for key in [k for k in kube.objects if k[0] == "Pod"]:
        kube.objects[key]["status"]["containerStatuses"] = [
            {"name": name, "ready": ok, "restartCount": 0} for name, ok in ready.items()]


def test_a_pass_renders_the_unit_and_reports_its_roles(fake_kube):
    fake_kube.put(isvc(replicas=2, disaggregation=PD, **ONE_GPU_EACH))
    ctx = make(fake_kube)
    reconcile(ctx, "default", "llama", "create")
    d = fake_kube.objects[("Deployment", "default", "llama")]
    assert [c["name"] for c in d["spec"]["template"]["spec"]["containers"]] == ["prefill", "decode", "proxy"]
    assert status(fake_kube)["disaggregation"]["prefill"] == {"port": 8100, "gpus": 1, "readyPods": 0}

    settle(fake_kube)
    _container_statuses(fake_kube, {"prefill": True, "decode": False, "proxy": False})
    reconcile(ctx, "default", "llama", "pod")
    assert status(fake_kube)["disaggregation"] == {
        "kvDiskGiB": 4.0,
        "prefill": {"port": 8100, "gpus": 1, "readyPods": 2},
        "decode": {"port": 8200, "gpus": 1, "readyPods": 0},
        "proxy": {"port": 8000, "readyPods": 0},
    }


def test_an_invalid_combination_is_degraded_and_renders_nothing(fake_kube):
    fake_kube.put(isvc(disaggregation=PD, resources={"gpusPerReplica": 3}))
    reconcile(make(fake_kube), "default", "llama", "create")
    st = status(fake_kube)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "even resources.gpusPerReplica (got 3)" in degraded["message"]
    assert ("Deployment", "default", "llama") not in fake_kube.objects
    assert "disaggregation" not in st


def test_no_status_entry_without_disaggregation():
    assert disaggregation.status(parsed(), []) is None
    assert disaggregation.status(None, []) is None


# ---- admission ----------------------------------------------------------------------------------


def test_the_webhook_refuses_a_malformed_field_at_apply_time():
    spec = {"model": {"name": "m", "pvc": {"claimName": "w"}}, "disaggregation": {"kvDiskGiB": -1}}
    out = decide(review_request(spec), Policy(), everyone_can)["response"]
    assert out["allowed"] is False and out["status"]["code"] == 422
    assert "spec.disaggregation.kvDiskGiB must be above 0" in out["status"]["message"]
    spec["disaggregation"] = PD
    assert decide(review_request(spec), Policy(), everyone_can)["response"]["allowed"] is True
