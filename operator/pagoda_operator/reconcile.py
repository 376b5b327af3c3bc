"""One reconcile pass over one InferenceService: read the world, decide, write only differences.

Every trigger (create, update, resume, the periodic ticker, events of the children) runs the same
level-triggered pass, so the order and number of triggers never matter:

1. read the InferenceService, its Deployment and pods, and every NodeTopology;
2. parse and validate the spec (``spec``), check capacity and placement (``placement``); a
   problem here blocks the pass: the children are left exactly as they are;
3. with ``autoscale``, scrape the ready pods' ``/metrics`` and take one autoscaler step;
4. build the desired children (``builders``) and create/replace only those that differ;
5. compute the status (``status``) and patch it only when it changed.

A per-object lock serialises passes for one InferenceService inside this process; the leader
lease keeps a second operator process out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagoda_daemon.capabilities import supported
from pagoda_operator import autoscaler, builders, placement
from pagoda_operator import metrics_scrape as scrape_mod
from pagoda_operator import status as status_mod
from pagoda_operator.kube import ApiError, Kube
from pagoda_operator.spec import InvalidSpec, ServiceSpec, Supports, desired_replicas, parse
from pagoda_operator.telemetry import DECISIONS, DESIRED, DURATION, ERRORS, RECONCILES, SIGNAL

log = logging.getLogger("pagoda_operator")


class Retry(Exception):
    """A transient conflict: run the pass again shortly."""


@dataclass
class Context:
    kube: Kube
    settings: builders.Settings = field(default_factory=builders.Settings)
    clock: Callable[[], float] = time.time
    scrape_timeout: float = 2.0
    fetcher: Callable[[str, float], str] = scrape_mod.fetch
    # the daemon capabilities a spec may ask for (pagoda_daemon.capabilities; tests widen it)
    supports: Supports = supported
    locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self.locks_guard:
            return self.locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        with self.locks_guard:
            self.locks.pop((namespace, name), None)


@dataclass
class Result:
    status: dict[str, Any]
    wrote: list[str]
    events: list[tuple[str, str, str]]  # (type Normal|Warning, reason, message)
    uid: str = ""


def reconcile(
    ctx: Context, namespace: str, name: str, trigger: str, autoscale: bool = False
) -> Result | None:
    """Run one pass; returns None when the InferenceService is gone or being deleted."""
    started = time.perf_counter()
    try:
        with ctx.lock(namespace, name):
            result = _reconcile(ctx, namespace, name, autoscale)
    except Exception:
        ERRORS.labels(trigger).inc()
        RECONCILES.labels(trigger, "error").inc()
        raise
    finally:
        DURATION.labels(trigger).observe(time.perf_counter() - started)
    RECONCILES.labels(
        trigger, "gone" if result is None else ("changed" if result.wrote else "unchanged")
    ).inc()
    return result


def _reconcile(ctx: Context, namespace: str, name: str, autoscale: bool) -> Result | None:
    kube = ctx.kube
    body = kube.get("InferenceService", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    generation = int(body["metadata"].get("generation") or 1)
    previous = body.get("status") or {}
    now = ctx.clock()
    now_iso = autoscaler.to_iso(now)
    events: list[tuple[str, str, str]] = []
    wrote: list[str] = []

    topologies = kube.topologies()
    spec: ServiceSpec | None = None
    blocker: status_mod.Problem | None = None
    try:
        spec = parse(name, namespace, body.get("spec") or {}, ctx.supports)
    except InvalidSpec as e:
        blocker = status_mod.Problem("InvalidSpec", str(e))
    if spec is not None:
        msg = placement.capacity_error(spec, topologies)
        if msg:
            blocker = status_mod.Problem("InvalidSpec", msg)
        elif (
            spec.placement.require_nvlink and spec.gpus > 1 and not placement.eligible_nodes(spec, topologies)
        ):
            blocker = status_mod.Problem(
                "NoEligibleNodes",
                f"requireNVLink: no NodeTopology shows {spec.gpus} GPUs connected all-to-all by NVLink/xGMI",
            )

    deployment = kube.get("Deployment", namespace, name)
    pods = [p for p in kube.list("Pod", namespace, builders.selector_string(name))]

    # What the daemons report: reused from the last status between scrapes.
    reported = {e["pod"]: e for e in previous.get("placement") or [] if e.get("pod")}
    expert_parallel = previous.get("expertParallel")
    auto_status = dict(previous.get("autoscaling") or {})
    autoscaled = auto_status.get("desiredReplicas") if spec and spec.autoscaling else None

    if autoscale and spec is not None:
        per_pod = scrape_mod.scrape(pods, spec.port, spec.model.name, ctx.scrape_timeout, ctx.fetcher)
        for pod_name, sig in per_pod.items():
            if "placement" in sig:
                reported[pod_name] = sig["placement"]
        eps = [s["expertParallel"] for s in per_pod.values() if "expertParallel" in s]
        if eps:
            expert_parallel = min(eps)
        if spec.autoscaling and blocker is None:
            auto_status, autoscaled, decision = _autoscale(spec, auto_status, autoscaled, per_pod, now)
            if decision:
                events.append(("Normal", "Autoscaled", decision))
    if spec is not None and expert_parallel is None:
        expert_parallel = spec.parallelism.expert

    desired_hash = None
    if spec is not None and blocker is None:
        replicas = desired_replicas(spec, autoscaled)
        kids = builders.children(spec, body, replicas, ctx.settings)
        actual = {
            "ConfigMap": kube.get("ConfigMap", namespace, builders.config_map_name(spec)),
            "Service": kube.get("Service", namespace, name),
            "Deployment": deployment,
        }
        if kids.network_policy is not None:
            actual["NetworkPolicy"] = kube.get("NetworkPolicy", namespace, name)
        for child in kids.all():
            kind = child["kind"]
            try:
                live, changed = _apply(kube, child, actual[kind], body["metadata"]["uid"])
            except _Conflict as e:
                blocker = status_mod.Problem("ChildConflict", str(e))
                break
            except ApiError as e:
                if e.status not in (400, 422):
                    raise
                # What the schema let through but the API server refuses in a child (a label
                # value, an env valueFrom, a quantity): the user must fix the spec.
                message = e.body.get("message") if isinstance(e.body, dict) else str(e)
                blocker = status_mod.Problem("InvalidSpec", f"the API server rejected the {kind}: {message}")
                break
            if changed:
                wrote.append(kind)
            if kind == "Deployment":
                deployment = live
        desired_hash = kids.deployment["metadata"]["annotations"][builders.HASH_ANNOTATION]
        DESIRED.labels(namespace, name).set(replicas)
    else:
        replicas = int(((deployment or {}).get("spec") or {}).get("replicas") or 0)

    pod_events: list[dict[str, Any]] = []
    if status_mod.needs_pod_events(pods):
        # A pod stuck before its containers start (a hostPath that is not there, a PVC that
        # cannot attach) says why only in Events.
        try:
            pod_events = kube.pod_warnings(namespace)
        except ApiError as e:
            log.debug("cannot read Events in %s: %s", namespace, e)
    new = status_mod.compute(
        generation=generation,
        desired=replicas,
        desired_hash=desired_hash,
        deployment=deployment,
        pods=pods,
        previous=previous,
        now=now_iso,
        blocker=blocker,
        pod_events=pod_events,
    )
    new["selector"] = builders.selector_string(name)
    if spec is not None:
        new["endpoint"] = builders.endpoint(spec)
    if expert_parallel is not None:
        new["expertParallel"] = int(expert_parallel)
    topo_by_node = {placement.node_name(t): t for t in topologies}
    new["placement"] = placement.replica_placement(pods, topo_by_node, reported)
    if spec is not None and spec.autoscaling:
        if autoscaled is None:
            auto_status["desiredReplicas"] = replicas
        new["autoscaling"] = auto_status

    old_degraded = status_mod.condition(previous, "Degraded") or {}
    new_degraded = status_mod.condition(new, "Degraded") or {}
    if new_degraded.get("status") == "True" and (
        old_degraded.get("status") != "True" or old_degraded.get("reason") != new_degraded.get("reason")
    ):
        events.append(("Warning", new_degraded["reason"], new_degraded.get("message", "")))

    if not status_mod.same_status(_prune(previous), _prune(new)):
        patch = {"status": {**{k: None for k in previous if k not in new}, **new}}
        try:
            kube.merge_patch("InferenceService", namespace, name, patch, sub="status")
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        wrote.append("status")
    return Result(status=new, wrote=wrote, events=events, uid=body["metadata"].get("uid", ""))


def _prune(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _autoscale(
    spec: ServiceSpec,
    auto_status: dict[str, Any],
    autoscaled: int | None,
    per_pod: Mapping[str, Mapping[str, Any]],
    now: float,
) -> tuple[dict[str, Any], int, str | None]:
    """One autoscaler step; returns the new status.autoscaling, the desired replicas and a log line."""
    cfg = spec.autoscaling
    assert cfg is not None
    current = desired_replicas(spec, autoscaled)
    samples = [s[cfg.metric] for s in per_pod.values() if cfg.metric in s]
    history = []
    for r in auto_status.get("recommendations") or []:
        try:
            history.append((autoscaler.from_iso(r["time"]), int(r["replicas"])))
        except (KeyError, ValueError):
            continue
    ev = autoscaler.evaluate(cfg, current, samples, history, now)
    signals = scrape_mod.signals_summary(per_pod)
    out = {
        "metric": cfg.metric,
        "target": cfg.target,
        "signals": signals,
        "desiredReplicas": ev.desired,
        "reason": ev.reason,
        "message": ev.message,
        "lastEvaluationTime": autoscaler.to_iso(now),
        "recommendations": [{"time": autoscaler.to_iso(t), "replicas": r} for t, r in ev.recommendations],
        "decisions": list(auto_status.get("decisions") or []),
    }
    if ev.value is not None:
        out["value"] = round(ev.value, 6)
        SIGNAL.labels(spec.namespace, spec.name, cfg.metric).set(ev.value)
    if auto_status.get("lastScaleTime"):
        out["lastScaleTime"] = auto_status["lastScaleTime"]
    line = None
    if ev.desired != current:
        entry = {
            "time": autoscaler.to_iso(now),
            "from": current,
            "to": ev.desired,
            "metric": cfg.metric,
            "reason": ev.reason,
            "target": cfg.target,
        }
        if ev.value is not None:
            entry["value"] = round(ev.value, 6)
        out["decisions"] = autoscaler.record(out["decisions"], entry)
        out["lastScaleTime"] = autoscaler.to_iso(now)
        direction = "up" if ev.desired > current else "down"
        DECISIONS.labels(spec.namespace, spec.name, direction).inc()
        line = f"{current} -> {ev.desired} replicas ({ev.reason}): {ev.message}"
        log.info("autoscale %s/%s: %s", spec.namespace, spec.name, line)
    return out, ev.desired, line


class _Conflict(Exception):
    pass


def _apply(
    kube: Kube, desired: dict[str, Any], actual: dict[str, Any] | None, owner_uid: str
) -> tuple[dict[str, Any], bool]:
    """Create or replace one child when it differs; returns (live object, whether we wrote)."""
    kind, meta = desired["kind"], desired["metadata"]
    if actual is None:
        try:
            return kube.create(desired), True
        except ApiError as e:
            if e.status != 409:
                raise
            actual = kube.get(kind, meta["namespace"], meta["name"])
            if actual is None:
                raise Retry(f"{kind} {meta['name']} vanished during create") from e
    owners = [
        r.get("uid")
        for r in (actual.get("metadata") or {}).get("ownerReferences") or []
        if r.get("controller")
    ]
    if owner_uid not in owners:
        raise _Conflict(
            f"{kind} {meta['name']} already exists and is not controlled by this InferenceService; "
            "rename one of them or delete the stray object"
        )
    if not builders.needs_update(desired, actual):
        return actual, False
    try:
        return kube.replace(builders.merge_for_replace(desired, actual)), True
    except ApiError as e:
        if e.status == 409:
            raise Retry(f"{kind} {meta['name']} changed while we replaced it") from e
        raise
