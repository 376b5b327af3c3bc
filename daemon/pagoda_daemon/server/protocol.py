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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from pagoda_daemon.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
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
from pagoda_daemon.structured_outputs import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_CHARS,
    StructuredOutputsParams,
)

log = logging.getLogger(__name__)

# Parameters (OpenAI's and vLLM's) that change what is generated and that Pagoda does not
# implement yet: a 400 names them rather than serving something else than was asked. OpenAI's
# fields that do not (store, metadata, service_tier; prediction, which only speeds up a reply the
# caller can guess) are ignored like any unknown field, as vLLM's server ignores them; modalities
# is declared on the chat endpoint: ["text"] is what it serves.
UNSUPPORTED = (
    "functions", "function_call",  # OpenAI's deprecated form of tools
    "suffix", "audio", "web_search_options",
    "chat_template", "use_beam_search", "length_penalty",
    "guided_whitespace_pattern", "logits_processors", "prompt_embeds", "mm_processor_kwargs", "lora_request",
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


def check_extra_fields(extra: dict[str, Any] | None, unsupported: tuple[str, ...], where: str = "") -> None:
    """A body's unknown fields: a 400 for one of ``unsupported`` (it would change the answer), the
    others ignored and logged once each (vLLM's clients send bookkeeping fields of their own)."""
    ignored = []
    for name in extra or {}:
        if name in unsupported:
            raise bad_request(f"parameter '{name}'{where} is not supported by Pagoda yet", param=name,
                              code="unsupported_parameter")
        ignored.append(name)
    if ignored:
        IGNORED_FIELDS.note(ignored)

# JSON can only carry a lone surrogate as a \uD800-\uDFFF escape: bodies without one skip the scan.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Identifier = Annotated[str, Field(max_length=MAX_ID_CHARS)]
# logit_bias: JSON object keys are strings, so a token id comes as its decimal digits
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,19}$")]


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
    return validate_at(model, parse_body(data))


def refuse_renamed(extra: dict[str, Any], renamed: dict[str, str | None], api: str) -> None:
    """A 400 for a field another API names otherwise (`renamed`: its name here, or None when it has none)."""
    for name, use in renamed.items():
        if name in extra:
            hint = f"; use {use}" if use else ""
            raise bad_request(f"'{name}' is not a field of {api}{hint}", param=name)


