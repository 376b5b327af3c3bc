"""Reading the daemons' /metrics (vLLM names) into signals."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagoda_operator.metrics_scrape import (
    MAX_SCRAPE_BYTES,
    ScrapeFailed,
    fetch,
    parse,
    scrape,
    signals_summary,
)

TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 4.0
vllm:num_requests_waiting{engine="0",model_name="other"} 100.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.7
# HELP pagoda:expert_parallel_size Current expert-parallel size.
# TYPE pagoda:expert_parallel_size gauge
pagoda:expert_parallel_size{model_name="llama"} 4.0
# HELP pagoda:placement_info Where this replica runs.
# TYPE pagoda:placement_info gauge
pagoda:placement_info{gpus="0,1",numa_nodes="0",model_name="llama"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="llama"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="llama"} 4.0
vllm:time_to_first_token_seconds_count{model_name="llama"} 4.0
vllm:time_to_first_token_seconds_sum{model_name="llama"} 0.9
"""


def test_parse_sums_requests_and_averages_kv_usage():
    sig = parse(TEXT, "llama")
    assert sig["requestsRunning"] == 5.0
    assert sig["requestsWaiting"] == 4.0  # the other model's series is ignored
    assert sig["kvCacheUsage"] == pytest.approx(0.6)
    assert sig["expertParallel"] == 4
    assert sig["placement"] == {"gpus": ["0", "1"], "numaNodes": [0]}


def test_parse_reads_the_fetched_models_revision():
    text = TEXT + ('# TYPE pagoda:model_info gauge\n'
                   'pagoda:model_info{model_name="llama",revision="0123abc",source="hf://org/llama"} 1.0\n')
    assert parse(text, "llama")["model"] == {"source": "hf://org/llama", "revision": "0123abc"}
    assert "model" not in parse(TEXT, "llama")  # a mounted model reports none


def test_parse_without_model_filter_and_missing_metrics():
    assert parse(TEXT)["requestsWaiting"] == 104.0
    assert parse("# nothing here\n") == {}


