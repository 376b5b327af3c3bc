"""A synthetic byte-level BPE tokenizer of Qwen3's size, for benchmarks that need a vocabulary
(constrained decoding: xgrammar's costs grow with the vocabulary and depend on what its tokens
hold) where no real tokenizer can be downloaded.

    python -m benchmarks.synthetic_tokenizer OUT_DIR [--config benchmarks/configs/qwen3-0.6b/config.json]

writes a PreTrainedTokenizerFast (tokenizer.json, tokenizer_config.json, ...) into OUT_DIR and
copies config.json beside it: a model directory with random weights and a tokenizer that both
Pagoda and vLLM load. Deterministic (the same files on every machine), built in a few seconds.

What it holds, like Qwen2/Qwen3's vocabulary (151,643 regular tokens, then special tokens from
151,643; the model's embedding has 151,936 rows): the 256 byte tokens (GPT-2's byte-to-unicode
map), pseudo-English words in lower case, capitalised and upper case, most with a leading space;
subword pieces; runs of spaces, newlines and tabs; punctuation runs with and without a leading
space (JSON's ``{"``, ``":``, ``",``, ``"}`` among them); numbers of one to three digits; words
joined by ``_`` or ``.``; accented Latin, Cyrillic and Greek words; about 25,000 CJK characters
and words (3-byte UTF-8, with their 2-byte prefixes as tokens, as byte-level vocabularies have).
Every token longer than one byte comes from a merge of its prefix and its last byte, so the BPE
model is valid; the merge order is not that of a trained tokenizer (it never tokenizes text
here: prompts are token ids), only the vocabulary matters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil

NUM_REGULAR = 151_643  # Qwen2/Qwen3: ids 0..151642; special tokens from 151643
# Qwen3's added tokens, at their ids (151643..151668)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
           "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
           "<tool_response>", "</tool_response>", "<think>", "</think>"]
EOS = "<|im_end|>"
# Qwen2's pre-tokenizer pattern (only used if text is ever encoded)
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of each byte to a printable character (what byte-level BPE vocabularies store)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
          "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sc", "sh", "sk", "sl", "sm",
          "sn", "sp", "st", "str", "sw", "th", "tr", "wh", "qu"]
VOWELS = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "ie", "io", "oo", "ou", "au", "oi"]
CODAS = ["", "", "", "b", "ck", "d", "ft", "g", "l", "ld", "ll", "m", "n", "nd", "ng", "nt", "p", "r", "rd",
         "rk", "rn", "rt", "s", "sh", "ss", "st", "t", "th", "x", "z"]
SUFFIXES = ["", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "able", "al", "ive", "ous", "ity"]
PUNCT = list("{}[]()\"':,.;!?-_/\\<>=+*&|#@$%^~`")
JSON_PIECES = ['{"', '"}', '":', '",', '":"', '","', '"]', '["', '},{', '}]', '":["', '":{"', '"},', '"],', '},',
               '],', '}}', ']]', '{}', '[]', '"},{"', '":[', '":{', '"}]', '"]}', '",\n', '"\n', '{\n', '}\n',
               '[\n', ']\n', ',\n', '":\n', '": "', '", "', '": [', '": {', '": ', '"}\n', '"},\n']


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                   for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))) + rng.choice(SUFFIXES)


def _candidates(rng: random.Random):
    """Token texts, most common kinds first; the caller stops when the vocabulary is full."""
    ws = []
    ws += [" " * n for n in range(2, 33)]
    ws += ["\n" * n for n in range(1, 9)] + ["\t" * n for n in range(1, 9)]
    ws += ["\n" + " " * n for n in range(1, 33)] + ["\n" + "\t" * n for n in range(1, 9)]
    ws += ["\n\n" + " " * n for n in range(1, 17)] + [" \n", "  \n", " \n\n", "\r\n", "\r\n\r\n", "\t\n", " \t"]
    yield from ws
    yield from JSON_PIECES
    yield from (" " + p for p in JSON_PIECES)
    yield from (str(n) for n in range(1000))
    for a in PUNCT:
        for b in PUNCT:
            yield a + b
            yield " " + a + b
        yield " " + a
    for _ in range(4000):
        p = "".join(rng.choice(PUNCT) for _ in range(rng.choice((3, 3, 4))))
        yield p
        if rng.random() < 0.3:
            yield p + "\n"
    # CJK: single characters (3 bytes) and two-character words
    cjk = [chr(c) for c in range(0x4E00, 0x9FA6)]
    rng.shuffle(cjk)
    yield from cjk[:18000]
    for _ in range(7000):
        yield rng.choice(cjk[:6000]) + rng.choice(cjk[:6000])
    for alphabet, count in (("абвгдеёжзийклмнопрстуфхцчшщъыьэюя", 4000), ("αβγδεζηθικλμνξοπρστυφχψω", 1500),
                            ("abcdefghijklmnopqrstuvwxyzéèêàâçôûüöäßñ", 3000)):
        for _ in range(count):
            w = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9)))
            yield " " + w if rng.random() < 0.6 else w
    while True:  # English-like words and their pieces, code identifiers
        w = _word(rng)
        r = rng.random()
        if r < 0.45:
            yield " " + w
        elif r < 0.65:
            yield w
        elif r < 0.8:
            yield " " + w.capitalize()
        elif r < 0.87:
            yield w.capitalize()
        elif r < 0.9:
            yield " " + w.upper() if rng.random() < 0.5 else w.upper()
        elif r < 0.95:
            yield rng.choice(("_", ".", "__", "->", "::", "(", "=")) + w
        else:
            yield w + rng.choice(("_", "(", "()", ":", "=", ".", "s"))


def vocabulary(num_regular: int = NUM_REGULAR, seed: int = 0) -> list[bytes]:
    """The regular tokens as bytes, id order: the 256 bytes, then each merged token after its prefix."""
    rng = random.Random(seed)
    tokens: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for text in _candidates(rng):
        data = text.encode()
        if data in seen:
            continue
        missing = [data[:k] for k in range(2, len(data) + 1) if data[:k] not in seen]
        if len(tokens) + len(missing) > num_regular:
            if len(tokens) + 1 > num_regular:
                break
            continue
        for piece in missing:  # prefixes first: each merge's parts exist before it
            seen.add(piece)
            tokens.append(piece)
        if len(tokens) == num_regular:
            break
    assert len(tokens) == num_regular, len(tokens)
    return tokens


def build(out_dir: str, config: str | None = None, num_regular: int = NUM_REGULAR, seed: int = 0) -> str:
    """Write the tokenizer (and config.json, when given) into out_dir; returns out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    tokens = vocabulary(num_regular, seed)
    vocab = {text(t): i for i, t in enumerate(tokens)}
    merges = [(text(t[:-1]), text(t[-1:])) for t in tokens[256:]]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    assert tok.token_to_id(SPECIAL[0]) == num_regular
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>",
                                   model_max_length=131072)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    if config:
        shutil.copy(config, os.path.join(out_dir, "config.json"))
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--config", default=None, help="a config.json to copy beside the tokenizer")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import time

    t = time.perf_counter()
    build(a.out_dir, a.config, seed=a.seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.out_dir)
    print(json.dumps({"dir": a.out_dir, "vocab": len(tok), "eos_token_id": tok.eos_token_id,
                      "seconds": round(time.perf_counter() - t, 1)}))


if __name__ == "__main__":
    main()
