"""Pure: observed workload and pods -> the conditions and counts of an InferenceService status.

The workload is the replicas' controller (a Deployment, or with podsPerReplica > 1 the
StatefulSets of groups of pods or their LeaderWorkerSet) reduced to one :class:`Workload`.
Ready is True only when it carries the pod template of the current generation and its ready,
updated and total replicas all equal the desired count; a group is one replica, ready when every
member is. Progressing is True while a rollout or a scale is under way. Degraded says, with a
reason, why things are not converging: an invalid spec, no eligible node, pods that cannot be
scheduled, pods whose volumes cannot be mounted, a configuration the daemon refused (with the
spec fields it named), crash loops (with the last lines the container wrote before it died),
image pulls, replica failures or an exceeded progress deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda_daemon.options import EXIT_REFUSED
from pagoda_operator import leader_worker_set
from pagoda_operator.builders import GROUP_LABEL, HASH_ANNOTATION, LEADER, ROLE_LABEL, WORKER
from pagoda_operator.placement import pod_ready
from pagoda_operator.spec import in_crd_terms

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")
CRASH_REASONS = {
    "CrashLoopBackOff": "CrashLoopBackOff",
    "ErrImagePull": "ImagePullError",
    "ImagePullBackOff": "ImagePullError",
    "InvalidImageName": "ImagePullError",
    "CreateContainerConfigError": "ContainerConfigError",
    "CreateContainerError": "ContainerConfigError",
    "RunContainerError": "ContainerConfigError",
}
# Warning Events (reason -> our reason) that explain a pod stuck before its containers start: the
# pod's own status then only says ContainerCreating, so these come from the namespace's Events.
START_FAILURES = {
    "FailedMount": "VolumeMountFailed",
    "FailedAttachVolume": "VolumeMountFailed",
    "FailedCreatePodSandBox": "PodSandboxFailed",
}
# Waiting reasons of a container whose pod has not started yet.
NOT_STARTED = ("ContainerCreating", "PodInitializing")
DETAIL_CHARS = 300


@dataclass(frozen=True)
class Problem:
    """A reason the desired state cannot be (or is not being) reached."""

    reason: str
    message: str


def rolled_out(workload: Mapping[str, Any] | None, desired: int, desired_hash: str | None) -> bool:
    """The Deployment (or StatefulSet) carries our current template and replica count, and its
    controller saw it."""
    if not workload:
        return False
    meta = workload.get("metadata") or {}
    if desired_hash is not None and (meta.get("annotations") or {}).get(HASH_ANNOTATION) != desired_hash:
        return False
    if (workload.get("spec") or {}).get("replicas") != desired:
        return False
    observed = ((workload.get("status") or {}).get("observedGeneration")) or 0
    return observed >= (meta.get("generation") or 0)


@dataclass(frozen=True)
class Workload:
    """The replicas as their controllers report them."""

    exists: bool
    current: bool  # carries this generation's template and replica count (rolled_out)
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    problems: tuple[Problem, ...] = ()

    @classmethod
    def of_deployment(cls, deployment: Mapping[str, Any] | None, desired: int,
                      desired_hash: str | None) -> Workload:
        st = (deployment or {}).get("status") or {}
        return cls(
            exists=deployment is not None,
            current=rolled_out(deployment, desired, desired_hash),
            replicas=int(st.get("replicas") or 0),
            ready=int(st.get("readyReplicas") or 0),
            updated=int(st.get("updatedReplicas") or 0),
            problems=tuple(deployment_problems(deployment)),
        )

    @classmethod
    def of_groups(cls, name: str, leaders: Mapping[str, Any] | None, workers: Mapping[int, Mapping[str, Any]],
                  pods: Sequence[Mapping[str, Any]], desired: int, desired_hashes: Mapping[str, str] | None,
                  pods_per_replica: int) -> Workload:
        """Groups of pods: the leaders' StatefulSet ``<name>`` (pod ``<name>-<g>`` leads group g)
        and one workers' StatefulSet per group (by group). A group is ready when its leader and
        all its workers are, all of the current revision; ``desired_hashes``: the spec hash of
        each StatefulSet by name, None when this pass does not know them (a blocked spec)."""
        alive = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        leader_rev = ((leaders or {}).get("status") or {}).get("updateRevision")

        def group(g: int) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]], bool]:
            leader = next((p for p in alive if p["metadata"]["name"] == f"{name}-{g}"
                           and _labels(p).get(ROLE_LABEL) == LEADER), None)
            sts = workers.get(g)
            members = [p for p in alive if _labels(p).get(ROLE_LABEL) == WORKER
                       and _labels(p).get(GROUP_LABEL) == str(g)]
            worker_rev = ((sts or {}).get("status") or {}).get("updateRevision")
            fresh = (
                leader is not None and _labels(leader).get("controller-revision-hash") == leader_rev
                and sts is not None and rolled_out(sts, pods_per_replica - 1, (desired_hashes or {}).get(
                    (sts.get("metadata") or {}).get("name", "")))
                and all(_labels(p).get("controller-revision-hash") == worker_rev for p in members)
            )
            return leader, members, fresh

        return cls._of_members(leaders, desired, (desired_hashes or {}).get(name), pods_per_replica, group)

    @classmethod
    def of_leader_worker_set(cls, lws: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]], desired: int,
                             desired_hash: str | None, pods_per_replica: int) -> Workload:
        """Groups of pods as one LeaderWorkerSet (leader_worker_set.py): a group's pods by the
        controller's group-index label, current when they carry the live object's template
        hash. ``desired_hash``: the object's spec hash, None when this pass does not know it."""
        alive = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        want = leader_worker_set.template_hash(lws)

        def group(g: int) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]], bool]:
            leader, members = leader_worker_set.members(alive, g)
            every = [leader, *members] if leader is not None else members
            fresh = want is not None and all(
                ((p.get("metadata") or {}).get("annotations") or {}).get(
                    leader_worker_set.TEMPLATE_HASH_ANNOTATION) == want for p in every)
            return leader, members, fresh

        return cls._of_members(lws, desired, desired_hash, pods_per_replica, group)

    @classmethod
    def _of_members(cls, workload: Mapping[str, Any] | None, desired: int, desired_hash: str | None,
                    pods_per_replica: int,
                    group: Callable[[int], tuple[Mapping[str, Any] | None, list[Mapping[str, Any]], bool]]
                    ) -> Workload:
        """Groups 0..desired-1, each as ``group(g)`` gives it: (its leader pod or None, its worker
        pods, whether they are all of the current revision). A group counts as updated when it is
        whole and current, ready when also every member is Ready; a member that restarted and is
        not Ready is named in GroupMemberFailed."""
        ready = updated = 0
        problems: list[Problem] = []
        for g in range(desired):
            leader, members, fresh = group(g)
            whole = leader is not None and len(members) == pods_per_replica - 1
            every = [leader, *members] if leader is not None else members
            updated += fresh and whole
            ready += fresh and whole and all(map(pod_ready, every))
            failed = [p for p in every if not pod_ready(p) and _restarts(p)]
            if failed:
                problems.append(Problem("GroupMemberFailed", f"replica {g}: " + "; ".join(
                    _failure(p) for p in failed) + "; its pods restart together"))
        st = (workload or {}).get("status") or {}
        return cls(
            exists=workload is not None,
            current=rolled_out(workload, desired, desired_hash),
            replicas=int(st.get("replicas") or 0),
            ready=ready,
            updated=updated,
            problems=tuple(problems),
        )


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _restarts(pod: Mapping[str, Any]) -> int:
    return sum(int(cs.get("restartCount") or 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def _failure(pod: Mapping[str, Any]) -> str:
    """``pod X exited (code 1, restarted 2 times): <its last line>``."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        last = ((cs.get("lastState") or {}).get("terminated")) or {}
        if last or cs.get("restartCount"):
            line = _last_line(last.get("message"))
            return (f"pod {pod['metadata']['name']} exited (code {last.get('exitCode')}, restarted "
                    f"{cs.get('restartCount', 0)} times)" + (f": {line}" if line else ""))
    return f"pod {pod['metadata']['name']} is not ready"


def _last_line(text: str | None) -> str:
    """The last non-empty line of a container's termination message (with the daemon's
    ``terminationMessagePolicy: FallbackToLogsOnError``: the end of its log), shortened."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    return last if len(last) <= DETAIL_CHARS else last[: DETAIL_CHARS - 3] + "..."


def waiting_to_start(pod: Mapping[str, Any]) -> bool:
    """Bound to a node, not deleted, and no container started yet (volumes, sandbox, pull)."""
    if pod["metadata"].get("deletionTimestamp") or not (pod.get("spec") or {}).get("nodeName"):
        return False
    st = pod.get("status") or {}
    if st.get("phase") not in (None, "Pending"):
        return False
    statuses = (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])
    return not statuses or any(
        ((cs.get("state") or {}).get("waiting") or {}).get("reason") in NOT_STARTED for cs in statuses
    )


