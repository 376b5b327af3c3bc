"""decide() alone: the reconcile pass's decisions from hand-built observations, no API at all
(observe() reads, decide() is pure, apply() writes)."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda_daemon.capabilities import supported
from pagoda_operator.builders import Settings
from pagoda_operator.reconcile import Decision, Observed, decide
from pagoda_operator.spec import InvalidSpec, Supports, parse
from tests.operator.operator_fakes import every_capability, isvc, topology

SETTINGS = Settings(daemon_image="img:1")
NOW = 1_800_000_000.0


def observed(body: dict[str, Any], *, topologies=(), deployment=None, signals=None,
             supports: Supports = supported) -> Observed:
    """What observe() would have read: the body parsed as observe() parses it, and the rest."""
    meta = body["metadata"]
    try:
        spec, error = parse(meta["name"], meta["namespace"], body["spec"], supports), None
    except InvalidSpec as e:
        spec, error = None, str(e)
    children = {"ConfigMap": None, "Service": None}
    return Observed(body, spec, error, list(topologies), deployment, [], children, signals, [])


def test_a_valid_spec_decides_every_child_and_the_replicas():
    d = decide(observed(isvc(replicas=3)), SETTINGS, NOW)
    assert d.blocker is None and d.replicas == 3
    assert d.children is not None and {c["kind"] for c in d.children.all()} == {"ConfigMap", "Service", "Deployment"}
    assert d.children.workload["spec"]["replicas"] == 3 and d.scale is None


def test_an_invalid_spec_keeps_the_children_and_the_live_replicas():
    body = isvc(resources={"gpusPerReplica": 8}, parallelism={"tensor": 3})
    d = decide(observed(body, deployment={"spec": {"replicas": 2}}, supports=every_capability), SETTINGS, NOW)
    assert d.children is None and d.replicas == 2
    assert d.blocker is not None and d.blocker.reason == "InvalidSpec" and "must equal" in d.blocker.message


def test_a_capability_the_daemon_lacks_blocks_the_generation():
    d = decide(observed(isvc(engine={"kvCacheDtype": "fp8"})), SETTINGS, NOW)
    assert d.children is None and d.blocker is not None and "spec.engine.kvCacheDtype" in d.blocker.message


def test_more_gpus_than_any_node_offers_is_invalid():
    body = isvc(resources={"gpusPerReplica": 8}, parallelism={"tensor": 8})
    d = decide(observed(body, topologies=[topology("n1", 4)]), SETTINGS, NOW)
    assert d.blocker is not None and "larger than any node offers" in d.blocker.message


@pytest.mark.parametrize("groups, eligible", [([[0, 1, 2, 3]], True), ([[0, 1], [2, 3]], False)])
def test_require_nvlink_needs_a_node_with_an_all_to_all_group(groups, eligible):
    body = isvc(resources={"gpusPerReplica": 4}, parallelism={"tensor": 4}, placement={"requireNVLink": True})
    d = decide(observed(body, topologies=[topology("n1", 4, groups)]), SETTINGS, NOW)
    assert (d.blocker is None) == eligible
    if not eligible:
        assert d.blocker is not None and d.blocker.reason == "NoEligibleNodes"


AUTOSCALED = {"minReplicas": 1, "maxReplicas": 4, "metric": "requestsWaiting", "target": 2,
              "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 60}


def signals(*waiting: float) -> dict[str, dict[str, Any]]:
    return {f"p{i}": {"requestsWaiting": w} for i, w in enumerate(waiting)}


def test_autoscaling_up_is_decided_from_the_scraped_signals():
    d: Decision = decide(observed(isvc(replicas=1, autoscaling=AUTOSCALED), signals=signals(6)), SETTINGS, NOW)
    assert d.replicas == 3 and d.scale is not None and d.scale[0] == 1 and d.scale[1].desired == 3
    assert d.autoscaling is not None and d.autoscaling["reason"] == "ScaleUp"
    assert d.autoscaling["decisions"][-1]["from"] == 1 and d.autoscaling["decisions"][-1]["to"] == 3


def test_scaling_down_waits_for_the_stabilization_window():
    body = isvc(replicas=1, autoscaling=AUTOSCALED)
    body["status"] = {"autoscaling": {"desiredReplicas": 3, "recommendations": [
        {"time": "2027-01-15T08:00:00Z", "replicas": 3}]}}
    d = decide(observed(body, signals=signals(0.5, 0.5, 0.5)), SETTINGS, NOW)
    assert d.replicas == 3 and d.autoscaling is not None and d.autoscaling["reason"] == "ScaleDownStabilizing"


def test_without_a_scrape_the_last_decision_stands():
    body = isvc(replicas=1, autoscaling=AUTOSCALED)
    body["status"] = {"autoscaling": {"desiredReplicas": 3}}
    d = decide(observed(body), SETTINGS, NOW)
    assert d.replicas == 3 and d.scale is None


def test_decide_is_pure():
    body = isvc(replicas=1, autoscaling=AUTOSCALED)
    before = repr(body)
    first = decide(observed(body, signals=signals(6)), SETTINGS, NOW)
    again = decide(observed(body, signals=signals(6)), SETTINGS, NOW)
    assert repr(body) == before and first.replicas == again.replicas and first.autoscaling == again.autoscaling
