"""Prefill/decode disaggregation on one machine: a prefill instance whose disk tier keeps each
prompt's KV blocks, a decode instance that takes them from there (kv_offload_disk_source), and
`pagoda pd-proxy` in front, all real processes on loopback, asked through the openai client.
Greedy answers equal a single instance's; the decode instance loaded the prompts instead of
computing them; errors come back in the OpenAI shape; two prefill instances share the work and
one stopped costs no answer."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, free_port, server_starter

PROMPTS = [[(13 * i + j) % 400 + 3 for j in range(100)] for i in range(4)]  # 6 full blocks each
OWN_PROMPTS = [[(17 * i + j) % 400 + 5 for j in range(100)] for i in range(2)]  # the error test's: no block shared


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


TRANSFER_KEY = {"PAGODA_KV_TRANSFER_KEY": "pd-test-key-0123456789"}


@pytest.fixture(scope="module", params=["directory", "tcp", "request"])
def pd(tiny_models, tmp_path_factory, request):
    """The decode instance takes the prefill instance's blocks from its directory (one host), or
    fetches them from its transfer port (between hosts; here both on loopback): the one port it
    was given, or the one each request names (the prefill instance's signed answer header, which
    the proxy passes on). One set per source for the module's tests (about 15 s to start each):
    the tests read the metrics as differences."""
    tmp_path = tmp_path_factory.mktemp(f"pd-{request.param}")
    disk = ("--kv-offload-disk-gib", "0.01")
    with server_starter(tiny_models["llama"], tmp_path) as start:
        if request.param == "directory":
            prefill = start("--kv-offload-disk-path", str(tmp_path / "prefill-kv"), *disk)
            source = str(tmp_path / "prefill-kv")
        else:
            transfer_port = free_port()
            prefill = start("--kv-offload-disk-path", str(tmp_path / "prefill-kv"), *disk,
                            "--kv-transfer-port", str(transfer_port), "--kv-transfer-host", "127.0.0.1",
                            env=TRANSFER_KEY)
            source = f"tcp://127.0.0.1:{transfer_port}" if request.param == "tcp" else "request"
        decode = start("--kv-offload-disk-path", str(tmp_path / "decode-kv"), *disk,
                       "--kv-offload-disk-source", source, env=TRANSFER_KEY)
        with pd_proxy([prefill.url], [decode.url], tmp_path) as url:
            yield prefill, decode, url


@contextlib.contextmanager
def pd_proxy(prefills: list[str], decodes: list[str], tmp_path) -> Iterator[str]:
    """`pagoda pd-proxy` in front of these instances, healthy; yields its URL."""
    port = free_port()
    log = open(tmp_path / "proxy.log", "w")  # noqa: SIM115 (closed below)
    instances = [a for url in prefills for a in ("--prefill", url)] + [a for url in decodes for a in ("--decode", url)]
    proxy = subprocess.Popen([sys.executable, "-m", "pagoda_daemon", "pd-proxy", *instances, "--port", str(port)],
                             stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proxy.poll() is None and time.monotonic() < deadline, (tmp_path / "proxy.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proxy.terminate()
        proxy.wait(10)
        log.close()


def decode_fetches(decode) -> bool:
    source = decode.cmd[decode.cmd.index("--kv-offload-disk-source") + 1]
    return source == "request" or source.startswith("tcp://")


def test_answers_through_prefill_then_decode_equal_one_instance(pd, server):
    import openai

    prefill, decode, url = pd
    one = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    both = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ask = dict(model=MODEL_NAME, max_tokens=12, temperature=0.0)
    want = [one.completions.create(prompt=p, **ask).choices[0].text for p in PROMPTS]
    hits, fetched, generated = (metric(decode.url, "vllm:external_prefix_cache_hits_total"),
                                metric(decode.url, "pagoda:kv_transfer_fetched_bytes_total"),
                                metric(prefill.url, "vllm:generation_tokens_total"))
    got = [both.completions.create(prompt=p, **ask).choices[0].text for p in PROMPTS]
    assert got == want
    # the decode instance took every prompt's 6 full blocks from the prefill instance's disk tier
    assert metric(decode.url, "vllm:external_prefix_cache_hits_total") - hits >= len(PROMPTS) * 6 * 16
    fetched = metric(decode.url, "pagoda:kv_transfer_fetched_bytes_total") - fetched
    assert fetched > 0 if decode_fetches(decode) else fetched == 0
    assert metric(prefill.url, "vllm:generation_tokens_total") - generated == len(PROMPTS)  # one token each
    # streamed through the proxy: the same text in pieces
    stream = both.completions.create(prompt=PROMPTS[0], stream=True, **ask)
    assert "".join(c.choices[0].text for c in stream) == want[0]
    # chat goes the same way
    chat = both.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "w5 w6 w7"}],
                                        max_tokens=4, temperature=0.0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    # and the Responses API: the prefill instance computes the same conversation's blocks
    hits = metric(decode.url, "vllm:external_prefix_cache_hits_total")
    document = " ".join(f"w{j}" for j in range(80))
    asked = dict(model=MODEL_NAME, instructions="Summarize.", input=document, max_output_tokens=6, temperature=0.0)
    response = both.responses.create(**asked)
    assert response.output_text == one.responses.create(**asked).output_text
    assert metric(decode.url, "vllm:external_prefix_cache_hits_total") - hits >= 16
    streamed = list(both.responses.create(**asked, stream=True))
    assert streamed[-1].response.output_text == response.output_text
    # and Anthropic's Messages API
    import anthropic

    conversation = dict(model=MODEL_NAME, max_tokens=6, system="Summarize.", extra_body={"temperature": 0.0},
                        messages=[{"role": "user", "content": " ".join(f"v{j}" for j in range(80))}])
    hits = metric(decode.url, "vllm:external_prefix_cache_hits_total")
    message = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(**conversation)
    direct = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(**conversation)
    assert [b.model_dump() for b in message.content] == [b.model_dump() for b in direct.content]
    assert metric(decode.url, "vllm:external_prefix_cache_hits_total") - hits >= 16
    assert [m.id for m in both.models.list().data] == [MODEL_NAME]
    prefill.wait_idle()
    decode.wait_idle()


def test_two_prefill_instances_take_turns_and_one_down_costs_no_answer(start_server, server, tmp_path):
    """xPyD between hosts, on loopback: two prefill instances with transfer ports, one decode
    instance fetching from whichever of them each request's signed header names. Requests take
    turns over the prefill instances; with one stopped the other computes every prompt, with both
    stopped the decode instance computes them itself; greedy answers always equal one instance's."""
    import openai

    disk = ("--kv-offload-disk-gib", "0.01")
    prefills = [start_server("--kv-offload-disk-path", str(tmp_path / f"prefill-{i}"), *disk, "--kv-transfer-port",
                             str(free_port()), "--kv-transfer-host", "127.0.0.1", env=TRANSFER_KEY) for i in range(2)]
    decode = start_server("--kv-offload-disk-path", str(tmp_path / "decode-kv"), *disk,
                          "--kv-offload-disk-source", "request", env=TRANSFER_KEY)
    one = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ask = dict(model=MODEL_NAME, max_tokens=8, temperature=0.0)
    prompts = [[(7 * i + j) % 400 + 5 for j in range(100)] for i in range(7)]
    want = [one.completions.create(prompt=p, **ask).choices[0].text for p in prompts]
    with pd_proxy([p.url for p in prefills], [decode.url], tmp_path) as url:
        both = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = [both.completions.create(prompt=p, **ask).choices[0].text for p in prompts[:4]]
        assert [metric(p.url, "vllm:generation_tokens_total") for p in prefills] == [2, 2]  # one token a prompt
        fetched = metric(decode.url, "pagoda:kv_transfer_fetched_bytes_total")
        assert fetched > 0 and metric(decode.url, "vllm:external_prefix_cache_hits_total") >= 4 * 6 * 16
        prefills[0].stop()
        got += [both.completions.create(prompt=p, **ask).choices[0].text for p in prompts[4:6]]
        assert metric(prefills[1].url, "vllm:generation_tokens_total") == 4
        assert metric(decode.url, "pagoda:kv_transfer_fetched_bytes_total") > fetched
        prefills[1].stop()
        got.append(both.completions.create(prompt=prompts[6], **ask).choices[0].text)
        assert metric(url, "pagoda_pd_proxy_prefill_skipped_total") == 1
        assert got == want
    decode.wait_idle()


