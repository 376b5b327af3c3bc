"""Replicas that span pods (``resources.podsPerReplica`` > 1): pure functions that render and
read a group of one leader pod and its workers.

LeaderWorkerSet's layout, with plain StatefulSets so that no other CRD or controller is needed
(where the cluster serves LeaderWorkerSets, ``leader_worker_set.py`` renders the groups as one
such object instead, from the same pod templates, ``leader_pod`` and ``worker_pod``):

- ``<name>``: the leaders' StatefulSet, one pod per replica (``<name>-<g>`` leads group g). Each
  runs ``pagoda serve`` with the API and node 0's ranks; the InferenceService's Service selects
  the leaders only.
- ``<name>-<g>``: group g's workers, podsPerReplica - 1 pods (``<name>-<g>-<i>`` is node i + 1,
  ``pagoda serve --node-rank-from-hostname``): ranks only, no API.
- ``<name>-group``: the headless Service that governs both (stable pod hostnames).

Workers meet their leader at its pod IP, which the operator reads from the leader pod and renders
into the workers' StatefulSet: no cluster DNS is needed, and a leader pod recreated with another
IP rolls its workers to the new address. A member that fails ends the processes of its whole
group (heartbeats in ``pagoda_daemon.executor.multiproc``), so the kubelet restarts them and they
re-form together; the status counts a replica ready only when every member is
(``status.Workload.of_groups``).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda_operator import builders
from pagoda_operator.builders import GROUP_LABEL, LEADER, ROLE_LABEL, WORKER
from pagoda_operator.spec import RENDEZVOUS_PORT, ServiceSpec


def group_service_name(name: str) -> str:
    return f"{name}-group"


def workers_name(name: str, group: int) -> str:
    return f"{name}-{group}"


def leader_selector(name: str) -> dict[str, str]:
    return {**builders.selector_labels(name), ROLE_LABEL: LEADER}


def worker_selector(name: str, group: int) -> dict[str, str]:
    return {**builders.selector_labels(name), ROLE_LABEL: WORKER, GROUP_LABEL: str(group)}


def role(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL)


def group_of(obj: Mapping[str, Any], name: str) -> int | None:
    """The group a leader pod (``<name>-<g>``), a worker pod or a workers' StatefulSet belongs to."""
    meta = obj.get("metadata") or {}
    if role(obj) == WORKER:
        value = (meta.get("labels") or {}).get(GROUP_LABEL, "")
    else:
        value = str(meta.get("name", "")).removeprefix(f"{name}-")
    return int(value) if value.isdigit() else None


def _alive(pod: Mapping[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp")


def leader_ips(pods: Sequence[Mapping[str, Any]], name: str) -> dict[int, str]:
    """Group -> the IP of its leader pod, for the leaders that have one."""
    out = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        group = group_of(pod, name)
        if role(pod) == LEADER and _alive(pod) and ip and group is not None:
            out[group] = ip
    return out


def group_service(spec: ServiceSpec, owner: Mapping[str, Any]) -> dict[str, Any]:
    return builders.stamp({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": builders.metadata(spec, owner, group_service_name(spec.name)),
        "spec": {
            "clusterIP": "None",
            "selector": builders.selector_labels(spec.name),
            # Members find each other while they start, before they are Ready.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "protocol": "TCP"}],
        },
    })


def _stateful_set(spec: ServiceSpec, owner: Mapping[str, Any], name: str, replicas: int,
                  selector: dict[str, str], template: dict[str, Any]) -> dict[str, Any]:
    return builders.stamp({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {**builders.metadata(spec, owner, name),
                     "labels": {**builders.labels(spec), **{k: v for k, v in selector.items()
                                                            if k in (ROLE_LABEL, GROUP_LABEL)}}},
        "spec": {
            "replicas": replicas,
            "serviceName": group_service_name(spec.name),
            "selector": {"matchLabels": selector},
            # Every member starts at once: they wait for each other anyway.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "revisionHistoryLimit": 5,
            "template": template,
        },
    })


def leader_pod(spec: ServiceSpec, settings: builders.Settings, config_hash: str) -> dict[str, Any]:
    """A group's leader: the daemon with the API and node 0's ranks, and the rendezvous port."""
    daemon = builders.container(spec, settings)
    daemon["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    return builders.pod_template(spec, settings, config_hash, [daemon], leader_selector(spec.name))


def worker_pod(spec: ServiceSpec, settings: builders.Settings, config_hash: str, rendezvous: Sequence[str],
               labels: Mapping[str, str]) -> dict[str, Any]:
    """A group's worker: the daemon container without API, probes or drain. ``rendezvous``: the
    flags that give its node rank and its leader's address (a member that cannot reach the
    leader exits, and restarts)."""
    daemon = builders.container(spec, settings)
    for key in ("startupProbe", "livenessProbe", "lifecycle"):
        daemon.pop(key)
    # Ready once its ranks joined the world and sized their KV caches: the node then accepts
    # connections on the rendezvous port number, which only the leader's store uses otherwise.
    daemon["ports"] = [{"name": "ready", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    daemon["readinessProbe"] = {"tcpSocket": {"port": "ready"}, "periodSeconds": builders.PROBE_PERIOD_S,
                                "failureThreshold": 1}
    daemon["args"] = ["serve", builders.model_argument(spec), "--device", spec.device,
                      "--config", posixpath.join(builders.CONFIG_DIR, builders.CONFIG_FILE),
                      *rendezvous, "--node-ready-port", str(RENDEZVOUS_PORT)]
    template = builders.pod_template(spec, settings, config_hash, [daemon], labels)
    template["metadata"]["annotations"] = {k: v for k, v in template["metadata"]["annotations"].items()
                                           if not k.startswith("prometheus.io/")}  # no /metrics here
    return template


def leaders(spec: ServiceSpec, owner: Mapping[str, Any], replicas: int, settings: builders.Settings,
            config_hash: str) -> dict[str, Any]:
    return _stateful_set(spec, owner, spec.name, replicas, leader_selector(spec.name),
                         leader_pod(spec, settings, config_hash))


def workers(spec: ServiceSpec, owner: Mapping[str, Any], group: int, leader_ip: str,
            settings: builders.Settings, config_hash: str) -> dict[str, Any]:
    """Group ``group``'s workers' StatefulSet: pod ``<name>-<g>-<i>`` is node i + 1
    (``--node-rank-from-hostname``) and meets the leader at ``leader_ip``."""
    selector = worker_selector(spec.name, group)
    template = worker_pod(spec, settings, config_hash, ["--node-rank-from-hostname", "--master-addr", leader_ip],
                          selector)
    return _stateful_set(spec, owner, workers_name(spec.name, group), spec.pods_per_replica - 1, selector,
                         template)


def children(spec: ServiceSpec, owner: Mapping[str, Any], replicas: int, settings: builders.Settings,
             ips: Mapping[int, str]) -> builders.Children:
    """Everything a grouped InferenceService owns, as desired now; workers only for the groups
    below ``replicas`` whose leader has an IP (``ips``, from :func:`leader_ips`)."""
    cm = builders.config_map(spec, owner)
    config_hash = builders.digest(cm["data"])
    return builders.Children(
        config_map=cm,
        service=builders.service(spec, owner),
        workload=leaders(spec, owner, replicas, settings, config_hash),
        network_policy=builders.network_policy(spec, owner, settings) if settings.network_policy else None,
        group_service=group_service(spec, owner),
        workers=tuple(workers(spec, owner, g, ip, settings, config_hash) for g, ip in sorted(ips.items())
                      if g < replicas),
    )
