"""A chat reply read whole and read streamed in random pieces gives the same message: reasoning,
content and tool calls, for every tool_choice mode, with and without a reasoning parser."""

from __future__ import annotations

import json
import random

import pytest

from pagoda_daemon.server.chat_reply import ReplyShape, required_calls
from pagoda_daemon.server.reasoning import reasoning_parser_for
from pagoda_daemon.server.tool_parsers import HermesToolParser

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
REQUIRED = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
SHAPES = {
    "plain+reasoning": ReplyShape(reasoning=reasoning_parser_for("qwen3")),
    "auto": ReplyShape("auto", HermesToolParser()),
    "auto+reasoning": ReplyShape("auto", HermesToolParser(), reasoning=reasoning_parser_for("qwen3")),
    "auto, one call": ReplyShape("auto", HermesToolParser(), parallel_tool_calls=False),
    "required": ReplyShape("required"),
    "named": ReplyShape("named", function_name="f"),
    "named+reasoning": ReplyShape("named", function_name="f", reasoning=reasoning_parser_for("deepseek_r1")),
}
TEXTS = ["", "plain answer", f"<think>\nhm\n</think>\n\nok {CALL}", f"{CALL}\n{CALL} tail", REQUIRED,
         REQUIRED[:-3], '{"x": 1}', "<think>never closed", f"before <tool_ {CALL}", "[]", '[{"name": 1}]']


def streamed(shape: ReplyShape, text: str, rng: random.Random) -> dict:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    streamer = shape.streamer()
    deltas = [d for piece in pieces for d in streamer.feed(piece)] + streamer.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.get("tool_calls", ()):
            slot = calls.setdefault(call["index"], ["", ""])
            if "id" in call:
                slot[0] = call["function"]["name"]
            slot[1] += call["function"].get("arguments", "")
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)], "called": streamer.called}


@pytest.mark.parametrize("name", SHAPES)
def test_streamed_pieces_assemble_to_the_whole_reply(name):
    shape, rng = SHAPES[name], random.Random()
    for text in TEXTS:
        reply = shape.whole(text)
        expected = {"content": reply.content or None, "reasoning": reply.reasoning,
                    "calls": [(c.name, c.arguments) for c in reply.tool_calls], "called": bool(reply.tool_calls)}
        for _ in range(20):
            assert streamed(shape, text, rng) == expected, (name, text)


def test_what_each_mode_makes_of_a_reply():
    assert [c.name for c in SHAPES["auto"].whole(f"{CALL}{CALL}").tool_calls] == ["f", "f"]
    assert len(SHAPES["auto, one call"].whole(f"{CALL}{CALL}").tool_calls) == 1
    reply = SHAPES["auto+reasoning"].whole(f"<think>plan</think>\n{CALL}")
    assert reply.reasoning == "plan" and reply.content is None and reply.tool_calls[0].arguments == '{"x": 1}'
    assert [(c.name, json.loads(c.arguments)) for c in SHAPES["required"].whole(REQUIRED).tool_calls] == [
        ("f", {"x": 1}), ("g", {})]
    assert SHAPES["required"].whole(REQUIRED[:-3]).content == REQUIRED[:-3]  # cut short: content
    assert SHAPES["named"].whole('{"x": 1}').tool_calls[0].arguments == '{"x": 1}'
    assert SHAPES["auto"].finish_reason("stop", True) == "tool_calls"
    assert SHAPES["named"].finish_reason("stop", True) == "stop"  # as OpenAI: the caller forced it
    assert SHAPES["auto"].finish_reason("length", True) == "length"


def test_required_calls_refuse_what_clients_cannot_read():
    assert required_calls('[{"name": "f", "parameters": {"x": 1e999}}]') is None  # would be Infinity
    assert required_calls('[{"name": "f", "parameters": {"x": 1}}') is None
    assert required_calls('[{"name": "f"}]') is None
    assert required_calls("[]") is None
    calls = required_calls('[{"name": "f", "parameters": {"s": "\\ud800"}}]')
    assert calls is not None and calls[0].arguments.encode()  # a lone surrogate stays escaped: sendable
