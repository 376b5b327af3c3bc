"""Read the daemons' Prometheus ``/metrics`` (vLLM metric names) into autoscaling signals, and
a starting daemon's ``/ready`` into its start-up phase.

``parse`` is pure (text in, numbers out); ``scrape`` fetches ready pods concurrently with a short
timeout, and a pod that does not answer is simply absent from the result; ``starting_phases``
does the same for pods that run but are not ready yet.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from pagoda_operator.placement import pod_ready

log = logging.getLogger(__name__)
T = TypeVar("T")

# spec.autoscaling.metric -> (Prometheus name, how samples of one pod combine)
SIGNALS = {
    "kvCacheUsage": ("vllm:kv_cache_usage_perc", "mean"),
    "requestsWaiting": ("vllm:num_requests_waiting", "sum"),
    "requestsRunning": ("vllm:num_requests_running", "sum"),
    "expertLoad": ("pagoda:eplb_rank_load_per_step", "mean"),  # elastic EP only (spec.ELASTIC_METRICS)
}
EXPERT_PARALLEL = "pagoda:expert_parallel_size"
PLACEMENT_INFO = "pagoda:placement_info"
MODEL_INFO = "pagoda:model_info"
# A daemon's /metrics is tens of KiB; anything past this is a broken or hostile pod.
MAX_SCRAPE_BYTES = 1 << 20
READ_CHUNK = 1 << 16


def _list(value: str) -> list[str]:
    return [v for v in (x.strip() for x in value.split(",")) if v]


def parse(text: str, model_name: str | None = None) -> dict[str, Any]:
    """Signals of one pod. Samples labelled with another ``model_name`` are ignored.

    Returns the keys of :data:`SIGNALS` that were present, plus ``expertParallel`` (gauge
    ``pagoda:expert_parallel_size``) and ``placement`` (labels ``gpus`` and ``numa_nodes`` of
    ``pagoda:placement_info``, comma-separated) and ``model`` (labels ``source`` and
    ``revision`` of ``pagoda:model_info``, for a model the daemon fetched) when it exports them.
    """
    values: dict[str, list[float]] = {}
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if model_name and labels.get("model_name") not in (None, model_name):
                continue
            values.setdefault(sample.name, []).append(float(sample.value))
            if sample.name == PLACEMENT_INFO:
                numa = [int(n) for n in _list(labels.get("numa_nodes", "")) if n.lstrip("-").isdigit()]
                out["placement"] = {"gpus": _list(labels.get("gpus", "")), "numaNodes": numa}
            elif sample.name == MODEL_INFO and labels.get("revision"):
                out["model"] = {"source": labels.get("source", ""), "revision": labels["revision"]}
    for key, (name, how) in SIGNALS.items():
        xs = values.get(name)
        if xs:
            out[key] = sum(xs) / len(xs) if how == "mean" else sum(xs)
    if values.get(EXPERT_PARALLEL):
        out["expertParallel"] = int(max(values[EXPERT_PARALLEL]))
    return out


def pod_url(pod: Mapping[str, Any], port: int, path: str = "/metrics") -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


class ScrapeFailed(OSError):
    """A /metrics answer too large or too slow: the pod is left out, as if it had not answered."""


def fetch(url: str, timeout: float, limit: int = MAX_SCRAPE_BYTES) -> str:
    """GET ``url``: at most ``limit`` bytes within about ``timeout`` seconds in all.

    A pod answering with an endless or dripping body must neither fill the operator's memory
    nor hold up the autoscaler step that waits for every scrape.
    """
    deadline = time.monotonic() + timeout
    body = bytearray()
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        while chunk := resp.read1(READ_CHUNK):
            body += chunk
            if len(body) > limit:
                raise ScrapeFailed(f"{url} answered more than {limit} bytes")
            if time.monotonic() > deadline:
                raise ScrapeFailed(f"{url} did not finish its answer within {timeout:g}s")
    return body.decode("utf-8", "replace")


def scrape(
    pods: Iterable[Mapping[str, Any]],
    port: int,
    model_name: str | None = None,
    timeout: float = 2.0,
    fetcher=fetch,
) -> dict[str, dict[str, Any]]:
    """Signals per ready pod name; pods that fail to answer or parse are left out."""
    targets = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
            continue
        url = pod_url(pod, port)
        if url:
            targets.append((pod["metadata"]["name"], url))
    return _read_each(targets, lambda url: parse(fetcher(url, timeout), model_name))


def _read_each(targets: list[tuple[str, str]], read: Callable[[str], T | None]) -> dict[str, T]:
    """``read`` of every (pod name, URL) at once; a pod whose read fails or gives None is left out."""
    if not targets:
        return {}

    def one(item: tuple[str, str]) -> tuple[str, T | None]:
        name, url = item
        try:
            return name, read(url)
        except Exception as exc:  # a pod that does not answer is only absent
            log.debug("reading %s failed: %s", url, exc)
            return name, None

    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        results = list(pool.map(one, targets))
    return {name: value for name, value in results if value is not None}


def signals_summary(per_pod: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Mean per pod of each signal, as written to ``status.autoscaling.signals``."""
    out: dict[str, Any] = {"pods": len(per_pod)}
    for key in SIGNALS:
        xs = [s[key] for s in per_pod.values() if key in s]
        if xs:
            out[key] = round(sum(xs) / len(xs), 6)
    return out


