"""One reconcile pass over one InferenceService: observe, decide, apply.

Every trigger (create, update, resume, the periodic ticker, events of the children) runs the same
level-triggered pass, so the order and number of triggers never matter:

1. ``observe()`` reads everything the pass needs into one ``Observed``: the InferenceService
   (with its spec parsed and validated once, ``spec``), the NodeTopologies, its Deployment, pods
   and other children (all from the watch-fed ``watch_cache``), the pods' ``/metrics`` (and the
   prefill pods', with their autoscaler) on autoscaling passes, Warning Events when a pod is stuck
   before starting;
2. ``decide()`` is pure: block on an invalid spec, check capacity and placement
   (``placement``), take one autoscaler step (and one of the prefill pods' autoscaler), build the
   desired children (``builders``); a problem blocks the generation and the children are left
   exactly as they are;
3. ``apply()`` creates/replaces only the children that differ, computes the whole status
   (``status.compute``) and patches it only when it changed.

A per-object lock serialises passes for one InferenceService inside this process; the leader
lease keeps a second operator process out.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagoda_daemon.capabilities import supported
from pagoda_operator import autoscaler, builders, disaggregation, leader_worker_set, placement, pod_groups
from pagoda_operator import elastic as elastic_mod
from pagoda_operator import metrics_scrape as scrape_mod
from pagoda_operator import model_config as model_config_mod
from pagoda_operator import status as status_mod
from pagoda_operator.kube import ApiError, Kube
from pagoda_operator.model_config import ModelConfigs
from pagoda_operator.spec import (
    Autoscaling,
    InvalidSpec,
    ServiceSpec,
    Supports,
    desired_replicas,
    parse,
    prefill_replicas,
)
from pagoda_operator.telemetry import (
    DURATION,
    ERRORS,
    PREFILL,
    RECONCILES,
    REPLICAS,
    ScalingSeries,
    autoscaled,
    forget,
)

if TYPE_CHECKING:
    from pagoda_operator.tracing import OperatorTracer

log = logging.getLogger("pagoda_operator")


class Retry(Exception):
    """A transient conflict: run the pass again shortly."""


# Retries of a child write the API server refused: after 10 s, then twice as long each time, at most
# 5 min apart (a quota or an RBAC rule does not change every tick); a new desired object retries at once.
WRITE_BACKOFF_FIRST_S = 10.0
WRITE_BACKOFF_MAX_S = 300.0


def write_problem(kind: str, name: str, error: ApiError) -> status_mod.Problem:
    """Why a child could not be written, as the InferenceService's Degraded reason and message."""
    message = error.body.get("message") if isinstance(error.body, dict) else str(error.body or error)
    if error.status in (400, 422):
        # what the schema let through but the API server refuses in a child (a label value, an
        # env valueFrom, a quantity): the user must fix the spec
        return status_mod.Problem("InvalidSpec", f"the API server rejected the {kind}: {message}")
    what = f"the API server refused the {kind} {name} ({error.status})"
    if error.status == 403:
        quota = "quota" in str(message).lower()
        return status_mod.Problem("QuotaExceeded" if quota else "Forbidden", f"{what}: {message}")
    if error.status == 429 or error.status >= 500:
        return status_mod.Problem("ApiServerError", f"{what}: {message}; retrying")
    return status_mod.Problem("ApiError", f"{what}: {message}")


@dataclass
class _Failure:
    problem: status_mod.Problem
    failures: int
    retry_at: float


class WriteBackoff:
    """The child writes the API server refused, by (namespace, owner, kind, name, desired content):
    the same write is not sent again before its retry time, and its problem stays reported."""

    def __init__(self) -> None:
        self._failed: dict[tuple[str, ...], _Failure] = {}
        self._guard = threading.Lock()

    @staticmethod
    def key(namespace: str, owner: str, child: Mapping[str, Any]) -> tuple[str, ...]:
        """The child's content as needs_update compares it: its spec-hash stamp and replicas."""
        stamp = child["metadata"]["annotations"][builders.HASH_ANNOTATION]
        replicas = (child.get("spec") or {}).get("replicas")
        return (namespace, owner, child["kind"], child["metadata"]["name"], f"{stamp}/{replicas}")

    def pending(self, key: tuple[str, ...], now: float) -> status_mod.Problem | None:
        """The problem of this write while it waits for its retry; None once it may be sent."""
        with self._guard:
            failed = self._failed.get(key)
        return failed.problem if failed is not None and now < failed.retry_at else None

    def failed(self, key: tuple[str, ...], problem: status_mod.Problem, now: float) -> float:
        """Record a refusal; returns the seconds until the write may be retried."""
        with self._guard:
            count = (self._failed[key].failures if key in self._failed else 0) + 1
            delay = min(WRITE_BACKOFF_FIRST_S * 2 ** (count - 1), WRITE_BACKOFF_MAX_S)
            self._drop_other_contents(key)
            self._failed[key] = _Failure(problem, count, now + delay)
        return delay

    def succeeded(self, key: tuple[str, ...]) -> None:
        with self._guard:
            self._drop_other_contents(key)
            self._failed.pop(key, None)

    def _drop_other_contents(self, key: tuple[str, ...]) -> None:
        """One entry per child: what an older desired content of it did no longer matters."""
        for other in [k for k in self._failed if k[:4] == key[:4] and k != key]:
            del self._failed[other]

    def forget(self, namespace: str, owner: str) -> None:
        with self._guard:
            for key in [k for k in self._failed if k[:2] == (namespace, owner)]:
                del self._failed[key]


