"""pd-proxy's probes and metrics, against instances faked with an httpx transport: ``/ready`` is
ready only when both instances are, and otherwise names the instance that is not and its start-up
phase (what the operator shows as a pod's ``startupPhase``); ``/metrics`` is the decode
instance's."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from pagoda_daemon.server import pd_proxy
from pagoda_daemon.server.pd_proxy import build_app

PREFILL, DECODE = "http://127.0.0.1:8100", "http://127.0.0.1:8200"
READY = {"status": "ready", "startup": [{"phase": "warming up"}]}
LOADING = {"status": "not ready", "reason": "engine starting", "startup": [{"phase": "loading weights"}]}


def proxy(answers: dict[str, tuple[int, object]]) -> TestClient:
    """A proxy whose instances answer ``answers[url]`` (status, JSON body or text); an URL not in
    it refuses the connection."""

    def handle(request: httpx.Request) -> httpx.Response:
        key = f"{request.url.scheme}://{request.url.host}:{request.url.port}{request.url.path}"
        if key not in answers:
            raise httpx.ConnectError("connection refused", request=request)
        status, body = answers[key]
        if isinstance(body, str):
            return httpx.Response(status, text=body, headers={"content-type": "text/plain; version=0.0.4"})
        return httpx.Response(status, json=body)

    return TestClient(build_app(PREFILL, DECODE, transport=httpx.MockTransport(handle)))


def test_ready_only_when_both_instances_are():
    r = proxy({PREFILL + "/ready": (200, READY), DECODE + "/ready": (200, READY)}).get("/ready")
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "prefill": READY, "decode": READY}


@pytest.mark.parametrize("loading", ["prefill", "decode"])
def test_a_loading_instance_makes_the_proxy_not_ready_and_says_which(loading):
    urls = {"prefill": PREFILL, "decode": DECODE}
    answers = {url + "/ready": (200, READY) for url in urls.values()}
    answers[urls[loading] + "/ready"] = (503, LOADING)
    r = proxy(answers).get("/ready")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "not ready"
    assert body["reason"] == f"{loading} instance: engine starting"
    assert body["startup"] == [{"phase": f"{loading}: loading weights"}]


def test_an_instance_that_does_not_answer_makes_the_proxy_not_ready():
    r = proxy({PREFILL + "/ready": (200, READY)}).get("/ready")  # decode refuses connections
    assert r.status_code == 503
    assert r.json()["reason"].startswith("decode instance did not answer")


def test_a_dropped_connection_is_a_502_that_names_the_error():
    """httpx's errors for a connection dropped mid-request carry no message: the 502 names the
    error's type (a bare "did not answer: " was all a failed request said on an H100 run)."""

    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("", request=request)

    client = TestClient(build_app(PREFILL, DECODE, transport=httpx.MockTransport(handle)))
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    assert r.status_code == 502
    assert r.json()["error"]["message"] == "an instance behind the proxy did not answer: ReadError"


def test_a_ready_answer_that_is_not_json_still_counts_by_its_status():
    r = proxy({PREFILL + "/ready": (503, "starting"), DECODE + "/ready": (200, READY)}).get("/ready")
    assert r.status_code == 503
    assert r.json() == {"status": "not ready", "reason": "prefill instance: HTTP 503", "startup": []}


def test_metrics_are_the_decode_instances():
    text = "vllm:external_prefix_cache_hits_total 96.0\n"
    c = proxy({DECODE + "/metrics": (200, text), PREFILL + "/metrics": (200, "prefill 1\n")})
    r = c.get("/metrics")
    assert r.status_code == 200
    assert r.text == text
    assert r.headers["content-type"].startswith("text/plain")
    assert proxy({}).get("/metrics").status_code == 502


def test_the_daemon_extra_carries_every_package_the_proxy_imports():
    """The daemon image installs the daemon extra only: a package the proxy imports outside it
    (httpx was one) makes `pagoda pd-proxy` exit at start in the image."""
    tree = ast.parse(Path(pd_proxy.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    third_party = imported - set(sys.stdlib_module_names) - {"pagoda_daemon"}
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("-", "_")
             for r in pyproject["project"]["optional-dependencies"]["daemon"]}
    assert third_party == {"httpx", "fastapi", "uvicorn"}
    assert third_party <= extra, third_party - extra
