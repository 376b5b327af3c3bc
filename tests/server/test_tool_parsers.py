"""Tool-call parsers: model text in, OpenAI tool calls out, whole (`parse`) or streamed.

The examples pin the formats (Qwen3's hermes blocks, Llama 3's bare JSON) and what is refused;
the properties check that a streamer fed any text in any pieces sends deltas of OpenAI's shape
that add up to exactly what `parse` returns for the whole text, and that it never raises.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda_daemon.server.tool_parsers import (
    MAX_NESTING,
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedReply,
    ToolParser,
    parser_for,
)

HERMES = HermesToolParser()
LLAMA3 = Llama3JsonToolParser()
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def block(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def call(name: str, key: str = "arguments", **arguments: Any) -> str:
    return json.dumps({"name": name, key: arguments})


def calls_of(reply: ParsedReply) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


# ---- hermes: parse ---------------------------------------------------------------------------------


def test_hermes_single_call_as_qwen3_writes_it():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    reply = HERMES.parse(text)
    assert reply.content is None
    assert calls_of(reply) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert reply.tool_calls[0].id.startswith("call_") and len(reply.tool_calls[0].id) > len("call_")


def test_hermes_parallel_calls_keep_their_order_and_get_distinct_ids():
    text = "\n".join(block(call(name, n=i)) for i, name in enumerate(["a", "b", "c"]))
    reply = HERMES.parse(text)
    assert reply.content is None
    assert calls_of(reply) == [("a", {"n": 0}), ("b", {"n": 1}), ("c", {"n": 2})]
    assert len({c.id for c in reply.tool_calls}) == 3
    assert calls_of(HERMES.parse(block(call("a")) + block(call("b")))) == [("a", {}), ("b", {})]


def test_hermes_text_around_calls_is_content_stripped_as_a_whole():
    text = "  Let me check.\n" + block(call("f", x=1)) + "\nDone. \n"
    reply = HERMES.parse(text)
    assert reply.content == "Let me check.\n\nDone."
    assert calls_of(reply) == [("f", {"x": 1})]
    between = HERMES.parse(block(call("f")) + " and then " + block(call("g")))
    assert between.content == "and then"
    assert [c.name for c in between.tool_calls] == ["f", "g"]


def test_hermes_plain_text_is_all_content():
    assert HERMES.parse("  Hello, world!\n") == ParsedReply("Hello, world!", [])
    assert HERMES.parse("") == ParsedReply(None, [])
    assert HERMES.parse(" \n\t") == ParsedReply(None, [])


def test_hermes_arguments_as_an_object_are_sent_as_json_text_with_unicode_kept():
    reply = HERMES.parse(block('{"name": "f", "arguments": {"city": "Zürich", "n": [1, 2.5, null, true]}}'))
    (only,) = reply.tool_calls
    assert isinstance(only.arguments, str)
    assert json.loads(only.arguments) == {"city": "Zürich", "n": [1, 2.5, None, True]}
    assert "Zürich" in only.arguments


def test_hermes_arguments_as_a_json_string_are_kept_as_the_model_wrote_them():
    encoded = '{"x":  1, "y": "two"}'
    reply = HERMES.parse(block(json.dumps({"name": "f", "arguments": encoded})))
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("f", encoded)]


def test_hermes_accepts_parameters_and_a_call_without_arguments():
    assert calls_of(HERMES.parse(block(call("f", key="parameters", q="x")))) == [("f", {"q": "x"})]
    reply = HERMES.parse(block('{"name": "now"}'))
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("now", "{}")]


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"x": 1}',  # missing brace
    "not json at all",
    "",
    '{"arguments": {"x": 1}}',  # no name
    '{"name": "", "arguments": {}}',
    '{"name": 7, "arguments": {}}',
    '{"name": "f", "arguments": [1, 2]}',
    '{"name": "f", "arguments": null}',
    '{"name": "f", "arguments": "not json"}',
    '{"name": "f", "arguments": "[1, 2]"}',
    '{"name": "f", "arguments": {}} trailing',
    '["f", {}]',
])
def test_hermes_malformed_block_stays_content_and_other_blocks_still_count(body):
    bad = block(body)
    assert HERMES.parse(bad) == ParsedReply(bad, [])
    reply = HERMES.parse("Hi " + bad + "\n" + block(call("good", x=1)))
    assert reply.content == "Hi " + bad
    assert calls_of(reply) == [("good", {"x": 1})]


def test_hermes_unterminated_block_is_content():
    text = 'Sure. <tool_call>{"name": "f", "arguments": {}}'
    assert HERMES.parse(text) == ParsedReply(text, [])
    after_call = block(call("f")) + "\n<tool_call>" + call("g")
    reply = HERMES.parse(after_call)
    assert reply.content == "<tool_call>" + call("g")
    assert [c.name for c in reply.tool_calls] == ["f"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("as_string", [False, True])
def test_non_finite_numbers_in_arguments_are_refused(value, as_string):
    arguments = f'{{"x": {value}}}'
    body = f'{{"name": "f", "arguments": {json.dumps(arguments) if as_string else arguments}}}'
    assert HERMES.parse(block(body)) == ParsedReply(block(body), [])
    llama = body.replace('"arguments"', '"parameters"')
    assert LLAMA3.parse(llama) == ParsedReply(llama, [])


@pytest.mark.parametrize("parser", [HERMES, LLAMA3], ids=["hermes", "llama3_json"])
def test_lone_surrogate_escapes_stay_escaped_so_the_reply_encodes_as_utf8(parser):
    body = r'{"name": "f", "parameters": {"x": "\ud800 Zürich"}}'
    reply = parser.parse(block(body) if parser is HERMES else body)
    (only,) = reply.tool_calls
    only.arguments.encode()  # a raw lone surrogate here would fail the whole response
    assert json.loads(only.arguments) == {"x": "\ud800 Zürich"}
    double_encoded = r'{"name": "f", "arguments": "{\"x\": \"\ud800\"}"}'  # the outer decode makes it raw
    reply = parser.parse(block(double_encoded) if parser is HERMES else double_encoded)
    (only,) = reply.tool_calls
    only.arguments.encode()
    assert json.loads(only.arguments) == {"x": "\ud800"}
    bad_name = r'{"name": "f\udc00", "parameters": {}}'
    text = block(bad_name) if parser is HERMES else bad_name
    assert parser.parse(text) == ParsedReply(text, [])


def test_deep_nesting_is_content_not_an_exception():
    deep = "[" * 100_000 + "]" * 100_000
    for text in [block(deep), block('{"name": "f", "arguments": {"x": ' + deep + "}}"),
                 block(json.dumps({"name": "f", "arguments": '{"x": ' + deep + "}"}))]:
        assert HERMES.parse(text) == ParsedReply(text, [])
        assert assemble(stream(HERMES, [text])) == (text, [])
    llama = '{"name": "f", "parameters": {"x": ' + deep + "}}"
    assert LLAMA3.parse(llama) == ParsedReply(llama, [])
    assert assemble(stream(LLAMA3, [llama])) == (llama, [])


@pytest.mark.parametrize("parser", [HERMES, LLAMA3], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("as_string", [False, True])
def test_nesting_at_every_depth_gives_the_same_answer_streamed_or_not(parser, as_string):
    """Up to MAX_NESTING deep (the call object included) a call is a call; deeper it is content,
    whether or not the interpreter could decode it from where it is called, and never an error."""
    key = "arguments" if parser is HERMES else "parameters"
    for depth in range(1, sys.getrecursionlimit() + 20):
        arguments = '{"x": ' + "[" * depth + "1" + "]" * depth + "}"  # the call object nests depth + 2 deep
        body = f'{{"name": "f", "{key}": {json.dumps(arguments) if as_string else arguments}}}'
        text = block(body) if parser is HERMES else body
        reply = parser.parse(text)
        if depth + 2 <= MAX_NESTING:
            assert reply.content is None and [c.name for c in reply.tool_calls] == ["f"], depth
            assert json.loads(reply.tool_calls[0].arguments) == json.loads(arguments)
        else:
            assert reply == ParsedReply(text, []), depth
        streamed = assemble(stream(parser, [text]))
        assert streamed == (reply.content, [(c.name, c.arguments) for c in reply.tool_calls]), depth


# ---- llama3_json: parse ----------------------------------------------------------------------------


def test_llama3_single_call_with_parameters_as_meta_asks():
    reply = LLAMA3.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert reply.content is None
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]
    assert reply.tool_calls[0].id.startswith("call_")


def test_llama3_python_tag_whitespace_and_arguments_key():
    reply = LLAMA3.parse('\n <|python_tag|> {"name": "f", "arguments": {"q": 1}} \n')
    assert reply.content is None
    assert calls_of(reply) == [("f", {"q": 1})]


def test_llama3_semicolon_separated_calls():
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}} ;\n{"name": "c", "parameters": {}}'
    reply = LLAMA3.parse(text)
    assert reply.content is None
    assert calls_of(reply) == [("a", {}), ("b", {"x": 1}), ("c", {})]
    assert len({c.id for c in reply.tool_calls}) == 3
    assert calls_of(LLAMA3.parse('{"name": "a", "parameters": {}};')) == [("a", {})]


def test_llama3_plain_text_is_content():
    assert LLAMA3.parse("  The weather in Paris is sunny. \n") == ParsedReply("The weather in Paris is sunny.", [])
    assert LLAMA3.parse("") == ParsedReply(None, [])
    mentions = 'You could call {"name": "f", "parameters": {}} yourself.'
    assert LLAMA3.parse(mentions) == ParsedReply(mentions, [])


@pytest.mark.parametrize("text", [
    '{"answer": 42}',
    '{"name": "f"}',  # Llama's calls always carry parameters
    '{"name": "f", "parameters": [1]}',
    '{"name": "f", "parameters": {}} and some words',
    '{"name": "f", "parameters": {}}; not a call',
    '{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}',  # not separated by ;
    '{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}',
    '{"name": "f", "parameters": {}}; {"answer": 1}',
    '{"name": "f", "parameters": {"x": 1}',
    "{ just braces }",
    "<|python_tag|>print('hi')",
    "<|python_tag|>",
    ";",
])
def test_llama3_text_that_is_not_all_calls_is_content(text):
    assert LLAMA3.parse(text) == ParsedReply(text, [])
    assert LLAMA3.parse(" " + text + "\n") == ParsedReply(text, [])


# ---- streaming: examples ---------------------------------------------------------------------------


def stream(parser: ToolParser, pieces: list[str]) -> list[dict]:
    streamer = parser.streamer()
    deltas = [d for piece in pieces for d in streamer.feed(piece)]
    deltas += streamer.finish()
    return deltas


def assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and (name, arguments) calls, as a client assembles them, checking each delta's shape."""
    content: list[str] = []
    calls: list[dict] = []
    ids: set[str] = set()
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            assert isinstance(delta["content"], str) and delta["content"], delta
            content.append(delta["content"])
            continue
        (entry,) = delta["tool_calls"]
        if "id" in entry:  # the header of a new call
            assert set(entry) == {"index", "id", "type", "function"}, entry
            assert entry["index"] == len(calls)
            assert entry["id"].startswith("call_") and entry["id"] not in ids
            ids.add(entry["id"])
            assert entry["type"] == "function"
            assert isinstance(entry["function"]["name"], str) and entry["function"]["name"]
            assert entry["function"].get("arguments", "") == ""
            calls.append({"name": entry["function"]["name"], "arguments": ""})
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}, entry
            assert entry["index"] == len(calls) - 1  # arguments follow their own header
            calls[-1]["arguments"] += entry["function"]["arguments"]
    return "".join(content) or None, [(c["name"], c["arguments"]) for c in calls]


