"""Thin kopf handlers: each one names a trigger and calls :func:`reconcile.reconcile`.

Handlers are registered on a fresh :class:`kopf.OperatorRegistry` built at start-up (nothing is
registered at import time), so the timer interval comes from the command line and tests can
build their own registry.

- create / update / resume of an InferenceService: reconcile (kopf retries on errors);
- a ticker thread, every ``interval`` seconds, for every InferenceService: scrape ``/metrics``,
  take an autoscaler step, reconcile (this is also the periodic resync that repairs drift). It is
  not a ``kopf.timer`` on purpose: kopf puts a finalizer on every object a timer serves, and then
  deleting an InferenceService would hang whenever the operator is not running;
- events of managed Deployments and pods: reconcile the owner, so status follows the rollout;
- events of managed LeaderWorkerSets: the same, while API discovery finds their CRD installed,
  through a watch of our own (optional_watch.py says why not kopf's). Nothing depends on it but
  how soon a pass follows the controller's status: passes read the LeaderWorkerSet from the API
  server, not from the watch-fed cache;
- events of NodeTopology: keep the NVLink label of the node in step.

No handler needs a finalizer, so the operator never blocks deletion: owner references let the
garbage collector remove the children.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import kopf

from pagoda_operator import GROUP, PLURAL, TOPOLOGY_PLURAL, VERSION, memory
from pagoda_operator import leader_worker_set as lws
from pagoda_operator.builders import INSTANCE_LABEL, MANAGED_BY
from pagoda_operator.kube import ApiError, Kube, in_cluster_server
from pagoda_operator.optional_watch import OptionalWatch
from pagoda_operator.pass_pool import PassPool
from pagoda_operator.placement import MODEL_LABEL_PREFIX, NVLINK_LABEL, node_labels
from pagoda_operator.reconcile import Context, Result, Retry, reconcile
from pagoda_operator.telemetry import HEARTBEATS, Heartbeats, forget
from pagoda_operator.watch_cache import MANAGED_SELECTOR, CachedKube

log = logging.getLogger("pagoda_operator")
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY, INSTANCE_LABEL: kopf.PRESENT}
OWNED_SELECTOR = f"{MANAGED_SELECTOR},{INSTANCE_LABEL}"  # MANAGED as a label selector
# /healthz answers 503 (and the liveness probe restarts the operator) when kopf's event loop has
# not run a 5 s heartbeat task for a minute, or when a periodic pass has not finished for ten
# intervals plus two minutes (a pass over 1,000 InferenceServices on a busy API server is slow,
# not stuck; docs/benchmarks/2026-11-25-operator-scale.md).
LOOP_BEAT = "kopf event loop"
LOOP_BEAT_S, LOOP_STUCK_AFTER_S = 5.0, 60.0
PASS_BEAT = "periodic pass"


# kopf's own threads: they run only the handlers left synchronous (NodeTopology's, which labels
# nodes, and the login); reconcile passes run on the PassPool's ``--workers`` threads
KOPF_THREADS = 2


def operator_settings(
    settings: kopf.OperatorSettings | None = None, workers: int = 8
) -> kopf.OperatorSettings:
    """kopf settings: our own annotations for kopf's bookkeeping, quiet events, no peering."""
    settings = settings or kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="operator.pagoda.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="operator.pagoda.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "pagoda-operator"
    settings.execution.max_workers = KOPF_THREADS
    # Objects kopf works on at once. Unbounded, a burst of creates had each object's worker patch
    # at once, and kopf's HTTP pool kept a TLS connection (128 KiB of buffers) for each: 188 of
    # them, 23.5 MiB, after 200 creates (tracemalloc, 2026-11-26). At 200 creates on the test
    # cluster, 64 left create-to-Ready as unbounded (p50 41.4 s) with 15 MiB less resident; 16
    # cost 6 s of p50 (docs/benchmarks/2026-11-26-operator-scale.md).
    settings.queueing.worker_limit = max(64, 16 * workers)
    settings.peering.standalone = True  # a Lease elects the leader (leader.py)
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings


