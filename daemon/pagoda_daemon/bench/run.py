"""One point of a serving benchmark: requests sent to an OpenAI-compatible endpoint with open-loop
arrivals (Poisson, or gamma for burstier traffic) or at a fixed concurrency, every response
streamed, and the latencies users feel summarized (TTFT, TPOT, ITL, end-to-end, goodput). On the
pooling endpoints nothing is generated and the latency is end to end: on embeddings each request
is one input and its reply one vector (base64, as the openai client asks); on rerank each request
is one query and its documents, and the reply ranks every one of them.

Open loop means a request is sent at its arrival time whether or not earlier ones have
finished, as real users do; `max_concurrency` caps what is in flight for closed-loop runs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from pagoda_daemon.bench import server_metrics
from pagoda_daemon.bench.datasets import BenchRequest

ENDPOINTS = ("completions", "chat", "embeddings", "rerank")
POOLING_ENDPOINTS = ("embeddings", "rerank")  # one reply, not streamed: no TTFT
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class PointConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson, below 1 burstier, above 1 steadier
    max_concurrency: int | None = None
    turn_delay_s: float = 0.0  # multi-turn: a user's pause between an answer and the next turn
    ignore_eos: bool = True  # the asked output length is the output length
    temperature: float = 0.0
    timeout_s: float = 600.0
    seed: int = 0
    goodput_slo_ms: dict[str, float] = field(default_factory=dict)  # ttft / tpot / e2el bounds

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}")
        if not (self.request_rate > 0):  # NaN included
            raise ValueError("request_rate must be > 0 (inf for all at once)")
        if not (0 < self.burstiness < math.inf):
            raise ValueError("burstiness must be a positive finite number")
        if not (0 <= self.turn_delay_s < math.inf):
            raise ValueError("turn_delay_s must be a finite number ≥ 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        unknown = set(self.goodput_slo_ms) - {"ttft", "tpot", "e2el"}
        if unknown or any(not (0 < v < math.inf) for v in self.goodput_slo_ms.values()):
            raise ValueError("goodput SLOs are ttft, tpot and e2el, each a positive number of ms")


@dataclass
class RequestResult:
    ok: bool
    start_s: float  # since the point began
    e2el_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive arrivals: gamma-distributed with mean 1/rate (shape
    `burstiness`; 1 is a Poisson process). All zero at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def _stream(client: httpx.AsyncClient, url: str, body: bytes, headers: dict, result: RequestResult,
                  t0: float) -> str:
    """POST one streamed request (a JSON body); fill `result` from its chunks and return the generated text."""
    text = []
    last = t0
    async with client.stream("POST", url, content=body, headers={**headers, "Content-Type": "application/json"}) \
            as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(str(chunk["error"])[:300])
            if chunk.get("usage"):
                result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if result.ttft_s is None and result.output_tokens:  # every token's text was held back
                    result.ttft_s = time.perf_counter() - t0
            for choice in chunk.get("choices") or []:
                # A chunk is a token's arrival even when its text is empty (a byte sequence cut
                # mid-character); the role-only first delta of a chat stream is not.
                delta = choice.get("delta") or {}
                piece = choice.get("text") if "text" in choice else delta.get("content")
                if (piece is None or ("role" in delta and not piece)) and not choice.get("finish_reason"):
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - t0
                else:
                    result.itl_s.append(now - last)
                last = now
                text.append(piece or "")
    return "".join(text)


def _common_fields(config: PointConfig, request: BenchRequest) -> dict:
    return {"model": config.model, "max_tokens": request.output_len, "temperature": config.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": config.ignore_eos}


def encoded_body(config: PointConfig, request: BenchRequest) -> bytes | None:
    """A single-turn completion's body, encoded before the clock starts: the client's JSON
    encoding is not the server's latency, and at an infinite rate it would delay every later
    request's send. None where the body depends on earlier answers (conversations, chat)."""
    if config.endpoint == "embeddings":
        return json.dumps({"model": config.model, "input": request.prompt, "encoding_format": "base64"}).encode()
    if config.endpoint == "rerank":
        return json.dumps({"model": config.model, "query": _as_text(request.prompt),
                           "documents": [_as_text(d) for d in request.documents]}).encode()
    if config.endpoint != "completions" or request.turns:
        return None
    return json.dumps({**_common_fields(config, request), "prompt": request.prompt}).encode()


async def _pool(client: httpx.AsyncClient, config: PointConfig, request: BenchRequest, body: bytes, headers: dict,
                result: RequestResult) -> None:
    """POST one pooling request (embeddings: one vector back; rerank: a result per document);
    its input tokens into `result` (vLLM's rerank usage has only ``total_tokens``)."""
    url = config.base_url + ("/v1/embeddings" if config.endpoint == "embeddings" else "/v1/rerank")
    response = await client.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    reply = response.json()
    if config.endpoint == "embeddings" and len(reply.get("data") or []) != 1:
        raise RuntimeError("the reply does not hold one vector")
    if config.endpoint == "rerank" and len(reply.get("results") or []) != len(request.documents):
        raise RuntimeError(f"the reply ranks {len(reply.get('results') or [])} of {len(request.documents)} documents")
    usage = reply.get("usage") or {}
    result.prompt_tokens = usage.get("prompt_tokens", usage.get("total_tokens", 0))


