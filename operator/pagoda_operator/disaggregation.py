"""Prefill/decode disaggregation (``spec.disaggregation``): pure functions that render its
engines and proxy, and read its roles back for the status. Two layouts.

**One pod per replica** (the default): three containers.

- ``prefill``: ``pagoda serve`` on its own port, half the replica's GPUs, its disk KV tier in
  ``<kv>/prefill``: it computes each prompt (the proxy asks it for one token) and its tier keeps
  the prompt's full blocks.
- ``decode``: ``pagoda serve`` on its own port, the other half, its disk KV tier in
  ``<kv>/decode`` and ``--kv-offload-disk-source <kv>/prefill``: it hard-links the prompt's
  blocks from the prefill tier instead of computing them, and generates the answer.
- ``proxy``: ``pagoda pd-proxy`` on the Service's port, reaching both engines on loopback; its
  ``/ready`` is ready only when both engines are, and its ``/metrics`` are the decode engine's.

Hard links need both tiers on one filesystem, seen through one mount: both live in one
disk-backed emptyDir (sized for both tiers), mounted whole in the decode container and as its
``prefill`` sub-directory in the prefill container. The kubelet makes a sub-path directory
before it starts the container that mounts it, and it starts a pod's containers in their order,
so the prefill directory exists before the decode engine, which refuses a missing source, starts.
Replicas scale whole units.

**Prefill pods apart** (``prefill.replicas`` set): prefill and decode engines scale apart and may
run on different nodes, as llm-d's do.

- ``<name>-prefill``: a Deployment of ``prefill.replicas`` pods (with ``prefill.autoscaling``,
  as many as its autoscaler decides: reconcile.py), each one prefill engine that
  serves its disk tier's blocks on :data:`KV_TRANSFER_PORT` and names itself by its pod IP in
  the signed header of each answer (``--kv-transfer-host $(POD_IP)``).
- ``<name>``: the replicas (the Service's pods, autoscaled like any), each a decode engine with
  ``--kv-offload-disk-source request`` (it fetches each prompt's blocks from the prefill pod
  that computed it) and the proxy, which reads the ready prefill pods' URLs from a file.
- ``<name>-prefill-instances``: the ConfigMap holding that file, written by the operator from
  the prefill pods it sees; the kubelet refreshes the mounted file and the proxy re-reads it, so
  prefill pods coming and going roll nothing. No cluster DNS or kube-proxy is needed.
- ``<name>-kv-transfer``: the Secret holding the key both roles sign and check transfers with
  (``PAGODA_KV_TRANSFER_KEY``), random, created once by the operator, which never reads it.
"""

from __future__ import annotations

import base64
import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda_operator import builders
from pagoda_operator.builders import INSTANCE_LABEL, ROLE_LABEL
from pagoda_operator.placement import pod_ready
from pagoda_operator.spec import KV_TRANSFER_PORT, Disaggregation, Role, ServiceSpec

PREFILL, DECODE, PROXY = "prefill", "decode", "proxy"
KV_VOLUME = "kv"
# Inside the default allowlist of disk KV paths (docs/operator.md, "Admission"), and apart from
# every other mount of the pod.
KV_DIR = "/var/cache/pagoda-kv"
PREFILL_KV, DECODE_KV = posixpath.join(KV_DIR, PREFILL), posixpath.join(KV_DIR, DECODE)
# The proxy relays requests and holds no model: a small fixed share of the pod.
PROXY_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}
# Prefill pods apart: the proxy's list of prefill instances (a ConfigMap's key, mounted whole so
# that the kubelet refreshes it), and the transfer key's Secret.
INSTANCES_VOLUME, INSTANCES_DIR, INSTANCES_KEY = "prefill-instances", "/etc/pagoda-pd", "prefill"
# The daemon's kv_offload.transfer_auth.KEY_ENV (the operator imports no daemon code beyond its
# declarations; tests/test_operator_daemon_contract.py checks the two agree).
TRANSFER_KEY_ENV = "PAGODA_KV_TRANSFER_KEY"
TRANSFER_SECRET_KEY = "key"


def prefill_name(name: str) -> str:
    return f"{name}-prefill"


def instances_config_map_name(name: str) -> str:
    return f"{name}-prefill-instances"


def transfer_secret_name(name: str) -> str:
    return f"{name}-kv-transfer"


def prefill_selector(name: str) -> dict[str, str]:
    """The prefill pods' labels: their own app instance, so that neither the replicas'
    Deployment, nor the Service, nor the operator's list of the replicas' pods takes them, and
    the InferenceService's label, so that their events reach its reconcile pass."""
    return {**builders.selector_labels(name), "app.kubernetes.io/instance": prefill_name(name), ROLE_LABEL: PREFILL}


def prefill_pods_selector(name: str) -> str:
    return f"{INSTANCE_LABEL}={name},{ROLE_LABEL}={PREFILL}"


