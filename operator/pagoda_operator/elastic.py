"""Elastic expert parallelism, the operator's half: decide each replica's expert-parallel size
from the signals it scrapes, ask the daemons for it, and say in status what was decided and
where each replica's transition stands (docs/elastic-ep.md).

- The rule is the replica autoscaler's (``autoscaler.evaluate``: the HPA's ratio, tolerance and
  stabilisation windows), over expert-parallel sizes between minExpert and maxExpert.
- The two autoscalers do not fight: growing, the expert-parallel size goes first (seconds, on
  GPUs the pod already holds) and the replica autoscaler adds replicas only once every replica
  is at maxExpert; shrinking, replicas go first (that frees whole pods and their GPUs) and the
  expert-parallel size shrinks only at minReplicas.
- The daemons' admin routes take a key only the operator and the pod know: derived from the
  operator's secret for this InferenceService's uid (HMAC-SHA256), written once to a Secret
  the pod reads. The operator may create Secrets but never read one.

``evaluate``, ``status_of`` and the builders are pure; ``read_states`` and ``request`` do the HTTP.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda_operator import autoscaler
from pagoda_operator.placement import pod_ready
from pagoda_operator.spec import Elastic, ServiceSpec

ADMIN_KEY_ENV = "PAGODA_ADMIN_API_KEY"  # the daemon's (pagoda_daemon.server.auth.ADMIN_API_KEY_ENV)
ADMIN_KEY_KEY = "admin-api-key"
OPERATOR_SECRET_ENV = "PAGODA_OPERATOR_ADMIN_SECRET"  # the chart's Secret, in the operator's pod only
# The daemon's phases (pagoda_daemon.engine.messages.ELASTIC_PHASES; a contract test keeps them equal).
PHASES = ("idle", "preparing", "transferring", "capturing", "done", "failed")
TRANSITIONS = ("preparing", "transferring", "capturing")  # a daemon in one of these is resizing
MAX_STATE_BYTES = 64 << 10  # a daemon's /elastic_ep is a few hundred bytes


def admin_secret_name(name: str) -> str:
    return f"{name}-pagoda-admin"


def admin_key(operator_secret: bytes, namespace: str, name: str, uid: str) -> str:
    """This InferenceService's admin key: the same on every pass and after a restart, never
    stored by the operator, different for a service re-created under the same name."""
    return hmac.new(operator_secret, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).hexdigest()


def admin_secret(spec: ServiceSpec, owner: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The Secret the pod reads its admin key from, owned by the InferenceService."""
    meta = owner["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": admin_secret_name(spec.name),
            "namespace": spec.namespace,
            "labels": {"app.kubernetes.io/managed-by": "pagoda-operator", "pagoda.dev/inferenceservice": spec.name},
            "ownerReferences": [{"apiVersion": owner.get("apiVersion", "pagoda.dev/v1alpha1"), "kind": "InferenceService",
                                 "name": meta["name"], "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "type": "Opaque",
        "data": {ADMIN_KEY_KEY: base64.b64encode(key.encode()).decode()},
    }


def admin_key_env(spec: ServiceSpec) -> dict[str, Any]:
    """Optional: with no operator secret (so no Secret) the daemon serves, its admin routes off."""
    return {"name": ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": admin_secret_name(spec.name),
                                                                  "key": ADMIN_KEY_KEY, "optional": True}}}


@dataclass(frozen=True)
class Decision:
    desired: int
    evaluation: autoscaler.Evaluation
    held: str | None  # why a change the rule wants waits (the replica autoscaler acts first)


def evaluate(e: Elastic, current: int, samples: Sequence[float], history: Sequence[tuple[float, int]], now: float,
             replicas_can_shrink: bool, pods: int) -> Decision:
    """The next expert-parallel size from the current one (the smallest a replica serves with);
    `samples` come from the `pods` serving pods (those that did not answer count as the
    replica autoscaler counts them)."""
    ev = autoscaler.evaluate(e.rule, current, samples, history, now, expected=pods)
    if ev.desired < current and replicas_can_shrink:
        return Decision(current, ev, "ReplicasFirst: replicas shrink before the expert-parallel size does")
    return Decision(ev.desired, ev, None)


