"""A chat reply as the response carries it: thinking apart, tool calls parsed, the rest content.

The engine generates text; what the client receives depends on the request and the server:
with a reasoning parser (``--reasoning-parser``), the thinking goes to ``reasoning_content``;
with tools, calls become ``tool_calls``, found by the model's tool-call parser when the model
chooses (``tool_choice: auto``) or read from the constrained output when the request forces a
call (``required``: a JSON array of ``{"name", "parameters"}``, vLLM's form; a named function:
the output is its arguments). One `ReplyShape` per request; `whole` reads a finished reply and
`streamer` one streamed choice. Both read text the same way, so the streamed deltas of a
choice concatenate to the whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pagoda_daemon.server.reasoning import ReasoningParser, ReasoningStreamer
from pagoda_daemon.server.tool_parsers import (
    Delta,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    call_deltas,
    call_from_object,
    decode_json,
    new_call_id,
)

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass
class Reply:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a `tool_choice: required` reply, or None when the text is not a complete
    array of calls (a reply cut by max_tokens): it is then returned as content. Arguments are
    encoded as the tool parsers encode them (no infinities, nothing UTF-8 cannot carry)."""
    value = decode_json(text)
    if not isinstance(value, list) or not value:
        return None
    calls = [call_from_object(item, ("parameters",), arguments_required=True) for item in value]
    return None if any(call is None for call in calls) else [call for call in calls if call is not None]


@dataclass(frozen=True)
class ReplyShape:
    tool_mode: ToolMode = "none"
    tool_parser: ToolParser | None = None  # with tool_mode auto
    function_name: str | None = None  # with tool_mode named
    parallel_tool_calls: bool = True
    reasoning: ReasoningParser | None = None

    @property
    def plain(self) -> bool:
        """The reply is all content, exactly as generated."""
        return self.tool_mode == "none" and self.reasoning is None

    @property
    def has_tools(self) -> bool:
        return self.tool_mode != "none"

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """A reply that ended by calling tools says so, as OpenAI's API does; a forced named call
        ends with "stop", as there (the caller knew a call would come)."""
        if called and engine_reason == "stop" and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason

    def whole(self, text: str) -> Reply:
        reasoning: str | None = None
        answer: str | None = text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, answer = split.reasoning, split.content
        if self.tool_mode == "none":
            return Reply(answer, reasoning)
        if self.tool_mode == "named":
            return Reply(None, reasoning, [ToolCall(self.function_name or "", answer or "", new_call_id())])
        if self.tool_mode == "required":
            calls = required_calls(answer or "")
            return Reply(answer, reasoning) if calls is None else Reply(None, reasoning, calls)
        assert self.tool_parser is not None
        parsed = self.tool_parser.parse(answer or "")
        calls = parsed.tool_calls if self.parallel_tool_calls else parsed.tool_calls[:1]
        return Reply(parsed.content, reasoning, calls)

    def streamer(self) -> ReplyStreamer:
        return ReplyStreamer(self)


def _push(deltas: list[Delta], key: str, text: str) -> None:
    """Appends a text delta, merged into the previous one when that is of the same kind."""
    if not text:
        return
    if deltas and set(deltas[-1]) == {key}:
        deltas[-1][key] += text
    else:
        deltas.append({key: text})


class ReplyStreamer:
    """One streamed choice: each piece of generated text in, the chat deltas to send out."""

    def __init__(self, shape: ReplyShape) -> None:
        self.shape = shape
        self._reasoning: ReasoningStreamer | None = shape.reasoning.streamer() if shape.reasoning else None
        self._tools: ToolCallStreamer | None = (
            shape.tool_parser.streamer() if shape.tool_mode == "auto" and shape.tool_parser else None)
        self._held = ""  # tool_mode required: the whole answer is read at the end
        self._named_started = False
        self._called = False

    @property
    def called(self) -> bool:
        return self._called or (self._tools is not None and self._tools.called)

    def feed(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        if self._reasoning is None:
            self._answer(deltas, text)
        else:
            reasoning, answer = self._reasoning.feed(text)
            _push(deltas, "reasoning_content", reasoning)
            self._answer(deltas, answer)
        return deltas

    def finish(self) -> list[Delta]:
        deltas: list[Delta] = []
        if self._reasoning is not None:
            reasoning, answer = self._reasoning.finish()
            _push(deltas, "reasoning_content", reasoning)
            self._answer(deltas, answer)
        mode = self.shape.tool_mode
        if mode == "auto" and self._tools is not None:
            deltas.extend(self._only_allowed(self._tools.finish()))
        elif mode == "required":
            calls = required_calls(self._held)
            if calls is None:
                _push(deltas, "content", self._held)
            else:
                for index, call in enumerate(calls):
                    deltas.extend(call_deltas(index, call))
                self._called = True
        elif mode == "named" and not self._named_started:
            self._start_named(deltas)
        return deltas

    def _answer(self, deltas: list[Delta], text: str) -> None:
        mode = self.shape.tool_mode
        if mode == "none":
            _push(deltas, "content", text)
        elif mode == "auto" and self._tools is not None:
            deltas.extend(self._only_allowed(self._tools.feed(text)))
        elif mode == "required":
            self._held += text
        elif mode == "named":
            if not self._named_started:
                self._start_named(deltas)
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})

    def _start_named(self, deltas: list[Delta]) -> None:
        self._named_started = self._called = True
        deltas.append(call_deltas(0, ToolCall(self.shape.function_name or "", "", new_call_id()))[0])

    def _only_allowed(self, deltas: list[Delta]) -> list[Delta]:
        """Without parallel tool calls, the first call only (as `whole` keeps it)."""
        if self.shape.parallel_tool_calls:
            return deltas
        return [d for d in deltas if all(call["index"] == 0 for call in d.get("tool_calls", ()))]


def message_fields(shape: ReplyShape, reply: Reply) -> dict[str, Any]:
    """The reply's fields of a chat message, past role and content."""
    fields: dict[str, Any] = {}
    if shape.reasoning is not None:
        fields["reasoning_content"] = reply.reasoning
    if shape.has_tools:
        fields["tool_calls"] = [{"id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}
                                for call in reply.tool_calls]
    return fields