def post_events(kube: Kube, namespace: str, name: str, result: Result | None) -> None:
    """Kubernetes Events on the InferenceService for what a pass reports (best effort)."""
    if not result or not result.events:
        return
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ref = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "name": name,
        "namespace": namespace,
        "uid": result.uid,
    }
    for type_, reason, message in result.events:
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": ref,
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "pagoda-operator"},
            "reportingComponent": "pagoda-operator",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            kube.create(event)
        except Exception as e:
            log.debug("event not posted: %s", e)


def _run(ctx: Context, namespace: str, name: str, trigger: str, autoscale: bool = False) -> Result | None:
    try:
        result = reconcile(ctx, namespace, name, trigger, autoscale=autoscale)
        post_events(ctx.kube, namespace, name, result)
        return result
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=1) from e
    except ApiError as e:
        if e.status in (409, 429, 500, 503, 504):
            raise kopf.TemporaryError(str(e), delay=2) from e
        raise


def keeps_time(body: Mapping[str, Any]) -> bool:
    """An InferenceService whose periodic pass takes a step by the clock: an autoscaler (of the
    replicas or of the prefill pods), or elastic EP (its decisions scrape the pods' metrics on each
    round)."""
    spec = body.get("spec") or {}

    def part(parent: Any, key: str) -> Any:
        return parent.get(key) if isinstance(parent, Mapping) else None

    prefill = part(part(spec, "disaggregation"), "prefill")
    return any((spec.get("autoscaling"), part(spec.get("parallelism"), "elastic"), part(prefill, "autoscaling")))


