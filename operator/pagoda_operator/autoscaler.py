"""Pure autoscaling arithmetic, the Horizontal Pod Autoscaler's rule applied to daemon metrics.

1. ``value`` is the mean of the chosen metric over the pods that answered. Pods that did not
   answer (starting, unready) count as using the target when scaling down and as idle when
   scaling up, so starting pods never cause flapping.
2. ``ratio = value / target``; within ``tolerance`` of 1 nothing changes; otherwise the
   recommendation is ``ceil(ratio × current)``, bounded by min/max replicas.
3. Stabilisation: every evaluation records its recommendation. Scaling up goes to the lowest
   recommendation of the last ``scaleUpStabilizationSeconds``, scaling down to the highest of
   the last ``scaleDownStabilizationSeconds``; so a spike must last a whole up-window and a
   trough a whole down-window before replicas follow.
4. Each change is a decision; the status keeps the last :data:`HISTORY` of them.

Everything here takes time as seconds (epoch floats) and returns new values; nothing mutates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pagoda_operator.spec import Autoscaling

HISTORY = 10
MAX_RECOMMENDATIONS = 200


@dataclass(frozen=True)
class Evaluation:
    desired: int
    recommendation: int
    reason: str
    message: str
    value: float | None
    recommendations: tuple[tuple[float, int], ...]

    def changed(self, current: int) -> bool:
        return self.desired != current


def mean(samples: Sequence[float]) -> float | None:
    return sum(samples) / len(samples) if samples else None


def recommend(cfg: Autoscaling, current: int, samples: Sequence[float],
              expected: int | None = None) -> tuple[int, str, str]:
    """Raw recommendation (before bounds and windows), reason, message. ``expected``: how many
    samples should have come (default: one per replica, ``current``)."""
    value = mean(samples)
    if value is None:
        return current, "NoMetrics", "no ready pod answered /metrics; holding"
    answered = len(samples)
    ratio = value / cfg.target
    if abs(ratio - 1) <= cfg.tolerance:
        return (
            current,
            "WithinTolerance",
            f"{cfg.metric} {value:.3g} is within {cfg.tolerance:.0%} of target {cfg.target:g}",
        )
    expected = current if expected is None else expected
    missing = max(0, expected - answered)
    if missing:
        # Pods without metrics: at target when scaling down, idle when scaling up (the HPA's rule).
        assumed = cfg.target if ratio < 1 else 0.0
        ratio = (value * answered + assumed * missing) / (cfg.target * expected)
        if abs(ratio - 1) <= cfg.tolerance or (ratio < 1) != (value < cfg.target):
            return (
                current,
                "WithinTolerance",
                (
                    f"{cfg.metric} {value:.3g} over {answered}/{expected} pods; counting the silent ones, within tolerance"
                ),
            )
    base = max(current, 1)
    rec = math.ceil(round(ratio * base, 9))
    direction = "above" if value > cfg.target else "below"
    return (
        rec,
        "ScaleUp" if rec > current else "ScaleDown",
        (f"{cfg.metric} {value:.3g} {direction} target {cfg.target:g} over {answered} pods"),
    )


def evaluate(
    cfg: Autoscaling,
    current: int,
    samples: Sequence[float],
    history: Sequence[tuple[float, int]],
    now: float,
    expected: int | None = None,
) -> Evaluation:
    """One autoscaler step: desired replicas from the current size, fresh samples and history.
    ``expected``: the samples that should have come (default one per replica; elastic EP sizes
    take one per pod whatever the size)."""
    value = mean(samples)
    if current < cfg.min_replicas or current > cfg.max_replicas:
        bound = max(cfg.min_replicas, min(cfg.max_replicas, current))
        why = "BelowMin" if current < cfg.min_replicas else "AboveMax"
        return Evaluation(
            bound,
            bound,
            why,
            f"{current} replicas outside [{cfg.min_replicas}, {cfg.max_replicas}]",
            value,
            _keep(history, now, cfg, (now, bound)),
        )
    raw, reason, message = recommend(cfg, current, samples, expected)
    rec = max(cfg.min_replicas, min(cfg.max_replicas, raw))
    if rec != raw:
        message += f"; wants {raw}, bounded to {rec}"
        reason = "BoundedByMax" if raw > rec else "BoundedByMin"
    kept = _keep(history, now, cfg, (now, rec))
    desired = current
    if rec > current:
        ups = [r for t, r in kept if now - t <= cfg.scale_up_window_s]
        desired = max(current, min(ups))
        if desired < rec:
            reason = "ScaleUpStabilizing" if desired == current else "ScaleUpStabilized"
            message += f"; lowest recommendation in the last {cfg.scale_up_window_s}s is {min(ups)}"
    elif rec < current:
        downs = [r for t, r in kept if now - t <= cfg.scale_down_window_s]
        desired = min(current, max(downs))
        if desired > rec:
            reason = "ScaleDownStabilizing" if desired == current else "ScaleDownStabilized"
            message += f"; highest recommendation in the last {cfg.scale_down_window_s}s is {max(downs)}"
    if desired == current and reason in ("ScaleUp", "ScaleDown"):
        reason = "NoChange"  # the rounded recommendation equals the current size
    return Evaluation(desired, rec, reason, message, value, kept)


def _keep(
    history: Sequence[tuple[float, int]], now: float, cfg: Autoscaling, new: tuple[float, int]
) -> tuple[tuple[float, int], ...]:
    """History within the longer window, plus the new recommendation, newest last."""
    horizon = max(cfg.scale_up_window_s, cfg.scale_down_window_s)
    kept = [(t, r) for t, r in history if now - t <= horizon and t <= now]
    kept.append(new)
    return tuple(kept[-MAX_RECOMMENDATIONS:])


def record(
    decisions: Sequence[Mapping[str, Any]], entry: Mapping[str, Any], limit: int = HISTORY
) -> list[dict[str, Any]]:
    """Append a decision, keeping the newest ``limit``."""
    return [*[dict(d) for d in decisions][-(limit - 1) :], dict(entry)] if limit > 1 else [dict(entry)]


def to_iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(s: str) -> float:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
