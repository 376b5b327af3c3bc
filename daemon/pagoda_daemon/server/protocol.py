"""OpenAI request bodies: parsed as strict JSON, validated with pydantic, mapped to SamplingParams.

The fields are OpenAI's plus the extra ones vLLM's server takes (``add_special_tokens``,
``truncate_prompt_tokens``, ``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``,
``chat_template_kwargs``, ...). Fields that change what is generated and that Pagoda does not
implement yet are a 400 naming them (``UNSUPPORTED``). Any other unknown field is accepted and
ignored, as vLLM does, and logged once per field name: clients written for vLLM send
bookkeeping fields of their own and must not fail on them. Every field is bounded
(the numeric bounds are SamplingParams's), numbers are strict (`7.0`, `true` and `"7"` are
not integers; NaN and infinities are refused), and a body that is not valid UTF-8 text,
holds lone surrogates or nests past what the parser takes is a 400, not a 500.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagoda_daemon.sampling_params import (
    INT64_MAX,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
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

log = logging.getLogger(__name__)

# Parameters (OpenAI's and vLLM's) that change what is generated and that Pagoda does not
# implement yet: a 400 names them rather than serving something else than was asked.
UNSUPPORTED = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
    "logit_bias", "suffix", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options",
    "service_tier", "store", "metadata", "chat_template", "use_beam_search", "length_penalty",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs", "logits_processors", "prompt_embeds",
    "mm_processor_kwargs", "lora_request",
)
MAX_ID_CHARS = 256  # user, cache_salt, request_id, a message's name
MAX_BAD_WORD_CHARS = 256
# chat_template_kwargs: the template's own arguments a caller may not replace
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
    "tools", "documents", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask",
})


class IgnoredFields:
    """The unknown field names already logged (each once per process): a named registry."""

    limit = 1024  # distinct names remembered; a client cycling names cannot grow it further

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, names: list[str]) -> None:
        with self._lock:
            new = [n[:64] for n in names if n not in self._seen]
            if len(self._seen) < self.limit:
                self._seen.update(names)
        if new:
            log.warning("request fields ignored (Pagoda does not know them): %s", ", ".join(sorted(new)[:20]))


IGNORED_FIELDS = IgnoredFields()

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


def parse_request(model: Any, data: bytes):
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
    continuous_usage_stats: bool = False  # usage on every chunk too (vLLM's option)


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
    spaces_between_special_tokens: bool = True
    user: Identifier | None = None
    cache_salt: Identifier | None = None
    # vLLM's extra fields
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[\x21-\x7e]+$")] | None = None
    priority: int = 0
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] = []
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _reject_unsupported(self):
        ignored = []
        for name in self.model_extra or {}:
            if name in UNSUPPORTED:
                raise bad_request(f"parameter '{name}' is not supported by Pagoda yet", param=name,
                                  code="unsupported_parameter")
            ignored.append(name)
        if ignored:
            IGNORED_FIELDS.note(ignored)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.priority != 0:  # as vLLM without --scheduling-policy priority
            raise bad_request("priority scheduling is not enabled on this server: priority must be 0",
                              param="priority", code="unsupported_parameter")
        return self

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    def truncation(self, max_model_len: int) -> int | None:
        """truncate_prompt_tokens as a token count (-1: the model's context, as in vLLM)."""
        if self.truncate_prompt_tokens is None:
            return None
        if self.truncate_prompt_tokens == -1:
            return max_model_len
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
        return self.truncate_prompt_tokens

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         default_max: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
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
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                allowed_token_ids=self.allowed_token_ids,
            )
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=param) from e


class CompletionRequest(_Common):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 only with echo: the prompt (and its logprobs) back, nothing generated
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only together with echo)", param="max_tokens")
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

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: generate one token (the engine always samples one) and
        return only the prompt, as vLLM does."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, default_max: int) -> SamplingParams:
        max_tokens = 1 if self.echo_only else self.max_tokens
        # echo with logprobs: the prompt's tokens get theirs too
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        if prompt_logprobs is not None and self.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs, self.prompt_logprobs)
        return self._sampling_params(max_tokens, self.logprobs, default_max, prompt_logprobs)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None  # null only on assistant messages
    name: Identifier | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.content is None and self.role != "assistant":
            raise bad_request(f"a {self.role} message needs content", param="messages.content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatTemplateFields(BaseModel):
    """The fields that render a conversation (the chat endpoint's and /tokenize's)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # the rendered template holds its special tokens already (vLLM's default for chat)
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Annotated[list[dict[str, str]], Field(max_length=1024)] | None = None

    @model_validator(mode="after")
    def _check_template_fields(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                              "(set add_generation_prompt to false)", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", param="continue_final_message")
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise bad_request(f"chat_template_kwargs may not set '{key}'", param=f"chat_template_kwargs.{key}")
        return self


class ChatCompletionRequest(_Common, ChatTemplateFields):
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # prefix the reply with the last message's content when it is the assistant's

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return self

    def echo_text(self) -> str:
        """What echo puts before the reply: the last message's content, if the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def sampling_params(self, default_max: int | None = None) -> SamplingParams:
        """Without max_tokens a chat reply may use the rest of the context, as in vLLM."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, default_max)


# ---- /tokenize and /detokenize (vLLM's) ---------------------------------------------------------

MAX_DETOKENIZE_TOKENS = 1 << 20


class _TokenizerRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None


class TokenizeCompletionRequest(_TokenizerRequest):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _no_unknown(self):
        for name in self.model_extra or {}:
            raise bad_request(f"unknown parameter '{name}'", param=name, code="unknown_parameter")
        return self


class DetokenizeRequest(_TokenizerRequest):
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class TokenizeRequest:
    """/tokenize's body: a conversation (``messages``) or a ``prompt``."""

    @staticmethod
    def model_validate(body: dict) -> TokenizeChatRequest | TokenizeCompletionRequest:
        return (TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest).model_validate(body)
