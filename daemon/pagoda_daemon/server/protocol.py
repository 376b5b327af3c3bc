"""OpenAI request bodies, validated with pydantic, and their mapping to SamplingParams.

Unknown fields are rejected, and fields OpenAI defines that Pagoda does not implement yet
are rejected by name: nothing a client sends is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagoda_daemon.sampling_params import SamplingParams
from pagoda_daemon.server.errors import bad_request

# OpenAI parameters Pagoda does not implement yet: a 400 names them.
UNSUPPORTED = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
    "logit_bias", "suffix", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options",
    "service_tier", "store", "metadata",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self):
        for name in self.model_extra or {}:
            if name in UNSUPPORTED:
                raise bad_request(f"parameter '{name}' is not supported by Pagoda yet", param=name,
                                  code="unsupported_parameter")
            raise bad_request(f"unknown parameter '{name}'", param=name, code="unknown_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.top_k is not None and self.top_k < -1:
            raise bad_request("top_k must be -1 (disabled) or non-negative", param="top_k")
        return self

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         default_max: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens if max_tokens is not None else default_max,
                min_tokens=self.min_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=param) from e


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.echo:
            raise bad_request("parameter 'echo' is not supported by Pagoda yet", param="echo",
                              code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by Pagoda yet", param="best_of",
                              code="unsupported_parameter")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def sampling_params(self, default_max: int) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, default_max)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return self

    def sampling_params(self, default_max: int | None = None) -> SamplingParams:
        """Without max_tokens a chat reply may use the rest of the context, as in vLLM."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, default_max)