def status_of(e: Elastic, previous: Mapping[str, Any], decision: Decision | None, current: int,
              states: Mapping[str, Mapping[str, Any]], now: float) -> dict[str, Any]:
    """status.elastic: the bounds, the last decision (with its history) and each pod's state."""
    out: dict[str, Any] = {k: v for k, v in previous.items() if k in ("decisions", "lastScaleTime")}
    out.update(minExpert=e.min_expert, maxExpert=e.max_expert, metric=e.metric, target=e.rule.target,
               currentExpertParallel=current)
    if decision is not None:
        ev = decision.evaluation
        out.update(desiredExpertParallel=decision.desired, reason="Held" if decision.held else ev.reason,
                   message=decision.held or ev.message, lastEvaluationTime=autoscaler.to_iso(now),
                   recommendations=[{"time": autoscaler.to_iso(t), "size": r} for t, r in ev.recommendations])
        if ev.value is not None:
            out["value"] = round(ev.value, 6)
        if decision.desired != current:
            entry = {"time": autoscaler.to_iso(now), "from": current, "to": decision.desired, "reason": ev.reason,
                     "metric": e.metric, "target": e.rule.target}
            if ev.value is not None:
                entry["value"] = round(ev.value, 6)
            out["decisions"] = autoscaler.record(out.get("decisions") or [], entry)
            out["lastScaleTime"] = autoscaler.to_iso(now)
    else:
        out.update({k: previous[k] for k in ("desiredExpertParallel", "reason", "message", "value",
                                             "lastEvaluationTime", "recommendations") if k in previous})
    out["pods"] = [_pod_status(pod, s) for pod, s in sorted(states.items())]
    return out


def _pod_status(pod: str, s: Mapping[str, Any]) -> dict[str, Any]:
    """One pod's entry, from what its daemon answered: only values of the schema's types go into
    status (a pod that answers anything else must not make the status patch fail)."""
    entry: dict[str, Any] = {"pod": pod}
    if _sized(s):
        entry["expertParallel"] = s["size"]
    if s.get("phase") in PHASES:
        entry["phase"] = s["phase"]
    seconds = s.get("last_seconds")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) and seconds:
        entry["lastTransitionSeconds"] = seconds
    error = s.get("last_error") or s.get("unreachable")
    if error:
        entry["lastError"] = str(error)[:500]
    return entry


def history_of(previous: Mapping[str, Any]) -> list[tuple[float, int]]:
    out = []
    for r in previous.get("recommendations") or []:
        try:
            out.append((autoscaler.from_iso(r["time"]), int(r["size"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def scaling_condition(states: Mapping[str, Mapping[str, Any]], desired: int | None) -> tuple[str, str, str]:
    """(status, reason, message) of the ``Scaling`` condition."""
    moving = sorted(p for p, s in states.items() if s.get("phase") in TRANSITIONS or s.get("is_scaling"))
    failed = sorted(p for p, s in states.items() if s.get("phase") == "failed")
    if moving:
        return "True", "Resizing", f"expert-parallel resize in progress on {', '.join(moving)}"
    off = sorted(p for p, s in states.items() if desired is not None and _sized(s) and s["size"] != desired)
    if failed:
        errors = "; ".join(f"{p}: {states[p].get('last_error') or 'failed'}" for p in failed)
        return "False", "ResizeFailed", f"rolled back, still serving at the old size: {errors}"[:1000]
    if off:
        return "True", "Resizing", f"asking {', '.join(off)} for {desired} expert-parallel ranks"
    return "False", "Stable", f"every replica serves with {desired} expert-parallel ranks" if desired else "stable"


def wanted_resizes(states: Mapping[str, Mapping[str, Any]], desired: int) -> list[str]:
    """Pods to ask for `desired`: those that answered, at another size and not resizing already."""
    return sorted(p for p, s in states.items() if _sized(s) and s["size"] != desired
                  and s.get("phase") not in TRANSITIONS and not s.get("is_scaling"))


def _sized(state: Mapping[str, Any]) -> bool:
    return isinstance(state.get("size"), int) and not isinstance(state.get("size"), bool)


# ---- HTTP to the daemons ---------------------------------------------------------------------


def _url(pod: Mapping[str, Any], port: int, path: str) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    return f"http://{f'[{ip}]' if ':' in ip else ip}:{port}{path}"


def _call(url: str, key: str, timeout: float, body: dict | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read(MAX_STATE_BYTES + 1)
    if len(raw) > MAX_STATE_BYTES:
        raise ValueError(f"{url} answered more than {MAX_STATE_BYTES} bytes")
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{url} answered {type(value).__name__}, not an object")
    return value


def read_states(pods: Sequence[Mapping[str, Any]], port: int, key: str, timeout: float,
                call=_call) -> dict[str, dict[str, Any]]:
    """Each ready pod's /elastic_ep; a pod whose answer fails (a 401 from a key that is not
    the operator's, a timeout) gets ``{"unreachable": why}``: shown in status, never resized."""
    out: dict[str, dict[str, Any]] = {}
    for pod in pods:
        url = _url(pod, port, "/elastic_ep")
        if url is None or pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
            continue
        try:
            out[pod["metadata"]["name"]] = call(url, key, timeout)
        except Exception as e:  # reported, tried again next pass
            out[pod["metadata"]["name"]] = {"unreachable": f"/elastic_ep: {type(e).__name__}: {e}"[:300]}
    return out


def request(pod: Mapping[str, Any], port: int, key: str, size: int, timeout: float, call=_call) -> str | None:
    """Ask one pod for `size` expert-parallel ranks; None, or why it was not accepted."""
    url = _url(pod, port, "/scale_elastic_ep")
    if url is None:
        return "no pod IP"
    try:
        call(url, key, timeout, {"new_expert_parallel_size": size})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
