"""The OpenAI-compatible HTTP API (FastAPI), over an EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda_daemon import __version__
from pagoda_daemon.engine.input_processor import InvalidInput
from pagoda_daemon.outputs import RequestOutput, RequestOutputKind
from pagoda_daemon.sampling_params import SEED_MIN, SamplingParams
from pagoda_daemon.server.auth import APIKeys
from pagoda_daemon.server.engine_client import EngineClient, EngineDeadError, PreparedRequest
from pagoda_daemon.server.errors import APIError, bad_request, unavailable
from pagoda_daemon.server.http_guard import RequestGuard
from pagoda_daemon.server.limits import RequestLimits
from pagoda_daemon.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    validation_error,
)

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerSettings:
    served_model_name: str
    max_waiting_requests: int = 4096  # beyond running + this many queued, new requests get 503
    default_max_tokens: int = 16


def build_app(client: EngineClient, settings: ServerSettings, tracer=None, *, keys: APIKeys | None = None,
              limits: RequestLimits | None = None, api_docs: bool = False) -> FastAPI:
    """The app; `keys` and `limits` go to the RequestGuard in front of every route, and the
    schema and docs pages exist only with `api_docs` (they map the API for anyone)."""
    docs = {} if api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Pagoda", version=__version__, **docs)
    app.add_middleware(RequestGuard, limits=limits or RequestLimits(), keys=keys or APIKeys(()),
                       draining=lambda: client.draining)
    app.state.client = client
    app.state.settings = settings
    app.state.tracer = tracer
    # JSON parsing and pydantic hold the GIL (about 15 ms for a 10 MB body): one body at a time in
    # a worker thread, so the event loop waits for at most one of them between its own turns.
    parse_gate = asyncio.Semaphore(1)

    async def parse(model, raw: Request):
        data = await raw.body()
        async with parse_gate:
            return await asyncio.to_thread(parse_request, model, data)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        """Routing errors (404, 405) in OpenAI's shape, with their headers (Allow on a 405)."""
        return APIError(str(exc.detail), exc.status_code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unexpected error")
        return APIError(f"internal error: {type(exc).__name__}", 500).response()

    @app.get("/health")
    async def health():
        engine = client.last_stats
        if not client.is_alive:
            return JSONResponse({"status": "dead", "reason": client.dead_reason, "engine": engine}, status_code=503)
        return {"status": "ok", "engine": engine}

    @app.get("/ready")
    async def ready():
        if not client.is_ready:
            return JSONResponse({"status": "not ready", "reason": client.not_ready_reason}, status_code=503)
        return {"status": "ready", **msgspec.structs.asdict(client.ready_info)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(settings, client)]}

    @app.get("/metrics")
    async def metrics():
        if client.metrics is None:
            return Response("", media_type="text/plain")
        body, content_type = client.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        req = await parse(CompletionRequest, raw)
        _check_model(req.model, settings)
        params = req.sampling_params(settings.default_max_tokens)
        prompts = req.prompts()
        _check_batch_fits(client, settings, len(prompts) * params.n)
        processed = await asyncio.to_thread(_process_prompts, client, prompts, params)
        return await _serve(raw, client, settings, req, processed, params, chat=False, tracer=tracer)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req = await parse(ChatCompletionRequest, raw)
        _check_model(req.model, settings)
        params = req.sampling_params()
        _check_batch_fits(client, settings, params.n)
        processed = await asyncio.to_thread(_process_chat, client, req, params)
        return await _serve(raw, client, settings, req, processed, params, chat=True, tracer=tracer)

    return app


# ---- request handling ------------------------------------------------------------------


def _check_model(name: str, settings: ServerSettings) -> None:
    if name != settings.served_model_name:
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise bad_request(f"the model '{shown}' does not exist; this server serves '{settings.served_model_name}'",
                          param="model", code="model_not_found")


def _capacity(client: EngineClient, settings: ServerSettings) -> int:
    """Requests the server holds at most: running plus queued."""
    return client.config.max_num_seqs + settings.max_waiting_requests


def _check_batch_fits(client: EngineClient, settings: ServerSettings, num_requests: int) -> None:
    """A batch larger than the server can ever hold is the caller's error (400), not a retry (503)."""
    limit = _capacity(client, settings)
    if num_requests > limit:
        raise bad_request(f"the request asks for {num_requests} generations (prompts x n), more than this server "
                          f"ever holds at once ({limit}); split it", param="n" if num_requests == 1 else "prompt",
                          code="too_many_generations")


def _ensure_ready(client: EngineClient) -> None:
    if not client.is_ready:
        raise unavailable(client.not_ready_reason or "the engine is not ready")