def validate_at(model: Any, value: Any, where: str = "") -> Any:
    """A request, or a part of one (an item, a block) at `where`, checked against its model; a
    400 names the failing field's place in the request."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_error(e.errors(), where) from e


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member it tried in error locations ('list[int]', 'str'): not a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in ("str", "int", "float", "bool"))


def validation_error(errors, where: str = "") -> APIError:
    """The first pydantic error as an OpenAI 400 whose param is the field's dotted path (below
    `where`, the place in the request of the part that was checked)."""
    err = errors[0]
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, APIError):
        return ctx_error
    loc = [where] if where else []
    loc += [str(x) for x in err.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    param = ".".join(loc) or None
    return bad_request(f"{param or 'body'}: {err.get('msg')}", param=param)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk too (vLLM's option)


# ---- structured outputs (response_format, vLLM's structured_outputs and guided_* fields) ---------

SchemaText = Annotated[str, Field(max_length=MAX_SCHEMA_CHARS)]
Schema = dict[str, Any] | SchemaText
RegexText = Annotated[str, Field(max_length=MAX_REGEX_CHARS)]
GrammarText = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]
Choices = Annotated[list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]], Field(max_length=MAX_CHOICES)]
# OpenAI's names of functions and response formats ([a-zA-Z0-9_-], at most 64); dots too, as MCP
# servers name their tools
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
MAX_TOOLS = 128  # OpenAI's limit
MAX_DESCRIPTION_CHARS = 64 * 1024


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON value
    strict: bool | None = None  # the output always follows the schema: strict or not, as in vLLM


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise bad_request("response_format.json_schema is required with type json_schema, and only then",
                              param="response_format.json_schema")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's structured_outputs: exactly one of its fields."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)
    json_schema: Schema | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: RegexText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None


Constraint = tuple[str, StructuredOutputsParams]  # (the request field that asked, the constraint)


def _structured(param: str, **fields: Any) -> Constraint:
    """The constraint, or a 400 naming `param` (the field the caller used) when it is invalid."""
    try:
        return param, StructuredOutputsParams(**fields)
    except ValueError as e:
        raise constraint_error(param, e) from e


def constraint_error(param: str, error: ValueError) -> APIError:
    """A StructuredOutputsParams error ("structured_outputs.<field> <problem>") as a 400 naming
    the request field that carried the constraint."""
    text = str(error)
    head, _, problem = text.partition(" ")
    if head.startswith("structured_outputs.") and problem:
        text = problem
    return bad_request(f"{param}: {text}", param=param)


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
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0  # refused unless --scheduling-policy priority
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] = []
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    logit_bias: Annotated[dict[TokenIdKey, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    return_tokens_as_token_ids: bool = False
    # constrained output: one of these at most
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Schema | None = None
    guided_regex: RegexText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
    guided_decoding_backend: Annotated[str, Field(max_length=64)] | None = None  # xgrammar serves them all

    @model_validator(mode="after")
    def _reject_unsupported(self):
        check_extra_fields(self.model_extra, UNSUPPORTED)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        return self

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    def constraint(self) -> Constraint | None:
        """The request's output constraint (the chat endpoint adds its tools')."""
        return self.output_constraint()

    def output_constraint(self) -> Constraint | None:
        """(the field that asked, the constraint) from whichever field carries one (400 for two)."""
        found: list[Constraint] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(_structured("response_format", json_object=True))
        elif rf is not None and rf.json_schema is not None:
            schema = rf.json_schema.json_schema
            found.append(_structured("response_format.json_schema.schema", json={} if schema is None else schema))
        so = self.structured_outputs
        if so is not None:
            fields = {"json": so.json_schema, "json_object": bool(so.json_object), "regex": so.regex,
                      "choice": so.choice, "grammar": so.grammar}
            set_names = [name for name, value in fields.items() if value not in (None, False)]
            param = f"structured_outputs.{set_names[0]}" if len(set_names) == 1 else "structured_outputs"
            found.append(_structured(param, **fields))
        for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append(_structured(name, **{field: value}))
        if len(found) > 1:
            raise bad_request(f"only one output constraint per request: {found[0][0]} and {found[1][0]} are both set",
                              param=found[1][0])
        return found[0] if found else None

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
                         default_max: int | None, prompt_logprobs: int | None = None,
                         constraint: Constraint | None = None) -> SamplingParams:
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
                priority=self.priority,
                logit_bias=None if self.logit_bias is None else {int(t): b for t, b in self.logit_bias.items()},
                structured_outputs=None if constraint is None else constraint[1],
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

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_at_once(cls, value: object, handler: ValidatorFunctionWrapHandler) -> object:
        """A list of plain ints in range is a valid prompt as it is: checked in C (0.8 ms for
        17,000 ids on the 2-core development VM) instead of by the union's validator (2.4 ms);
        anything else goes through the union, which names what is wrong."""
        if (isinstance(value, list) and value and set(map(type, value)) == {int}
                and min(value) >= 0 and max(value) <= INT64_MAX):
            return value
        return handler(value)

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
        if isinstance(p[0], int):  # the union took one type for the whole list: ids, strings or lists of ids
            return [p]
        return list(p)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: generate one token (the engine always samples one) and
        return only the prompt, as vLLM does."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, default_max: int, constraint: Constraint | None = None) -> SamplingParams:
        max_tokens = 1 if self.echo_only else self.max_tokens
        # echo with logprobs: the prompt's tokens get theirs too
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        if prompt_logprobs is not None and self.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs, self.prompt_logprobs)
        return self._sampling_params(max_tokens, self.logprobs, default_max, prompt_logprobs, constraint)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = _STRICT
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_SCHEMA_CHARS)]  # JSON text of an object, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call the assistant made, as the client sends it back in the history."""

    model_config = _STRICT
    id: Identifier
    type: Literal["function"] = "function"
    function: ToolCallFunction


