"""pd-proxy's probes, metrics and routing, against instances faked with an httpx transport:
``/ready`` is ready only when an instance of each role is, and otherwise names the instance that
is not and its start-up phase (what the operator shows as a pod's ``startupPhase``); ``/metrics``
is the decode instance's and the proxy's own; with several instances of a role, requests go to the
least busy, around an instance that is down. (tests/server/test_pd_disaggregation.py runs real
instances.)"""

from __future__ import annotations

import ast
import json
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


def test_metrics_are_the_decode_instances_then_the_proxys_own():
    text = "vllm:external_prefix_cache_hits_total 96.0\n"
    c = proxy({DECODE + "/metrics": (200, text), PREFILL + "/metrics": (200, "prefill 1\n")})
    r = c.get("/metrics")
    assert r.status_code == 200
    assert r.text.startswith(text) and "prefill 1" not in r.text
    assert f'pagoda_pd_proxy_in_flight{{instance="{DECODE}",role="decode"}} 0.0' in r.text
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
    assert third_party == {"httpx", "fastapi", "uvicorn", "prometheus_client"}
    assert third_party <= extra, third_party - extra


P2, D2 = "http://127.0.0.1:8101", "http://127.0.0.1:8201"
ASK = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}


class Instances:
    """Fake instances that record what each was asked; ``down`` refuse connections, ``status``
    answer the completion route with another status."""

    def __init__(self, down=(), status=None, broken=()) -> None:
        self.asked: list[tuple[str, dict, dict]] = []
        self.down, self.status, self.broken = set(down), dict(status or {}), set(broken)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if base in self.broken:
            raise httpx.ReadError("", request=request)
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json=READY)
        self.asked.append((base, json.loads(request.content), dict(request.headers)))
        status = self.status.get(base, 200)
        headers = {"x-pagoda-kv-source": f"tcp://{request.url.host}:{request.url.port + 1000} 1 sig"}
        body = {"choices": [{"text": base}]} if status == 200 else {"error": {"message": "no", "code": status}}
        # a stream, as from a real connection (a response made with its content cannot be streamed)
        return httpx.Response(status, stream=httpx.ByteStream(json.dumps(body).encode()),
                              headers={**headers, "content-type": "application/json"})

    def who(self, role_urls) -> list[str]:
        return [base for base, _, _ in self.asked if base in role_urls]


def routed(instances: Instances, n: int = 4, prefills=(PREFILL, P2), decodes=(DECODE, D2)):
    client = TestClient(build_app(list(prefills), list(decodes), transport=httpx.MockTransport(instances)))
    answers = [client.post("/v1/completions", json=ASK) for _ in range(n)]
    return client, answers


def test_requests_take_turns_over_idle_instances_of_each_role():
    seen = Instances()
    _, answers = routed(seen)
    assert [a.status_code for a in answers] == [200] * 4
    assert seen.who({PREFILL, P2}) == [PREFILL, P2, PREFILL, P2]
    assert seen.who({DECODE, D2}) == [DECODE, D2, DECODE, D2]
    # each decode request names the prefill instance that computed its prompt
    decode_asks = [(base, headers) for base, _, headers in seen.asked if base in (DECODE, D2)]
    assert [h["x-pagoda-kv-source"].split()[0] for _, h in decode_asks] == [
        "tcp://127.0.0.1:9100", "tcp://127.0.0.1:9101"] * 2


def test_the_least_busy_instance_goes_first():
    from pagoda_daemon.server.pd_proxy import Instances as Pool

    pool = Pool("decode", [DECODE, D2, "http://127.0.0.1:8202"])
    pool.all[0].in_flight, pool.all[1].in_flight = 3, 1
    assert pool.by_load()[0].url == "http://127.0.0.1:8202"
    pool.all[2].in_flight = 5
    assert [i.url for i in pool.by_load()] == [D2, DECODE, "http://127.0.0.1:8202"]


