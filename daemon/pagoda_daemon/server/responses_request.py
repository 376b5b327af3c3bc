"""OpenAI's Responses API request (`POST /v1/responses`), served as the chat request it amounts to.

A Responses request is a conversation (``input``: a string, or items: messages, the function
calls the model made and their outputs, reasoning) with ``instructions`` in front, function
``tools``, ``text.format`` for structured output and ``reasoning.effort``. `to_chat` turns it
into the `ChatCompletionRequest` that asks for the same generation, so both endpoints share one
path: one chat template rendering, one set of bounds and sampling fields (every sampling field the
chat endpoint takes, vLLM's extras among them, passes through under its own name and is checked
there), one reply parser. `responses_output.py` writes the reply in the Responses shape.

Pagoda keeps no state between requests, as vLLM's server does by default: ``store`` is accepted
and reported false, and what needs a stored response (``previous_response_id``, ``background``,
``conversation``, reusable ``prompt`` templates) is a 400 that says so. Content other than text
(images, files, audio) and tools other than functions (web search, file search, code
interpreter, MCP, ...) are 400s naming the field: this server runs text models and calls no tools
itself.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagoda_daemon.sampling_params import INT64_MAX, MAX_LOGPROBS
from pagoda_daemon.server.errors import bad_request
from pagoda_daemon.server.protocol import (
    MAX_ID_CHARS,
    MAX_SCHEMA_CHARS,
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionDefinition,
    FunctionName,
    Identifier,
    JsonSchemaFormat,
    refuse_renamed,
    validate_at,
)

_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)
# Item fields a client sends back as it received them in an earlier response's output: accepted, not rendered
_ECHOED = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
MAX_INPUT_ITEMS = 4096
MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# Chat fields with a Responses name of their own: a 400 that names the one to use
CHAT_ONLY: dict[str, str | None] = {
    "messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format", "reasoning_effort": "reasoning.effort",
    "logprobs": 'include ["message.output_text.logprobs"]', "n": None, "echo": None,
    "add_generation_prompt": None, "continue_final_message": None, "modalities": None,
}
# What a stored response would be needed for
NEEDS_STORE = ("previous_response_id", "background", "conversation", "prompt")
INCLUDABLE = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url",
    "computer_call_output.output.image_url", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "code_interpreter_call.outputs",
]
OUTPUT_LOGPROBS = "message.output_text.logprobs"


class ContentPart(BaseModel):
    """A part of a message's content; text is all this server reads."""

    model_config = _ECHOED
    type: Literal["input_text", "output_text", "refusal", "input_image", "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None


class MessageItem(BaseModel):
    model_config = _ECHOED  # id, status of an earlier output message
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_INPUT_ITEMS)]


class FunctionCallItem(BaseModel):
    model_config = _ECHOED  # id, status
    type: Literal["function_call"]
    call_id: Identifier
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_SCHEMA_CHARS)]


class FunctionCallOutputItem(BaseModel):
    model_config = _ECHOED
    type: Literal["function_call_output"]
    call_id: Identifier
    output: str | Annotated[list[ContentPart], Field(max_length=MAX_INPUT_ITEMS)]


class ReasoningItem(BaseModel):
    """Earlier thinking sent back: accepted and not rendered, as chat's reasoning_content is not
    (chat templates drop past thinking)."""

    model_config = _ECHOED
    type: Literal["reasoning"]


ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(FunctionDefinition):
    """Responses' function tool: the chat tool's function, flat, with its type beside it."""

    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: FunctionName


class TextFormat(JsonSchemaFormat):
    """text.format: response_format's type with, for json_schema, its fields beside it (not nested)."""

    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None  # type: ignore[assignment]  # json_schema only (checked below)

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise bad_request("text.format of type json_schema needs a name and a schema", param="text.format")
        return self


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; vLLM ignores it too


class ReasoningConfig(BaseModel):
    model_config = _STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries are written: the thinking is returned
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseStreamOptions(BaseModel):
    model_config = _STRICT
    include_obfuscation: bool | None = None  # padding against side channels on OpenAI's service; none here


