"""Embeddings through the engine (``LLM.embed``): the vectors equal Hugging Face transformers'
on the same weights (AutoModel's last hidden state, pooled as the model's sentence-transformers
config says), for last-token, mean and first-token pooling, whole prompts and chunked ones,
prefix-cache hits, preemption, tensor parallel size 2 (gloo), a model body without its head
(as Qwen3-Embedding ships) and a whole causal checkpoint; and nothing is left behind."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pagoda_daemon import LLM
from pagoda_daemon.models.tiny import build_tiny_embedding_model
from pagoda_daemon.pooling import EnginePooling, PoolingParams, model_pooling, resolve_runner
from tests.processes import warm_start_method

ENGINE = dict(dtype="float32", device="cpu", block_size=16, max_model_len=256)
TOLERANCE = 2e-5  # float32 on both sides; the sums run in another order


@pytest.fixture(scope="module")
def embedding_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("embedding-models")
    return {
        "qwen3-last": str(build_tiny_embedding_model("qwen3", root / "qwen3-last", seed=11)),
        "llama-mean": str(build_tiny_embedding_model("llama", root / "llama-mean", seed=12, pooling="mean",
                                                     normalize=False)),
        "qwen3-cls-causal": str(build_tiny_embedding_model("qwen3", root / "qwen3-cls", seed=13, pooling="cls",
                                                           body=False)),
    }


def reference(path: str, prompts: list[list[int]], pooling: str, normalize: bool,
              dimensions: int | None = None) -> list[np.ndarray]:
    """What sentence-transformers computes: AutoModel's last hidden state pooled, cut, normalized."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            if dimensions:
                vector = vector[:dimensions]
            if normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            out.append(vector.numpy())
    return out


def random_prompts(rng: random.Random, n: int, low: int = 1, high: int = 120) -> list[list[int]]:
    return [[rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(n)]


def assert_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g = np.asarray(g.outputs.embedding if hasattr(g, "outputs") else g)
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=TOLERANCE, rtol=0)


def assert_nothing_left(llm: LLM) -> None:
    """No request, no block, no partial vector held (the runner forgets a request once told it finished)."""
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0
    last = llm.embed([[5, 6, 7]])[0].request_id  # its step tells the runner of the earlier requests' end
    runner = core.executor.worker.runner
    assert set(runner.requests) <= {last}  # the runner hears of this one's end with the next step
    assert runner.pooler._partial == {}


@pytest.mark.parametrize("name, pooling, normalize", [("qwen3-last", "last", True), ("llama-mean", "mean", False),
                                                      ("qwen3-cls-causal", "cls", True)])
def test_vectors_equal_transformers(embedding_models, name, pooling, normalize):
    """Whole prompts and prompts chunked over several steps (a 32-token budget), in one batch."""
    path = embedding_models[name]
    rng = random.Random()
    prompts = random_prompts(rng, 12)
    want = reference(path, prompts, pooling, normalize)
    for extra in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        llm = LLM(path, **ENGINE, **extra)
        assert llm.engine.pooling == EnginePooling(pooling, normalize, 64)
        assert_close(llm.embed(prompts), want)
        assert_nothing_left(llm)


def test_prefix_cache_hits_and_options(embedding_models):
    """Last-token pooling reads a shared prefix from the cache and still gives the same vectors;
    normalize may be turned off per call; text prompts tokenize as the model's tokenizer does."""
    path = embedding_models["qwen3-last"]
    rng = random.Random()
    prefix = random_prompts(rng, 1, 48, 48)[0]
    prompts = [prefix + p for p in random_prompts(rng, 6, 1, 40)]
    llm = LLM(path, **ENGINE, enable_prefix_caching=True)
    assert_close(llm.embed(prompts[:1]), reference(path, prompts[:1], "last", True))
    before = llm.get_stats().prefix_cache.hits
    assert_close(llm.embed(prompts), reference(path, prompts, "last", True))
    assert llm.get_stats().prefix_cache.hits - before >= 5 * 48  # the later prompts read the prefix from the cache
    assert_close(llm.embed(prompts, normalize=False), reference(path, prompts, "last", False))
    text = "The capital of France is Paris."
    ids = llm.tokenizer.encode(text)
    assert_close(llm.embed(text), reference(path, [ids], "last", True))
    assert_nothing_left(llm)