def _engine(spec: ServiceSpec, settings: builders.Settings, name: str, role: Role, kv_args: list[str],
            kv_mount: dict[str, Any], port_name: str | None = None) -> dict[str, Any]:
    """One engine container: the daemon's own rendering on the role's port, with its KV tier."""
    d = spec.disaggregation
    assert d is not None
    c = builders.container(spec, settings, name=name, port=role.port, port_name=port_name or name)
    c["args"] += ["--kv-offload-disk-gib", repr(d.kv_disk_gib), *kv_args]
    for flag, value in (("--max-num-seqs", role.max_num_seqs), ("--max-num-batched-tokens", role.max_num_batched_tokens)):
        if value is not None:  # the command line wins over the shared engine.yaml
            c["args"] += [flag, str(value)]
    c["volumeMounts"].append(kv_mount)
    if d.prefill_pods:
        c["env"].append({"name": TRANSFER_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": transfer_secret_name(spec.name), "key": TRANSFER_SECRET_KEY}}})
    return c


def proxy_args(spec: ServiceSpec, d: Disaggregation) -> list[str]:
    """``pagoda pd-proxy`` on the Service's port, in front of the decode engine on loopback and
    the prefill engine there too, or with prefill pods apart those the mounted file lists."""
    prefill = (["--prefill-file", posixpath.join(INSTANCES_DIR, INSTANCES_KEY)] if d.prefill_pods
               else ["--prefill", f"http://127.0.0.1:{d.prefill.port}"])
    return ["pd-proxy", *prefill, "--decode", f"http://127.0.0.1:{d.decode.port}", "--host", "0.0.0.0",
            "--port", str(spec.port)]


def proxy_container(spec: ServiceSpec, settings: builders.Settings) -> dict[str, Any]:
    """The proxy: alive while its port accepts connections (its ``/health`` asks the engines,
    which may load for many minutes), ready while an engine of each role is (its ``/ready``)."""
    d = spec.disaggregation
    assert d is not None
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": builders.TMP_DIR}]
    if d.prefill_pods:
        mounts.append({"name": INSTANCES_VOLUME, "mountPath": INSTANCES_DIR, "readOnly": True})
    return {
        **builders.process_container(spec, settings, PROXY, proxy_args(spec, d)),
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "env": [{"name": "TMPDIR", "value": builders.TMP_DIR}],
        "resources": {k: dict(v) for k, v in PROXY_RESOURCES.items()},
        "volumeMounts": mounts,
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": builders.readiness_probe(),
    }


def kv_volume(d: Disaggregation, tiers: int = 2) -> dict[str, Any]:
    """Disk-backed (not memory: no memory limit to grow), sized for the pod's engines' tiers."""
    return {"name": KV_VOLUME, "emptyDir": {"sizeLimit": f"{math.ceil(tiers * d.kv_disk_gib * 1024)}Mi"}}


def pod(spec: ServiceSpec, settings: builders.Settings, config_hash: str) -> dict[str, Any]:
    """A replica's pod (a :data:`builders.PodRenderer`): prefill engine, decode engine, proxy; with
    prefill pods apart, the decode engine and the proxy."""
    d = spec.disaggregation
    assert d is not None
    if d.prefill_pods:
        decode = _engine(spec, settings, DECODE, d.decode,
                         ["--kv-offload-disk-path", KV_DIR, "--kv-offload-disk-source", "request"],
                         {"name": KV_VOLUME, "mountPath": KV_DIR})
        template = builders.pod_template(spec, settings, config_hash, [decode, proxy_container(spec, settings)])
        template["spec"]["volumes"] += [kv_volume(d, tiers=1), {
            "name": INSTANCES_VOLUME, "configMap": {"name": instances_config_map_name(spec.name)}}]
        return template
    prefill = _engine(spec, settings, PREFILL, d.prefill, ["--kv-offload-disk-path", PREFILL_KV],
                      {"name": KV_VOLUME, "mountPath": PREFILL_KV, "subPath": PREFILL})
    decode = _engine(spec, settings, DECODE, d.decode,
                     ["--kv-offload-disk-path", DECODE_KV, "--kv-offload-disk-source", PREFILL_KV],
                     {"name": KV_VOLUME, "mountPath": KV_DIR})
    # prefill first: the kubelet starts containers in this order (see the module's docstring)
    template = builders.pod_template(spec, settings, config_hash, [prefill, decode, proxy_container(spec, settings)])
    template["spec"]["volumes"].append(kv_volume(d))
    return template


def prefill_pod(spec: ServiceSpec, settings: builders.Settings, config_hash: str) -> dict[str, Any]:
    """A prefill pod (prefill pods apart): one engine that serves its tier's blocks on the
    transfer port and names itself there by its pod IP."""
    d = spec.disaggregation
    assert d is not None
    engine = _engine(spec, settings, PREFILL, d.prefill,
                     ["--kv-offload-disk-path", KV_DIR, "--kv-transfer-port", str(KV_TRANSFER_PORT),
                      "--kv-transfer-host", "$(POD_IP)"],
                     {"name": KV_VOLUME, "mountPath": KV_DIR}, port_name="http")
    engine["ports"].append({"name": "kv-transfer", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"})
    engine["env"].append({"name": "POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1",
                                                                       "fieldPath": "status.podIP"}}})
    template = builders.pod_template(spec, settings, config_hash, [engine], prefill_selector(spec.name))
    template["metadata"]["annotations"]["prometheus.io/port"] = str(d.prefill.port)
    template["spec"]["volumes"].append(kv_volume(d, tiers=1))
    return template


def prefill_deployment(spec: ServiceSpec, owner: Mapping[str, Any], settings: builders.Settings,
                       config_hash: str, replicas: int) -> dict[str, Any]:
    """The prefill pods' Deployment at ``replicas`` pods: prefill.replicas, or the prefill
    autoscaler's count (:func:`pagoda_operator.spec.prefill_replicas`)."""
    selector = prefill_selector(spec.name)
    return builders.stamp({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**builders.metadata(spec, owner, prefill_name(spec.name)),
                     "labels": {**builders.labels(spec), ROLE_LABEL: PREFILL}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "progressDeadlineSeconds": settings.progress_deadline_s,
            "revisionHistoryLimit": 5,
            "template": prefill_pod(spec, settings, config_hash),
        },
    })


def _alive(pod: Mapping[str, Any]) -> bool:
    return not (pod.get("metadata") or {}).get("deletionTimestamp")


def prefill_urls(spec: ServiceSpec, prefill_pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ready prefill pods' engines, sorted (the file changes only when the set does)."""
    d = spec.disaggregation
    assert d is not None
    ips = {(p.get("status") or {}).get("podIP") for p in prefill_pods if _alive(p) and pod_ready(p)}
    return sorted(f"http://{ip}:{d.prefill.port}" for ip in ips if ip)


def instances_config_map(spec: ServiceSpec, owner: Mapping[str, Any],
                         prefill_pods: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The proxy's list of prefill instances: one URL a line (``pagoda pd-proxy --prefill-file``)."""
    urls = prefill_urls(spec, prefill_pods)
    return builders.stamp({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": builders.metadata(spec, owner, instances_config_map_name(spec.name)),
        "data": {INSTANCES_KEY: "".join(f"{u}\n" for u in urls)},
    })


def prefill_children(spec: ServiceSpec, owner: Mapping[str, Any], settings: builders.Settings, config_hash: str,
                     prefill_pods: Sequence[Mapping[str, Any]], replicas: int | None) -> tuple[dict[str, Any], ...]:
    """With prefill pods apart (``replicas`` of them): their Deployment and the proxies' list of
    them (written before the replicas' Deployment, whose pods mount it); otherwise nothing."""
    d = spec.disaggregation
    if d is None or not d.prefill_pods or replicas is None:
        return ()
    return (instances_config_map(spec, owner, prefill_pods),
            prefill_deployment(spec, owner, settings, config_hash, replicas))


def transfer_secret(spec: ServiceSpec, owner: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The Secret both roles read the transfer key from, owned by the InferenceService."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": builders.metadata(spec, owner, transfer_secret_name(spec.name)),
        "type": "Opaque",
        "data": {TRANSFER_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def _container_ready(pod: Mapping[str, Any], name: str) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any(cs.get("name") == name and cs.get("ready") is True for cs in statuses)


def status(spec: ServiceSpec | None, pods: Sequence[Mapping[str, Any]],
           prefill_pods: Sequence[Mapping[str, Any]] = (), prefill_replicas: int | None = None,
           prefill_autoscaling: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``status.disaggregation``: each role's port and GPUs, and in how many pods its container
    is ready (in one pod per replica, a replica serves only when all three are: its pod is Ready
    then; with prefill pods apart, also how many prefill pods there are to be, ``prefill_replicas``,
    and their autoscaler's state)."""
    if spec is None or spec.disaggregation is None:
        return None
    d = spec.disaggregation
    alive = [p for p in pods if _alive(p)]

    def ready(name: str, among: Sequence[Mapping[str, Any]] = alive) -> int:
        return sum(_container_ready(p, name) for p in among)

    prefill: dict[str, Any] = {"port": d.prefill.port, "gpus": spec.gpus_per_engine, "readyPods": ready(PREFILL)}
    if d.prefill_pods:
        prefill.update(replicas=d.prefill.replicas if prefill_replicas is None else prefill_replicas,
                       readyPods=ready(PREFILL, [p for p in prefill_pods if _alive(p)]))
        if prefill_autoscaling is not None:
            prefill["autoscaling"] = prefill_autoscaling
    return {
        "kvDiskGiB": d.kv_disk_gib,
        "prefill": prefill,
        "decode": {"port": d.decode.port, "gpus": spec.gpus_per_engine, "readyPods": ready(DECODE)},
        "proxy": {"port": spec.port, "readyPods": ready(PROXY)},
    }
