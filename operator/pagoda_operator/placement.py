"""Placement from NodeTopology: which nodes can hold a replica, and where each replica landed.

A NodeTopology (cluster-scoped, one per node, named after the node, written by the daemon's
topology agent; schema in ``crds/nodetopologies.pagoda.dev.yaml``, meaning in docs/topology.md)
carries in its ``spec``: ``gpus`` (index, model, pciBusId, numaNode, memoryBytes, uuid), ``links``
(one per GPU pair a < b, type NVLINK | XGMI | PIX | PXB | PHB | NODE | SYS | UNKNOWN) and
``numaNodes``. This module reads those fields only, and never imports the daemon.

``requireNVLink`` is enforced through a node label rather than a list of host names, so that a
node joining the cluster never rolls running Deployments: the operator labels every node with
the size of its largest group of GPUs connected all-to-all by NVLink/xGMI
(:data:`NVLINK_LABEL`), and the pod template requires that label to be at least
``gpusPerReplica``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from itertools import combinations
from typing import Any

from pagoda_operator.spec import ServiceSpec

NVLINK_LABEL = "pagoda.dev/nvlink-gpus"
# Node labels naming the models a node's cache holds (model_label); the operator owns the prefix.
MODEL_LABEL_PREFIX = "models.pagoda.dev/"
# Of the scheduler's 1..100 preference weights: strong, as a cold start downloads the whole model,
# yet a preference, so a replica still starts on a node without it when that is the only room.
MODEL_CACHE_WEIGHT = 80
FABRIC_LINKS = frozenset({"NVLINK", "XGMI"})


def report(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The topology report inside a NodeTopology object (its spec; tolerant of older shapes)."""
    for key in ("spec", "status"):
        body = obj.get(key)
        if isinstance(body, Mapping) and ("gpus" in body or "numaNodes" in body):
            return body
    return obj


def node_name(obj: Mapping[str, Any]) -> str:
    body = report(obj)
    return (obj.get("metadata") or {}).get("name") or body.get("nodeName") or body.get("hostname") or ""


def gpu_indices(obj: Mapping[str, Any]) -> list[int]:
    return sorted(int(g.get("index", i)) for i, g in enumerate(report(obj).get("gpus") or []))


def fabric_pairs(obj: Mapping[str, Any]) -> set[tuple[int, int]]:
    """Unordered GPU pairs joined by NVLink or xGMI (directly or through a switch)."""
    pairs = set()
    for link in report(obj).get("links") or []:
        if str(link.get("type", "")).upper() in FABRIC_LINKS:
            a, b = int(link["a"]), int(link["b"])
            pairs.add((min(a, b), max(a, b)))
    return pairs


def nvlink_clique(obj: Mapping[str, Any]) -> int:
    """Size of the largest set of GPUs connected pairwise by NVLink/xGMI (1 with any GPU, 0 without)."""
    gpus = gpu_indices(obj)
    if not gpus:
        return 0
    pairs = fabric_pairs(obj)
    adjacent = {g: {b for a, b in pairs if a == g} | {a for a, b in pairs if b == g} for g in gpus}
    best = 1

    def expand(clique: set[int], candidates: set[int], excluded: set[int]) -> None:  # Bron-Kerbosch
        nonlocal best
        if not candidates and not excluded:
            best = max(best, len(clique))
            return
        if len(clique) + len(candidates) <= best:
            return
        for v in sorted(candidates):
            expand(clique | {v}, candidates & adjacent[v], excluded & adjacent[v])
            candidates = candidates - {v}
            excluded = excluded | {v}

    expand(set(), set(gpus), set())
    return best


def model_label(namespace: str, source: str) -> str:
    """The Node label that says a node's model cache holds ``source`` (a model URI as the cache
    records it, status.modelCache.models[].source) of ``namespace``, complete: a digest, so the
    pod template names it without the cache's contents, and a label key fits any URI's length."""
    digest = hashlib.sha256(f"{namespace}\0{source}".encode()).hexdigest()[:40]
    return f"{MODEL_LABEL_PREFIX}m-{digest}"


def node_labels(obj: Mapping[str, Any]) -> dict[str, str]:
    """Labels the operator keeps on the Node a NodeTopology describes: its NVLink clique, and one
    per model its cache holds complete (status.modelCache, written by the node's agent)."""
    labels = {NVLINK_LABEL: str(nvlink_clique(obj))}
    cache = (obj.get("status") or {}).get("modelCache") or {}
    for m in cache.get("models") or []:
        if isinstance(m, Mapping) and m.get("complete") is True and isinstance(m.get("namespace"), str) \
                and isinstance(m.get("source"), str):
            labels[model_label(m["namespace"], m["source"])] = "true"
    return labels