# Fields of a message that clients send back as they received them (the openai SDK serializes a
# reply message whole): accepted when empty, and never rendered.
ECHOED_MESSAGE_FIELDS = frozenset({"refusal", "annotations", "audio", "function_call", "reasoning_content",
                                   "reasoning"})


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null only on assistant messages
    name: Identifier | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant only
    tool_call_id: Identifier | None = None  # tool only: the call this message answers

    @model_validator(mode="after")
    def _check(self):
        for key, value in (self.model_extra or {}).items():
            if key not in ECHOED_MESSAGE_FIELDS:
                raise bad_request(f"messages: unknown field '{key}'", param=f"messages.{key}")
            if key in ("function_call", "audio") and value is not None:
                raise bad_request(f"messages: '{key}' is not supported by Pagoda (use tool_calls)",
                                  param=f"messages.{key}", code="unsupported_parameter")
        if self.content is None and self.role != "assistant":
            raise bad_request(f"a {self.role} message needs content", param="messages.content")
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", param="messages.tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise bad_request("a tool message needs tool_call_id (and only a tool message has one)",
                              param="messages.tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: tool call arguments as objects (templates write
        them with `tojson`), as vLLM passes them."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _arguments_object(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"a tool call's arguments must be a JSON object: {e}",
                          param="messages.tool_calls.function.arguments") from e
    if not isinstance(value, dict):
        raise bad_request("a tool call's arguments must be a JSON object", param="messages.tool_calls.function.arguments")
    return value


# ---- tools --------------------------------------------------------------------------------------

class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # calls forced by tool_choice always follow the schema


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """A 400 naming the first of a request's ``chat_template_kwargs`` that would replace one of
    the template's own arguments (chat, and the score template's variables)."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs may not set '{key}'", param=f"chat_template_kwargs.{key}")


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
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    # OpenAI's, as vLLM passes it: to the template as a variable, and "none" turns thinking off
    # (enable_thinking false, unless chat_template_kwargs sets it), any other value on
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (OpenAI's shape, unset fields left out)."""
        return None if not self.tools else [tool.model_dump(exclude_none=True) for tool in self.tools]

    @model_validator(mode="after")
    def _check_template_fields(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                              "(set add_generation_prompt to false)", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", param="continue_final_message")
        check_template_kwargs(self.chat_template_kwargs)
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise bad_request("tools: two functions have the same name", param="tools")
        return self


class ChatCompletionRequest(_Common, ChatTemplateFields):
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # prefix the reply with the last message's content when it is the assistant's
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = None  # no audio out

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool() is None:
            raise bad_request(f"tool_choice names the function '{self.tool_choice.function.name}', which is not "
                              "among the tools", param="tool_choice.function.name")
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How the reply may call tools: not at all, when the model chooses (the reply is parsed
        for calls), or always (the output is constrained to calls)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice in (None, "auto"):
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    def named_tool(self) -> tuple[int, FunctionDefinition] | None:
        """The function tool_choice names, with its place among the tools."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        for index, tool in enumerate(self.tools or []):
            if tool.function.name == self.tool_choice.function.name:
                return index, tool.function
        return None

    def constraint(self) -> Constraint | None:
        """tool_choice required: a JSON array of calls to declared functions with valid arguments
        (vLLM's form); a named function: that function's arguments. Either constrains the whole
        reply, so it cannot be combined with a response format."""
        own = self.output_constraint()
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return own
        if own is not None:
            raise bad_request(f"tool_choice {mode} and {own[0]} both constrain the reply: send one of them",
                              param=own[0])
        named = self.named_tool()
        if named is not None:
            index, function = named
            return _structured(f"tools.{index}.function.parameters", json=function.parameters or NO_ARGUMENTS)
        calls = {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                              "parameters": tool.function.parameters or NO_ARGUMENTS},
             "required": ["name", "parameters"], "additionalProperties": False}
            for tool in self.tools or []]}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return _structured("tools", json=schema)

    def echo_text(self) -> str:
        """What echo puts before the reply: the last message's content, if the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def sampling_params(self, default_max: int | None = None, constraint: Constraint | None = None) -> SamplingParams:
        """Without max_tokens a chat reply may use the rest of the context, as in vLLM."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, default_max, constraint=constraint)


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