def test_hermes_streams_content_at_once_and_holds_only_a_possible_tag():
    streamer = HERMES.streamer()
    assert streamer.feed("Hello") == [{"content": "Hello"}]
    assert streamer.feed(" <tool_") == []  # the space waits for what follows; `<tool_` may be a tag
    assert streamer.feed("box>") == [{"content": " <tool_box>"}]
    assert streamer.feed("\n\n") == []
    assert streamer.feed(" x") == [{"content": "\n\n x"}]
    assert not streamer.called


def test_hermes_streams_each_call_as_soon_as_its_block_closes():
    streamer = HERMES.streamer()
    assert streamer.feed("Checking.\n<tool_call>\n") == [{"content": "Checking."}]
    assert streamer.feed('{"name": "f", "arguments": {"x": 1}}\n</tool') == []
    assert not streamer.called
    header, arguments = streamer.feed("_call>\n<tool_call>")
    assert streamer.called
    assert header["tool_calls"][0]["function"]["name"] == "f" and header["tool_calls"][0]["index"] == 0
    assert json.loads(arguments["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    second = streamer.feed(call("g") + "</tool_call>")
    assert [d["tool_calls"][0]["index"] for d in second] == [1, 1]
    assert streamer.finish() == []


def test_llama3_streams_plain_text_at_once_and_holds_a_call_to_the_end():
    streamer = LLAMA3.streamer()
    assert streamer.feed(" ") == []
    assert streamer.feed("The") == [{"content": "The"}]
    assert streamer.feed(" answer") == [{"content": " answer"}]
    calling = LLAMA3.streamer()
    assert calling.feed("<|python") == []
    assert calling.feed('_tag|>{"name": "f", "parameters": {}}') == []
    assert not calling.called
    assert assemble(calling.finish()) == (None, [("f", "{}")])
    assert calling.called


# ---- streaming: properties -------------------------------------------------------------------------

WHITESPACE = st.text(st.sampled_from([" ", "\n", "\t", "\r", "\u00a0", "\u2003", "\x0b", "\x1c"]), max_size=4)
PLAIN = st.one_of(
    st.text(st.sampled_from(list("ab z<>/{}[]\":;,_|\n")), max_size=16),
    st.text(max_size=8),
)
NAMES = st.sampled_from(["get_weather", "search", "f", "lookup_user", "ünïcode_名"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(10**12), 10**12),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                      max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=6), VALUES, max_size=4)


@st.composite
def call_json(draw, keys=("arguments", "parameters", "string", "none")) -> tuple[str, str, dict]:
    """A well-formed call's JSON text, its name and its arguments."""
    name, arguments = draw(NAMES), draw(ARGUMENTS)
    style = draw(st.sampled_from(keys))
    obj: dict[str, Any] = {"name": name}
    if style == "string":
        obj["arguments"] = json.dumps(arguments, ensure_ascii=draw(st.booleans()))
    elif style != "none":
        obj[style] = arguments
    return json.dumps(obj, ensure_ascii=draw(st.booleans())), name, arguments


@st.composite
def hermes_call_block(draw) -> str:
    text, _, _ = draw(call_json())
    return "<tool_call>" + draw(WHITESPACE) + text + draw(WHITESPACE) + "</tool_call>"


MALFORMED_BODIES = [
    '{"name": "f", "arguments": {"x": 1}', "not json", "", '{"arguments": {}}', '{"name": "", "arguments": {}}',
    '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "nope"}', '{"name": "f", "arguments": {"x": NaN}}',
    '{"name": "f", "arguments": {"x": 1e999}}', '{"name": "f"} tail', "[" * 3000 + "]" * 3000,
    '{"name": "f", "arguments": {"x": "<tool_call>"}}', '{"name": "f", "arguments": {"x": "</tool_call>"}}',
]
PARTIAL_TAGS = st.sampled_from(["<tool_", "</tool", "<tool_call", "</tool_call", "<", "</", "tool_call>",
                                "<tool_call>", "</tool_call>", "<|python_tag|>", "<|python", "{", "}", ";"])
HERMES_PIECES = st.one_of(
    PLAIN, WHITESPACE, PARTIAL_TAGS, hermes_call_block(),
    st.sampled_from(MALFORMED_BODIES).map(block),
    st.sampled_from(MALFORMED_BODIES).map(lambda body: "<tool_call>" + body),  # unterminated
    call_json().map(lambda c: c[0]),  # a call's JSON outside any block
)
HERMES_TEXTS = st.lists(HERMES_PIECES, max_size=8).map("".join)


@st.composite
def llama3_text(draw) -> str:
    """A reply of calls as Llama writes them, sometimes spoiled, or any mixture of pieces."""
    if draw(st.booleans()):
        head = draw(WHITESPACE) + draw(st.sampled_from(["", "<|python_tag|>"])) + draw(WHITESPACE)
        calls = draw(st.lists(call_json(keys=("parameters", "arguments", "string")), min_size=1, max_size=3))
        separators = [draw(WHITESPACE) + ";" + draw(WHITESPACE) for _ in calls]
        body = "".join(c[0] + sep for c, sep in zip(calls, separators, strict=True))
        if not draw(st.booleans()):
            body = body[: -len(separators[-1])]
        return head + body + draw(WHITESPACE) + draw(st.one_of(st.just(""), PLAIN, PARTIAL_TAGS))
    pieces = st.one_of(PLAIN, WHITESPACE, PARTIAL_TAGS, call_json().map(lambda c: c[0]),
                       st.sampled_from(MALFORMED_BODIES))
    return "".join(draw(st.lists(pieces, max_size=6)))


def splits(data: st.DataObject, text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut at random places (empty pieces too)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=min(len(text) + 2, 40)), label="cuts"))
    bounds = [0, *cuts, len(text)]
    return [[text], list(text), [text[a:b] for a, b in itertools.pairwise(bounds)]]


