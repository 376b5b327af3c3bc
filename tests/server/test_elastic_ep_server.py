"""Elastic EP through `pagoda serve` (CPU, gloo): the admin routes resize a running replica
2 → 3 → 4 → 2 while the openai client streams completions in a loop, with zero failed
requests; the routes take the admin key only, refuse hostile bodies with a 4xx in OpenAI's
error shape, and the metrics and /elastic_ep tell each transition."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

USER, ADMIN = "user-key-1", "admin-key-1"


def _admin(srv: ServerProcess, method: str, path: str, key: str | None = ADMIN, headers: dict | None = None,
           **kwargs) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, srv.url + path, headers={**auth, **(headers or {})}, timeout=30, **kwargs)


def _wait_size(srv: ServerProcess, size: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    state: dict = {}
    while time.monotonic() < deadline:
        state = _admin(srv, "GET", "/elastic_ep").json()
        if not state["is_scaling"] and state["phase"] in ("done", "failed") and state["target"] == size:
            return state
        time.sleep(0.2)
    raise AssertionError(f"no resize to {size}: {state}\n{srv.log_path.read_text()[-3000:]}")


class LoopingClient:
    """The openai client streaming completions back to back until stopped; every request must
    finish with all its tokens."""

    def __init__(self, url: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key=USER, max_retries=0, timeout=120)
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                stream = self.client.completions.create(model="tiny", prompt=f"request {i} says", max_tokens=12,
                                                        temperature=0.0, stream=True,
                                                        extra_body={"ignore_eos": True})
                chunks = [c for c in stream]
                text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
                if chunks[-1].choices[0].finish_reason != "length" or len(text_chunks) == 0:
                    self.failures.append(f"request {i}: {chunks[-1]}")
                self.done += 1
            except Exception as e:
                self.failures.append(f"request {i}: {type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


@pytest.fixture
def elastic_server(tiny_models, tmp_path):
    srv = ServerProcess(tiny_models["qwen3_moe"], "--dtype", "float32", "--max-model-len", "256",
                        "--expert-parallel-size", "2", "--enable-eplb", "--eplb-step-interval", "20",
                        "--elastic-ep-min-size", "2", "--elastic-ep-max-size", "4",
                        "--api-key", USER, "--admin-api-key", ADMIN, log_dir=tmp_path, served_name="tiny")
    try:
        srv.wait_ready(180)
        yield srv
    finally:
        srv.stop()


def test_resizing_a_serving_replica_fails_no_request(elastic_server):
    srv = elastic_server
    loop = LoopingClient(srv.url)
    try:
        for size in (3, 4, 2):
            while loop.done < 3:  # requests in flight across each transition
                time.sleep(0.1)
            answer = _admin(srv, "POST", "/scale_elastic_ep", json={"new_expert_parallel_size": size})
            assert answer.status_code == 202, answer.text
            busy = _admin(srv, "POST", "/scale_elastic_ep", json={"new_expert_parallel_size": 3})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "resize_in_progress"
            state = _wait_size(srv, size)
            assert (state["size"], state["phase"], state["last_error"]) == (size, "done", "")
            loop.done = 0
        while loop.done < 3:
            time.sleep(0.1)
    finally:
        loop.stop()
    assert loop.failures == []
    assert _admin(srv, "GET", "/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": False}
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'pagoda:expert_parallel_size{model_name="tiny"} 2.0' in metrics
    assert 'pagoda:elastic_ep_transitions_total{model_name="tiny",outcome="done"} 3.0' in metrics
    assert 'pagoda:elastic_ep_phase{model_name="tiny",phase="done"} 1.0' in metrics
    moved = [line for line in metrics.splitlines() if line.startswith("pagoda:elastic_ep_bytes_moved_total")]
    assert moved and float(moved[0].split()[-1]) > 0
    srv.wait_idle()


def test_the_admin_routes_take_the_admin_key_and_bounded_bodies(elastic_server):
    srv = elastic_server
    for key in (None, USER, "wrong"):  # a user's key is not an admin key
        answer = _admin(srv, "POST", "/scale_elastic_ep", key=key, json={"new_expert_parallel_size": 3})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert _admin(srv, "GET", "/elastic_ep", key=key).status_code == 401
    hostile = [{"new_expert_parallel_size": 5}, {"new_expert_parallel_size": 1}, {"new_expert_parallel_size": 0},
               {"new_expert_parallel_size": -3}, {"new_expert_parallel_size": 2**70},
               {"new_expert_parallel_size": "3"}, {"new_expert_parallel_size": True},
               {"new_expert_parallel_size": 3.0}, {"new_expert_parallel_size": None}, {},
               {"new_expert_parallel_size": 3, "new_data_parallel_size": 3}, {"new_expert_parallel_size": 3, "x": 1},
               [3]]
    for body in hostile:
        answer = _admin(srv, "POST", "/scale_elastic_ep", json=body)
        assert answer.status_code == 400, (body, answer.text)
        assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    for raw in (b"{", b"\xff", b'{"new_expert_parallel_size": NaN}'):
        answer = _admin(srv, "POST", "/scale_elastic_ep", content=raw, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400, (raw, answer.text)
    assert _admin(srv, "GET", "/elastic_ep").json()["size"] == 2  # nothing above moved the replica
    # vLLM's body works too
    assert _admin(srv, "POST", "/scale_elastic_ep", json={"new_data_parallel_size": 2}).status_code == 202
    assert _wait_size(srv, 2)["phase"] == "done"


def test_without_an_admin_key_the_admin_routes_are_off(server):
    answer = httpx.post(server.url + "/scale_elastic_ep", json={"new_expert_parallel_size": 2}, timeout=10)
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_routes_off"


def test_an_admin_key_that_is_also_a_user_key_is_refused_at_start(tiny_models, tmp_path):
    srv = ServerProcess(tiny_models["llama"], "--api-key", f"a,{ADMIN}", "--admin-api-key", ADMIN, log_dir=tmp_path)
    assert srv.proc.wait(60) == 2
    srv.stop()
    assert "the admin API key must differ from every user API key" in srv.log_path.read_text()
