"""Frontend bookkeeping per request: text, stop strings, and the RequestOutput callers see."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagoda_daemon.engine.detokenizer import IncrementalDetokenizer
from pagoda_daemon.engine.messages import EngineCoreOutput
from pagoda_daemon.outputs import CompletionOutput, RequestOutput, RequestOutputKind, RequestTiming
from pagoda_daemon.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    timing: RequestTiming
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_delta: list[dict[int, float] | None] | None = None  # not yet handed out
    pooled: bytes | None = None  # a pooling request's vector, once it came


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # requests a stop string finished, which the core must stop: (request id, stop string)
    stop_string_finished: list[tuple[str, str]]
    # (seconds per token since the request's previous tokens, tokens) for each output with new tokens
    inter_token: list[tuple[float, int]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    arrival_time: float | None = None) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output, params.spaces_between_special_tokens,
        )
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detok,
            RequestTiming(time.monotonic() if arrival_time is None else arrival_time), output_kind,
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        return None if state is None else self._make_output(state, "abort", None, [], [])

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        results, stopped, gaps = [], [], []
        now = time.monotonic()
        for out in core_outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted by the caller meanwhile
            if out.new_token_ids:
                gap = state.timing.tokens_arrived(len(out.new_token_ids), now)
                if gap is not None:
                    gaps.append((gap, len(out.new_token_ids)))
            if out.queue_time is not None:
                state.timing.queue_time = out.queue_time
            state.num_cached_tokens = out.num_cached_tokens
            if out.pooled is not None:
                state.pooled = out.pooled
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = state.prompt_logprobs_delta = out.prompt_logprobs
            state.token_ids.extend(out.new_token_ids)
            if state.logprobs is not None and state.output_kind is not RequestOutputKind.DELTA:
                state.logprobs.extend(out.new_logprobs)
            check_stop = len(state.token_ids) > state.params.min_tokens
            stop_str = state.detokenizer.update(out.new_token_ids, check_stop)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if stop_str is not None and finish_reason in (None, "length", "stop"):
                if finish_reason is None:
                    stopped.append((out.request_id, stop_str))
                finish_reason, stop_reason = "stop", stop_str
            if finish_reason is not None:
                del self.states[out.request_id]
            elif state.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            results.append(self._make_output(state, finish_reason, stop_reason, out.new_token_ids, out.new_logprobs))
        return ProcessedOutputs(results, stopped, gaps)

    def _make_output(self, state: RequestState, finish_reason: str | None, stop_reason,
                     new_token_ids: list[int], new_logprobs: list[dict[int, float]]) -> RequestOutput:
        finished = finish_reason is not None
        delta = state.detokenizer.take_delta(finished)
        prompt_logprobs = state.prompt_logprobs
        if state.output_kind is RequestOutputKind.DELTA:
            text, token_ids = delta, new_token_ids
            logprobs = new_logprobs if state.logprobs is not None else None
            prompt_logprobs, state.prompt_logprobs_delta = state.prompt_logprobs_delta, None
        else:
            text = state.detokenizer.text if finished else state.detokenizer.text[: state.detokenizer.emitted]
            token_ids = list(state.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
        )
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, [completion], finished,
            state.num_cached_tokens, state.timing, prompt_logprobs, state.pooled if finished else None,
        )