def check_stream_matches_parse(parser: ToolParser, text: str, data: st.DataObject) -> None:
    reply = parser.parse(text)
    expected = (reply.content, [(c.name, c.arguments) for c in reply.tool_calls])
    for pieces in splits(data, text):
        assert "".join(pieces) == text
        streamer = parser.streamer()
        sent = [streamer.feed(piece) for piece in pieces]
        deltas = [d for batch in sent for d in batch]
        assert streamer.called == any("tool_calls" in d for d in deltas)
        sent.append(streamer.finish())
        deltas += sent[-1]
        for batch in sent:  # what one piece releases goes out as one content delta, not several
            assert not any("content" in a and "content" in b for a, b in itertools.pairwise(batch)), batch
        assert assemble(deltas) == expected, pieces
        assert streamer.called == bool(reply.tool_calls)


@PROPERTY
@given(HERMES_TEXTS, st.data())
def test_hermes_stream_in_any_pieces_equals_parse(text, data):
    check_stream_matches_parse(HERMES, text, data)


@PROPERTY
@given(llama3_text(), st.data())
def test_llama3_stream_in_any_pieces_equals_parse(text, data):
    check_stream_matches_parse(LLAMA3, text, data)


# ---- parse against an independent model of the format ----------------------------------------------

SAFE_PLAIN = st.text(st.characters(blacklist_characters="<"), max_size=12)  # cannot open or close a block
SAFE_ARGUMENTS = st.dictionaries(st.text(st.characters(blacklist_characters="<"), max_size=5),
                                 st.one_of(st.integers(-(2**70), 2**70), st.text(st.characters(blacklist_characters="<"), max_size=5)),
                                 max_size=3)


