"""Autoscaling arithmetic: proportional rule, tolerance, bounds, stabilisation windows, history."""

from __future__ import annotations

import pytest

from pagoda_operator.autoscaler import HISTORY, evaluate, from_iso, recommend, record, to_iso
from pagoda_operator.spec import Autoscaling


def cfg(**kw) -> Autoscaling:
    base = dict(
        min_replicas=1,
        max_replicas=10,
        metric="requestsWaiting",
        target=2.0,
        tolerance=0.1,
        scale_up_window_s=0,
        scale_down_window_s=0,
    )
    base.update(kw)
    return Autoscaling(**base)


@pytest.mark.parametrize(
    "current, samples, expected, reason",
    [
        (2, [4.0, 4.0], 4, "ScaleUp"),  # ratio 2 -> double
        (2, [3.0, 3.0], 3, "ScaleUp"),  # ratio 1.5 -> ceil(3)
        (4, [1.0, 1.0, 1.0, 1.0], 2, "ScaleDown"),  # ratio 0.5 -> half
        (3, [2.1, 2.1, 2.1], 3, "WithinTolerance"),  # 5% over: inside the 10% tolerance
        (3, [1.85, 1.85, 1.85], 3, "WithinTolerance"),
        (3, [2.3, 2.3, 2.3], 4, "ScaleUp"),  # 15% over: ceil(3.45)
        (1, [0.0], 0, "ScaleDown"),  # idle: the raw rule says 0; bounds (min >= 1) apply later
        (2, [], 2, "NoMetrics"),
        # pods without metrics: idle when scaling up, at target when scaling down
        (4, [6.0, 6.0], 6, "ScaleUp"),  # (12 + 0*2)/(2*4) = 1.5 -> 6
        (4, [2.6, 2.6], 4, "WithinTolerance"),  # (5.2 + 0*2)/8 = 0.65: direction flips, hold
        (4, [0.0, 0.0], 2, "ScaleDown"),  # (0 + 2*2)/8 = 0.5 -> 2
        (4, [1.9, 1.9], 4, "WithinTolerance"),  # (3.8 + 2*2)/8 = 0.975: within tolerance
    ],
)
def test_recommendation_table(current, samples, expected, reason):
    rec, why, _ = recommend(cfg(), current, samples)
    assert (rec, why) == (expected, reason)


def test_rounding_to_the_current_size_is_no_change():
    ev = evaluate(cfg(tolerance=0.0), 1, [1.5], [], now=0.0)  # ratio 0.75 -> ceil(0.75) = 1
    assert (ev.desired, ev.reason) == (1, "NoChange")


def test_idle_single_pod_stays_at_min():
    ev = evaluate(cfg(), 1, [0.0], [], now=0.0)
    assert (ev.desired, ev.reason) == (1, "BoundedByMin")


@pytest.mark.parametrize(
    "kw, current, samples, expected, reason",
    [
        ({"max_replicas": 5}, 4, [8.0] * 4, 5, "BoundedByMax"),
        ({"min_replicas": 3}, 4, [0.2] * 4, 3, "BoundedByMin"),
        ({"max_replicas": 5}, 5, [8.0] * 5, 5, "BoundedByMax"),  # already at max: stays, says why
        (
            {"min_replicas": 2, "max_replicas": 6},
            1,
            [2.0],
            2,
            "BelowMin",
        ),  # out of bounds is corrected at once
        ({"min_replicas": 2, "max_replicas": 6}, 9, [2.0] * 9, 6, "AboveMax"),
    ],
)
def test_bounds(kw, current, samples, expected, reason):
    ev = evaluate(cfg(**kw), current, samples, [], now=1000.0)
    assert (ev.desired, ev.reason) == (expected, reason)


def run(c: Autoscaling, current: int, series: list[tuple[float, float]]):
    """Feed (time, per-pod value) steps through evaluate, carrying history and replicas; return sizes."""
    history: tuple = ()
    sizes = []
    for t, value in series:
        ev = evaluate(c, current, [value] * current, history, now=t)
        history = ev.recommendations
        current = ev.desired
        sizes.append(current)
    return sizes


def test_scale_up_waits_for_a_full_up_window():
    c = cfg(scale_up_window_s=30)
    # load doubles at t=0 and stays: the minimum over the last 30 s only rises once the calm
    # recommendation made at t=-10 has left the window, i.e. after 30 s of high load
    sizes = run(c, 2, [(-10, 2.0), (0, 4.0), (10, 4.0), (20, 4.0), (30, 4.0), (40, 4.0)])
    assert sizes == [2, 2, 2, 2, 4, 4]


def test_short_spike_inside_the_up_window_does_not_scale():
    c = cfg(scale_up_window_s=30)
    sizes = run(c, 2, [(0, 2.0), (10, 8.0), (20, 2.0), (30, 8.0), (40, 2.0)])
    assert sizes == [2, 2, 2, 2, 2]


def test_immediate_scale_up_with_zero_window():
    assert run(cfg(), 2, [(0, 4.0)]) == [4]


def test_scale_down_waits_for_a_full_down_window_then_takes_the_highest():
    c = cfg(scale_down_window_s=60)
    # load drops at t=0; recommendations: 2 (t=-10), 1, 1, ... the max over 60 s stays 2 until
    # the t=-10 recommendation is more than 60 s old
    sizes = run(c, 2, [(-10, 2.0), (0, 1.0), (20, 1.0), (40, 1.0), (50, 1.0), (51, 1.0)])
    assert sizes == [2, 2, 2, 2, 2, 1]


def test_scale_down_goes_to_the_highest_recommendation_in_the_window():
    c = cfg(scale_down_window_s=60)
    history = ((0.0, 8), (20.0, 6), (40.0, 4))
    ev = evaluate(c, 8, [0.5] * 8, history, now=70.0)  # raw recommendation 2; window holds 6, 4, 2
    assert (ev.recommendation, ev.desired, ev.reason) == (2, 6, "ScaleDownStabilized")
    ev = evaluate(c, 8, [0.5] * 8, history, now=50.0)  # window still holds 8
    assert (ev.desired, ev.reason) == (8, "ScaleDownStabilizing")


def test_up_and_down_windows_are_independent():
    c = cfg(scale_up_window_s=0, scale_down_window_s=300)
    history = ((0.0, 1),)
    ev = evaluate(c, 2, [4.0, 4.0], history, now=10.0)
    assert ev.desired == 4  # the long down-window does not slow scaling up


def test_history_is_pruned_to_the_longer_window():
    c = cfg(scale_up_window_s=10, scale_down_window_s=30)
    history = tuple((float(t), 2) for t in range(0, 100, 5))
    ev = evaluate(c, 2, [2.0, 2.0], history, now=100.0)
    assert all(100 - t <= 30 for t, _ in ev.recommendations)
    assert ev.recommendations[-1] == (100.0, 2)


def test_kv_cache_usage_fraction_target():
    c = cfg(metric="kvCacheUsage", target=0.8)
    ev = evaluate(c, 2, [0.96, 1.0], [], now=0.0)  # mean 0.98 -> ratio 1.225 -> ceil(2.45) = 3
    assert ev.desired == 3 and abs(ev.value - 0.98) < 1e-9


def test_decision_history_keeps_the_last_ten():
    decisions: list = []
    for i in range(25):
        decisions = record(decisions, {"from": i, "to": i + 1})
    assert len(decisions) == HISTORY == 10
    assert [d["from"] for d in decisions] == list(range(15, 25))


def test_time_round_trip():
    assert from_iso(to_iso(1_700_000_000.0)) == 1_700_000_000.0
