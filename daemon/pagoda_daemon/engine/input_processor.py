"""Validate and tokenize what callers send, before anything reaches the engine core."""

from __future__ import annotations

import json

from pagoda_daemon.sampling_params import SamplingParams, has_lone_surrogate, is_strict_int
from pagoda_daemon.templates import PairFormat

PromptType = str | list[int]

# Unicode composition (NFC, NFKC) merges at most 4 code points into one (Greek extended).
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_GROWING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
# Pre-tokenizers that keep every character (their pieces cover the text).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts",
                           "FixedLength"}


def resolve_eos_token_id(tokenizer, model_config) -> int | None:
    """The tokenizer's EOS, else the model config's (the first one where it lists several)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(model_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


def cache_salt_keys(cache_salt: str | None) -> tuple:
    """Extra block-hash keys: requests with different salts never share cached blocks."""
    return (("salt", cache_salt),) if cache_salt else ()


def _component_shrink(state: dict | None, allowed: set[str], shrinking: set[str]) -> int | None:
    """How many text characters one output character may stand for after this normalizer or
    pre-tokenizer (1: none lost), or None when characters may be dropped without bound."""
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        factor = 1
        for part in state.get("normalizers") or state.get("pretokenizers") or []:
            f = _component_shrink(part, allowed, shrinking)
            if f is None:
                return None
            factor *= f
        return factor
    if state.get("behavior") == "Removed":
        return None
    if kind == "Replace":  # a fixed string for another: k characters become len(content)
        pattern = (state.get("pattern") or {}).get("String")
        content = state.get("content") or ""
        return -(-len(pattern) // len(content)) if pattern and content else None
    if kind in shrinking:
        return 4
    return 1 if kind in allowed else None


def max_chars_per_token(tokenizer) -> int | None:
    """An upper bound on the characters of prompt text one token can cover, or None where the
    tokenizer gives no such bound (it drops or fuses characters: whitespace splitting, fused
    unknown tokens, replacing normalizers, slow tokenizers).

    With it, a text of L characters has at least L / bound tokens, so a text that cannot fit
    the context is refused without tokenizing it.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    try:
        normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
    shrink_norm = _component_shrink(normalizer, _GROWING_NORMALIZERS | _COMPOSING_NORMALIZERS,
                                    _COMPOSING_NORMALIZERS)
    shrink_pre = _component_shrink(pre, _KEEPING_PRE_TOKENIZERS, set())
    if shrink_norm is None or shrink_pre is None:
        return None
    model = backend.model
    byte_level = "ByteLevel" in json.dumps(pre)
    if not (byte_level or model.byte_fallback or (model.unk_token is not None and not model.fuse_unk)):
        return None  # unknown characters are dropped or fused into one token
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(1, longest) * shrink_norm * shrink_pre