def _process_prompt(client: EngineClient, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
    try:
        return client.validate(prompt, params)
    except InvalidInput as e:
        raise bad_request(str(e), param=e.param, code=e.code) from e
    except ValueError as e:
        raise bad_request(str(e), param="prompt") from e


def _process_prompts(client: EngineClient, prompts: list, params: SamplingParams) -> list[tuple[str | None, list[int]]]:
    """Tokenize and check every prompt (run in a worker thread: the tokenizer releases the GIL)."""
    _ensure_ready(client)
    return [_process_prompt(client, p, params) for p in prompts]


def _process_chat(client: EngineClient, req: ChatCompletionRequest,
                  params: SamplingParams) -> list[tuple[str | None, list[int]]]:
    """Apply the chat template, then tokenize and check (run in a worker thread)."""
    _ensure_ready(client)
    conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        prompt_text = client.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=req.add_generation_prompt)
    except Exception as e:  # a template that rejects the conversation is the caller's problem
        raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from e
    return [_process_prompt(client, prompt_text, params)]


def _model_card(settings: ServerSettings, client: EngineClient) -> dict:
    info = client.ready_info
    return {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "pagoda",
            "max_model_len": info.max_model_len if info is not None else None}


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """n > 1 becomes n requests; a seeded request gives each child its own seed (seed + index,
    wrapping within the signed 64-bit range)."""
    from dataclasses import replace

    seed = None if params.seed is None else SEED_MIN + (params.seed + index - SEED_MIN) % 2**64
    return replace(params, n=1, seed=seed)


def _prepare(client: EngineClient, base_id: str, prompts, params: SamplingParams, cache_salt: str | None,
             arrival: float) -> list[tuple[int, PreparedRequest]]:
    """Every generation of the request (by choice index) encoded, before any is registered: all or nothing."""
    prepared = []
    for p_index, (text, ids) in enumerate(prompts):
        for i in range(params.n):
            index = p_index * params.n + i
            try:
                prepared.append((index, client.prepare(f"{base_id}-{index}", text, ids, _child_params(params, i),
                                                       cache_salt, arrival)))
            except ValueError as e:
                raise bad_request(str(e)) from e
    return prepared


async def _serve(raw: Request, client: EngineClient, settings: ServerSettings, req, prompts, params, chat: bool,
                 tracer=None):
    limit = _capacity(client, settings)
    n_new = len(prompts) * params.n
    if client.num_in_flight + n_new > limit:
        raise unavailable(f"the server is at capacity ({client.num_in_flight} requests in flight); retry later")
    base_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    arrival = time.monotonic()
    prepared = _prepare(client, base_id, prompts, params, getattr(req, "cache_salt", None), arrival)
    # No await from here to the last submit: the engine cannot be found dead half way through.
    _ensure_ready(client)
    # streamed: each output carries only what is new; otherwise one complete output at the end
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    streams = [(index, len(p.prompt_ids), client.submit(p, kind)) for index, p in prepared]
    span = None
    if tracer is not None:
        span = tracer.start_request_span(dict(raw.headers), base_id, {
            "gen_ai.response.id": base_id,
            "gen_ai.request.model": req.model,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.operation.name": "chat" if chat else "text_completion",
        })
        span.event("queued")
    builder_cls = _ChatBuilder if chat else _CompletionBuilder
    builder = builder_cls(base_id, created, req.model, client.tokenizer, params.n, params.logprobs)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(streams, builder, include_usage, span),
                                 media_type="text/event-stream")
    return await _collect(raw, streams, builder, span)