@pytest.mark.parametrize("failure", ["down", "503", "429", "500"])
def test_a_prefill_instance_down_or_failing_passes_the_request_to_the_next(failure):
    seen = Instances(down={PREFILL} if failure == "down" else (),
                     status={} if failure == "down" else {PREFILL: int(failure)})
    client, answers = routed(seen)
    assert [a.status_code for a in answers] == [200] * 4
    assert seen.who({DECODE, D2}) == [DECODE, D2, DECODE, D2]
    assert all(h["x-pagoda-kv-source"].startswith("tcp://127.0.0.1:9101 ") for b, _, h in seen.asked if b in (DECODE, D2))
    text = client.get("/metrics").text  # several decode instances: the proxy's own series only
    assert f'pagoda_pd_proxy_requests_total{{instance="{PREFILL}",outcome="failed",role="prefill"}}' in text
    assert "pagoda_pd_proxy_prefill_skipped_total 0.0" in text


def test_with_no_prefill_instance_the_decode_instance_computes_the_prompt():
    seen = Instances(down={PREFILL, P2})
    client, answers = routed(seen, n=2)
    assert [a.status_code for a in answers] == [200] * 2
    assert seen.who({DECODE, D2}) == [DECODE, D2]
    assert not any("x-pagoda-kv-source" in h for _, _, h in seen.asked)
    assert "pagoda_pd_proxy_prefill_skipped_total 2.0" in client.get("/metrics").text


def test_a_request_a_prefill_instance_refuses_comes_back_and_goes_no_further():
    seen = Instances(status={PREFILL: 400, P2: 400})
    _, answers = routed(seen, n=1)
    assert answers[0].status_code == 400 and answers[0].json()["error"]["message"] == "no"
    assert seen.who({PREFILL, P2}) == [PREFILL] and seen.who({DECODE, D2}) == []


def test_a_decode_instance_refusing_connections_passes_the_request_on_one_failing_later_does_not():
    seen = Instances(down={DECODE})
    _, answers = routed(seen)
    assert [a.status_code for a in answers] == [200] * 4 and seen.who({DECODE, D2}) == [D2] * 4
    seen = Instances(broken={DECODE})
    _, answers = routed(seen, n=2)
    # the connection to DECODE was made: its answer may have been generated, so no second try
    assert [a.status_code for a in answers] == [502, 200]
    assert answers[0].json()["error"]["message"] == "an instance behind the proxy did not answer: ReadError"


def test_nothing_stays_in_flight_after_answers_refusals_and_streams():
    seen = Instances(status={D2: 422})
    client, answers = routed(seen)
    assert [a.status_code for a in answers] == [200, 422, 200, 422]
    with client.stream("POST", "/v1/completions", json={**ASK, "stream": True}) as r:
        assert r.status_code == 200
        r.read()
    text = client.get("/metrics").text
    assert re.findall(r"^pagoda_pd_proxy_in_flight\{.*\} (\S+)$", text, re.M) == ["0.0"] * 4


def test_ready_while_an_instance_of_each_role_is():
    answers = {url + "/ready": (200, READY) for url in (PREFILL, P2, DECODE)}
    answers[D2 + "/ready"] = (503, LOADING)
    c = TestClient(build_app([PREFILL, P2], [DECODE, D2], transport=httpx.MockTransport(
        lambda r: httpx.Response(*answers[f"http://{r.url.host}:{r.url.port}{r.url.path}"][:1],
                                 json=answers[f"http://{r.url.host}:{r.url.port}{r.url.path}"][1]))))
    r = c.get("/ready")
    assert r.status_code == 200 and r.json()["decode_ready"] == "1 of 2" and r.json()["prefill_ready"] == "2 of 2"
    answers[DECODE + "/ready"] = (503, LOADING)
    r = c.get("/ready")
    assert r.status_code == 503 and r.json()["reason"] == "decode instance: engine starting"


@pytest.mark.parametrize("argv, message", [
    (["--prefill", PREFILL, "--prefill", PREFILL, "--decode", DECODE], "each once"),
    ([*[a for i in range(65) for a in ("--prefill", f"http://10.0.0.1:{8000 + i}")], "--decode", DECODE], "at most 64"),
    (["--prefill", PREFILL, "--decode", "127.0.0.1:8200"], "must be an http(s) URL"),
])
def test_bad_instance_lists_are_refused_in_one_line(argv, message, capsys):
    import argparse

    p = argparse.ArgumentParser()
    pd_proxy.add_args(p)
    assert pd_proxy.run(p.parse_args(argv)) == 2
    assert message in capsys.readouterr().out
