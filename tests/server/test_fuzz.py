"""Property-based fuzzing of the OpenAI API against one real `pagoda serve` on loopback.

Thousands of generated requests across /v1/completions, /v1/chat/completions, /v1/responses and
/v1/messages: valid
bodies within every bound, hostile values (numbers past int64, NaN and infinities as JSON
literals, floats for ints, lone surrogates, deep nesting, empty strings and lists, unknown
and missing fields, malformed JSON), streamed and not, some aborted by the client. Each
answer must be a 200 of the right shape or a 400 in the API's error shape, and afterwards
the engine must live with nothing in flight, queued or allocated, and the API's memory
must not have grown.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from dataclasses import dataclass

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}
RAW = "__raw_json__"  # a string value replaced by raw JSON text after encoding
EXAMPLES = 450
MIN_REQUESTS = 3000

# ---- valid bodies ---------------------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
token_ids = st.lists(st.integers(0, 511), min_size=1, max_size=12)
optional_fields: dict = {
    "n": st.integers(1, 3),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.one_of(st.integers(-1, 600), st.just(2**63 - 1), st.integers(2**31, 2**200)),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(text, st.lists(text, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=4),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 100.0),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "user": st.text(max_size=16),
    "cache_salt": st.text(max_size=16),
    # vLLM's extra fields
    "spaces_between_special_tokens": st.booleans(),
    "request_id": st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=16),
    "priority": st.just(0),
    "truncate_prompt_tokens": st.one_of(st.just(-1), st.integers(1, 40)),
    "allowed_token_ids": st.lists(st.integers(0, 511), min_size=1, max_size=8),
    "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-150, 150), max_size=6),  # clamped past 100
    "bad_words": st.lists(text, max_size=3),
    "prompt_logprobs": st.integers(0, 20),
    "return_tokens_as_token_ids": st.booleans(),
    "add_special_tokens": st.booleans(),
}
# output constraints: one per body where they are valid (two are a 400, which hostile bodies cover)
schemas = st.sampled_from([{"type": "integer"}, {"type": "object", "properties": {"a": {"type": "string",
                           "maxLength": 3}}, "required": ["a"]}, {"enum": ["x", "y"]}, {}])
constraint_fields = {
    "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                                 st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "s", "schema": s}},
                                           schemas)),
    "structured_outputs": st.sampled_from([{"choice": ["a", "b"]}, {"regex": "[a-z]{1,4}"}, {"json": {"type": "integer"}},
                                           {"grammar": 'root ::= "x"+'}, {"json_object": True}]),
    "guided_json": st.one_of(schemas, schemas.map(json.dumps)),
    "guided_regex": st.sampled_from(["[0-9]+", "(yes|no)", ".{1,3}"]),
    "guided_choice": st.lists(st.text(st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"]), min_size=1,
                                      max_size=8), min_size=1, max_size=3),
    "guided_grammar": st.sampled_from(['root ::= "a" | "b"', 'root ::= [0-9]{1,3}']),
    "guided_decoding_backend": st.sampled_from(["xgrammar", "auto"]),
}
tool = st.builds(lambda name, params: {"type": "function", "function": {"name": name, **params}},
                 st.sampled_from(["f", "get_weather", "a.b-c_9"]),
                 st.sampled_from([{}, {"parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}]))
tool_fields = {"tools": st.lists(tool, min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"]),
               "tool_choice": st.sampled_from(["none", "auto", "required"]), "parallel_tool_calls": st.booleans()}
completion_fields = {**optional_fields, "logprobs": st.integers(0, 20), "echo": st.booleans()}
chat_fields = {**optional_fields, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
               "max_completion_tokens": st.integers(2, 6), "add_generation_prompt": st.booleans(),
               "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), st.booleans()),
               "documents": st.lists(st.fixed_dictionaries({"title": text, "text": text}), max_size=2),
               "echo": st.booleans(), "continue_final_message": st.just(False), "modalities": st.just(["text"]),
               "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"]),
               **tool_fields}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                         min_size=1, max_size=2))},
    optional={"name": st.text(st.characters(codec="utf-8"), max_size=8)})
# Responses: its own fields, and every sampling field the chat endpoint takes under the same name
responses_tool = st.builds(lambda t: {"type": "function", **t["function"]}, tool)
format_of = st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                      st.builds(lambda s: {"type": "json_schema", "name": "s", "schema": s}, schemas))
responses_fields = {
    **{k: v for k, v in optional_fields.items() if k != "n"},
    "instructions": text, "include": st.just(["message.output_text.logprobs"]), "top_logprobs": st.integers(0, 20),
    "text": st.builds(lambda f: {"format": f}, format_of),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low", "high"]),
                                                     "summary": st.just("auto")}),
    "tools": st.lists(responses_tool, min_size=1, max_size=3, unique_by=lambda t: t["name"]),
    "tool_choice": st.sampled_from(["none", "auto", "required"]), "parallel_tool_calls": st.booleans(),
    "store": st.booleans(), "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "truncation": st.sampled_from(["auto", "disabled"]), "max_tool_calls": st.integers(1, 4),
}
input_item = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("input_text"), "text": text}),
                                         min_size=1, max_size=2))},
    optional={"type": st.just("message")})
# Anthropic's Messages: its own fields, and the chat sampling fields under their own names
anthropic_tool = st.builds(lambda t: {"name": t["function"]["name"], "input_schema": t["function"].get(
    "parameters", {"type": "object", "properties": {}})}, tool)
messages_fields = {
    **{k: v for k, v in optional_fields.items() if k not in ("n", "stop")},
    "system": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)),
    "stop_sequences": st.lists(text, max_size=4),
    "tools": st.lists(anthropic_tool, min_size=1, max_size=3, unique_by=lambda t: t["name"]),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])},
                                         optional={"disable_parallel_tool_use": st.booleans()}),
    "thinking": st.one_of(st.just({"type": "disabled"}), st.just({"type": "adaptive"}),
                          st.builds(lambda b: {"type": "enabled", "budget_tokens": b}, st.integers(1024, 4096))),
    "output_config": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high", "max"])}),
    "metadata": st.fixed_dictionaries({}, optional={"user_id": st.text(max_size=8)}),
    "service_tier": st.sampled_from(["auto", "standard_only"]),
}
anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                         min_size=1, max_size=2))})


def body_of(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"model": st.just(MODEL_NAME), **required}, optional=optional)


valid_completion = body_of(
    {"prompt": st.one_of(text, token_ids, st.lists(text, min_size=1, max_size=3),
                         st.lists(token_ids, min_size=1, max_size=3)),
     "max_tokens": st.integers(1, 6)}, completion_fields)
valid_chat = body_of({"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)},
                     chat_fields)
valid_responses = body_of({"input": st.one_of(text, st.lists(input_item, min_size=1, max_size=3)),
                           "max_output_tokens": st.integers(1, 6)}, responses_fields)
valid_messages = body_of({"messages": st.lists(anthropic_message, min_size=1, max_size=3),
                          "max_tokens": st.integers(1, 6)}, messages_fields)
VALID = {"completion": valid_completion, "chat": valid_chat, "responses": valid_responses, "messages": valid_messages}

# ---- hostile values -------------------------------------------------------------------------------

lone_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
hostile_scalar = st.one_of(
    st.sampled_from([2**63, 2**64, 2**70, -(2**63) - 1, 10**30, -1, 0, True, False, None, "", "7", 7.0, 0.5,
                     math.nan, math.inf, -math.inf, 1e300, -1e-300]),
    st.integers(), st.floats(), st.text(max_size=8),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), lone_surrogate, st.text(max_size=4)),
)
hostile_value = st.one_of(
    hostile_scalar,
    st.lists(hostile_scalar, max_size=4),
    st.dictionaries(st.text(max_size=6), hostile_scalar, max_size=3),
    st.just([]), st.just({}), st.just([[]]),
    st.sampled_from([RAW + "1e309", RAW + "-1e400", RAW + "NaN", RAW + "-Infinity", RAW + "1" * 5000,
                     RAW + "[" * 5000 + "]" * 5000, RAW + "{" * 3000 + "}" * 3000, RAW + "0.0000001e-400"]),
)
field_names = st.sampled_from(sorted({*completion_fields, *chat_fields, *constraint_fields, *responses_fields,
                                      *messages_fields,
                                      "input", "max_output_tokens", "previous_response_id", "background",
                                      "prompt", "messages", "model", "stream",
                                      "stream_options", "echo", "best_of", "tools", "logit_bias", "suffix",
                                      "chat_template", "bogus", ""}))


@st.composite
def hostile_body(draw, valid: st.SearchStrategy[dict]) -> dict:
    """A valid body with some fields replaced by hostile values, added or removed."""
    body = dict(draw(valid))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "replace", "delete"]))
        name = draw(field_names)
        if action == "delete":
            body.pop(name, None)
        else:
            body[name] = draw(hostile_value)
    if "messages" in body and isinstance(body["messages"], list) and body["messages"] and draw(st.booleans()):
        msg = dict(body["messages"][0]) if isinstance(body["messages"][0], dict) else {}
        msg[draw(st.sampled_from(["role", "content", "name", "extra"]))] = draw(hostile_value)
        body["messages"] = [msg, *body["messages"][1:]]
    return body


def encode(body: dict) -> bytes:
    """JSON text, lone surrogates as \\u escapes, NaN/Infinity as Python's json writes them, and
    RAW-marked strings spliced in as raw JSON text."""
    data = json.dumps(body, ensure_ascii=True, allow_nan=True)
    while f'"{RAW}' in data:
        start = data.index(f'"{RAW}')
        end = data.index('"', start + 1)
        data = data[:start] + data[start + len(RAW) + 1:end] + data[end + 1:]
    return data.encode()


@dataclass
class Case:
    kind: str  # completion | chat
    body: bytes
    stream: bool
    abort: bool
    valid: bool


@st.composite
def case(draw) -> Case:
    kind = draw(st.sampled_from(["completion", "chat", "responses", "messages"]))
    valid_strategy = VALID[kind]
    valid = draw(st.integers(0, 9)) < 4
    body = dict(draw(valid_strategy)) if valid else draw(hostile_body(valid_strategy))
    if draw(st.integers(0, 2)) == 0:  # an output constraint in a third of the bodies
        # (Responses asks for a format in text.format: response_format is the chat endpoint's)
        name = draw(st.sampled_from(sorted(set(constraint_fields) - ({"response_format"} if kind in (
            "responses", "messages") else set()))))
        body[name] = draw(constraint_fields[name])
    stream = draw(st.booleans())
    if stream and "stream" not in body:
        body["stream"] = True
        if draw(st.booleans()) and kind != "messages":
            body["stream_options"] = ({"include_obfuscation": draw(st.booleans())} if kind == "responses"
                                      else {"include_usage": True})
    if draw(st.integers(0, 29)) == 0:  # malformed JSON text
        data = draw(st.sampled_from([b"{", b'{"model": }', b"\xff\xfe\x00", b"[]", b"null", b"", b'"x"']))
        return Case(kind, data, False, False, False)
    abort = draw(st.integers(0, 5)) == 0
    if abort and valid:  # long enough to be cut off mid-generation
        body.update({"max_output_tokens" if kind == "responses" else "max_tokens": 300, "ignore_eos": True,
                     "min_tokens": 0})
        if kind == "messages":
            body.pop("thinking", None)  # enabled thinking's budget is at least 1,024, more than max_tokens
        body.pop("max_completion_tokens", None)
    return Case(kind, encode(body), body.get("stream") is True, abort, valid)


# ---- checking the answers -------------------------------------------------------------------------

def check_error(resp_json: dict) -> None:
    error = resp_json["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)


async def send(client: httpx.AsyncClient, url: str, c: Case, seen: Counter) -> None:
    headers = {"content-type": "application/json"}
    if c.abort:  # hang up early: after the first event, or before a non-streamed answer
        try:
            async with client.stream("POST", url + PATHS[c.kind], content=c.body, headers=headers,
                                     timeout=0.05 if not c.stream else 30) as resp:
                seen[f"aborted-{resp.status_code}"] += 1
                seen["requests"] += 1
                assert resp.status_code in (200, 400), resp.status_code
                async for _ in resp.aiter_lines():
                    break
        except httpx.TimeoutException:
            seen["aborted-timeout"] += 1
            seen["requests"] += 1
        return
    resp = await client.post(url + PATHS[c.kind], content=c.body, headers=headers, timeout=60)
    seen[resp.status_code] += 1
    seen["requests"] += 1
    assert resp.status_code in (200, 400), (resp.status_code, resp.text[:500], c.body[:500])
    if resp.status_code == 400:
        (check_anthropic_error if c.kind == "messages" else check_error)(resp.json())
        return
    if c.kind == "messages":
        check_message(resp.json() if not c.stream else resp.text)
        seen["stream-ok" if c.stream else "messages-ok"] += 1
        return
    if c.kind == "responses":
        check_response(resp.json() if not c.stream else resp.text)
        seen["stream-ok" if c.stream else "responses-ok"] += 1
        return
    if not c.stream:
        body = resp.json()
        # abort: an output constraint that meets allowed_token_ids, bad_words or min_tokens in no token
        assert body["choices"] and all(ch["finish_reason"] in ("length", "stop", "tool_calls") or (
            ch["finish_reason"] == "abort" and "output constraint" in ch["stop_reason"]) for ch in body["choices"]), body
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        return
    lines = [ln for ln in resp.text.split("\n") if ln]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for ln in lines[:-1]:
        event = json.loads(ln.removeprefix("data: "))
        assert "error" not in event, event  # an error event means the engine failed the request
    seen["stream-ok"] += 1


def check_response(answer: dict | str) -> None:
    """A Responses answer: whole, or the events of a stream ending in its final response."""
    if isinstance(answer, str):
        events = [json.loads(ln.removeprefix("data: ")) for ln in answer.split("\n") if ln.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert all(e["type"] != "error" for e in events), events  # an error event: the engine failed the request
        assert events[0]["type"] == "response.created", events[:2]
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed"), events[-1]
        answer = events[-1]["response"]
    assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete", "failed"), answer
    # failed: an output constraint that meets allowed_token_ids, bad_words or min_tokens in no token
    assert answer["status"] != "failed" or "output constraint" in answer["error"]["message"], answer
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def check_anthropic_error(body: dict) -> None:
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == "invalid_request_error" and isinstance(body["error"]["message"], str)


def check_message(answer: dict | str) -> None:
    """An Anthropic answer: a message, or a stream's events from message_start to message_stop."""
    if isinstance(answer, str):
        events = [json.loads(ln.removeprefix("data: ")) for ln in answer.split("\n") if ln.startswith("data: ")]
        kinds = [e["type"] for e in events]
        if "error" in kinds:  # only an output constraint that meets allowed_token_ids, bad_words or min_tokens
            error = events[-1]["error"]
            assert kinds[-1] == "error" and error["type"] == "invalid_request_error", events
            assert "output constraint" in error["message"], events
            return
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
        assert kinds.count("content_block_start") == kinds.count("content_block_stop")
        assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
        return
    assert answer["type"] == "message" and answer["role"] == "assistant", answer
    assert answer["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), answer
    assert answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"] > 0


async def send_all(url: str, cases: list[Case], seen: Counter) -> None:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
        await asyncio.gather(*(send(client, url, c, seen) for c in cases))


def api_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_fuzzed_requests_never_break_the_server(server):
    seen: Counter = Counter()
    warm = [Case("completion", encode({"model": MODEL_NAME, "prompt": "warm", "max_tokens": 2, "stream": s}), s,
                 False, True) for s in (False, True)] * 8
    asyncio.run(send_all(server.url, warm, Counter()))
    rss_before = api_rss_mb(server.proc.pid)
    log_start = server.log_path.stat().st_size

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases=st.lists(case(), min_size=6, max_size=12))
    def fuzz(cases: list[Case]) -> None:
        asyncio.run(send_all(server.url, cases, seen))

    fuzz()
    total = seen["requests"]
    assert total >= MIN_REQUESTS, seen
    assert seen[200] > 0 and seen[400] > 0 and seen["stream-ok"] > 0, seen
    engine = server.wait_idle(timeout=30)
    assert engine["in_flight"] == 0 and engine["num_running"] == 0 and engine["num_waiting"] == 0, engine
    assert engine["num_free_kv_blocks"] == engine["num_kv_blocks"], engine
    health = server.health()
    assert health.status_code == 200 and health.json()["status"] == "ok"
    growth = api_rss_mb(server.proc.pid) - rss_before
    assert growth < 100, f"API RSS grew {growth:.0f} MB over {total} requests"
    with open(server.log_path) as f:
        f.seek(log_start)
        logged = f.read()
    assert "Traceback" not in logged, logged[-3000:]
    print(f"fuzz: {total} requests, {dict(seen)}, API RSS {growth:+.0f} MB")


def test_the_fuzzed_fields_cover_every_request_field():
    """The valid-body strategies draw every field the request models define (so a new field is fuzzed)."""
    from pagoda_daemon.server.protocol import ChatCompletionRequest, CompletionRequest
    from pagoda_daemon.server.responses_request import ResponsesRequest

    set_by_case = {"model", "stream", "stream_options"}
    refused_unless_default = {"best_of"}  # unsupported values: the hostile strategies send them
    assert set(CompletionRequest.model_fields) == {*completion_fields, *constraint_fields, "prompt", "max_tokens",
                                                   *set_by_case, *refused_unless_default}
    assert set(ChatCompletionRequest.model_fields) == {*chat_fields, *constraint_fields, "messages", "max_tokens",
                                                       *set_by_case}
    from pagoda_daemon.server.anthropic_request import MessagesRequest

    assert set(MessagesRequest.model_fields) == {*messages_fields, "messages", "max_tokens", "model",
                                                 "stream"} - set(optional_fields)
    refused = {"previous_response_id", "background"}  # need stored responses: the hostile strategies send them
    assert set(ResponsesRequest.model_fields) == {*responses_fields, "input", "max_output_tokens", *set_by_case,
                                                  *refused} - set(optional_fields)