class Ticker:
    """Every ``interval`` seconds, one autoscaling + resync pass over every InferenceService."""

    def __init__(self, ctx: Context, interval: float, namespaces: Sequence[str] = (), workers: int = 4,
                 heartbeats: Heartbeats = HEARTBEATS):
        self.ctx, self.interval, self.namespaces, self.workers = ctx, interval, list(namespaces), workers
        self.heartbeats = heartbeats
        self.stop_flag = threading.Event()
        self.thread: threading.Thread | None = None

    def targets(self) -> list[tuple[str, str]]:
        """The InferenceServices this round passes over: every one that keeps time (an autoscaler
        or elastic EP steps on this clock), the others unless a pass triggered by a watch event
        ran within the interval. Each such pass costs the operator the same CPU (1,000 objects on
        2 cores: 12,151 periodic passes of 20,687 while they came up, 2026-11-26-operator-scale.md)."""
        items = []
        for ns in self.namespaces or [None]:
            items += self.ctx.kube.list("InferenceService", ns)
        recent = self.ctx.clock() - self.interval
        return sorted(
            (i["metadata"]["namespace"], i["metadata"]["name"])
            for i in items
            if not i["metadata"].get("deletionTimestamp")
            and (keeps_time(i) or self.ctx.passed_at.get((i["metadata"]["namespace"], i["metadata"]["name"]),
                                                         -math.inf) <= recent)
        )

    def tick(self) -> None:
        targets = self.targets()
        if not targets:
            return

        def one(target: tuple[str, str]) -> None:
            ns, name = target
            try:
                post_events(self.ctx.kube, ns, name, reconcile(self.ctx, ns, name, "timer", autoscale=True))
            except Exception as e:
                log.warning("periodic pass over %s/%s failed: %s", ns, name, e)

        with ThreadPoolExecutor(
            max_workers=min(self.workers, len(targets)), thread_name_prefix="tick"
        ) as pool:
            list(pool.map(one, targets))

    def run(self) -> None:
        while not self.stop_flag.wait(0):
            started = time.monotonic()
            try:
                self.tick()
            except Exception as e:  # the API may be briefly unavailable
                log.warning("periodic pass failed: %s", e)
            self.heartbeats.beat(PASS_BEAT)  # finished, well or not: not stuck
            memory.give_back()  # what the pass and the events since the last one freed (memory.py)
            self.stop_flag.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self) -> None:
        self.heartbeats.expect(PASS_BEAT, 10 * self.interval + 120)
        self.thread = threading.Thread(target=self.run, name="pagoda-ticker", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_flag.set()
        self.heartbeats.forget(PASS_BEAT)
        if self.thread:
            self.thread.join(timeout=30)


async def loop_heartbeat(heartbeats: Heartbeats, every_s: float = LOOP_BEAT_S,
                         stuck_after_s: float = LOOP_STUCK_AFTER_S) -> None:
    """Beat while the event loop runs tasks: a loop blocked by a handler stops beating."""
    heartbeats.expect(LOOP_BEAT, stuck_after_s)
    while True:
        heartbeats.beat(LOOP_BEAT)
        await asyncio.sleep(every_s)


def build_registry(
    ctx: Context, interval: float = 15.0, namespaces: Sequence[str] = (), workers: int = 4,
    lws_recheck_s: float = lws.RECHECK_S,
) -> kopf.OperatorRegistry:
    """``lws_recheck_s``: how long the LeaderWorkerSet watch waits to ask again after finding
    them not served (the operator's ``--lws-discovery-interval``)."""
    registry = kopf.OperatorRegistry()
    ticker = Ticker(ctx, interval, namespaces, workers)
    passes = PassPool(workers)

    def child_event(namespace: str, owner: str, trigger: str) -> None:
        passes.request((namespace, owner), functools.partial(_child_event, ctx, namespace, owner, trigger))

    def on_leader_worker_set(event: Mapping[str, Any]) -> None:
        meta = event["object"].get("metadata") or {}
        owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        if owner and meta.get("namespace"):
            child_event(meta["namespace"], owner, "leaderworkerset")

    lws_watches = [OptionalWatch(ctx.kube, lws.KIND, ns, OWNED_SELECTOR, ctx.leader_worker_sets, on_leader_worker_set,
                                 recheck_s=lws_recheck_s) for ns in (namespaces or [None])]
    res = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        info = kopf.login_with_service_account(**kwargs)
        if info is None:
            return kopf.login_with_kubeconfig(**kwargs)
        # kopf names the server kubernetes.default.svc, which needs cluster DNS; our own client
        # (kube.Kube) uses the Service address the kubelet passes in. Use the same for both.
        server = in_cluster_server(os.environ)
        return dataclasses.replace(info, server=server) if server else info

    @kopf.on.startup(registry=registry)
    def start_ticker(**_: Any) -> None:
        ticker.start()
        for watch in lws_watches:
            watch.start()

    @kopf.on.cleanup(registry=registry)
    def stop_ticker(**_: Any) -> None:
        for watch in lws_watches:
            watch.stop()
        ticker.stop()
        passes.shutdown()

    beating: list[asyncio.Task] = []  # kept: the loop holds tasks only weakly

    @kopf.on.startup(registry=registry)
    async def start_loop_heartbeat(**_: Any) -> None:
        beating.append(asyncio.get_running_loop().create_task(loop_heartbeat(HEARTBEATS)))

    @kopf.on.cleanup(registry=registry)
    async def stop_loop_heartbeat(**_: Any) -> None:
        for task in beating:
            task.cancel()
        HEARTBEATS.forget(LOOP_BEAT)

    @kopf.on.resume(**res, id="reconcile")
    @kopf.on.create(**res, id="reconcile")
    @kopf.on.update(**res, id="reconcile")
    async def on_change(namespace: str, name: str, reason: str, body: kopf.Body, **_: Any) -> None:
        _observe(ctx, "InferenceService", {"object": body})  # the spec this change is about, whatever ran first
        await passes.run(_run, ctx, namespace, name, str(getattr(reason, "value", reason)))

    # The handlers below run on kopf's event loop and never wait: the cache takes the object, the
    # pool the pass (pass_pool.py says why).
    @kopf.on.event(**res, id="forget")
    async def on_gone(event: Mapping[str, Any], namespace: str, name: str, **_: Any) -> None:
        _observe(ctx, "InferenceService", event)
        if event.get("type") == "DELETED":
            forget(namespace, name)
            ctx.forget(namespace, name)

    @kopf.on.event("apps", "v1", "deployments", labels=MANAGED, registry=registry, id="deployment")
    async def on_deployment(event: Mapping[str, Any], labels: Mapping[str, str], namespace: str, **_: Any) -> None:
        _observe(ctx, "Deployment", event)
        child_event(namespace, labels[INSTANCE_LABEL], "deployment")

    @kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED, registry=registry, id="statefulset")
    async def on_stateful_set(event: Mapping[str, Any], labels: Mapping[str, str], namespace: str, **_: Any) -> None:
        _observe(ctx, "StatefulSet", event)
        child_event(namespace, labels[INSTANCE_LABEL], "statefulset")

    @kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry, id="pod")
    async def on_pod(event: Mapping[str, Any], labels: Mapping[str, str], namespace: str, **_: Any) -> None:
        _observe(ctx, "Pod", event)
        child_event(namespace, labels[INSTANCE_LABEL], "pod")

    # Children no status depends on: watched only to keep the passes' reads of them current.
    @kopf.on.event("", "v1", "services", labels=MANAGED, registry=registry, id="service")
    async def on_service(event: Mapping[str, Any], **_: Any) -> None:
        _observe(ctx, "Service", event)

    @kopf.on.event("", "v1", "configmaps", labels=MANAGED, registry=registry, id="configmap")
    async def on_config_map(event: Mapping[str, Any], **_: Any) -> None:
        _observe(ctx, "ConfigMap", event)

    if ctx.settings.network_policy:
        @kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=MANAGED, registry=registry,
                       id="networkpolicy")
        async def on_network_policy(event: Mapping[str, Any], **_: Any) -> None:
            _observe(ctx, "NetworkPolicy", event)

    @kopf.on.event(GROUP, VERSION, TOPOLOGY_PLURAL, registry=registry, id="node-labels")
    def on_topology(event: Mapping[str, Any], body: kopf.Body, name: str, **_: Any) -> None:
        _observe(ctx, "NodeTopology", event)  # what reconcile passes read instead of a list
        sync_node_labels(ctx, name, None if event.get("type") == "DELETED" else body)

    return registry


