"""Other APIs' replies written from the chat reply: the seam the Responses and Anthropic
Messages endpoints plug into.

Those endpoints are served through the chat path (their request becomes the chat request for the
same conversation), so the engine's outputs become chat bodies and chunks first. A `ReplyFormat`
then writes the whole chat body in its API's shape, and an `EventWriter` turns the stream of
chat chunks into its API's server-sent events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pagoda_daemon.server.protocol import ChatCompletionRequest

Request = TypeVar("Request")


class EventWriter(Protocol):
    """One streamed reply: its opening events, the events of each chat chunk, its closing events."""

    def start(self) -> list[dict[str, Any]]: ...

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (an error body too: the engine died mid-reply)."""
        ...

    def finish(self) -> list[dict[str, Any]]: ...


class ReplyFormat(Protocol):
    id_prefix: str  # the reply's id: this, then the request's id

    def body(self, reply_id: str, created: int, chat_body: dict[str, Any]) -> dict[str, Any]:
        """The whole reply (a chat completion with one choice) in this API's shape."""
        ...

    def events(self, reply_id: str, created: int, prompt_tokens: int) -> EventWriter: ...


@dataclass
class ChatServed(Generic[Request]):
    """A format's state: the API's own request, and the chat request it was served as."""

    request: Request
    chat: ChatCompletionRequest


class ChunkReader:
    """Reads chat chunks for an event writer: each choice's thinking, text and tool-call deltas go
    to the writer's hooks; the finish reason and the final usage are kept for its closing events."""

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.stop_reason: Any = None  # the stop string (or token) that ended the reply
        self.usage: dict[str, Any] | None = None  # the chat usage

    def read(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage") is not None and not chunk["choices"]:
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            self.on_choice(choice)
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self.on_reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self.on_content(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self.on_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return events

    def on_choice(self, choice: dict[str, Any]) -> None:
        """Sees each choice before its deltas (its logprobs)."""

    def on_reasoning(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def on_content(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def on_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """One tool call delta: its first has `id` and the function's name, the rest arguments."""
        raise NotImplementedError


def cached_tokens(chat_usage: dict[str, Any]) -> int:
    """The prompt tokens a chat usage says were read from the prefix cache."""
    return (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def aborted_message(stop_reason: Any) -> str:
    """Why the engine stopped a generation (its output constraint left no token to sample)."""
    return f"the generation was aborted: {stop_reason or 'no reason given'}"


def sse_event(event: dict[str, Any]) -> str:
    """One event as OpenAI's and Anthropic's streams send it: its type as the SSE event name, then the JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
