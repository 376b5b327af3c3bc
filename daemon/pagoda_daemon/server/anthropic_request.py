"""Anthropic's Messages API request (`POST /v1/messages`), served as the chat request it amounts to.

Clients written for Anthropic's API (its SDKs, coding agents pointed at a local model) send a
conversation of content blocks: text, the `tool_use` blocks the assistant made, the `tool_result`
blocks that answer them, and the thinking they received. `to_chat` turns it into the
`ChatCompletionRequest` that asks for the same generation, so the chat template, bounds,
sampling, tool-call and reasoning parsers and structured outputs are the chat endpoint's (as
`responses_request.py` does for OpenAI's Responses API); `anthropic_output.py` writes the reply.

Served as vLLM serves it: `system`, `stop_sequences`, `temperature`/`top_p`/`top_k`, custom
tools with `tool_choice` (`auto`, `any`, `tool`, `none`; `disable_parallel_tool_use`),
`output_config` (`effort`, a JSON-schema `format`) and `thinking` (`enabled`/`disabled` turn the
chat template's `enable_thinking` on or off; the thinking comes back as `thinking` blocks with a
reasoning parser). Content other than text (images, documents) and Anthropic's server tools (web
search, code execution, bash, text editor, MCP servers, containers) are 400s naming the field:
this server runs text models and calls no tools itself. Thinking blocks sent back are accepted
and not rendered, as chat templates drop past thinking.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagoda_daemon.sampling_params import INT64_MAX, MAX_STOP_STRINGS
from pagoda_daemon.server.errors import bad_request
from pagoda_daemon.server.protocol import (
    MAX_DESCRIPTION_CHARS,
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionName,
    Identifier,
    StopString,
    refuse_renamed,
    validate_at,
)

_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
# Blocks a client sends back as it received them carry fields of their own (cache_control,
# citations, signature): accepted, not rendered
_ECHOED = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
MAX_MESSAGES = 4096
MAX_BLOCKS = 4096

# Fields with an Anthropic name of their own: a 400 that names the one to use
CHAT_ONLY: dict[str, str | None] = {
    "stop": "stop_sequences", "response_format": "output_config.format", "max_completion_tokens": "max_tokens",
    "reasoning_effort": "output_config.effort", "n": None, "logprobs": None, "top_logprobs": None, "echo": None,
    "add_generation_prompt": None, "continue_final_message": None, "parallel_tool_calls":
    "tool_choice.disable_parallel_tool_use", "stream_options": None,
}
# What needs tools or state this server does not run
NOT_SERVED = ("mcp_servers", "container", "context_management")
UNSERVED_BLOCKS = ("image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                   "web_fetch_tool_result", "code_execution_tool_result", "container_upload", "mcp_tool_use",
                   "mcp_tool_result")


class TextBlock(BaseModel):
    model_config = _ECHOED  # cache_control, citations
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _ECHOED
    type: Literal["tool_use"]
    id: Identifier
    name: FunctionName
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _ECHOED
    type: Literal["tool_result"]
    tool_use_id: Identifier
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    """Earlier thinking sent back (`thinking`, or `redacted_thinking`): accepted, not rendered."""

    model_config = _ECHOED
    type: Literal["thinking", "redacted_thinking"]


BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)]


class CustomTool(BaseModel):
    model_config = _ECHOED  # cache_control, input_examples
    type: Literal["custom"] | None = None
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None


class ToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "tool") != (self.name is not None):
            raise bad_request("tool_choice.name is required with type tool, and only then", param="tool_choice.name")
        return self


class ThinkingConfig(BaseModel):
    model_config = _STRICT
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    # Anthropic's minimum; the thinking is bounded by max_tokens here (no separate budget is enforced)
    budget_tokens: Annotated[int, Field(ge=1024, le=INT64_MAX)] | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: no thinking block is returned


class OutputFormat(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _STRICT
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = _STRICT
    user_id: Identifier | None = None


class MessagesRequest(BaseModel):
    """The Messages fields; any other field is a chat field, checked as the chat endpoint checks it."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)]
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)] | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here

    @model_validator(mode="after")
    def _check(self):
        extra = self.model_extra or {}
        refuse_renamed(extra, CHAT_ONLY, "Anthropic's Messages API (it is OpenAI's)")
        for name in NOT_SERVED:
            if extra.get(name) is not None:
                raise bad_request(f"'{name}' needs tools this server does not run", param=name,
                                  code="unsupported_parameter")
        return self

    @property
    def thinking_shown(self) -> bool:
        """Whether thinking comes back as blocks (`thinking.display` omitted: it does not)."""
        return self.thinking is None or self.thinking.display != "omitted"

    def custom_tools(self) -> list[CustomTool]:
        tools = []
        for index, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise bad_request(f"tools.{index}: Anthropic's server tools ({str(kind)[:40]!r}) are not served: this "
                                  "server runs no tools itself and serves custom tools", param=f"tools.{index}.type",
                                  code="unsupported_parameter")
            tools.append(validate_at(CustomTool, tool, f"tools.{index}"))
        return tools

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: the system prompt first; a user turn's tool results
        become `tool` messages (before its text, as they answer the turn before); an assistant
        turn's tool_use blocks become its tool_calls."""
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for m_index, message in enumerate(self.messages):
            where = f"messages.{m_index}.content"
            if isinstance(message.content, str):
                messages.append({"role": message.role, "content": message.content})
                continue
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for b_index, raw in enumerate(message.content):
                block = _block(raw, f"{where}.{b_index}")
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    if message.role != "assistant":
                        raise bad_request("tool_use blocks are the assistant's", param=f"{where}.{b_index}.type")
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
                elif isinstance(block, ToolResultBlock):
                    if message.role != "user":
                        raise bad_request("tool_result blocks are the user's", param=f"{where}.{b_index}.type")
                    content = "" if block.content is None else _text(block.content, f"{where}.{b_index}.content")
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
            if message.role == "assistant":
                if texts or calls:
                    messages.append({"role": "assistant", "content": "".join(texts) if texts else None,
                                     **({"tool_calls": calls} if calls else {})})
            elif texts or not message.content:
                messages.append({"role": "user", "content": "".join(texts)})
        return messages

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that asks for the same generation (a 400 naming the field otherwise)."""
        body: dict[str, Any] = dict(self.model_extra or {})
        body.update(model=self.model, messages=self.chat_messages(), max_tokens=self.max_tokens, stream=self.stream)
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # message_delta carries the usage
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        tools = self.custom_tools()
        if tools:
            body["tools"] = [{"type": "function", "function": {
                "name": tool.name, "parameters": tool.input_schema,
                **({"description": tool.description} if tool.description is not None else {}),
                **({"strict": tool.strict} if tool.strict is not None else {})}} for tool in tools]
        choice = self.tool_choice
        if choice is not None and (tools or choice.type != "auto"):
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        kwargs = body.get("chat_template_kwargs")
        if self.thinking is not None and self.thinking.type != "adaptive" and isinstance(kwargs or {}, dict):
            # (anything but an object is left for the chat request's check to refuse)
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled", **(kwargs or {})}
        if self.output_config is not None:
            if self.output_config.effort is not None:
                body["reasoning_effort"] = self.output_config.effort
            if self.output_config.format is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": self.output_config.format.json_schema}}
        if self.metadata is not None and self.metadata.user_id is not None:
            body.setdefault("user", self.metadata.user_id)
        return validate_at(ChatCompletionRequest, body)


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: the conversation without a reply's bound."""

    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] = 1


def _block(raw: dict[str, Any], where: str) -> BaseModel:
    kind = raw.get("type")
    model = BLOCKS.get(kind) if isinstance(kind, str) else None
    if model is None:
        served = kind in UNSERVED_BLOCKS
        raise bad_request(f"{where}: {str(kind)[:40]!r} blocks are not served"
                          + (": this server runs text models and no tools of its own" if served else ""),
                          param=f"{where}.type", code="unsupported_parameter" if served else None)
    return validate_at(model, raw, where)


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a system prompt or a tool result: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    pieces = []
    for index, raw in enumerate(content):
        block = _block(raw, f"{where}.{index}")
        if not isinstance(block, TextBlock):
            raise bad_request(f"{where}.{index}: only text blocks are read here", param=f"{where}.{index}.type")
        pieces.append(block.text)
    return "".join(pieces)
