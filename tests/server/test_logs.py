"""What `pagoda serve` says at the default level: one line per start-up phase with its
duration, one access line per request (with the request id), and the same as JSON objects
with `--log-format json` / PAGODA_LOG_FORMAT."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess


def _run(model: str, tmp_path, env=None) -> str:
    srv = ServerProcess(model, log_dir=tmp_path, env=env)
    try:
        srv.wait_ready()
        body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4}
        assert httpx.post(srv.url + "/v1/completions", json=body, headers={"X-Request-Id": "req-42"},
                          timeout=60).status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": -1}, timeout=60).status_code == 400
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        assert srv.stop() == 0
    return srv.log_path.read_text()


def test_start_up_phases_and_access_lines(tiny_models, tmp_path):
    log = _run(tiny_models["qwen3"], tmp_path)
    for phase in ("start-up: weights", "start-up: KV cache", "start-up: warm-up in", "engine ready in",
                  "serving " + MODEL_NAME + " on http://127.0.0.1:"):
        assert phase in log, phase
    access = [line for line in log.splitlines() if " pagoda.access: " in line]
    assert any("req-42 POST /v1/completions 200 prompt_tokens=" in line and "completion_tokens=4 " in line
               for line in access), access
    assert any(" POST /v1/completions 400 prompt_tokens=- completion_tokens=- " in line for line in access), access
    assert not any("/health" in line for line in access)  # probes log at DEBUG


def test_json_log_format(tiny_models, tmp_path):
    log = _run(tiny_models["qwen3"], tmp_path, env={"PAGODA_LOG_FORMAT": "json"})
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert len(lines) == len([line for line in log.splitlines() if line.strip()]), log[-2000:]  # every line is JSON
    assert {entry["process"] for entry in lines} >= {"api", "engine-core"}
    access = [e for e in lines if e["logger"] == "pagoda.access"]
    assert any(e["request_id"] == "req-42" and "POST /v1/completions 200" in e["message"] for e in access)
    assert all({"time", "level", "logger", "message"} <= set(e) for e in lines)


def test_a_bad_log_format_is_refused():
    proc = subprocess.run([sys.executable, "-m", "pagoda_daemon", "--log-format", "xml", "serve", "/m"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'xml'" in proc.stderr


def test_engine_stats_lines_while_the_engine_works_and_none_when_idle(tiny_models, tmp_path):
    import time

    srv = ServerProcess(tiny_models["qwen3"], "--log-stats-interval", "0.5", log_dir=tmp_path)
    try:
        srv.wait_ready()
        body = {"model": MODEL_NAME, "prompt": "count", "max_tokens": 64, "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(1.2)
        lines = [line for line in srv.log_path.read_text().splitlines() if "engine: " in line and "tokens/s" in line]
        assert lines and "running " in lines[0] and "KV cache " in lines[0] and "prefix-cache hits" in lines[0]
        time.sleep(1.5)  # idle: no new line
        assert len([line for line in srv.log_path.read_text().splitlines()
                    if "engine: " in line and "tokens/s" in line]) == len(lines)
    finally:
        assert srv.stop() == 0


def test_a_bad_stats_interval_is_refused(tiny_models):
    for bad in ("-1", "nan", "1e9"):
        proc = subprocess.run([sys.executable, "-m", "pagoda_daemon", "serve", tiny_models["qwen3"],
                               "--log-stats-interval", bad], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--log-stats-interval must be 0 to 86400 seconds" in proc.stderr, bad


def test_ready_says_where_start_up_is_and_how_long_each_phase_took(tiny_models, tmp_path):
    """/ready's body names the phase a starting engine is in; once ready, every phase in order
    with its duration, also as pagoda:startup_phase_seconds (the operator and people watching a
    slow start see where it is, not a silent probe)."""
    import time

    from pagoda_daemon.engine.messages import STARTUP_PHASES

    srv = ServerProcess(tiny_models["qwen3"], log_dir=tmp_path)
    try:
        seen_starting = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                resp = httpx.get(srv.url + "/ready", timeout=2)
            except httpx.HTTPError:  # not listening yet
                time.sleep(0.05)
                continue
            if resp.status_code == 200:
                break
            assert resp.status_code == 503 and resp.json()["reason"].startswith("the engine is still starting")
            seen_starting.append(resp.json())
            time.sleep(0.05)
        body = resp.json()
        assert body["status"] == "ready"
        phases = body["startup"]
        assert [p["phase"] for p in phases] == list(STARTUP_PHASES)
        assert all(p["seconds"] >= 0 for p in phases)
        assert sum(p["seconds"] for p in phases) == pytest.approx(body["startup_seconds"] - phases[0]["started_s"],
                                                                  abs=0.01)
        for b in seen_starting:  # phases are only ever entered in order
            names = [p["phase"] for p in b["startup"]]
            assert names == list(STARTUP_PHASES[:len(names)])
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        for name in STARTUP_PHASES:
            assert f'pagoda:startup_phase_seconds{{model_name="{MODEL_NAME}",phase="{name}"}}' in metrics
    finally:
        assert srv.stop() == 0
