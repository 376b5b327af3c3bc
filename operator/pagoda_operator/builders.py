"""Pure functions: InferenceService spec + observed world -> desired child objects.

Every child is a plain dict ready for the API server, with an owner reference to the
InferenceService (so deleting it garbage-collects everything) and the annotation
:data:`HASH_ANNOTATION`: a digest of everything the operator sets except ``spec.replicas``.
The reconciler patches a child only when that digest or the replica count differs, so an
unchanged spec never writes anything (no update storms) and a changed pod template rolls the
Deployment exactly once.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from pagoda_daemon.config import offload_host_gib
from pagoda_operator import GROUP, KIND, VERSION
from pagoda_operator.elastic import admin_key_env
from pagoda_operator.placement import affinity
from pagoda_operator.spec import ServiceSpec, daemon_config, quantity_bytes

HASH_ANNOTATION = "pagoda.dev/spec-hash"
CONFIG_HASH_ANNOTATION = "pagoda.dev/config-hash"
INSTANCE_LABEL = "pagoda.dev/inferenceservice"
# podsPerReplica > 1 (pod_groups.py): a pod's role in its group, and the group of a worker.
ROLE_LABEL = "pagoda.dev/role"
GROUP_LABEL = "pagoda.dev/group"
LEADER, WORKER = "leader", "worker"
MANAGED_BY = "pagoda-operator"
CONFIG_FILE = "engine.yaml"
CONFIG_DIR = "/etc/pagoda"
MODEL_DIR = "/models"
CACHE_DIR = "/var/cache/pagoda"
MODEL_CACHE_DIR = "/var/cache/pagoda-models"  # the node cache's namespace directory, in the pod
TMP_DIR = "/tmp"
# The images' `pagoda` user (Dockerfile.cuda, Dockerfile.rocm, e2e/image/build-images.sh): the pods
# pin it by number, so runAsNonRoot holds whatever USER a custom spec.image declares.
DAEMON_UID = 10001
API_KEY_ENV = "PAGODA_API_KEY"
# Every client namespace: the default of --network-policy-http-from.
ALL_NAMESPACES: tuple[dict[str, Any], ...] = ({"namespaceSelector": {}},)
DEFAULT_IMAGE = "ghcr.io/pagoda-serving/pagoda:0.1.0"
# Seconds a terminating daemon keeps serving before it gets SIGTERM: time for the endpoints
# controller (and every proxy or client watching Endpoints) to stop sending it new requests.
PRE_STOP_DELAY_S = 5
# The kubelet probes once a period, so a pod turns Ready up to a period after its engine does:
# with a startup probe every 10 s and a readiness probe every 5 s, a tiny model's pod on the local
# cluster was Ready 2.7-10.1 s after its engine (4 restarts, 2026-11-30), as long again as the engine
# took to start; probed every 2 s, 0.0-0.9 s after (4 restarts; Ready's time has whole seconds).
# /health and /ready are answered from memory by the API process, so frequent probes cost nothing;
# the failure windows stay as they were (30 minutes to start, about 15 s to turn unready).
PROBE_PERIOD_S = 2
STARTUP_PROBE_FAILURES = 30 * 60 // PROBE_PERIOD_S
READINESS_PROBE_FAILURES = 8


@dataclass(frozen=True)
class Settings:
    """Operator-wide knobs that shape children (from the command line)."""

    daemon_image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    progress_deadline_s: int = 1800
    termination_grace_s: int = 60
    # One NetworkPolicy per InferenceService: its HTTP port open to these NetworkPolicyPeers
    # only, every other port of its pods to nobody.
    network_policy: bool = False
    http_from: tuple[dict[str, Any], ...] = ALL_NAMESPACES
    # The node's model cache (chart modelCache.nodePath): hf:// and s3:// models land there once
    # per node, one directory per namespace; "": each pod fetches into its own cache volume.
    node_model_cache: str = ""


@dataclass(frozen=True)
class Children:
    config_map: dict[str, Any]
    service: dict[str, Any]
    workload: dict[str, Any]  # the replicas: a Deployment, or the leaders' StatefulSet (pod_groups.py)
    network_policy: dict[str, Any] | None = None
    group_service: dict[str, Any] | None = None  # podsPerReplica > 1: the groups' headless Service
    workers: tuple[dict[str, Any], ...] = ()  # podsPerReplica > 1: a StatefulSet per group
    # spec.disaggregation.prefill.replicas: the proxies' list of prefill pods and their Deployment
    prefill: tuple[dict[str, Any], ...] = ()

    def all(self) -> list[dict[str, Any]]:
        """Every child to write, in the order they are applied."""
        kids = [self.config_map, self.service]
        kids += [self.group_service] if self.group_service else []
        kids += [*self.prefill, self.workload, *self.workers]
        return kids + ([self.network_policy] if self.network_policy else [])


def digest(obj: Any) -> str:
    """Stable short digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def selector_labels(name: str) -> dict[str, str]:
    """Labels that pick an InferenceService's pods (immutable Deployment selector)."""
    return {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": name, INSTANCE_LABEL: name}


def labels(spec: ServiceSpec) -> dict[str, str]:
    return {
        **selector_labels(spec.name),
        "app.kubernetes.io/component": "inference",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector_string(name: str) -> str:
    """``status.selector`` for the scale subresource (what an HPA uses to find the pods)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def endpoint(spec: ServiceSpec) -> str:
    return f"http://{spec.name}.{spec.namespace}.svc:{spec.port}"


def config_map_name(spec: ServiceSpec) -> str:
    return f"{spec.name}-config"


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def model_argument(spec: ServiceSpec) -> str:
    m = spec.model
    if m.source == "uri":
        assert m.uri is not None
        return m.uri
    if m.source == "pvc" and m.path.strip("/"):
        return posixpath.join(MODEL_DIR, m.path.strip("/"))
    return MODEL_DIR


def daemon_args(spec: ServiceSpec, port: int | None = None) -> list[str]:
    """Arguments after the ``pagoda`` entrypoint; engine options come from the mounted config.
    ``port``: where the engine serves, when it is not the Service's (spec.disaggregation)."""
    return [
        "serve",
        model_argument(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(spec.port if port is None else port),
        "--served-model-name",
        spec.model.name,
        "--device",
        spec.device,
        "--config",
        posixpath.join(CONFIG_DIR, CONFIG_FILE),
    ]


def metadata(spec: ServiceSpec, owner: Mapping[str, Any], name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": spec.namespace,
        "labels": labels(spec),
        "ownerReferences": [owner_reference(owner)],
    }


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Add the spec-hash annotation: digest of the object without replicas or the annotation."""
    body = json.loads(json.dumps(obj))
    body.get("spec", {}).pop("replicas", None)
    obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest(body)
    return obj


def config_map(spec: ServiceSpec, owner: Mapping[str, Any]) -> dict[str, Any]:
    text = yaml.safe_dump(daemon_config(spec), sort_keys=True)
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": metadata(spec, owner, config_map_name(spec)),
            "data": {CONFIG_FILE: text},
        }
    )


def service(spec: ServiceSpec, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The API: every pod, or with podsPerReplica > 1 the leader of each group."""
    selector = selector_labels(spec.name)
    if spec.pods_per_replica > 1:
        selector[ROLE_LABEL] = LEADER
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata(spec, owner, spec.name),
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    )


def _env(spec: ServiceSpec, settings: Settings) -> list[dict[str, Any]]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": "NODE_NAME", **field_ref("spec.nodeName")},
        {"name": "POD_NAME", **field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": "PAGODA_INFERENCESERVICE", "value": spec.name},
        *cache_env(),
    ]
    if spec.model.source == "uri":
        env.append({"name": "PAGODA_CACHE_DIR", "value": MODEL_CACHE_DIR if settings.node_model_cache else CACHE_DIR})
        env += model_source_env(spec)
    elif spec.lora is not None and spec.lora.adapters:  # fetched adapters land in the writable cache volume
        env.append({"name": "PAGODA_CACHE_DIR", "value": CACHE_DIR})
    key = spec.api_key_secret
    if key is not None:
        env.append(
            {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}}}
        )
    if spec.parallelism.elastic is not None:  # the operator's key to the daemon's admin routes (elastic.py)
        env.append(admin_key_env(spec))
    if spec.tracing.otlp_endpoint:
        env += [
            {"name": "OTEL_SERVICE_NAME", "value": f"pagoda-{spec.name}"},
            {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
            {"name": "OTEL_TRACES_SAMPLER_ARG", "value": repr(float(spec.tracing.sampling_ratio))},
        ]
    user = [dict(e) for e in spec.pod.env]
    overridden = {e["name"] for e in user}
    return [e for e in env if e["name"] not in overridden] + user


# The standard variables of each remote source's client: the keys of spec.model.credentials'
# Secret, read by the pod (optional: a public model needs none), and where its endpoint and
# region go.
CREDENTIAL_KEYS = {"hf": ("HF_TOKEN",), "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")}
ENDPOINT_ENV = {"hf": "HF_ENDPOINT", "s3": "AWS_ENDPOINT_URL"}
REGION_ENV = "AWS_REGION"


