"""Metrics, traces and KV events of a real server, seen by real consumers."""

from __future__ import annotations

import time

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pagoda_daemon.telemetry.kv_events import BlockRemoved, BlockStored, decode_batch
from tests.server.conftest import MODEL_NAME, free_port
from tests.telemetry.test_tracing import Receiver, attrs


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def get(values, name: str, **labels) -> float:
    return values.get((name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items()))), 0.0)


def test_metrics_parse_and_move_by_the_right_amounts(server):
    server.wait_idle()
    before = scrape(server.url)
    prompt = "Paged attention stores the key and value cache in fixed-size blocks of tokens"
    first = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert first.status_code == 200
    server.wait_idle()
    mid = scrape(server.url)
    resp = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 7, "ignore_eos": True}).json()
    n_prompt = resp["usage"]["prompt_tokens"]
    server.wait_idle()
    after = scrape(server.url)

    assert get(after, "vllm:prompt_tokens_total") - get(mid, "vllm:prompt_tokens_total") == n_prompt
    assert get(after, "vllm:generation_tokens_total") - get(mid, "vllm:generation_tokens_total") == 7
    assert get(after, "vllm:request_success_total", finished_reason="length") - \
        get(before, "vllm:request_success_total", finished_reason="length") == 2
    for hist in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_queue_time_seconds"):
        assert get(after, hist + "_count") - get(mid, hist + "_count") == 1, hist
    assert get(after, "vllm:inter_token_latency_seconds_count") - \
        get(mid, "vllm:inter_token_latency_seconds_count") == 6  # 7 tokens, 6 gaps
    # the same prompt again: its full blocks come from the prefix cache
    assert get(after, "vllm:prefix_cache_queries_total") - get(mid, "vllm:prefix_cache_queries_total") == n_prompt
    hits = get(after, "vllm:prefix_cache_hits_total") - get(mid, "vllm:prefix_cache_hits_total")
    assert hits == (n_prompt - 1) // 16 * 16 > 0
    assert get(after, "vllm:num_requests_running") == 0 and get(after, "vllm:num_requests_waiting") == 0
    assert get(after, "vllm:kv_cache_usage_perc") == 0.0
    # where the engine runs, for the operator (a CPU engine: no GPU; NUMA node unknown or 0)
    placement = [k for k in after if k[0] == "pagoda:placement_info"]
    assert len(placement) == 1 and dict(placement[0][1])["gpus"] == ""
    assert get(after, "pagoda:expert_parallel_size") == 1


def test_aborted_request_is_counted_as_abort(server):
    before = scrape(server.url)
    body = {"model": MODEL_NAME, "prompt": "A long story:", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    server.wait_idle()
    time.sleep(0.3)
    after = scrape(server.url)
    assert get(after, "vllm:request_success_total", finished_reason="abort") - \
        get(before, "vllm:request_success_total", finished_reason="abort") == 1


def test_trace_exported_with_parent_from_traceparent(start_server):
    receiver = Receiver()
    try:
        srv = start_server("--otlp-traces-endpoint", receiver.base_url + "/v1/traces")
        trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
        resp = httpx.post(srv.url + "/v1/chat/completions", headers=headers, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": 0.5, "top_p": 0.9})
        assert resp.status_code == 200
        deadline = time.monotonic() + 20
        spans = []
        while time.monotonic() < deadline and not spans:
            spans = [s for _, s in receiver.spans() if s.trace_id.hex() == trace_id]
            time.sleep(0.2)
        assert len(spans) == 1, receiver.spans()
        span = spans[0]
        assert span.parent_span_id.hex() == parent_id
        a = attrs(span.attributes)
        assert a["gen_ai.request.model"] == MODEL_NAME and a["gen_ai.request.max_tokens"] == 3
        assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
        assert a["gen_ai.usage.output_tokens"] == 3 and a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.response.id"] == resp.json()["id"]
        assert {e.name for e in span.events} >= {"queued", "scheduled", "first_token"}
    finally:
        receiver.close()


def test_kv_events_block_stored_then_removed_after_eviction(start_server):
    port = free_port()
    # a cache of 24 blocks of 16 tokens: a few long prompts force evictions
    srv = start_server("--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--max-model-len", "256",
                       "--kv-cache-memory-bytes", str(24 * 8192))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        events, seqs = [], []
        deadline = time.monotonic() + 30
        prompts = [[(7 * i + j) % 400 + 3 for j in range(200)] for i in range(4)]
        sent = 0
        while time.monotonic() < deadline and not any(isinstance(e, BlockRemoved) for e in events):
            if sent < len(prompts):  # the first requests also cover the slow-joiner window
                r = httpx.post(srv.url + "/v1/completions", json={
                    "model": MODEL_NAME, "prompt": prompts[sent], "max_tokens": 2})
                assert r.status_code == 200, r.text
                sent += 1
            while sub.poll(200):
                seq, _, batch = decode_batch(sub.recv_multipart())
                seqs.append(seq)
                events.extend(batch)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored, events
        assert all(e.block_size == 16 and len(e.token_ids) == 16 for e in stored)
        first = next(e for e in stored if e.token_ids == prompts[-1][:16] or e.parent_block_hash is None)
        assert first.parent_block_hash is None
        removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert removed and removed <= {h for e in stored for h in e.block_hashes}
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
    finally:
        sub.close(0)
        ctx.term()


def test_kv_events_report_the_offload_tiers_with_their_medium(start_server):
    """With a host-memory tier of 8 blocks, the subscriber sees blocks stored there and, once
    it is full, removed from it, each with medium CPU (no parent, no tokens: the tier knows a
    block by its hash), beside the GPU cache's own events."""
    port = free_port()
    srv = start_server("--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--max-model-len", "256",
                       "--kv-cache-memory-bytes", str(24 * 8192), "--kv-offload-cpu-gib", str(8 * 8192 / 2**30))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        events: list = []
        deadline = time.monotonic() + 30
        prompts = [[(11 * i + j) % 400 + 3 for j in range(200)] for i in range(4)]
        sent = 0

        def cpu_removal() -> bool:
            return any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)

        while time.monotonic() < deadline and not cpu_removal():
            if sent < len(prompts):
                r = httpx.post(srv.url + "/v1/completions", json={
                    "model": MODEL_NAME, "prompt": prompts[sent], "max_tokens": 2})
                assert r.status_code == 200, r.text
                sent += 1
            while sub.poll(200):
                events.extend(decode_batch(sub.recv_multipart())[2])
        on_cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
        on_gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
        assert on_cpu and on_gpu and cpu_removal(), events
        assert all(e.parent_block_hash is None and e.token_ids == [] for e in on_cpu)
        assert {h for e in on_cpu for h in e.block_hashes} <= {h for e in on_gpu for h in e.block_hashes}
        removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes}
        assert removed <= {h for e in on_cpu for h in e.block_hashes}
    finally:
        sub.close(0)
        ctx.term()