def capacity_error(spec: ServiceSpec, topologies: Iterable[Mapping[str, Any]]) -> str | None:
    """InvalidSpec message when no NodeTopology offers the GPUs of one pod (gpusPerReplica /
    podsPerReplica; None: fine or unknown)."""
    tops = list(topologies)
    if spec.gpus == 0 or not tops:
        return None
    most = max(len(gpu_indices(t)) for t in tops)
    if spec.gpus_per_pod > most:
        per_pod = f" / podsPerReplica ({spec.pods_per_replica})" if spec.pods_per_replica > 1 else ""
        return (
            f"resources.gpusPerReplica ({spec.gpus}){per_pod} is larger than any node offers: the largest "
            f"NodeTopology shows {most} GPUs"
        )
    return None


def eligible_nodes(spec: ServiceSpec, topologies: Iterable[Mapping[str, Any]]) -> list[str]:
    """Nodes that can hold one pod of a replica: enough GPUs, and with requireNVLink an NVLink clique that big."""
    out = []
    for t in topologies:
        enough = nvlink_clique(t) if spec.placement.require_nvlink else len(gpu_indices(t))
        if enough >= spec.gpus_per_pod:
            out.append(node_name(t))
    return sorted(out)


def affinity(spec: ServiceSpec, node_model_cache: bool = False) -> dict[str, Any] | None:
    """Node affinity: requireNVLink enforced through :data:`NVLINK_LABEL`; with a node model
    cache, a preference for nodes whose cache already holds the model (:func:`model_label`)."""
    node: dict[str, Any] = {}
    if spec.placement.require_nvlink and spec.gpus > 0:
        term = {"matchExpressions": [{"key": NVLINK_LABEL, "operator": "Gt", "values": [str(spec.gpus_per_pod - 1)]}]}
        node["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": [term]}
    if node_model_cache and spec.model.source == "uri" and spec.model.canonical_uri:
        held = {"key": model_label(spec.namespace, spec.model.canonical_uri), "operator": "Exists"}
        node["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": MODEL_CACHE_WEIGHT, "preference": {"matchExpressions": [held]}}]
    return {"nodeAffinity": node} if node else None


def numa_of(obj: Mapping[str, Any] | None, gpu_ids: Iterable[str]) -> list[int]:
    """NUMA nodes of the given GPUs (by index or UUID) according to a NodeTopology."""
    if not obj:
        return []
    wanted = {str(g) for g in gpu_ids}
    numa = set()
    for g in report(obj).get("gpus") or []:
        if str(g.get("index")) in wanted or (g.get("uuid") and g["uuid"] in wanted):
            n = g.get("numaNode")
            if n is not None and int(n) >= 0:
                numa.add(int(n))
    return sorted(numa)


def replica_placement(
    pods: Iterable[Mapping[str, Any]],
    topologies: Mapping[str, Mapping[str, Any]],
    reported: Mapping[str, Mapping[str, Any]] | None = None,
    starting: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Status entries, one per scheduled pod: node, readiness, GPUs and NUMA nodes, and for a
    pod not ready yet the start-up phase its engine reported (``starting``).

    GPUs and NUMA nodes come from what the daemon reports (``reported[pod]`` with ``gpus`` and
    ``numaNodes``, read from its ``pagoda:placement_info`` metric); NUMA nodes fall back to the
    node's NodeTopology for the reported GPUs. ``modelRevision``: the revision of an hf:// or
    s3:// model the pod's daemon resolved and serves (``pagoda:model_info``).
    """
    reported = reported or {}
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name = pod["metadata"]["name"]
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod["metadata"].get("deletionTimestamp")):
            continue
        entry: dict[str, Any] = {"pod": name, "node": node, "ready": pod_ready(pod)}
        if not entry["ready"] and (starting or {}).get(name):
            entry["startupPhase"] = (starting or {})[name]
        info = reported.get(name) or {}
        gpus = [str(g) for g in info.get("gpus") or []]
        if gpus:
            entry["gpus"] = gpus
        numa = [int(n) for n in info.get("numaNodes") or []] or numa_of(topologies.get(node), gpus)
        if numa:
            entry["numaNodes"] = numa
        if info.get("modelRevision"):
            entry["modelRevision"] = str(info["modelRevision"])
        out.append(entry)
    return out


def pod_ready(pod: Mapping[str, Any]) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def pairs_all_to_all(obj: Mapping[str, Any], gpus: Iterable[int]) -> bool:
    """True when every pair of the given GPUs is joined by NVLink/xGMI."""
    pairs = fabric_pairs(obj)
    return all((min(a, b), max(a, b)) in pairs for a, b in combinations(sorted(set(gpus)), 2))