def ready_pod(name, ip="10.0.0.1", ready=True):
    return {
        "metadata": {"name": name},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_scrape_only_ready_pods_and_tolerates_failures():
    calls = []

    def fetcher(url, timeout):
        calls.append(url)
        if "10.0.0.3" in url:
            raise OSError("connection refused")
        return 'vllm:num_requests_waiting{model_name="m"} 2\n'

    pods = [
        ready_pod("a", "10.0.0.1"),
        ready_pod("b", "10.0.0.2", ready=False),
        ready_pod("c", "10.0.0.3"),
        ready_pod("d", "fd00::1"),
    ]
    out = scrape(pods, 8000, "m", fetcher=fetcher)
    assert sorted(out) == ["a", "d"]
    assert sorted(calls) == [
        "http://10.0.0.1:8000/metrics",
        "http://10.0.0.3:8000/metrics",
        "http://[fd00::1]:8000/metrics",
    ]
    assert signals_summary(out) == {"pods": 2, "requestsWaiting": 2.0}


HUGE = 50 * 1000 * 1000


@pytest.fixture
def metrics_server():
    """A real HTTP server on loopback standing in for daemons: a normal /metrics, one answering
    50 MB, one dripping a byte every 0.1 s."""
    stop = threading.Event()
    sent = {"huge": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            try:
                if self.path == "/metrics":
                    body = TEXT.encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/huge":
                    self.send_header("Content-Length", str(HUGE))
                    self.end_headers()
                    line = b'vllm:num_requests_waiting{model_name="llama"} 1.0\n' * 20000
                    while sent["huge"] < HUGE and not stop.is_set():
                        self.wfile.write(line)
                        sent["huge"] += len(line)
                else:
                    self.end_headers()
                    while not stop.is_set():
                        self.wfile.write(b"#")
                        self.wfile.flush()
                        time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sent
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_fetch_reads_a_normal_answer(metrics_server):
    base, _ = metrics_server
    assert parse(fetch(f"{base}/metrics", 2), "llama")["requestsWaiting"] == 4.0


def test_a_50_mb_answer_is_a_failed_scrape_read_only_to_the_limit(metrics_server):
    base, sent = metrics_server
    with pytest.raises(ScrapeFailed, match=f"more than {MAX_SCRAPE_BYTES} bytes"):
        fetch(f"{base}/huge", 5)
    # The operator stopped reading at the limit: the server could not push the whole body
    # (what it sent beyond the limit sits in socket buffers), and the operator holds no 50 MB.
    assert sent["huge"] < HUGE // 2


def test_a_dripping_answer_fails_after_the_timeout(metrics_server):
    base, _ = metrics_server
    started = time.monotonic()
    with pytest.raises(ScrapeFailed, match=r"within 0\.5s"):
        fetch(f"{base}/drip", 0.5)
    assert time.monotonic() - started < 2


def test_scrape_leaves_out_the_pod_that_answers_too_much(metrics_server):
    base, _ = metrics_server
    port = int(base.rsplit(":", 1)[1])
    pods = [ready_pod("good", "127.0.0.1")]
    assert sorted(scrape(pods, port, "llama", 5.0, fetch)) == ["good"]

    def huge_instead(url, timeout):
        return fetch(url.replace("/metrics", "/huge"), timeout)

    assert scrape(pods, port, "llama", 5.0, huge_instead) == {}


def test_a_starting_daemon_reports_its_phase(tiny_models, tmp_path):
    """Against a real `pagoda serve` as it starts: every phase read from /ready is one of the
    engine's, in order, and the pod counts as starting only until it is ready."""
    import httpx

    from pagoda_daemon.engine.messages import STARTUP_PHASES
    from pagoda_operator.metrics_scrape import starting_phases
    from tests.server.conftest import ServerProcess

    srv = ServerProcess(tiny_models["qwen3"], log_dir=tmp_path)
    pod = {"metadata": {"name": "p0"}, "status": {"phase": "Running", "podIP": "127.0.0.1",
                                                   "conditions": [{"type": "Ready", "status": "False"}]}}
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            phase = starting_phases([pod], srv.port, timeout=2).get("p0")
            if phase and phase not in seen:
                seen.append(phase)
            try:
                if httpx.get(srv.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        assert seen, "no start-up phase seen before ready"
        assert seen == [p for p in STARTUP_PHASES if p in seen]  # in the engine's order
        assert starting_phases([pod], srv.port, timeout=2) == {}  # ready: no phase to show
        ready = {**pod, "status": {**pod["status"], "conditions": [{"type": "Ready", "status": "True"}]}}
        assert starting_phases([ready], srv.port, timeout=2) == {}  # a Ready pod is not asked
    finally:
        assert srv.stop() == 0


def test_a_downloading_daemon_reports_its_progress_in_the_phase():
    """Against the daemon's real download-time server (/ready while the model is fetched): the
    phase carries bytes, files, rate and time left; progress fields of the wrong type are left out."""
    from pagoda_daemon.models.fetch import FetchProgress
    from pagoda_daemon.server.download_status import DownloadStatus
    from pagoda_operator.metrics_scrape import _current_phase, starting_phases
    from tests.server.conftest import free_port

    port = free_port()
    pod = {"metadata": {"name": "p0"}, "status": {"phase": "Running", "podIP": "127.0.0.1",
                                                   "conditions": [{"type": "Ready", "status": "False"}]}}
    status = DownloadStatus("127.0.0.1", port)
    with status:
        assert starting_phases([pod], port, timeout=2) == {"p0": "downloading model"}  # nothing known yet
        status.update(FetchProgress(1_234_000_000, 16_000_000_000, 3, 9, 110e6, 134.4))
        assert starting_phases([pod], port, timeout=2) == {
            "p0": "downloading model: 1.2 of 16.0 GB, 3/9 files, 110 MB/s, 134 s left"}
        status.update(FetchProgress(0, 16_000_000_000, 0, 9, 0.0, None))
        assert starting_phases([pod], port, timeout=2)["p0"] == "downloading model: 0.0 of 16.0 GB, 0/9 files"
    hostile = {"status": "not ready", "startup": [{"phase": "downloading model", "bytes_done": "1",
                                                   "bytes_total": True, "rate_bytes_per_s": float("nan")}]}
    import json

    assert _current_phase(json.dumps(hostile)) == "downloading model"
    assert _current_phase(json.dumps({"status": "not ready", "startup": [{"phase": "x" * 500}]})) == "x" * 160
    assert _current_phase(json.dumps({"status": "not ready", "startup": ["not a dict"]})) is None
