"""Anthropic's Messages API: the request as the chat request it amounts to, the reply checked
against the anthropic SDK's own types, and a real `pagoda serve` on loopback asked through the
anthropic SDK (`messages.create`, `messages.stream`, `messages.count_tokens`): the same
generation as the chat endpoint, streamed = whole, stop sequences, thinking blocks, tool use and
an agent loop with the SDK's own content blocks, x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest
from pydantic import TypeAdapter

from pagoda_daemon.server.anthropic_output import AnthropicFormat
from pagoda_daemon.server.anthropic_request import MessagesRequest
from pagoda_daemon.server.errors import APIError
from pagoda_daemon.server.protocol import parse_request
from tests.server.conftest import MODEL_NAME, REASONING_MODEL_NAME

anthropic = pytest.importorskip("anthropic")
EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}


def request(**body) -> MessagesRequest:
    return parse_request(MessagesRequest, json.dumps({"model": "m", "max_tokens": 9, **body}).encode())


# ---- without a server -----------------------------------------------------------------------------

def test_a_conversation_of_blocks_becomes_the_chat_messages_it_is():
    req = request(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {
        "type": "ephemeral"}}], messages=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two calls", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}],
             "is_error": False},
            {"type": "text", "text": "And tomorrow?"}]},
    ], tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"],
        temperature=0.3, top_k=5, thinking={"type": "enabled", "budget_tokens": 2048},
        output_config={"effort": "low"}, metadata={"user_id": "u1"}, seed=4)
    chat = req.to_chat()
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "days": 1}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Rome", "days": 2}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tool_mode == "required" and not chat.parallel_tool_calls and chat.stop == ["END"]
    assert chat.max_tokens == 9 and chat.temperature == 0.3 and chat.top_k == 5 and chat.seed == 4
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.reasoning_effort == "low"
    assert chat.user == "u1"
    named = request(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                    tool_choice={"type": "tool", "name": "get_weather"}).to_chat()
    assert named.tool_mode == "named"
    fmt = request(messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"},
                  output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}).to_chat()
    assert fmt.chat_template_kwargs == {"enable_thinking": False}
    assert fmt.response_format is not None and fmt.response_format.json_schema is not None


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2**63}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 10}},
     "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "http://x"}]}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]}, "stop_sequences.0"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as caught:
        request(**body).to_chat()
    assert caught.value.status == 400 and caught.value.param == param, caught.value.body()


def chat_stream(reasoning: str, text: str, arguments: str, finish: str) -> tuple[list[dict], dict]:
    """A chat reply's stream, cut at random places, and the same reply whole."""
    chunks: list[dict] = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]}]
    for key, value in (("reasoning_content", reasoning), ("content", text)):
        cuts = sorted(random.sample(range(1, len(value)), 2))
        for a, b in zip([0, *cuts], [*cuts, len(value)]):
            chunks.append({"choices": [{"index": 0, "delta": {key: value[a:b]}, "finish_reason": None}]})
    chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                                      "function": {"name": "f", "arguments": ""}}]},
                                "finish_reason": None}]})
    cut = random.randrange(1, len(arguments))
    for piece in (arguments[:cut], arguments[cut:]):
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": piece}}]}, "finish_reason": None}]})
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": None}]})
    usage = {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29, "prompt_tokens_details": {
        "cached_tokens": 16}}
    chunks.append({"choices": [], "usage": usage})
    whole = {"choices": [{"index": 0, "finish_reason": finish, "stop_reason": None, "message": {
        "role": "assistant", "content": text, "reasoning_content": reasoning,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}}],
        "usage": usage}
    return chunks, whole


