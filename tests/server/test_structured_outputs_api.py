"""Structured outputs and tool calling through a real `pagoda serve` on loopback, asked by raw
HTTP and by the openai SDK: response_format, vLLM's structured_outputs and guided_* fields,
tools with every tool_choice, streamed tool-call deltas, reasoning_content, an agent loop, the
400s that name the field, and the metrics.

The tiny model has random weights, so it calls a tool only when the output is constrained to a
call: `tool_choice` required or named, or (for `auto`, where the reply is parsed) a
`structured_outputs.choice` that holds the call's text in the model's own format (the tiny
Qwen3's chat template is Qwen3's hermes format: `<tool_call>` JSON blocks).
"""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import jsonschema
import pytest

from tests.server.conftest import REASONING_MODEL_NAME, REASONING_SERVER_ARGS, ServerProcess, running

NAME = REASONING_MODEL_NAME
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "properties": {}})
           for tool in TOOLS}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def server(tiny_models, tmp_path_factory, request):
    with running(tiny_models["qwen3"], *REASONING_SERVER_ARGS, "--structured-outputs-backend", request.param,
                 log_dir=tmp_path_factory.mktemp("logs"), served_name=NAME) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": NAME, "messages": [{"role": "user", "content": "Weather?"}], **body}, timeout=120)


