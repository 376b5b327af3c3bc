"""Classifiers made from a language model's tokens (hf_overrides.py) and score templates
(templates.py): the original Qwen3-Reranker layout (a ``Qwen3ForCausalLM`` checkpoint, tied
embeddings) served as vLLM serves it, with ``--hf-overrides`` and a score template; its pair
scores equal the model card's reading of transformers' causal LM on the same prompt (the softmax
of the "yes" logit over "no" and "yes" at the last position). ``no_post_processing`` on an untied
Llama: each token's logit a label. Truncation cuts the document and keeps the template around it;
what cannot be served is refused with the reason; nothing is left behind."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pagoda_daemon import LLM
from pagoda_daemon.hf_overrides import classifier_from_tokens, parse_hf_overrides
from pagoda_daemon.models.tiny import build_tiny_model
from pagoda_daemon.templates import read_chat_template
from tests.engine.test_cross_encoders import assert_nothing_left, texts
from tests.processes import warm_start_method

ENGINE = dict(dtype="float32", device="cpu", block_size=16)
TOLERANCE = 2e-5  # float32 on both sides
TEMPLATE = str(Path(__file__).resolve().parents[2] / "examples" / "templates" / "qwen3_reranker.jinja")
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# The tiny tokenizers have no "yes" and "no": two of their tokens stand in (ids chosen at random
# once; any two distinct tokens test the same arithmetic)
NO, YES = 300, 400


def model_card_prompt(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """Qwen3-Reranker's prompt as its model card builds it in Python (not through the template)."""
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return f"{prefix}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{suffix}"


def last_logits(path: str, prompts: list[str], rows: list[int]) -> np.ndarray:
    """transformers' causal LM: the logits of ``rows`` at each prompt's last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return np.stack([model(**tokenizer(p, return_tensors="pt")).logits[0, -1, rows].numpy() for p in prompts])


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> tuple[str, dict]:
    """A tiny Qwen3 causal LM laid out as Qwen3-Reranker ships, and the overrides that serve it."""
    path = str(build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-reranker") / "m", seed=51))
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens([NO, YES])
    return path, {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
                  "is_original_qwen3_reranker": True}


def test_qwen3_reranker_scores_equal_the_model_card(reranker):
    path, overrides = reranker
    llm = LLM(path, **ENGINE, hf_overrides=overrides, chat_template=TEMPLATE)
    pooling = llm.engine.pooling
    assert pooling.classifies and pooling.labels == ("LABEL_0",) and pooling.activation == "sigmoid"
    rng = random.Random()
    query, documents = " ".join(texts(rng, 1, longest=10)), texts(rng, 6, longest=25)
    logits = last_logits(path, [model_card_prompt(query, d) for d in documents], [NO, YES])
    want = torch.softmax(torch.from_numpy(logits), -1).numpy()[:, 1]
    got = [o.outputs.score for o in llm.score(query, documents)]
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    raw = [o.outputs.score for o in llm.score(query, documents, use_activation=False)]
    np.testing.assert_allclose(raw, logits[:, 1] - logits[:, 0], atol=TOLERANCE, rtol=0)
    assert llm.get_stats().prefix_cache.hits > 0  # the template and the query, shared by every pair
    # a request's instruction replaces the default one
    logits = last_logits(path, [model_card_prompt(query, d, "find cats") for d in documents], [NO, YES])
    got = [o.outputs.score for o in llm.score(query, documents, use_activation=False,
                                              chat_template_kwargs={"instruction": "find cats"})]
    np.testing.assert_allclose(got, logits[:, 1] - logits[:, 0], atol=TOLERANCE, rtol=0)
    assert_nothing_left(llm)


def test_the_tokenizer_is_loaded_once(reranker, monkeypatch):
    """The engine's tokenizer serves the classifier's token ids, the score template's check and
    the prompts alike: one load per engine, not one for each."""
    from pagoda_daemon.models import loader

    loads = []
    load_tokenizer = loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: loads.append(path) or load_tokenizer(path))
    path, overrides = reranker
    llm = LLM(path, **ENGINE, hf_overrides=overrides, chat_template=TEMPLATE)
    assert loads == [path] and llm.engine.model_config.classifier_token_ids == [NO, YES]


def _tensor_parallel(_: int, path: str, overrides: dict, query: str, documents: list[str], out: str) -> None:
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE, hf_overrides=overrides, chat_template=TEMPLATE)
    np.save(out, np.array([o.outputs.score for o in llm.score(query, documents, use_activation=False)]))


def test_tensor_parallel(reranker, tmp_path):
    """Two ranks on gloo: each rank's embedding holds half the vocabulary, and each reads the
    head's two rows whole from the checkpoint."""
    path, overrides = reranker
    rng = random.Random()
    query, documents = " ".join(texts(rng, 1, longest=10)), texts(rng, 4, longest=25)
    out = str(tmp_path / "scores.npy")
    mp.start_processes(_tensor_parallel, args=(path, overrides, query, documents, out), nprocs=1, start_method=warm_start_method())
    logits = last_logits(path, [model_card_prompt(query, d) for d in documents], [NO, YES])
    np.testing.assert_allclose(np.load(out), logits[:, 1] - logits[:, 0], atol=TOLERANCE, rtol=0)


