"""OpenAI request bodies: parsed as strict JSON, validated with pydantic, mapped to SamplingParams.

Unknown fields are rejected, and fields OpenAI defines that Pagoda does not implement yet
are rejected by name: nothing a client sends is silently ignored. Every field is bounded
(the numeric bounds are SamplingParams's), numbers are strict (`7.0`, `true` and `"7"` are
not integers; NaN and infinities are refused), and a body that is not valid UTF-8 text,
holds lone surrogates or nests past what the parser takes is a 400, not a 500.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagoda_daemon.sampling_params import (
    INT64_MAX,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    has_lone_surrogate,
)
from pagoda_daemon.server.errors import APIError, bad_request

# OpenAI parameters Pagoda does not implement yet: a 400 names them.
UNSUPPORTED = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
    "logit_bias", "suffix", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options",
    "service_tier", "store", "metadata",
)
MAX_ID_CHARS = 256  # user, cache_salt, a message's name

# JSON can only carry a lone surrogate as a \uD800-\uDFFF escape: bodies without one skip the scan.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Identifier = Annotated[str, Field(max_length=MAX_ID_CHARS)]


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(data: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying why not."""
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except RecursionError as e:
        raise bad_request("the request body nests too deeply", code="invalid_json") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, ints past 4,300 digits
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(data):
        _reject_lone_surrogates(body)
    return body


def _reject_lone_surrogates(body: dict) -> None:
    """400 naming the first key or string that holds a lone surrogate (iterative: any depth)."""
    stack: list[tuple[object, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if has_lone_surrogate(value):
                raise bad_request(f"{path or 'body'}: strings must be valid Unicode (a lone surrogate was sent)",
                                  param=path or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                if has_lone_surrogate(key):
                    raise bad_request("object keys must be valid Unicode (a lone surrogate was sent)",
                                      param=path or None)
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(value) if isinstance(item, (str, list, dict)))


def parse_request(model: type[BaseModel], data: bytes):
    """Parse and validate a request body (CPU work: the API runs it off the event loop)."""
    try:
        return model.model_validate(parse_body(data))
    except ValidationError as e:
        raise validation_error(e.errors()) from e


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member it tried in error locations ('list[int]', 'str'): not a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in ("str", "int", "float", "bool"))


def validation_error(errors) -> APIError:
    """The first pydantic error as an OpenAI 400 whose param is the field's dotted path."""
    err = errors[0]
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, APIError):
        return ctx_error
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    param = ".".join(loc) or None
    return bad_request(f"{param or 'body'}: {err.get('msg')}", param=param)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # larger than the vocabulary: all of it, as in vLLM
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: Identifier | None = None
    cache_salt: Identifier | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self):
        for name in self.model_extra or {}:
            if name in UNSUPPORTED:
                raise bad_request(f"parameter '{name}' is not supported by Pagoda yet", param=name,
                                  code="unsupported_parameter")
            raise bad_request(f"unknown parameter '{name}'", param=name, code="unknown_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
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
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

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
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: Identifier | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
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
