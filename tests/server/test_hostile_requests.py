"""Hostile requests against a real `pagoda serve`: each gets a 4xx in OpenAI's error shape (or is
served), the engine serves on, and nothing stays registered, queued or allocated afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def post_raw(server, path: str, body: bytes | str, timeout: float = 60) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"},
                      timeout=timeout)


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(content="Hello", **fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serving_and_idle(server) -> dict:
    """The engine lives, answers a plain request, and holds nothing (in flight, queued, blocks)."""
    health = server.health()
    assert health.status_code == 200, health.text
    ok = httpx.post(server.url + COMPLETIONS, json=completion(), timeout=60)
    assert ok.status_code == 200, ok.text
    engine = server.wait_idle()
    assert engine["in_flight"] == 0, engine
    return engine


# ---- 1. the engine survives any request; every numeric field is bounded --------------------------

def test_top_k_past_int64_is_the_whole_vocabulary_and_the_engine_survives(server):
    pid = server.engine_pid()
    for top_k in (2**63, 2**64 + 5, 10**30, 10**6):
        resp = httpx.post(server.url + COMPLETIONS, json=completion(top_k=top_k, temperature=1.0, seed=1),
                          timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    # clamped means the same as disabled: a seeded sample is the one top_k=-1 gives
    same = [httpx.post(server.url + COMPLETIONS, json=completion(top_k=k, temperature=1.0, seed=5, max_tokens=6),
                       timeout=60).json()["choices"][0]["text"] for k in (-1, 2**63)]
    assert same[0] == same[1]
    assert server.engine_pid() == pid  # the same engine process, never restarted
    assert_serving_and_idle(server)


OUT_OF_BOUNDS = [
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 2**70),
    ("top_k", -2), ("n", 0), ("n", 129), ("max_tokens", 0), ("max_tokens", 2**70), ("min_tokens", -1),
    ("min_tokens", 2**64), ("logprobs", 21), ("logprobs", -1), ("temperature", 2.5), ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.01), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", 101.0), ("stop_token_ids", [-1]),
    ("stop_token_ids", [10**7]), ("stop_token_ids", [2**64]), ("stop_token_ids", list(range(1025))),
    ("stop", [f"s{i}" for i in range(33)]), ("stop", "x" * 1025), ("stop", [""]), ("cache_salt", "s" * 257),
    ("user", "u" * 257), ("best_of", 2),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_BOUNDS, ids=lambda v: str(v)[:20])
def test_out_of_bounds_fields_get_400_naming_the_field(server, field, value):
    resp = httpx.post(server.url + COMPLETIONS, json=completion(**{field: value}), timeout=60)
    error = assert_openai_error(resp, 400)
    assert error["param"].split(".")[0] == field, error  # the field, or an item of it (stop_token_ids.0)
    assert server.health().json()["engine"].get("in_flight") == 0


def test_extreme_values_inside_the_bounds_are_served(server):
    for fields in ({"seed": 2**63 - 1, "n": 3}, {"seed": -(2**63)}, {"top_k": -1}, {"top_k": 0},
                   {"temperature": 1e-300}, {"repetition_penalty": 100.0, "presence_penalty": -2.0},
                   {"logprobs": 20}, {"min_tokens": 2, "max_tokens": 2}, {"stop": [f"s{i}" for i in range(32)]}):
        resp = httpx.post(server.url + COMPLETIONS, json=completion(**fields), timeout=60)
        assert resp.status_code == 200, (fields, resp.text)
    assert_serving_and_idle(server)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e309"])
def test_non_finite_numbers_get_400(server, literal):
    body = json.dumps(completion()).replace('"max_tokens": 2', f'"temperature": {literal}, "max_tokens": 2')
    assert_openai_error(post_raw(server, COMPLETIONS, body), 400)


# ---- 2. unencodable requests: 400, and nothing stays registered -------------------------------

def test_unencodable_requests_get_400_and_leave_nothing_in_flight(server):
    bodies = [json.dumps(completion(seed=2**70)), json.dumps(completion(stop="\ud800")),
              json.dumps(completion(stop=["ok", "\udfff"], n=2)), json.dumps(chat(stop="\ud800"))]
    for _ in range(25):
        for i, body in enumerate(bodies):
            assert_openai_error(post_raw(server, CHAT if i == 3 else COMPLETIONS, body), 400)
    engine = server.health().json()["engine"]
    assert engine["in_flight"] == 0 and engine["num_running"] == 0 and engine["num_waiting"] == 0, engine
    assert_serving_and_idle(server)


# ---- 3. lone surrogates and deep nesting ------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, completion(prompt="ab\ud800cd"), "prompt"),
    (COMPLETIONS, completion(prompt=["fine", "\udc00"]), "prompt.1"),
    (CHAT, chat("hi \ud83d there"), "messages.0.content"),
    (CHAT, chat([{"type": "text", "text": "\udfff"}]), "messages.0.content.0.text"),
    (CHAT, {**chat(), "messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, "messages.0.name"),
    (COMPLETIONS, {**completion(), "\ud800": 1}, None),
    (COMPLETIONS, completion(model="\ud800"), "model"),
], ids=["prompt", "prompt-list", "chat", "chat-part", "name", "key", "model"])
def test_lone_surrogates_get_400(server, path, body, param):
    error = assert_openai_error(post_raw(server, path, json.dumps(body)), 400, param)
    assert "surrogate" in error["message"]


def test_a_surrogate_pair_is_valid_text(server):
    resp = post_raw(server, COMPLETIONS, json.dumps(completion(prompt="smile \ud83d\ude00", stop="\ud83d\ude00")))
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deeply_nested_json_gets_400(server, depth):
    body = f'{{"model": "{MODEL_NAME}", "prompt": {"[" * depth}1{"]" * depth}}}'
    assert_openai_error(post_raw(server, COMPLETIONS, body), 400)
    assert_openai_error(post_raw(server, CHAT, '{"messages": ' + "[" * depth + "]" * depth + "}"), 400)


@pytest.mark.parametrize("body", [b"\xff\xfe{", b'{"model": 1' + b"1" * 5000 + b"}", b"{" * 50, b"\x00"],
                         ids=["bad-utf8", "5000-digit-int", "unclosed", "nul"])
def test_malformed_bodies_get_400(server, body):
    assert_openai_error(post_raw(server, COMPLETIONS, body), 400)


# ---- 5. token ids are strict integers -----------------------------------------------------------

@pytest.mark.parametrize("token", ["7.0", "true", '"7"', "7.5", "null", "[7]"])
@pytest.mark.parametrize("field", ["prompt", "stop_token_ids"])
def test_token_ids_must_be_integers(server, field, token):
    base = completion()
    if field == "prompt":
        del base["prompt"]
    body = json.dumps(base)[:-1] + f', "{field}": [5, {token}, 9]}}'
    error = assert_openai_error(post_raw(server, COMPLETIONS, body), 400)
    assert error["param"].split(".")[0] == field, error


def test_integer_fields_refuse_floats_bools_and_strings(server):
    for field, value in (("max_tokens", 2.0), ("max_tokens", True), ("n", "2"), ("seed", 1.0), ("top_k", False),
                         ("logprobs", "1"), ("stream", 1), ("ignore_eos", "false")):
        assert_openai_error(httpx.post(server.url + COMPLETIONS, json=completion(**{field: value}), timeout=30),
                            400, field)


@pytest.mark.parametrize("ids", [[-1, 5], [5, 2**63], [True, 5], [5, 1.0], [5, None], [5, "7"], [5, [6]]])
def test_token_id_prompts_taken_at_once_still_refuse_what_the_union_refuses(ids):
    """Lists of plain ints in range skip the union's validator (CompletionRequest); anything else
    is still refused by it, naming the prompt (no server: parsing alone)."""
    from pagoda_daemon.server.errors import APIError
    from pagoda_daemon.server.protocol import INT64_MAX, CompletionRequest, parse_request

    with pytest.raises(APIError) as refused:
        parse_request(CompletionRequest, json.dumps({"model": MODEL_NAME, "prompt": ids}).encode())
    assert refused.value.status == 400 and refused.value.param.split(".")[0] == "prompt", refused.value.param
    ids = [0, INT64_MAX, *(random.randrange(2**20) for _ in range(1000))]
    request = parse_request(CompletionRequest, json.dumps({"model": MODEL_NAME, "prompt": ids}).encode())
    assert request.prompts() == [ids]


# ---- 6. a batch that can never fit is a 400, not a 503 -------------------------------------------

def test_a_batch_larger_than_the_server_holds_gets_400(server):
    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.server.api import ServerSettings

    held = EngineConfig.max_num_seqs + ServerSettings.max_waiting_requests  # the fixture's server: defaults
    for fields in ({"prompt": ["hi"] * (held + 1)}, {"prompt": [[5, 6]] * (held // 128 + 1), "n": 128}):
        resp = httpx.post(server.url + COMPLETIONS, json=completion(**fields), timeout=60)
        error = assert_openai_error(resp, 400)
        assert "retry-after" not in resp.headers and error["code"] == "too_many_generations"
    assert_serving_and_idle(server)


# ---- 7. routing errors in OpenAI's shape ---------------------------------------------------------

def test_404_and_405_use_the_openai_error_shape(server):
    missing = httpx.get(server.url + "/v1/nothing-here")
    assert_openai_error(missing, 404)
    wrong_method = httpx.get(server.url + COMPLETIONS)
    assert_openai_error(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"


# ---- 8. aborted streams: no traceback, nothing leaked --------------------------------------------

def test_a_burst_of_aborted_streams_logs_no_traceback_and_leaks_nothing(server):
    start = server.log_path.stat().st_size

    async def abort_one(client: httpx.AsyncClient, i: int) -> None:
        body = completion(prompt=f"story {i}:", max_tokens=200, ignore_eos=True, stream=True, n=1 + i % 3)
        path = CHAT if i % 2 else COMPLETIONS
        if path == CHAT:
            body = chat(f"story {i}", max_tokens=200, ignore_eos=True, stream=True, n=1 + i % 3)
        async with client.stream("POST", server.url + path, json=body) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_lines():
                break  # hang up after the first event

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            await asyncio.gather(*(abort_one(client, i) for i in range(60)))

    asyncio.run(run())
    engine = server.wait_idle(timeout=30)
    time.sleep(0.5)
    with open(server.log_path) as f:
        f.seek(start)
        logged = f.read()
    assert "Traceback" not in logged and "aclose()" not in logged, logged[-3000:]
    assert engine["in_flight"] == 0, engine
    assert_serving_and_idle(server)


# ---- 4. huge prompts: refused before tokenizing, off the event loop ------------------------------

def _vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# Polls /health from its own process (so the test's sender threads do not slow the measurement)
# until its stdin closes, then prints the latencies in seconds as JSON.
_HEALTH_POLLER = """
import json, sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies = []
with httpx.Client(timeout=10) as client:
    while not stop.is_set():
        t0 = time.perf_counter()
        assert client.get(sys.argv[1] + "/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.01)
print(json.dumps(latencies))
"""


@pytest.mark.serial  # a wall-clock bound: runs alone, after the parallel pass
def test_huge_prompts_do_not_block_health_or_keep_memory(server):
    huge = json.dumps(completion(prompt="lorem ipsum dolor sit amet " * 400_000)).encode()  # ~10.8 MB
    huge_chat = json.dumps(chat("lorem ipsum dolor sit amet " * 400_000)).encode()
    assert 10_000_000 < len(huge) < 30_000_000
    near_limit = json.dumps(completion(prompt="lorem ipsum " * 700)).encode()  # must be tokenized
    rss_before = _vm_rss_mb(server.proc.pid)
    results: list[httpx.Response] = []

    def send(path: str, body: bytes) -> None:
        results.append(post_raw(server, path, body, timeout=120))

    poller = subprocess.Popen([sys.executable, "-c", _HEALTH_POLLER, server.url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        for _ in range(3):
            senders = [threading.Thread(target=send, args=(COMPLETIONS, huge)) for _ in range(3)]
            senders += [threading.Thread(target=send, args=(CHAT, huge_chat)),
                        threading.Thread(target=send, args=(COMPLETIONS, near_limit))]
            for t in senders:
                t.start()
            for t in senders:
                t.join()
        time.sleep(0.2)
    finally:
        out, _ = poller.communicate("", timeout=30)
    latencies = sorted(json.loads(out))
    assert len(results) == 15
    for resp in results:
        error = assert_openai_error(resp, 400, "prompt")
        assert error["code"] == "context_length_exceeded", error
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    assert p99 < 0.1, f"/health p99 {p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms over {len(latencies)}"
    growth = _vm_rss_mb(server.proc.pid) - rss_before
    assert growth < 150, f"API RSS grew {growth:.0f} MB"
    assert_serving_and_idle(server)


# ---- 1. the engine core's last line of defence -----------------------------------------------------

def test_the_engine_core_fails_a_bad_add_alone(tiny_models, tmp_path):
    """ADD frames the API would never send (it validates first) fail their request only."""
    import multiprocessing
    import os

    import msgspec
    import zmq

    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.engine.messages import EngineCoreOutputs, EngineReady, EngineStarting, Shutdown
    from pagoda_daemon.sampling_params import SamplingParams
    from pagoda_daemon.server import wire
    from pagoda_daemon.server.core_process import run_engine_core

    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.setsockopt(zmq.LINGER, 0)
    in_addr, out_addr = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    to_core.bind(in_addr)
    from_core.bind(out_addr)
    config = EngineConfig(model=tiny_models["llama"], device="cpu", max_model_len=128, num_kv_blocks=32,
                          numa_policy="none")
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(config, in_addr, out_addr, os.getpid(), "INFO", None), daemon=True)
    proc.start()
    try:
        message = None
        while not isinstance(message, EngineReady):  # the start-up phases come first
            assert from_core.poll(120_000), "engine core not ready"
            message = wire.decode_from_core(from_core.recv())
            assert isinstance(message, (EngineStarting, EngineReady)), message
        good = wire.add_request("good", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), None, (), 0.0)
        fields = msgspec.structs.asdict(good)

        def add_frame(**changes) -> bytes:  # an ADD frame as raw msgpack, so any field may be wrong
            f = {**fields, **changes}
            return msgspec.msgpack.encode(["add", *f.values()])

        bad = [
            add_frame(request_id="unknown-param", sampling_params={**fields["sampling_params"], "bogus": 1}),
            add_frame(request_id="bad-seed", sampling_params={**fields["sampling_params"], "seed": 2**64 - 1}),
            add_frame(request_id="bad-token", prompt_token_ids=[5, 10**9]),  # past the vocabulary
            add_frame(request_id="no-prompt", prompt_token_ids=[]),
            add_frame(request_id="missing-fields", sampling_params=None),  # the wrong type
            add_frame(request_id="text-prompt", prompt_token_ids=["five"]),
            msgspec.msgpack.encode(["add", "too-short"]),
            msgspec.msgpack.encode(["not", "a", "message"]),
            msgspec.msgpack.encode({"a": "map"}),
            b"\xc1 not msgpack at all",
        ]
        for frame in bad:
            to_core.send(frame)
        to_core.send(wire.encode(good))
        finished: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while "good" not in finished and time.monotonic() < deadline:
            assert from_core.poll(10_000), "no output from the engine core"
            message = wire.decode_from_core(from_core.recv())
            assert isinstance(message, EngineCoreOutputs), message
            for out in message.outputs:
                if out.finish_reason is not None:
                    finished[out.request_id] = out.finish_reason
        assert finished == {"unknown-param": "abort", "bad-seed": "abort", "bad-token": "abort",
                            "no-prompt": "abort", "missing-fields": "abort", "text-prompt": "abort",
                            "too-short": "abort", "good": "length"}
        assert proc.is_alive()
        to_core.send(wire.encode(Shutdown()))
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        to_core.close(0)
        from_core.close(0)
        ctx.term()