def needs_pod_events(pods: Sequence[Mapping[str, Any]]) -> bool:
    """Whether reading the namespace's Warning Events could explain something (cheap guard)."""
    return any(waiting_to_start(p) for p in pods)


def _start_failure(pod: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> Problem | None:
    meta = pod["metadata"]
    mine = [
        e
        for e in events
        if (e.get("involvedObject") or {}).get("name") == meta["name"]
        and (e.get("involvedObject") or {}).get("uid") in (None, meta.get("uid"))
        and e.get("reason") in START_FAILURES
    ]
    if not mine:
        return None
    latest = max(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    message = (latest.get("message") or "").strip()
    if len(message) > DETAIL_CHARS:
        message = message[: DETAIL_CHARS - 3] + "..."
    return Problem(START_FAILURES[latest["reason"]], f"pod {meta['name']}: {latest['reason']}: {message}")


def pod_problems(
    pods: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]] = ()
) -> list[Problem]:
    """Per-pod trouble: unschedulable, volumes that cannot be mounted (from ``events``, the
    namespace's Warning Events about pods), crash loops, image pulls. In pod-name order."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        st = pod.get("status") or {}
        if events and waiting_to_start(pod):
            failure = _start_failure(pod, events)
            if failure:
                out.append(failure)
        for c in st.get("conditions") or []:
            if (
                c.get("type") == "PodScheduled"
                and c.get("status") == "False"
                and c.get("reason") == "Unschedulable"
            ):
                out.append(
                    Problem(
                        "Unschedulable", f"pod {name} cannot be scheduled: {c.get('message', '')}".strip()
                    )
                )
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            last = ((cs.get("lastState") or {}).get("terminated")) or {}
            if last.get("exitCode") == EXIT_REFUSED and not cs.get("ready"):
                # Checks that need the model's config.json (a layout its heads or experts cannot
                # be split into) run in the daemon, not at apply time: name the spec's fields.
                line = _last_line(last.get("message")) or "(no message)"
                out.append(Problem("ConfigurationRefused", f"pod {name} container {cs.get('name')} refused "
                                   f"its configuration (exit {EXIT_REFUSED}, restarted "
                                   f"{cs.get('restartCount', 0)} times): {in_crd_terms(line)}"))
                continue
            reason = CRASH_REASONS.get(waiting.get("reason", ""))
            if not reason:
                continue
            msg = f"pod {name} container {cs.get('name')}: {waiting.get('reason')}"
            if cs.get("restartCount"):
                msg += f" (restarted {cs['restartCount']} times)"
            if last.get("reason"):
                msg += f", last exit {last.get('reason')} code {last.get('exitCode')}"
            # What the container said before it died names the problem better than the back-off.
            detail = _last_line(last.get("message")) or waiting.get("message")
            if detail:
                msg += f": {detail}"
            out.append(Problem(reason, msg))
    return out


def deployment_problems(deployment: Mapping[str, Any] | None) -> list[Problem]:
    out = []
    for c in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            out.append(Problem("ReplicaFailure", c.get("message") or c.get("reason") or "replica failure"))
        if (
            c.get("type") == "Progressing"
            and c.get("status") == "False"
            and c.get("reason") == "ProgressDeadlineExceeded"
        ):
            out.append(
                Problem(
                    "ProgressDeadlineExceeded", c.get("message") or "rollout exceeded its progress deadline"
                )
            )
    return out


def set_condition(
    previous: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> dict[str, Any]:
    """A condition, keeping the previous lastTransitionTime when its status did not change."""
    value = "True" if status else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    since = (
        old["lastTransitionTime"]
        if old and old.get("status") == value and old.get("lastTransitionTime")
        else now
    )
    return {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def compute(
    *,
    generation: int,
    desired: int,
    workload: Workload,
    pods: Sequence[Mapping[str, Any]],
    previous: Mapping[str, Any] | None,
    now: str,
    blocker: Problem | None = None,
    pod_events: Sequence[Mapping[str, Any]] = (),
    selector: str | None = None,
    endpoint: str | None = None,
    expert_parallel: int | None = None,
    placement: list[dict[str, Any]] | None = None,
    autoscaling: dict[str, Any] | None = None,
    elastic: dict[str, Any] | None = None,
    scaling: tuple[str, str, str] | None = None,
    disaggregation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole status: conditions, counts and observedGeneration, and what the pass carries
    through (the scale selector, the endpoint, the expert-parallel size, where each replica
    runs, the autoscaler's state, elastic EP's state, the prefill/decode roles). ``scaling``: the ``Scaling`` condition
    (status, reason, message) of elastic EP, which only an elastic InferenceService has.

    ``blocker`` is a problem that stopped the operator from applying this generation (InvalidSpec,
    NoEligibleNodes): the children then still carry the previous spec, observedGeneration stays
    where it was, and Ready is False because the current generation is not served.
    ``pod_events``: Warning Events about pods of the namespace (see :func:`needs_pod_events`).
    """
    previous = previous or {}
    prev_conds = previous.get("conditions") or []
    counts = {"replicas": workload.replicas, "readyReplicas": workload.ready, "updatedReplicas": workload.updated}
    problems = ([blocker] if blocker else []) + list(workload.problems) + pod_problems(pods, pod_events)
    current = blocker is None and workload.current
    ready = (
        current
        and desired > 0
        and counts["updatedReplicas"] == desired
        and counts["readyReplicas"] == desired
        and counts["replicas"] == desired
    )
    progress = f"{counts['readyReplicas']}/{desired} ready, {counts['updatedReplicas']}/{desired} updated"

    if blocker:
        ready_c = (False, blocker.reason, f"generation {generation} is not applied: {blocker.message}")
        prog_c = (False, blocker.reason, "waiting for a spec that can be applied")
    elif ready:
        ready_c = (True, "AllReplicasReady", f"{desired}/{desired} replicas ready at generation {generation}")
        prog_c = (False, "Complete", f"generation {generation} is rolled out")
    else:
        if desired == 0 and current and counts["replicas"] == 0:
            ready_c = (False, "ScaledToZero", "no replicas requested")
            prog_c = (False, "Complete", f"generation {generation} is rolled out (0 replicas)")
        else:
            ready_c = (False, "ReplicasNotReady", progress)
            if not workload.exists:
                why = "Creating"
            elif not current or counts["updatedReplicas"] < min(desired, counts["replicas"] or desired):
                why = "RollingOut"
            elif counts["replicas"] > desired:
                why = "ScalingDown"
            elif counts["readyReplicas"] < desired and counts["replicas"] < desired:
                why = "ScalingUp"
            else:
                why = "WaitingForReady"
            deadline = any(p.reason == "ProgressDeadlineExceeded" for p in problems)
            prog_c = (not deadline, "ProgressDeadlineExceeded" if deadline else why, progress)

    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        deg_c = (True, first.reason, first.message + more)
    else:
        deg_c = (False, "AsExpected", "no problems observed")

    conditions = [
        set_condition(prev_conds, t, *c, generation=generation, now=now)
        for t, c in zip(CONDITION_TYPES, (ready_c, prog_c, deg_c))
    ]
    if scaling is not None:
        conditions.append(set_condition(prev_conds, "Scaling", scaling[0] == "True", scaling[1], scaling[2],
                                        generation=generation, now=now))
    observed = previous.get("observedGeneration") if blocker else generation
    out: dict[str, Any] = {
        "conditions": conditions,
        "replicas": counts["replicas"],
        "readyReplicas": counts["readyReplicas"],
        "updatedReplicas": counts["updatedReplicas"],
        "desiredReplicas": desired,
    }
    if observed is not None:
        out["observedGeneration"] = observed
    carried = {"selector": selector, "endpoint": endpoint, "expertParallel": expert_parallel,
               "placement": placement, "autoscaling": autoscaling, "elastic": elastic,
               "disaggregation": disaggregation}
    out.update({k: v for k, v in carried.items() if v is not None})
    return out


def degraded_event(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """A Warning Event when the status turns Degraded, or Degraded for another reason."""
    old = condition(previous, "Degraded") or {}
    cur = condition(new, "Degraded") or {}
    if cur.get("status") == "True" and (old.get("status") != "True" or old.get("reason") != cur.get("reason")):
        return ("Warning", cur["reason"], cur.get("message", ""))
    return None


def condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Equal for the purpose of writing: lastTransitionTime only moves with status, so compare all."""
    return dict(a or {}) == dict(b or {})
