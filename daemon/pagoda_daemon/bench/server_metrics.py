"""What the server says about a benchmark point: its latency histograms, read from its
Prometheus ``/metrics`` before and after the point, as the difference of the two.

The client's TTFT is the whole way (sending, the HTTP server, the engine, streaming back); the
server's histograms split it. Pagoda and vLLM both export these under vLLM's names:
``time_to_first_token`` runs from the request's arrival in the API server to its first token
there, ``request_queue_time`` from arrival to the first schedule, ``request_prefill_time`` from
then to the first token. Pagoda adds ``request_admission``: from the request's headers read to
its submission to the engine (body, parsing, tokenizing), the time before that arrival stamp. A
server without ``/metrics`` (or without a histogram) simply has no entry.
"""

from __future__ import annotations

import math

import httpx

HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "pagoda:request_admission_seconds")

# name -> (sum, count, [(upper bound, cumulative count), ...] in increasing bound order)
Snapshot = dict[str, tuple[float, float, list[tuple[float, float]]]]


def parse(text: str) -> Snapshot:
    """The histograms of HISTOGRAMS in a Prometheus text exposition, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        name = family.name
        if family.type != "histogram" or name not in HISTOGRAMS:
            continue
        total = count = 0.0
        buckets: dict[float, float] = {}
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
        out[name] = (total, count, sorted(buckets.items()))
    return out


def scrape(base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> Snapshot | None:
    """The server's histograms now, or None when it has no readable /metrics."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return parse(response.text)
    except (httpx.HTTPError, ValueError, ImportError):  # ImportError: no prometheus_client here
        return None


def quantile_bound(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The upper bound of the bucket that holds the q-quantile: all a histogram knows of it
    (interpolating inside a bucket, as Prometheus's histogram_quantile does, made up a 150 ms
    median for queue times whose mean was 5 ms, all in vLLM's first bucket of 0.3 s). None when
    the histogram is empty or the quantile lies past its last finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    for bound, cumulative in buckets:
        if cumulative >= rank:
            return None if math.isinf(bound) else bound
    return None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def difference(before: Snapshot | None, after: Snapshot | None) -> dict[str, dict[str, float | None]] | None:
    """Per histogram over the point: how many observations, their mean, and for p50/p90/p99 the
    bucket bound each lies under (ms; as coarse as the server's buckets)."""
    if before is None or after is None:
        return None
    out: dict[str, dict[str, float | None]] = {}
    for name, (total, count, buckets) in after.items():
        total0, count0, buckets0 = before.get(name, (0.0, 0.0, []))
        n = count - count0
        if n <= 0:
            continue
        earlier = dict(buckets0)
        delta = [(bound, cumulative - earlier.get(bound, 0.0)) for bound, cumulative in buckets]
        short = name.split(":", 1)[1].removesuffix("_seconds")
        out[short] = {"count": n, "mean_ms": _ms((total - total0) / n),
                      **{f"p{p}_le_ms": _ms(quantile_bound(p / 100, delta)) for p in (50, 90, 99)}}
    return out