def test_truncation_cuts_the_document_and_keeps_the_template(reranker):
    path, overrides = reranker
    llm = LLM(path, **ENGINE, hf_overrides=overrides, chat_template=TEMPLATE)
    tokenizer = llm.tokenizer
    rng = random.Random()
    query, document = " ".join(texts(rng, 1, longest=5)), " ".join(texts(rng, 12, longest=25))  # 12 words or more
    whole = len(tokenizer(model_card_prompt(query, document))["input_ids"])
    doc_tokens = len(tokenizer(document, add_special_tokens=False)["input_ids"])
    assert doc_tokens > 8
    limit = whole - doc_tokens + 5  # room for five of the document's tokens
    [out] = llm.score(query, [document], truncate_prompt_tokens=limit, use_activation=False)
    assert len(out.prompt_token_ids) <= limit
    suffix = tokenizer("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")["input_ids"]
    assert out.prompt_token_ids[-len(suffix):] == suffix  # where the answer is read is kept
    cut = llm.engine.input_processor.first_tokens(document, 5)
    assert document.startswith(cut) and len(cut) < len(document)
    logits = last_logits(path, [model_card_prompt(query, cut)], [NO, YES])
    assert out.outputs.score == pytest.approx(float(logits[0, 1] - logits[0, 0]), abs=TOLERANCE)
    with pytest.raises(ValueError, match="leaves no room for the document"):
        llm.score(query, [document], truncate_prompt_tokens=limit - 6)
    assert_nothing_left(llm)


def test_a_cut_never_keeps_more_tokens_than_asked_among_a_characters_byte_pieces(reranker):
    """Byte-level BPE splits 東 into pieces that share its offsets; a cut among them drops the
    character, so the text re-tokenizes to at most the tokens asked for (a truncation that kept
    the character failed: the prompt stayed over its limit however often it was cut)."""
    path, overrides = reranker
    llm = LLM(path, **ENGINE, hf_overrides=overrides, chat_template=TEMPLATE)
    rng = random.Random()
    for text in ["of over 東", "vu Paris 東京 cats", " ".join(texts(rng, 12, longest=25))]:
        n = len(llm.tokenizer(text, add_special_tokens=False)["input_ids"])
        for limit in range(1, n + 1):
            cut = llm.engine.input_processor.first_tokens(text, limit)
            assert text.startswith(cut), (text, limit, cut)
            assert len(llm.tokenizer(cut, add_special_tokens=False)["input_ids"]) <= limit, (text, limit, cut)
    assert llm.engine.input_processor.first_tokens("東", 1) == ""
    assert_nothing_left(llm)


