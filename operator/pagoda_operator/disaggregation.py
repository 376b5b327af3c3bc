"""Prefill/decode disaggregation (``spec.disaggregation``): pure functions that render a replica
as one pod of three containers, and read its roles back for the status.

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
Replicas scale whole units. The daemon can also move the blocks between hosts over TCP
(``kv_offload/transfer.py``); rendering prefill and decode pods apart is not built.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda_operator import builders
from pagoda_operator.spec import Disaggregation, Role, ServiceSpec

PREFILL, DECODE, PROXY = "prefill", "decode", "proxy"
KV_VOLUME = "kv"
# Inside the default allowlist of disk KV paths (docs/operator.md, "Admission"), and apart from
# every other mount of the pod.
KV_DIR = "/var/cache/pagoda-kv"
PREFILL_KV, DECODE_KV = posixpath.join(KV_DIR, PREFILL), posixpath.join(KV_DIR, DECODE)
# The proxy relays requests and holds no model: a small fixed share of the pod.
PROXY_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}


def _engine(spec: ServiceSpec, settings: builders.Settings, name: str, role: Role, kv_args: list[str],
            kv_mount: dict[str, Any]) -> dict[str, Any]:
    """One engine container: the daemon's own rendering on the role's port, with its KV tier."""
    d = spec.disaggregation
    assert d is not None
    c = builders.container(spec, settings, name=name, port=role.port, port_name=name)
    c["args"] += ["--kv-offload-disk-gib", repr(d.kv_disk_gib), *kv_args]
    for flag, value in (("--max-num-seqs", role.max_num_seqs), ("--max-num-batched-tokens", role.max_num_batched_tokens)):
        if value is not None:  # the command line wins over the shared engine.yaml
            c["args"] += [flag, str(value)]
    c["volumeMounts"].append(kv_mount)
    return c


def proxy_args(spec: ServiceSpec, d: Disaggregation) -> list[str]:
    """``pagoda pd-proxy`` on the Service's port, in front of both engines on loopback."""
    return ["pd-proxy", "--prefill", f"http://127.0.0.1:{d.prefill.port}",
            "--decode", f"http://127.0.0.1:{d.decode.port}", "--host", "0.0.0.0", "--port", str(spec.port)]


def proxy_container(spec: ServiceSpec, settings: builders.Settings) -> dict[str, Any]:
    """The proxy: alive while its port accepts connections (its ``/health`` asks the engines,
    which may load for many minutes), ready while both engines are (its ``/ready``)."""
    d = spec.disaggregation
    assert d is not None
    return {
        **builders.process_container(spec, settings, PROXY, proxy_args(spec, d)),
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "env": [{"name": "TMPDIR", "value": builders.TMP_DIR}],
        "resources": {k: dict(v) for k, v in PROXY_RESOURCES.items()},
        "volumeMounts": [{"name": "tmp", "mountPath": builders.TMP_DIR}],
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": builders.probe("/ready", 5, 3),
    }


def kv_volume(d: Disaggregation) -> dict[str, Any]:
    """Disk-backed (not memory: no memory limit to grow), sized for both engines' tiers."""
    return {"name": KV_VOLUME, "emptyDir": {"sizeLimit": f"{math.ceil(2 * d.kv_disk_gib * 1024)}Mi"}}


def pod(spec: ServiceSpec, settings: builders.Settings, config_hash: str) -> dict[str, Any]:
    """A replica's pod (a :data:`builders.PodRenderer`): prefill engine, decode engine, proxy."""
    d = spec.disaggregation
    assert d is not None
    prefill = _engine(spec, settings, PREFILL, d.prefill, ["--kv-offload-disk-path", PREFILL_KV],
                      {"name": KV_VOLUME, "mountPath": PREFILL_KV, "subPath": PREFILL})
    decode = _engine(spec, settings, DECODE, d.decode,
                     ["--kv-offload-disk-path", DECODE_KV, "--kv-offload-disk-source", PREFILL_KV],
                     {"name": KV_VOLUME, "mountPath": KV_DIR})
    # prefill first: the kubelet starts containers in this order (see the module's docstring)
    template = builders.pod_template(spec, settings, config_hash, [prefill, decode, proxy_container(spec, settings)])
    template["spec"]["volumes"].append(kv_volume(d))
    return template


def _container_ready(pod: Mapping[str, Any], name: str) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any(cs.get("name") == name and cs.get("ready") is True for cs in statuses)


def status(spec: ServiceSpec | None, pods: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``status.disaggregation``: each role's port and GPUs, and in how many of the pods its
    container is ready (a replica serves only when all three are: its pod is Ready then)."""
    if spec is None or spec.disaggregation is None:
        return None
    d = spec.disaggregation
    alive = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]

    def ready(name: str) -> int:
        return sum(_container_ready(p, name) for p in alive)

    return {
        "kvDiskGiB": d.kv_disk_gib,
        "prefill": {"port": d.prefill.port, "gpus": spec.gpus_per_engine, "readyPods": ready(PREFILL)},
        "decode": {"port": d.decode.port, "gpus": spec.gpus_per_engine, "readyPods": ready(DECODE)},
        "proxy": {"port": spec.port, "readyPods": ready(PROXY)},
    }
