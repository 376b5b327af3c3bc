"""``/score``, ``/rerank`` and ``/classify`` through a real `pagoda serve` over HTTP on loopback:
a BERT cross-encoder's pair scores equal Hugging Face transformers' (the tokenizer's pair, token
types 0 and 1, sigmoid of the one logit) under each of vLLM's names for the two sides and on each
route vLLM serves; rerank sorts by relevance and keeps ``top_n``; a three-label classifier's
/classify equals transformers' softmax with its label names; an embedding server scores pairs by
cosine; what cannot be served is a 4xx in the OpenAI error shape naming the field, the server
serves on and holds nothing afterwards. (No Cohere or Jina client is installed here: httpx speaks
their JSON, which is what those clients send.)"""

from __future__ import annotations

import random

import httpx
import numpy as np
import pytest

from pagoda_daemon.models.tiny import build_tiny_encoder, build_tiny_model
from tests.engine.test_cross_encoders import hf_logits, sigmoid, texts
from tests.engine.test_pooling import reference
from tests.engine.test_token_classifiers import NO, TEMPLATE, YES, last_logits, model_card_prompt
from tests.server.conftest import running

MODEL = "tiny-reranker"
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = str(build_tiny_encoder("bert", tmp_path_factory.mktemp("models") / "reranker", seed=41, num_labels=1))
    with running(path, "--max-num-seqs", "8", "--max-waiting-requests", "8",
                 log_dir=tmp_path_factory.mktemp("logs"), served_name=MODEL) as srv:
        yield srv, path


def _post(srv, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(srv.url + path, json=body, timeout=60)


@pytest.mark.parametrize("first, second", [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                                           ("text_1", "text_2")])
def test_scores_equal_transformers_under_each_name(reranker, first, second):
    srv, path = reranker
    rng = random.Random()
    query, documents = texts(rng, 1, longest=10)[0], texts(rng, 5, longest=25)
    want = sigmoid(hf_logits(path, [query] * 5, documents)[:, 0])
    for route in ("/score", "/v1/score"):
        reply = _post(srv, route, {"model": MODEL, first: query, second: documents})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == list(range(5)) and {d["object"] for d in body["data"]} == {"score"}
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=TOLERANCE, rtol=0)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    # N:N, side by side; the raw logit without the activation
    firsts, seconds = texts(rng, 3, longest=10), texts(rng, 3, longest=25)
    reply = _post(srv, "/score", {first: firsts, second: seconds, "use_activation": False})  # model is optional
    np.testing.assert_allclose([d["score"] for d in reply.json()["data"]], hf_logits(path, firsts, seconds)[:, 0],
                               atol=TOLERANCE, rtol=0)
    srv.wait_idle()


def test_rerank_sorts_and_keeps_top_n(reranker):
    srv, path = reranker
    rng = random.Random()
    query, documents = texts(rng, 1, longest=10)[0], texts(rng, 9, longest=25)
    want = sigmoid(hf_logits(path, [query] * 9, documents)[:, 0])
    order = list(np.argsort(-want, kind="stable"))
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _post(srv, route, {"model": MODEL, "query": query, "documents": documents, "top_n": 4}).json()
        assert [r["index"] for r in body["results"]] == order[:4], (body, want)
        for r in body["results"]:
            assert r["document"] == {"text": documents[r["index"]]}
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=TOLERANCE)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    every = _post(srv, "/rerank", {"query": query, "documents": documents, "return_documents": False}).json()
    assert [r["index"] for r in every["results"]] == order and "document" not in every["results"][0]
    one = _post(srv, "/rerank", {"query": query, "documents": documents[0]}).json()
    assert len(one["results"]) == 1 and one["results"][0]["relevance_score"] == pytest.approx(want[0], abs=TOLERANCE)
    srv.wait_idle()


def test_truncation_of_a_pair(reranker):
    srv, path = reranker
    rng = random.Random()
    query, documents = texts(rng, 1, longest=6)[0], texts(rng, 3, longest=200)
    too_long = _post(srv, "/rerank", {"query": query, "documents": [" ".join(["fox"] * 300)]})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "documents"
    body = _post(srv, "/score", {"queries": query, "documents": documents, "truncate_prompt_tokens": 40,
                                 "use_activation": False}).json()
    want = hf_logits(path, [query] * 3, documents, truncation="longest_first", max_length=40)[:, 0]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=TOLERANCE, rtol=0)
    # each document cut to its first 5 tokens, as vLLM's max_tokens_per_doc
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    # the text up to the end of its 5th token, where the tokenizer's offsets put it (decoding the 5
    # ids is not the same text where a token ends inside a character, as in 東京's bytes); a
    # character whose byte pieces the 5th token splits is left out whole
    def first_five(d: str) -> str:
        offsets = tokenizer(d, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        k = 5
        while 0 < k < len(offsets) and offsets[k][0] < offsets[k - 1][1]:
            k -= 1
        return d if len(offsets) <= 5 else d[: offsets[k - 1][1]] if k else ""

    cut = [first_five(d) for d in documents]
    body = _post(srv, "/score", {"queries": query, "documents": documents, "max_tokens_per_doc": 5,
                                 "use_activation": False}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], hf_logits(path, [query] * 3, cut)[:, 0],
                               atol=TOLERANCE, rtol=0)
    srv.wait_idle()