@PROPERTY
@given(st.lists(st.one_of(
    st.tuples(st.just("text"), st.one_of(SAFE_PLAIN, WHITESPACE)),
    st.tuples(st.just("call"), st.tuples(NAMES, SAFE_ARGUMENTS, st.sampled_from(["arguments", "parameters"]), WHITESPACE)),
    st.tuples(st.just("bad"), st.sampled_from([b for b in MALFORMED_BODIES if "tool_call" not in b])),
), max_size=8), st.one_of(st.just(""), st.sampled_from(MALFORMED_BODIES).map(lambda body: "<tool_call>" + body)))
def test_hermes_parse_finds_exactly_the_well_formed_blocks(segments, unterminated):
    text, content, expected_calls = "", "", []
    for kind, value in segments:
        if kind == "call":
            name, arguments, key, ws = value
            text += f"<tool_call>{ws}{json.dumps({'name': name, key: arguments})}{ws}</tool_call>"
            expected_calls.append((name, arguments))
        else:
            piece = value if kind == "text" else block(value)
            text += piece
            content += piece
    text += unterminated
    content += unterminated
    reply = HERMES.parse(text)
    assert reply.content == (content.strip() or None)
    assert calls_of(reply) == expected_calls


# ---- choosing a parser -----------------------------------------------------------------------------

