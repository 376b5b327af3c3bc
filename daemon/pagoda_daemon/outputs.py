"""What the engine hands back to callers: one RequestOutput per prompt, as in vLLM."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# token id -> logprob, for the sampled token and the top-N alternatives at one position
Logprobs = dict[int, float]


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the previous output: streaming costs O(new), not O(all)
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestTiming:
    """When things happened to one request, in ``time.monotonic()`` seconds: one record per
    request, kept by the frontend's OutputProcessor and read by metrics, traces and callers
    (``RequestOutput.metrics``, as vLLM's RequestMetrics)."""

    arrival_time: float
    queue_time: float | None = None  # arrival to first schedule, measured by the engine core
    first_token_time: float | None = None
    last_token_time: float | None = None

    def tokens_arrived(self, n: int, now: float) -> float | None:
        """Record n new tokens; the interval per token since the previous ones (None for the first)."""
        gap = None
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            gap = (now - self.last_token_time) / n
        self.last_token_time = now
        return gap

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestTiming | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (vLLM's
    # shape); with DELTA outputs only on the first output
    prompt_logprobs: list[Logprobs | None] | None = None
    # a pooling request's vector (float32, little-endian; pooling.py), with its final output
    pooled: bytes | None = None

    def absorb(self, newer: RequestOutput) -> None:
        """Fold the next DELTA output of the same request into this one: text, tokens and
        logprobs appended, the finish, cache and timing fields taken from the newer."""
        assert newer.request_id == self.request_id and len(newer.outputs) == len(self.outputs)
        for mine, theirs in zip(self.outputs, newer.outputs, strict=True):
            mine.text += theirs.text
            mine.token_ids = [*mine.token_ids, *theirs.token_ids]
            if theirs.logprobs is not None:
                mine.logprobs = [*(mine.logprobs or []), *theirs.logprobs]
            mine.finish_reason, mine.stop_reason = theirs.finish_reason, theirs.stop_reason
        self.finished = newer.finished
        self.num_cached_tokens = newer.num_cached_tokens
        self.metrics = newer.metrics
        if self.prompt_logprobs is None:
            self.prompt_logprobs = newer.prompt_logprobs
        if self.pooled is None:
            self.pooled = newer.pooled


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's ``LLM.embed`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # one score per label, through the classifier's activation (pooling.py)


@dataclass
class ClassificationRequestOutput:
    """One prompt's label scores, as vLLM's ``LLM.classify`` returns them."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score, as vLLM's ``LLM.score`` returns it: a cross-encoder's on the pair as one
    prompt, or the cosine of an embedding model's two vectors (prompt_token_ids: both texts')."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