def model_source_env(spec: ServiceSpec) -> list[dict[str, Any]]:
    """What the daemon needs to fetch an hf:// or s3:// model: the credentials as references to
    the user's Secret (the kubelet reads it, never the operator), the endpoint, the region."""
    m = spec.model
    scheme = m.scheme or ""
    env: list[dict[str, Any]] = []
    if m.credentials_secret:
        env += [
            {
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": m.credentials_secret, "key": key, "optional": True}},
            }
            for key in CREDENTIAL_KEYS.get(scheme, ())
        ]
    if m.endpoint and scheme in ENDPOINT_ENV:
        env.append({"name": ENDPOINT_ENV[scheme], "value": m.endpoint})
    if m.region and scheme == "s3":
        env.append({"name": REGION_ENV, "value": m.region})
    return env


def cache_env() -> list[dict[str, str]]:
    """Where the daemon's libraries write at run time, all under the writable cache emptyDir
    (the root filesystem is read-only): Triton's compiled kernels and its driver helper, Hugging
    Face's files, torch's and other XDG caches, CUDA's PTX JIT cache. Temporary files (the
    engine's IPC sockets, compiler scratch) go to the /tmp emptyDir."""
    return [
        {"name": "TRITON_HOME", "value": CACHE_DIR},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/hf"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "CUDA_CACHE_PATH", "value": f"{CACHE_DIR}/nv"},
        {"name": "TMPDIR", "value": TMP_DIR},
    ]


