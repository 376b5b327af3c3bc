"""The shapes two servers give the same Responses and Anthropic Messages requests, side by side.

Run against `pagoda serve` and `vllm serve` on one machine (benchmarks/run_gpu.sh api-compat):
for each request, the HTTP status, the answer's JSON shape (every key path with its value's type;
list items merged) or, streamed, the order of its event types (repeats collapsed). The weights are
random, so the texts differ; the shapes are what clients parse. Standard library only (the GPU
image has no HTTP client of its own).

    python -m benchmarks.api_compat --server pagoda=http://127.0.0.1:18000 --model m --out compat.json
    python -m benchmarks.api_compat --server vllm=http://127.0.0.1:18001 --model m --out compat.json  # adds, compares
"""

from __future__ import annotations

import argparse
import http.client
import json
import urllib.error
import urllib.request
from typing import Any

TOOL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "responses": ("/v1/responses", {"input": "Hello there", "max_output_tokens": 16, "temperature": 0}),
    "responses-instructions-items": ("/v1/responses", {
        "instructions": "Be brief.", "max_output_tokens": 16, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": "Weather?"}]}),
    "responses-stream": ("/v1/responses", {"input": "Hello there", "max_output_tokens": 16, "stream": True}),
    "responses-logprobs": ("/v1/responses", {"input": "Hello", "max_output_tokens": 4, "top_logprobs": 2,
                                             "include": ["message.output_text.logprobs"]}),
    "responses-tool-required": ("/v1/responses", {
        "input": "Weather in Paris?", "max_output_tokens": 200, "tool_choice": "required", "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL}]}),
    "responses-tool-required-stream": ("/v1/responses", {
        "input": "Weather in Paris?", "max_output_tokens": 200, "tool_choice": "required", "stream": True,
        "parallel_tool_calls": False, "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL}]}),
    "responses-json-schema": ("/v1/responses", {
        "input": "A city", "max_output_tokens": 100,
        "text": {"format": {"type": "json_schema", "name": "city", "schema": TOOL, "strict": True}}}),
    "responses-previous-id": ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_unknown"}),
    "messages": ("/v1/messages", {"max_tokens": 16, "system": "Be brief.",
                                  "messages": [{"role": "user", "content": "Hello there"}]}),
    "messages-stream": ("/v1/messages", {"max_tokens": 16, "stream": True,
                                         "messages": [{"role": "user", "content": "Hello there"}]}),
    "messages-tool-any": ("/v1/messages", {
        "max_tokens": 200, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "get_weather", "input_schema": TOOL}]}),
    "messages-tool-any-stream": ("/v1/messages", {
        "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "get_weather", "input_schema": TOOL}]}),
    "messages-tool-result": ("/v1/messages", {
        "max_tokens": 16, "tools": [{"name": "get_weather", "input_schema": TOOL}], "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]}),
    "messages-count-tokens": ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hello"}]}),
    "messages-image": ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/x.png"}}]}]}),
}


def shape(value: Any, path: str = "", out: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Every key path of a JSON value with the types found there (list items under `[]`)."""
    out = {} if out is None else out
    out.setdefault(path or ".", set()).add(type(value).__name__)
    if isinstance(value, dict):
        for key, item in value.items():
            shape(item, f"{path}.{key}", out)
    elif isinstance(value, list):
        for item in value:
            shape(item, f"{path}[]", out)
    return out


def ask(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            status = resp.status
            try:
                text = resp.read().decode()
            except http.client.IncompleteRead as e:  # the server broke the answer off
                return {"status": status, "broken_off": e.partial.decode(errors="replace")[-300:]}
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    if body.get("stream") and status == 200:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        kinds: list[str] = []
        for event in events:
            if not kinds or kinds[-1] != event.get("type"):
                kinds.append(event.get("type"))
        last = events[-1] if events else {}
        final = last.get("response") or {}
        return {"status": status, "events": kinds, "sse_event_lines": text.count("event: "),
                "final": {k: sorted(v) for k, v in sorted(shape(final).items())}}
    try:
        answer = json.loads(text)
    except ValueError:
        return {"status": status, "text": text[:300]}
    return {"status": status, "shape": {k: sorted(v) for k, v in sorted(shape(answer).items())},
            "error": answer.get("error") if isinstance(answer, dict) else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", action="append", required=True, help="LABEL=BASE_URL (repeat)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, help="JSON results; servers already in it are kept and compared")
    args = parser.parse_args()
    try:  # servers asked in earlier runs (one server at a time on one GPU)
        with open(args.out) as f:
            results: dict[str, dict[str, Any]] = json.load(f)
    except FileNotFoundError:
        results = {}
    for spec in args.server:
        label, base = spec.split("=", 1)
        results[label] = {name: ask(base, path, {"model": args.model, **body}) for name, (path, body) in REQUESTS.items()}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    labels = list(results)
    for name in REQUESTS:
        row = [results[label][name] for label in labels]
        summary = " | ".join(f"{label}: {r['status']}" + (f" {'>'.join(r['events'])}" if "events" in r else "")
                             for label, r in zip(labels, row))
        print(f"{name}: {summary}")
        if len(row) == 2 and "shape" in row[0] and "shape" in row[1] and row[0]["status"] == row[1]["status"] == 200:
            a, b = row[0]["shape"], row[1]["shape"]
            only = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            typed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
            print(f"  only {labels[0]}: {only[0]}\n  only {labels[1]}: {only[1]}\n  types differ: {typed}")


if __name__ == "__main__":
    main()
