"""Embeddings on a CUDA device, on the default GPU path (Triton kernels, piecewise CUDA graphs for
steps with prompts, async scheduling, padded eager steps): float32 vectors (TF32 off) against
Hugging Face transformers' AutoModel on the same device for last-token, mean and first-token
pooling, whole and chunked, and for the encoders (BERT, XLM-RoBERTa: bidirectional attention on the
Triton varlen kernel); bfloat16 vectors against the float32 reference by cosine. Cross-encoders
(BERT's pairs in two token types, read by the piecewise graphs from their buffer; XLM-RoBERTa)
and decoder classifiers (Qwen3, Llama: the score head on the last token, a shared query read from
the prefix cache): pair scores against AutoModelForSequenceClassification. The original
Qwen3-Reranker layout (hf_overrides and a score template) against the causal LM's yes/no logits.

Skipped without a GPU (CI); run on the GPU machine by `benchmarks/run_gpu.sh pooling-tests`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagoda_daemon import LLM
from pagoda_daemon.models.tiny import build_tiny_model
from tests.engine import test_cross_encoders
from tests.engine.test_cross_encoders import hf_logits, models, texts  # noqa: F401
from tests.engine.test_encoders import encoders, prompts_up_to  # noqa: F401
from tests.engine.test_pooling import assert_nothing_left, embedding_models, random_prompts, reference  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ENGINE = dict(device="cuda", block_size=16, max_model_len=256, gpu_memory_utilization=0.3)


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 32}], ids=["whole", "chunked-32"])
@pytest.mark.parametrize("name, pooling, normalize", [("qwen3-last", "last", True), ("llama-mean", "mean", False),
                                                      ("qwen3-cls-causal", "cls", True)])
def test_vectors_equal_transformers_on_cuda(embedding_models, name, pooling, normalize, config):  # noqa: F811
    torch.backends.cuda.matmul.allow_tf32 = False
    path = embedding_models[name]
    prompts = random_prompts(random.Random(), 24)
    want = reference(path, prompts, pooling, normalize)  # on the CPU, float32
    llm = LLM(path, dtype="float32", **ENGINE, **config)
    assert llm.engine.core.worker_info.attention_backend != "torch"
    runner = llm.engine.core.executor.worker.runner
    assert runner.piecewise is not None and runner.cuda_graphs is None  # prompt steps replay graphs; none decodes
    for got, w in zip(llm.embed(prompts), want, strict=True):
        np.testing.assert_allclose(got.outputs.embedding, w, atol=2e-4, rtol=0)
    assert_nothing_left(llm)
    del llm
    half = LLM(path, dtype="bfloat16", **ENGINE, **config)
    for got, w in zip(half.embed(prompts), want, strict=True):
        g = np.asarray(got.outputs.embedding)
        assert float(g @ w) / (np.linalg.norm(g) * np.linalg.norm(w)) > 0.995


@pytest.mark.parametrize("name, pooling, normalize", [("bert-cls", "cls", True), ("xlmr-mean", "mean", False)])
def test_encoder_vectors_equal_transformers_on_cuda(encoders, name, pooling, normalize):  # noqa: F811
    torch.backends.cuda.matmul.allow_tf32 = False
    path = encoders[name]
    prompts = prompts_up_to(random.Random(), 32, 256)
    want = reference(path, prompts, pooling, normalize)
    engine = dict(ENGINE, max_model_len=256)
    llm = LLM(path, dtype="float32", **engine)
    assert llm.engine.core.worker_info.attention_backend != "torch"
    runner = llm.engine.core.executor.worker.runner
    assert runner.piecewise is not None and runner.piecewise.graphs
    for got, w in zip(llm.embed(prompts), want, strict=True):
        np.testing.assert_allclose(got.outputs.embedding, w, atol=2e-4, rtol=0)
    assert_nothing_left(llm)
    del llm
    half = LLM(path, dtype="bfloat16", **engine)
    for got, w in zip(half.embed(prompts), want, strict=True):
        g = np.asarray(got.outputs.embedding)
        assert float(g @ w) / (np.linalg.norm(g) * np.linalg.norm(w)) > 0.995


@pytest.mark.parametrize("name", ["bert-1", "xlmr-1"])
def test_cross_encoder_scores_equal_transformers_on_cuda(models, name):  # noqa: F811
    torch.backends.cuda.matmul.allow_tf32 = False
    path = models[name]
    rng = random.Random()
    firsts, seconds = texts(rng, 40), texts(rng, 40, longest=25)
    want = hf_logits(path, firsts, seconds)[:, 0]
    llm = LLM(path, dtype="float32", **ENGINE)
    runner = llm.engine.core.executor.worker.runner
    assert runner.piecewise is not None and runner.piecewise.graphs
    got = [o.outputs.score for o in llm.score(firsts, seconds, use_activation=False)]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    del llm
    half = LLM(path, dtype="bfloat16", **ENGINE)
    got = np.array([o.outputs.score for o in half.score(firsts, seconds, use_activation=False)])
    assert np.corrcoef(got, want)[0, 1] > 0.99


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_decoder_classifier_scores_equal_transformers_on_cuda(tmp_path, arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(build_tiny_model(arch, tmp_path / arch, seed=39, num_labels=1))
    rng = random.Random()
    query, documents = " ".join(texts(rng, 1, longest=10) * 6), texts(rng, 24, longest=25)  # a query of blocks
    want = hf_logits(path, [query] * len(documents), documents)[:, 0]
    llm = LLM(path, dtype="float32", **ENGINE)
    assert llm.engine.core.worker_info.attention_backend != "torch"
    got = [o.outputs.score for o in llm.score(query, documents, use_activation=False)]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    assert llm.get_stats().prefix_cache.hits > 0
    test_cross_encoders.assert_nothing_left(llm)
    del llm
    half = LLM(path, dtype="bfloat16", **ENGINE)
    got = np.array([o.outputs.score for o in half.score(query, documents, use_activation=False)])
    assert np.corrcoef(got, want)[0, 1] > 0.99


def test_qwen3_reranker_layout_on_cuda(tmp_path):
    """The original Qwen3-Reranker layout (a causal LM with tied embeddings) served through
    hf_overrides and the score template: scores equal the model card's reading of transformers'
    causal LM on the same GPU."""
    from transformers import AutoTokenizer

    from tests.engine.test_token_classifiers import NO, TEMPLATE, YES, last_logits, model_card_prompt

    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(build_tiny_model("qwen3", tmp_path / "qwen3-reranker", seed=55))
    tokens = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens([NO, YES])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
                 "is_original_qwen3_reranker": True}
    rng = random.Random()
    query, documents = " ".join(texts(rng, 1, longest=10)), texts(rng, 16, longest=25)
    logits = last_logits(path, [model_card_prompt(query, d) for d in documents], [NO, YES])
    want = logits[:, 1] - logits[:, 0]
    engine = dict(ENGINE, max_model_len=1024)  # the template alone is about 240 of the tiny tokenizer's tokens
    llm = LLM(path, dtype="float32", **engine, hf_overrides=overrides, chat_template=TEMPLATE)
    got = [o.outputs.score for o in llm.score(query, documents, use_activation=False)]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    assert llm.get_stats().prefix_cache.hits > 0
    del llm
    half = LLM(path, dtype="bfloat16", **engine, hf_overrides=overrides, chat_template=TEMPLATE)
    got = np.array([o.outputs.score for o in half.score(query, documents, use_activation=False)])
    assert np.corrcoef(got, want)[0, 1] > 0.99
