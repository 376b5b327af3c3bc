"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions.

One builder per request. It sees each generation's outputs (by choice index; ``n`` choices per
prompt) and writes what OpenAI's API and vLLM's server return: logprobs with ``text_offset``,
``echo`` (the prompt, and its logprobs, before the completion), vLLM's ``prompt_logprobs``,
usage with ``prompt_tokens_details.cached_tokens`` (prompt tokens read from the prefix cache)
and, with a reasoning parser, ``completion_tokens_details.reasoning_tokens`` (the generated
tokens up to and including the one that closes the thinking), and usage on every chunk with
``stream_options.continuous_usage_stats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda_daemon.outputs import Logprobs, RequestOutput
from pagoda_daemon.server.chat_reply import ReplyShape, ReplyStreamer, message_fields
from pagoda_daemon.server.reasoning import THINK_CLOSE, single_token_id

Prompt = tuple[str | None, list[int]]  # (prompt text or None, token ids)


@dataclass
class ResponseOptions:
    response_id: str
    created: int
    model: str
    n: int  # choices per prompt
    num_top_logprobs: int | None  # None: no logprobs
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field asked for
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    echo_text: str = ""  # chat: the assistant message echoed before the reply
    token_ids_as_tokens: bool = False  # vLLM's return_tokens_as_token_ids
    continuous_usage: bool = False
    reply: ReplyShape = field(default_factory=ReplyShape)  # chat: reasoning and tool calls


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


# JSON has no -inf (a token masked out by allowed_token_ids, bad_words or a grammar) nor NaN:
# they are sent as vLLM's server sends them, -9999.0
MIN_LOGPROB = -9999.0


def _finite(entry: Logprobs | None) -> Logprobs | None:
    if entry is None or all(v >= MIN_LOGPROB for v in entry.values()):  # NaN fails the comparison
        return entry
    return {t: v if v >= MIN_LOGPROB else MIN_LOGPROB for t, v in entry.items()}


def _top(lp: Logprobs, n: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:n]


@dataclass
class _Choice:
    """What a streamed choice has sent so far."""

    started: bool = False
    completion_tokens: int = 0
    text_offset: int = 0  # where the next token's text starts (the tokens' strings so far, summed)
    cached_tokens: int = 0
    reply: ReplyStreamer | None = None  # chat replies that are not plain content
    thinks: bool = False  # some reasoning was sent
    thought: int = 0  # tokens generated while the thinking lasts
    thought_ids: list[int] = field(default_factory=list)  # those tokens, when `</think>` is not one token
    thought_tail: str = ""  # the text's last characters, where a `</think>` split across outputs begins
    thinking_tokens: int | None = None  # once the thinking has closed: its tokens, the closing one included


