"""Encoder embedding models (BERT, XLM-RoBERTa) through the engine: the vectors equal Hugging
Face transformers' on the same weights (AutoModel's last hidden state, pooled as the model's
sentence-transformers config says) for a BERT body checkpoint and an XLM-RoBERTa checkpoint that
carries its masked-LM head; prompts are never split across steps nor read from the prefix cache
(either would change the vectors); tensor parallel size 2 on gloo; and what an encoder cannot
serve is refused with the reason."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pagoda_daemon import LLM
from pagoda_daemon.models.bert import BertModel
from pagoda_daemon.models.loader import WeightLoadError
from pagoda_daemon.models.tiny import build_tiny_encoder
from pagoda_daemon.pooling import resolve_runner
from tests.engine.test_pooling import assert_close, assert_nothing_left, reference
from tests.processes import warm_start_method

ENGINE = dict(dtype="float32", device="cpu", block_size=16)
# the tiny encoders' position tables hold 256 positions (XLM-RoBERTa's 258 less its offset of 2)
MAX_LEN = 256


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        "bert-cls": str(build_tiny_encoder("bert", root / "bert-cls", seed=21, pooling="cls")),
        "xlmr-mean": str(build_tiny_encoder("xlm-roberta", root / "xlmr-mean", seed=22, pooling="mean",
                                            normalize=False)),
    }


def prompts_up_to(rng: random.Random, n: int, longest: int) -> list[list[int]]:
    """Random ids past the special tokens (a pad id would move XLM-RoBERTa's positions), one of a
    single token and one filling the context among them."""
    lengths = [1, longest, *(rng.randint(2, longest) for _ in range(n - 2))]
    return [[rng.randrange(5, 500) for _ in range(length)] for length in lengths]


@pytest.mark.parametrize("name, pooling, normalize", [("bert-cls", "cls", True), ("xlmr-mean", "mean", False)])
def test_vectors_equal_transformers(encoders, name, pooling, normalize):
    path = encoders[name]
    llm = LLM(path, **ENGINE)
    assert llm.engine.core.pooling.type == pooling and llm.engine.core.max_model_len == MAX_LEN
    prompts = prompts_up_to(random.Random(), 12, MAX_LEN)
    assert_close(llm.embed(prompts), reference(path, prompts, pooling, normalize))
    assert_nothing_left(llm)


def test_prompts_come_whole_and_no_prefix_is_reused(encoders):
    """Prompts sharing long prefixes, with a token budget that holds one whole prompt a step
    and two of them waiting for it: each is computed in one step, none from cached blocks."""
    path = encoders["bert-cls"]
    llm = LLM(path, **ENGINE, max_num_batched_tokens=MAX_LEN, max_num_seqs=4)
    core = llm.engine.core
    assert not core.config.enable_chunked_prefill and not core.config.enable_prefix_caching
    rng = random.Random()
    shared = [rng.randrange(5, 500) for _ in range(160)]
    prompts = [shared + [rng.randrange(5, 500) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    assert_close(llm.embed(prompts), reference(path, prompts, "cls", True))
    stats = llm.get_stats()
    assert stats.prefix_cache.hits == 0
    assert stats.num_steps >= len(prompts)  # one whole prompt a step: no two fit the budget
    assert_nothing_left(llm)


def test_text_through_the_tokenizer(encoders):
    """A text gets the tokenizer's [CLS] ... [SEP], as sentence-transformers encodes it."""
    from transformers import AutoTokenizer

    path = encoders["bert-cls"]
    texts = ["The capital of France is Paris.", "déjà vu 東京", "x"]
    ids = [AutoTokenizer.from_pretrained(path)(t).input_ids for t in texts]
    assert all(i[0] == 2 and i[-1] == 3 for i in ids)
    got = LLM(path, **ENGINE).embed(texts)
    assert_close(got, reference(path, ids, "cls", True))


def test_refusals(encoders, tmp_path):
    path = encoders["bert-cls"]
    with pytest.raises(ValueError, match="is an encoder"):
        resolve_runner("generate", path, ["BertModel"])
    assert resolve_runner("auto", path, ["XLMRobertaForMaskedLM"]) == "pooling"
    with pytest.raises(ValueError, match="is an encoder"):
        LLM(path, **ENGINE, runner="generate")
    with pytest.raises(ValueError, match="positions"):
        LLM(path, **ENGINE, max_model_len=MAX_LEN + 1)
    with pytest.raises(ValueError, match="an encoder computes each prompt in one step"):
        LLM(path, **ENGINE, max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="KV offload"):
        LLM(path, **ENGINE, kv_offload_cpu_gib=1.0)
    with pytest.raises(ValueError, match="position_embedding_type"):
        LLM(str(build_tiny_encoder("bert", tmp_path / "relative", position_embedding_type="relative_key")), **ENGINE)
    llm = LLM(path, **ENGINE)
    with pytest.raises(ValueError, match="context of 256 tokens"):
        llm.embed([[7] * (MAX_LEN + 1)])
    assert_nothing_left(llm)


def test_checkpoint_names():
    name = BertModel.checkpoint_name
    assert name("bert.encoder.layer.3.attention.self.query.weight") == "model.layers.3.self_attn.query.weight"
    assert name("encoder.layer.0.attention.output.LayerNorm.gamma") == "model.layers.0.attention_norm.weight"
    assert name("roberta.embeddings.LayerNorm.bias") == "model.embeddings.norm.bias"
    assert name("encoder.layer.1.output.dense.bias") == "model.layers.1.down_proj.bias"
    for head in ("pooler.dense.weight", "cls.predictions.bias", "lm_head.dense.weight", "embeddings.position_ids",
                 "classifier.out_proj.weight"):
        assert name(head) is None


def test_a_missing_tensor_is_named(encoders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(encoders["bert-cls"], path)
    weights = load_file(path / "model.safetensors")
    del weights["encoder.layer.1.intermediate.dense.bias"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.up_proj\.bias"):
        LLM(str(path), **ENGINE)


def _tensor_parallel(_: int, path: str, prompts: list[list[int]], out: str) -> None:
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    np.save(out, np.array([o.outputs.embedding for o in llm.embed(prompts)]))


def test_tensor_parallel(encoders, tmp_path):
    """Two ranks on gloo, each with half the heads and half the intermediate columns."""
    path = encoders["xlmr-mean"]
    prompts = prompts_up_to(random.Random(), 5, 100)
    out = str(tmp_path / "vectors.npy")
    mp.start_processes(_tensor_parallel, args=(path, prompts, out), nprocs=1, start_method=warm_start_method())
    assert_close(list(np.load(out)), reference(path, prompts, "mean", False))
