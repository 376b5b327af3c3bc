"""Write the node's report as a cluster-scoped NodeTopology, named after the node.

The topology goes in `spec` and is replaced only when it changed, so
`metadata.generation` moves exactly when the topology does and the operator's
watch sees no noise. Every run refreshes `status.lastHeartbeatTime` (through
the status subresource, which never bumps the generation), so a stale object
means a dead agent. The `kubernetes` client is imported only by `connect`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pagoda_daemon.topology.model import NodeTopology

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "pagoda.dev", "v1alpha1", "nodetopologies", "NodeTopology"
MANAGED_BY = {"app.kubernetes.io/managed-by": "pagoda-topology-agent"}
# Report fields that describe the reporting process, not the node: kept out of spec.
PROCESS_FIELDS = ("hostname", "allowedCpus", "visibility", "warnings")
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def topology_spec(report: NodeTopology) -> dict[str, Any]:
    """The NodeTopology `spec`: the report less process fields, plus what placement asks most."""
    spec = report.to_dict()
    for key in PROCESS_FIELDS:
        spec.pop(key, None)
    for gpu in spec.get("gpus", []):
        gpu["fabricPeers"] = sorted(report.fabric_peers(gpu["index"]))
    models = sorted({g.model for g in report.gpus})
    summary: dict[str, Any] = {
        "gpuCount": len(report.gpus),
        "numaNodeCount": len(report.numa_nodes),
        "fabricAllToAll": len(report.gpus) > 1 and report.fabric_all_to_all(),
    }
    if models:
        summary["gpuModel"] = models[0] if len(models) == 1 else "mixed"
    spec["summary"] = summary
    return spec


def node_name_from_env(explicit: str | None = None) -> str:
    """The node name (downward API `spec.nodeName` as NODE_NAME); ValueError when unusable."""
    name = explicit or os.environ.get("NODE_NAME", "")
    if not name:
        raise ValueError("NODE_NAME is not set: pass spec.nodeName through the downward API or --node-name")
    if len(name) > 253 or not _NODE_NAME.fullmatch(name):
        raise ValueError(f"node name {name!r} is not a valid Kubernetes object name")
    return name


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Publisher:
    """Creates or updates one NodeTopology through a `CustomObjectsApi`-like client.

    ``status_extra`` adds fields to each status write (the node's model cache, ModelCacheKeeper);
    when it fails, the topology is published without them."""

    def __init__(self, api: Any, node_name: str, *, clock: Callable[[], str] = utc_now,
                 status_extra: Callable[[], dict[str, Any]] | None = None) -> None:
        self.api = api
        self.node_name = node_name
        self.clock = clock
        self.status_extra = status_extra

    def publish(self, report: NodeTopology) -> str:
        """Write the report; returns "created", "updated" or "unchanged" (heartbeat only)."""
        spec = topology_spec(report)
        extra = self._status_extra()  # once: a conflict retries the write, not the model cache's pass
        for attempt in range(3):
            try:
                return self._publish(spec, report, extra)
            except Exception as exc:
                if getattr(exc, "status", None) != 409 or attempt == 2:
                    raise
                log.info("topology: conflict writing NodeTopology %s; retrying", self.node_name)
        raise AssertionError("unreachable")

    def _status_extra(self) -> dict[str, Any]:
        if self.status_extra is None:
            return {}
        try:
            return self.status_extra()
        except Exception as exc:  # the topology and heartbeat go out regardless
            log.error("topology: node status extras failed: %s", exc)
            return {}

    def _publish(self, spec: dict[str, Any], report: NodeTopology, extra: dict[str, Any]) -> str:
        now = self.clock()
        current = self._get()
        if current is None:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "metadata": {"name": self.node_name, "labels": dict(MANAGED_BY)},
                "spec": spec,
            }
            current = self.api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
            action = "created"
        elif _canonical(current.get("spec")) != _canonical(spec):
            current["spec"] = spec
            current = self.api.replace_cluster_custom_object(GROUP, VERSION, PLURAL, self.node_name, current)
            action = "updated"
        else:
            action = "unchanged"

        previous = current.get("status") or {}
        current["status"] = {
            "lastHeartbeatTime": now,
            "lastUpdateTime": previous.get("lastUpdateTime", now) if action == "unchanged" else now,
            "observedGeneration": current["metadata"].get("generation", 1),
            "warnings": list(report.warnings),
        }
        if report.hostname:
            current["status"]["hostname"] = report.hostname
        current["status"].update(extra)
        self.api.replace_cluster_custom_object_status(GROUP, VERSION, PLURAL, self.node_name, current)
        return action

    def _get(self) -> dict[str, Any] | None:
        try:
            return self.api.get_cluster_custom_object(GROUP, VERSION, PLURAL, self.node_name)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise


class ModelCacheKeeper:
    """The node's model cache (chart ``modelCache``), tended at each publish: evicted down to its
    size, keeping what serving daemons hold and the newest revision of every model an
    InferenceService names, and reported as ``status.modelCache``."""

    def __init__(self, api: Any, root: str, max_bytes: int) -> None:
        self.api = api
        self.root = root
        self.max_bytes = max_bytes

    def __call__(self) -> dict[str, Any]:
        from pagoda_daemon.models.model_cache import tend

        return {"modelCache": tend(self.root, self.max_bytes, self.models_named())}

    def models_named(self) -> set[tuple[str, str]] | None:
        """(namespace, model URI) of every InferenceService; None when they cannot be listed
        (then nothing is evicted: a model in use must never go for want of the list)."""
        from pagoda_daemon.model_uri import InvalidModelUri, is_uri, parse

        try:
            listed = self.api.list_cluster_custom_object(GROUP, VERSION, "inferenceservices")
        except Exception as exc:
            log.warning("model cache: cannot list InferenceServices (%s); nothing is evicted this time",
                        getattr(exc, "reason", None) or exc)
            return None
        named = set()
        for item in listed.get("items") or []:
            uri = ((item.get("spec") or {}).get("model") or {}).get("uri")
            namespace = (item.get("metadata") or {}).get("namespace")
            if isinstance(uri, str) and isinstance(namespace, str) and is_uri(uri):
                with contextlib.suppress(InvalidModelUri):
                    named.add((namespace, str(parse(uri))))
        return named


def run_agent(
    publisher: Publisher,
    collect: Callable[[], NodeTopology],
    interval: float,
    *,
    once: bool = False,
    stop: threading.Event | None = None,
) -> int:
    """Publish every `interval` seconds until `stop` is set; with `once`, a single write.

    Discovery runs again each time (a driver upgrade or a GPU falling off the
    bus must show). API errors are logged and retried at the next tick, so a
    restarting apiserver does not kill the DaemonSet pod.
    """
    stop = stop or threading.Event()
    while True:
        try:
            action = publisher.publish(collect())
            log.info("topology: NodeTopology %s %s", publisher.node_name, action)
        except Exception as exc:
            log.error("topology: publishing NodeTopology %s failed: %s", publisher.node_name, exc)
            if once:
                return 1
        if once or stop.wait(interval):
            return 0


def connect(kubeconfig: str | None = None) -> Any:
    """A CustomObjectsApi: from `kubeconfig`, else in-cluster, else the default kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise RuntimeError("publishing needs the kubernetes client: pip install 'pagoda[daemon]'") from exc
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.CustomObjectsApi()
    return client.CustomObjectsApi(config.new_client_from_config(config_file=kubeconfig))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def publish_at_start(sysfs_root: str = "/") -> str | None:
    """What `pagoda serve` does when it starts on a Kubernetes node (NODE_NAME set): write its
    node's NodeTopology once. Any failure (no RBAC, no API server) is a warning, never fatal."""
    node = os.environ.get("NODE_NAME")
    if not node:
        return None
    try:
        from pagoda_daemon.topology.discover import discover

        result = Publisher(connect(), node).publish(discover(sysfs_root))
        log.info("NodeTopology %s: %s", node, result)
        return result
    except Exception as exc:  # the daemon serves whether or not the report could be written
        status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
        if status in (401, 403):
            # The usual case: the pod's ServiceAccount may not write NodeTopology; the chart's
            # topology agent does it. One line, not the API server's whole response.
            log.warning("not publishing NodeTopology for %s: %s %s (the topology agent publishes it)",
                        node, status, reason)
        else:
            log.warning("could not publish NodeTopology for %s: %s", node, exc)
        return None
