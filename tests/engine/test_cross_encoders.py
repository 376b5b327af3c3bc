"""Cross-encoders and sequence classifiers (``BertForSequenceClassification``,
``XLMRobertaForSequenceClassification``, and the decoders' ``Qwen3ForSequenceClassification`` and
``LlamaForSequenceClassification``) through the engine: a pair's score and a text's label
scores equal Hugging Face transformers' (AutoModelForSequenceClassification on the same weights,
the pair made by the same tokenizer, BERT's second text in token type 1) through the activation
the config implies; truncation keeps the pair's special tokens as sentence-transformers'
CrossEncoder does; an embedding model scores a pair by the cosine of its two vectors; tensor
parallel size 2 on gloo; what a classifier cannot serve is refused with the reason; nothing is
left behind."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pagoda_daemon import LLM
from pagoda_daemon.models.bert import BertForSequenceClassification, XLMRobertaForSequenceClassification
from pagoda_daemon.models.tiny import build_tiny_embedding_model, build_tiny_encoder, build_tiny_model
from pagoda_daemon.pooling import classifier_activation, resolve_runner
from tests.engine.test_pooling import reference
from tests.processes import warm_start_method

ENGINE = dict(dtype="float32", device="cpu", block_size=16)
TOLERANCE = 2e-5  # float32 on both sides
# up to 6 tokens a word in the tiny tokenizers: a query of 10 words and a document of 25 fit the
# 256-token context as a pair
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "Paris", "sleeps", "under",
         "東京", "rain,", "déjà", "vu", "of", "42", "cats", "and", "seven", "bridges")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cross-encoders")
    return {
        "bert-1": str(build_tiny_encoder("bert", root / "bert-1", seed=31, num_labels=1)),
        "xlmr-1": str(build_tiny_encoder("xlm-roberta", root / "xlmr-1", seed=32, num_labels=1)),
        "bert-3": str(build_tiny_encoder("bert", root / "bert-3", seed=33, num_labels=3,
                                         id2label={0: "negative", 1: "neutral", 2: "positive"})),
    }


def texts(rng: random.Random, n: int, longest: int = 10, shortest: int = 1) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest))) for _ in range(n)]


def hf_logits(path: str, firsts: list[str], seconds: list[str] | None = None, **tokenize) -> np.ndarray:
    """transformers' logits, one pair (or text) at a time, token types as the tokenizer gives them."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for i, first in enumerate(firsts):
            args = (first,) if seconds is None else (first, seconds[i])
            encoded = tokenizer(*args, return_tensors="pt", return_token_type_ids=True, **tokenize)
            kinds = getattr(model.config, "type_vocab_size", None)
            if kinds is None:  # a decoder: no token types
                del encoded["token_type_ids"]
            elif kinds == 1:
                encoded["token_type_ids"].zero_()
            rows.append(model(**encoded).logits[0].numpy())
    return np.array(rows)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def assert_nothing_left(llm: LLM) -> None:
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0
    last = llm.classify([[5, 6, 7]])[0].request_id
    runner = core.executor.worker.runner
    assert set(runner.requests) <= {last}
    assert runner.pooler._partial == {}


@pytest.mark.parametrize("name, pieces", [("bert-1", False), ("xlmr-1", False), ("bert-1", True)])
def test_pair_scores_equal_transformers(models, name, pieces):
    """1:N and N:N, with the activation (sigmoid for one label) and without it; ``pieces``:
    steps padded and run piece by piece, the buffers a GPU's piecewise graphs read (token types
    included)."""
    path = models[name]
    llm = LLM(path, **ENGINE, pad_eager_steps=pieces)
    assert (llm.engine.core.executor.worker.runner.piecewise is not None) == pieces
    pooling = llm.engine.pooling
    assert pooling.classifies and pooling.type == "cls" and pooling.activation == "sigmoid"
    rng = random.Random()
    query, documents = texts(rng, 1)[0], texts(rng, 7, longest=25)
    want = hf_logits(path, [query] * len(documents), documents)[:, 0]
    got = [o.outputs.score for o in llm.score(query, documents)]
    np.testing.assert_allclose(got, sigmoid(want), atol=TOLERANCE, rtol=0)
    firsts, seconds = texts(rng, 5), texts(rng, 5, longest=25)
    raw = [o.outputs.score for o in llm.score(firsts, seconds, use_activation=False)]
    np.testing.assert_allclose(raw, hf_logits(path, firsts, seconds)[:, 0], atol=TOLERANCE, rtol=0)
    # the pair's token types reached the model: the same ids in one segment score otherwise
    if name == "bert-1":
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(path)(firsts[0], seconds[0]).input_ids
        one_segment = llm.classify([ids], use_activation=False)[0].outputs.probs[0]
        assert abs(one_segment - raw[0]) > 1e-4
    assert_nothing_left(llm)