@pytest.mark.parametrize("route, body, param", [
    ("/score", {"queries": "a"}, "queries"),
    ("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "documents"),
    ("/score", {"queries": [], "documents": "x"}, "text_1"),
    ("/score", {"queries": "a", "documents": "b", "text_1": "c"}, "text_1"),
    ("/score", {"queries": "a", "documents": [1, 2]}, "text_2"),
    ("/score", {"queries": "a", "documents": ["ok"] * 2049}, "text_2"),
    ("/score", {"queries": "a", "documents": ["ok"] * 17}, "documents"),  # more than the server ever holds
    ("/score", {"text_1": "a", "text_2": ["ok"] * 17}, "text_2"),
    ("/rerank", {"query": "a", "documents": ["ok"] * 17}, "documents"),
    ("/score", {"queries": "a", "documents": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/score", {"queries": "a", "documents": "b", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/score", {"queries": "a", "documents": "b", "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    ("/score", {"queries": "a", "documents": "b", "max_tokens_per_query": 256}, "max_tokens_per_query"),
    ("/score", {"queries": "a", "documents": "b", "use_activation": "yes"}, "use_activation"),
    ("/score", {"queries": "a", "documents": "b", "priority": 2}, "priority"),
    ("/score", {"queries": "a", "documents": "b", "model": "other"}, "model"),
    ("/score", {"queries": "a", "documents": "b", "instruction": "x"}, "instruction"),  # no score template here
    ("/score", {"queries": "a", "documents": "b", "instruction": ""}, "instruction"),
    ("/score", {"queries": "a", "documents": "b", "instruction": 7}, "instruction"),
    ("/rerank", {"query": "a", "documents": ["b"], "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
    ("/rerank", {"query": "a", "documents": ["b"], "chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs.tools"),
    ("/rerank", {"query": "a", "documents": ["b"], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/score", b'{"queries": "\\ud800", "documents": "b"}', "queries"),
    ("/score", b'{"queries": "a", "documents": ["b", "\\udfff"]}', "documents.1"),
    ("/score", b'{"queries": ["a", "\\ud800"], "documents": ["b", "c"]}', "queries.1"),
    ("/rerank", {"query": "a", "documents": ["b", "c", "fox " * 300]}, "documents.2"),  # past the context
    ("/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": 2**64}, "top_n"),
    ("/rerank", {"query": "a", "documents": {"text": "b"}}, "documents"),
    ("/rerank", {"documents": ["b"]}, "query"),
    ("/classify", {"input": ""}, "input"),
    ("/classify", {"input": [[1, 2], [10**6]]}, "input.1"),
    ("/classify", {"input": "a", "use_activation": 1}, "use_activation"),
])
def test_what_cannot_be_served_is_a_400(reranker, route, body: dict | bytes, param):
    srv, _ = reranker
    reply = _post(srv, route, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    ok = _post(srv, "/rerank", {"query": "still", "documents": ["serving"], "unknown_field": 1})
    assert ok.status_code == 200 and len(ok.json()["results"]) == 1


def test_routes_of_other_tasks_are_404s(reranker, server):
    srv, _ = reranker
    for route, body in (("/v1/embeddings", {"model": MODEL, "input": "hi"}),
                        ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        reply = _post(srv, route, body)
        assert reply.status_code == 404 and "/rerank" in reply.json()["error"]["message"], reply.text
    for route in ("/score", "/rerank", "/classify", "/v1/rerank"):  # a generating server
        reply = _post(server, route, {"query": "a", "documents": ["b"], "input": "c"})
        assert reply.status_code == 404 and "--runner pooling" in reply.json()["error"]["message"]
    srv.wait_idle()


def test_classify_with_labels(tmp_path):
    path = str(build_tiny_encoder("bert", tmp_path / "sentiment", seed=42, num_labels=3,
                                  id2label={0: "negative", 1: "neutral", 2: "positive"}))
    with running(path, log_dir=tmp_path, served_name="tiny-sentiment") as srv:
        rng = random.Random()
        batch = texts(rng, 5)
        logits = hf_logits(path, batch)
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        body = _post(srv, "/classify", {"model": "tiny-sentiment", "input": batch}).json()
        assert body["object"] == "list" and body["id"].startswith("classify-")
        for d, p in zip(body["data"], probs, strict=True):
            np.testing.assert_allclose(d["probs"], p, atol=TOLERANCE, rtol=0)
            assert d["num_classes"] == 3 and d["label"] == ("negative", "neutral", "positive")[int(np.argmax(p))]
        scored = _post(srv, "/score", {"queries": "a", "documents": "b"})
        assert scored.status_code == 400 and "one label" in scored.json()["error"]["message"]
        srv.wait_idle()


def test_an_embedding_server_scores_by_cosine(tmp_path):
    from transformers import AutoTokenizer

    path = str(build_tiny_encoder("bert", tmp_path / "embed", seed=43, pooling="mean", normalize=True))
    with running(path, "--max-num-seqs", "8", "--max-waiting-requests", "8",
                 log_dir=tmp_path, served_name="tiny-embed") as srv:
        rng = random.Random()
        query, documents = texts(rng, 1)[0], texts(rng, 4)
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = [tokenizer(t).input_ids for t in [query, *documents]]
        vectors = reference(path, ids, "mean", True)
        want = [float(vectors[0] @ v) for v in vectors[1:]]
        body = _post(srv, "/rerank", {"query": query, "documents": documents}).json()
        assert sorted(r["index"] for r in body["results"]) == [0, 1, 2, 3]
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert body["usage"]["prompt_tokens"] == sum(len(ids[0]) + len(i) for i in ids[1:])
        assert _post(srv, "/classify", {"input": "hi"}).status_code == 404
        cut = _post(srv, "/rerank", b'{"query": "a", "documents": ["b", "\\ud800"], "max_tokens_per_doc": 2}')
        assert cut.status_code == 400 and cut.json()["error"]["param"] == "documents.1", cut.text
        many = _post(srv, "/rerank", {"query": "a", "documents": ["ok"] * 16})  # 17 texts, more than it holds
        assert many.status_code == 400 and many.json()["error"]["param"] == "documents", many.text
        srv.wait_idle()


def test_qwen3_reranker_served_as_vllm_serves_it(tmp_path):
    """The original Qwen3-Reranker layout behind `pagoda serve --hf-overrides ... --chat-template`:
    /rerank's scores equal the model card's reading of transformers' causal LM, with the default
    instruction and with a request's own; a pair past the context is a 400 naming its document,
    truncation cuts the document (a 400 where the template alone is past the limit)."""
    import json

    from transformers import AutoTokenizer

    path = str(build_tiny_model("qwen3", tmp_path / "qwen3-reranker", seed=54))
    tokens = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens([NO, YES])
    overrides = json.dumps({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
                            "is_original_qwen3_reranker": True})
    with running(path, "--hf-overrides", overrides, "--chat-template", TEMPLATE, "--max-model-len", "512",
                 log_dir=tmp_path, served_name="qwen3-reranker") as srv:
        rng = random.Random()
        query, documents = " ".join(texts(rng, 1, longest=10)), texts(rng, 5, longest=25)
        for instruction in (None, "find the cats"):
            extra = {"instruction": instruction} if instruction else {}
            body = _post(srv, "/rerank", {"query": query, "documents": documents, **extra}).json()
            prompts = [model_card_prompt(query, d, *([instruction] if instruction else [])) for d in documents]
            logits = last_logits(path, prompts, [NO, YES])
            want = np.exp(logits[:, 1]) / np.exp(logits).sum(-1)
            assert len(body["results"]) == 5, body
            for r in body["results"]:
                assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=TOLERANCE)
        # chat_template_kwargs set the same variable, and win over instruction (vLLM's order)
        both = _post(srv, "/score", {"queries": query, "documents": documents[:1], "instruction": "ignored",
                                     "chat_template_kwargs": {"instruction": "find the cats"}}).json()
        assert both["data"][0]["score"] == pytest.approx(want[0], abs=TOLERANCE)
        long = _post(srv, "/rerank", {"query": query, "documents": ["a", "fox " * 300]})  # past the context
        assert long.status_code == 400 and long.json()["error"]["param"] == "documents.1", long.text
        tight = _post(srv, "/rerank", {"query": query, "documents": ["a"], "truncate_prompt_tokens": 40})
        assert tight.status_code == 400 and tight.json()["error"]["param"] == "truncate_prompt_tokens", tight.text
        assert "no room for the document" in tight.json()["error"]["message"]
        cut = _post(srv, "/rerank", {"query": query, "documents": ["fox " * 300], "truncate_prompt_tokens": -1})
        assert cut.status_code == 200 and 400 < cut.json()["usage"]["prompt_tokens"] <= 512, cut.text
        srv.wait_idle()