def test_requests_that_cannot_be_served_come_back_as_openai_errors(pd):
    prefill, decode, url = pd
    if decode.cmd[-1] == "request":  # a source header not signed by the prefill instance: refused
        forged = httpx.post(decode.url + "/v1/completions", timeout=30,
                            json={"model": MODEL_NAME, "prompt": OWN_PROMPTS[0], "max_tokens": 2},
                            headers={"x-pagoda-kv-source": "tcp://127.0.0.1:9 1 " + "0" * 64})
        assert forged.status_code == 400 and forged.json()["error"]["param"] == "x-pagoda-kv-source"
        # the prefill instance's own header, from an answer, is taken (the source it names is real)
        answer = httpx.post(prefill.url + "/v1/completions", timeout=30,
                            json={"model": MODEL_NAME, "prompt": OWN_PROMPTS[1], "max_tokens": 1})
        signed = answer.headers["x-pagoda-kv-source"]
        assert signed.startswith("tcp://127.0.0.1:")
        direct = httpx.post(decode.url + "/v1/completions", timeout=30, headers={"x-pagoda-kv-source": signed},
                            json={"model": MODEL_NAME, "prompt": OWN_PROMPTS[1], "max_tokens": 2})
        assert direct.status_code == 200
    bad = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "w3", "temperature": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["message"]
    broken = httpx.post(url + "/v1/completions", content=b"{not json", timeout=30,
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    listed = httpx.post(url + "/v1/completions", json=[1, 2], timeout=30)
    assert listed.status_code == 400 and listed.json()["error"]["type"] == "invalid_request_error"


def test_a_source_the_tier_cannot_link_from_is_refused_at_start(tiny_models, tmp_path):
    from pagoda_daemon import LLM

    with pytest.raises(ValueError, match="kv_offload_disk_source needs kv_offload_disk_path"):
        LLM(tiny_models["llama"], device="cpu", kv_offload_disk_source=str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        LLM(tiny_models["llama"], device="cpu", kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=0.01,
            kv_offload_disk_source=str(tmp_path / "missing"))
    (tmp_path / "kv").mkdir()
    with pytest.raises(ValueError, match="another engine's directory"):
        LLM(tiny_models["llama"], device="cpu", kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=0.01,
            kv_offload_disk_source=str(tmp_path / "kv"))
    elsewhere = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    if elsewhere is not None and os.stat(elsewhere).st_dev != os.stat(tmp_path).st_dev:
        try:
            with pytest.raises(ValueError, match="different filesystems"):
                LLM(tiny_models["llama"], device="cpu", kv_offload_disk_path=str(tmp_path / "kv"),
                    kv_offload_disk_gib=0.01, kv_offload_disk_source=elsewhere)
        finally:
            os.rmdir(elsewhere)


def test_the_prefill_request_keeps_what_shapes_the_prompt():
    from pagoda_daemon.server.pd_proxy import prefill_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}],
            "chat_template_kwargs": {"enable_thinking": False}, "stream": True, "n": 3, "max_completion_tokens": 50,
            "response_format": {"type": "json_object"}, "tool_choice": "required", "min_tokens": 5}
    assert prefill_request(body) == {"model": "m", "messages": body["messages"], "tools": body["tools"],
                                     "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 1}
    responses = {"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": "hi"}],
                 "tools": [{"type": "function", "name": "f"}], "stream": True, "max_output_tokens": 50,
                 "text": {"format": {"type": "json_object"}}, "tool_choice": "required", "top_logprobs": 2,
                 "include": ["message.output_text.logprobs"], "reasoning": {"effort": "low"}}
    messages = {"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 50, "stream": True, "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"},
                "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {}}}}
    assert prefill_request(messages, "/v1/messages") == {
        "model": "m", "system": "be brief", "messages": messages["messages"], "thinking": {"type": "disabled"},
        "output_config": {"effort": "low"}, "max_tokens": 1}
    assert prefill_request(responses, "/v1/responses") == {
        "model": "m", "instructions": "be brief", "input": responses["input"], "tools": responses["tools"],
        "reasoning": {"effort": "low"}, "max_output_tokens": 1}


def test_the_proxy_never_forwards_a_clients_source_header():
    """Only the prefill instance's answer header reaches the decode instance (the relay adds it)."""
    from pagoda_daemon.server.pd_proxy import forwarded_headers

    sent = {"Authorization": "Bearer k", "x-pagoda-kv-source": "tcp://10.0.0.9:1 1 " + "0" * 64, "Cookie": "c"}
    assert forwarded_headers(sent) == {"Authorization": "Bearer k"}
