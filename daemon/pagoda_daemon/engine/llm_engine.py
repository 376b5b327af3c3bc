"""The in-process engine: input processing, the engine core, and output processing.

The offline `LLM` drives it directly; the server puts the core in its own process
and keeps the two processing ends in the API server.
"""

from __future__ import annotations

import itertools

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.engine_core import EngineCore
from pagoda_daemon.engine.input_processor import (
    InputProcessor,
    PromptType,
    cache_salt_keys,
    resolve_eos_token_id,
)
from pagoda_daemon.engine.messages import EngineStats
from pagoda_daemon.engine.output_processor import OutputProcessor
from pagoda_daemon.engine.request import Request
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.models import loader
from pagoda_daemon.outputs import RequestOutput, RequestOutputKind
from pagoda_daemon.pooling import PoolingParams
from pagoda_daemon.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:  # one engine in this process; `pagoda serve` runs several
            raise ValueError("data_parallel_size above 1 runs one engine per data-parallel rank behind `pagoda serve`; "
                             "offline, start one LLM per set of GPUs")
        self.config = config
        model = loader.load_engine_model(config)  # a bad model, override or template fails first
        self.model_config, self.tokenizer = model.config, model.tokenizer
        self.core = EngineCore(config, self.model_config, tokenizer=self.tokenizer)
        self.pooling = self.core.pooling  # None: the engine generates
        # As the server's engine does before it reports ready: every kernel compiled now, not
        # during the caller's first batch. (The heap is not frozen: it is the caller's process.)
        self.core.warm_up()
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.core.max_model_len,
                                              self.config.scheduling_policy, model.pair_format)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id = resolve_eos_token_id(self.tokenizer, self.model_config)
        self._ids = itertools.count()
        self._totals: EngineStats | None = None  # the counters of every make_stats() so far

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    lora: LoRARequest | None = None) -> str:
        """Validate and enqueue; raises ValueError on bad input without touching other requests."""
        text, token_ids = self.input_processor.process(prompt, params)
        return self.add_processed_request(text, token_ids, params, request_id, cache_salt, output_kind, lora)

    def add_processed_request(self, text: str | None, token_ids: list[int], params: SamplingParams,
                              request_id: str | None = None, cache_salt: str | None = None,
                              output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                              lora: LoRARequest | None = None, pooling: PoolingParams | None = None) -> str:
        """Enqueue a prompt that InputProcessor.process already accepted (``pooling``: an
        embedding request, on a pooling engine)."""
        if params.n != 1:
            raise ValueError("n > 1 is served by fanning out into n requests; pass n=1 to the engine")
        rid = request_id if request_id is not None else str(next(self._ids))
        request = Request(rid, token_ids, params, self.eos_token_id, self.config.block_size,
                          cache_salt_keys(cache_salt), lora=lora, pooling=pooling)
        self.core.add_request(request)
        self.output_processor.add_request(rid, text, token_ids, params, output_kind)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.core.abort_requests([request_id])
        return self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process(self.core.step())
        for rid, stop_str in processed.stop_string_finished:
            self.core.finish_request(rid, stop_str)
        return processed.outputs

    def stats(self) -> EngineStats:
        """The gauges now and the counters since the engine started."""
        now = self.core.make_stats()
        self._totals = now if self._totals is None else self._totals.add_counters(now)
        return self._totals
