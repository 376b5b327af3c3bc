"""``POST /v1/embeddings`` through a real `pagoda serve` and the openai client: the vectors equal
Hugging Face transformers' (AutoModel, pooled as the model's sentence-transformers config says)
whether the client asks for base64 (its default) or floats; batches of texts and of token ids
come back in order with their usage; what cannot be served is a 4xx in the OpenAI error shape
and the server serves on, holding nothing afterwards; a pooling server does not generate and a
generating server serves no embeddings (404s, as vLLM serves only its runner's routes)."""

from __future__ import annotations

import base64
import random

import httpx
import numpy as np
import pytest

from pagoda_daemon.models.tiny import build_tiny_embedding_model
from tests.engine.test_pooling import TOLERANCE, reference
from tests.server.conftest import running
from tests.server.test_observability import scrape

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    path = str(build_tiny_embedding_model("qwen3", tmp_path_factory.mktemp("models") / "embed", seed=21))
    with running(path, "--max-model-len", "128", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
                 "--max-waiting-requests", "8",
                 log_dir=tmp_path_factory.mktemp("logs"), served_name=MODEL) as srv:
        yield srv, path


def _client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(srv, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_vectors_equal_transformers_through_the_openai_client(embedding_server):
    srv, path = embedding_server
    client = _client(srv)
    rng = random.Random()
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 128))] for _ in range(9)]
    want = reference(path, prompts, "last", True)
    default = client.embeddings.create(model=MODEL, input=prompts)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    for reply in (default, floats):
        assert [d.index for d in reply.data] == list(range(len(prompts)))
        for d, w in zip(reply.data, want, strict=True):
            np.testing.assert_allclose(np.asarray(d.embedding), w, atol=TOLERANCE, rtol=0)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, prompts))
        assert reply.model == MODEL and reply.object == "list"
    raw = _post(srv, {"model": MODEL, "input": prompts[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, want[0], atol=TOLERANCE, rtol=0)
    # texts as the model's tokenizer makes them; normalize off (vLLM's field)
    from transformers import AutoTokenizer

    texts = ["The capital of France is", "déjà vu 東京 🚀"]
    ids = [AutoTokenizer.from_pretrained(path).encode(t) for t in texts]
    reply = _post(srv, {"model": MODEL, "input": texts, "normalize": False, "encoding_format": "float"}).json()
    for d, w in zip(reply["data"], reference(path, ids, "last", False), strict=True):
        np.testing.assert_allclose(np.asarray(d["embedding"]), w, atol=TOLERANCE, rtol=0)
    assert reply["usage"]["prompt_tokens"] == sum(map(len, ids))
    srv.wait_idle()


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1, -1]}, "input"),
    ({"input": [[1, 2], [600]]}, "input.1"),
    ({"input": ["ok"] * 2049}, "input"),
    ({"input": ["ok"] * 17}, "input"),  # more than the server ever holds (8 running + 8 waiting)
    ({"input": 7}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": "hello", "dimensions": 8}, "dimensions"),
    ({"input": "hello", "dimensions": 0}, "dimensions"),
    ({"input": "hello", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "hello", "normalize": "yes"}, "normalize"),
    ({"input": "hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "hello", "priority": 3}, "priority"),
    ({"input": "hello", "model": "other"}, "model"),
    ({"input": list(range(3, 132))}, "input"),  # 129 tokens: past the 128-token context
])
def test_what_cannot_be_served_is_a_400(embedding_server, body, param):
    srv, _ = embedding_server
    reply = _post(srv, {"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    ok = _post(srv, {"model": MODEL, "input": "still serving", "unknown_field": 1})  # unknown fields are ignored
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64



def test_a_conversation_is_embedded_through_the_chat_template(embedding_server):
    """vLLM's chat form: ``messages`` rendered by the model's chat template (no generation
    prompt unless asked, no special tokens added on top), one vector; what cannot be served is a
    400 naming ``messages`` and the server serves on."""
    from transformers import AutoTokenizer

    srv, path = embedding_server
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversation = [{"role": "system", "content": "Represent the question for retrieval."},
                    {"role": "user", "content": "what is the capital of France?"}]
    for prompt in (False, True):
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
        ids = tokenizer.encode(text, add_special_tokens=False)
        body = {"model": MODEL, "messages": conversation, "encoding_format": "float"}
        reply = _post(srv, {**body, "add_generation_prompt": True} if prompt else body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        assert len(data["data"]) == 1 and data["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(data["data"][0]["embedding"], reference(path, [ids], "last", True)[0],
                                   atol=TOLERANCE, rtol=0)
    for bad, param in (({"messages": []}, "messages"),
                       ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
                       ({"messages": conversation, "input": "hi"}, "messages"),
                       ({"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),
                       ({"messages": conversation, "chat_template": "{{ 1 }}"}, "chat_template"),
                       ({"messages": conversation, "continue_final_message": True, "add_generation_prompt": True},
                        "continue_final_message")):
        reply = _post(srv, {"model": MODEL, **bad})
        assert reply.status_code == 400, (bad, reply.text)
        assert reply.json()["error"]["param"] == param, reply.json()
    assert _post(srv, {"model": MODEL, "input": "still serving"}).status_code == 200
    srv.wait_idle()

def test_truncation_and_a_whole_context(embedding_server):
    srv, path = embedding_server
    ids = [random.randrange(3, 500) for _ in range(140)]
    reply = _post(srv, {"model": MODEL, "input": ids, "truncate_prompt_tokens": 128, "encoding_format": "float"})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 128
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"], reference(path, [ids[-128:]], "last", True)[0],
                               atol=TOLERANCE, rtol=0)
    assert _post(srv, {"model": MODEL, "input": ids[:128]}).status_code == 200  # the whole context, nothing after it
    srv.wait_idle()


def test_a_pooling_server_does_not_generate(embedding_server):
    srv, _ = embedding_server
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                                                               {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/responses", {"input": "hi"})):
        reply = _post(srv, {"model": MODEL, **body}, route)
        assert reply.status_code == 404 and "embeddings" in reply.json()["error"]["message"]


def test_metrics_count_each_input(embedding_server):
    srv, _ = embedding_server
    srv.wait_idle()

    def get(values, name: str, **labels) -> float:
        return sum(v for (n, keys), v in values.items() if n == name and {("model_name", MODEL), *labels.items()}
                   <= set(keys))

    before = scrape(srv.url)
    inputs = [[random.randrange(3, 500) for _ in range(random.randint(1, 60))] for _ in range(3)]
    assert _post(srv, {"model": MODEL, "input": inputs}).status_code == 200
    srv.wait_idle()
    after = scrape(srv.url)
    assert get(after, "vllm:prompt_tokens_total") - get(before, "vllm:prompt_tokens_total") == sum(map(len, inputs))
    assert get(after, "vllm:request_success_total", finished_reason="stop") - \
        get(before, "vllm:request_success_total", finished_reason="stop") == 3
    assert get(after, "vllm:generation_tokens_total") == get(before, "vllm:generation_tokens_total")
    assert get(after, "vllm:e2e_request_latency_seconds_count") - \
        get(before, "vllm:e2e_request_latency_seconds_count") == 3


def test_a_generating_server_serves_no_embeddings(server):
    reply = _post(server, {"model": "tiny-llama", "input": "hi"})
    assert reply.status_code == 404 and "--runner pooling" in reply.json()["error"]["message"]


def test_a_pooling_mode_not_served_is_refused_at_start(tmp_path):
    import json
    import subprocess
    import sys

    path = build_tiny_embedding_model("llama", tmp_path / "max", seed=22)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    done = subprocess.run([sys.executable, "-m", "pagoda_daemon", "serve", str(path), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pooling_mode_max_tokens" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_trace_of_an_embeddings_request(tmp_path):
    """One span per request, child of the caller's traceparent, named as OTel's GenAI conventions
    name an embeddings operation, with its input tokens."""
    import time

    from tests.telemetry.test_tracing import Receiver, attrs

    receiver = Receiver()
    path = str(build_tiny_embedding_model("qwen3", tmp_path / "embed", seed=23))
    try:
        with running(path, "--max-model-len", "128", "--otlp-traces-endpoint", receiver.base_url + "/v1/traces",
                     log_dir=tmp_path, served_name=MODEL) as srv:
            trace_id, parent_id = "0af7651916cd43dd8448eb211c80319d", "b7ad6b7169203332"
            reply = httpx.post(srv.url + "/v1/embeddings", json={"model": MODEL, "input": [[5, 6, 7], [8, 9]]},
                               headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}, timeout=60)
            assert reply.status_code == 200
            deadline = time.monotonic() + 20
            spans: list = []
            while time.monotonic() < deadline and not spans:
                spans = [s for _, s in receiver.spans() if s.trace_id.hex() == trace_id]
                time.sleep(0.2)
        assert len(spans) == 1, receiver.spans()
        span = spans[0]
        assert span.name == f"embeddings {MODEL}" and span.parent_span_id.hex() == parent_id
        a = attrs(span.attributes)
        assert a["gen_ai.operation.name"] == "embeddings" and a["gen_ai.usage.input_tokens"] == 5
        assert a["gen_ai.response.id"].startswith("embd-")
    finally:
        receiver.close()


def test_an_encoder_served_through_the_openai_client(tmp_path):
    """A BERT checkpoint (no --runner: an encoder is a pooling model) served as an embedding model
    would be: texts get [CLS] ... [SEP] and their vectors equal transformers' [CLS] pooling; a
    prompt past the position table is a 400 and the server serves on; it generates nothing."""
    from transformers import AutoTokenizer

    from pagoda_daemon.models.tiny import build_tiny_encoder
    from tests.engine.test_encoders import prompts_up_to

    path = str(build_tiny_encoder("bert", tmp_path / "bert", seed=24, pooling="cls"))
    with running(path, "--max-num-seqs", "8", log_dir=tmp_path, served_name="tiny-bert") as srv:
        client = _client(srv)
        texts = ["What is the capital of France?", "Paris is the capital of France.", "x"]
        prompts = prompts_up_to(random.Random(), 6, 256)
        reply = client.embeddings.create(model="tiny-bert", input=texts)
        ids = [AutoTokenizer.from_pretrained(path)(t).input_ids for t in texts]
        for d, w in zip(reply.data, reference(path, ids, "cls", True), strict=True):
            np.testing.assert_allclose(np.asarray(d.embedding), w, atol=TOLERANCE, rtol=0)
        assert reply.usage.prompt_tokens == sum(map(len, ids))
        reply = client.embeddings.create(model="tiny-bert", input=prompts)
        for d, w in zip(reply.data, reference(path, prompts, "cls", True), strict=True):
            np.testing.assert_allclose(np.asarray(d.embedding), w, atol=TOLERANCE, rtol=0)
        too_long = _post(srv, {"model": "tiny-bert", "input": [7] * 257})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input"
        chat = _post(srv, {"model": "tiny-bert", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"  # it has no chat template
        generate = _post(srv, {"model": "tiny-bert", "prompt": "hi"}, "/v1/completions")
        assert generate.status_code == 404
        assert _post(srv, {"model": "tiny-bert", "input": "still serving"}).status_code == 200
        srv.wait_idle()
