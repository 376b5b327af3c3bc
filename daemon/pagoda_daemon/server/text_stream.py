"""Helpers for reading generated text piece by piece, shared by the tool-call and reasoning parsers.

Both streamers must hand out exactly what their whole-text counterparts (`parse`, `split`) return,
while a tag may arrive split across pieces and surrounding whitespace is stripped from the whole:
these two helpers are the holding-back that makes the streamed pieces add up to the whole result.
"""

from __future__ import annotations


def tag_prefix_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`: held back from
    the stream until the next piece shows whether the tag is really there."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class StrippedText:
    """Streams text with its surrounding whitespace removed, as `str.strip` would on the whole:
    leading whitespace is dropped, trailing whitespace is held until more text follows it."""

    def __init__(self) -> None:
        self._started = False
        self._held_whitespace = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held_whitespace + text
        kept = text.rstrip()
        self._held_whitespace = text[len(kept):]
        return kept
