"""Builders: spec -> desired ConfigMap, Service and Deployment, and the compare-before-patch rule."""

from __future__ import annotations

import copy

import pytest
import yaml

from pagoda_daemon.config import DISK_READ_AHEAD_GIB
from pagoda_operator import builders
from pagoda_operator.builders import HASH_ANNOTATION, Settings, children, merge_for_replace, needs_update
from pagoda_operator.spec import parse
from tests.operator.operator_fakes import every_capability, isvc


def build(replicas: int = 1, name: str = "llama", **spec):
    body = isvc(name, **spec)
    s = parse(name, "default", body["spec"], supports=every_capability)
    return s, children(s, body, replicas, Settings(daemon_image="img:1"))


def container(kids):
    return kids.workload["spec"]["template"]["spec"]["containers"][0]


def env_of(kids):
    return {e["name"]: e for e in container(kids)["env"]}


def test_every_child_is_owned_labelled_and_stamped():
    _, kids = build()
    for child in (kids.config_map, kids.service, kids.workload):
        meta = child["metadata"]
        assert meta["namespace"] == "default"
        (ref,) = meta["ownerReferences"]
        assert ref == {
            "apiVersion": "pagoda.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "llama",
            "uid": "uid-llama",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator"
        assert meta["labels"]["pagoda.dev/inferenceservice"] == "llama"
        assert len(meta["annotations"][HASH_ANNOTATION]) == 16


def test_deployment_runs_the_daemon_command_line():
    _, kids = build(3, port=9000)
    c = container(kids)
    assert kids.workload["spec"]["replicas"] == 3
    assert c["image"] == "img:1" and c["command"] == ["pagoda"]
    assert c["args"] == [
        "serve",
        "/models/llama",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--served-model-name",
        "llama-3-8b",
        "--device",
        "cuda",
        "--config",
        "/etc/pagoda/engine.yaml",
    ]
    assert c["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    # Probed every 2 s: Ready soon after the engine is; 30 minutes to start, ~15 s to turn unready.
    startup, ready = c["startupProbe"], c["readinessProbe"]
    assert startup["periodSeconds"] == ready["periodSeconds"] == 2
    assert startup["periodSeconds"] * startup["failureThreshold"] == 30 * 60
    assert 14 <= ready["periodSeconds"] * ready["failureThreshold"] <= 20
    assert env_of(kids)["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    tmpl = kids.workload["spec"]["template"]
    assert kids.workload["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    assert tmpl["metadata"]["annotations"]["prometheus.io/port"] == "9000"


@pytest.mark.parametrize(
    "gpus, resource, expected_limits",
    [
        (4, "nvidia.com/gpu", {"nvidia.com/gpu": 4}),
        (2, "amd.com/gpu", {"amd.com/gpu": 2}),
        (0, "nvidia.com/gpu", None),
    ],
)
def test_gpu_requests(gpus, resource, expected_limits):
    par = {"tensor": gpus} if gpus else {}
    _, kids = build(resources={"gpusPerReplica": gpus, "gpuResourceName": resource}, parallelism=par)
    res = container(kids)["resources"]
    assert res.get("limits") == expected_limits and res.get("requests") == expected_limits
    assert container(kids)["args"][container(kids)["args"].index("--device") + 1] == (
        "cuda" if gpus else "cpu"
    )


def test_pod_resource_overrides_merge_with_gpus():
    _, kids = build(
        pod={"resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}}}
    )
    assert container(kids)["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 1},
    }


@pytest.mark.parametrize(("given", "expected"), [
    ({"requests": {"memory": "64Gi"}, "limits": {"memory": "64Gi"}},
     {"requests": {"memory": "73728Mi"}, "limits": {"memory": "73728Mi"}}),
    ({"limits": {"memory": "1000M"}}, {"limits": {"memory": "9146Mi"}}),  # 953.7 Mi + 8 GiB, rounded up
    ({"requests": {"cpu": "4"}}, {"requests": {"cpu": "4"}}),  # no memory given: none invented
    ({"limits": {"memory": "1e9"}}, {"limits": {"memory": "1e9"}}),  # a form not read: left as written
])
def test_the_host_memory_kv_pool_is_added_to_the_memory_the_user_gave(given, expected):
    _, kids = build(resources={"gpusPerReplica": 0}, pod={"resources": given}, kvOffload={"cpuGiB": 8})
    assert container(kids)["resources"] == expected


def test_a_disk_tier_alone_adds_the_host_memory_its_reads_land_in():
    """The daemon reads the disk tier's hits into DISK_READ_AHEAD_GIB of host memory beside
    the steps (docs/kv-offload.md): that memory is the pod's too."""
    assert DISK_READ_AHEAD_GIB == 1.0
    _, kids = build(resources={"gpusPerReplica": 0}, pod={"resources": {"limits": {"memory": "4Gi"}}},
                    kvOffload={"disk": {"path": "/kv", "sizeGiB": 10}})
    assert container(kids)["resources"] == {"limits": {"memory": "5120Mi"}}


def test_data_parallel_engines_get_their_gpus_and_a_kv_tier_each():
    """parallelism.data: 2 renders the option, every engine's GPUs, and twice the host-memory
    pool and the disk tier (each engine has tiers of the sizes given)."""
    _, kids = build(resources={"gpusPerReplica": 4}, parallelism={"tensor": 2, "data": 2},
                    pod={"resources": {"limits": {"memory": "64Gi"}}},
                    kvOffload={"cpuGiB": 8, "disk": {"path": "/kv", "sizeGiB": 10}})
    cfg = yaml.safe_load(kids.config_map["data"]["engine.yaml"])
    assert (cfg["data_parallel_size"], cfg["tensor_parallel_size"], cfg["kv_offload_cpu_gib"]) == (2, 2, 8)
    assert container(kids)["resources"]["limits"] == {"nvidia.com/gpu": 4, "memory": f"{(64 + 16) * 1024}Mi"}
    vols = {v["name"]: v for v in kids.workload["spec"]["template"]["spec"]["volumes"]}
    assert vols["kv-offload"]["emptyDir"] == {"sizeLimit": f"{2 * 10 * 1024}Mi"}


def test_data_parallel_experts_engines_get_one_gpu_each():
    """parallelism.dataParallelExperts: the option in engine.yaml, and tensor × expert × data GPUs
    as for any data-parallel replica (each engine one)."""
    _, kids = build(resources={"gpusPerReplica": 4}, parallelism={"data": 4, "dataParallelExperts": True})
    cfg = yaml.safe_load(kids.config_map["data"]["engine.yaml"])
    assert (cfg["data_parallel_experts"], cfg["data_parallel_size"], cfg["tensor_parallel_size"],
            cfg["expert_parallel_size"]) == (True, 4, 1, 1)
    assert container(kids)["resources"]["limits"] == {"nvidia.com/gpu": 4}
    _, plain = build(resources={"gpusPerReplica": 4}, parallelism={"data": 4})
    assert "data_parallel_experts" not in yaml.safe_load(plain.config_map["data"]["engine.yaml"])
    # EPLB balances the experts over the engines (the daemon's enable_eplb with data_parallel_experts)
    _, balanced = build(resources={"gpusPerReplica": 2}, parallelism={
        "data": 2, "dataParallelExperts": True, "eplb": {"redundantExperts": 2, "stepInterval": 100, "asyncSteps": 4}})
    cfg = yaml.safe_load(balanced.config_map["data"]["engine.yaml"])
    assert (cfg["data_parallel_experts"], cfg["enable_eplb"], cfg["num_redundant_experts"], cfg["eplb_step_interval"],
            cfg["eplb_async_steps"]) == (True, True, 2, 100, 4)


def test_engine_config_in_the_config_map():
    _, kids = build(
        resources={"gpusPerReplica": 8},
        parallelism={"tensor": 2, "expert": 4, "data": 1},
        engine={
            "maxModelLen": 8192,
            "blockSize": 32,
            "maxNumSeqs": 128,
            "maxNumBatchedTokens": 4096,
            "numKvBlocks": 2048,
            "dtype": "bfloat16",
            "kvCacheDtype": "fp8",
            "gpuMemoryUtilization": 0.85,
            "enablePrefixCaching": False,
            "enforceEager": True,
            "schedulingPolicy": "priority",
        },
        kvOffload={"cpuGiB": 64, "disk": {"path": "/kv", "sizeGiB": 200}},
        placement={"numaPolicy": "none"},
        tracing={"otlpEndpoint": "http://otel:4317", "samplingRatio": 0.25},
    )
    cfg = yaml.safe_load(kids.config_map["data"]["engine.yaml"])
    assert cfg == {
        "max_model_len": 8192,
        "block_size": 32,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 4096,
        "num_kv_blocks": 2048,
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "gpu_memory_utilization": 0.85,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "scheduling_policy": "priority",
        "tensor_parallel_size": 2,
        "expert_parallel_size": 4,
        "data_parallel_size": 1,
        "numa_policy": "none",
        "otlp_traces_endpoint": "http://otel:4317",
        "kv_offload_cpu_gib": 64,
        "kv_offload_disk_path": "/kv",
        "kv_offload_disk_gib": 200,
    }
    env = env_of(kids)
    assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"
    mounts = {m["mountPath"]: m["name"] for m in container(kids)["volumeMounts"]}
    assert mounts["/kv"] == "kv-offload" and mounts["/etc/pagoda"] == "config"
    vols = {v["name"]: v for v in kids.workload["spec"]["template"]["spec"]["volumes"]}
    assert vols["kv-offload"]["emptyDir"] == {"sizeLimit": "204800Mi"}


def test_optional_engine_fields_are_left_to_the_daemon():
    _, kids = build()
    cfg = yaml.safe_load(kids.config_map["data"]["engine.yaml"])
    assert (
        "max_model_len" not in cfg and "otlp_traces_endpoint" not in cfg and "kv_offload_cpu_gib" not in cfg
        and "num_kv_blocks" not in cfg and "scheduling_policy" not in cfg
    )
    assert "OTEL_TRACES_SAMPLER" not in env_of(kids)


@pytest.mark.parametrize(
    "model, arg, volume",
    [
        (
            {"name": "m", "pvc": {"claimName": "w", "path": "a/b"}},
            "/models/a/b",
            {"persistentVolumeClaim": {"claimName": "w", "readOnly": True}},
        ),
        (
            {"name": "m", "pvc": {"claimName": "w"}},
            "/models",
            {"persistentVolumeClaim": {"claimName": "w", "readOnly": True}},
        ),
        (
            {"name": "m", "hostPath": {"path": "/data/m"}},
            "/models",
            {"hostPath": {"path": "/data/m", "type": "Directory"}},
        ),
        # No model volume: downloads would land in the writable cache emptyDir.
        ({"name": "m", "uri": "hf://Qwen/Qwen3-0.6B"}, "hf://Qwen/Qwen3-0.6B", None),
    ],
)
def test_model_sources(model, arg, volume):
    _, kids = build(model=model)
    assert container(kids)["args"][1] == arg
    vols = {v.pop("name"): v for v in kids.workload["spec"]["template"]["spec"]["volumes"]}
    assert vols.get("model") == volume
    assert vols["cache"] == {"emptyDir": {}}


def test_placement_reaches_the_pod():
    tol = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    _, kids = build(
        resources={"gpusPerReplica": 4},
        parallelism={"tensor": 4},
        placement={"nodeSelector": {"pool": "h100"}, "tolerations": tol, "requireNVLink": True},
    )
    pod = kids.workload["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "h100"} and pod["tolerations"] == tol
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {"matchExpressions": [{"key": "pagoda.dev/nvlink-gpus", "operator": "Gt", "values": ["3"]}]}
    ]


def test_user_env_overrides_ours_and_annotations_labels_merge():
    _, kids = build(
        pod={
            "env": [{"name": "HF_HOME", "value": "/x"}, {"name": "NODE_NAME", "value": "forced"}],
            "annotations": {"a": "1"},
            "labels": {"team": "ml", "app.kubernetes.io/name": "hijack"},
        },
        model={"name": "m", "uri": "hf://a/b"},
    )
    env = [e for e in container(kids)["env"] if e["name"] in ("HF_HOME", "NODE_NAME")]
    assert env == [{"name": "HF_HOME", "value": "/x"}, {"name": "NODE_NAME", "value": "forced"}]
    tmpl = kids.workload["spec"]["template"]["metadata"]
    assert tmpl["annotations"]["a"] == "1"
    assert tmpl["labels"]["team"] == "ml" and tmpl["labels"]["app.kubernetes.io/name"] == "pagoda"


def test_service_and_scale_selector():
    s, kids = build()
    assert kids.service["spec"]["selector"] == kids.workload["spec"]["selector"]["matchLabels"]
    assert kids.service["spec"]["ports"][0]["targetPort"] == "http"
    assert builders.selector_string("llama") == (
        "app.kubernetes.io/instance=llama,app.kubernetes.io/name=pagoda,pagoda.dev/inferenceservice=llama"
    )
    assert builders.endpoint(s) == "http://llama.default.svc:8000"


def test_building_twice_is_identical():
    assert build()[1] == build()[1]


def test_replicas_do_not_change_the_digest_but_the_template_does():
    _, one = build(1)
    _, three = build(3)
    h = lambda k: k.workload["metadata"]["annotations"][HASH_ANNOTATION]  # noqa: E731
    assert h(one) == h(three)
    _, other = build(1, engine={"blockSize": 32})
    assert h(other) != h(one)
    # an engine change reaches the pod template through the config digest, so pods roll
    a = one.workload["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH_ANNOTATION]
    b = other.workload["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH_ANNOTATION]
    assert a != b


def live(obj, **status):
    """What the API server returns: defaults added, resourceVersion, foreign annotations."""
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = "42"
    out["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "3"
    out["metadata"]["labels"]["added-by-someone"] = "x"
    if out["kind"] == "Deployment":
        out["spec"]["strategy"] = {"type": "RollingUpdate"}
        out["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    if out["kind"] == "Service":
        out["spec"]["clusterIP"] = "10.0.0.7"
    return out


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, False),  # same spec, apiserver defaults present: nothing to write
        ({"replicas": 2}, True),  # scaled
        ({"engine": {"blockSize": 64}}, True),
        ({"image": "img:2"}, True),
        ({"placement": {"nodeSelector": {"a": "b"}}}, True),
    ],
)
def test_needs_update(change, expected):
    _, before = build()
    replicas = change.pop("replicas", 1)
    _, after = build(replicas, **change)
    assert needs_update(after.workload, live(before.workload)) is expected
    assert needs_update(after.workload, None) is True


def test_merge_for_replace_keeps_what_others_own():
    _, kids = build()
    actual = live(kids.service)
    body = merge_for_replace(kids.service, actual)
    assert body["metadata"]["resourceVersion"] == "42"
    assert body["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"
    assert body["metadata"]["labels"]["added-by-someone"] == "x"
    assert body["spec"]["clusterIP"] == "10.0.0.7"
    assert kids.service["metadata"].get("resourceVersion") is None  # the desired object is not mutated


def test_daemon_says_why_it_died_and_leaves_endpoints_before_sigterm():
    _, kids = build()
    c = container(kids)
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(builders.PRE_STOP_DELAY_S)]
    grace = kids.workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > builders.PRE_STOP_DELAY_S


def pod_spec(kids):
    return kids.workload["spec"]["template"]["spec"]


def test_daemon_pod_runs_with_least_privilege():
    """Non-root as the images' pagoda user (uid 10001), the runtime's seccomp filter, no
    capabilities, no privilege gain, a read-only root, and no Kubernetes API credentials."""
    _, kids = build()
    pod = pod_spec(kids)
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container(kids)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["automountServiceAccountToken"] is False
    # A spec.pod.serviceAccountName (imagePullSecrets, say) still gets no token.
    _, named = build(pod={"serviceAccountName": "puller"})
    assert pod_spec(named)["serviceAccountName"] == "puller"
    assert pod_spec(named)["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    "model",
    [
        {"name": "m", "pvc": {"claimName": "w", "path": "a"}},
        {"name": "m", "hostPath": {"path": "/data/m"}},
        {"name": "m", "uri": "hf://a/b"},
    ],
)
def test_every_runtime_write_lands_on_a_writable_volume(model):
    """With a read-only root filesystem, each directory the daemon's libraries write to (Triton's
    kernel cache, Hugging Face and XDG caches, CUDA's JIT cache, temporary files with the
    engine's IPC sockets) must be inside a mount that is not read-only."""
    _, kids = build(model=model, kvOffload={"disk": {"path": "/kv", "sizeGiB": 1}})
    env = env_of(kids)
    writable = [m["mountPath"] for m in container(kids)["volumeMounts"] if not m.get("readOnly")]
    volumes = {v["name"]: v for v in pod_spec(kids)["volumes"]}
    for var in ("TRITON_HOME", "TRITON_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME", "CUDA_CACHE_PATH", "TMPDIR"):
        path = env[var]["value"]
        assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in writable), (var, path, writable)
    mounts = {m["mountPath"]: m for m in container(kids)["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert "emptyDir" in volumes[mounts["/var/cache/pagoda"]["name"]]
    # The model and the config stay read-only.
    assert mounts["/etc/pagoda"]["readOnly"] is True
    if "pvc" in model or "hostPath" in model:
        assert mounts["/models"]["readOnly"] is True


def test_api_key_comes_from_the_secret_the_spec_names():
    _, kids = build(server={"apiKeySecretRef": {"name": "llm-key", "key": "token"}})
    assert env_of(kids)["PAGODA_API_KEY"] == {
        "name": "PAGODA_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "token"}},
    }
    _, default_key = build(server={"apiKeySecretRef": {"name": "llm-key"}})
    assert env_of(default_key)["PAGODA_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "llm-key", "key": "api-key"}
    _, none = build()
    assert "PAGODA_API_KEY" not in env_of(none)
    # Probes and the metrics scrape use the paths the daemon keeps open.
    c = container(kids)
    assert {c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} <= {"/health", "/ready"}


def test_network_policy_is_a_child_only_when_the_operator_is_told():
    body = isvc("llama", port=9000)
    s = parse("llama", "default", body["spec"])
    off = children(s, body, 1, Settings())
    assert off.network_policy is None and [c["kind"] for c in off.all()] == ["ConfigMap", "Service", "Deployment"]

    on = children(s, body, 1, Settings(network_policy=True))
    pol = on.network_policy
    assert [c["kind"] for c in on.all()] == ["ConfigMap", "Service", "Deployment", "NetworkPolicy"]
    assert pol["apiVersion"] == "networking.k8s.io/v1" and pol["metadata"]["name"] == "llama"
    assert pol["metadata"]["ownerReferences"][0]["uid"] == "uid-llama" and HASH_ANNOTATION in pol["metadata"]["annotations"]
    assert pol["spec"]["podSelector"]["matchLabels"] == on.workload["spec"]["selector"]["matchLabels"]
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    # One rule: the HTTP port, from every namespace by default; every other port is closed.
    assert pol["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9000}], "from": [{"namespaceSelector": {}}]}]

    team = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    monitoring = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    narrow = children(s, body, 1, Settings(network_policy=True, http_from=(team, monitoring))).network_policy
    assert narrow["spec"]["ingress"][0]["from"] == [team, monitoring]
    assert needs_update(narrow, pol)