@dataclass
class Context:
    kube: Kube
    settings: builders.Settings = field(default_factory=builders.Settings)
    clock: Callable[[], float] = time.time
    scrape_timeout: float = 2.0
    fetcher: Callable[[str, float], str] = scrape_mod.fetch
    ready_fetcher: Callable[[str, float], str] = scrape_mod.fetch_ready
    # elastic EP: the operator's secret its per-service admin keys derive from (None: elastic EP is
    # not driven), and how a daemon's admin route is called (tests call a real server too)
    operator_secret: bytes | None = None
    elastic_call: Callable[..., dict[str, Any]] = elastic_mod._call
    # (uid, name) of the Secrets this process created or found (admin key, KV transfer key)
    secrets_made: set[tuple[str, str]] = field(default_factory=set)
    # the daemon capabilities a spec may ask for (pagoda_daemon.capabilities; tests widen it)
    supports: Supports = supported
    locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    locks_guard: threading.Lock = field(default_factory=threading.Lock)
    backoff: WriteBackoff = field(default_factory=WriteBackoff)
    tracer: OperatorTracer | None = None  # OTLP traces of the passes (tracing.py); None: off
    # when each InferenceService's latest pass finished (ctx.clock()), whatever triggered it: the
    # periodic pass leaves alone what a watch event had reconciled since its previous round
    passed_at: dict[tuple[str, str], float] = field(default_factory=dict)
    # the models' config.json, for refusing at apply time a layout the model cannot take
    # (model_config.py); None: left to the daemon's start
    model_configs: ModelConfigs | None = None
    # whether the cluster serves LeaderWorkerSets (leader_worker_set.Discovery): groups of pods
    # render as one of them, else as StatefulSets
    leader_worker_sets: Callable[[], bool] = field(default=lambda: False)

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self.locks_guard:
            return self.locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        with self.locks_guard:
            self.locks.pop((namespace, name), None)
            self.passed_at.pop((namespace, name), None)
        self.backoff.forget(namespace, name)


@dataclass
class Result:
    status: dict[str, Any]
    wrote: list[str]
    events: list[tuple[str, str, str]]  # (type Normal|Warning, reason, message)
    body: Mapping[str, Any] = field(default_factory=dict)  # the InferenceService as the pass read it

    @property
    def uid(self) -> str:
        return str((self.body.get("metadata") or {}).get("uid", ""))


def reconcile(
    ctx: Context, namespace: str, name: str, trigger: str, autoscale: bool = False
) -> Result | None:
    """Run one pass; returns None when the InferenceService is gone or being deleted."""
    started = time.perf_counter()
    started_wall = ctx.clock()
    try:
        with ctx.lock(namespace, name):
            result = _reconcile(ctx, namespace, name, autoscale)
            if result is not None:
                ctx.passed_at[(namespace, name)] = ctx.clock()
    except Exception:
        ERRORS.labels(trigger).inc()
        RECONCILES.labels(trigger, "error").inc()
        raise
    finally:
        DURATION.labels(trigger).observe(time.perf_counter() - started)
    RECONCILES.labels(
        trigger, "gone" if result is None else ("changed" if result.wrote else "unchanged")
    ).inc()
    if ctx.tracer is not None and result is not None:
        try:
            ctx.tracer.reconciled(namespace, name, trigger, started_wall, ctx.clock(), result.body, result.status,
                                  result.wrote)
        except Exception as e:  # a trace is never worth a failed pass
            log.warning("tracing the pass over %s/%s: %s", namespace, name, e)
    return result