class InvalidInput(ValueError):
    """A prompt or parameter the model cannot serve; `param` names the request field."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.index: int | None = None  # which of several inputs (process_pairs), where that is known


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word tokenized as is and with a leading space
    (how it appears after another word), without special tokens; empty results dropped."""
    sequences: list[list[int]] = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _second_segment_start(token_type_ids: list[int] | None) -> int | None:
    """Where a pair's token types turn from 0 to 1 (None: they never do). ValueError for any
    other pattern: a cross-encoder's pair is two segments, the first then the second."""
    if not token_type_ids or 1 not in token_type_ids:
        return None
    start = token_type_ids.index(1)
    if any(t != 1 for t in token_type_ids[start:]) or any(t != 0 for t in token_type_ids[:start]):
        raise ValueError("the tokenizer's token types for a pair are not 0s then 1s: not a two-segment encoder")
    return start


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, scheduling_policy: str = "fcfs",
                 pair_format: PairFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.pair_format = pair_format or PairFormat()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduling_policy = scheduling_policy
        self.max_chars_per_token = max_chars_per_token(tokenizer)

    def _too_long(self, num_tokens: int, at_least: bool = False) -> InvalidInput:
        size = f"at least {num_tokens}" if at_least else str(num_tokens)
        return InvalidInput(f"the prompt is {size} tokens long, which leaves no room to generate within "
                            f"the model's context of {self.max_model_len} tokens", code="context_length_exceeded")

    def _too_long_to_pool(self, num_tokens: int, at_least: bool = False) -> InvalidInput:
        size = f"at least {num_tokens}" if at_least else str(num_tokens)
        return InvalidInput(f"the input is {size} tokens long, more than the model's context of {self.max_model_len} "
                            "tokens: shorten it, or set truncate_prompt_tokens", code="context_length_exceeded")

    def check_text_length(self, text: str, pooling: bool = False) -> None:
        """Refuse, without tokenizing, a text too long to fit the context whatever its tokens."""
        if self.max_chars_per_token is None:
            return
        at_least = len(text) // self.max_chars_per_token
        if pooling and at_least > self.max_model_len:
            raise self._too_long_to_pool(at_least, at_least=True)
        if not pooling and at_least >= self.max_model_len:
            raise self._too_long(at_least, at_least=True)

    def process(self, prompt: PromptType, params: SamplingParams, *, add_special_tokens: bool = True,
                truncate_prompt_tokens: int | None = None, pooling: bool = False) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids); raise InvalidInput (a ValueError) on bad input.

        add_special_tokens: let the tokenizer add its BOS and the like (off for a text that
        already holds them, e.g. a rendered chat template). truncate_prompt_tokens: keep only
        the prompt's last k tokens (vLLM's option: the text is then None, as it no longer
        matches the ids). pooling: an embedding input, which may fill the whole context (nothing
        is generated after it); ``params`` is then not read."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInput("prompt must not be empty")
            if truncate_prompt_tokens is None:
                self.check_text_length(prompt, pooling)
            if has_lone_surrogate(prompt):
                raise InvalidInput("prompt must be valid Unicode (it holds a lone surrogate)")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            text = None
            # the set of types in C first: 0.35 against 1.6 ms for 17,000 ids (2-core development VM)
            if set(map(type, token_ids)) != {int} and any(not is_strict_int(t) for t in token_ids):
                raise InvalidInput("prompt token ids must be integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidInput(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        else:
            raise InvalidInput(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if truncate_prompt_tokens is not None and len(token_ids) > truncate_prompt_tokens:
            token_ids = token_ids[len(token_ids) - truncate_prompt_tokens:]
            text = None
        if not token_ids:
            raise InvalidInput("prompt must not be empty")
        if pooling:
            if len(token_ids) > self.max_model_len:
                raise self._too_long_to_pool(len(token_ids))
            self._check_priority(params)
            return text, token_ids
        if len(token_ids) >= self.max_model_len:
            raise self._too_long(len(token_ids))
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidInput(
                f"this model's context is {self.max_model_len} tokens, but the prompt ({len(token_ids)} tokens) "
                f"plus max_tokens ({params.max_tokens}) asks for {len(token_ids) + params.max_tokens}",
                code="context_length_exceeded")
        if len(token_ids) + params.min_tokens > self.max_model_len:
            raise InvalidInput(
                f"min_tokens ({params.min_tokens}) plus the prompt ({len(token_ids)} tokens) exceeds this "
                f"model's context of {self.max_model_len} tokens", param="min_tokens", code="context_length_exceeded")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidInput(f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids")
        if params.allowed_token_ids is not None and any(not 0 <= t < self.vocab_size for t in params.allowed_token_ids):
            raise InvalidInput(f"allowed_token_ids must be in [0, {self.vocab_size})", param="allowed_token_ids")
        if any(not 0 <= t < self.vocab_size for word in params.bad_words_token_ids for t in word):
            raise InvalidInput(f"bad_words token ids must be in [0, {self.vocab_size})", param="bad_words")
        self._check_priority(params)
        if params.logit_bias is not None and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise InvalidInput(f"logit_bias token ids must be in [0, {self.vocab_size})", param="logit_bias")
        after = params.structured_outputs_after_token_id
        if after is not None and not 0 <= after < self.vocab_size:
            raise InvalidInput(f"structured_outputs_after_token_id must be in [0, {self.vocab_size})",
                               param="structured_outputs_after_token_id")
        return text, token_ids

    def process_pairs(self, pairs: list[tuple[str, str]], params: SamplingParams, *,
                      truncate_prompt_tokens: int | None = None, max_first_tokens: int = 0,
                      max_second_tokens: int = 0,
                      template_variables: dict | None = None) -> list[tuple[list[int], int | None]]:
        """Text pairs (query, document) as a cross-encoder reads them: each one prompt made by the
        tokenizer's pair template (BERT: [CLS] a [SEP] b [SEP]), and the position where the second
        text's token type 1 starts (None: the tokenizer gives one segment type throughout).
        ``max_first_tokens``/``max_second_tokens`` (0: no limit) cut each text to that many of
        its tokens first; ``truncate_prompt_tokens`` then shortens the longer text until the pair
        fits (sentence-transformers' CrossEncoder: the special tokens are kept). A ``pair_format``
        that joins the pair into one text (a score template, with ``template_variables``; or the
        two texts together) is cut in the document instead (``_fit_joined``). InvalidInput on
        bad input, its ``index`` the pair at fault.

        One tokenizer call for all the pairs: benchmarks/rerank_bench.py's 4,096 passage pairs took
        0.9 s in one call, 1.6 s in a call each (2-core development VM, 2026-12-02), where a whole
        round of them took 3.8 s through an H200."""
        firsts, seconds = [], []
        for index, (first, second) in enumerate(pairs):
            try:
                for name, text in (("query", first), ("document", second)):  # the param: which text is at fault
                    if not isinstance(text, str):
                        raise InvalidInput(f"the {name} must be a string, got {type(text).__name__}", param=name)
                    if has_lone_surrogate(text):
                        raise InvalidInput(f"the {name} must be valid Unicode (it holds a lone surrogate)",
                                           param=name)
                if truncate_prompt_tokens is None and not (max_first_tokens or max_second_tokens):
                    self.check_text_length(first + second, pooling=True)
            except InvalidInput as e:
                e.index = index
                raise
            firsts.append(self.first_tokens(first, max_first_tokens))
            seconds.append(self.first_tokens(second, max_second_tokens))
        if self.pair_format.joined:
            self._check_priority(params)
            if not pairs:
                return []
            # one tokenizer call for every pair, as below: process_pairs of benchmarks/rerank_bench.py's
            # 4,096 pairs under the Qwen3-Reranker template took 1.2 s (snippets) and 3.9 s (passages)
            # this way, 4.9 s and 8.7 s with a call each (2-core development VM, busy with a test run
            # beside, 2026-12-03)
            texts = [self._render(index, first, second, template_variables)
                     for index, (first, second) in enumerate(zip(firsts, seconds, strict=True))]
            return [(self._fit_joined(index, firsts[index], seconds[index], list(ids), truncate_prompt_tokens,
                                      template_variables), None)
                    for index, ids in enumerate(self.tokenizer(texts)["input_ids"])]
        specials = self.tokenizer.num_special_tokens_to_add(pair=True)
        kwargs: dict = {}
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens < specials + 2:
                raise InvalidInput(f"truncate_prompt_tokens ({truncate_prompt_tokens}) leaves no room for a pair: its "
                                   f"{specials} special tokens and one token of each text need {specials + 2}",
                                   param="truncate_prompt_tokens")
            kwargs = {"truncation": "longest_first", "max_length": truncate_prompt_tokens}
        self._check_priority(params)
        if not pairs:
            return []
        encoded = self.tokenizer(firsts, seconds, return_token_type_ids=True, **kwargs)
        types = encoded.get("token_type_ids") or [None] * len(pairs)
        out = []
        for index, (ids, pair_types) in enumerate(zip(encoded["input_ids"], types, strict=True)):
            if len(ids) > self.max_model_len:
                error = self._too_long_to_pool(len(ids))
                error.index = index
                raise error
            out.append((list(ids), _second_segment_start(pair_types)))
        return out

    def _fit_joined(self, index: int, query: str, document: str, ids: list[int], truncate_prompt_tokens: int | None,
                    variables: dict | None) -> list[int]:
        """A pair rendered as one text, as tokenized (``ids``), made to fit: past
        ``truncate_prompt_tokens`` the document loses its last tokens until the prompt fits (the
        template's own text around the document is kept: it holds where the answer is read); a
        prompt that cannot fit that way, or past the context without truncation, is refused."""
        limit = truncate_prompt_tokens or self.max_model_len
        for _ in range(8):  # a cut's new token boundaries may leave it a token or two over
            over = len(ids) - limit
            if over <= 0 or truncate_prompt_tokens is None:
                break
            kept = len(self.tokenizer(document, add_special_tokens=False)["input_ids"]) - over
            if kept < 1:
                raise InvalidInput(f"truncate_prompt_tokens ({truncate_prompt_tokens}) leaves no room for the "
                                   f"document of pair {index}: the prompt holds {len(ids)} tokens, its document "
                                   f"{kept + over}", param="truncate_prompt_tokens")
            document = self.first_tokens(document, kept)
            ids = list(self.tokenizer(self._render(index, query, document, variables))["input_ids"])
        if len(ids) > limit:
            error = self._too_long_to_pool(len(ids))
            error.index = index
            raise error
        return ids

    def _render(self, index: int, query: str, document: str, variables: dict | None) -> str:
        try:
            return self.pair_format.render(self.tokenizer, query, document, variables)
        except Exception as e:  # Jinja raises many kinds, the template's raise_exception too
            error = InvalidInput(f"the score template cannot render this pair: {e}", param="documents")
            error.index = index
            raise error from e

    def first_tokens(self, text: str, limit: int) -> str:
        """The text up to the end of its first ``limit`` tokens (0: all of it), cut where the
        tokenizer says that token ends, so re-tokenizing gives those tokens. The byte pieces of
        one character share its offsets: a cut among them drops the whole character (keeping it
        would keep every piece, more than ``limit`` tokens, and a truncation loop cutting again
        would get the same text back). A text that is not one (not a string, a lone surrogate)
        comes back as it is: the checks after refuse it."""
        if limit <= 0 or not isinstance(text, str) or has_lone_surrogate(text):
            return text
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) <= limit:
            return text
        cut = limit
        while cut > 0 and offsets[cut][0] < offsets[cut - 1][1]:  # token `cut` shares a character with the one before
            cut -= 1
        return text[: offsets[cut - 1][1]] if cut > 0 else ""

    def _check_priority(self, params: SamplingParams) -> None:
        if params.priority != 0 and self.scheduling_policy != "priority":  # as vLLM refuses it
            raise InvalidInput(f"priority {params.priority} needs the priority scheduling policy "
                               "(--scheduling-policy priority); this engine admits requests in arrival order",
                               param="priority", code="unsupported_parameter")
