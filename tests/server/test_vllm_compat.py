"""What clients written for vLLM send and read, against a real `pagoda serve` on loopback:
echo with logprobs (lm-eval's loglikelihood), usage on every chunk (guidellm), vLLM's extra
fields, unknown fields, request ids, cached-token usage, the tokenizer routes."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from pagoda_daemon import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=60, **kw)


def events(resp: httpx.Response) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in resp.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.fixture(scope="module")
def offline(tiny_models):
    return LLM(tiny_models["llama"], max_model_len=512, num_kv_blocks=64)


def random_ids(n: int) -> list[int]:
    rng = random.Random()
    return [rng.randrange(3, 500) for _ in range(n)]


WORDS = ["Pagoda", "serves", "large", "language", "models", "on", "Kubernetes", "with", "paged", "attention", "and", "continuous", "batching"]


def random_text_ids(offline, n_words: int) -> list[int]:
    """Token ids of a random sentence: whole characters, so no two tokens decode to the same
    string (byte pieces of a split character all decode to U+FFFD, and top_logprobs is keyed by text)."""
    return offline.engine.tokenizer.encode(" ".join(random.choices(WORDS, k=n_words)))


def test_echo_with_logprobs_returns_the_prompt_scored(server, offline):
    prompt = random_text_ids(offline, random.randrange(3, 20))
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                                            "temperature": 0}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    for p in range(1, len(prompt)):
        assert lp["token_logprobs"][p] == pytest.approx(want.prompt_logprobs[p][prompt[p]], abs=1e-4)
        assert lp["top_logprobs"][p][lp["tokens"][p]] == pytest.approx(lp["token_logprobs"][p])
    # the text is the prompt's, then the completion's; offsets index into it
    prompt_text = offline.engine.tokenizer.decode(prompt)
    assert choice["text"].startswith(prompt_text)
    assert lp["text_offset"][0] == 0
    for tok, start, nxt in zip(lp["tokens"], lp["text_offset"], lp["text_offset"][1:]):
        assert nxt == start + len(tok)
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 1


def test_echo_with_max_tokens_zero_returns_only_the_prompt(server):
    prompt = "The capital of France is Paris."
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == prompt
    assert len(choice["logprobs"]["tokens"]) == body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 0
    streamed = events(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                                       "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == prompt


def test_streamed_echo_and_logprobs_match_the_whole_answer(server):
    body = {"prompt": random_ids(12), "max_tokens": 6, "echo": True, "logprobs": 2, "temperature": 0,
            "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    chunks = [e["choices"][0] for e in events(post(server, "/v1/completions", {**body, "stream": True}))]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


def test_prompt_logprobs_field_as_vllm_shapes_it(server):
    prompt = random_ids(8)
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        assert str(prompt[p]) in plp[p] and 3 >= len(plp[p]) >= 2
        assert all(set(v) == {"logprob", "decoded_token"} for v in plp[p].values())
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    resp = post(server, "/v1/completions", {"prompt": "Paged attention", "max_tokens": 5, "ignore_eos": True,
                                            "stream": True,
                                            "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}})
    chunks = events(resp)
    assert all("usage" in c for c in chunks), chunks
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    chat = events(post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    assert all("usage" in c for c in chat) and chat[-1]["usage"]["completion_tokens"] == 4


def test_unknown_fields_are_ignored_and_logged_once(server):
    name = f"client_bookkeeping_{random.randrange(10**9)}"
    for _ in range(3):
        resp = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, name: {"trace": 1}})
        assert resp.status_code == 200, resp.text
    assert server.log_path.read_text().count(name) == 1
    # OpenAI's bookkeeping fields change nothing generated: accepted, as vLLM's server accepts them
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "store": False, "metadata": {"team": "eval"}, "service_tier": "auto",
                                                  "modalities": ["text"],
                                                  "prediction": {"type": "content", "content": "a guess"}})
    assert chat.status_code == 200, chat.text
    audio = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "modalities": ["text", "audio"]})
    assert audio.status_code == 400 and audio.json()["error"]["param"].startswith("modalities"), audio.text


def test_request_ids_name_the_response(server):
    resp = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123" and resp.json()["id"] == "cmpl-abc-123"
    generated = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert len(generated.headers["x-request-id"]) == 32
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": "mine"}).json()
    assert body["id"] == "cmpl-mine"
    # the same id twice at once: both served (engine ids stay unique)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8},
                                                headers={"X-Request-Id": "same"}), range(4)))
    assert [r.status_code for r in results] == [200] * 4
    bad = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "x" * 300})
    assert bad.headers["x-request-id"] != "x" * 300
    assert httpx.get(server.url + "/nowhere", headers={"X-Request-Id": "r1"}).headers["x-request-id"] == "r1"


def test_cached_tokens_count_the_prefix_cache(server):
    prompt = random_ids(70)
    first = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    second = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # four full blocks of 16


def test_vllm_sampling_fields(server, offline):
    allowed = random.sample(range(3, 500), 4)
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "allowed_token_ids": allowed,
                                            "logprobs": 0, "return_tokens_as_token_ids": True}).json()
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") and int(t.split(":")[1]) in allowed for t in tokens), tokens
    truncated = post(server, "/v1/completions", {"prompt": random_ids(30), "max_tokens": 2,
                                                 "truncate_prompt_tokens": 7}).json()
    assert truncated["usage"]["prompt_tokens"] == 7
    greedy = {"prompt": "The capital of", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
              "return_tokens_as_token_ids": True}
    ids = [int(t.split(":")[1]) for t in
           post(server, "/v1/completions", greedy).json()["choices"][0]["logprobs"]["tokens"]]
    tokenizer = offline.engine.tokenizer
    # a generated token that is a word of its own (its text tokenizes back to it)
    word_id = next(t for t in ids if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    banned = post(server, "/v1/completions", {**greedy, "bad_words": [tokenizer.decode([word_id])]}).json()
    banned_ids = [int(t.split(":")[1]) for t in banned["choices"][0]["logprobs"]["tokens"]]
    assert word_id not in banned_ids and banned_ids[:ids.index(word_id)] == ids[:ids.index(word_id)]
    for extra in ({"add_special_tokens": False}, {"spaces_between_special_tokens": False}, {"priority": 0},
                  {"truncate_prompt_tokens": -1}):
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra}).status_code == 200


def test_chat_extras(server):
    msgs = [{"role": "user", "content": "hi"}]
    think = post(server, "/tokenize", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    plain = post(server, "/tokenize", {"messages": msgs})
    assert think.json()["count"] > plain.json()["count"]
    resp = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.json()["usage"]["prompt_tokens"] == think.json()["count"]
    # OpenAI's reasoning_effort, as vLLM maps it: "none" turns thinking off, other levels leave it on,
    # an explicit enable_thinking wins; on completions it is an ignored unknown field, as in vLLM
    effort = {level: post(server, "/tokenize", {"messages": msgs, "reasoning_effort": level}).json()["count"]
              for level in ("none", "low", "high")}
    assert effort == {"none": think.json()["count"], "low": plain.json()["count"], "high": plain.json()["count"]}
    kept_on = post(server, "/tokenize", {"messages": msgs, "reasoning_effort": "none",
                                         "chat_template_kwargs": {"enable_thinking": True}})
    assert kept_on.json()["count"] == plain.json()["count"]
    chat = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "reasoning_effort": "none"})
    assert chat.json()["usage"]["prompt_tokens"] == think.json()["count"]
    assert post(server, "/v1/chat/completions", {"messages": msgs, "reasoning_effort": "extreme"}).status_code == 400
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "reasoning_effort": "low"}).status_code == 200
    cont = [*msgs, {"role": "assistant", "content": "Paris is"}]
    body = post(server, "/v1/chat/completions", {"messages": cont, "max_tokens": 3, "echo": True,
                                                 "continue_final_message": True,
                                                 "add_generation_prompt": False}).json()
    assert body["choices"][0]["message"]["content"].startswith("Paris is")
    null_content = [*msgs, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    assert post(server, "/v1/chat/completions", {"messages": null_content, "max_tokens": 2}).status_code == 200


def test_tokenizer_routes_models_ping_and_not_served(server, offline):
    text = "Continuous batching lets new requests join"
    tok = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tok["tokens"] == offline.engine.tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512 and len(tok["token_strs"]) == tok["count"]
    assert post(server, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": text}
    bad = post(server, "/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|end_of_text|>" and info["chat_template"]
    card = httpx.get(server.url + f"/v1/models/{MODEL_NAME}").json()
    assert card["id"] == MODEL_NAME and card["max_model_len"] == 512
    missing = httpx.get(server.url + "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    for path in ("/v1/embeddings", "/v1/images/generations", "/v1/audio/transcriptions"):
        resp = post(server, path, {"input": "x"})
        assert resp.status_code == 404 and "does not serve" in resp.json()["error"]["message"]


# The vllm: series inference-perf's vLLM client and llm-d's scrapers read (counters with the
# _total prometheus_client adds). vLLM itself registers the multimodal-cache, external
# (connector) prefix-cache, KV-block-lifetime and corrupted-request series only when those
# features are on; none is in this build, so neither server exposes them here.
SCRAPED = {
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:e2e_request_latency_seconds", "vllm:num_requests_waiting", "vllm:num_requests_running",
    "vllm:request_time_per_output_token_seconds", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:iteration_tokens_total",
    "vllm:prompt_tokens_cached_total", "vllm:request_prefill_kv_computed_tokens", "vllm:cache_config_info",
}


def test_metrics_carry_every_scraped_vllm_series(server):
    from prometheus_client.parser import text_string_to_metric_families

    prompt = random_ids(40)
    for _ in range(2):  # the second is served from the prefix cache
        post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "n": 2, "ignore_eos": True})
    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    names = {n.removesuffix("_count") for n in samples} | set(samples)
    missing = SCRAPED - names
    assert not missing, missing
    for s in samples["vllm:cache_config_info"]:
        assert s.labels["block_size"] == "16"
    assert sum(s.value for s in samples["vllm:prompt_tokens_cached_total"]) >= 32
    params_n = {s.labels["le"]: s.value for s in samples["vllm:request_params_n_bucket"]}
    assert params_n["1.0"] < params_n["2.0"]  # the n=2 requests
    assert sum(s.value for s in samples["vllm:iteration_tokens_total_count"]) > 0
    assert sum(s.value for s in samples["vllm:request_time_per_output_token_seconds_count"]) > 0


def test_the_openai_sdk_reads_every_new_shape(openai_client, offline):
    """The official client parses these into its own types: a field of the wrong shape would
    fail its validation or come back None."""
    card = openai_client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME
    prompt = random_text_ids(offline, 8)
    echoed = openai_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, echo=True, logprobs=2,
                                              temperature=0)
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and echoed.choices[0].text.startswith(offline.engine.tokenizer.decode(prompt))
    fresh = " ".join(random.choices(WORDS, k=12))  # a conversation no earlier test cached
    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": fresh}],
                                                 max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    for kind in ("chat", "completions"):
        common = dict(model=MODEL_NAME, max_tokens=4, n=3, stream=True, extra_body={"ignore_eos": True},
                      stream_options={"include_usage": True})
        if kind == "chat":
            stream = openai_client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **common)
        else:
            stream = openai_client.completions.create(prompt="Paged attention", **common)
        chunks = list(stream)
        assert {c.index for ch in chunks for c in ch.choices} == {0, 1, 2}
        finished = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        assert finished == ["length"] * 3
        assert chunks[-1].usage.completion_tokens == 12
    repeat = random_text_ids(offline, 40)
    openai_client.completions.create(model=MODEL_NAME, prompt=repeat, max_tokens=1)
    again = openai_client.completions.create(model=MODEL_NAME, prompt=repeat, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == (len(repeat) - 1) // 16 * 16


def test_logit_bias_through_the_openai_client(openai_client, offline):
    """OpenAI's logit_bias as the official client sends it (token ids as string keys) reaches the
    engine core over its socket and samples as the offline LLM does with the same bias."""
    prompt = random_text_ids(offline, 10)
    greedy = dict(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    def token_ids(completion) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]

    plain = token_ids(openai_client.completions.create(**greedy))
    favoured = random.choice([t for t in range(3, 500) if t not in plain[:2]])
    bias = {plain[0]: -100, plain[1]: -100, favoured: 2.5}
    biased = token_ids(openai_client.completions.create(**greedy, logit_bias={str(t): b for t, b in bias.items()}))
    offline_out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                            logit_bias=bias))[0].outputs[0].token_ids
    assert biased == offline_out and biased != plain and not {plain[0], plain[1]} & set(biased)
    forced = random.randrange(3, 500)
    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, seed=7, logit_bias={str(forced): 100},
                                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                                 logprobs=True)
    assert [c.token for c in chat.choices[0].logprobs.content] == [f"token_id:{forced}"] * 5


def test_priority_scheduling_serves_the_most_urgent_waiting_request_first(start_server):
    """--scheduling-policy priority, one sequence at a time: of two requests queued behind a
    running one, the later-arriving but more urgent one (lower priority value) is served first;
    under the default policy a priority is a 400 (the `server` fixture's BAD_REQUESTS case)."""
    import concurrent.futures
    import time

    srv = start_server("--scheduling-policy", "priority", "--max-num-seqs", "1")
    finished: dict[str, float] = {}

    def complete(name: str, priority: int) -> int:
        resp = post(srv, "/v1/completions", {"prompt": random_ids(8), "max_tokens": 4, "ignore_eos": True,
                                             "priority": priority})
        finished[name] = time.monotonic()
        return resp.status_code

    def waiting() -> float:
        lines = httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
        return float(next(ln for ln in lines if ln.startswith("vllm:num_requests_waiting")).rsplit(" ", 1)[1])

    def wait_until(predicate, what: str) -> None:
        deadline = time.monotonic() + 60
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.01)

    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        # a streamed request holds the engine's only slot until the test leaves its stream (the
        # server then aborts it), so both others are queued, whatever the machine's speed
        longest = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] - 8
        holder = {"prompt": random_ids(8), "max_tokens": longest, "ignore_eos": True, "stream": True, "priority": 0}
        with httpx.stream("POST", srv.url + "/v1/completions", json={"model": MODEL_NAME, **holder}, timeout=60) as s:
            assert s.status_code == 200
            lines = s.iter_lines()  # kept: a dropped iterator closes the stream, and the server aborts it
            next(line for line in lines if line.startswith("data: "))  # it runs
            lazy = pool.submit(complete, "lazy", 10)
            wait_until(lambda: waiting() >= 1, "the first request is queued")
            urgent = pool.submit(complete, "urgent", -10)
            wait_until(lambda: waiting() >= 2, "both requests are queued")
        assert lazy.result() == urgent.result() == 200
    finally:
        pool.shutdown()
    assert finished["urgent"] < finished["lazy"], finished
    assert post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": 2**63}).status_code == 400