def _resources(spec: ServiceSpec) -> dict[str, Any]:
    out: dict[str, dict[str, Any]] = {
        k: dict(v) for k, v in spec.pod.resources.items() if k in ("requests", "limits")
    }
    if spec.gpus > 0:  # each engine container its own share (two per pod with spec.disaggregation)
        for k in ("requests", "limits"):
            out.setdefault(k, {})[spec.gpu_resource] = spec.gpus_per_engine // spec.pods_per_replica
    # KV offload's host memory is allocated up front (pinned on GPUs, never swapped): the host
    # tier, or with a disk tier alone (spec.disaggregation renders one for each engine) the slots
    # its reads land in. A memory request or limit the user gave is for the engine without it,
    # so the pool is added on top (each data-parallel engine has one).
    disk_tier = spec.kv_offload.disk_path is not None or spec.disaggregation is not None
    pool = int(offload_host_gib(spec.kv_offload.cpu_gib or 0.0, disk_tier) * 2**30) * spec.parallelism.data
    for k in ("requests", "limits"):
        given = quantity_bytes(out.get(k, {}).get("memory")) if "memory" in out.get(k, {}) else None
        if pool and given is not None:
            out[k]["memory"] = f"{math.ceil((given + pool) / 2**20)}Mi"
    return out


