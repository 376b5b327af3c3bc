"""Constrained decoding in the engine core: compile each request's grammar off the step loop,
track where its output stands, and write the token bitmask that the sampler applies.

A backend does the work (a compiled grammar per constraint, a matcher per request, a packed
int32 bitmask of the allowed tokens per row): llguidance by default, or xgrammar (vLLM's
default, ``--structured-outputs-backend xgrammar``). llguidance is the default because its
masks cost least here: on an H100, with half of the nano-vllm workload under JSON schemas,
0.951 of the same tokens' unconstrained throughput against xgrammar's 0.578, same call
(docs/benchmarks/2026-11-26-structured-outputs-fill-h100.md). Compiles
run in a thread pool, cached by the constraint's canonical text: a request whose grammar is
not compiled yet waits in the queue without holding up the batch. Masks are filled for a
whole step at once by the backend's threads (in C++ or Rust) while the step's forward pass
runs on the device: the engine core launches the forward pass, accepts the previous step's
tokens, starts the fill, and goes on with the outputs' bookkeeping and the next step's
schedule; only then does it wait for the masks and have the worker sample
(Executor.sample_tokens). Scheduling ahead stays on with constrained requests in the batch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pagoda_daemon.engine.messages import StructuredOutputStats
from pagoda_daemon.engine.scheduler_output import GrammarBitmask
from pagoda_daemon.structured_outputs import (
    StructuredOutputsParams,
    build_grammar,
    build_llguidance_grammar,
    llguidance_message,
    native_message,
)

log = logging.getLogger(__name__)

COMPILE_THREADS = 2
# compiled grammars kept for reuse (by canonical constraint); a compiled JSON schema for a
# 150k-token vocabulary takes from tens of kB to a few MB
CACHE_ENTRIES = 512
MAX_TIMES_RECORDED = 4096  # compile and mask-fill times kept between two stats reads


def fill_threads() -> int:
    """Threads for the batch mask fill: every CPU this process may run on. xgrammar's default,
    half the machine's hardware threads, counts CPUs outside a pinned worker's set (a pinned
    engine has the cores of its GPU's NUMA node) and so oversubscribes them; the engine core's
    own thread only waits while the threads fill."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 2) // 2)


class RequestGrammar:
    """One request's constraint: compiling, then a matcher that follows its output. With
    ``starts_after`` (a token id), the output is free until that token is sampled (a reasoning
    model's end of thinking) and the constraint follows only what comes after it. ``submit``
    runs a backend's matcher construction off the step loop where it costs a compile
    (``builds_matchers_apart``)."""

    def __init__(self, future: Future, backend: Callable[[], Any], submit: Callable[..., Future],
                 starts_after: int | None = None) -> None:
        self._future = future
        self._backend = backend
        self._submit = submit
        self._matcher_future: Future | None = None
        self.matcher: Any = None
        self.error: str | None = None
        self.starts_after = starts_after

    @property
    def active(self) -> bool:
        """The constraint applies to the next token."""
        return self.starts_after is None

    def ready(self) -> bool:
        """Compiled (or failed): the request may be scheduled (or must be failed)."""
        if self.matcher is not None or self.error is not None:
            return True
        try:
            if self._matcher_future is None:
                if not self._future.done():
                    return False
                backend = self._backend()
                if backend.builds_matchers_apart:
                    self._matcher_future = self._submit(backend.new_matcher, self._future.result())
                    return False
                self.matcher = backend.new_matcher(self._future.result())
            elif self._matcher_future.done():
                self.matcher = self._matcher_future.result()
            else:
                return False
        except Exception as e:
            self.error = native_message(e)
        return True

    def accept(self, token: int) -> bool:
        """Follow a sampled token; False when the grammar refuses it. Before the constraint starts
        every token is accepted, and the one it starts after switches it on."""
        if not self.active:
            if token == self.starts_after:
                self.starts_after = None
            return True
        return self._backend().accept(self.matcher, token)

    @property
    def terminated(self) -> bool:
        return self.active and self._backend().terminated(self.matcher)


def _special_tokens_as_special(xgr: Any, tokenizer: Any, info: Any, vocab_size: int) -> Any:
    """xgrammar (0.2.8) finds special tokens from the vocabulary's text alone: one the tokenizer
    calls special whose text is not empty (<|pad|>, <|im_start|>, ...) stays an ordinary token,
    and a JSON string or a regex may take it as its literal text, which decoding with
    skip_special_tokens then drops (a string short of its minLength). Rebuilt with those tokens'
    text empty, xgrammar treats them as special: never allowed, a stop token still as a stop."""
    special = {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if t.special}
    special |= set(getattr(tokenizer, "all_special_ids", None) or [])
    special = {i for i in special if 0 <= i < vocab_size} - set(info.special_token_ids)
    if not special:
        return info
    vocab = [""] * vocab_size
    for text, i in tokenizer.get_vocab().items():
        if 0 <= i < vocab_size:
            vocab[i] = text
    for i in special:
        vocab[i] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())


