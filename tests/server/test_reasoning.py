"""Reasoning parsers: a reply's `<think> ... </think>` apart from its answer, whole (`split`) or streamed.

The examples pin how Qwen3 and DeepSeek-R1 replies split; the property checks that a streamer fed
any text in any pieces sends reasoning and content that add up to exactly what `split` returns.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda_daemon.server.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    SplitReply,
    constraint_start,
    reasoning_parser_for,
)

QWEN3 = Qwen3ReasoningParser()
QWEN3_IN_REASONING = Qwen3ReasoningParser(starts_in_reasoning=True)
DEEPSEEK_R1 = DeepSeekR1ReasoningParser()
ALL = [QWEN3, QWEN3_IN_REASONING, DEEPSEEK_R1]
IDS = ["qwen3", "qwen3-starts-in-reasoning", "deepseek_r1"]
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- split -----------------------------------------------------------------------------------------


def test_qwen3_reply_as_it_writes_it():
    reply = QWEN3.split("<think>\nThe user wants a greeting.\n</think>\n\nHello!")
    assert reply == SplitReply("The user wants a greeting.", "Hello!")


def test_answer_keeps_its_inner_and_trailing_whitespace():
    assert QWEN3.split("<think>r</think>\n\nline one\n\nline two\n") == SplitReply("r", "line one\n\nline two\n")


def test_reply_that_never_thinks_is_content_exactly_as_generated():
    assert QWEN3.split("  Hello!\n") == SplitReply(None, "  Hello!\n")
    assert QWEN3.split("") == SplitReply(None, None)
    assert QWEN3.split(" \n") == SplitReply(None, " \n")
    # a tag that does not open the reply is only text
    assert QWEN3.split("Sure. <think>x</think> done") == SplitReply(None, "Sure. <think>x</think> done")
    assert QWEN3.split("</think>x") == SplitReply(None, "</think>x")


def test_opening_tag_after_leading_whitespace_still_opens_the_thinking():
    assert QWEN3.split(" \n<think>r</think>a") == SplitReply("r", "a")


def test_thinking_without_a_closing_tag_is_all_reasoning():
    assert QWEN3.split("<think>\nstill thinking about it ") == SplitReply("still thinking about it", None)
    assert QWEN3.split("<think>partial </thi") == SplitReply("partial </thi", None)
    assert DEEPSEEK_R1.split("hmm, let me see") == SplitReply("hmm, let me see", None)


def test_empty_thinking_and_empty_answer_are_none():
    assert QWEN3.split("<think>\n\n</think>\n\nHi") == SplitReply(None, "Hi")  # enable_thinking=False shape
    assert QWEN3.split("<think>r</think>  \n") == SplitReply("r", None)
    assert QWEN3.split("<think></think>") == SplitReply(None, None)


def test_only_the_first_closing_tag_ends_the_thinking():
    assert QWEN3.split("<think>a</think>b</think>c") == SplitReply("a", "b</think>c")


def test_deepseek_r1_reply_starts_inside_the_thinking():
    assert DEEPSEEK_R1.starts_in_reasoning
    assert DEEPSEEK_R1.split("Let me think.\n</think>\n\nThe answer is 4.") == SplitReply("Let me think.", "The answer is 4.")
    assert DEEPSEEK_R1.split("<think>\nr\n</think>a") == SplitReply("r", "a")  # writing the tag again is fine
    assert DeepSeekR1ReasoningParser(starts_in_reasoning=False).starts_in_reasoning


def test_starts_in_reasoning_when_the_prompt_opened_the_thinking():
    assert QWEN3_IN_REASONING.split("r</think>a") == SplitReply("r", "a")
    assert QWEN3.split("r</think>a") == SplitReply(None, "r</think>a")
    assert QWEN3_IN_REASONING.split("") == SplitReply(None, None)


# ---- streaming: examples ---------------------------------------------------------------------------


def stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    streamer = parser.streamer()
    sent = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    return "".join(r for r, _ in sent) or None, "".join(c for _, c in sent) or None


def test_streamer_sends_reasoning_and_answer_as_they_come():
    streamer = QWEN3.streamer()
    assert streamer.feed("<thi") == ("", "")
    assert streamer.feed("nk>\nFirst") == ("First", "")
    assert streamer.feed(" step.\n</th") == (" step.", "")  # the newline waits; `</th` may close
    assert streamer.feed("ink>\n\nHel") == ("", "Hel")
    assert streamer.feed("lo ") == ("", "lo ")
    assert streamer.finish() == ("", "")


def test_streamer_sends_a_reply_without_thinking_at_once():
    streamer = QWEN3.streamer()
    assert streamer.feed(" ") == ("", "")  # a tag may still follow
    assert streamer.feed("Hi") == ("", " Hi")
    assert streamer.feed(" <think>") == ("", " <think>")


def test_streamer_releases_a_held_partial_tag_that_was_not_one():
    streamer = QWEN3.streamer()
    assert streamer.feed("<think>a </thin") == ("a", "")
    assert streamer.feed("g") == (" </thing", "")
    assert streamer.finish() == ("", "")


# ---- streaming: property ---------------------------------------------------------------------------

WHITESPACE = st.text(st.sampled_from([" ", "\n", "\t", "\r", "\u00a0", "\u2003", "\x0b"]), max_size=4)
PLAIN = st.one_of(st.text(st.sampled_from(list("ab z<>/thinkTHINK\n")), max_size=12), st.text(max_size=8))
TAGS = st.sampled_from(["<think>", "</think>", "<thi", "</thi", "<", "</", "think>", "<think", "</think",
                        "<THINK>", "< think>"])


@st.composite
def reasoning_text(draw) -> str:
    """A reply as a reasoning model writes one, often spoiled, or any mixture of tags and text."""
    if draw(st.booleans()):
        open_tag = draw(st.sampled_from(["<think>", "", "<thi"]))
        close_tag = draw(st.sampled_from(["</think>", "", "</thi", "</think"]))
        return (draw(WHITESPACE) + open_tag + draw(WHITESPACE) + draw(PLAIN) + draw(WHITESPACE) + close_tag
                + draw(WHITESPACE) + draw(PLAIN) + draw(WHITESPACE) + draw(st.sampled_from(["", "<thi", "</thi", "<"])))
    return "".join(draw(st.lists(st.one_of(PLAIN, WHITESPACE, TAGS), max_size=8)))


@pytest.mark.parametrize("parser", ALL, ids=IDS)
@PROPERTY
@given(text=reasoning_text(), data=st.data())
def test_stream_in_any_pieces_equals_split(parser, text, data):
    expected = parser.split(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=min(len(text) + 2, 40)), label="cuts"))
    bounds = [0, *cuts, len(text)]
    for pieces in [[text], list(text), [text[a:b] for a, b in itertools.pairwise(bounds)]]:
        assert stream(parser, pieces) == (expected.reasoning, expected.content), pieces


# ---- choosing a parser -----------------------------------------------------------------------------


def test_reasoning_parser_for_by_name():
    qwen3 = reasoning_parser_for("qwen3")
    assert isinstance(qwen3, Qwen3ReasoningParser) and not qwen3.starts_in_reasoning
    assert reasoning_parser_for("qwen3", starts_in_reasoning=True).starts_in_reasoning
    deepseek = reasoning_parser_for("deepseek_r1")
    assert isinstance(deepseek, DeepSeekR1ReasoningParser) and deepseek.starts_in_reasoning


def test_reasoning_parser_for_unknown_name_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1") as error:
        reasoning_parser_for("granite")
    assert "granite" in str(error.value) and "qwen3" in str(error.value)


class ThinkTokenizer:
    """What constraint_start asks of a tokenizer: `<think>` 7 and `</think>` 8 as single tokens
    (as Qwen3's 151667 and 151668), or spelled in pieces."""

    def __init__(self, single: bool = True) -> None:
        self.single = single

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.single:
            return {"<think>": [7], "</think>": [8]}[text]
        return [ord(c) for c in text]


@pytest.mark.parametrize("prompt, want", [
    ([1, 2, 3], 8),  # thinking on (the template writes no tag): the answer comes after </think>
    ([1, 2, 7], 8),  # the prompt opened the thinking (DeepSeek-R1 style)
    ([1, 7, 5, 8, 5], None),  # enable_thinking false: the prompt closed it, constrain from the start
    ([1, 7, 8, 2, 7], 8),  # an earlier turn closed a thought, the last tag opens one
    ([], 8),
])
def test_constraint_starts_after_the_end_of_thinking(prompt, want):
    assert constraint_start(ThinkTokenizer(), prompt) == want


def test_no_single_end_of_thinking_token_constrains_from_the_start():
    assert constraint_start(ThinkTokenizer(single=False), [1, 2, 3]) is None


@pytest.mark.parametrize("single_token", [True, False])
def test_thinking_tokens_are_counted_up_to_the_one_that_closes_it(tiny_models, single_token):
    """With `</think>` one token (Qwen3's, DeepSeek-R1's tokenizers) the count is its position;
    spelled in pieces (the tiny tokenizer's own), the fewest tokens whose text holds it. Both
    count the same generated tokens."""
    from transformers import AutoTokenizer

    from pagoda_daemon.server.responses import thinking_tokens

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    if single_token:
        tokenizer.add_tokens(["</think>"])
    close = tokenizer.encode("</think>", add_special_tokens=False)
    assert (len(close) == 1) == single_token
    rng = random.Random()
    thought = " ".join(rng.choice(["plan", "weather", "2+2", "東京", "so"]) for _ in range(rng.randint(1, 12)))
    head = tokenizer.encode(f"<think>\n{thought}\n</think>", add_special_tokens=False)
    ids = head + tokenizer.encode("\n\nThe answer.", add_special_tokens=False)
    close_id = close[0] if single_token else None
    assert thinking_tokens(tokenizer, ids, close_id) == len(head)
    assert thinking_tokens(tokenizer, head[:-1], close_id) == len(head) - 1  # not closed yet: every token
    assert thinking_tokens(tokenizer, [], close_id) == 0


@pytest.mark.parametrize("single_token", [True, False])
def test_a_streamed_reply_counts_the_thinking_tokens_the_whole_one_does(tiny_models, single_token):
    """ChatBuilder's count, fed the reply's tokens in random pieces, equals its count of the whole reply."""
    from transformers import AutoTokenizer

    from pagoda_daemon.outputs import CompletionOutput, RequestOutput
    from pagoda_daemon.server.chat_reply import ReplyShape
    from pagoda_daemon.server.responses import ChatBuilder, ResponseOptions

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    if single_token:
        tokenizer.add_tokens(["</think>"])
    rng = random.Random()
    thought = " ".join(rng.choice(["plan", "2+2", "東京", "so"]) for _ in range(rng.randint(1, 12)))
    ids = tokenizer.encode(f"<think>\n{thought}\n</think>\n\nIt is 4.", add_special_tokens=False)
    options = ResponseOptions("chatcmpl-x", 0, "m", 1, None, reply=ReplyShape(reasoning=reasoning_parser_for("qwen3")))

    def output(token_ids: list[int], finish: str | None) -> RequestOutput:
        text = tokenizer.decode(token_ids)
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, token_ids, finish)], finished=bool(finish))

    whole = ChatBuilder(options, tokenizer, [(None, [1])]).full({0: output(ids, "stop")})
    streamed = ChatBuilder(options, tokenizer, [(None, [1])])
    start = 0
    while start < len(ids):
        end = min(len(ids), start + rng.randint(1, 3))
        piece = output(ids[start:end], "stop" if end == len(ids) else None)
        if start == 0:
            streamed.first_chunks(0, piece)
        streamed.deltas(0, piece)
        start = end
    count = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert streamed.usage_chunk()["usage"]["completion_tokens_details"]["reasoning_tokens"] == count
    assert 0 < count < len(ids)