def chat_stream(server, body: dict) -> list[dict]:
    resp = chat(server, {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    lines = [ln.removeprefix("data: ") for ln in resp.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def assemble(chunks: list[dict]) -> dict:
    """A streamed choice put together as the openai SDK does: content and reasoning concatenated,
    tool calls by index (id, name and type from their first delta, arguments concatenated)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                if "id" in call:
                    assert call["id"].startswith("call_") and call["type"] == "function"
                    slot["name"] = call["function"]["name"]
                slot["arguments"] += call["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def whole(body: dict) -> dict:
    message = body["choices"][0]["message"]
    return {"content": message["content"], "reasoning": message.get("reasoning_content"),
            "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in message.get("tool_calls") or []],
            "finish_reason": body["choices"][0]["finish_reason"]}


def valid_call(call: dict) -> None:
    assert call["name"] in SCHEMAS, call
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


# ---- response formats ---------------------------------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "東京"]}, "maxItems": 3}}}


def test_response_format_json_schema_and_json_object_hold_at_temperature_one(server):
    seeds = random.sample(range(1 << 30), 6)
    for seed in seeds:
        body = chat(server, {"max_tokens": 400, "temperature": 1.0, "seed": seed, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}}).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", (seed, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        body = chat(server, {"max_tokens": 400, "temperature": 1.0, "seed": seed,
                             "response_format": {"type": "json_object"}}).json()
        if body["choices"][0]["finish_reason"] == "stop":  # any object may run past max_tokens
            assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_completions_take_vllm_fields_and_response_format(server):
    def complete(extra: dict) -> str:
        resp = httpx.post(server.url + "/v1/completions", json={
            "model": NAME, "prompt": "Answer:", "max_tokens": 400, "temperature": 1.0,
            "seed": random.randrange(1 << 30), **extra}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "stop"
        return resp.json()["choices"][0]["text"]

    choices = ["yes", "no", "yes, surely", "東京 🚀"]
    assert complete({"guided_choice": choices}) in choices
    assert complete({"structured_outputs": {"choice": choices}}) in choices
    assert re.fullmatch(r"[a-c]{2,4}-\d{3}", complete({"guided_regex": r"[a-c]{2,4}-\d{3}"}))
    assert re.fullmatch(r"(ab|cd)+!", complete({"structured_outputs": {"grammar": 'root ::= ("ab" | "cd"){1,5} "!"'}}))
    jsonschema.validate(json.loads(complete({"guided_json": json.dumps(PERSON)})), PERSON)
    jsonschema.validate(json.loads(complete({"structured_outputs": {"json": PERSON}})), PERSON)
    jsonschema.validate(json.loads(complete({"response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})), PERSON)


def test_openai_sdk_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=10**7)
        capital: bool

    for _ in range(3):
        completion = client.beta.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": "A city?"}], response_format=City,
            max_tokens=300, temperature=1.0, seed=random.randrange(1 << 30))
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, City), message


# ---- tools ----------------------------------------------------------------------------------------

def test_tool_choice_required_always_calls_a_declared_function_with_valid_arguments(server):
    for parallel in (False, True):
        for _ in range(4):
            body = chat(server, {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel,
                                 "max_tokens": 500, "temperature": 1.0, "seed": random.randrange(1 << 30)}).json()
            reply = whole(body)
            if reply["finish_reason"] == "length":  # parallel calls may go on past max_tokens
                assert parallel
                continue
            assert reply["finish_reason"] == "tool_calls" and reply["content"] is None, reply
            assert reply["calls"] and (parallel or len(reply["calls"]) == 1)
            for call in reply["calls"]:
                valid_call(call)
            ids = [c["id"] for c in body["choices"][0]["message"]["tool_calls"]]
            assert len(set(ids)) == len(ids)


def test_a_named_tool_choice_gets_its_arguments(server):
    body = chat(server, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                         "max_tokens": 300, "temperature": 1.0, "seed": random.randrange(1 << 30)}).json()
    reply = whole(body)
    assert reply["finish_reason"] == "stop" and reply["content"] is None  # as OpenAI: the caller forced it
    assert [c["name"] for c in reply["calls"]] == ["get_weather"]
    valid_call(reply["calls"][0])


def test_auto_parses_the_models_own_call_format(server):
    for text, calls in [(HERMES_CALL, [("get_weather", {"city": "Paris", "days": 2})]),
                        ("Let me check. " + HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                         "</tool_call>", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
                        ("No tool needed.", [])]:
        body = chat(server, {"tools": TOOLS, "max_tokens": 300, "structured_outputs": {"choice": [text]}}).json()
        reply = whole(body)
        assert reply["finish_reason"] != "length"
        assert [(c["name"], json.loads(c["arguments"])) for c in reply["calls"]] == calls
        assert reply["finish_reason"] == ("tool_calls" if calls else "stop")
        assert reply["content"] == ("Let me check." if len(calls) == 2 else None if calls else "No tool needed.")
    # tool_choice none: the same text is content, not a call
    reply = whole(chat(server, {"tools": TOOLS, "tool_choice": "none", "max_tokens": 300,
                                "structured_outputs": {"choice": [HERMES_CALL]}}).json())
    assert reply["calls"] == [] and reply["content"] == HERMES_CALL and reply["finish_reason"] == "stop"


@pytest.mark.parametrize("case", ["required", "named", "auto", "auto-two", "plain"])
def test_streamed_deltas_concatenate_to_the_whole_reply(server, case):
    body = {"tools": TOOLS, "max_tokens": 400, "temperature": 1.0, "seed": random.randrange(1 << 30),
            "parallel_tool_calls": case != "required"}
    if case == "required":
        body["tool_choice"] = "required"
    elif case == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    elif case.startswith("auto"):
        extra = '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' if case == "auto-two" else ""
        body["structured_outputs"] = {"choice": ["<think>\nweather\n</think>\n\nChecking. " + HERMES_CALL + extra]}
    else:
        body.pop("tools")
    full = whole(chat(server, body).json())
    streamed = assemble(chat_stream(server, body))
    assert streamed == full
    if case != "plain":
        assert full["calls"]
    if case.startswith("auto"):
        assert full["reasoning"] == "weather" and full["content"] == "Checking."


def test_reasoning_content_is_split_from_the_answer(server):
    reply = whole(chat(server, {"max_tokens": 50, "structured_outputs": {
        "choice": ["<think>\nLet me think: 2+2.\n</think>\n\nIt is 4."]}}).json())
    assert reply["reasoning"] == "Let me think: 2+2." and reply["content"] == "It is 4."
    # with enable_thinking false Qwen3's template closes the thinking in the prompt: all content
    reply = whole(chat(server, {"max_tokens": 50, "chat_template_kwargs": {"enable_thinking": False},
                                "structured_outputs": {"choice": ["It is 4."]}}).json())
    assert reply["reasoning"] is None and reply["content"] == "It is 4."


def test_an_agent_loop_through_the_openai_client(server, client):
    """Call a tool, send its result back, get the final answer: the history with the assistant's
    tool_calls (content null) and the tool message reaches the chat template."""
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=300,
                                           extra_body={"structured_outputs": {"choice": [HERMES_CALL]}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    messages.append(choice.message)  # the SDK's own message object, sent back as the SDK serializes it
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    answer = "It is sunny in Paris."
    final = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=50,
                                           extra_body={"structured_outputs": {"choice": [answer]}})
    assert final.choices[0].message.content == answer and final.choices[0].finish_reason == "stop"
    # what the model saw: the template rendered the call and the tool's result
    history = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    tokens = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": history, "tools": TOOLS},
                        timeout=30).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"model": NAME, "tokens": tokens}, timeout=30).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in prompt
    assert "Sunny, 21 C" in prompt and '"name": "get_time"' in prompt
    assert final.usage.prompt_tokens == len(tokens)


# ---- what is refused ----------------------------------------------------------------------------

DEEP: dict = {"type": "string"}
for _ in range(70):
    DEEP = {"type": "array", "items": DEEP}

BAD = [
    ("malformed schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
    ("schema with a bad pattern", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(("}}}}, "response_format.json_schema.schema"),
    ("json_schema without its schema object", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("response format name with a space", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a b", "schema": {}}}}, "response_format.json_schema.name"),
    ("unknown response format", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("guided_json not JSON", {"guided_json": "{"}, "guided_json"),
    ("schema nested too deep", {"guided_json": DEEP}, "guided_json"),
    ("grammar that cannot compile", {"structured_outputs": {"grammar": "root ::= missing_rule"}},
     "structured_outputs.grammar"),
    ("regex that cannot compile", {"guided_regex": "[a-"}, "guided_regex"),
    ("two constraints", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("two fields of structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("structured_outputs field we do not serve", {"structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    ("empty choice list", {"guided_choice": []}, "guided_choice"),
    ("too many choices", {"guided_choice": [str(i) for i in range(1025)]}, "guided_choice"),
    ("a choice that is not a string", {"guided_choice": ["a", 7]}, "guided_choice.1"),
    ("a control character in a choice", {"guided_choice": ["a\x00b"]}, "guided_choice"),
    ("regex past its bound", {"guided_regex": "a" * 20000}, "guided_regex"),
    ("unknown tool name in tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "launch_rocket"}}}, "tool_choice.function.name"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("empty tools", {"tools": []}, "tools"),
    ("two tools of one name", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("a tool whose parameters cannot compile", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "wat"}}}}}],
        "tool_choice": "required"}, "tools"),
    ("named tool whose parameters cannot compile", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters"),
    ("a forced call with a response format", {"tools": TOOLS, "tool_choice": "required",
                                              "response_format": {"type": "json_object"}}, "response_format"),
    ("tool type other than function", {"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]},
     "tools.0.type"),
    ("tool name too long", {"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
     "tools.0.function.name"),
    ("functions (deprecated)", {"functions": [{"name": "f"}]}, "functions"),
    ("tool message without tool_call_id", {"messages": [{"role": "user", "content": "x"},
                                                        {"role": "tool", "content": "42"}]},
     "messages.tool_call_id"),
    ("tool_calls on a user message", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.tool_calls"),
    ("tool call arguments that are not JSON", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.tool_calls.function.arguments"),
    ("unknown message field", {"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, "messages.mood"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_what_cannot_be_served_is_a_400_naming_the_field(server, case):
    _, body, param = case
    resp = chat(server, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    ok = chat(server, {"max_tokens": 2})
    assert ok.status_code == 200


def test_auto_without_a_known_format_is_a_400_and_a_parser_flag_fixes_it(tiny_models, tmp_path):
    from pagoda_daemon.models.tiny import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "plain-template", seed=4)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")  # no tools
    srv = ServerProcess(str(model), "--max-model-len", "512", log_dir=tmp_path, served_name=NAME)
    try:
        srv.wait_ready()
        resp = chat(srv, {"tools": TOOLS, "max_tokens": 5})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice", resp.text
        assert chat(srv, {"tools": TOOLS, "tool_choice": "required", "max_tokens": 300}).status_code == 200
    finally:
        srv.stop()
    srv = ServerProcess(str(model), "--max-model-len", "512", "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", log_dir=tmp_path, served_name=NAME)
    try:
        srv.wait_ready()
        reply = whole(chat(srv, {"tools": TOOLS, "max_tokens": 300,
                                 "structured_outputs": {"choice": [HERMES_CALL]}}).json())
        assert [c["name"] for c in reply["calls"]] == ["get_weather"]
    finally:
        srv.stop()


def test_metrics_count_constrained_requests_compiles_and_cache_hits(server):
    for _ in range(3):
        assert chat(server, {"max_tokens": 20, "guided_choice": ["alpha", "beta"]}).status_code == 200
    server.wait_idle()

    def value(text: str, name: str) -> float:
        found = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    deadline = time.monotonic() + 10  # the engine's stats reach the API with its next outputs or stats tick
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        if value(text, "pagoda:grammar_cache_hits_total") >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert value(text, "pagoda:structured_output_requests_total") >= 3
    assert value(text, "pagoda:grammar_cache_hits_total") >= 2
    assert value(text, "pagoda:grammar_compile_seconds_count") >= 1
    assert value(text, "pagoda:grammar_mask_fill_seconds_count") >= 1  # one per step with constrained rows
    assert value(text, "pagoda:grammar_compile_failures_total") == 0
