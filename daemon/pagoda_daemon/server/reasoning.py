"""Separate a reasoning model's thinking from its answer, as vLLM's `reasoning_content` does.

Reasoning models (Qwen3, DeepSeek-R1) think inside `<think> ... </think>` before they answer.
Clients want the answer as `content` and the thinking apart, as `reasoning_content`. `split`
reads a finished reply; `streamer` reads one piece at a time. Both read text the same way, so
the streamed pieces of each kind concatenate to exactly what `split` returns.

Whitespace: the reasoning is stripped at both ends (Qwen3 writes `<think>\\n...\\n</think>`) and
the answer after `</think>` loses its leading whitespace (Qwen3 writes `</think>\\n\\n`). A reply
that never thinks is content exactly as generated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from pagoda_daemon.server.text_stream import StrippedText, tag_prefix_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@functools.lru_cache(maxsize=8)
def single_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer spells it as one token, else None (asked for every
    reasoning request with the server's one tokenizer: cached)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def constraint_start(tokenizer, prompt_token_ids: list[int]) -> int | None:
    """The token a structured-output constraint should start after when a reasoning parser is on:
    the id of `</think>`, so that the model thinks freely and its answer is constrained (vLLM's
    rule: the grammar starts once the reasoning has ended). None, constraining from the first
    token, when the tokenizer has no single `</think>` token or when the prompt has already closed
    the thinking (its last think tag is `</think>`, as Qwen3's template writes with
    enable_thinking false)."""
    close = single_token_id(tokenizer, THINK_CLOSE)
    if close is None:
        return None
    open_ = single_token_id(tokenizer, THINK_OPEN)
    for token in reversed(prompt_token_ids):
        if token == close:
            return None
        if token == open_:
            break
    return close


@dataclass
class SplitReply:
    """A reply split into thinking and answer; each is None when the reply has none of it."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """Thinking in `<think> ... </think>` at the start of the reply, then the answer.

    The reply thinks when it opens with `<think>` (after any whitespace) or when it starts inside
    the thinking because the prompt ended with the opening tag (`starts_in_reasoning`). Thinking
    with no `</think>` by the end is all reasoning, and the reply has no content."""

    name: ClassVar[str]
    starts_in_reasoning_always: ClassVar[bool] = False

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning or self.starts_in_reasoning_always

    def split(self, text: str) -> SplitReply:
        """Splits a finished reply into its thinking and its answer."""
        rest = text.lstrip()
        if rest.startswith(THINK_OPEN):
            rest = rest[len(THINK_OPEN):]
        elif self.starts_in_reasoning:
            rest = text
        else:
            return SplitReply(None, text or None)
        reasoning, closed, content = rest.partition(THINK_CLOSE)
        return SplitReply(reasoning.strip() or None, (content.lstrip() or None) if closed else None)

    def streamer(self) -> ReasoningStreamer:
        """A fresh streamer for one choice of a streamed reply."""
        return ReasoningStreamer(self.starts_in_reasoning)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes `<think>` itself; with `enable_thinking=False` its template closes an empty
    thinking block in the prompt, and the reply is all content."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1's template ends the prompt with `<think>`, so a reply starts inside the thinking
    whether or not the caller says so; text before `</think>` is reasoning, as in vLLM."""

    name = "deepseek_r1"
    starts_in_reasoning_always = True


class ReasoningStreamer:
    """Reads one choice's text piece by piece; each call returns (reasoning piece, content piece),
    either possibly empty, holding back what may be the start of a tag until it is decided."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = "start"  # "start" (an opening tag may follow), "reasoning", "answer", "content"
        self._pending = ""
        self._reasoning = StrippedText()
        self._answer_started = False

    def feed(self, delta_text: str) -> tuple[str, str]:
        """The reasoning and content to send for this newly generated piece of text."""
        self._pending += delta_text
        if self._state == "start":
            head = self._pending.lstrip()
            if head.startswith(THINK_OPEN):
                self._state, self._pending = "reasoning", head[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(head):  # only whitespace or part of the tag so far
                return "", ""
            else:
                self._state = "reasoning" if self._starts_in_reasoning else "content"
        if self._state == "reasoning":
            return self._feed_reasoning()
        return "", self._take_content()

    def finish(self) -> tuple[str, str]:
        """What was held back, once the choice has ended."""
        if self._state == "start":
            self._state = "reasoning" if self._starts_in_reasoning else "content"
        if self._state == "reasoning":
            reasoning, self._pending = self._reasoning.push(self._pending), ""
            return reasoning, ""
        return "", self._take_content()

    def _feed_reasoning(self) -> tuple[str, str]:
        end = self._pending.find(THINK_CLOSE)
        if end < 0:
            keep = len(self._pending) - tag_prefix_len(self._pending, THINK_CLOSE)
            reasoning, self._pending = self._pending[:keep], self._pending[keep:]
            return self._reasoning.push(reasoning), ""
        reasoning = self._reasoning.push(self._pending[:end])  # its trailing whitespace stays held: dropped
        self._state, self._pending = "answer", self._pending[end + len(THINK_CLOSE):]
        return reasoning, self._take_content()

    def _take_content(self) -> str:
        text, self._pending = self._pending, ""
        if self._state == "answer" and not self._answer_started:
            text = text.lstrip()
            self._answer_started = bool(text)
        return text


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser_for(name: str, starts_in_reasoning: bool = False) -> ReasoningParser:
    """The parser named as vLLM's --reasoning-parser names it."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](starts_in_reasoning)