async def _merge(streams) -> AsyncIterator[tuple[int, int, RequestOutput]]:
    """Interleave the outputs of several generations as they arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, prompt_len, gen):
        try:
            async for out in gen:
                await queue.put((index, prompt_len, out))
        except Exception as e:
            await queue.put((index, prompt_len, e))
        finally:
            await queue.put((index, prompt_len, None))

    tasks = [asyncio.create_task(pump(i, n, g)) for i, n, g in streams]
    remaining = len(tasks)
    try:
        while remaining:
            index, prompt_len, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, prompt_len, item
    finally:
        for t in tasks:
            t.cancel()
        # a cancelled pump may still be inside its generator: wait for it before closing that
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, _, g in streams:
            await g.aclose()


def _wall(monotonic_s: float) -> float:
    return time.time() - (time.monotonic() - monotonic_s)


def _span_events(span, out: RequestOutput) -> None:
    """Scheduled and first-token events of the first generation, at the times they happened."""
    m = out.metrics
    if m is None:
        return
    if m.queue_time is not None:
        span.event("scheduled", timestamp=_wall(m.arrival_time + m.queue_time))
    if m.first_token_time is not None:
        span.event("first_token", timestamp=_wall(m.first_token_time))


async def _collect(raw: Request, streams, builder, span) -> JSONResponse:
    finals: dict[int, tuple[int, RequestOutput]] = {}

    async def gather():
        async for index, prompt_len, out in _merge(streams):
            if out.finished:
                finals[index] = (prompt_len, out)
                if span is not None and index == 0:
                    _span_events(span, out)

    task = asyncio.create_task(gather())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not done and await raw.is_disconnected():
                task.cancel()  # aborts every generation of this request
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if span is not None:
                    span.end("abort", 0, 0, error="client disconnected")
                return JSONResponse({}, status_code=499)
        task.result()
    except EngineDeadError as e:
        if span is not None:
            span.end(None, 0, 0, error=str(e))
        raise e.api_error() from e
    body = builder.full(finals)
    if span is not None:
        usage = body["usage"]
        span.end(",".join(c["finish_reason"] or "" for c in body["choices"]), usage["prompt_tokens"],
                 usage["completion_tokens"])
    return JSONResponse(body)


async def _stream(streams, builder, include_usage: bool, span) -> AsyncIterator[str]:
    """Stream DELTA outputs: each carries only the text, tokens and logprobs new since the last."""
    prompt_tokens: dict[int, int] = {}
    completion_tokens: dict[int, int] = {}
    reasons = []
    try:
        async for index, prompt_len, out in _merge(streams):
            c = out.outputs[0]
            if index not in prompt_tokens and hasattr(builder, "role_chunk"):
                yield _sse(builder.role_chunk(index))
            prompt_tokens[index] = prompt_len
            completion_tokens[index] = completion_tokens.get(index, 0) + len(c.token_ids)
            if c.text or c.finish_reason is not None or c.logprobs:
                yield _sse(builder.chunk(index, c.text, c.finish_reason, c.logprobs, c.token_ids))
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
                if span is not None and index == 0:
                    _span_events(span, out)
        n_prompt = builder.prompt_tokens({i: (n, None) for i, n in prompt_tokens.items()})
        if include_usage:
            yield _sse(builder.usage_chunk(_usage(n_prompt, sum(completion_tokens.values()))))
        if span is not None:
            span.end(",".join(reasons), n_prompt, sum(completion_tokens.values()))
    except EngineDeadError as e:
        if span is not None:
            span.end(None, 0, 0, error=str(e))
        yield _sse(e.api_error().body())
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _top(lp: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:n]


class _CompletionBuilder:
    """Builds /v1/completions bodies and stream chunks."""

    object_name = "text_completion"

    def __init__(self, rid: str, created: int, model: str, tokenizer, n: int, num_top_logprobs: int | None):
        self.rid, self.created, self.model = rid, created, model
        self.tokenizer, self.n, self.num_top = tokenizer, n, num_top_logprobs

    def _envelope(self, choices: list, **extra) -> dict:
        return {"id": self.rid, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None):
        if logprobs is None:
            return None
        dec = self.tokenizer.decode
        return {
            "tokens": [dec([t]) for t in token_ids],
            "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [{dec([k]): v for k, v in _top(lp, self.num_top or 0)} for lp in logprobs],
            "text_offset": [],
        }

    def chunk(self, index, delta, finish, logprobs, token_ids) -> dict:
        return self._envelope([{"index": index, "text": delta, "logprobs": self._logprobs(token_ids, logprobs),
                                "finish_reason": finish}])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope([], usage=usage)

    def prompt_tokens(self, finals) -> int:
        # n generations of one prompt count its tokens once
        return sum(n for index, (n, _) in finals.items() if index % self.n == 0)

    def full(self, finals) -> dict:
        choices = []
        for index in sorted(finals):
            c = finals[index][1].outputs[0]
            choices.append({"index": index, "text": c.text, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                            "finish_reason": c.finish_reason})
        completion = sum(len(out.outputs[0].token_ids) for _, out in finals.values())
        return self._envelope(choices, usage=_usage(self.prompt_tokens(finals), completion))


class _ChatBuilder(_CompletionBuilder):
    """Builds /v1/chat/completions bodies and stream chunks."""

    object_name = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, token_ids, logprobs):
        if logprobs is None:
            return None
        return {"content": [
            {**self._entry(t, lp.get(t)), "top_logprobs": [self._entry(k, v) for k, v in _top(lp, self.num_top or 0)]}
            for t, lp in zip(token_ids, logprobs)
        ]}

    def role_chunk(self, index: int) -> dict:
        return self._envelope([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])

    def chunk(self, index, delta, finish, logprobs, token_ids) -> dict:
        return self._envelope([{"index": index, "delta": {"content": delta} if delta else {},
                                "logprobs": self._logprobs(token_ids, logprobs), "finish_reason": finish}])

    def full(self, finals) -> dict:
        choices = []
        for index in sorted(finals):
            c = finals[index][1].outputs[0]
            choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason})
        completion = sum(len(out.outputs[0].token_ids) for _, out in finals.values())
        body = self._envelope(choices, usage=_usage(self.prompt_tokens(finals), completion))
        body["object"] = "chat.completion"
        return body
