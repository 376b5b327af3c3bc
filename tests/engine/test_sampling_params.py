"""SamplingParams bounds (shared by the offline LLM, the HTTP API and the engine core), the
input processor's length bound, and the runner's last line of defence against huge values."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.engine.input_processor import InputProcessor, InvalidInput, max_chars_per_token
from pagoda_daemon.models import loader
from pagoda_daemon.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MIN_POSITIVE_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    has_lone_surrogate,
)
from pagoda_daemon.worker.model_runner import torch_seed

INVALID = [
    ("n", 0), ("n", MAX_N + 1), ("n", True), ("n", 2.0),
    ("max_tokens", 0), ("max_tokens", 2**63), ("max_tokens", 3.0),
    ("min_tokens", -1), ("min_tokens", 2**64),
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", math.nan),
    ("seed", SEED_MAX + 1), ("seed", SEED_MIN - 1), ("seed", 2**70), ("seed", 1.0), ("seed", False),
    ("presence_penalty", 2.5), ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1e6), ("repetition_penalty", math.inf),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", True),
    ("stop", [""]), ("stop", ["x"] * 33), ("stop", ["y" * 1025]), ("stop", ["ok\ud800"]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", [2**64]),
    ("stop_token_ids", list(range(1025))),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"),
    ("structured_outputs_after_token_id", -1), ("structured_outputs_after_token_id", 2**64),
    ("structured_outputs_after_token_id", 1.0), ("structured_outputs_after_token_id", True),
    ("structured_outputs_after_token_id", "7"),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {2**64: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", {True: 1.0}),
    ("logit_bias", {1.0: 1.0}), ("logit_bias", {5: math.nan}), ("logit_bias", {5: -math.inf}),
    ("logit_bias", {5: 10**400}), ("logit_bias", {5: "1"}), ("logit_bias", {5: False}), ("logit_bias", {5: None}),
    ("logit_bias", [(5, 1.0)]), ("logit_bias", dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=lambda v: repr(v)[:24])
def test_out_of_bounds_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_beyond_max_tokens_names_min_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens "):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_values_at_the_bounds_are_accepted_with_vllm_semantics():
    assert SamplingParams(seed=SEED_MAX).seed == SEED_MAX
    assert SamplingParams(seed=SEED_MIN).seed == SEED_MIN
    assert SamplingParams(n=MAX_N, logprobs=MAX_LOGPROBS).n == MAX_N
    assert SamplingParams(top_k=-1).top_k == 0  # disabled
    assert SamplingParams(top_k=2**63).top_k == 0  # more than any vocabulary: all of it
    assert SamplingParams(top_k=50).top_k == 50
    assert SamplingParams(temperature=1e-300).temperature == MIN_POSITIVE_TEMPERATURE  # as vLLM clamps it
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(stop=["\U0001f600"]).stop == ["\U0001f600"]
    # logit_bias: clamped to OpenAI's [-100, 100] as vLLM does, ints become floats, empty is none
    assert SamplingParams(logit_bias={3: 1e300, 4: -250, 5: 2, 6: -0.5}).logit_bias == {
        3: 100.0, 4: -100.0, 5: 2.0, 6: -0.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={2**63 - 1: 1.0}).logit_bias == {2**63 - 1: 1.0}  # the vocabulary is checked later


def test_lone_surrogates_are_found_and_pairs_are_not():
    assert has_lone_surrogate("a\ud800b") and has_lone_surrogate("\udfff")
    assert not has_lone_surrogate("plain") and not has_lone_surrogate("smile \U0001f600")


def test_the_runner_seeds_torch_with_any_integer():
    for seed in (0, -1, SEED_MIN, SEED_MAX, 2**64 - 1, 2**64, 2**70, -(2**70)):
        torch.Generator().manual_seed(torch_seed(seed))  # never raises
    assert torch_seed(-5) == -5 and torch_seed(2**64 + 3) == 3


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return loader.load_tokenizer(tiny_models["llama"])


def test_max_chars_per_token_bounds_every_token(tokenizer):
    bound = max_chars_per_token(tokenizer)
    assert bound == max(len(t) for t in tokenizer.get_vocab())
    for text in ("The capital of France is Paris. " * 20, "x" * 500, " " * 300, "\u00e9\u4e2d\U0001f600" * 50):
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= len(text) / bound


def test_a_text_too_long_for_the_context_is_refused_without_tokenizing(tokenizer):
    class CountingTokenizer:
        """The real tokenizer, counting encode calls."""

        def __init__(self) -> None:
            self.calls = 0
            self.backend_tokenizer = tokenizer.backend_tokenizer

        def get_vocab(self):
            return tokenizer.get_vocab()

        def encode(self, text, **kw):
            self.calls += 1
            return tokenizer.encode(text, **kw)

    counting = CountingTokenizer()
    proc = InputProcessor(counting, len(tokenizer), max_model_len=64)
    with pytest.raises(InvalidInput) as e:
        proc.process("word " * 10_000_000, SamplingParams(max_tokens=1))
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt" and counting.calls == 0
    with pytest.raises(InvalidInput):  # near the bound: tokenized, then refused by its token count
        proc.process("ab" * (64 * proc.max_chars_per_token // 2 - 1), SamplingParams(max_tokens=1))
    assert counting.calls == 1
    with pytest.raises(InvalidInput, match="surrogate"):
        proc.process("bad \ud800", SamplingParams(max_tokens=1))
    with pytest.raises(InvalidInput) as e:
        proc.process("hello", SamplingParams(max_tokens=None, min_tokens=100))
    assert e.value.param == "min_tokens"
    with pytest.raises(InvalidInput, match="integers"):
        proc.process([1, True, 3], SamplingParams(max_tokens=1))


def test_offline_llm_rejects_bad_params_and_serves_huge_top_k(tiny_models):
    llm = LLM(tiny_models["llama"], device="cpu", max_model_len=128, num_kv_blocks=32, numa_policy="none")
    with pytest.raises(ValueError, match=r"^seed "):
        llm.generate(["hi"], SamplingParams(seed=2**64))
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidInput, match=r"^logit_bias token ids must be in \[0, ") as e:
        llm.generate(["hi"], SamplingParams(logit_bias={3: 1.0, vocab: 1.0}))
    assert e.value.param == "logit_bias"
    # top_k past the vocabulary (stored as given up to 2**31) is clamped by the runner, like vLLM's
    params = SamplingParams(max_tokens=4, top_k=2**31 - 1, seed=3, logprobs=MAX_LOGPROBS)
    whole = llm.generate(["hi"], SamplingParams(max_tokens=4, top_k=0, seed=3, logprobs=MAX_LOGPROBS))[0]
    out = llm.generate(["hi"], params)[0]
    assert out.outputs[0].token_ids == whole.outputs[0].token_ids


def _bpe_tokenizer(normalizer=None, pre_tokenizer=None, **bpe):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "ab": 2, "\u2581": 3, "<unk>": 4, "<0x41>": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>", **bpe))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_max_chars_per_token_only_where_the_tokenizer_keeps_every_character():
    from tokenizers import Regex, normalizers, pre_tokenizers

    sentencepiece_like = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    assert max_chars_per_token(_bpe_tokenizer(sentencepiece_like, byte_fallback=True)) == 6
    assert max_chars_per_token(_bpe_tokenizer(normalizers.NFC(), pre_tokenizers.ByteLevel())) == 6 * 4
    # characters dropped or fused without bound: no length bound, every prompt is tokenized
    assert max_chars_per_token(_bpe_tokenizer(normalizers.Replace(Regex(" +"), " "), byte_fallback=True)) is None
    assert max_chars_per_token(_bpe_tokenizer(pre_tokenizer=pre_tokenizers.Whitespace(), byte_fallback=True)) is None
    assert max_chars_per_token(_bpe_tokenizer(fuse_unk=True)) is None