@dataclass(frozen=True)
class Observed:
    """Everything one pass reads, read before anything is decided."""

    body: Mapping[str, Any]  # the InferenceService
    spec: ServiceSpec | None  # the spec parsed and validated, or None with why in spec_error
    spec_error: str | None
    topologies: list[Mapping[str, Any]]
    deployment: dict[str, Any] | None
    pods: list[dict[str, Any]]
    children: dict[str, dict[str, Any] | None]  # ConfigMap, Service (and NetworkPolicy) as they are
    signals: dict[str, dict[str, Any]] | None  # per pod, scraped from /metrics; None: not this pass
    pod_events: list[dict[str, Any]]  # Warning Events, read only when a pod is stuck before starting
    # podsPerReplica > 1 (pod_groups.py): the leaders' and the workers' StatefulSets, the headless Service
    stateful_sets: list[dict[str, Any]] = field(default_factory=list)
    group_service: dict[str, Any] | None = None
    starting: dict[str, str] = field(default_factory=dict)  # pod -> start-up phase, from its /ready
    # elastic EP: each ready pod's /elastic_ep (None: not read this pass) and the admin key it takes
    elastic_states: dict[str, dict[str, Any]] | None = None
    admin_key: str | None = None
    model_config: dict[str, Any] | None = None  # the model's config.json, where this operator reads it
    # spec.disaggregation.prefill.replicas (disaggregation.py): the prefill pods, their Deployment
    # and the proxies' list of them, read in either layout so that a change removes them
    prefill_pods: list[dict[str, Any]] = field(default_factory=list)
    prefill_deployment: dict[str, Any] | None = None
    prefill_instances: dict[str, Any] | None = None
    # with prefill.autoscaling: per ready prefill pod, scraped from /metrics; None: not this pass
    prefill_signals: dict[str, dict[str, Any]] | None = None
    # whether the cluster serves LeaderWorkerSets, and this InferenceService's (leader_worker_set.py)
    lws_served: bool = False
    leader_worker_set: dict[str, Any] | None = None

    @property
    def leaders(self) -> dict[str, Any] | None:
        name = self.body["metadata"]["name"]
        return next((s for s in self.stateful_sets if s["metadata"]["name"] == name), None)

    def live(self, kind: str, obj_name: str) -> dict[str, Any] | None:
        """The live child of this kind and name, as this pass read it."""
        if kind == "Deployment":
            return self.deployment if obj_name == self.body["metadata"]["name"] else self.prefill_deployment
        if kind == "ConfigMap" and obj_name == disaggregation.instances_config_map_name(self.body["metadata"]["name"]):
            return self.prefill_instances
        if kind == "StatefulSet":
            return next((s for s in self.stateful_sets if s["metadata"]["name"] == obj_name), None)
        if kind == "LeaderWorkerSet":
            return self.leader_worker_set
        if kind == "Service" and obj_name != self.body["metadata"]["name"]:
            return self.group_service
        return self.children.get(kind)


@dataclass
class Decision:
    """What the pass wants: a pure function of Observed (``decide``)."""

    spec: ServiceSpec | None
    blocker: status_mod.Problem | None  # what stops this generation from being applied
    replicas: int
    children: builders.Children | None  # None: leave the children as they are
    autoscaling: dict[str, Any] | None  # the new status.autoscaling
    scale: tuple[int, autoscaler.Evaluation] | None  # (replicas before, this pass's autoscaler step)
    expert_parallel: int | None
    reported: dict[str, dict[str, Any]]  # placement the daemons reported, by pod
    elastic: dict[str, Any] | None = None  # the new status.elastic
    scaling: tuple[str, str, str] | None = None  # the Scaling condition (elastic EP)
    resizes: list[tuple[str, int]] = field(default_factory=list)  # (pod, expert-parallel size) to ask for
    # prefill pods apart: how many (None: none apart), their autoscaler's new status and this pass's step
    prefill_replicas: int | None = None
    prefill_autoscaling: dict[str, Any] | None = None
    prefill_scale: tuple[int, autoscaler.Evaluation] | None = None


def _reconcile(ctx: Context, namespace: str, name: str, autoscale: bool) -> Result | None:
    observed = observe(ctx, namespace, name, autoscale)
    if observed is None:
        return None
    now = ctx.clock()
    decision = decide(observed, ctx.settings, now)
    return apply(ctx, observed, decision, now)


