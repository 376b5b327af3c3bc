"""A sweep: the same workload at several values of one variable (request rate, concurrency,
lengths), repeated, against one or several servers, each point saved as it finishes so that an
interrupted sweep resumes where it stopped; then throughput against median TTFT on one chart."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda_daemon.bench.datasets import BenchRequest
from pagoda_daemon.bench.run import POOLING_ENDPOINTS, PointConfig, run_point

# The variables a sweep may move: those of the point config and those of the dataset.
POINT_VARS = {"request_rate": float, "max_concurrency": int, "burstiness": float}
DATASET_VARS = {"input_len": int, "output_len": int, "num_prompts": int, "document_len": int,
                "documents_per_query": int}
WORKLOAD_VARS = {**POINT_VARS, **DATASET_VARS}
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_name(kind: str, name: str) -> str:
    """Names become directories: letters, digits, '.', '_' and '-', 1-100 of them, no dot first."""
    if not name or len(name) > 100 or name.startswith(".") or not set(name) <= _NAME_CHARS:
        raise ValueError(f"{kind} {name!r}: use 1-100 letters, digits, '.', '_' or '-', not starting with '.'")
    return name


def parse_values(var: str, text: str) -> list[float | int]:
    if var not in WORKLOAD_VARS:
        raise ValueError(f"--workload-var must be one of {', '.join(WORKLOAD_VARS)}")
    kind = WORKLOAD_VARS[var]
    values = [kind(v) for v in text.split(",") if v.strip()]
    if not values or any(not (v > 0) or (kind is int and math.isinf(v)) for v in values):
        raise ValueError(f"--values: positive numbers for {var}, comma-separated")
    return values


def point_path(out_dir: Path, experiment: str, server: str, var: str, value: float | int, iteration: int) -> Path:
    return out_dir / experiment / server / f"{var}={value}" / f"iter-{iteration}.json"


def run_sweep(
    servers: Sequence[tuple[str, PointConfig]],
    var: str,
    values: Sequence[float | int],
    iterations: int,
    make_requests: Callable[[dict, int], list[BenchRequest]],
    out_dir: Path,
    experiment: str,
    *,
    resume: bool = False,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Every (server, value, iteration) point; `make_requests(dataset_overrides, seed)` builds
    the requests. A point whose file exists is loaded with `resume`, and refused without it."""
    check_name("experiment name", experiment)
    points = []
    for label, base in servers:
        check_name("server label", label)
        for index, value in enumerate(values):
            for iteration in range(iterations):
                path = point_path(out_dir, experiment, label, var, value, iteration)
                if path.exists():
                    if not resume:
                        raise FileExistsError(f"{path} exists: pass --resume, or another --experiment-name")
                    log(f"{label} {var}={value} iteration {iteration}: done before, skipped")
                    points.append(json.loads(path.read_text()))
                    continue
                # The same requests for every server, new ones for every point of a server: a
                # point that re-sent an earlier point's prompts would be served from the prefix
                # cache (on the H100, 2026-11-26, a prefill-heavy point after one with the same
                # prompts ran 14% faster for Pagoda than with fresh prompts; vLLM's did not gain).
                seed = base.seed + index * iterations + iteration
                point: dict[str, Any] = {var: value} if var in POINT_VARS else {}
                config = dataclasses.replace(base, seed=seed, **point)
                requests = make_requests({var: value} if var in DATASET_VARS else {}, seed)
                result = run_point(config, requests, progress=progress)
                result.update(server=label, workload_var=var, value=value, iteration=iteration)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(result, indent=1))
                os.replace(tmp, path)  # a point interrupted half-way is not counted as done
                latency, rate = axes(result)
                log(f"{label} {var}={value} iteration {iteration}: {result[rate.key]} {rate.label}, "
                    f"{latency.label} {result[latency.key]['p50']} ms, {result['failed']} failed")
                points.append(result)
    return points


@dataclass(frozen=True)
class Axis:
    key: str  # the summary's field
    label: str


def axes(point: dict) -> tuple[Axis, Axis]:
    """(the latency, the throughput) a point is plotted by: median TTFT and output tokens/s, or, on
    the pooling endpoints (nothing is generated), median end-to-end latency and input tokens/s."""
    if point["config"]["endpoint"] in POOLING_ENDPOINTS:
        return Axis("e2el_ms", "median latency"), Axis("total_token_throughput", "input tokens/s")
    return Axis("ttft_ms", "median TTFT"), Axis("output_throughput", "output tokens/s")


def plot(points: Sequence[dict], out_base: Path, title: str = "") -> list[Path]:
    """Throughput against median latency (output tokens/s against TTFT; on the pooling endpoints,
    input tokens/s against end-to-end latency), one line per server (mean over iterations at each
    value), as PNG and SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_server: dict[str, dict] = {}
    latency, rate = axes(points[0] if points else {"config": {"endpoint": "completions"}})
    for p in points:
        if p[latency.key]["p50"] is None or p[rate.key] is None:
            continue
        by_server.setdefault(p["server"], {}).setdefault(p["value"], []).append(p)
    for server, by_value in by_server.items():
        xs, ys, labels = [], [], []
        for value in sorted(by_value):
            runs = by_value[value]
            xs.append(sum(r[latency.key]["p50"] for r in runs) / len(runs))
            ys.append(sum(r[rate.key] for r in runs) / len(runs))
            labels.append(value)
        ax.plot(xs, ys, marker="o", label=server)
        for x, y, v in zip(xs, ys, labels):
            ax.annotate(str(v), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    var = points[0]["workload_var"] if points else ""
    ax.set_xlabel(f"{latency.label} (ms)")
    ax.set_ylabel(rate.label)
    ax.set_title(title or f"throughput against {latency.label} (points labelled by {var})")
    ax.grid(alpha=0.3)
    ax.legend()
    out_base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for ext in ("png", "svg"):
        path = out_base.with_suffix(f".{ext}")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        written.append(path)
    plt.close(fig)
    return written
