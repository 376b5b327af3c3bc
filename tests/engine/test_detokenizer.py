"""Incremental detokenisation: whole characters only, stop strings cut exactly."""

from __future__ import annotations

import pytest

from pagoda_daemon.engine.detokenizer import IncrementalDetokenizer, backend_decoder
from pagoda_daemon.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stream(tok, text: str, stop=(), include_stop=False, prompt="Hello"):
    """Feed `text`'s tokens one at a time; return (deltas, final text, stop string)."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), True, list(stop), include_stop)
    deltas, hit = [], None
    for t in ids:
        hit = detok.update([t], check_stop=True)
        deltas.append(detok.take_delta(finished=hit is not None))
        if hit:
            break
    deltas.append(detok.take_delta(finished=True))
    return deltas, detok.text, hit


def test_multibyte_characters_are_never_split(tok):
    text = "café 東京 🚀 naïve Straße"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the byte-level BPE splits characters across tokens
    deltas, final, _ = stream(tok, text)
    assert final == text == "".join(deltas)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected"),
    [
        ("The capital of France is Paris. The quick", ["Paris"], False, "The capital of France is "),
        ("The capital of France is Paris. The quick", ["Paris"], True, "The capital of France is Paris"),
        ("one two three four", ["o t", "four"], False, "one tw"),  # earliest match wins
        ("東京 is far", ["京 i"], False, "東"),
    ],
)
def test_stop_strings_cut_the_text_exactly(tok, text, stop, include, expected):
    deltas, final, hit = stream(tok, text, stop, include)
    assert hit is not None
    assert final == expected
    assert "".join(deltas) == expected  # nothing past the cut was ever streamed


def test_stop_string_spanning_tokens_is_held_back_until_decided(tok):
    text = "Paged attention stores the key"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "attention st"
    assert not any(stop in tok.decode([t]) for t in ids)  # only visible across tokens
    deltas, final, hit = stream(tok, text, [stop])
    assert hit == stop and final == "Paged "
    assert "".join(deltas) == "Paged "


def test_no_stop_match_streams_everything(tok):
    text = "Continuous batching lets new requests join"
    deltas, final, hit = stream(tok, text, ["zzz"])
    assert hit is None and final == text == "".join(deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_backend_shortcut_decodes_as_transformers_does(tok, skip_special_tokens):
    """Random ids, special tokens among them, streamed through the Rust backend directly and
    through transformers' decode: the same text at every step."""
    import random

    assert backend_decoder(tok) is not None  # the test tokenizer is a fast one
    rng = random.Random()
    vocab = len(tok)
    ids = [rng.randrange(vocab) for _ in range(200)] + list(tok.all_special_ids) * 3
    rng.shuffle(ids)
    prompt = [rng.randrange(vocab) for _ in range(10)]
    fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens, [], False)
    slow = IncrementalDetokenizer(tok, prompt, skip_special_tokens, [], False)
    slow.backend = None
    for t in ids:
        fast.update([t], check_stop=False)
        slow.update([t], check_stop=False)
        assert fast.text == slow.text
    assert fast.text and any(t in tok.all_special_ids for t in ids)


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tok):
    class Custom(type(tok)):
        def decode(self, *args, **kwargs):  # e.g. a model's own post-processing
            return super().decode(*args, **kwargs)

    custom = Custom.__new__(Custom)
    custom.__dict__.update(tok.__dict__)
    assert backend_decoder(custom) is None
    assert backend_decoder(object()) is None