def observe(ctx: Context, namespace: str, name: str, autoscale: bool) -> Observed | None:
    """Read the InferenceService and its world; None when it is gone or being deleted."""
    kube = ctx.kube
    body = kube.get("InferenceService", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    spec: ServiceSpec | None = None
    spec_error = None
    try:
        spec = parse(name, namespace, body.get("spec") or {}, ctx.supports)
    except InvalidSpec as e:
        spec_error = str(e)  # decide() reports it; nothing more to read for this spec
    topologies = kube.topologies()  # from the watch cache where ctx.kube is a CachedKube
    deployment = kube.get("Deployment", namespace, name)
    # Read in either layout, so that a change of podsPerReplica removes the other one's objects.
    stateful_sets = list(kube.list("StatefulSet", namespace, builders.selector_string(name)))
    group_service = kube.get("Service", namespace, pod_groups.group_service_name(name))
    # Where the CRD is not served there is none to read (removing the CRD removed them all). Read
    # from the API server, not a watch-fed cache: kopf's watch of them may start late (handlers.py).
    lws_served = ctx.leader_worker_sets()
    lws = kube.get("LeaderWorkerSet", namespace, leader_worker_set.name(name)) if lws_served else None
    pods = list(kube.list("Pod", namespace, builders.selector_string(name)))
    children: dict[str, dict[str, Any] | None] = {}
    signals = None
    serving = [p for p in pods if pod_groups.role(p) != builders.WORKER]  # workers have no HTTP port
    if spec is not None:
        children["ConfigMap"] = kube.get("ConfigMap", namespace, builders.config_map_name(spec))
        children["Service"] = kube.get("Service", namespace, name)
        if ctx.settings.network_policy:
            children["NetworkPolicy"] = kube.get("NetworkPolicy", namespace, name)
        if autoscale:
            signals = scrape_mod.scrape(serving, spec.port, spec.model.name, ctx.scrape_timeout, ctx.fetcher)
    elastic_states = admin_key = None
    if spec is not None and spec.parallelism.elastic is not None and ctx.operator_secret:
        admin_key = elastic_mod.admin_key(ctx.operator_secret, namespace, name, body["metadata"].get("uid", ""))
        if autoscale:
            elastic_states = elastic_mod.read_states(serving, spec.port, admin_key, ctx.scrape_timeout,
                                                     ctx.elastic_call)
    starting: dict[str, str] = {}
    if spec is not None:  # a starting engine says which phase it is in: shown in status.placement
        starting = scrape_mod.starting_phases(serving, spec.port, ctx.scrape_timeout, ctx.ready_fetcher)
    prefill_pods = list(kube.list("Pod", namespace, disaggregation.prefill_pods_selector(name)))
    prefill_signals = None
    d = spec.disaggregation if spec is not None else None
    if autoscale and spec is not None and d is not None and d.prefill.autoscaling is not None:
        # the replicas' scrape (same timeout, reader and model filter) on the prefill engines' port
        prefill_signals = scrape_mod.scrape(prefill_pods, d.prefill.port, spec.model.name, ctx.scrape_timeout,
                                            ctx.fetcher)
    pod_events: list[dict[str, Any]] = []
    if status_mod.needs_pod_events(pods + prefill_pods):
        # A pod stuck before its containers start (a hostPath that is not there, a PVC that
        # cannot attach) says why only in Events.
        try:
            pod_events = list(kube.pod_warnings(namespace))
        except ApiError as e:
            log.debug("cannot read Events in %s: %s", namespace, e)
    model_config = ctx.model_configs.get(spec) if spec is not None and ctx.model_configs is not None else None
    prefill_deployment = kube.get("Deployment", namespace, disaggregation.prefill_name(name))
    prefill_instances = kube.get("ConfigMap", namespace, disaggregation.instances_config_map_name(name))
    return Observed(body, spec, spec_error, list(topologies), deployment, pods, children, signals, pod_events,
                    stateful_sets, group_service, starting, elastic_states, admin_key, model_config, prefill_pods,
                    prefill_deployment, prefill_instances, prefill_signals, lws_served, lws)


def decide(observed: Observed, settings: builders.Settings, now: float) -> Decision:
    """Place, autoscale and build the desired children. Pure: no I/O, no clock."""
    body = observed.body
    previous = body.get("status") or {}
    spec = observed.spec
    blocker: status_mod.Problem | None = None
    if observed.spec_error is not None:
        blocker = status_mod.Problem("InvalidSpec", observed.spec_error)
    if spec is not None:
        layout = model_config_mod.layout_error(spec, observed.model_config) if observed.model_config else None
        msg = layout or placement.capacity_error(spec, observed.topologies)
        if msg:
            blocker = status_mod.Problem("InvalidSpec", msg)
        elif (
            spec.placement.require_nvlink
            and spec.gpus_per_pod > 1
            and not placement.eligible_nodes(spec, observed.topologies)
        ):
            blocker = status_mod.Problem(
                "NoEligibleNodes",
                f"requireNVLink: no NodeTopology shows {spec.gpus_per_pod} GPUs connected all-to-all by NVLink/xGMI",
            )

    # What the daemons report: reused from the last status between scrapes.
    reported = {e["pod"]: e for e in previous.get("placement") or [] if e.get("pod")}
    expert_parallel = previous.get("expertParallel")
    auto_status = dict(previous.get("autoscaling") or {})
    autoscaled = auto_status.get("desiredReplicas") if spec and spec.autoscaling else None
    scale = None
    per_pod = observed.signals
    if per_pod is not None and spec is not None:
        for pod_name, sig in per_pod.items():
            if "placement" in sig or "model" in sig:
                entry = dict(sig.get("placement") or reported.get(pod_name) or {})
                if "model" in sig:
                    entry["modelRevision"] = sig["model"]["revision"]
                reported[pod_name] = entry
        eps = [s["expertParallel"] for s in per_pod.values() if "expertParallel" in s]
        if eps:
            expert_parallel = min(eps)
    el = spec.parallelism.elastic if spec is not None else None
    elastic_status, scaling, resizes, hold_up = _elastic(observed, spec, autoscaled, now)
    if el is not None and elastic_status is not None and "currentExpertParallel" in elastic_status:
        expert_parallel = elastic_status["currentExpertParallel"]
    if per_pod is not None and spec is not None and spec.autoscaling and blocker is None:
        current = desired_replicas(spec, autoscaled)
        auto_status, ev = _autoscale(spec.autoscaling, auto_status, current, per_pod, now, hold_up)
        scale = (current, ev)
        autoscaled = ev.desired
    prefill_count, prefill_auto, prefill_scale = _prefill_autoscale(observed, spec, blocker is None, now)
    if spec is not None and expert_parallel is None:
        expert_parallel = spec.parallelism.expert

    if spec is not None and blocker is None:
        replicas = desired_replicas(spec, autoscaled)
        if spec.pods_per_replica > 1 and observed.lws_served:
            kids = leader_worker_set.children(spec, body, replicas, settings)
        elif spec.pods_per_replica > 1:
            ips = pod_groups.leader_ips(observed.pods, spec.name)
            kids = pod_groups.children(spec, body, replicas, settings, ips)
        else:
            kids = builders.children(spec, body, replicas, settings,
                                     disaggregation.pod if spec.disaggregation else builders.one_engine_pod)
            kids = dataclasses.replace(kids, prefill=disaggregation.prefill_children(
                spec, body, settings, builders.digest(kids.config_map["data"]), observed.prefill_pods, prefill_count))
    else:
        live = observed.deployment or observed.leaders or observed.leader_worker_set
        replicas = int(((live or {}).get("spec") or {}).get("replicas") or 0)
        kids = None
    if spec is not None and spec.autoscaling and autoscaled is None:
        auto_status["desiredReplicas"] = replicas
    autoscaling = auto_status if spec is not None and spec.autoscaling else None
    if blocker is not None:
        resizes = []
    return Decision(spec, blocker, replicas, kids, autoscaling, scale, expert_parallel, reported, elastic_status,
                    scaling, resizes, prefill_count, prefill_auto, prefill_scale)


def _prefill_autoscale(observed: Observed, spec: ServiceSpec | None, step: bool, now: float
                       ) -> tuple[int | None, dict[str, Any] | None, tuple[int, autoscaler.Evaluation] | None]:
    """The prefill pods' size (None: no prefill pods apart), their autoscaler's status
    (``status.disaggregation.prefill.autoscaling``) and, on a pass that scraped them and may
    ``step``, this pass's step: the replica autoscaler's (:func:`_autoscale`) over the prefill
    pods. Between steps the count and the status stay what the last step left."""
    rule = spec.disaggregation.prefill.autoscaling if spec is not None and spec.disaggregation else None
    previous = ((observed.body.get("status") or {}).get("disaggregation") or {}).get("prefill") or {}
    auto_status = dict(previous.get("autoscaling") or {}) if rule is not None else {}
    count = prefill_replicas(spec, auto_status.get("desiredReplicas")) if spec is not None else None
    if rule is None or count is None:
        return count, None, None
    scale = None
    if step and observed.prefill_signals is not None:
        auto_status, ev = _autoscale(rule, auto_status, count, observed.prefill_signals, now)
        scale, count = (count, ev), ev.desired
    auto_status.setdefault("desiredReplicas", count)
    return count, auto_status, scale


def _elastic(observed: Observed, spec: ServiceSpec | None, autoscaled: int | None, now: float
             ) -> tuple[dict[str, Any] | None, tuple[str, str, str] | None, list[tuple[str, int]], str | None]:
    """Elastic EP's step (pure): (status.elastic, the Scaling condition, the resizes to ask for,
    why the replica autoscaler must not grow now). Between the passes that read the daemons,
    the last status and condition stay."""
    el = spec.parallelism.elastic if spec is not None else None
    if spec is None or el is None:
        return None, None, [], None
    previous = observed.body.get("status") or {}
    prev_el = previous.get("elastic") or {}
    states = observed.elastic_states
    if states is None:
        old = status_mod.condition(previous, "Scaling")
        kept = (old["status"], old.get("reason", ""), old.get("message", "")) if old else None
        return (dict(prev_el) or None), kept, [], None
    sizes = [s["size"] for s in states.values() if isinstance(s.get("size"), int)]
    current = min(sizes) if sizes else int(prev_el.get("currentExpertParallel") or spec.parallelism.expert)
    samples = [sig[el.metric] for sig in (observed.signals or {}).values() if el.metric in sig]
    replicas = desired_replicas(spec, autoscaled)
    can_shrink = spec.autoscaling is not None and replicas > spec.autoscaling.min_replicas
    serving = max(len(states), len(observed.signals or {}))
    decision = elastic_mod.evaluate(el, current, samples, elastic_mod.history_of(prev_el), now, can_shrink, serving)
    status = elastic_mod.status_of(el, prev_el, decision, current, states, now)
    scaling = elastic_mod.scaling_condition(states, decision.desired)
    resizes = [(pod, decision.desired) for pod in elastic_mod.wanted_resizes(states, decision.desired)]
    growing = decision.desired > current or scaling[1] == "Resizing"
    hold_up = (f"ElasticFirst: the expert-parallel size grows first ({current} -> {decision.desired} of at most "
               f"{el.max_expert})") if growing and current < el.max_expert else None
    return status, scaling, resizes, hold_up


def apply(ctx: Context, observed: Observed, decision: Decision, now: float) -> Result | None:
    """Write the children that differ, then the status if it changed; record metrics and events."""
    kube = ctx.kube
    body = observed.body
    namespace, name = body["metadata"].get("namespace", ""), body["metadata"]["name"]
    previous = body.get("status") or {}
    spec, blocker, scale = decision.spec, decision.blocker, decision.scale
    events: list[tuple[str, str, str]] = []
    wrote: list[str] = []
    if scale is not None and spec is not None and spec.autoscaling is not None:
        line = _record_scale(spec, spec.autoscaling, *scale)
        if line:
            events.append(("Normal", "Autoscaled", line))
    prefill_rule = spec.disaggregation.prefill.autoscaling if spec is not None and spec.disaggregation else None
    if decision.prefill_scale is not None and spec is not None and prefill_rule is not None:
        line = _record_scale(spec, prefill_rule, *decision.prefill_scale, PREFILL, "prefill")
        if line:
            events.append(("Normal", "Autoscaled", f"prefill: {line}"))

    if spec is not None and spec.parallelism.elastic is not None and observed.admin_key is not None:
        problem = _ensure_secret(ctx, body, elastic_mod.admin_secret(spec, body, observed.admin_key), "the admin key")
        if problem:
            events.append(("Warning", "AdminKeySecret", problem))
        for pod_name, size in decision.resizes:
            pod = next((p for p in observed.pods if p["metadata"]["name"] == pod_name), None)
            why = "gone" if pod is None else elastic_mod.request(pod, spec.port, observed.admin_key, size,
                                                                 ctx.scrape_timeout, ctx.elastic_call)
            events.append(("Warning", "ElasticResizeRefused", f"{pod_name}: {size} expert-parallel ranks: {why}")
                          if why else ("Normal", "ElasticResize", f"{pod_name}: asked for {size} expert-parallel ranks"))
            log.info("elastic %s/%s: %s asked for %d expert-parallel ranks%s", namespace, name, pod_name, size,
                     f": {why}" if why else "")

    if spec is not None and spec.disaggregation is not None and spec.disaggregation.prefill_pods:
        # random, never read back: the roles read it from the Secret, the operator never needs it
        secret = disaggregation.transfer_secret(spec, body, secrets.token_hex(32))
        problem = _ensure_secret(ctx, body, secret, "the KV transfer key")
        if problem:
            events.append(("Warning", "KVTransferKeySecret", problem))

    lws_name = leader_worker_set.name(name)
    lives = {(kind, n): observed.live(kind, n) for kind, n in
             [("Deployment", name), ("LeaderWorkerSet", lws_name),
              *(("StatefulSet", st["metadata"]["name"]) for st in observed.stateful_sets)]}
    desired_hashes: dict[str, str] | None = None
    if decision.children is not None:
        for child in decision.children.all():
            kind, child_name = child["kind"], child["metadata"]["name"]
            key = ctx.backoff.key(namespace, name, child)
            waiting = ctx.backoff.pending(key, now)
            if waiting is not None:  # refused before: not sent again until its retry time
                blocker = waiting
                break
            try:
                live, changed = _apply(kube, child, observed.live(kind, child_name), body["metadata"]["uid"])
            except _Conflict as e:
                blocker = status_mod.Problem("ChildConflict", str(e))
                break
            except ApiError as e:
                if e.status == 404:  # gone between this pass's read and its write
                    raise Retry(f"{kind} {child_name} vanished while being written") from e
                blocker = write_problem(kind, child_name, e)
                delay = ctx.backoff.failed(key, blocker, now)
                log.warning("%s/%s: %s (next try in %.0f s)", namespace, name, blocker.message, delay)
                break
            ctx.backoff.succeeded(key)
            if changed:
                wrote.append(kind)
            lives[(kind, child_name)] = live
        else:
            wrote += _remove_stale(kube, observed, decision.children, decision.replicas)
        desired_hashes = {c["metadata"]["name"]: c["metadata"]["annotations"][builders.HASH_ANNOTATION]
                          for c in decision.children.all()
                          if c["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet")}
        REPLICAS.desired.labels(namespace, name).set(decision.replicas)
        if decision.prefill_replicas is not None:
            PREFILL.desired.labels(namespace, name).set(decision.prefill_replicas)
        else:  # no prefill pods apart (any more): no series of theirs
            forget(namespace, name, (PREFILL,))
    as_lws = (decision.children.workload["kind"] == leader_worker_set.KIND if decision.children is not None
              else observed.leader_worker_set is not None)
    grouped = spec.pods_per_replica > 1 if spec is not None else as_lws or observed.leaders is not None
    if grouped and as_lws:
        workload = status_mod.Workload.of_leader_worker_set(
            lives.get(("LeaderWorkerSet", lws_name)), observed.pods, decision.replicas,
            (desired_hashes or {}).get(lws_name),
            spec.pods_per_replica if spec is not None else int(
                ((observed.leader_worker_set or {}).get("spec") or {}).get("leaderWorkerTemplate", {}).get("size")
                or 1))
    elif grouped:
        workers = {g: st for (kind, n), st in lives.items() if kind == "StatefulSet" and st is not None
                   and pod_groups.role(st) == builders.WORKER and (g := pod_groups.group_of(st, name)) is not None}
        workload = status_mod.Workload.of_groups(
            name, lives.get(("StatefulSet", name)), workers, observed.pods, decision.replicas, desired_hashes,
            spec.pods_per_replica if spec is not None else 1 + max((int(st["spec"]["replicas"]) for st in
                                                                     workers.values()), default=0))
    else:
        workload = status_mod.Workload.of_deployment(
            lives.get(("Deployment", name)), decision.replicas, (desired_hashes or {}).get(name))

    topo_by_node = {placement.node_name(t): t for t in observed.topologies}
    new = status_mod.compute(
        generation=int(body["metadata"].get("generation") or 1),
        desired=decision.replicas,
        workload=workload,
        pods=observed.pods + observed.prefill_pods,  # a failing prefill pod is named in Degraded too
        previous=previous,
        now=autoscaler.to_iso(now),
        blocker=blocker,
        pod_events=observed.pod_events,
        selector=builders.selector_string(name) + (f",{builders.ROLE_LABEL}={builders.LEADER}" if grouped else ""),
        endpoint=builders.endpoint(spec) if spec is not None else None,
        expert_parallel=int(decision.expert_parallel) if decision.expert_parallel is not None else None,
        placement=placement.replica_placement(observed.pods, topo_by_node, decision.reported, observed.starting),
        autoscaling=decision.autoscaling,
        elastic=decision.elastic,
        scaling=decision.scaling,
        disaggregation=disaggregation.status(spec, observed.pods, observed.prefill_pods, decision.prefill_replicas,
                                             decision.prefill_autoscaling),
    )
    warning = status_mod.degraded_event(previous, new)
    if warning:
        events.append(warning)
    if not status_mod.same_status(_prune(previous), _prune(new)):
        patch = {"status": _merge_patch(previous, new)}
        try:
            kube.merge_patch("InferenceService", namespace, name, patch, sub="status")
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        wrote.append("status")
    return Result(status=new, wrote=wrote, events=events, body=body)


def _ensure_secret(ctx: Context, body: Mapping[str, Any], secret: dict[str, Any], holding: str) -> str | None:
    """Create a Secret holding a key of this InferenceService's, once per uid and operator process
    (the operator may create Secrets, never read them: one that exists is taken as ours; were it
    not, the daemons' refusals say so). None, or the problem."""
    made = (body["metadata"].get("uid", ""), secret["metadata"]["name"])
    if made in ctx.secrets_made:
        return None
    try:
        ctx.kube.create(secret)
    except ApiError as e:
        if e.status != 409:
            return f"cannot create Secret {made[1]} for {holding}: {e}"
    ctx.secrets_made.add(made)
    return None


def _prune(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns ``old`` into ``new``: ``new`` with null for each key it
    dropped, at any depth (a merge patch merges objects, so a dropped key would stay: say
    ``status.disaggregation.prefill.autoscaling`` once the prefill autoscaler is removed)."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        before = old.get(k)
        out[k] = _merge_patch(before, v) if isinstance(v, Mapping) and isinstance(before, Mapping) else v
    return out


def _autoscale(
    cfg: Autoscaling,
    auto_status: dict[str, Any],
    current: int,
    per_pod: Mapping[str, Mapping[str, Any]],
    now: float,
    hold_up: str | None = None,
) -> tuple[dict[str, Any], autoscaler.Evaluation]:
    """One autoscaler step (pure) of ``cfg`` from ``current`` pods and their signals; the new
    status (status.autoscaling, status.disaggregation.prefill.autoscaling) and the evaluation.
    ``hold_up``: why growth waits (elastic EP grows first)."""
    samples = [s[cfg.metric] for s in per_pod.values() if cfg.metric in s]
    history = []
    for r in auto_status.get("recommendations") or []:
        try:
            history.append((autoscaler.from_iso(r["time"]), int(r["replicas"])))
        except (KeyError, ValueError):
            continue
    ev = autoscaler.evaluate(cfg, current, samples, history, now)
    if hold_up and ev.desired > current:
        ev = dataclasses.replace(ev, desired=current, reason="ElasticFirst", message=f"{ev.message}; {hold_up}")
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
    if auto_status.get("lastScaleTime"):
        out["lastScaleTime"] = auto_status["lastScaleTime"]
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
    return out, ev


def _record_scale(spec: ServiceSpec, cfg: Autoscaling, current: int, ev: autoscaler.Evaluation,
                  series: ScalingSeries = REPLICAS, pods: str = "") -> str | None:
    """An autoscaler step's metrics and log line; the Event text when it changed the size.
    ``pods``: which pods it sizes, when not the replicas ("prefill")."""
    autoscaled(spec.namespace, spec.name, series)
    if ev.value is not None:
        series.signal.labels(spec.namespace, spec.name, cfg.metric).set(ev.value)
    if ev.desired == current:
        return None
    series.decisions.labels(spec.namespace, spec.name, "up" if ev.desired > current else "down").inc()
    line = f"{current} -> {ev.desired} replicas ({ev.reason}): {ev.message}"
    log.info("autoscale %s/%s%s: %s", spec.namespace, spec.name, f" {pods}" if pods else "", line)
    return line


class _Conflict(Exception):
    pass


def _remove_stale(kube: Kube, observed: Observed, children: builders.Children, replicas: int) -> list[str]:
    """Delete what this InferenceService controls and no longer wants: the other layout's objects
    after podsPerReplica, spec.disaggregation.prefill.replicas or the LeaderWorkerSet CRD's presence
    changed, the workers of groups scaled away. A group whose leader has no IP
    this pass keeps its workers (its leader pod is being replaced). Returns ``-Kind`` per deletion."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children.all()}
    name, uid = observed.body["metadata"]["name"], observed.body["metadata"]["uid"]
    grouped = children.group_service is not None and children.workload["kind"] == "StatefulSet"
    candidates = [("Deployment", observed.deployment), ("Service", observed.group_service),
                  ("LeaderWorkerSet", observed.leader_worker_set),
                  *(("StatefulSet", st) for st in observed.stateful_sets),
                  ("Deployment", observed.prefill_deployment), ("ConfigMap", observed.prefill_instances)]
    gone = []
    for kind, obj in candidates:
        if obj is None or (kind, obj["metadata"]["name"]) in wanted or not _controlled_by(obj, uid):
            continue
        group = pod_groups.group_of(obj, name) if kind == "StatefulSet" else None
        if grouped and pod_groups.role(obj) == builders.WORKER and group is not None and group < replicas:
            continue
        kube.delete(kind, observed.body["metadata"].get("namespace", ""), obj["metadata"]["name"])
        gone.append(f"-{kind}")
    return gone


def _controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid and r.get("controller")
               for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


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
            actual = kube.get_live(kind, meta["namespace"], meta["name"])  # perhaps not one of ours
            if actual is None:
                raise Retry(f"{kind} {meta['name']} vanished during create") from e
    if not _controlled_by(actual, owner_uid):
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