def _observe(ctx: Context, kind: str, event: Mapping[str, Any]) -> None:
    """A watch event into the passes' cache (where ctx.kube keeps one)."""
    if isinstance(ctx.kube, CachedKube) and isinstance(event.get("object"), Mapping):
        ctx.kube.cache.observe(kind, event["object"], deleted=event.get("type") == "DELETED")


def _child_event(ctx: Context, namespace: str, owner: str, trigger: str) -> None:
    # A pass a child's event asked for (on the PassPool) is not retried; the ticker repairs what a
    # failure here leaves. Logged without a traceback: a refused write repeats on every event.
    try:
        post_events(ctx.kube, namespace, owner, reconcile(ctx, namespace, owner, trigger))
    except Exception as e:
        log.warning("reconcile of %s/%s after a %s event failed: %s", namespace, owner, trigger, e)


def sync_node_labels(ctx: Context, node: str, topology: Mapping[str, Any] | None) -> bool:
    """Keep the node's pagoda labels in step with its NodeTopology (None: it was deleted, drop
    them). Patches only on a difference; True when it patched."""
    want: dict[str, str | None] = (
        dict(node_labels(topology)) if topology is not None else {NVLINK_LABEL: None}
    )
    live = ctx.kube.get("Node", None, node)
    if live is None:
        return False
    have = (live.get("metadata") or {}).get("labels") or {}
    # a model the node's cache no longer holds: its label goes
    want |= {k: None for k in have if k.startswith(MODEL_LABEL_PREFIX) and k not in want}
    if all(have.get(k) == v for k, v in want.items()):
        return False
    ctx.kube.merge_patch("Node", None, node, {"metadata": {"labels": want}})
    log.info("node %s labels %s", node, want)
    return True