async def _send(client: httpx.AsyncClient, config: PointConfig, request: BenchRequest,
                start_s: float, encoded: bytes | None = None) -> list[RequestResult]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    common = _common_fields(config, request)
    results = []
    messages: list[dict] = []
    turns = request.turns or (None,)
    for n, turn in enumerate(turns):
        if n and config.turn_delay_s:
            await asyncio.sleep(config.turn_delay_s)
        result = RequestResult(ok=False, start_s=start_s)
        t0 = time.perf_counter()
        try:
            if config.endpoint in POOLING_ENDPOINTS:
                await _pool(client, config, request, encoded or b"", headers, result)
                result.ok = True
            elif config.endpoint == "completions":  # a turn of a token-id conversation is its whole prompt
                body = encoded or json.dumps({**common, "prompt": request.prompt if turn is None else turn}).encode()
                await _stream(client, config.base_url + "/v1/completions", body, headers, result, t0)
            else:
                messages.append({"role": "user", "content": turn if turn is not None else _as_text(request.prompt)})
                body = json.dumps({**common, "messages": list(messages)}).encode()
                reply = await _stream(client, config.base_url + "/v1/chat/completions", body, headers, result, t0)
                messages.append({"role": "assistant", "content": reply})
            if config.endpoint not in POOLING_ENDPOINTS:
                result.ok = result.ttft_s is not None
                if not result.ok:
                    result.error = "the stream ended without a token"
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"[:300]
        result.e2el_s = time.perf_counter() - t0
        results.append(result)
        if not result.ok:
            break  # a conversation stops at its first failed turn
    return results


def _as_text(prompt: list[int] | str | None) -> str:
    if isinstance(prompt, str):
        return prompt
    raise ValueError("the chat and rerank endpoints take text: use a JSONL or multi-turn dataset (chat), or "
                     "--decode-prompts-with a tokenizer")


# Connections per httpx client. httpcore's pool scans every connection against every queued
# request each time one is sent or returned: with one client of 64 connections, 10.7 of the
# client's 13.9 CPU seconds went to that scan (512 short embedding requests at concurrency 64, the
# 2-core development VM, 2026-12-02), and the client, not the server, set the throughput. Slots
# of 8 connections each keep the scan small; a request takes a free slot's client.
CONNECTIONS_PER_CLIENT = 8


async def _run(config: PointConfig, requests: Sequence[BenchRequest], progress: bool) -> tuple[list, float]:
    gaps = arrival_gaps(len(requests), config.request_rate, config.burstiness, config.seed)
    width = config.max_concurrency or len(requests) or 1  # requests in flight at most
    bar = _progress_bar(len(requests)) if progress else None
    limits = httpx.Limits(max_connections=CONNECTIONS_PER_CLIENT, max_keepalive_connections=CONNECTIONS_PER_CLIENT)
    clients = [httpx.AsyncClient(timeout=config.timeout_s, limits=limits)
               for _ in range(-(-width // CONNECTIONS_PER_CLIENT))]
    slots: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
    for k in range(width):  # slot k uses client k // 8: no client ever has more requests than connections
        slots.put_nowait(clients[k // CONNECTIONS_PER_CLIENT])
    bodies = [encoded_body(config, r) for r in requests]
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        began = time.perf_counter()

        async def one(request: BenchRequest, encoded: bytes | None) -> list[RequestResult]:
            client = await slots.get()
            try:
                out = await _send(client, config, request, time.perf_counter() - began, encoded)
            finally:
                slots.put_nowait(client)
            if bar is not None:
                bar.update(1)
            return out

        tasks = []
        for request, body, gap in zip(requests, bodies, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request, body)))
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - began
    if bar is not None:
        bar.close()
    return [r for rs in done for r in rs], duration


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", desc="requests")


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles, in milliseconds (None when there is nothing to summarize)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy's default
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": round(1000 * sum(ordered) / len(ordered), 3),
            **{f"p{p}": round(1000 * pct(p), 3) for p in PERCENTILES}}


def summarize(config: PointConfig, results: Sequence[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    slo = config.goodput_slo_ms

    def meets(r: RequestResult) -> bool:
        tpot = r.tpot_s
        return ((r.ttft_s or 0) * 1000 <= slo.get("ttft", math.inf)
                and (tpot or 0) * 1000 <= slo.get("tpot", math.inf)
                and r.e2el_s * 1000 <= slo.get("e2el", math.inf))

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "config": {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                   for k, v in dataclasses.asdict(config).items() if k != "api_key"},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / duration_s, 4) if duration_s > 0 else None,
        "output_throughput": round(out_tokens / duration_s, 2) if duration_s > 0 else None,
        "total_token_throughput": round((in_tokens + out_tokens) / duration_s, 2) if duration_s > 0 else None,
        "goodput": round(sum(meets(r) for r in ok) / duration_s, 4) if slo and duration_s > 0 else None,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for r in ok for g in r.itl_s]),
        "e2el_ms": _stats([r.e2el_s for r in ok]),
    }


def run_point(config: PointConfig, requests: Sequence[BenchRequest], *, progress: bool = False) -> dict:
    """Send every request as the config says and return the summary (a JSON-able dict), with
    the server's own latency histograms over the point where it exports them (server_metrics.py)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    before = server_metrics.scrape(config.base_url, headers)
    cpu = time.process_time()
    results, duration = asyncio.run(_run(config, requests, progress))
    summary = summarize(config, results, duration)
    # near duration_s, the client was the bottleneck and its latencies include its own queueing
    summary["client_cpu_s"] = round(time.process_time() - cpu, 3)
    summary["server_metrics"] = server_metrics.difference(before, server_metrics.scrape(config.base_url, headers))
    return summary