MetadataKey = Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]


class ResponsesRequest(BaseModel):
    """The Responses fields; any other field is a chat field and is checked as the chat endpoint
    checks it (`to_chat`)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str | None = None  # none: the served model
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[INCLUDABLE], Field(max_length=16)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    store: bool | None = None  # nothing is stored: the response says store false
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None  # built-in tool calls: none run here
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)] | None = None
    previous_response_id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    background: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        extra = self.model_extra or {}
        refuse_renamed(extra, CHAT_ONLY, "the Responses API (it is the chat endpoint's)")
        if self.previous_response_id is not None:
            raise bad_request(f"previous response '{self.previous_response_id}' not found: this server stores no "
                              "responses (send the conversation in input)", param="previous_response_id",
                              code="previous_response_not_found")
        if self.background:
            raise bad_request("background responses need stored responses, which this server does not keep",
                              param="background", code="unsupported_parameter")
        for name in ("conversation", "prompt"):
            if extra.get(name) is not None:
                raise bad_request(f"'{name}' needs state this server does not keep (send the conversation in input)",
                                  param=name, code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        return self

    @property
    def output_logprobs(self) -> bool:
        """Logprobs of the output text, when `include` asks for them (top_logprobs alone does not)."""
        return OUTPUT_LOGPROBS in (self.include or ())

    @cached_property
    def function_tools(self) -> list[FunctionTool]:
        """The tools, checked once (the chat request and every response object of a stream show them)."""
        tools = []
        for index, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(f"tools.{index}: tools of type {str(kind)[:40]!r} are not served: this server "
                                  "runs no tools itself and serves function tools", param=f"tools.{index}.type",
                                  code="unsupported_parameter")
            tools.append(validate_at(FunctionTool, tool, f"tools.{index}"))
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice of type {str(choice.get('type'))[:40]!r} is not served (function tools "
                              "only)", param="tool_choice.type", code="unsupported_parameter")
        named = validate_at(NamedFunctionChoice, choice, "tool_choice")
        return {"type": "function", "function": {"name": named.name}}

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions first (a system message, as vLLM
        renders them), then each input item; consecutive function calls join one assistant message."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for index, raw in enumerate(self.input):
            kind = raw.get("type", "message" if "role" in raw else None)
            model = ITEMS.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise bad_request(f"input.{index}: items of type {str(kind)[:40]!r} are not served (message, "
                                  "function_call, function_call_output and reasoning are)",
                                  param=f"input.{index}.type", code="unsupported_parameter")
            item = validate_at(model, raw, f"input.{index}")
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _text(item.content, f"input.{index}.content")})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # the same turn's text or calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _text(item.output, f"input.{index}.output")})
        if not messages:
            raise bad_request("input holds no message to answer", param="input")
        return messages

    def to_chat(self, served_model: str) -> ChatCompletionRequest:
        """The chat request that asks for the same generation (a 400 naming the field otherwise)."""
        body: dict[str, Any] = {
            key: value for key, value in (self.model_extra or {}).items() if key not in NEEDS_STORE}
        body.update(model=self.model or served_model, messages=self.messages(), stream=self.stream,
                    parallel_tool_calls=self.parallel_tool_calls)
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the final event carries the usage
        tools = self.function_tools
        if tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in tools]
        choice = self.chat_tool_choice()
        if choice is not None and (tools or choice != "auto"):  # auto without tools: nothing to choose
            body["tool_choice"] = choice
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.output_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return validate_at(ChatCompletionRequest, body)


def _text(content: str | list[ContentPart], where: str) -> str:
    """A message's text: its text parts joined (a refusal counts as text); other content is a 400."""
    if isinstance(content, str):
        return content
    pieces = []
    for index, part in enumerate(content):
        if part.type in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}.{index}: {part.type} content is not served: this server runs text models",
                              param=f"{where}.{index}.type", code="unsupported_parameter")
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            raise bad_request(f"{where}.{index}: a {part.type} part needs its text", param=f"{where}.{index}")
        pieces.append(text)
    return "".join(pieces)
