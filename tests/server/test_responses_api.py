"""OpenAI's Responses API on a real `pagoda serve` on loopback, through the openai SDK's
`client.responses` (create, streamed create, and its `stream()` helper that rebuilds the response
from the events): the same generation as the chat endpoint, whole and streamed; logprobs;
max_output_tokens; reasoning items; function calls and an agent loop that sends the SDK's own
output items back; structured output through text.format; the 400s and 404s; and the same reply
through the prefill/decode proxy."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, REASONING_MODEL_NAME

openai = pytest.importorskip("openai")

PROMPTS = ["Tell me about Paris.", "Count to ten", "¿Qué tal? 東京"]


def chat_reply(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def salted(extra: dict | None = None) -> dict:
    """extra_body with a fresh cache_salt: a request that reads no other's prefix-cache blocks
    computes its prompt as the one it is compared with did (the same float32 sums)."""
    return {**(extra or {}), "cache_salt": f"salt-{random.randrange(1 << 60)}"}


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}])
def test_a_response_is_the_chat_reply_to_the_same_conversation(openai_client, sampling):
    seed = random.randrange(1 << 30)
    extra = {} if sampling["temperature"] == 0 else {"seed": seed}
    for prompt in PROMPTS:
        resp = openai_client.responses.create(model=MODEL_NAME, instructions="Answer briefly.", input=prompt,
                                              max_output_tokens=12, extra_body=salted(extra), **sampling)
        chat = chat_reply(openai_client, messages=[{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": prompt}],
                          max_tokens=12, extra_body=salted(extra), **sampling)
        assert resp.output_text == chat.choices[0].message.content
        assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL_NAME
        assert resp.usage.input_tokens == chat.usage.prompt_tokens
        assert resp.usage.output_tokens == chat.usage.completion_tokens
        assert resp.usage.total_tokens == chat.usage.total_tokens
        if chat.choices[0].finish_reason == "length":
            assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
            assert resp.output[-1].status == "incomplete"
        else:
            assert resp.status == "completed"
        assert resp.max_output_tokens == 12 and resp.instructions == "Answer briefly." and resp.store is False


def test_a_streamed_response_is_the_whole_one(openai_client):
    prompt = random.choice(PROMPTS)
    whole = openai_client.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=20, temperature=0,
                                           extra_body=salted())
    events = list(openai_client.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=20,
                                                 temperature=0, stream=True, extra_body=salted()))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == events[kinds.index("response.output_item.added")].item.id


def test_the_sdk_stream_helper_rebuilds_a_completed_response(openai_client):
    # a constrained reply ends by itself (the tiny model's random weights rarely stop otherwise)
    answer = random.choice(["sunny", "rain in Paris", "東京 is cloudy"])
    body = {"structured_outputs": {"choice": [answer]}}
    with openai_client.responses.stream(model=MODEL_NAME, input="Weather?", max_output_tokens=50,
                                        extra_body=body) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == answer == "".join(deltas)
    whole = openai_client.responses.create(model=MODEL_NAME, input="Weather?", max_output_tokens=50, extra_body=body)
    assert whole.output_text == answer and whole.usage.output_tokens == final.usage.output_tokens


def test_output_logprobs_are_the_chat_endpoints(openai_client):
    prompt = random.choice(PROMPTS)
    asked = {"model": MODEL_NAME, "input": prompt, "max_output_tokens": 8, "temperature": 0,
             "include": ["message.output_text.logprobs"], "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    resp = openai_client.responses.create(**{**asked, "extra_body": salted(asked["extra_body"])})
    chat = chat_reply(openai_client, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0,
                      logprobs=True, top_logprobs=3, extra_body=salted({"ignore_eos": True}))
    got = resp.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert len(got) == resp.usage.output_tokens == len(want) == 8
    # (unsalted, the second request would read the first's prompt from the prefix cache: the same
    # tokens, with float32 sums in another order, differences near 1e-6; the bound allows that)
    for a, b in zip(got, want):
        assert (a.token, a.bytes) == (b.token, b.bytes) and a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-3)
    # streamed: the deltas carry the logprobs of their tokens, and the final response all of them
    events = list(openai_client.responses.create(**{**asked, "extra_body": salted(asked["extra_body"])}, stream=True))
    streamed = [(lp.token, lp.logprob) for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = [(lp.token, lp.logprob) for lp in events[-1].response.output[0].content[0].logprobs]
    assert [t for t, _ in final] == [lp.token for lp in got] and final[:len(streamed)] == streamed
    assert [lp for _, lp in final] == pytest.approx([lp.logprob for lp in got], abs=1e-3)
    plain = openai_client.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=4, top_logprobs=3)
    assert plain.output[0].content[0].logprobs is None  # include did not ask


BAD = [
    ({"input": "hi", "previous_response_id": "resp_abc"}, 400, "previous_response_id"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "max_tokens": 3}, 400, "max_tokens"),
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 400,
     "input.0.content.0.type"),
    ({"input": "hi", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": float("nan")}, 400, None),
    ({"input": "hi", "model": "other"}, 400, "model"),
    ({"input": None}, 400, "input"),
    ({"input": "x" * 100_000, "max_output_tokens": 4}, 400, None),  # longer than the model's context
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_what_cannot_be_served_is_refused_and_the_server_serves_on(server, body, status, param):
    raw = json.dumps({"model": MODEL_NAME, **body}).replace("NaN", "1e999")
    resp = httpx.post(server.url + "/v1/responses", content=raw, headers={"content-type": "application/json"},
                      timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(server.url + "/v1/responses", json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_stored_responses_are_not_kept(server, openai_client):
    for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1/cancel")):
        resp = httpx.request(method, server.url + path, timeout=30)
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id", (method, resp.text)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve("resp_1")


# ---- a reasoning model with tools (the tiny Qwen3: hermes tool calls, <think> reasoning) ----------

QWEN = REASONING_MODEL_NAME
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def qwen(reasoning_server):
    return reasoning_server, openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="unused", max_retries=0,
                                           timeout=120)


def test_thinking_is_a_reasoning_item_and_its_tokens_are_counted(qwen):
    srv, client = qwen
    body = {"structured_outputs": {"choice": ["<think>\nLet me think: 2+2.\n</think>\n\nIt is 4."]}}
    resp = client.responses.create(model=QWEN, input="2+2?", max_output_tokens=60, temperature=0, extra_body=body)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Let me think: 2+2." and resp.output_text == "It is 4."
    # the thinking's tokens are the generated ones up to the one that completes </think> (the grammar
    # lets the random model spell the text with any tokens: they are read from the chat reply's ids)
    chat = client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "2+2?"}], max_tokens=60,
                                          temperature=0, logprobs=True,
                                          extra_body={**body, "return_tokens_as_token_ids": True})
    generated = [int(lp.token.removeprefix("token_id:")) for lp in chat.choices[0].logprobs.content]

    def text(k: int) -> str:
        return httpx.post(srv.url + "/detokenize", json={"tokens": generated[:k]}, timeout=30).json()["prompt"]

    thinking = next(k for k in range(1, len(generated) + 1) if "</think>" in text(k))
    assert chat.usage.completion_tokens_details.reasoning_tokens == thinking  # the chat endpoint counts them too
    assert resp.usage.output_tokens_details.reasoning_tokens == thinking < resp.usage.output_tokens == len(generated)
    with client.responses.stream(model=QWEN, input="2+2?", max_output_tokens=60, temperature=0,
                                 extra_body=body) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and final.output[0].content[0].text == "Let me think: 2+2."
    assert final.usage.output_tokens_details.reasoning_tokens == thinking and final.output_text == "It is 4."


def test_function_calls_and_an_agent_loop_with_the_sdks_own_items(qwen):
    _, client = qwen
    # one call at most: at temperature 1 the random model may grow an array of calls past any bound
    resp = client.responses.create(model=QWEN, input="Weather in Paris and Rome?", tools=[WEATHER],
                                   tool_choice="required", max_output_tokens=400, temperature=1.0,
                                   parallel_tool_calls=False, extra_body={"seed": random.randrange(1 << 30)})
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and resp.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the conversation goes back with the SDK's output items and each call's output
    history = [{"role": "user", "content": "Weather in Paris and Rome?"}, *resp.output,
               *({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls)]
    answer = client.responses.create(model=QWEN, input=history, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=5)
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens > resp.usage.input_tokens
    # a named function, streamed: the arguments' deltas make the call's arguments
    with client.responses.stream(model=QWEN, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=400) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_text_format_json_schema_holds(qwen):
    _, client = qwen
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}},
              "required": ["name", "age"], "additionalProperties": False}
    for seed in random.sample(range(1 << 30), 3):
        resp = client.responses.create(
            model=QWEN, input="A person, as JSON.", max_output_tokens=300, temperature=1.0, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
            reasoning={"effort": "none"})
        assert resp.status == "completed" and resp.text.format.type == "json_schema"
        jsonschema.validate(json.loads(resp.output_text), schema)
