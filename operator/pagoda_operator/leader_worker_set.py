"""Replicas that span pods as one LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``), where the
cluster serves that CRD: pure functions that render the object and read its groups' pods, and
the cached API discovery that says whether it is served.

The LeaderWorkerSet controller (a project of its own, installed apart) builds from the object the
layout ``pod_groups.py`` renders with plain StatefulSets: ``<lws>-<g>`` leads group g,
``<lws>-<g>-<i>`` (i from 1) are its workers, a group restarts as one unit
(``RecreateGroupOnPodRestart``) and rolls as one. The object is named ``<name>-group``, after the
headless Service both layouts render (the controller names its pods' subdomain after the object
and uses the Service of that name where one exists); ``<name>`` stays the API's Service.

The controller's pod webhook labels each pod with its group and worker index and sets
``LWS_LEADER_ADDRESS`` (``<lws>-<g>.<lws>.<namespace>``, the leader's DNS name through that
Service) and ``LWS_WORKER_INDEX`` in its containers; a worker takes its node rank and its
leader's address from them (``$(VAR)`` in the args, expanded by the kubelet). The hostname rule
of the StatefulSet layout (``--node-rank-from-hostname``: ordinal + 1) does not fit here: the
controller numbers a group's workers from 1, so the worker index is the node rank itself.
Both come from the kubernetes-sigs/lws source (api/leaderworkerset/v1, pkg/utils/pod).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pagoda_operator import builders, pod_groups
from pagoda_operator.builders import LEADER, ROLE_LABEL, WORKER
from pagoda_operator.spec import ServiceSpec

log = logging.getLogger("pagoda_operator")

GROUP, VERSION, PLURAL, KIND = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"
# set on every pod by the controller's webhook
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
# ours, on both pod templates: which rendering a pod was made from (the controller's own revision
# label is a hash the operator cannot compute)
TEMPLATE_HASH_ANNOTATION = "pagoda.dev/template-hash"
RECHECK_S = 60.0


def name(service: str) -> str:
    """The LeaderWorkerSet of InferenceService ``service``: named after the groups' headless Service."""
    return pod_groups.group_service_name(service)


def leader_worker_set(spec: ServiceSpec, owner: Mapping[str, Any], replicas: int, settings: builders.Settings,
                      config_hash: str) -> dict[str, Any]:
    """``replicas`` groups of ``podsPerReplica`` pods: the leader and worker pod templates of the
    StatefulSet layout; workers created with their leader's pod (they wait for each other anyway;
    ``LeaderReady`` would never start a group, whose leader is ready only once its workers joined)."""
    worker_labels = {**builders.selector_labels(spec.name), ROLE_LABEL: WORKER}
    rendezvous = ["--node-rank", f"$({WORKER_INDEX_ENV})", "--master-addr", f"$({LEADER_ADDRESS_ENV})"]
    template: dict[str, Any] = {
        "leaderTemplate": pod_groups.leader_pod(spec, settings, config_hash),
        "workerTemplate": pod_groups.worker_pod(spec, settings, config_hash, rendezvous, worker_labels),
        "size": spec.pods_per_replica,
        # a member that restarts takes its whole group down and up again (the daemons' heartbeats
        # end the others' processes anyway: this makes it one event)
        "restartPolicy": "RecreateGroupOnPodRestart",
    }
    digest = builders.digest(template)
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        pod["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = digest
    return builders.stamp({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": builders.metadata(spec, owner, name(spec.name)),
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": template,
            "startupPolicy": "LeaderCreated",
            # one group at a time, no group beyond the replicas (a spare group's GPUs rarely exist)
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    })


def children(spec: ServiceSpec, owner: Mapping[str, Any], replicas: int, settings: builders.Settings
             ) -> builders.Children:
    """The grouped InferenceService's children with the groups as one LeaderWorkerSet: those of
    ``pod_groups.children`` (ConfigMap, Services, NetworkPolicy) without its StatefulSets."""
    kids = pod_groups.children(spec, owner, replicas, settings, {})
    config_hash = builders.digest(kids.config_map["data"])
    return dataclasses.replace(kids, workload=leader_worker_set(spec, owner, replicas, settings, config_hash),
                               workers=())


def template_hash(lws: Mapping[str, Any] | None) -> str | None:
    """The rendering the live LeaderWorkerSet's pods should carry."""
    template = (((lws or {}).get("spec") or {}).get("leaderWorkerTemplate") or {}).get("workerTemplate") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION)


def members(pods: Sequence[Mapping[str, Any]], group: int) -> tuple[Mapping[str, Any] | None,
                                                                    list[Mapping[str, Any]]]:
    """Group ``group``'s leader pod (None: none yet) and its workers, by the controller's labels."""
    mine = [p for p in pods if _labels(p).get(GROUP_INDEX_LABEL) == str(group)]
    leader = next((p for p in mine if _labels(p).get(ROLE_LABEL) == LEADER), None)
    return leader, [p for p in mine if _labels(p).get(ROLE_LABEL) == WORKER]


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


class Discovery:
    """Whether the API server serves LeaderWorkerSets (``ask``: API discovery), asked at most
    once per ``recheck_s``: a CRD installed or removed changes the layout within that time. A
    failed question keeps the last answer (at first: not served) and is asked again on the next call."""

    def __init__(self, ask: Callable[[], bool], recheck_s: float = RECHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ask, self._recheck_s, self._clock = ask, recheck_s, clock
        self._guard = threading.Lock()
        self._served: bool | None = None  # None: never answered
        self._asked_at: float | None = None

    def __call__(self) -> bool:
        with self._guard:
            now = self._clock()
            if self._asked_at is None or now - self._asked_at >= self._recheck_s:
                try:
                    served = bool(self._ask())
                except Exception as e:  # the API server briefly away: keep what was known, ask again next time
                    log.warning("cannot tell whether %s is served: %s", API_VERSION, e)
                    return bool(self._served)
                self._asked_at = now
                if served != self._served:
                    log.info("%s is %s: groups of pods render as %s", API_VERSION,
                             "served" if served else "not served",
                             "one LeaderWorkerSet each" if served else "StatefulSets")
                self._served = served
            return bool(self._served)
