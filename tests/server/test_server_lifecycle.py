"""Process-level behaviour: engine death, back-pressure, graceful drain on SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.server.conftest import MODEL_NAME


def test_engine_death_fails_in_flight_requests_and_exits(start_server):
    srv = start_server()
    result = {}

    def long_request():
        body = {"model": MODEL_NAME, "prompt": "Tell me everything", "max_tokens": 480, "ignore_eos": True,
                "n": 32}
        t0 = time.monotonic()
        resp = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        result["status"], result["body"], result["seconds"] = resp.status_code, resp.json(), time.monotonic() - t0

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 10
    while srv.health().json()["engine"].get("num_running", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(srv.engine_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    t.join(30)
    assert not t.is_alive()
    assert result["status"] == 500 and result["body"]["error"]["code"] == "engine_dead"
    assert time.monotonic() - killed_at < 5
    assert srv.proc.wait(10) == 1  # and the daemon exits, so that the kubelet restarts the pod


def test_queue_full_gets_503_with_retry_after_and_sigterm_drains(start_server):
    srv = start_server("--max-num-seqs", "2", "--max-waiting-requests", "1")
    statuses: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(6)

    def fire():
        body = {"model": MODEL_NAME, "prompt": "Count slowly", "max_tokens": 480, "ignore_eos": True}
        barrier.wait()  # all six arrive together: 3 fit (2 running + 1 waiting), 3 are turned away
        resp = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        with lock:
            statuses.append(resp.status_code)
            if resp.status_code == 503:
                assert resp.headers["retry-after"]
                assert resp.json()["error"]["code"] == "service_unavailable"
            else:
                assert resp.json()["usage"]["completion_tokens"] == 480

    threads = [threading.Thread(target=fire) for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the turned-away ones answer at once; the others are running
        with lock:
            if statuses.count(503) == 3:
                break
        time.sleep(0.02)
    while srv.health().json()["engine"].get("num_running") != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.health().json()["engine"]["num_running"] == 2  # draining starts with work in flight
    srv.proc.send_signal(signal.SIGTERM)  # drain: the accepted requests still finish
    for t in threads:
        t.join(120)
    assert statuses.count(200) == 3 and statuses.count(503) == 3, statuses
    assert srv.proc.wait(60) == 0
