"""Prefill/decode disaggregation's router (``pagoda pd-proxy``).

Each completion goes first to a prefill instance with one token to generate: it computes the
prompt and its disk tier keeps the prompt's full KV blocks. Then the request, unchanged, goes
to a decode instance whose ``kv_offload_disk_source`` is the prefill instance's disk tier (or
its transfer port on another host): its scheduler finds the prompt's blocks there (hard-linked
or fetched into its own tier, docs/kv-offload.md), loads them instead of computing them, and
generates the answer, streamed or not, which the proxy passes back as it comes. A prefill
instance on another host names itself in a signed ``x-pagoda-kv-source`` answer header, which
the proxy adds to the decode request: the decode instance then fetches from whichever prefill
instance answered. vLLM's P/D examples route the same way.

The proxy holds no state and no credentials of its own: a client's ``Authorization`` header
goes to both instances, which check it (docs/security.md). ``/ready`` is ready only when both
instances are (a pod running the three is Ready only then), and ``/metrics`` is the decode
instance's: its requests, KV cache and prefix hits are what the clients of the proxy see.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request,
# imported inside build_app so that the CLI does not import FastAPI) when they are defined.
import argparse
import json
from typing import Any

from pagoda_daemon.kv_offload.transfer_auth import SOURCE_HEADER
from pagoda_daemon.server.errors import APIError, bad_request

ROUTES = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id")
# What the prefill request must not carry: it generates one token, unstreamed, once, with no
# grammar. Whatever shapes the prompt (messages, tools, chat_template_kwargs) stays, so that the
# prefill instance computes the very blocks the decode instance will look for.
_NOT_FOR_PREFILL = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_completion_tokens",
                    "response_format", "structured_outputs", "tool_choice")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: the same prompt, one token, no stream."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["max_tokens"] = 1
    return out


def forwarded_headers(headers: Any) -> dict[str, str]:
    """What of a client's headers goes on to the instances: its credentials, content type and id."""
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}


PROBE_TIMEOUT_S = 5.0  # a probe of an instance: well inside a kubelet probe's own timeout
KEEPALIVE_S = 2.0  # an idle connection to an instance is closed after this, before the instance's 5 s


def describe(error: Exception) -> str:
    """An exception as a client can read it: httpx's often have no message (a dropped connection)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def not_ready_answer(role: str, status_code: int, body: Any) -> dict[str, Any]:
    """The proxy's 503 body for an instance that is not ready: the instance's reason and start-up
    phases, each named after its role, so a reader of the proxy's ``/ready`` (the operator's
    ``startupPhase``) sees which instance is still loading and what it does."""
    body = body if isinstance(body, dict) else {}
    phases = body.get("startup") if isinstance(body.get("startup"), list) else []
    return {"status": "not ready",
            "reason": f"{role} instance: {body.get('reason') or body.get('status') or f'HTTP {status_code}'}",
            "startup": [{**p, "phase": f"{role}: {p.get('phase')}"} for p in phases if isinstance(p, dict)]}


def build_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0, transport: Any = None):
    """The proxy's ASGI app (``transport``: an httpx transport for the instances, for tests)."""
    import httpx  # here: `pagoda --help` and the delegated commands need neither it nor fastapi
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    # Idle connections are dropped before the instances' (uvicorn closes them after 5 s): a request
    # sent on a connection the instance is closing fails with nothing received.
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport,
                               limits=httpx.Limits(max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S))
    app = FastAPI(title="pagoda pd-proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    def passed(response: Any):
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))

    async def relay(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise bad_request(f"the request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        headers = forwarded_headers(request.headers)
        try:
            first = await client.post(prefill_url + path, json=prefill_request(body), headers=headers)
            if first.status_code != 200:  # the request cannot be served: the prefill instance says why
                return passed(first)
            # where the prefill instance keeps the prompt's KV (between hosts), signed by it: the
            # decode instance checks it and fetches from there (kv_offload/transfer.py)
            source = first.headers.get(SOURCE_HEADER)
            if source is not None:
                headers = {**headers, SOURCE_HEADER: source}
            if not body.get("stream"):
                return passed(await client.post(decode_url + path, content=raw, headers=headers))
            answer = await client.send(client.build_request("POST", decode_url + path, content=raw, headers=headers),
                                       stream=True)
        except httpx.HTTPError as e:
            raise APIError(f"an instance behind the proxy did not answer: {describe(e)}", 502,
                           code="bad_gateway") from e
        if answer.status_code != 200:
            await answer.aread()
            await answer.aclose()
            return passed(answer)

        async def passed_through():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:  # also when the client goes away mid-stream: the decode connection goes back
                await answer.aclose()

        return StreamingResponse(passed_through(), media_type=answer.headers.get("content-type"))

    for path in ROUTES:
        async def route(request: Request, path: str = path):
            return await relay(request, path)

        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        headers = forwarded_headers(request.headers)
        try:
            return passed(await client.get(decode_url + "/v1/models", headers=headers))
        except httpx.HTTPError as e:
            raise APIError(f"the decode instance did not answer: {describe(e)}", 502, code="bad_gateway") from e

    @app.get("/health")
    async def health():
        ok = True
        for url in (prefill_url, decode_url):
            try:
                ok = ok and (await client.get(url + "/health", timeout=PROBE_TIMEOUT_S)).status_code == 200
            except httpx.HTTPError:
                ok = False
        return Response(status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready():
        answers = {}
        for role, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                r = await client.get(url + "/ready", timeout=PROBE_TIMEOUT_S)
            except httpx.HTTPError as e:
                return JSONResponse({"status": "not ready", "reason": f"{role} instance did not answer: {describe(e)}",
                                     "startup": []}, status_code=503)
            try:
                body = r.json()
            except ValueError:
                body = {}
            if r.status_code != 200:
                return JSONResponse(not_ready_answer(role, r.status_code, body), status_code=503)
            answers[role] = body
        return {"status": "ready", **answers}

    @app.get("/metrics")
    async def metrics():
        try:
            return passed(await client.get(decode_url + "/metrics", timeout=PROBE_TIMEOUT_S))
        except httpx.HTTPError as e:
            raise APIError(f"the decode instance did not answer: {describe(e)}", 502, code="bad_gateway") from e

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="the prefill instance's URL (http://host:port)")
    p.add_argument("--decode", required=True, help="the decode instance's URL")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            print(f"pagoda pd-proxy: --{name} must be an http(s) URL, not {url!r}")
            return 2
    if not 1 <= args.port <= 65535 or not args.timeout > 0:
        print("pagoda pd-proxy: --port must be 1..65535 and --timeout positive")
        return 2
    uvicorn.run(build_app(args.prefill, args.decode, args.timeout), host=args.host, port=args.port,
                log_level="warning")
    return 0
