"""The OpenAI-compatible API through the real `openai` client against a real server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagoda_daemon import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def offline(tiny_models):
    return LLM(tiny_models["llama"], device="cpu", max_model_len=512, num_kv_blocks=64, numa_policy="none")


def test_completion_text_equals_offline_generate(openai_client, offline):
    resp = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    choice = resp.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length" == expected.finish_reason
    assert resp.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 12
    assert resp.model == MODEL_NAME and resp.object == "text_completion"


def test_streamed_completion_concatenates_to_the_same_text(openai_client, offline):
    stream = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    prompt_tokens = chunks[-1].usage.prompt_tokens

    two = list(openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=2, seed=3,
                                                stream=True, stream_options={"include_usage": True}))
    usage = two[-1].usage
    assert usage.prompt_tokens == prompt_tokens  # one prompt, counted once for its n choices
    assert usage.completion_tokens == 10
    assert sorted({c.choices[0].index for c in two if c.choices}) == [0, 1]


def test_a_token_whose_text_is_held_back_still_streams_a_chunk(openai_client, offline):
    """A chunk for generated tokens even while their bytes do not yet make a character (text ""),
    as vLLM's server streams: a client times the first token by the first chunk, so holding the
    chunk back until text appears made clients measure a later TTFT than the engine's. (Outputs
    the handler has not sent yet merge into one chunk, so chunks are at most one per token.)"""
    lead_byte = offline.tokenizer.convert_tokens_to_ids("\u00e4")  # byte 0xE4: starts a 3-byte character
    stream = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"allowed_token_ids": [lead_byte]})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert 2 <= len(texts) <= 32, texts  # before: one chunk, at the end
    assert texts[0] == ""
    assert chunks[-1].usage.completion_tokens == 32
    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=32, temperature=0, stream=True,
                                                 extra_body={"allowed_token_ids": [lead_byte]})
    contents = [c.choices[0].delta.content for c in chat if c.choices and c.choices[0].delta.role is None]
    assert 2 <= len(contents) <= 32 and contents[0] == "", contents


def test_chat_completion_uses_the_chat_template(openai_client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    resp = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=10,
                                                 temperature=0)
    templated = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = offline.generate([templated], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(offline.tokenizer.encode(templated))

    stream = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                                   temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_n_seed_stop_and_logprobs(openai_client):
    resp = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                            seed=7, n=3, logprobs=2)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    again = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                             seed=7, n=3, logprobs=2)
    assert [c.text for c in resp.choices] == [c.text for c in again.choices]
    assert resp.usage.completion_tokens == 24
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 8 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)

    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)

    base = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[5:8]
    if "\ufffd" not in stop and stop.strip():
        cut = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                               stop=[stop])
        assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_models_version_and_probes(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] == 512
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/ready").status_code == 200
    assert server.health().json()["status"] == "ok"


async def _stream_one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str | None, int]:
    body = {"model": MODEL_NAME, "prompt": f"Request number {i} says", "max_tokens": 8 + i % 9,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    finish, usage = None, -1
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                finish = chunk["choices"][0]["finish_reason"]
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return i, finish, usage


def test_128_concurrent_streams_all_complete_and_free_their_blocks(server):
    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream_one(client, server.url, i) for i in range(128)))

    results = asyncio.run(run())
    assert len(results) == 128
    for i, finish, usage in results:
        assert finish == "length", (i, finish)
        assert usage == 8 + i % 9, (i, usage)
    server.wait_idle()


BAD_REQUESTS = [
    ("wrong type", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("negative max_tokens", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("huge max_tokens", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10**9}, "prompt"),
    ("temperature out of range", {"model": MODEL_NAME, "prompt": "hi", "temperature": 7}, "temperature"),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, "model"),
    ("oversized prompt", {"model": MODEL_NAME, "prompt": "word " * 2000}, "prompt"),
    ("empty prompt", {"model": MODEL_NAME, "prompt": ""}, "prompt"),
    ("token id out of range", {"model": MODEL_NAME, "prompt": [1, 2, 10**7]}, "prompt"),
    # past api.py's bounds for work on the event loop: checked in a worker thread, and a body over
    # INLINE_BODY_BYTES parsed there too
    ("token id out of range in a long prompt", {"model": MODEL_NAME, "prompt": [1] * 9000 + [10**7]}, "prompt"),
    ("token id out of range in a large body", {"model": MODEL_NAME, "prompt": [10**5] * 12000 + [-1]}, "prompt"),
    ("unsupported parameter", {"model": MODEL_NAME, "prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("logit_bias token out of the vocabulary", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"5": 1, "1000000": 2}},
     "logit_bias"),
    ("logit_bias token past int64", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"9999999999999999999": 2}},
     "logit_bias"),
    ("logit_bias key not a token id", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"-5": 1}}, "logit_bias"),
    ("logit_bias value not a number", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"5": "up"}},
     "logit_bias"),
    ("logit_bias not an object", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": [[5, 1]]}, "logit_bias"),
    ("suffix", {"model": MODEL_NAME, "prompt": "hi", "suffix": "end"}, "suffix"),
    ("guided_json that cannot compile", {"model": MODEL_NAME, "prompt": "hi", "guided_json": {"type": "nonsense"}},
     "guided_json"),
    ("priority", {"model": MODEL_NAME, "prompt": "hi", "priority": 3}, "priority"),
    ("max_tokens 0 without echo", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("truncate_prompt_tokens 0", {"model": MODEL_NAME, "prompt": "hi", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("allowed_token_ids out of range", {"model": MODEL_NAME, "prompt": "hi", "allowed_token_ids": [10**6]},
     "allowed_token_ids"),
    ("a bad word of more tokens than a word may hold",
     {"model": MODEL_NAME, "prompt": "hi", "bad_words": ["\u00e9\U0001F680" * 40]}, "bad_words"),
    ("allowed_token_ids empty", {"model": MODEL_NAME, "prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("prompt_logprobs past the bound", {"model": MODEL_NAME, "prompt": "hi", "prompt_logprobs": 21},
     "prompt_logprobs"),
    ("request_id with a space", {"model": MODEL_NAME, "prompt": "hi", "request_id": "a b"}, "request_id"),
    ("continuous usage of a wrong type",
     {"model": MODEL_NAME, "prompt": "hi", "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ("missing prompt", {"model": MODEL_NAME}, "prompt"),
]
BAD_CHAT = [
    ("empty messages", {"model": MODEL_NAME, "messages": []}, "messages"),
    ("bad role", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("tools", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ("top_logprobs without logprobs",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("null content from the user", {"model": MODEL_NAME, "messages": [{"role": "user", "content": None}]},
     "messages.content"),
    ("continue_final_message with add_generation_prompt",
     {"model": MODEL_NAME, "messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("chat_template_kwargs replacing the conversation",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"conversation": []}}, "chat_template_kwargs.conversation"),
    ("chat_template", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                       "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
]


@pytest.mark.parametrize(("path", "case"), [("/v1/completions", c) for c in BAD_REQUESTS]
                         + [("/v1/chat/completions", c) for c in BAD_CHAT], ids=lambda v: v[0] if isinstance(v, tuple) else v)
def test_bad_requests_get_400_with_openai_error_shape(server, path, case):
    _, body, param = case
    resp = httpx.post(server.url + path, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_invalid_json_bodies_get_400(server, raw):
    resp = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_aborts_and_returns_blocks(server):
    body = {"model": MODEL_NAME, "prompt": "A long story:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    # the connection is closed mid-stream; the engine must drop the request
    engine = server.wait_idle()
    assert engine["num_running"] == 0


def test_non_streaming_disconnect_aborts_too(server):
    body = {"model": MODEL_NAME, "prompt": "A long story:", "max_tokens": 480, "ignore_eos": True, "n": 16}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    server.wait_idle(timeout=30)
