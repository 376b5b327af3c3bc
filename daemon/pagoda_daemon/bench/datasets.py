"""What a serving benchmark sends: prompts from random token ids, from a JSONL file, or from a
shared-prefix generator, and multi-turn conversations. Every draw is seeded, so two servers
benchmarked with the same flags get the same requests in the same order."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Token ids below this are left out of random prompts: tokenizers keep their special tokens
# (BOS, EOS, pad, chat markers) at the bottom of the vocabulary.
FIRST_ORDINARY_TOKEN = 100


@dataclass(frozen=True)
class BenchRequest:
    """One request: a prompt (token ids or text) or a conversation's user turns, and how many
    tokens to ask for; on the rerank endpoint the prompt is the query and ``documents`` what it
    ranks."""

    prompt: list[int] | str | None
    output_len: int
    # multi-turn, sent in order, each after the previous answer: user messages (chat), or each
    # turn's whole prompt as token ids (completions: the conversation so far, then the new turn)
    turns: tuple[str | list[int], ...] = field(default=())
    documents: tuple[str | list[int], ...] = field(default=())


DATASETS = ("random", "shared-prefix", "jsonl", "multi-turn")


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length drawn uniformly in mean·[1 − r, 1 + r], at least 1."""
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(lo, hi))


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)]


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int, *, range_ratio: float = 0.0,
                    seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, _length(rng, input_len, range_ratio), vocab_size),
                         _length(rng, output_len, range_ratio)) for _ in range(num)]


def rerank_requests(num: int, documents: int, query_len: int, document_len: int, vocab_size: int, *,
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """`num` queries of about `query_len` random token ids, each with `documents` documents of
    about `document_len`: a retriever's top documents, reranked (sent as text, ``as_text``)."""
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, _length(rng, query_len, range_ratio), vocab_size), 1,
                         documents=tuple(_ids(rng, _length(rng, document_len, range_ratio), vocab_size)
                                         for _ in range(documents)))
            for _ in range(num)]


def shared_prefix_requests(num: int, num_prefixes: int, prefix_len: int, input_len: int, output_len: int,
                           vocab_size: int, *, range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each request one of them (round
    robin) and a suffix of about `input_len` tokens: the prefix cache's workload."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    return [BenchRequest(prefixes[i % num_prefixes] + _ids(rng, _length(rng, input_len, range_ratio), vocab_size),
                         _length(rng, output_len, range_ratio)) for i in range(num)]


def jsonl_requests(path: str | Path, num: int, output_len: int, *, seed: int = 0) -> list[BenchRequest]:
    """Prompts from a JSONL file: one object per line with `prompt` (text, or a list of token
    ids) and optionally `output_len`; sampled without replacement (cycled if too few)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
            raise ValueError(f"{path}:{n}: each line needs a non-empty 'prompt' (text or token ids)")
        out = row.get("output_len", output_len)
        if not isinstance(out, int) or out < 1:
            raise ValueError(f"{path}:{n}: 'output_len' must be a positive integer")
        rows.append(BenchRequest(prompt, out))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    random.Random(seed).shuffle(rows)
    return [rows[i % len(rows)] for i in range(num)]


def multi_turn_requests(num: int, turns: int, words_per_turn: int, output_len: int, *,
                        seed: int = 0) -> list[BenchRequest]:
    """`num` conversations of `turns` user messages each (random words); each turn goes to the
    chat endpoint with the conversation so far, so later turns re-read earlier ones."""
    rng = random.Random(seed)
    words = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
             "quebec romeo sierra tango uniform victor whiskey xray")
    vocab = words.split(" ")
    return [BenchRequest(None, output_len, tuple(" ".join(rng.choice(vocab) for _ in range(words_per_turn))
                                                 for _ in range(turns))) for _ in range(num)]


def conversation_requests(num: int, turns: int, shared_len: int, turn_len: int, answer_len: int, output_len: int,
                          vocab_size: int, *, document_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    """`num` conversations of `turns` token-id prompts on one shared context of `shared_len`
    tokens (a long system prompt), then each conversation's own document of `document_len`
    tokens (a RAG document, an agent's tool outputs: prefixes no other conversation shares):
    turn t is the context, the document, the t − 1 earlier user turns of `turn_len` tokens each
    followed by an answer of `answer_len` tokens (replayed, as a trace would: the server's own
    answers are not fed back), then the new user turn. Each turn re-reads the whole
    conversation: the workload of KV offload and of the prefix cache."""
    rng = random.Random(seed)
    shared = _ids(rng, shared_len, vocab_size)
    out = []
    for _ in range(num):
        history = shared + _ids(rng, document_len, vocab_size)
        prompts: list[str | list[int]] = []
        for _ in range(turns):
            history += _ids(rng, turn_len, vocab_size)
            prompts.append(list(history))
            history += _ids(rng, answer_len, vocab_size)
        out.append(BenchRequest(None, output_len, tuple(prompts)))
    return out


def as_text(requests: Sequence[BenchRequest], decode: Callable[[list[int]], str]) -> list[BenchRequest]:
    """Token-id prompts sent as text instead (vLLM's random dataset sends text), so that the
    server's tokenizer is part of what is measured. The server tokenizes the text again, which
    may change a prompt's length by a few tokens where the tokenizer merges across ids. A rerank
    request's documents are decoded too."""

    def text(prompt: str | list[int]) -> str:
        return decode(prompt) if isinstance(prompt, list) else prompt

    return [dataclasses.replace(r, prompt=text(r.prompt) if r.prompt is not None else None,
                                documents=tuple(text(d) for d in r.documents)) for r in requests]

