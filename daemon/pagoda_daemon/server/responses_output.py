"""The reply to a Responses request, written from the chat reply that answers it.

`responses_request.py` serves a Responses request as a chat request; this module rewrites the
chat reply in the Responses shape. A whole reply becomes a `response` object whose output items
are, in order, the thinking (a `reasoning` item, with a reasoning parser), the text (a `message`
with one `output_text` part, when there is text or nothing else) and each function call (a `function_call`
item, its `call_id` the chat call's id). A streamed reply becomes OpenAI's event sequence:
`response.created` and `response.in_progress`, then per item `output_item.added`, its deltas
(`reasoning_text`, `output_text` after a `content_part.added`, `function_call_arguments`) and
their `.done` events, `output_item.done`, and last `response.completed` (`response.incomplete`
when max_output_tokens cut the reply, `response.failed` after an `error` event). Every event
carries a `sequence_number`; the final response's items are the streamed ones, ids included.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from pagoda_daemon.server.protocol import ChatCompletionRequest
from pagoda_daemon.server.reply_format import ChatServed, ChunkReader, aborted_message, cached_tokens
from pagoda_daemon.server.responses_request import ResponsesRequest


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def response_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage in the Responses names."""
    if chat_usage is None:
        return None
    cached = cached_tokens(chat_usage)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": chat_usage["total_tokens"]}


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(the response's status, its incomplete_details) for the chat reply's finish reason. An
    aborted generation (an output constraint that no allowed token could follow) failed."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "failed", None
    return "completed", None


def failure(status: str, stop_reason: Any) -> dict[str, str] | None:
    """A failed response's error (its codes are OpenAI's list: the reason goes in the message)."""
    if status != "failed":
        return None
    return {"code": "server_error", "message": aborted_message(stop_reason)}


@dataclass
class ResponseHeader:
    """What a response object says of its request, whole or streamed."""

    id: str
    created_at: int
    request: ResponsesRequest
    chat: ChatCompletionRequest

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: dict[str, str] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        req, chat = self.request, self.chat
        fmt = req.text.format if req.text is not None else None
        text: dict[str, Any] = {"format": {"type": "text"} if fmt is None else fmt.model_dump(
            exclude_none=True, by_alias=True)}
        if req.text is not None and req.text.verbosity is not None:
            text["verbosity"] = req.text.verbosity
        reasoning = None if req.reasoning is None else {"effort": req.reasoning.effort,
                                                        "summary": req.reasoning.summary}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": chat.model, "output": output,
            "parallel_tool_calls": chat.parallel_tool_calls, "previous_response_id": None,
            "reasoning": reasoning, "store": False,
            "temperature": 1.0 if chat.temperature is None else chat.temperature, "text": text,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in req.function_tools],
            "top_logprobs": req.top_logprobs or 0, "top_p": 1.0 if chat.top_p is None else chat.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "user": chat.user,
            "metadata": req.metadata or {},
        }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, parts: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_body(header: ResponseHeader, chat_body: dict[str, Any]) -> dict[str, Any]:
    """The whole chat reply (one choice) as a response object."""
    choice = chat_body["choices"][0]
    message = choice["message"]
    status, incomplete = status_of(choice["finish_reason"])
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(new_item_id("rs"), message["reasoning_content"]))
    if message.get("content") or not (output or message.get("tool_calls")):  # a reply has a message, empty or not
        logprobs = None if choice["logprobs"] is None else choice["logprobs"]["content"]
        output.append(message_item(new_item_id("msg"), [text_part(message["content"] or "", logprobs)]))
    for call in message.get("tool_calls") or []:
        output.append(call_item(new_item_id("fc"), call["id"], call["function"]["name"],
                                call["function"]["arguments"]))
    if output and status == "incomplete":  # the item max_output_tokens cut; those before it are whole
        output[-1]["status"] = "incomplete"
    return header.envelope(status, output, response_usage(chat_body["usage"]), incomplete,
                           failure(status, choice.get("stop_reason")))


@dataclass
class _OpenItem:
    kind: str  # "reasoning", "message" or "function_call"
    index: int  # its place in the output
    item: dict[str, Any]
    text: str = ""  # reasoning or output text so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_index: int | None = None  # the chat tool call's index