def test_a_streamed_reply_is_the_event_sequence_of_the_whole_one():
    req = request(messages=[{"role": "user", "content": "x"}], stream=True)
    fmt = AnthropicFormat(req, req.to_chat())
    chunks, whole = chat_stream("think it over", "It is sunny.", '{"city": "Paris", "days": 2}', "tool_calls")
    body = fmt.body("msg_1", 0, whole)
    message = anthropic.types.Message.model_validate(body)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Paris", "days": 2} and message.stop_reason == "tool_use"
    assert body["usage"] == {"input_tokens": 4, "output_tokens": 9, "cache_read_input_tokens": 16}
    events = fmt.events("msg_1", 0, 20)
    sent = events.start()
    for chunk in chunks:
        sent += events.chunk(chunk)
    sent += events.finish()
    for event in sent:
        EVENT.validate_python(event)
    kinds = [e["type"] for e in sent]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    # the deltas rebuild the whole message's blocks
    blocks: list[dict] = []
    for e in sent:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"], partial=""))
        elif e["type"] == "content_block_delta":
            delta, block = e["delta"], blocks[e["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[delta["type"]]
            block[key] += delta[{"input_json_delta": "partial_json"}.get(delta["type"], key)]
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial"])
        del block["partial"]
    assert blocks == body["content"]
    assert sent[-2]["delta"]["stop_reason"] == "tool_use" and sent[-2]["usage"] == body["usage"]


def test_a_cut_reply_says_max_tokens_and_a_stop_string_says_which():
    req = request(messages=[{"role": "user", "content": "x"}], stop_sequences=["END"])
    fmt = AnthropicFormat(req, req.to_chat())
    cut = fmt.body("msg_2", 0, {"choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "message": {
        "role": "assistant", "content": "abc"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 9,
                                                            "total_tokens": 12}})
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("max_tokens", None)
    stopped = fmt.body("msg_3", 0, {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END",
                                                 "message": {"role": "assistant", "content": "abc"}}],
                                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    with pytest.raises(APIError):  # the engine aborted: the request's own constraint allowed no token
        fmt.body("msg_4", 0, {"choices": [{"index": 0, "finish_reason": "abort", "stop_reason": "output constraint",
                                           "message": {"role": "assistant", "content": ""}}], "usage": None})


# ---- a real server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


PROMPTS = ["Tell me about Paris.", "Count to ten", "¿Qué tal? 東京"]


def test_a_message_is_the_chat_reply_to_the_same_conversation(client, openai_client):
    for prompt in PROMPTS:
        seed = random.randrange(1 << 30)
        # (the SDK takes temperature, top_p and top_k in extra_body: its typed parameters dropped them)
        message = client.messages.create(model=MODEL_NAME, max_tokens=12, system="Answer briefly.",
                                         messages=[{"role": "user", "content": prompt}],
                                         extra_body={"seed": seed, "temperature": 1.0, "cache_salt": f"a{seed}"})
        # (its own cache salt each: neither reads the other's prompt from the prefix cache, so both
        # compute it with the same float32 sums)
        chat = openai_client.chat.completions.create(
            model=MODEL_NAME, max_tokens=12, temperature=1.0, seed=seed, extra_body={"cache_salt": f"c{seed}"},
            messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}])
        text = "".join(b.text for b in message.content if b.type == "text")
        assert text == (chat.choices[0].message.content or "")
        assert message.id.startswith("msg_") and message.model == MODEL_NAME and message.role == "assistant"
        assert message.usage.input_tokens == chat.usage.prompt_tokens and message.usage.cache_read_input_tokens == 0
        assert message.usage.output_tokens == chat.usage.completion_tokens
        assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
        counted = client.messages.count_tokens(model=MODEL_NAME, system="Answer briefly.",
                                               messages=[{"role": "user", "content": prompt}])
        assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_message_is_the_whole_one(client):
    prompt = random.choice(PROMPTS)
    ask = dict(model=MODEL_NAME, max_tokens=20, messages=[{"role": "user", "content": prompt}],
               extra_body={"temperature": 0.0, "cache_salt": f"s{random.randrange(1 << 60)}"})
    whole = client.messages.create(**ask)
    # its own cache salt: the stream computes the prompt as the whole reply did (no prefix-cache read)
    salt = f"t{random.randrange(1 << 60)}"
    with client.messages.stream(**{**ask, "extra_body": {"temperature": 0.0, "cache_salt": salt}}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    answer = random.choice(["sunny", "rain", "東京"])
    message = client.messages.create(model=MODEL_NAME, max_tokens=50, stop_sequences=["END"],
                                     messages=[{"role": "user", "content": "Weather?"}],
                                     extra_body={"structured_outputs": {"choice": [f"{answer} END and more"]}})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
    assert message.content[0].text == f"{answer} "


def test_errors_come_in_anthropics_shape_and_the_server_serves_on(server, client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in caught.value.body["error"]["message"]
    for body in ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
                 {"model": "other", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
                 {"model": MODEL_NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "x" * 100_000}]},
                 {"model": MODEL_NAME, "max_tokens": 3, "messages": "x"}):
        resp = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
        assert resp.status_code == 400 and resp.json()["type"] == "error", resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(server.url + "/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert client.messages.create(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).usage


def test_the_api_key_is_read_from_x_api_key(start_server):
    srv = start_server("--api-key", "k-123")
    good = anthropic.Anthropic(base_url=srv.url, api_key="k-123", max_retries=0, timeout=60)
    assert good.messages.create(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).content
    bearer = anthropic.Anthropic(base_url=srv.url, auth_token="k-123", max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}]).input_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0, timeout=60).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    # elsewhere x-api-key is not a credential: the OpenAI routes take the bearer key only
    resp = httpx.post(srv.url + "/v1/chat/completions", headers={"x-api-key": "k-123"}, timeout=30,
                      json={"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 401


# ---- a reasoning model with tools (the tiny Qwen3: hermes tool calls, <think> reasoning) ----------

QWEN = REASONING_MODEL_NAME


@pytest.fixture(scope="module")
def qwen(reasoning_server):
    return anthropic.Anthropic(base_url=reasoning_server.url, api_key="unused", max_retries=0, timeout=120)


def test_thinking_blocks_tool_use_and_an_agent_loop(qwen):
    body = {"structured_outputs": {"choice": ["<think>\nLet me think.\n</think>\n\nIt is 4."]}}
    message = qwen.messages.create(model=QWEN, max_tokens=60, messages=[{"role": "user", "content": "2+2?"}],
                                   extra_body=body)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "Let me think."), ("text", "It is 4.")]
    with qwen.messages.stream(model=QWEN, max_tokens=60, messages=[{"role": "user", "content": "2+2?"}],
                              extra_body=body) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    hidden = qwen.messages.create(model=QWEN, max_tokens=60, messages=[{"role": "user", "content": "2+2?"}],
                                  thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
                                  extra_body=body)
    assert [b.type for b in hidden.content] == ["text"] and hidden.usage.output_tokens == message.usage.output_tokens
    # a forced tool: tool_use blocks with valid input; then the conversation goes back with the SDK's own blocks
    # one call at most: at temperature 1 the random model may grow an array of calls past any bound
    asked = qwen.messages.create(model=QWEN, max_tokens=400, tools=[WEATHER],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}],
                                 extra_body={"seed": random.randrange(1 << 30), "temperature": 1.0})
    uses = [b for b in asked.content if b.type == "tool_use"]
    assert uses and asked.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": asked.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"}
                                            for u in uses]}]
    answer = qwen.messages.create(model=QWEN, max_tokens=5, tools=[WEATHER], tool_choice={"type": "none"},
                                  messages=history)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > asked.usage.input_tokens
    # streamed, a named tool's input arrives as input_json_delta and the SDK rebuilds it
    with qwen.messages.stream(model=QWEN, max_tokens=400, tools=[WEATHER],
                              tool_choice={"type": "tool", "name": "get_weather"},
                              messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"