def _stop_ids(tokenizer: Any, stop_token_ids: list[int]) -> list[int]:
    stops = set(stop_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)


class XgrammarBackend:
    """xgrammar 0.2: compiled grammars, one GrammarMatcher per request, the batch matcher's
    threads for a step's masks."""

    name = "xgrammar"
    builds_matchers_apart = False  # a GrammarMatcher over the compiled grammar: microseconds

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=_stop_ids(tokenizer, stop_token_ids))
        info = _special_tokens_as_special(xgr, tokenizer, info, vocab_size)
        self._xgr = xgr
        self._batch = xgr.BatchGrammarMatcher(threads)
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Parse the constraint as compile will, without a tokenizer (the API's check)."""
        build_grammar(params)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self._compiler.compile_grammar(build_grammar(params))

    def new_matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    @staticmethod
    def terminated(matcher: Any) -> bool:
        return bool(matcher.is_terminated())

    def fill(self, matchers: list[Any], out: np.ndarray) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, out)


class LlguidanceBackend:
    """llguidance 1.x: each request gets a matcher built from its constraint's grammar (in the
    compile pool: a few ms), not a deep copy of a shared one: copies of one matcher share its
    lazily built lexer, and their fills then wait for each other. On an H100 host's 16 cores,
    36 rows filled by 15 threads took 3.72 ms as copies and 1.74 ms built apart; 128 rows 11.4
    and 3.4 ms (2026-11-26, docs/benchmarks/2026-11-26-structured-outputs-fill-h100.md). A
    step's masks are filled by the executor's threads. Special tokens are never allowed inside
    a constraint (llguidance lexes text, not special tokens); at the end of one the tokenizer's
    end-of-sequence token is the stop."""

    name = "llguidance"
    builds_matchers_apart = True

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        stops = _stop_ids(tokenizer, stop_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None and stops:
            eos = stops[0]
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._llg = llguidance
        self._executor = llguidance.LLExecutor(threads)
        self._fill = llguidance.numpy.fill_next_token_bitmask_par

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Parse the constraint as compile will, without a tokenizer (the API's check)."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(build_llguidance_grammar(params))
        if error:
            raise RuntimeError(llguidance_message(error))

    def compile(self, params: StructuredOutputsParams) -> str:
        """The constraint's grammar, once a matcher built from it has no error."""
        grammar = build_llguidance_grammar(params)
        self.new_matcher(grammar)
        return grammar

    def new_matcher(self, grammar: str) -> Any:
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(llguidance_message(matcher.get_error()))
        return matcher

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    @staticmethod
    def terminated(matcher: Any) -> bool:
        return bool(matcher.is_stopped())

    def fill(self, matchers: list[Any], out: np.ndarray) -> None:
        self._fill(self._executor, [(m, i) for i, m in enumerate(matchers)], out)


BACKENDS: dict[str, type[XgrammarBackend] | type[LlguidanceBackend]] = {
    backend.name: backend for backend in (LlguidanceBackend, XgrammarBackend)
}


class GrammarManager:
    """The engine core's grammars: a backend (made from the tokenizer on first use), a compile
    pool, a cache of compiled grammars, and the step's bitmask."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
                 backend: str) -> None:
        """``tokenizer`` is called once, in a compile thread, when the first constraint arrives:
        an engine that never sees one never imports its backend (xgrammar: 2.4 s on a busy
        2-core machine) nor loads a tokenizer of its own."""
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        self.vocab_size = vocab_size
        self.backend_name = backend
        self._load_tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._backend: Any = None
        self.fill_threads_used: int | None = None  # set with the backend
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        # one step's masks at a time; the backend spreads each fill over its own threads
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self.stats = StructuredOutputStats()

    def backend(self) -> Any:
        """The backend, made on first use (in a compile thread: tokenizer and vocabulary)."""
        if self._backend is not None:
            return self._backend
        with self._init_lock:
            if self._backend is None:
                self.fill_threads_used = fill_threads()
                self._backend = BACKENDS[self.backend_name](self._load_tokenizer(), self.vocab_size,
                                                            self._stop_token_ids, self.fill_threads_used)
            return self._backend

    @property
    def bitmask_width(self) -> int:
        return -(-self.vocab_size // 32)

    def make_stats(self) -> StructuredOutputStats | None:
        """What happened since the previous call (and reset), or None when nothing did."""
        with self._lock:
            stats, self.stats = self.stats, StructuredOutputStats()
        return stats if stats.requests or stats.compiles or stats.failures or stats.mask_fill_seconds else None

    def grammar_for(self, params: StructuredOutputsParams, starts_after: int | None = None) -> RequestGrammar:
        """Start (or reuse) the compile of this constraint (``starts_after``: RequestGrammar's)."""
        key = params.key
        with self._lock:
            self.stats.requests += 1
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
            else:
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
                if len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return RequestGrammar(future, self.backend, self._pool.submit, starts_after)

    def _compile(self, params: StructuredOutputsParams):
        start = time.perf_counter()
        try:
            compiled = self.backend().compile(params)
        except Exception:
            with self._lock:
                self.stats.failures += 1
            raise
        with self._lock:
            self.stats.compiles += 1
            if len(self.stats.compile_seconds) < MAX_TIMES_RECORDED:
                self.stats.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def fill_masks(self, rows: list[int], matchers: list[Any]) -> Future[GrammarBitmask]:
        """The allowed next tokens of each matcher, one packed int32 row each (bit t of row i:
        token t allowed) for step row ``rows[i]``, filled by the backend's threads while the caller
        goes on. Every matcher comes from a compiled grammar, so the backend exists; none may take
        a token before the result is in.

        Both backends release the GIL while they fill, but the fill thread needs it for the few
        Python lines before that; a caller busy in Python would hold it for up to the
        interpreter's switch interval (5 ms, a whole step) before the fill begins. So the caller
        waits here until the fill thread is inside the backend (tens of µs)."""
        inside = threading.Event()
        future = self._fill_pool.submit(self._fill, rows, matchers, inside)
        inside.wait()
        return future

    def _fill(self, rows: list[int], matchers: list[Any], inside: threading.Event) -> GrammarBitmask:
        inside.set()  # the GIL stays here until the backend lets it go, a few lines on
        out = np.empty((len(matchers), self.bitmask_width), dtype=np.int32)  # every row is filled
        start = time.perf_counter()
        self._backend.fill(matchers, out)
        seconds = time.perf_counter() - start
        with self._lock:
            if len(self.stats.mask_fill_seconds) < MAX_TIMES_RECORDED:
                self.stats.mask_fill_seconds.append(seconds)
            self.stats.mask_fill_rows += len(matchers)
        return GrammarBitmask(rows, out)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