class ResponseEvents(ChunkReader):
    """One streamed reply: chat chunks in, Responses events out (each with its sequence number)."""

    def __init__(self, header: ResponseHeader, logprobs: bool) -> None:
        super().__init__()
        self.header = header
        self.logprobs = logprobs
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.open: _OpenItem | None = None
        self.pending_logprobs: list[dict[str, Any]] = []  # not yet sent with a text delta
        self.error: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = self.header.envelope("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (an error body too: the engine died mid-reply)."""
        if "error" in chunk:
            self.error = chunk["error"]
            return [*self._close(cut=True), self._event("error", code=self.error.get("code"), message=self.error.get("message", ""),
                                param=self.error.get("param"))]
        return self.read(chunk)

    def on_choice(self, choice: dict[str, Any]) -> None:
        if self.logprobs and choice.get("logprobs"):
            self.pending_logprobs.extend(choice["logprobs"]["content"])

    def on_reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._text("reasoning", text)

    def on_content(self, text: str) -> list[dict[str, Any]]:
        return self._text("message", text)

    def finish(self) -> list[dict[str, Any]]:
        events = self._close()
        if not self.output and self.error is None:  # nothing but empty text: an empty message, as whole
            events = self._open("message", message_item(new_item_id("msg"), [], "in_progress")) + self._close()
        if self.error is not None:
            # the response's error codes are OpenAI's list; the error event before it has the server's own
            error = {"code": "server_error", "message": self.error.get("message", "")}
            response = self.header.envelope("failed", self.output, response_usage(self.usage), error=error)
            return [*events, self._event("response.failed", response=response)]
        status, incomplete = status_of(self.finish_reason)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        response = self.header.envelope(status, self.output, response_usage(self.usage), incomplete,
                                        failure(status, self.stop_reason))
        return [*events, self._event(kind, response=response)]

    # ---- items -------------------------------------------------------------------------------

    def _open(self, kind: str, item: dict[str, Any], call_index: int | None = None) -> list[dict[str, Any]]:
        events = self._close()
        self.open = _OpenItem(kind, len(self.output), item, call_index=call_index)
        self.output.append(item)
        events.append(self._event("response.output_item.added", output_index=self.open.index, item=dict(item)))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.open.index,
                                      content_index=0, part=text_part("", [] if self.logprobs else None)))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open.kind != kind:
            item = ({"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": [], "status": "in_progress"}
                    if kind == "reasoning" else message_item(new_item_id("msg"), [], "in_progress"))
            events = self._open(kind, item)
        current = self.open
        assert current is not None
        current.text += text
        where = {"item_id": current.item["id"], "output_index": current.index, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        else:
            logprobs, self.pending_logprobs = self.pending_logprobs, []
            current.logprobs += logprobs
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=logprobs))
        return events

    def on_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if "id" in call:  # a call's first delta: its id and name
            events = self._open("function_call", call_item(new_item_id("fc"), call["id"], function.get("name", ""),
                                                           "", "in_progress"), call["index"])
        current = self.open
        arguments = function.get("arguments") or ""
        if current is None or current.kind != "function_call" or current.call_index != call["index"] or not arguments:
            return events
        current.text += arguments
        events.append(self._event("response.function_call_arguments.delta", item_id=current.item["id"],
                                  output_index=current.index, delta=arguments))
        return events

    def _close(self, cut: bool = False) -> list[dict[str, Any]]:
        """The open item's closing events; `cut`: it ended before the model did (the engine failed)."""
        current, self.open = self.open, None
        if current is None:
            return []
        status = "incomplete" if cut or self.finish_reason == "length" else "completed"
        item, where = current.item, {"item_id": current.item["id"], "output_index": current.index}
        events = []
        if current.kind == "reasoning":
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=current.text))
            item.update(reasoning_item(item["id"], current.text, status))
        elif current.kind == "message":
            current.logprobs += self.pending_logprobs
            self.pending_logprobs = []
            logprobs = current.logprobs if self.logprobs else None
            part = text_part(current.text, logprobs)
            events.append(self._event("response.output_text.done", **where, content_index=0, text=current.text,
                                      logprobs=logprobs or []))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
            item.update(message_item(item["id"], [part], status))
        else:
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=current.text))
            item.update(arguments=current.text, status=status)
        events.append(self._event("response.output_item.done", output_index=current.index, item=dict(item)))
        return events


class ResponsesFormat(ChatServed[ResponsesRequest]):
    """The `ReplyFormat` of /v1/responses."""

    id_prefix = "resp_"

    def body(self, reply_id: str, created: int, chat_body: dict[str, Any]) -> dict[str, Any]:
        return response_body(ResponseHeader(reply_id, created, self.request, self.chat), chat_body)

    def events(self, reply_id: str, created: int, prompt_tokens: int) -> ResponseEvents:
        return ResponseEvents(ResponseHeader(reply_id, created, self.request, self.chat), self.request.output_logprobs)