def _volumes(spec: ServiceSpec, settings: Settings) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(spec)}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {"name": "tmp", "emptyDir": {}},
        # Per pod; a fetched model (hf://, s3://) lands here too when there is no node cache.
        {"name": "cache", "emptyDir": {"sizeLimit": spec.model.cache_size} if spec.model.cache_size else {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    m = spec.model
    if m.source == "uri" and settings.node_model_cache:
        volumes.append(node_model_cache_volume(settings.node_model_cache))
        # Only this namespace's part of the node cache (the kubelet makes it with the root's mode,
        # 1777, set by the topology agent): replicas and InferenceServices of one namespace share
        # their downloads, other namespaces' models stay out of reach.
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR, "subPath": spec.namespace})
    if m.source == "pvc":
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": m.claim_name, "readOnly": m.read_only}}
        )
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": m.read_only})
    elif m.source == "hostPath":
        volumes.append({"name": "model", "hostPath": {"path": m.path, "type": "Directory"}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    kv = spec.kv_offload
    if kv.disk_path:
        empty: dict[str, Any] = {}
        if kv.disk_gib:
            empty["sizeLimit"] = f"{int(kv.disk_gib * 1024) * spec.parallelism.data}Mi"  # a tier per engine
        volumes.append({"name": "kv-offload", "emptyDir": empty})
        mounts.append({"name": "kv-offload", "mountPath": kv.disk_path})
    return volumes, mounts


def node_model_cache_volume(path: str) -> dict[str, Any]:
    return {"name": "model-cache", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}


def pod_security_context() -> dict[str, Any]:
    """Non-root by number, the runtime's default seccomp filter; volumes group-owned by the
    daemon's group, changed only when their root does not match (large model PVCs mount fast)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": DAEMON_UID,
        "runAsGroup": DAEMON_UID,
        "fsGroup": DAEMON_UID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """No capabilities, no setuid gain, nothing written outside the emptyDirs (:func:`_volumes`)."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }


def probe(path: str, period: int, failures: int, port: str = "http") -> dict[str, Any]:
    """An HTTP probe of ``path`` on the container port named ``port``."""
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def readiness_probe(port: str = "http") -> dict[str, Any]:
    """/ready every PROBE_PERIOD_S: in the Service's endpoints soon after the engine is ready."""
    return probe("/ready", PROBE_PERIOD_S, READINESS_PROBE_FAILURES, port)


def process_container(spec: ServiceSpec, settings: Settings, name: str, args: list[str]) -> dict[str, Any]:
    """What every container of a daemon pod shares, whatever ``pagoda`` command it runs: the
    image, least privilege, drain on stop, its last words in the pod status."""
    return {
        "name": name,
        "image": spec.image or settings.daemon_image,
        "imagePullPolicy": spec.image_pull_policy or settings.image_pull_policy,
        "command": ["pagoda"],
        "args": args,
        # A daemon that exits on bad input says why on stderr ("pagoda serve: model path ... has
        # no config.json"); this puts the end of its log into the pod status, where the operator
        # reads it into the Degraded condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Zero-downtime rolls and scale-downs: keep serving while the pod leaves the endpoints.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_DELAY_S)]}}},
        "securityContext": container_security_context(),
    }


def container(spec: ServiceSpec, settings: Settings, name: str = "daemon", port: int | None = None,
              port_name: str = "http") -> dict[str, Any]:
    """An engine container (``pagoda serve``): API port, probes, drain on stop. By default the
    one daemon of a replica's (leader) pod; spec.disaggregation's engines pass their own ``name``,
    ``port`` and ``port_name`` (disaggregation.py)."""
    _, mounts = _volumes(spec, settings)
    return {
        **process_container(spec, settings, name, daemon_args(spec, port)),
        "ports": [{"name": port_name, "containerPort": spec.port if port is None else port, "protocol": "TCP"}],
        "env": _env(spec, settings),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # Model loading and warm-up can take many minutes: liveness waits for the startup probe.
        "startupProbe": probe("/health", PROBE_PERIOD_S, STARTUP_PROBE_FAILURES, port_name),
        "livenessProbe": probe("/health", 10, 3, port_name),
        "readinessProbe": readiness_probe(port_name),
    }


def pod_template(
    spec: ServiceSpec, settings: Settings, config_hash: str, containers: Sequence[dict[str, Any]],
    extra_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod of this InferenceService around its ``containers`` (the daemon; with
    spec.disaggregation two engines and their proxy): volumes, least privilege, placement, the
    user's pod overrides."""
    volumes, _ = _volumes(spec, settings)
    pod_spec: dict[str, Any] = {
        "containers": list(containers),
        "volumes": volumes,
        "securityContext": pod_security_context(),
        # The daemon calls no Kubernetes API: the topology agent publishes NodeTopology (the
        # daemon's own attempt at start is best effort and only logs a warning without a token).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_s,
    }
    pl = spec.placement
    if pl.node_selector:
        pod_spec["nodeSelector"] = dict(pl.node_selector)
    if pl.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in pl.tolerations]
    aff = affinity(spec, node_model_cache=bool(settings.node_model_cache))
    if aff:
        pod_spec["affinity"] = aff
    if spec.pod.service_account_name:
        pod_spec["serviceAccountName"] = spec.pod.service_account_name
    if spec.pod.priority_class_name:
        pod_spec["priorityClassName"] = spec.pod.priority_class_name
    pod_labels = {**spec.pod.labels, **labels(spec), **(extra_labels or {})}
    pod_annotations = {
        **spec.pod.annotations,
        CONFIG_HASH_ANNOTATION: config_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.port),
        "prometheus.io/path": "/metrics",
    }
    return {"metadata": {"labels": pod_labels, "annotations": pod_annotations}, "spec": pod_spec}


# A pod template renderer: (spec, settings, config hash) -> the Deployment's template.
PodRenderer = Callable[[ServiceSpec, Settings, str], dict[str, Any]]


def one_engine_pod(spec: ServiceSpec, settings: Settings, config_hash: str) -> dict[str, Any]:
    """The pod of a replica served by one daemon."""
    return pod_template(spec, settings, config_hash, [container(spec, settings)])


def deployment(
    spec: ServiceSpec,
    owner: Mapping[str, Any],
    replicas: int,
    settings: Settings,
    config_hash: str,
    render_pod: PodRenderer = one_engine_pod,
) -> dict[str, Any]:
    return stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": metadata(spec, owner, spec.name),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": selector_labels(spec.name)},
                "progressDeadlineSeconds": settings.progress_deadline_s,
                "revisionHistoryLimit": 5,
                "template": render_pod(spec, settings, config_hash),
            },
        }
    )