QWEN3_TEMPLATE = ("{%- if tools %}For each function call, return a json object with function name and arguments "
                  "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                  "\"arguments\": <args-json-object>}\n</tool_call>{%- endif %}")
LLAMA31_TEMPLATE = "{%- if builtin_tools is defined or tools is not none %}<|python_tag|>{{ tool_call }}{%- endif %}"


def test_parser_for_by_name():
    assert isinstance(parser_for("hermes", None, None), HermesToolParser)
    assert isinstance(parser_for("llama3_json", None, None), Llama3JsonToolParser)
    assert isinstance(parser_for("llama3_json", QWEN3_TEMPLATE, "qwen3"), Llama3JsonToolParser)  # a name wins


def test_parser_for_unknown_name_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="hermes") as error:
        parser_for("mistral_v9", QWEN3_TEMPLATE, None)
    assert "mistral_v9" in str(error.value) and "llama3_json" in str(error.value)


def test_parser_for_detects_the_format_from_the_chat_template():
    assert isinstance(parser_for(None, QWEN3_TEMPLATE, "qwen3"), HermesToolParser)
    assert isinstance(parser_for(None, QWEN3_TEMPLATE, None), HermesToolParser)
    assert isinstance(parser_for(None, LLAMA31_TEMPLATE, "llama"), Llama3JsonToolParser)
    assert isinstance(parser_for(None, LLAMA31_TEMPLATE, None), Llama3JsonToolParser)
    assert isinstance(parser_for(None, "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}", "llama"),
                      Llama3JsonToolParser)


@pytest.mark.parametrize(("template", "model_type"), [
    (None, None), ("", "llama"), ("{% for m in messages %}{{ m.content }}{% endfor %}", "llama"),
    ("{{ tools }} in some other format", "mistral"),
    ("<tools>{{ tools }}</tools> answer with [TOOL_CALLS]", "qwen2"),
])
def test_parser_for_unknown_template_is_none(template, model_type):
    assert parser_for(None, template, model_type) is None