def test_preemption_keeps_every_vector(embedding_models):
    """A cache of a few blocks, scheduling a step ahead as on a GPU (a finished prompt holds its
    blocks until its vector is back): requests are preempted and computed again, mean pooling
    sums from the start again, and every vector is still the reference's."""
    path = embedding_models["llama-mean"]
    prompts = random_prompts(random.Random(), 8, 90, 110)
    llm = LLM(path, **{**ENGINE, "max_model_len": 128}, num_kv_blocks=10, max_num_batched_tokens=64,
              async_scheduling=True)
    assert_close(llm.embed(prompts), reference(path, prompts, "mean", False))
    assert llm.get_stats().num_preemptions > 0
    assert_nothing_left(llm)


def test_bounds_and_refusals(embedding_models, tiny_models):
    path = embedding_models["qwen3-last"]
    llm = LLM(path, **ENGINE)
    full = random_prompts(random.Random(), 1, 256, 256)[0]
    assert_close(llm.embed([full]), reference(path, [full], "last", True))  # a whole context: nothing follows it
    with pytest.raises(ValueError, match="more than the model's context"):
        llm.embed([[*full, 5]])
    assert_close(llm.embed([[*full, 5, 6]], truncate_prompt_tokens=256), reference(path, [([*full, 5, 6])[2:]],
                                                                                  "last", True))
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed(["hello"], dimensions=8)
    assert llm.embed([]) == []
    for bad in ("", [[]], [600], [[1, 2], [-1]]):
        with pytest.raises(ValueError):
            llm.embed(bad)
    with pytest.raises(ValueError, match=r"LLM\.embed"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(tiny_models["llama"], **ENGINE).embed(["hello"])
    with pytest.raises(ValueError, match="enable_lora does not combine"):
        LLM(path, **ENGINE, enable_lora=True)
    with pytest.raises(ValueError, match="pooling_type and pooling_normalize need runner pooling"):
        LLM(tiny_models["llama"], **ENGINE, runner="generate", pooling_type="mean")
    assert_nothing_left(llm)


def test_matryoshka_dimensions(embedding_models, tmp_path):
    path = Path(build_tiny_embedding_model("qwen3", tmp_path / "mrl", seed=14))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    llm = LLM(str(path), **ENGINE)
    prompts = random_prompts(random.Random(), 4)
    assert_close(llm.embed(prompts, dimensions=16), reference(str(path), prompts, "last", True, 16))
    with pytest.raises(ValueError, match=r"one of \[16, 32, 64\]"):
        llm.embed(prompts, dimensions=20)


def test_pooling_of_a_directory(tmp_path):
    """modules.json and the Pooling config decide; a mode Pagoda does not serve is refused."""
    assert model_pooling(tmp_path).type == "last" and model_pooling(tmp_path).normalize
    assert resolve_runner("auto", tmp_path, ["Qwen3ForCausalLM"]) == "generate"
    assert resolve_runner("auto", tmp_path, ["Qwen3Model"]) == "pooling"
    (tmp_path / "pool").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "pool", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    found = model_pooling(tmp_path)
    assert (found.type, found.normalize) == ("mean", False)
    assert resolve_runner("auto", tmp_path, ["LlamaForCausalLM"]) == "pooling"
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        model_pooling(tmp_path)
    (tmp_path / "modules.json").write_text("not json")
    assert model_pooling(tmp_path).type == "last"


@pytest.mark.parametrize("params", [PoolingParams("max"), PoolingParams(dimensions=0), PoolingParams(dimensions=65),
                                    PoolingParams(dimensions=True), PoolingParams(normalize=1)])  # type: ignore[arg-type]
def test_pooling_params_bounds(params):
    with pytest.raises(ValueError):
        params.check(64)


def _tensor_parallel(_: int, path: str, prompts: list[list[int]], out: str) -> None:
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE, max_num_batched_tokens=32)
    np.save(out, np.array([o.outputs.embedding for o in llm.embed(prompts)]))


def test_tensor_parallel(embedding_models, tmp_path):
    """Two ranks on gloo, each with half the heads: rank 0's vectors are the reference's."""
    path = embedding_models["llama-mean"]
    prompts = random_prompts(random.Random(), 5)
    out = str(tmp_path / "vectors.npy")
    mp.start_processes(_tensor_parallel, args=(path, prompts, out), nprocs=1, start_method=warm_start_method())
    assert_close(list(np.load(out)), reference(path, prompts, "mean", False))
