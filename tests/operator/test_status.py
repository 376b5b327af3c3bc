"""Status: conditions and counts from the observed Deployment and pods."""

from __future__ import annotations

import pytest

from pagoda_operator.builders import HASH_ANNOTATION
from pagoda_operator.status import Problem, Workload, compute, condition

NOW = "2024-05-01T12:00:00Z"
H = "hash-current"


def dep(replicas=3, ready=3, updated=3, total=None, hash_=H, generation=2, observed=2, conditions=()):
    return {
        "metadata": {"generation": generation, "annotations": {HASH_ANNOTATION: hash_}},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas if total is None else total,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": list(conditions),
        },
    }


def pod(name="p", **status):
    return {"metadata": {"name": name}, "status": status}


def conds(st):
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def run(deployment, desired=3, pods=(), previous=None, blocker=None, generation=5, pod_events=()):
    return compute(
        generation=generation,
        desired=desired,
        workload=Workload.of_deployment(deployment, desired, H),
        pods=list(pods),
        previous=previous,
        now=NOW,
        blocker=blocker,
        pod_events=pod_events,
    )


@pytest.mark.parametrize(
    "deployment, desired, ready, progressing, degraded",
    [
        (dep(), 3, ("True", "AllReplicasReady"), ("False", "Complete"), ("False", "AsExpected")),
        (None, 3, ("False", "ReplicasNotReady"), ("True", "Creating"), ("False", "AsExpected")),
        (
            dep(ready=1),
            3,
            ("False", "ReplicasNotReady"),
            ("True", "WaitingForReady"),
            ("False", "AsExpected"),
        ),
        # a new template: the Deployment still carries the old hash
        (dep(hash_="old"), 3, ("False", "ReplicasNotReady"), ("True", "RollingOut"), ("False", "AsExpected")),
        # template applied, controller has not observed it yet
        (
            dep(generation=3, observed=2),
            3,
            ("False", "ReplicasNotReady"),
            ("True", "RollingOut"),
            ("False", "AsExpected"),
        ),
        # rollout half way: 1 of 3 updated, old pods still serving
        (
            dep(updated=1, total=4),
            3,
            ("False", "ReplicasNotReady"),
            ("True", "RollingOut"),
            ("False", "AsExpected"),
        ),
        # scaled 3 -> 5: two new pods coming
        (
            dep(replicas=5, ready=3, updated=3, total=3),
            5,
            ("False", "ReplicasNotReady"),
            ("True", "ScalingUp"),
            ("False", "AsExpected"),
        ),
        # scaled 5 -> 3: two pods terminating
        (
            dep(ready=5, updated=5, total=5),
            3,
            ("False", "ReplicasNotReady"),
            ("True", "ScalingDown"),
            ("False", "AsExpected"),
        ),
        # ready but the Deployment has a different replica count than desired (autoscaler just decided)
        (
            dep(replicas=2, ready=2, updated=2),
            3,
            ("False", "ReplicasNotReady"),
            ("True", "RollingOut"),
            ("False", "AsExpected"),
        ),
        (
            dep(replicas=0, ready=0, updated=0),
            0,
            ("False", "ScaledToZero"),
            ("False", "Complete"),
            ("False", "AsExpected"),
        ),
        (
            dep(
                ready=2,
                conditions=[
                    {
                        "type": "Progressing",
                        "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": "took too long",
                    }
                ],
            ),
            3,
            ("False", "ReplicasNotReady"),
            ("False", "ProgressDeadlineExceeded"),
            ("True", "ProgressDeadlineExceeded"),
        ),
        (
            dep(
                ready=0,
                conditions=[
                    {
                        "type": "ReplicaFailure",
                        "status": "True",
                        "reason": "FailedCreate",
                        "message": "exceeded quota",
                    }
                ],
            ),
            3,
            ("False", "ReplicasNotReady"),
            ("True", "WaitingForReady"),
            ("True", "ReplicaFailure"),
        ),
    ],
)
def test_conditions_table(deployment, desired, ready, progressing, degraded):
    st = run(deployment, desired)
    assert conds(st) == {"Ready": ready, "Progressing": progressing, "Degraded": degraded}
    assert all(c["observedGeneration"] == 5 for c in st["conditions"])
    assert st["observedGeneration"] == 5


