"""Per-request sampling and stopping parameters (vLLM-compatible names and defaults).

Every field is bounded here, so that the offline `LLM`, the HTTP API (which reuses these
bounds) and the engine core (which re-validates what arrives over its socket) agree on
what a request may ask for, and nothing a caller sends can overflow the engine's int64
buffers, its msgpack frames or torch's generators.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from pagoda_daemon.structured_outputs import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# seed: a signed 64-bit int, as vLLM's API bounds it (torch.long); torch's generators take it as is.
SEED_MIN, SEED_MAX = INT64_MIN, INT64_MAX
MAX_N = 128  # choices per prompt
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # allowed_token_ids: a whole large vocabulary's worth
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 64  # one bad word's token sequence
# logit_bias entries: each costs the runner 20 bytes a step while its request runs (row, token id,
# bias, copied to the device), so a request cannot make every step move megabytes; a larger set of
# tokens is what allowed_token_ids is for. Values are clamped to OpenAI's [-100, 100] as vLLM
# clamps them (-100 or 100 is in effect a ban or a forced choice).
MAX_LOGIT_BIAS = 1 << 16
LOGIT_BIAS_LIMIT = 100.0
MAX_REPETITION_PENALTY = 100.0
# Like vLLM: a positive temperature below this is raised to it (smaller ones overflow the softmax).
MIN_POSITIVE_TEMPERATURE = 1e-2
# top_k at or above this means the whole vocabulary (no vocabulary is that large, and vLLM keeps
# top_k as int32); it is stored as 0 (disabled).
TOP_K_WHOLE_VOCABULARY = 2**31

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """True when `text` holds a UTF-16 surrogate, which no UTF-8 text (or tokenizer) can carry."""
    return not text.isascii() and _LONE_SURROGATE.search(text) is not None


def _shown(value: object) -> str:
    """A value for an error message: huge ints by size (their digits may exceed what str() allows)."""
    if is_strict_int(value) and abs(value) >= 10**30:
        return f"a {value.bit_length()}-bit integer"
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that a float holds finitely: NaN, infinities and ints past
    float's range (whose conversion would raise OverflowError) are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_strict_int(value: object) -> bool:
    """An int that is not a bool (JSON `true` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """What to sample and when to stop. Validated on construction: bad values raise ValueError
    whose message starts with the field's name."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled; TOP_K_WHOLE_VOCABULARY or more: disabled too
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # logprobs of every prompt token after the first (the top N alternatives, plus the prompt's
    # own token); a request asking for them skips prefix-cache hits, as in vLLM
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None  # sample only from these
    # token sequences never to complete (vLLM's bad_words, tokenized by the frontend): the last
    # token of a sequence is banned whenever the output ends with the ones before it
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # token id -> a number added to its logit before penalties and sampling (OpenAI's logit_bias;
    # logprobs stay those of the raw logits, as vLLM reports them); empty means None
    logit_bias: dict[int, float] | None = None
    # constrained decoding (a JSON schema, regex, choice or grammar); a dict is read as its fields
    structured_outputs: StructuredOutputsParams | None = None
    # the constraint starts after the first output token equal to this id, which, like the tokens
    # before it, is sampled freely: a reasoning model's end of thinking (`</think>`), so that it
    # thinks unconstrained and answers constrained, as vLLM does with a reasoning parser
    structured_outputs_after_token_id: int | None = None
    # scheduling priority under scheduling_policy "priority": lower values are admitted first and
    # preempted last (ties by arrival), as in vLLM; anything but 0 is refused under "fcfs"
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        self._validate()
        if self.logit_bias is not None:
            self.logit_bias = {token: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
                               for token, bias in self.logit_bias.items()} or None
        if self.top_k == -1 or self.top_k >= TOP_K_WHOLE_VOCABULARY:
            self.top_k = 0
        if 0.0 < self.temperature < MIN_POSITIVE_TEMPERATURE:
            self.temperature = MIN_POSITIVE_TEMPERATURE

    def _validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise ValueError(f"{param} {message}")

        def check_int(param: str, value, low: int, high: int = INT64_MAX) -> None:
            if not is_strict_int(value):
                fail(param, f"must be an integer, got {_shown(value)}")
            if value < low:
                fail(param, f"must be at least {low}, got {_shown(value)}")
            if value > high:
                fail(param, f"must be at most {high}, got {_shown(value)}")

        def check_float(param: str, value, ok, bounds: str) -> None:
            if not is_finite_number(value) or not ok(value):
                fail(param, f"must be a finite number in {bounds}, got {_shown(value)}")

        # n > 1 is fanned out by the frontend into n requests; the engine core sees n=1.
        check_int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        check_float("temperature", self.temperature, lambda v: v >= 0.0, "[0, inf)")
        check_float("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "(0, 1]")
        if not is_strict_int(self.top_k) or self.top_k < -1:
            fail("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {_shown(self.top_k)}")
        check_float("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "[0, 1]")
        if self.seed is not None:
            check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        check_float("presence_penalty", self.presence_penalty, lambda v: -2.0 <= v <= 2.0, "[-2, 2]")
        check_float("frequency_penalty", self.frequency_penalty, lambda v: -2.0 <= v <= 2.0, "[-2, 2]")
        check_float("repetition_penalty", self.repetition_penalty, lambda v: 0.0 < v <= MAX_REPETITION_PENALTY,
                    f"(0, {MAX_REPETITION_PENALTY:g}]")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.allowed_token_ids is not None:
            if not 1 <= len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
                fail("allowed_token_ids", f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids, got {len(self.allowed_token_ids)}")
            if any(not is_strict_int(t) or not 0 <= t <= INT64_MAX for t in self.allowed_token_ids):
                fail("allowed_token_ids", "must be non-negative integers")
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            fail("bad_words", f"may hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words_token_ids)}")
        for word in self.bad_words_token_ids:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS or any(
                    not is_strict_int(t) or not 0 <= t <= INT64_MAX for t in word):
                fail("bad_words", f"each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                fail("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to numbers")
            if any(not is_strict_int(t) or not 0 <= t <= INT64_MAX for t in self.logit_bias):
                fail("logit_bias", "keys must be non-negative integer token ids")
            if not all(map(is_finite_number, self.logit_bias.values())):
                fail("logit_bias", f"values must be finite numbers (clamped to [-{LOGIT_BIAS_LIMIT:g}, "
                                   f"{LOGIT_BIAS_LIMIT:g}])")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS or has_lone_surrogate(s):
                fail("stop", f"must be non-empty strings of valid Unicode, at most {MAX_STOP_STRING_CHARS} "
                             "characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not is_strict_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", f"must be StructuredOutputsParams, got {_shown(self.structured_outputs)}")
        check_int("priority", self.priority, INT64_MIN)
        after = self.structured_outputs_after_token_id
        if after is not None and (not is_strict_int(after) or not 0 <= after <= INT64_MAX):
            fail("structured_outputs_after_token_id", f"must be a non-negative integer, got {_shown(after)}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, f"must be true or false, got {_shown(getattr(self, name))}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_host_tokens(self) -> bool:
        """Sampling reads the request's earlier output tokens on the host (penalties, bad words):
        the engine waits for each step's tokens before scheduling the next. (A grammar needs them
        too, but only before sampling: the engine fills its mask while the forward pass runs.)"""
        return self.uses_penalties or bool(self.bad_words_token_ids)
