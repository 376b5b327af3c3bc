"""The operator's own series exist before anything happens to them (at 0), so that the
dashboard's rate() and increase() over errors and autoscaling decisions read 0, not "no data"
(e2e/test_prometheus.py runs every dashboard query against a real Prometheus)."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagoda_operator import telemetry
from pagoda_operator.reconcile import Context, reconcile
from tests.operator.operator_fakes import FakeKube, every_capability, isvc


def _exposition() -> str:
    return generate_latest(telemetry.REGISTRY).decode()


def test_error_series_exist_for_every_trigger_from_the_start():
    text = _exposition()
    for trigger in telemetry.TRIGGERS:
        assert f'pagoda_operator_reconcile_errors_total{{trigger="{trigger}"}}' in text


def test_decision_series_exist_once_autoscaled_and_go_with_the_object():
    kube = FakeKube()
    kube.put(isvc(name="scaled", namespace="metrics-ns", resources={"gpusPerReplica": 0},
                  autoscaling={"minReplicas": 1, "maxReplicas": 3, "metric": "requestsWaiting", "target": 4}))
    ctx = Context(kube=kube, supports=every_capability, fetcher=lambda url, timeout: "")
    reconcile(ctx, "metrics-ns", "scaled", "timer", autoscale=True)
    text = _exposition()
    for direction in ("up", "down"):
        assert (f'pagoda_operator_autoscaling_decisions_total{{direction="{direction}",name="scaled",'
                f'namespace="metrics-ns"}} 0.0') in text
    telemetry.forget("metrics-ns", "scaled")
    assert not [line for line in _exposition().splitlines()
                if line.startswith("pagoda_operator_autoscaling_decisions") and 'name="scaled"' in line]