@pytest.mark.parametrize(
    "pod_status, reason, fragment",
    [
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
            "Unschedulable",
            "Insufficient nvidia.com/gpu",
        ),
        (
            {
                "containerStatuses": [
                    {
                        "name": "daemon",
                        "restartCount": 5,
                        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
                        "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                    }
                ]
            },
            "CrashLoopBackOff",
            "restarted 5 times), last exit OOMKilled code 137",
        ),
        (
            {"containerStatuses": [{"name": "daemon", "state": {"waiting": {"reason": "ImagePullBackOff"}}}]},
            "ImagePullError",
            "ImagePullBackOff",
        ),
        (
            {
                "containerStatuses": [
                    {"name": "daemon", "state": {"waiting": {"reason": "ContainerCreating"}}}
                ]
            },
            None,
            None,
        ),
    ],
)
def test_degraded_from_pods(pod_status, reason, fragment):
    st = run(dep(ready=2), pods=[pod("x", **pod_status), pod("y")])
    deg = condition(st, "Degraded")
    if reason is None:
        assert deg["status"] == "False"
        return
    assert (deg["status"], deg["reason"]) == ("True", reason)
    assert fragment in deg["message"] and "pod x" in deg["message"]


@pytest.mark.parametrize("waiting", [{"reason": "CrashLoopBackOff", "message": "back-off 10s"}, None])
def test_a_layout_the_daemon_refused_is_degraded_naming_the_spec_fields(waiting):
    """A layout only the model's config.json rules out: `pagoda serve` exits 2 with one line,
    and Degraded says so in the InferenceService's own terms, during the back-off and while the
    container runs again."""
    refusal = ("pagoda serve: the number of attention heads (32) is not divisible by tensor_parallel_size × "
               "expert_parallel_size = 3; num_redundant_experts needs enable_eplb")
    status = {"name": "daemon", "restartCount": 1, "ready": False,
              "state": {"waiting": waiting} if waiting else {"running": {"startedAt": NOW}},
              "lastState": {"terminated": {"reason": "Error", "exitCode": 2,
                                           "message": f"INFO loading config\n{refusal}\n"}}}
    deg = condition(run(dep(ready=2), pods=[pod("x", containerStatuses=[status]), pod("y")]), "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "ConfigurationRefused")
    assert deg["message"] == (
        "pod x container daemon refused its configuration (exit 2, restarted 1 times): pagoda serve: the number of attention heads "
        "(32) is not divisible by spec.parallelism.tensor × spec.parallelism.expert = 3; "
        "spec.parallelism.eplb.redundantExperts needs spec.parallelism.eplb")


def test_terminating_pods_are_not_problems():
    p = pod("x", containerStatuses=[{"name": "d", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}])
    p["metadata"]["deletionTimestamp"] = NOW
    assert condition(run(dep(), pods=[p]), "Degraded")["status"] == "False"


def test_several_problems_are_counted():
    bad = [
        pod(n, containerStatuses=[{"name": "d", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}])
        for n in "abc"
    ]
    assert condition(run(dep(ready=0), pods=bad), "Degraded")["message"].endswith("(and 2 more)")


def test_blocker_keeps_observed_generation_and_says_why():
    previous = {"observedGeneration": 4, "conditions": []}
    st = run(dep(), previous=previous, blocker=Problem("InvalidSpec", "tensor (3) does not divide"))
    assert conds(st) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert st["observedGeneration"] == 4
    assert "tensor (3) does not divide" in condition(st, "Degraded")["message"]
    assert st["readyReplicas"] == 3  # the children still serve the previous spec


def test_last_transition_time_moves_only_with_status():
    first = run(dep(ready=1))
    later = compute(
        generation=5,
        desired=3,
        workload=Workload.of_deployment(dep(ready=2), 3, H),
        pods=[],
        previous=first,
        now="2024-05-01T12:05:00Z",
    )
    assert condition(later, "Ready")["lastTransitionTime"] == NOW  # still False
    ready = compute(
        generation=5,
        desired=3,
        workload=Workload.of_deployment(dep(), 3, H),
        pods=[],
        previous=later,
        now="2024-05-01T12:09:00Z",
    )
    assert condition(ready, "Ready")["lastTransitionTime"] == "2024-05-01T12:09:00Z"
    assert condition(ready, "Degraded")["lastTransitionTime"] == NOW


def test_counts_default_to_zero():
    st = run({"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {}}, desired=1)
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"], st["desiredReplicas"]) == (0, 0, 0, 1)


def test_crash_loop_names_what_the_container_said():
    """With terminationMessagePolicy FallbackToLogsOnError the last log line is the message."""
    log_tail = "loading...\nTraceback (most recent call last):\n  ...\npagoda serve: model path '/models' has no config.json\n"
    p = pod(
        "x",
        containerStatuses=[
            {
                "name": "daemon",
                "restartCount": 2,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting"}},
                "lastState": {"terminated": {"reason": "Error", "exitCode": 2, "message": log_tail}},
            }
        ],
    )
    deg = condition(run(dep(ready=0), pods=[p]), "Degraded")
    assert deg["reason"] == "ConfigurationRefused"  # exit 2: `pagoda serve` refused what it was given
    assert deg["message"] == (
        "pod x container daemon refused its configuration (exit 2, restarted 2 times): "
        "pagoda serve: model path '/models' has no config.json"
    )


def test_long_termination_messages_are_shortened():
    p = pod(
        "x",
        containerStatuses=[
            {
                "name": "daemon",
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"reason": "Error", "exitCode": 1, "message": "E" * 1000}},
            }
        ],
    )
    msg = condition(run(dep(ready=0), pods=[p]), "Degraded")["message"]
    assert msg.endswith("E...") and len(msg) < 400


def starting(name="x", uid="u-x"):
    return {
        "metadata": {"name": name, "uid": uid},
        "spec": {"nodeName": "node-1"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [{"name": "daemon", "state": {"waiting": {"reason": "ContainerCreating"}}}],
        },
    }


def warning(pod_name, reason, message, uid="u-x", ts="2024-05-01T11:59:00Z"):
    return {
        "involvedObject": {"kind": "Pod", "name": pod_name, "uid": uid},
        "type": "Warning",
        "reason": reason,
        "message": message,
        "lastTimestamp": ts,
    }


def test_pods_stuck_before_start_are_explained_by_their_events():
    from pagoda_operator.status import needs_pod_events

    stuck = starting()
    assert needs_pod_events([stuck]) and not needs_pod_events([pod("y")])
    events = [
        warning("x", "FailedMount", "old message", ts="2024-05-01T11:00:00Z"),
        warning(
            "x",
            "FailedMount",
            'MountVolume.SetUp failed for volume "model" : hostPath type check failed: /data/m is not a directory',
        ),
        warning("other", "FailedMount", "not ours", uid="u-other"),
        warning("x", "FailedMount", "an earlier pod of the same name", uid="u-old"),
        warning("x", "BackOff", "not a start failure"),
    ]
    deg = condition(run(dep(replicas=1, ready=0), desired=1, pods=[stuck], generation=1, pod_events=events),
                    "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "VolumeMountFailed")
    assert deg["message"] == (
        'pod x: FailedMount: MountVolume.SetUp failed for volume "model" : hostPath type check failed: '
        "/data/m is not a directory"
    )
    # Without events (or once the pod runs) there is nothing to report.
    assert condition(run(dep(replicas=1, ready=0), desired=1, pods=[stuck]), "Degraded")["status"] == "False"
    running = {
        **stuck,
        "status": {"phase": "Running", "containerStatuses": [{"name": "daemon", "state": {"running": {}}}]},
    }
    st = run(dep(replicas=1, ready=0), desired=1, pods=[running], generation=1, pod_events=events)
    assert condition(st, "Degraded")["status"] == "False" and not needs_pod_events([running])
