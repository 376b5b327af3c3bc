"""Turn a model's generated text into OpenAI tool calls, whole or as streamed deltas.

Models call tools by writing text in a format their chat template teaches them; the OpenAI API
returns those calls as structured `tool_calls`. Each parser here knows one format. `parse` reads a
finished reply; `streamer` reads one piece at a time and yields the OpenAI chat deltas to send.
Both read text the same way, so a streamed reply assembles into exactly what `parse` returns:
the same content and the same calls in the same order (only the random call ids differ).

Whatever the model writes, a parser never raises: text that is not a well-formed call (bad JSON,
an unterminated block, a call without a name, arguments nested over `MAX_NESTING` deep) is
returned as content.
"""

from __future__ import annotations

import json
import math
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pagoda_daemon.server.text_stream import StrippedText, tag_prefix_len

Delta = dict[str, Any]


@dataclass
class ToolCall:
    """One function call: `arguments` is the JSON text of an object, as OpenAI sends it."""

    name: str
    arguments: str
    id: str


@dataclass
class ParsedReply:
    """A reply split into what the user reads (`content`, None when there is none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    """A fresh id in OpenAI's shape; the client echoes it back in the tool's result message."""
    return "call_" + secrets.token_hex(12)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would make arguments clients cannot parse


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: valid JSON, but it would be sent on as Infinity, which is not
        raise ValueError(f"{text} is out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)

# A call object (its arguments included) nested deeper is content. JSON nested near the
# interpreter's recursion limit decodes or not depending on how deep the caller's stack is, so
# without a fixed bound `parse` and a streamer (called from different depths) could disagree on
# the same text, or fail to encode it again.
MAX_NESTING = 128


def _nesting_within(value: Any, limit: int) -> bool:
    """Whether `value` nests arrays and objects at most `limit` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def _sendable(text: str) -> bool:
    """Whether `text` encodes as UTF-8: JSON's `\\ud800` escape decodes to a lone surrogate, which does not."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _skip_whitespace(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


def call_from_object(obj: Any, argument_keys: tuple[str, ...], arguments_required: bool) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments": {...}}`, or None when it is not one.

    Arguments given as a string (some models double-encode them) are kept as they are when the
    string itself is a JSON object: the client receives the text the model wrote."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if not _sendable(obj["name"]):
        return None
    if not _nesting_within(obj, MAX_NESTING):
        return None
    present = [key for key in argument_keys if key in obj]
    if not present:
        return None if arguments_required else ToolCall(obj["name"], "{}", new_call_id())
    arguments = obj[present[0]]
    if isinstance(arguments, str):
        try:
            decoded = _DECODER.decode(arguments)
            if not isinstance(decoded, dict) or not _nesting_within(decoded, MAX_NESTING - 1):  # as if in place
                return None
        except (ValueError, RecursionError):
            return None
        return ToolCall(obj["name"], arguments if _sendable(arguments) else json.dumps(decoded), new_call_id())
    if not isinstance(arguments, dict):
        return None
    encoded = json.dumps(arguments, ensure_ascii=False)
    if not _sendable(encoded):  # keep the model's escapes rather than send what UTF-8 cannot carry
        encoded = json.dumps(arguments)
    return ToolCall(obj["name"], encoded, new_call_id())


def decode_json(text: str) -> Any:
    """The value of `text` (surrounding whitespace allowed), or None when it is not JSON."""
    try:
        return _DECODER.decode(text.strip())
    except (ValueError, RecursionError):  # deep nesting overflows the decoder's recursion
        return None


def _add_content(deltas: list[Delta], text: str) -> None:
    """Appends a content delta, merged into the previous one when that is content too."""
    if not text:
        return
    if deltas and set(deltas[-1]) == {"content"}:
        deltas[-1]["content"] += text
    else:
        deltas.append({"content": text})


def call_deltas(index: int, call: ToolCall) -> list[Delta]:
    """The OpenAI deltas of one whole call: its header (id, type, name), then its arguments."""
    return [
        {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": ""}}]},
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]


class ToolCallStreamer(ABC):
    """Reads one choice's generated text piece by piece and says which deltas to send.

    Content is stripped of surrounding whitespace, like `ParsedReply.content`; a call is sent
    whole once its text is complete, so its arguments are exactly those `parse` returns."""

    def __init__(self) -> None:
        self.called = False  # whether a call was sent: the choice then finishes with "tool_calls"
        self._content = StrippedText()
        self._calls_sent = 0

    @abstractmethod
    def feed(self, delta_text: str) -> list[Delta]:
        """The deltas to send for this newly generated piece of text (often none yet)."""

    @abstractmethod
    def finish(self) -> list[Delta]:
        """The deltas for whatever text was held back, once the choice has ended."""

    def _emit_content(self, deltas: list[Delta], text: str) -> None:
        _add_content(deltas, self._content.push(text))

    def _emit_call(self, deltas: list[Delta], call: ToolCall) -> None:
        deltas.extend(call_deltas(self._calls_sent, call))
        self._calls_sent += 1
        self.called = True


class ToolParser(ABC):
    """One tool-call format, as the chat template of a model family teaches it."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedReply:
        """Splits a finished reply into content and calls."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh streamer for one choice of a streamed reply."""


# ---- hermes: <tool_call>{json}</tool_call> blocks (Qwen2.5, Qwen3, Hermes) --------------------------

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def _hermes_call(body: str) -> ToolCall | None:
    """The call a block's body holds. A call without arguments is kept: the block says it is one."""
    return call_from_object(decode_json(body), ("arguments", "parameters"), arguments_required=False)


