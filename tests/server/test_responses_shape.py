"""The Responses API without a server: a Responses request becomes the chat request that asks for
the same generation, and a chat reply, whole or streamed, becomes the Responses reply, checked
against the openai SDK's own types of responses and stream events."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import TypeAdapter

from pagoda_daemon.server.errors import APIError
from pagoda_daemon.server.protocol import parse_request
from pagoda_daemon.server.responses_output import ResponseEvents, ResponseHeader, response_body
from pagoda_daemon.server.responses_request import ResponsesRequest

openai_types = pytest.importorskip("openai.types.responses")
EVENT = TypeAdapter(openai_types.ResponseStreamEvent)
MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**body) -> ResponsesRequest:
    return parse_request(ResponsesRequest, json.dumps({"model": MODEL, **body}).encode())


def refused(body: dict) -> dict:
    with pytest.raises(APIError) as caught:
        req = request(**body)
        req.to_chat(MODEL)
    err = caught.value
    assert err.status == 400, err.body()
    return err.body()["error"]


def test_a_conversation_of_items_becomes_the_chat_messages_it_is():
    req = request(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer "},
                                          {"type": "input_text", "text": "now."}]},
    ], tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=7,
        temperature=0.5, seed=3, include=["message.output_text.logprobs"], top_logprobs=2,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        reasoning={"effort": "low"}, store=True, metadata={"k": "v"}, user="u1")
    chat = req.to_chat(MODEL)
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_b"},
        {"role": "developer", "content": "Answer now."},
    ]
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    assert chat.tool_mode == "named" and chat.max_tokens == 7 and chat.temperature == 0.5 and chat.seed == 3
    assert chat.logprobs and chat.top_logprobs == 2 and chat.reasoning_effort == "low" and chat.user == "u1"
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    # a bare string is one user message, and without tools tool_choice auto asks nothing
    plain = request(input="hi", tool_choice="auto").to_chat(MODEL)
    assert [m.for_template() for m in plain.messages] == [{"role": "user", "content": "hi"}]
    assert plain.tool_mode == "none" and not plain.logprobs
    # top_logprobs alone does not ask for logprobs (vLLM's and OpenAI's rule: include asks)
    assert not request(input="hi", top_logprobs=3).to_chat(MODEL).logprobs


def test_the_served_model_answers_when_the_request_names_none():
    req = parse_request(ResponsesRequest, b'{"input": "hi"}')
    assert req.to_chat("served").model == "served"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"input": "hi", "max_tokens": 5}, "max_tokens"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools.0.name"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.function.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}],
      "model": MODEL}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 2**63}, "max_output_tokens"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "temperature": 2.5}, "temperature"),
    ({"input": "hi", "temperature": "1"}, "temperature"),
    ({"input": "hi", "include": ["everything"]}, "include.0"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "truncation": "left"}, "truncation"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": "hi", "use_beam_search": True}, "use_beam_search"),
    ({"input": 7}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body, param):
    error = refused({"model": MODEL, **body})
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


CHUNKS_REPLY = ("think about it", "It is sunny.", '{"city": "Paris"}')


def chat_stream(reasoning: str, content: str, arguments: str, finish: str,
                logprobs: bool) -> tuple[list[dict], dict]:
    """A chat reply's stream cut at `pieces` places, and the same reply whole (as ChatBuilder writes them)."""
    def lp(token):
        return {"token": token, "logprob": -0.5, "bytes": list(token.encode()),
                "top_logprobs": [{"token": token, "logprob": -0.5, "bytes": list(token.encode())}]}

    chunks: list[dict] = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}]
    tokens = []
    for key, text in (("reasoning_content", reasoning), ("content", content)):
        cuts = sorted(random.sample(range(1, len(text)), min(3, len(text) - 1)))
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            tokens.append(text[a:b])
            chunks.append({"choices": [{"index": 0, "delta": {key: text[a:b]},
                                        "logprobs": {"content": [lp(text[a:b])]} if logprobs else None,
                                        "finish_reason": None}]})
    chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        "logprobs": None, "finish_reason": None}]})
    chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": arguments}}]}, "logprobs": None, "finish_reason": finish}]})
    usage = {"prompt_tokens": 11, "completion_tokens": len(tokens), "total_tokens": 11 + len(tokens),
             "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 3}}
    chunks.append({"choices": [], "usage": usage})
    whole = {"choices": [{"index": 0, "finish_reason": finish,
                          "logprobs": {"content": [lp(t) for t in tokens]} if logprobs else None,
                          "message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                                      "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                          "name": "get_weather", "arguments": arguments}}]}}], "usage": usage}
    return chunks, whole