def test_truncation_keeps_the_pair_special_tokens(models):
    """truncate_prompt_tokens cuts the longer text first, as the tokenizer's longest_first does
    (sentence-transformers' CrossEncoder); too small a budget for a pair is refused."""
    path = models["bert-1"]
    llm = LLM(path, **ENGINE)
    rng = random.Random()
    query, documents = texts(rng, 1, longest=8)[0], texts(rng, 4, longest=80)  # cut to 24 tokens
    got = [o.outputs.score for o in llm.score(query, documents, truncate_prompt_tokens=24, use_activation=False)]
    want = hf_logits(path, [query] * 4, documents, truncation="longest_first", max_length=24)[:, 0]
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    assert all(len(o.prompt_token_ids) <= 24 for o in llm.score(query, documents, truncate_prompt_tokens=24))
    with pytest.raises(ValueError, match="leaves no room for a pair"):
        llm.score(query, documents, truncate_prompt_tokens=4)
    with pytest.raises(ValueError, match="more than the model's context"):
        llm.score(query, " ".join(["fox"] * 300))
    assert_nothing_left(llm)


def test_labels_and_softmax(models):
    """Three labels: softmax over them by default (vLLM's and transformers' single-label rule)."""
    path = models["bert-3"]
    llm = LLM(path, **ENGINE)
    assert llm.engine.pooling.labels == ("negative", "neutral", "positive")
    rng = random.Random()
    batch = texts(rng, 6, longest=40)
    logits = hf_logits(path, batch)
    probs = np.array([o.outputs.probs for o in llm.classify(batch)])
    np.testing.assert_allclose(probs, torch.softmax(torch.from_numpy(logits), -1).numpy(), atol=TOLERANCE, rtol=0)
    raw = np.array([o.outputs.probs for o in llm.classify(batch, use_activation=False)])
    np.testing.assert_allclose(raw, logits, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.embed("a")
    assert_nothing_left(llm)


def test_activation_from_the_config(tmp_path):
    class Config:
        num_labels = 1
        problem_type = None

    config = Config()
    assert classifier_activation(config) == "sigmoid"
    config.sentence_transformers = {"activation_fn": "torch.nn.modules.linear.Identity"}
    assert classifier_activation(config) == "none"
    config.problem_type = "regression"
    assert classifier_activation(config) == "none"
    config.problem_type, config.num_labels = "multi_label_classification", 4
    assert classifier_activation(config) == "sigmoid"
    config.problem_type = None
    config.sentence_transformers = {"activation_fn": "os.system"}
    with pytest.raises(ValueError, match="not served"):
        classifier_activation(config)
    # an Identity CrossEncoder (raw scores) end to end
    path = build_tiny_encoder("bert", tmp_path / "identity", seed=34, num_labels=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(cfg))
    got = LLM(str(path), **ENGINE).score("the fox", ["a dog", "Paris"])
    np.testing.assert_allclose([o.outputs.score for o in got], hf_logits(str(path), ["the fox"] * 2,
                                                                        ["a dog", "Paris"])[:, 0], atol=TOLERANCE)


def test_an_embedding_model_scores_by_cosine(tmp_path):
    """vLLM's bi-encoder scoring: the cosine of the two texts' vectors (1:N)."""
    from transformers import AutoTokenizer

    path = str(build_tiny_encoder("bert", tmp_path / "embed", seed=35, pooling="mean", normalize=False))
    llm = LLM(path, **ENGINE)
    rng = random.Random()
    query, documents = texts(rng, 1)[0], texts(rng, 5)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vectors = reference(path, [tokenizer(t).input_ids for t in [query, *documents]], "mean", False)
    want = [float(vectors[0] @ v / np.linalg.norm(vectors[0]) / np.linalg.norm(v)) for v in vectors[1:]]
    got = llm.score(query, documents)
    np.testing.assert_allclose([o.outputs.score for o in got], want, atol=1e-5)
    with pytest.raises(ValueError, match="1:N or N:N"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="not classes"):
        llm.classify("a")


def test_refusals(models):
    path = models["bert-1"]
    with pytest.raises(ValueError, match="serves classification and scoring"):
        resolve_runner("generate", path, ["BertForSequenceClassification"])
    with pytest.raises(ValueError, match="pools its first token"):
        LLM(path, **ENGINE, pooling_type="mean")
    with pytest.raises(ValueError, match="pools its first token"):
        LLM(path, **ENGINE, pooling_normalize=True)
    with pytest.raises(ValueError, match=r"use LLM\.embed, LLM\.classify or LLM\.score"):
        LLM(path, **ENGINE).generate("hello")


def test_checkpoint_names():
    bert, xlmr = BertForSequenceClassification.checkpoint_name, XLMRobertaForSequenceClassification.checkpoint_name
    assert bert("bert.pooler.dense.weight") == "classifier.dense.weight"
    assert bert("classifier.bias") == "classifier.out_proj.bias"
    assert bert("bert.encoder.layer.0.attention.self.key.bias") == "model.layers.0.self_attn.key.bias"
    assert xlmr("classifier.dense.weight") == "classifier.dense.weight"
    assert xlmr("classifier.out_proj.weight") == "classifier.out_proj.weight"
    assert xlmr("roberta.embeddings.position_ids") is None


def _tensor_parallel(_: int, path: str, firsts: list[str], seconds: list[str], out: str) -> None:
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    np.save(out, np.array([o.outputs.score for o in llm.score(firsts, seconds, use_activation=False)]))


def test_tensor_parallel(models, tmp_path):
    """Two ranks on gloo: the body's heads split, the head replicated on each."""
    path = models["bert-1"]
    rng = random.Random()
    firsts, seconds = texts(rng, 4), texts(rng, 4, longest=25)
    out = str(tmp_path / "scores.npy")
    mp.start_processes(_tensor_parallel, args=(path, firsts, seconds, out), nprocs=1, start_method=warm_start_method())
    np.testing.assert_allclose(np.load(out), hf_logits(path, firsts, seconds)[:, 0], atol=TOLERANCE, rtol=0)


def test_a_causal_embedding_model_scores_too(tmp_path):
    """The cosine path does not depend on the encoder: a Qwen3 embedding body scores pairs."""
    path = str(build_tiny_embedding_model("qwen3", tmp_path / "qwen3", seed=36))
    got = LLM(path, **ENGINE).score("the fox", ["the fox", "a lazy dog"])
    assert got[0].outputs.score == pytest.approx(1.0, abs=1e-5) and got[1].outputs.score < 1.0


@pytest.mark.parametrize("arch, config", [("qwen3", {}), ("llama", {"max_num_batched_tokens": 32})],
                         ids=["qwen3-whole", "llama-chunked-32"])
def test_decoder_classifiers_equal_transformers(tmp_path, arch, config):
    """A decoder's score head on its last token: three labels through softmax, one label's pair
    scores (the tokenizer's pair, no token types), whole and in chunks of 32 tokens, with pairs
    that share a query reading it from the prefix cache."""
    path = str(build_tiny_model(arch, tmp_path / "three", seed=37, num_labels=3))
    llm = LLM(path, **ENGINE, **config)
    pooling = llm.engine.pooling
    assert pooling.classifies and pooling.type == "last" and pooling.activation == "softmax"
    rng = random.Random()
    batch = texts(rng, 6, longest=60)
    logits = hf_logits(path, batch)
    probs = np.array([o.outputs.probs for o in llm.classify(batch)])
    np.testing.assert_allclose(probs, torch.softmax(torch.from_numpy(logits), -1).numpy(), atol=TOLERANCE, rtol=0)
    del llm
    path = str(build_tiny_model(arch, tmp_path / "one", seed=38, num_labels=1))
    llm = LLM(path, **ENGINE, **config)
    # a query of blocks: 18 words or more, so that its first 16-token block holds the query alone
    # (a query of one word six times could end inside the first block: no block shared, no hit)
    query, documents = " ".join(texts(rng, 1, longest=10, shortest=3) * 6), texts(rng, 5, longest=25)
    want = hf_logits(path, [query] * 5, documents)[:, 0]
    got = [o.outputs.score for o in llm.score(query, documents, use_activation=False)]
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    assert llm.get_stats().prefix_cache.hits > 0
    with pytest.raises(ValueError, match="is a sequence classifier"):
        resolve_runner("generate", path, ["Qwen3ForSequenceClassification"])
    with pytest.raises(ValueError, match="pools its last token"):
        LLM(path, **ENGINE, pooling_type="cls")
    assert_nothing_left(llm)