class CompletionBuilder:
    object_name = "text_completion"

    def __init__(self, options: ResponseOptions, tokenizer, prompts: list[Prompt]) -> None:
        self.o = options
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.choices: dict[int, _Choice] = {}

    # ---- pieces ------------------------------------------------------------------------

    def envelope(self, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.o.response_id, "object": self.object_name, "created": self.o.created,
                "model": self.o.model, "choices": choices, **extra}

    def token_str(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.o.token_ids_as_tokens else self.tokenizer.decode([token_id])

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.o.n]

    def prompt_text(self, index: int) -> str:
        text, ids = self.prompt_of(index)
        return text if text is not None else self.tokenizer.decode(ids)

    @staticmethod
    def end_offset(logprobs: dict[str, Any] | None) -> int:
        """The text_offset after these logprobs' last token."""
        if not logprobs or not logprobs.get("tokens"):
            return 0
        return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    def _logprobs(self, token_ids: list[int], entries: list[Logprobs | None], offset: int,
                  whole_entries: bool = False) -> dict[str, Any]:
        """OpenAI's completion logprobs for these tokens. text_offset counts the tokens' strings
        from the choice's first token (equal to positions in the text wherever tokens decode
        to whole characters), so streamed and whole answers agree. whole_entries: every
        alternative the engine returned (the prompt's, as vLLM's echo does), else the top
        num_top_logprobs."""
        tokens = [self.token_str(t) for t in token_ids]
        entries = [_finite(e) for e in entries]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        n = self.o.num_top_logprobs or 0
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.get(t) for t, e in zip(token_ids, entries)],
            "top_logprobs": [None if e is None else {self.token_str(k): v for k, v in
                                                     (e.items() if whole_entries else _top(e, n))}
                             for e in entries],
            "text_offset": offsets,
        }

    @staticmethod
    def _join(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
        if a is None or b is None:
            return a or b
        return {key: a[key] + b[key] for key in a}

    def _prompt_logprobs_field(self, out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, decoded_token}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if e is None else {str(t): {"logprob": lp, "decoded_token": self.token_str(t)}
                                        for t, lp in e.items()} for e in map(_finite, out.prompt_logprobs)]

    def _echo(self, index: int, out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text and (with logprobs) its logprobs, for echo."""
        text = self.prompt_text(index)
        if self.o.num_top_logprobs is None:
            return text, None
        ids = self.prompt_of(index)[1]
        entries = out.prompt_logprobs or [None] * len(ids)
        return text, self._logprobs(ids, list(entries), 0, whole_entries=True)

    def cached_tokens(self, finals: dict[int, RequestOutput]) -> int:
        # n generations of one prompt count its tokens once
        return sum(out.num_cached_tokens for index, out in finals.items() if index % self.o.n == 0)

    def prompt_tokens(self, prompt_lens: dict[int, int]) -> int:
        return sum(n for index, n in prompt_lens.items() if index % self.o.n == 0)

    # ---- whole responses -----------------------------------------------------------------

    def _choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        text, logprobs = ("", None) if not self.o.echo else self._echo(index, out)
        if not self.o.echo_only:
            gen = None
            if c.logprobs is not None:
                gen = self._logprobs(c.token_ids, list(c.logprobs), self.end_offset(logprobs))
            text += c.text
            logprobs = self._join(logprobs, gen)
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.o.prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs_field(out)
        return choice

    def completion_tokens(self, out: RequestOutput) -> int:
        return 0 if self.o.echo_only else len(out.outputs[0].token_ids)

    def full(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices = [self._choice(i, finals[i]) for i in sorted(finals)]
        completion = sum(self.completion_tokens(out) for out in finals.values())
        prompt = self.prompt_tokens({i: len(out.prompt_token_ids) for i, out in finals.items()})
        return self.envelope(choices, usage=usage(prompt, completion, self.cached_tokens(finals)))

    # ---- streams ---------------------------------------------------------------------------

    def _chunk_usage(self, index: int, state: _Choice) -> dict[str, Any]:
        return {"usage": usage(len(self.prompt_of(index)[1]), state.completion_tokens)} if self.o.continuous_usage else {}

    def first_chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Sent before a choice's first delta: the echoed prompt (and prompt logprobs)."""
        state = self.choices[index] = _Choice()
        if not self.o.echo and not self.o.prompt_logprobs:
            return []
        choice: dict[str, Any] = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
        if self.o.echo:
            choice["text"], choice["logprobs"] = self._echo(index, out)
            state.text_offset = self.end_offset(choice["logprobs"])
        if self.o.prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs_field(out)
        return [self.envelope([choice], **self._chunk_usage(index, state))]

    def deltas(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks of one DELTA output (often one; none when it carries nothing to send)."""
        chunk = self.delta(index, out)
        return [] if chunk is None else [chunk]

    def delta(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        """One DELTA output as a chunk, or None when it carries nothing to send."""
        state = self.choices[index]
        c = out.outputs[0]
        state.cached_tokens = out.num_cached_tokens
        if self.o.echo_only:
            if c.finish_reason is None:
                return None
            text, token_ids, logprobs = "", [], None
        else:
            text, token_ids, logprobs = c.text, c.token_ids, c.logprobs
            state.completion_tokens += len(token_ids)
        if not (text or token_ids or c.finish_reason is not None or logprobs):
            return None
        lp = None
        if logprobs is not None:
            lp = self._logprobs(token_ids, list(logprobs), state.text_offset)
            state.text_offset = self.end_offset(lp) or state.text_offset
        return self.envelope([self._delta_choice(index, text, lp, c.finish_reason, c.stop_reason)],
                             **self._chunk_usage(index, state))

    def _delta_choice(self, index: int, text: str, logprobs, finish: str | None, stop_reason) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}

    def usage_chunk(self) -> dict[str, Any]:
        prompt = self.prompt_tokens({i: len(self.prompt_of(i)[1]) for i in self.choices})
        completion = sum(s.completion_tokens for s in self.choices.values())
        cached = sum(s.cached_tokens for i, s in self.choices.items() if i % self.o.n == 0)
        return self.envelope([], usage=usage(prompt, completion, cached))

    def finish_reasons(self, finals: dict[int, RequestOutput]) -> str:
        return ",".join(out.outputs[0].finish_reason or "" for _, out in sorted(finals.items()))


def thinking_tokens(tokenizer, token_ids: Sequence[int], close_id: int | None) -> int:
    """How many of these generated tokens think: up to and including the one that completes
    `</think>` (all of them when it has not come). Without a single closing token (`close_id`
    None), the fewest tokens whose text holds the tag (a binary search over decoded prefixes)."""
    if close_id is not None:
        for i, token in enumerate(token_ids):
            if token == close_id:
                return i + 1
        return len(token_ids)
    if THINK_CLOSE not in tokenizer.decode(list(token_ids)):
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_CLOSE in tokenizer.decode(list(token_ids[:mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


class ChatBuilder(CompletionBuilder):
    object_name = "chat.completion.chunk"

    def __init__(self, options: ResponseOptions, tokenizer, prompts: list[Prompt]) -> None:
        super().__init__(options, tokenizer, prompts)
        # the token that ends the thinking, with a reasoning parser (None: spelled in pieces)
        self.close_id = None if options.reply.reasoning is None else single_token_id(tokenizer, THINK_CLOSE)

    def _with_reasoning_tokens(self, body: dict[str, Any], count: int) -> dict[str, Any]:
        if self.o.reply.reasoning is not None:
            body["usage"]["completion_tokens_details"] = {"reasoning_tokens": count}
        return body

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, token_ids, entries, offset, whole_entries=False):
        n = self.o.num_top_logprobs or 0
        entries = [_finite(e) for e in entries]
        return {"content": [
            {**self._entry(t, e.get(t)), "top_logprobs": [self._entry(k, v) for k, v in _top(e, n)]}
            for t, e in zip(token_ids, entries)
        ]}

    def _choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        lp = None if c.logprobs is None else self._logprobs(c.token_ids, list(c.logprobs), 0)
        shape = self.o.reply
        reply = shape.whole(c.text)
        content = reply.content
        if self.o.echo_text:
            content = self.o.echo_text + (content or "")
        message = {"role": "assistant", "content": content, **message_fields(shape, reply)}
        return {"index": index, "message": message, "logprobs": lp,
                "finish_reason": shape.finish_reason(c.finish_reason, bool(reply.tool_calls)),
                "stop_reason": c.stop_reason}

    def full(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        body = super().full(finals)
        body["object"] = "chat.completion"
        parser = self.o.reply.reasoning
        if parser is not None:  # (the reasoning split alone: `whole` would parse tool calls again)
            outputs = [out.outputs[0] for out in finals.values()]
            self._with_reasoning_tokens(body, sum(
                thinking_tokens(self.tokenizer, c.token_ids, self.close_id)
                for c in outputs if parser.split(c.text).reasoning is not None))
        if self.o.prompt_logprobs:  # vLLM puts the (one) prompt's on the response
            body["prompt_logprobs"] = self._prompt_logprobs_field(finals[min(finals)])
        return body

    def first_chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        state = self.choices[index] = _Choice()
        if not self.o.reply.plain:
            state.reply = self.o.reply.streamer()
        delta: dict[str, Any] = {"role": "assistant", "content": self.o.echo_text}
        extra: dict[str, Any] = {}
        if self.o.prompt_logprobs:
            extra["prompt_logprobs"] = self._prompt_logprobs_field(out)
        return [self.envelope([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
                              **extra, **self._chunk_usage(index, state))]

    def deltas(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Plain content streams as it comes; a reply with reasoning or tools goes through its
        streamer, which may hold text back (a tag not yet complete, a call not yet closed) and
        then send several deltas at once. The output's logprobs ride on its first chunk, the
        finish reason on its last."""
        state = self.choices[index]
        if state.reply is None:
            return super().deltas(index, out)
        c = out.outputs[0]
        state.cached_tokens = out.num_cached_tokens
        state.completion_tokens += len(c.token_ids)
        self._count_thinking(state, c.token_ids, c.text)
        pieces = state.reply.feed(c.text)
        finish = None
        if c.finish_reason is not None:
            pieces += state.reply.finish()
            finish = self.o.reply.finish_reason(c.finish_reason, state.reply.called)
            if not pieces:
                pieces = [{}]
        state.thinks = state.thinks or any(piece.get("reasoning_content") for piece in pieces)
        lp = None if c.logprobs is None else self._logprobs(c.token_ids, list(c.logprobs), 0)
        if not pieces and lp is not None:
            pieces = [{}]
        chunks = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            choice = {"index": index, "delta": piece, "logprobs": lp if i == 0 else None,
                      "finish_reason": finish if last else None, "stop_reason": c.stop_reason if last else None}
            chunks.append(self.envelope([choice], **self._chunk_usage(index, state)))
        return chunks

    def _count_thinking(self, state: _Choice, token_ids: Sequence[int], text: str) -> None:
        """Counts a streamed choice's tokens until its thinking closes: by the closing token when
        `</think>` is one, else by looking for the tag where this output's text meets the last's
        (then the kept tokens say which completed it)."""
        if self.o.reply.reasoning is None or state.thinking_tokens is not None:
            return
        if self.close_id is not None:
            state.thought += thinking_tokens(self.tokenizer, token_ids, self.close_id)
            if self.close_id in token_ids:
                state.thinking_tokens = state.thought
            return
        state.thought += len(token_ids)
        state.thought_ids += token_ids
        window = state.thought_tail + text
        if THINK_CLOSE in window:
            state.thinking_tokens = thinking_tokens(self.tokenizer, state.thought_ids, None)
            state.thought_ids = []
        else:
            state.thought_tail = window[-(len(THINK_CLOSE) - 1):]

    def usage_chunk(self) -> dict[str, Any]:
        chunk = super().usage_chunk()
        count = sum(s.thought if s.thinking_tokens is None else s.thinking_tokens
                    for s in self.choices.values() if s.thinks)
        return self._with_reasoning_tokens(chunk, count)

    def _delta_choice(self, index: int, text: str, logprobs, finish: str | None, stop_reason) -> dict[str, Any]:
        # a token whose text is held back still sends content "" (as vLLM's server does); only the
        # closing chunk, with nothing new, has an empty delta
        return {"index": index, "delta": {"content": text} if text or finish is None else {}, "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": stop_reason}