def fetch_ready(url: str, timeout: float, limit: int = MAX_SCRAPE_BYTES) -> str:
    """GET a daemon's ``/ready``: its body whether it answers 200 or 503 (a starting engine)."""
    try:
        return fetch(url, timeout, limit)
    except urllib.error.HTTPError as e:
        if e.code != 503:
            raise
        return e.read(limit).decode("utf-8", "replace")


def _starting(pod: Mapping[str, Any]) -> bool:
    st = pod.get("status") or {}
    return (not pod["metadata"].get("deletionTimestamp") and st.get("phase") == "Running"
            and not pod_ready(pod) and bool(st.get("podIP")))


def starting_phases(pods: Iterable[Mapping[str, Any]], port: int, timeout: float = 2.0,
                    fetcher=fetch_ready) -> dict[str, str]:
    """Pod name -> the start-up phase its engine is in (``/ready``'s last ``startup`` entry),
    for pods that run and are not ready; a pod that does not answer is left out."""
    targets = [(p["metadata"]["name"], str(pod_url(p, port, "/ready"))) for p in pods if _starting(p)]
    return _read_each(targets, lambda url: _current_phase(fetcher(url, timeout)))


def _current_phase(body_text: str) -> str | None:
    """The last phase a not-ready ``/ready`` body lists (None for anything else), shortened; a
    download with its progress (``downloading model: 1.2 of 16.0 GB, 3/9 files, 110 MB/s, 130 s
    left``)."""
    body = json.loads(body_text)
    phases = body.get("startup") if isinstance(body, dict) and body.get("status") != "ready" else None
    last = phases[-1] if isinstance(phases, list) and phases and isinstance(phases[-1], dict) else {}
    phase = last.get("phase")
    if not isinstance(phase, str):
        return None
    progress = _download_progress(last)
    return (f"{phase[:60]}: {progress}" if progress else phase)[:160]


def _download_progress(phase: Mapping[str, Any]) -> str:
    """The fetch's progress fields of a ``downloading model`` phase (pagoda_daemon's
    FetchProgress), in words; "" when they are absent or not numbers."""
    def number(key: str) -> float | None:
        v = phase.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None

    done, total = number("bytes_done"), number("bytes_total")
    files_done, files_total = number("files_done"), number("files_total")
    if done is None or total is None:
        return ""
    parts = [f"{done / 1e9:.1f} of {total / 1e9:.1f} GB"]
    if files_done is not None and files_total is not None:
        parts.append(f"{files_done:.0f}/{files_total:.0f} files")
    rate, eta = number("rate_bytes_per_s"), number("eta_s")
    if rate:
        parts.append(f"{rate / 1e6:.0f} MB/s")
    if eta is not None:
        parts.append(f"{eta:.0f} s left")
    return ", ".join(parts)