def test_token_rows_as_labels_on_an_untied_model(tmp_path):
    """no_post_processing: each token's logit is a label (softmax over three), on a Llama whose
    language-model head is its own tensor; without a template a pair is its two texts joined."""
    path = str(build_tiny_model("llama", tmp_path / "llama", seed=52))
    from transformers import AutoTokenizer

    rows = [100, 200, 300]
    tokens = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(rows)
    llm = LLM(path, **ENGINE, hf_overrides={"architectures": ["LlamaForSequenceClassification"],
                                             "classifier_from_token": tokens, "method": "no_post_processing"})
    rng = random.Random()
    batch = texts(rng, 5, longest=30)
    want = torch.softmax(torch.from_numpy(last_logits(path, batch, rows)), -1).numpy()
    got = np.array([o.outputs.probs for o in llm.classify(batch)])
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    del llm
    one = LLM(path, **ENGINE, hf_overrides={"architectures": ["LlamaForSequenceClassification"],
                                            "classifier_from_token": tokens[:1]})
    [out] = one.score("the fox", ["jumps over"], use_activation=False)
    assert out.prompt_token_ids == one.tokenizer("the foxjumps over")["input_ids"]  # joined as they are
    want_one = last_logits(path, ["the foxjumps over"], rows[:1])[0, 0]
    assert out.outputs.score == pytest.approx(float(want_one), abs=TOLERANCE)


@pytest.mark.parametrize("text, message", [
    ("", "must be a JSON object"),
    ("not json", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ("{}", "at least one key"),
    ('{"architectures": "Qwen3ForSequenceClassification"}', "non-empty list"),
    ('{"architectures": []}', "non-empty list"),
    ('{"architectures": [1]}', "non-empty list"),
    ('{"a": "' + "x" * 70000 + '"}', "longer than"),
    ('{"rope_theta": NaN}', "NaN is not a number"),
    ('{"max_position_embeddings": -Infinity}', "-Infinity is not a number"),
])
def test_malformed_overrides(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hf_overrides(text)


@pytest.mark.parametrize("overrides, message", [
    ({"classifier_from_token": ["a", "b"], "is_original_qwen3_reranker": True}, "architectures must name"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True},
     "classifier_from_token must be a list"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a", "b", "c"],
      "is_original_qwen3_reranker": True}, "reads two tokens"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [""]},
     "classifier_from_token must be a list"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a"] * 65},
     "classifier_from_token must be a list"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a"], "method": "sum"},
     "method must be one of"),
])
def test_what_a_token_classifier_cannot_be(overrides, message):
    from transformers import Qwen3Config

    config = Qwen3Config()
    config.update(overrides)
    with pytest.raises(ValueError, match=message):
        classifier_from_tokens(config)


def test_refusals_at_start(reranker, tmp_path):
    path, overrides = reranker
    with pytest.raises(ValueError, match="is not a token of the model's tokenizer"):
        LLM(path, **ENGINE, hf_overrides={**overrides, "classifier_from_token": ["no-such-token", "yes-either"]})
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(path, **ENGINE, hf_overrides="{architectures")
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(path, **ENGINE, hf_overrides={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        LLM(path, **ENGINE, hf_overrides=overrides, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="without the document"):
        LLM(path, **ENGINE, hf_overrides=overrides, chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="cannot render"):
        LLM(path, **ENGINE, hf_overrides=overrides, chat_template="{{ raise_exception('no pairs here') }}")
    with pytest.raises(ValueError, match="chat_template must be"):
        LLM(path, **ENGINE, chat_template="")


def test_read_chat_template(tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages }}")
    assert read_chat_template(str(file)) == "{{ messages }}"
    assert read_chat_template("{% for m in messages %}{{ m }}{% endfor %}").startswith("{%")
    big = tmp_path / "big.jinja"
    big.write_text("{{ x }}" * (1 << 18))
    with pytest.raises(ValueError, match="larger than"):
        read_chat_template(str(big))
    with pytest.raises(ValueError, match="neither a file"):
        read_chat_template("plain words")


def test_the_chat_template_option_replaces_the_tokenizers(tmp_path):
    path = str(build_tiny_model("qwen3", tmp_path / "chat", seed=53))
    llm = LLM(path, **ENGINE, chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"
