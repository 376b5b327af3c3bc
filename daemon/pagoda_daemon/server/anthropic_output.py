"""The reply to an Anthropic Messages request, written from the chat reply that answers it.

A whole reply is a `message` whose content blocks are, in order, the thinking (a `thinking`
block, with a reasoning parser; its `signature` is empty: nothing here signs thinking), the text
(a `text` block, when there is text) and each call (a `tool_use` block, its `input` the call's
arguments as an object). A streamed reply is Anthropic's event sequence: `message_start`, per
block `content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` with the stop reason and usage, and `message_stop`.
Usage counts `input_tokens` apart from `cache_read_input_tokens` (prompt tokens read from the
prefix cache), as Anthropic's API and vLLM's server count them. Errors are Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, which its SDKs read.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pagoda_daemon.server.anthropic_request import MessagesRequest
from pagoda_daemon.server.errors import APIError
from pagoda_daemon.server.reply_format import ChatServed, ChunkReader, aborted_message, cached_tokens
from pagoda_daemon.server.tool_parsers import decode_json

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(error: APIError) -> JSONResponse:
    """An API error as Anthropic's API answers it (its status kept, the field named in the message)."""
    named = error.param is None or error.param.split(".")[0] in error.message
    message = error.message if named else f"{error.param}: {error.message}"
    return JSONResponse(anthropic_error_body(error.status, message), status_code=error.status, headers=error.headers)


def aborted(stop_reason: Any) -> APIError:
    """The engine stopped the generation: the request's output constraint left no token to sample."""
    return APIError(aborted_message(stop_reason), 400)


def message_usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    if chat_usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = cached_tokens(chat_usage)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached}


def stop_of(finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the chat reply's finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str):  # the stop string that ended the reply
        return "stop_sequence", stop_reason
    return "end_turn", None


def call_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object a tool_use block holds (None: not a whole object, or
    nested past what the decoder takes)."""
    value = decode_json(arguments)
    return value if isinstance(value, dict) else None


class AnthropicFormat(ChatServed[MessagesRequest]):
    """The `ReplyFormat` of /v1/messages."""

    id_prefix = "msg_"

    def body(self, reply_id: str, created: int, chat_body: dict[str, Any]) -> dict[str, Any]:
        choice = chat_body["choices"][0]
        if choice["finish_reason"] == "abort":
            raise aborted(choice.get("stop_reason"))
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content") and self.request.thinking_shown:
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        called = False
        for call in message.get("tool_calls") or []:
            arguments = call["function"]["arguments"]
            value = call_input(arguments)
            if value is None:  # a call max_tokens cut: its text, as the chat endpoint returns such a reply
                content.append({"type": "text", "text": arguments})
            else:
                called = True
                content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                "input": value})
        stop_reason, stop_sequence = stop_of(choice["finish_reason"], choice.get("stop_reason"), called)
        return {"id": reply_id, "type": "message", "role": "assistant", "model": self.chat.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": message_usage(chat_body["usage"])}

    def events(self, reply_id: str, created: int, prompt_tokens: int) -> MessageEvents:
        return MessageEvents(reply_id, self.chat.model, prompt_tokens, self.request.thinking_shown)


class MessageEvents(ChunkReader):
    """One streamed reply: chat chunks in, Anthropic's events out."""

    def __init__(self, reply_id: str, model: str, prompt_tokens: int, thinking_shown: bool = True) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.thinking_shown = thinking_shown
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.blocks = 0  # blocks started so far
        self.open: str | None = None  # the open block's type
        self.open_call: int | None = None  # its chat tool call's index, for a tool_use block
        self.called = False
        self.failed = False

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {
            "id": self.reply_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}}]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            self.failed = True
            return [*self._close(), {"type": "error", **anthropic_error_body(500, chunk["error"].get("message", ""))}]
        return self.read(chunk)

    def on_reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._delta("thinking", {"type": "thinking_delta", "thinking": text}) if self.thinking_shown else []

    def on_content(self, text: str) -> list[dict[str, Any]]:
        return self._delta("text", {"type": "text_delta", "text": text})

    def finish(self) -> list[dict[str, Any]]:
        if self.failed:
            return []
        events = self._close()
        if self.finish_reason == "abort":
            return [*events, {"type": "error", **anthropic_error_body(400, aborted(self.stop_reason).message)}]
        stop_reason, stop_sequence = stop_of(self.finish_reason, self.stop_reason, self.called)
        return [*events, {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                          "usage": message_usage(self.usage)},
                {"type": "message_stop"}]

    # ---- blocks ------------------------------------------------------------------------------

    def _start(self, kind: str, block: dict[str, Any], call_index: int | None = None) -> list[dict[str, Any]]:
        events = self._close()
        self.open, self.open_call = kind, call_index
        self.blocks += 1
        return [*events, {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open != kind:
            events = self._start(kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                 else {"type": "text", "text": ""})
        return [*events, {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}]

    def on_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if "id" in call:  # a call's first delta: its id and name
            self.called = True
            events = self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": function.get("name", ""),
                                              "input": {}}, call["index"])
        arguments = function.get("arguments") or ""
        if self.open == "tool_use" and self.open_call == call["index"] and arguments:
            events.append({"type": "content_block_delta", "index": self.blocks - 1,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = self.open_call = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]