class HermesToolParser(ToolParser):
    """Calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number of
    them (parallel calls). All text outside well-formed blocks is content, stripped as a whole."""

    name = "hermes"

    def parse(self, text: str) -> ParsedReply:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(HERMES_OPEN, pos)
            end = text.find(HERMES_CLOSE, start + len(HERMES_OPEN)) if start >= 0 else -1
            if end < 0:  # no more blocks, or one left unterminated: the rest is content
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            call = _hermes_call(text[start + len(HERMES_OPEN):end])
            if call is None:
                content.append(text[start:end + len(HERMES_CLOSE)])
            else:
                calls.append(call)
            pos = end + len(HERMES_CLOSE)
        return ParsedReply("".join(content).strip() or None, calls)

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer()


class HermesStreamer(ToolCallStreamer):
    """Sends text outside blocks as it comes, holding back what may be the start of `<tool_call>`;
    holds a block until `</tool_call>` closes it, then sends it as a call (or as content if bad)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text not yet sent: in a block, everything after its opening tag
        self._in_block = False
        self._searched = 0  # in a block, how much of `_pending` is known to hold no closing tag

    def feed(self, delta_text: str) -> list[Delta]:
        self._pending += delta_text
        deltas: list[Delta] = []
        while True:
            if self._in_block:
                end = self._pending.find(HERMES_CLOSE, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._pending) - len(HERMES_CLOSE) + 1)
                    return deltas
                body, self._pending = self._pending[:end], self._pending[end + len(HERMES_CLOSE):]
                self._in_block = False
                call = _hermes_call(body)
                if call is None:
                    self._emit_content(deltas, HERMES_OPEN + body + HERMES_CLOSE)
                else:
                    self._emit_call(deltas, call)
            else:
                start = self._pending.find(HERMES_OPEN)
                if start < 0:
                    held = tag_prefix_len(self._pending, HERMES_OPEN)
                    self._emit_content(deltas, self._pending[:len(self._pending) - held])
                    self._pending = self._pending[len(self._pending) - held:]
                    return deltas
                self._emit_content(deltas, self._pending[:start])
                self._pending = self._pending[start + len(HERMES_OPEN):]
                self._in_block, self._searched = True, 0

    def finish(self) -> list[Delta]:
        deltas: list[Delta] = []
        self._emit_content(deltas, (HERMES_OPEN if self._in_block else "") + self._pending)
        self._pending, self._in_block = "", False
        return deltas


# ---- llama3_json: the whole reply is {"name": ..., "parameters": {...}} (Llama 3.1-3.3) -------------

PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls of a reply that is one JSON call or several separated by `;`, or None if it is
    anything else: a reply is either all calls or all content, as it is for vLLM."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    calls: list[ToolCall] = []
    pos = _skip_whitespace(body, 0)
    while pos < len(body):
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return None
        call = call_from_object(obj, ("parameters", "arguments"), arguments_required=True)
        if call is None:
            return None
        calls.append(call)
        pos = _skip_whitespace(body, pos)
        if pos < len(body):
            if body[pos] != ";":
                return None
            pos = _skip_whitespace(body, pos + 1)
    return calls or None


def _looks_like_llama3_call(stripped: str) -> bool:
    return stripped.startswith(("{", PYTHON_TAG))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x answers a tool call with nothing but JSON, optionally after `<|python_tag|>`.
    Arguments are under "parameters" (as Meta's template asks) or "arguments"."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedReply:
        calls = _llama3_calls(text) if _looks_like_llama3_call(text.lstrip()) else None
        if calls is None:
            return ParsedReply(text.strip() or None, [])
        return ParsedReply(None, calls)

    def streamer(self) -> ToolCallStreamer:
        return Llama3JsonStreamer()


class Llama3JsonStreamer(ToolCallStreamer):
    """Decides from the reply's first characters: plain text streams as it comes; a reply that
    starts like a call is held to the end, since only the whole of it says whether it is one."""

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._mode: str | None = None  # None until decided, then "content" or "calls"

    def feed(self, delta_text: str) -> list[Delta]:
        deltas: list[Delta] = []
        if self._mode == "content":
            self._emit_content(deltas, delta_text)
            return deltas
        self._held += delta_text
        if self._mode is None:
            start = self._held.lstrip()
            if _looks_like_llama3_call(start):
                self._mode = "calls"
            elif start and not PYTHON_TAG.startswith(start):
                self._mode = "content"
                self._emit_content(deltas, self._held)
                self._held = ""
        return deltas

    def finish(self) -> list[Delta]:
        deltas: list[Delta] = []
        calls = _llama3_calls(self._held) if self._mode == "calls" else None
        if calls is None:
            self._emit_content(deltas, self._held)
        else:
            for call in calls:
                self._emit_call(deltas, call)
        self._held = ""
        return deltas


# ---- choosing a parser ----------------------------------------------------------------------------

PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)}


def parser_for(name: str | None, chat_template: str | None, model_type: str | None) -> ToolParser | None:
    """The parser named (as vLLM's --tool-call-parser), or else the one the chat template's
    format shows; None when the template teaches no format we know."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool call parser {name!r}; known parsers: {', '.join(sorted(PARSERS))}")
        return PARSERS[name]()
    template = chat_template or ""
    if HERMES_OPEN in template:
        return HermesToolParser()
    if PYTHON_TAG in template or (model_type == "llama" and "tools" in template):
        return Llama3JsonToolParser()
    return None