def network_policy(spec: ServiceSpec, owner: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """Ingress to the daemon pods: the HTTP port (API, probes, /metrics) from ``settings.http_from``;
    with podsPerReplica > 1 or prefill pods apart every port from the InferenceService's own pods
    (the ranks' store and gloo/NCCL sockets; the prefill engines' API and KV transfer port); every other port (KV events, anything a custom image opens) from nowhere.
    Egress is not limited."""
    d = spec.disaggregation
    prefill_pods = d is not None and d.prefill_pods
    # With prefill pods apart (disaggregation.py) the policy covers them too: their engine's HTTP
    # port as the Service's (its API, probes and /metrics), every port from this InferenceService's
    # own pods (the proxies ask the engine, the decode engines fetch KV blocks).
    pods = {INSTANCE_LABEL: spec.name} if prefill_pods else selector_labels(spec.name)
    http_ports = [spec.port, d.prefill.port] if d is not None and prefill_pods else [spec.port]
    ingress: list[dict[str, Any]] = [
        {"ports": [{"protocol": "TCP", "port": p} for p in http_ports],
         "from": [dict(peer) for peer in settings.http_from]}
    ]
    if spec.pods_per_replica > 1 or prefill_pods:
        ingress.append({"from": [{"podSelector": {"matchLabels": pods}}]})
    return stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata(spec, owner, spec.name),
            "spec": {
                "podSelector": {"matchLabels": pods},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
    )


def children(spec: ServiceSpec, owner: Mapping[str, Any], replicas: int, settings: Settings,
             render_pod: PodRenderer = one_engine_pod) -> Children:
    """Everything one InferenceService owns, as desired now (``render_pod``: its Deployment's pod,
    by default one daemon's)."""
    cm = config_map(spec, owner)
    return Children(
        config_map=cm,
        service=service(spec, owner),
        workload=deployment(spec, owner, replicas, settings, digest(cm["data"]), render_pod),
        network_policy=network_policy(spec, owner, settings) if settings.network_policy else None,
    )


def needs_update(desired: Mapping[str, Any], actual: Mapping[str, Any] | None) -> bool:
    """Compare before patch: True when the child is missing, its digest differs, or replicas differ."""
    if actual is None:
        return True
    want = desired["metadata"]["annotations"][HASH_ANNOTATION]
    have = ((actual.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)
    if want != have:
        return True
    if "replicas" in desired.get("spec", {}):
        return desired["spec"]["replicas"] != (actual.get("spec") or {}).get("replicas")
    return False


def merge_for_replace(desired: Mapping[str, Any], actual: Mapping[str, Any]) -> dict[str, Any]:
    """The body to PUT: ours, keeping what others own on the live object.

    Keeps resourceVersion (optimistic concurrency), foreign labels and annotations (e.g. the
    Deployment controller's revision), and a Service's allocated clusterIP.
    """
    body = json.loads(json.dumps(desired))
    meta = actual.get("metadata") or {}
    body["metadata"]["resourceVersion"] = meta.get("resourceVersion")
    body["metadata"]["labels"] = {**(meta.get("labels") or {}), **body["metadata"].get("labels", {})}
    body["metadata"]["annotations"] = {
        **(meta.get("annotations") or {}),
        **body["metadata"].get("annotations", {}),
    }
    if body.get("kind") == "Service":
        live = actual.get("spec") or {}
        for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if key in live:
                body["spec"][key] = live[key]
    return body