def sdk_view(body: dict) -> dict:
    """The response as the SDK's strict type reads it. OpenAI's usage also counts cache writes (a
    billing count of its own service); Pagoda does not report it, and the SDK reads a response
    without it (its parsing is lenient), so only the strict check here needs it filled."""
    body = json.loads(json.dumps(body))
    if body.get("usage"):
        body["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)
    return body


def strip_ids(value):
    if isinstance(value, dict):
        return {k: strip_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [strip_ids(v) for v in value]
    return value


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_a_streamed_reply_is_the_event_sequence_of_the_whole_one(logprobs, finish):
    include = ["message.output_text.logprobs"] if logprobs else None
    req = request(input="Weather?", tools=[WEATHER], stream=True, include=include, metadata={"a": "b"})
    header = ResponseHeader("resp_x", 1_700_000_000, req, req.to_chat(MODEL))
    chunks, whole = chat_stream(*CHUNKS_REPLY, finish=finish, logprobs=logprobs)
    body = response_body(header, whole)
    openai_types.Response.model_validate(sdk_view(body))
    events = ResponseEvents(header, logprobs)
    sent = events.start()
    for chunk in chunks:
        sent += events.chunk(chunk)
    sent += events.finish()
    for event in sent:
        EVENT.validate_python(sdk_view(event) if "response" not in event else
                              {**event, "response": sdk_view(event["response"])})  # one of OpenAI's, with its fields
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    kinds = [e["type"] for e in sent]
    last = "response.completed" if finish == "tool_calls" else "response.incomplete"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == last
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    # the deltas concatenate to the whole reply's text, thinking and arguments
    assert "".join(e["delta"] for e in sent if e["type"] == "response.reasoning_text.delta") == CHUNKS_REPLY[0]
    assert "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta") == CHUNKS_REPLY[1]
    assert "".join(e["delta"] for e in sent if e["type"] == "response.function_call_arguments.delta") == \
        CHUNKS_REPLY[2]
    final = sent[-1]["response"]
    # the streamed items are the final response's, and (ids aside) the whole reply's
    done = [e["item"] for e in sent if e["type"] == "response.output_item.done"]
    assert final["output"] == done
    assert strip_ids(final) == strip_ids(body)
    assert body["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 4},
                             "output_tokens": whole["usage"]["completion_tokens"],
                             "output_tokens_details": {"reasoning_tokens": 3},
                             "total_tokens": whole["usage"]["total_tokens"]}
    if finish == "length":
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert [item["status"] for item in body["output"]] == ["completed", "completed", "incomplete"]
    else:
        assert body["status"] == "completed" and body["incomplete_details"] is None
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][2]["call_id"] == "call_1" and body["metadata"] == {"a": "b"} and body["store"] is False


def test_an_engine_failure_mid_stream_ends_it_failed():
    req = request(input="hi", stream=True)
    events = ResponseEvents(ResponseHeader("resp_y", 1, req, req.to_chat(MODEL)), False)
    sent = events.start() + events.chunk({"choices": [{"index": 0, "delta": {"content": "par"},
                                                       "logprobs": None, "finish_reason": None}]})
    sent += events.chunk({"error": {"message": "the engine died", "type": "server_error", "code": "engine_dead",
                                    "param": None}})
    sent += events.finish()
    for event in sent:
        EVENT.validate_python(event)
    kinds = [e["type"] for e in sent]
    assert kinds[-3:] == ["response.output_item.done", "error", "response.failed"]
    assert sent[-3]["item"]["status"] == "incomplete" and sent[-3]["item"]["content"][0]["text"] == "par"
    assert sent[-2]["code"] == "engine_dead"
    assert sent[-1]["response"]["error"] == {"code": "server_error", "message": "the engine died"}
