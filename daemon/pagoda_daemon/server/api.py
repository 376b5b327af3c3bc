"""The OpenAI-compatible HTTP API (FastAPI), over an EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda_daemon import __version__
from pagoda_daemon.engine.input_processor import InvalidInput, bad_words_token_ids
from pagoda_daemon.kv_offload.transfer_auth import SOURCE_HEADER, SourceHeaders
from pagoda_daemon.lora.registry import AdapterRegistry
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.outputs import RequestOutput, RequestOutputKind
from pagoda_daemon.pooling import (
    NOTHING_SAMPLED,
    EnginePooling,
    PoolingParams,
    check_one_label,
    cosine,
    pair_up,
)
from pagoda_daemon.sampling_params import SEED_MIN, SamplingParams
from pagoda_daemon.server import admin, tokens
from pagoda_daemon.server.anthropic_output import AnthropicFormat, anthropic_error
from pagoda_daemon.server.anthropic_request import CountTokensRequest, MessagesRequest
from pagoda_daemon.server.auth import APIKeys
from pagoda_daemon.server.chat_reply import ReplyShape
from pagoda_daemon.server.chat_template import render_chat
from pagoda_daemon.server.embeddings import (
    EmbeddingBody,
    EmbeddingChatRequest,
    EmbeddingRequest,
    embedding_body,
)
from pagoda_daemon.server.engine_client import EngineClient, EngineDeadError, PreparedRequest
from pagoda_daemon.server.errors import APIError, bad_request, unavailable
from pagoda_daemon.server.http_guard import RequestGuard
from pagoda_daemon.server.limits import DEFAULT_MAX_WAITING_REQUESTS, RequestLimits
from pagoda_daemon.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Constraint,
    constraint_error,
    parse_request,
    validation_error,
)
from pagoda_daemon.server.reasoning import THINK_OPEN, constraint_start, reasoning_parser_for
from pagoda_daemon.server.reply_format import EventWriter, ReplyFormat, sse_event
from pagoda_daemon.server.responses import ChatBuilder, CompletionBuilder, ResponseOptions
from pagoda_daemon.server.responses_output import ResponsesFormat
from pagoda_daemon.server.responses_request import ResponsesRequest
from pagoda_daemon.server.scoring import (
    ClassifyBody,
    ClassifyChatRequest,
    ClassifyRequest,
    RerankRequest,
    ScoreBody,
    ScoreRequest,
    classify_body,
    rerank_body,
    score_body,
)
from pagoda_daemon.server.tool_parsers import parser_for

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
# Work below these sizes runs on the event loop: it holds the GIL wherever it runs, so a worker
# thread only adds hops that wait for the busy loop. 400 streamed requests at once on one H100
# (2026-11-27): with every body parsed in the thread, one at a time, the 90th percentile waited
# 1.8 s for its parse; p99 TTFT 2.6 s -> 2.1 s in place. At the bounds (2-core development VM):
# parsing a 64 KiB body 1.6 ms, checking 8,192 prompt token ids 0.6 ms.
INLINE_BODY_BYTES = 64 * 1024
INLINE_PROMPT_TOKENS = 8192


@dataclass
class ServerSettings:
    served_model_name: str
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS  # beyond running + this many queued: 503
    default_max_tokens: int = 16
    tool_call_parser: str | None = None  # None: the one the model's chat template shows
    reasoning_parser: str | None = None  # None: thinking stays in the content, as in vLLM
    kv_source_headers: SourceHeaders | None = None  # prefill/decode between hosts (kv_offload/transfer.py)
    adapters: AdapterRegistry | None = None  # LoRA adapters requests may name as their model (--enable-lora)
    pooling: EnginePooling | None = None  # the model is served for embeddings (runner pooling), else None


def build_app(client: EngineClient, settings: ServerSettings, tracer=None, *, keys: APIKeys | None = None,
              limits: RequestLimits | None = None, api_docs: bool = False,
              admin_keys: APIKeys | None = None) -> FastAPI:
    """The app; `keys` and `limits` go to the RequestGuard in front of every route, and the
    schema and docs pages exist only with `api_docs` (they map the API for anyone)."""
    docs = {} if api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Pagoda", version=__version__, **docs)
    app.add_middleware(RequestGuard, limits=limits or RequestLimits(), keys=keys or APIKeys(()),
                       draining=lambda: client.draining)
    app.state.client = client
    app.state.settings = settings
    app.state.tracer = tracer
    # JSON parsing and pydantic hold the GIL (about 15 ms for a 10 MB body): a large body is parsed
    # in a worker thread, one at a time, so the event loop waits for at most one of them between
    # its own turns. A small one is parsed in place: its thread hop costs more than the parse.
    parse_gate = asyncio.Semaphore(1)

    async def parse(model, raw: Request):
        data = await raw.body()
        if len(data) <= INLINE_BODY_BYTES:
            return parse_request(model, data)
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
            return JSONResponse({"status": "not ready", "reason": client.not_ready_reason,
                                 "startup": client.startup_phases()}, status_code=503)
        return {"status": "ready", **msgspec.structs.asdict(client.ready_info), "startup": client.startup_phases()}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        adapters = settings.adapters.names() if settings.adapters is not None else []
        return {"object": "list", "data": [_model_card(settings, client)]
                + [_adapter_card(settings, client, name) for name in adapters]}

    @app.get("/metrics")
    async def metrics():
        if client.metrics is None:
            return Response("", media_type="text/plain")
        body, content_type = client.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if _check_model(model_id, settings, status=404) is not None:
            return _adapter_card(settings, client, model_id)
        return _model_card(settings, client)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's health route (vLLM serves it too): /health's answer."""
        return await health()

    @app.post("/v1/completions")
    async def completions(raw: Request):
        _check_generates(settings, "/v1/completions")
        req = await parse(CompletionRequest, raw)
        _check_model(req.model, settings)
        constraint = req.constraint()
        params = req.sampling_params(settings.default_max_tokens, constraint)
        prompts = req.prompts()
        _check_batch_fits(client, settings, len(prompts) * params.n)
        if _is_light(prompts, req, constraint):
            processed, params = _process_prompts(client, prompts, params, req, constraint)
        else:
            processed, params = await asyncio.to_thread(_process_prompts, client, prompts, params, req, constraint)
        return await _serve(raw, client, settings, req, processed, params, chat=False, tracer=tracer)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        _check_generates(settings, "/v1/chat/completions")
        req = await parse(ChatCompletionRequest, raw)
        _check_model(req.model, settings)
        return await _serve_chat(raw, req)

    @app.post("/v1/responses")
    async def responses(raw: Request):
        """OpenAI's Responses API, served as the chat request it amounts to (responses_request.py)."""
        _check_generates(settings, "/v1/responses")
        request = await parse(ResponsesRequest, raw)
        req = request.to_chat(settings.served_model_name)
        _check_model(req.model, settings)
        return await _serve_chat(raw, req, ResponsesFormat(request, req))

    @app.post("/v1/messages")
    async def anthropic_messages(raw: Request):
        """Anthropic's Messages API, served as the chat request it amounts to (anthropic_request.py);
        its errors in Anthropic's shape, which its SDKs read."""
        try:
            _check_generates(settings, "/v1/messages")
            request = await parse(MessagesRequest, raw)
            req = request.to_chat()
            _check_model(req.model, settings)
            return await _serve_chat(raw, req, AnthropicFormat(request, req))
        except APIError as e:
            return anthropic_error(e)

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request):
        """OpenAI's embeddings: one pooling request per input (server/embeddings.py)."""
        pooling = _pooling_for(settings, "/v1/embeddings", "embed")
        req = await parse(EmbeddingBody, raw)
        _check_model(req.model, settings)
        try:
            params = pooling.params(req.normalize, req.dimensions)
        except ValueError as e:
            raise bad_request(str(e), param="dimensions") from e
        processed = await _process_inputs(client, settings, req, params)
        vectors = await _serve_pooling(raw, client, settings, req, processed, "embd", "embeddings", tracer,
                                       {"gen_ai.request.encoding_formats": [req.encoding_format]})
        if vectors is None:
            return JSONResponse({}, status_code=499)
        body = embedding_body(req.model, vectors, req.encoding_format, _prompt_tokens(processed))
        return Response(msgspec.json.encode(body), media_type="application/json")

    @app.post("/classify")
    async def classify(raw: Request):
        """vLLM's classification: a sequence classifier's label scores per input (server/scoring.py)."""
        pooling = _pooling_for(settings, "/classify", "classify")
        req = await parse(ClassifyBody, raw)
        _check_model(req.model or settings.served_model_name, settings)
        processed = await _process_inputs(client, settings, req, pooling.classify_params(req.use_activation))
        vectors = await _serve_pooling(raw, client, settings, req, processed, "classify", "classify", tracer)
        if vectors is None:
            return JSONResponse({}, status_code=499)
        probs = [np.frombuffer(v, dtype="<f4").tolist() for v in vectors]
        body = classify_body(_reply_id("classify", req, raw), settings.served_model_name, probs, pooling.labels,
                             _prompt_tokens(processed))
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def score_pairs(raw: Request, req: ScoreRequest | RerankRequest,
                          pooling: EnginePooling) -> tuple[list[float], int] | None:
        """The scores of the pairs a score or rerank request asks for, and the prompt tokens they
        took; None when the client went away."""
        _check_model(req.model or settings.served_model_name, settings)
        firsts, seconds = req.sides()
        try:
            pairs = pair_up(firsts, seconds)
        except ValueError as e:
            raise bad_request(str(e), param=req.names[1]) from e
        variables = req.template_variable_field
        if variables and (not pooling.classifies or client.pair_format.template is None):
            raise bad_request(f"{variables} sets the score template's variables, and this server has no score "
                              "template (serve a classifier with --chat-template)", param=variables)
        if pooling.classifies:  # a cross-encoder: each pair one prompt
            try:
                check_one_label(pooling)
            except ValueError as e:
                raise bad_request(str(e), param="model") from e
            _check_batch_fits(client, settings, len(pairs), pooled=req.names[1])
            processed = await asyncio.to_thread(_process_pairs, client, req, pooling, firsts, seconds, pairs)
            outputs = await _serve_pooling(raw, client, settings, req, processed, "score", "score", tracer)
            if outputs is None:
                return None
            return [float(np.frombuffer(v, dtype="<f4")[0]) for v in outputs], _prompt_tokens(processed)
        # an embedding model: each text one vector, each pair the cosine of its two
        _check_batch_fits(client, settings, len(firsts) + len(seconds),
                          pooled=req.names[1] if len(seconds) >= len(firsts) else req.names[0])
        processed = await asyncio.to_thread(_process_sides, client, req, pooling.params(), firsts, seconds)
        vectors = await _serve_pooling(raw, client, settings, req, processed, "score", "score", tracer)
        if vectors is None:
            return None
        n = len(firsts)
        tokens = sum(len(processed[i][1]) + len(processed[n + j][1]) for i, j in pairs)
        return [cosine(vectors[i], vectors[n + j]) for i, j in pairs], tokens

    async def serve_pairs(raw: Request, body, reply) -> Response:
        """A score or rerank request (``body``: its model) answered by ``reply(request, scores,
        prompt tokens)``."""
        pooling = _pooling_for(settings, raw.url.path, "score")
        req = await parse(body, raw)
        scored = await score_pairs(raw, req, pooling)
        if scored is None:
            return JSONResponse({}, status_code=499)
        return Response(msgspec.json.encode(reply(req, *scored)), media_type="application/json")

    @app.post("/score")
    @app.post("/v1/score")
    async def score(raw: Request):
        """vLLM's pair scoring (server/scoring.py)."""
        return await serve_pairs(raw, ScoreBody, lambda req, scores, tokens: score_body(
            _reply_id("score", req, raw), settings.served_model_name, scores, tokens))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(raw: Request):
        """Jina's and Cohere's rerank, as vLLM serves it (server/scoring.py)."""
        return await serve_pairs(raw, RerankRequest, lambda req, scores, tokens: rerank_body(
            _reply_id("rerank", req, raw), settings.served_model_name, req.sides()[1], scores, req.top_n,
            req.return_documents, tokens))

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(raw: Request):
        """The prompt's tokens for a Messages request (no max_tokens needed), through the chat template."""
        try:
            req = (await parse(CountTokensRequest, raw)).to_chat()
            _check_model(req.model, settings)
            _ensure_ready(client)
            return {"input_tokens": len(await asyncio.to_thread(tokens.prompt_ids, client.tokenizer, req))}
        except APIError as e:
            return anthropic_error(e)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.post("/v1/responses/{response_id}/cancel")
    async def stored_response(response_id: str):
        shown = response_id if len(response_id) <= 100 else response_id[:100] + "..."
        raise APIError(f"response '{shown}' not found: this server stores no responses", 404,
                       param="response_id", code="not_found")

    async def _serve_chat(raw: Request, req: ChatCompletionRequest, reply_format: ReplyFormat | None = None):
        """The chat path: the chat endpoint's, and the Responses and Messages endpoints' as the chat
        request theirs amounts to (their reply written by `reply_format`)."""
        constraint = req.constraint()
        params = req.sampling_params(constraint=constraint)
        _check_batch_fits(client, settings, params.n)
        tool_parser = _tool_parser(client, settings, req)
        processed, params = await asyncio.to_thread(_process_chat, client, req, params, constraint)
        reasoning = None
        if settings.reasoning_parser is not None:  # a prompt that ends in <think> starts the reply inside it
            reasoning = reasoning_parser_for(settings.reasoning_parser,
                                             (processed[0][0] or "").rstrip().endswith(THINK_OPEN))
            if params.structured_outputs is not None:  # the constraint applies to the answer, not the thinking
                after = constraint_start(client.tokenizer, processed[0][1])
                if after is not None:
                    params = dataclasses.replace(params, structured_outputs_after_token_id=after)
        named = req.named_tool()
        shape = ReplyShape(req.tool_mode, tool_parser, None if named is None else named[1].name,
                           req.parallel_tool_calls, reasoning)
        return await _serve(raw, client, settings, req, processed, params, chat=True, tracer=tracer, reply=shape,
                            reply_format=reply_format)

    tokens.add_routes(app, client, lambda name: _check_model(name, settings, status=404), parse)
    admin.add_routes(app, client, admin_keys or APIKeys((), frozenset()), parse, settings.adapters)
    for path in NOT_SERVED:
        app.add_api_route(path, _not_served(path), methods=["GET", "POST"], include_in_schema=False)
    return app


# OpenAI routes this server does not serve: a 404 that says so, in the OpenAI error shape.
NOT_SERVED = ("/v1/audio/transcriptions", "/v1/audio/translations",
              "/v1/audio/speech", "/v1/images/generations", "/v1/moderations", "/pooling")


def _check_generates(settings: ServerSettings, path: str) -> None:
    """A 404 on the generation routes of a server that pools (embeddings, scores), as vLLM
    serves only the routes of its runner."""
    if settings.pooling is not None:
        raise APIError(f"this server does not serve {path}: its model '{settings.served_model_name}' is served for "
                       f"{_pooling_routes(settings.pooling)} (runner pooling)", 404, code="not_found")


def _pooling_routes(pooling: EnginePooling) -> str:
    if pooling.classifies:
        return "classification and scoring (/classify, /score, /rerank)"
    return "embeddings and scoring (/v1/embeddings, /score, /rerank)"


def _pooling_for(settings: ServerSettings, path: str, task: str) -> EnginePooling:
    """The engine's pooling settings where it serves ``task`` (embed, classify, score), else a
    404 saying what this server serves instead."""
    pooling = settings.pooling
    if pooling is None:
        raise APIError(f"this server does not serve {path}: its model generates text (/v1/completions, "
                       "/v1/chat/completions); an embedding model or a cross-encoder is served with --runner pooling",
                       404, code="not_found")
    if (task == "embed" and pooling.classifies) or (task == "classify" and not pooling.classifies):
        raise APIError(f"this server does not serve {path}: its model '{settings.served_model_name}' is served for "
                       f"{_pooling_routes(pooling)}", 404, code="not_found")
    return pooling


def _not_served(path: str):
    async def not_served():
        raise APIError(f"this server does not serve {path}: it generates text (/v1/completions, "
                       "/v1/chat/completions)", 404, code="not_found")
    return not_served


# ---- request handling ------------------------------------------------------------------


def _check_model(name: str, settings: ServerSettings, status: int = 400) -> LoRARequest | None:
    """The adapter a request's model names, or None for the base model; else a 400 (404 on the
    routes that look a model up)."""
    if name == settings.served_model_name:
        return None
    lora = settings.adapters.get(name) if settings.adapters is not None else None
    if lora is not None:
        return lora
    shown = name if len(name) <= 100 else name[:100] + "..."
    adapters = " or one of its LoRA adapters (GET /v1/models)" if settings.adapters is not None else ""
    raise APIError(f"the model '{shown}' does not exist; this server serves '{settings.served_model_name}'{adapters}",
                   status, param="model", code="model_not_found")


def _capacity(client: EngineClient, settings: ServerSettings) -> int:
    """Requests the server holds at most: running plus queued."""
    return client.config.max_num_seqs + settings.max_waiting_requests


def _check_batch_fits(client: EngineClient, settings: ServerSettings, num_requests: int,
                      pooled: str | None = None) -> None:
    """A batch larger than the server can ever hold is the caller's error (400), not a retry (503).
    ``pooled`` names the field that carries a pooling request's many inputs; a generation's
    batch is its prompts times ``n``."""
    limit = _capacity(client, settings)
    if num_requests > limit:
        what, param = ("inputs", pooled) if pooled else (
            "generations (prompts x n)", "n" if num_requests == 1 else "prompt")
        raise bad_request(f"the request asks for {num_requests} {what}, more than this server ever holds at once "
                          f"({limit}); split it", param=param, code="too_many_generations")


def _ensure_ready(client: EngineClient) -> None:
    if not client.is_ready:
        raise unavailable(client.not_ready_reason or "the engine is not ready")


Processed = list[tuple[str | None, list[int]]]  # (prompt text or None, prompt token ids) per prompt


def _process_prompt(client: EngineClient, prompt, params: SamplingParams, req) -> tuple[str | None, list[int]]:
    try:
        truncate = req.truncation(client.input_processor.max_model_len) if client.input_processor else None
        return client.validate(prompt, params, add_special_tokens=req.add_special_tokens,
                               truncate_prompt_tokens=truncate)
    except InvalidInput as e:
        raise bad_request(str(e), param=e.param, code=e.code) from e
    except ValueError as e:
        raise bad_request(str(e), param="prompt") from e


def _with_bad_words(client: EngineClient, params: SamplingParams, req) -> SamplingParams:
    """The bad words as token sequences (a word past SamplingParams' token bound is a 400)."""
    if not req.bad_words:
        return params
    try:
        return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(client.tokenizer, req.bad_words))
    except ValueError as e:
        raise bad_request(str(e), param="bad_words") from e


def _check_constraint(constraint: Constraint | None, backend: str) -> None:
    """A constraint that cannot compile (with the engine's backend) is a 400 naming its field,
    before the request is queued."""
    if constraint is None:
        return
    param, structured = constraint
    try:
        structured.check(backend)
    except ValueError as e:
        raise constraint_error(param, e) from e


def _tool_parser(client: EngineClient, settings: ServerSettings, req: ChatCompletionRequest):
    """The parser of the calls a model makes when it may choose (tool_choice auto)."""
    if req.tool_mode != "auto":
        return None
    template = getattr(client.tokenizer, "chat_template", None)
    parser = parser_for(settings.tool_call_parser, template if isinstance(template, str) else None,
                        getattr(client.model_config, "model_type", None))
    if parser is None:
        raise bad_request('tool_choice "auto" needs a tool call parser, and this model\'s chat template shows no '
                          "tool call format Pagoda knows: start the server with --tool-call-parser, or send "
                          'tool_choice "required" or a named function', param="tool_choice")
    return parser


def _is_light(prompts: list, req: CompletionRequest, constraint: Constraint | None) -> bool:
    """Whether checking these prompts is cheaper than a thread hop: token ids only (nothing to
    tokenize), few of them, no bad words to tokenize and no grammar to compile."""
    return (constraint is None and not req.bad_words and all(isinstance(p, list) for p in prompts)
            and sum(len(p) for p in prompts) <= INLINE_PROMPT_TOKENS)


def _process_prompts(client: EngineClient, prompts: list, params: SamplingParams, req: CompletionRequest,
                     constraint: Constraint | None = None) -> tuple[Processed, SamplingParams]:
    """Tokenize and check every prompt (in a worker thread unless `_is_light`: the tokenizer releases the GIL)."""
    _ensure_ready(client)
    _check_constraint(constraint, client.config.structured_outputs_backend)
    params = _with_bad_words(client, params, req)
    return [_process_prompt(client, p, params, req) for p in prompts], params


def _process_chat(client: EngineClient, req: ChatCompletionRequest, params: SamplingParams,
                  constraint: Constraint | None = None) -> tuple[Processed, SamplingParams]:
    """Apply the chat template, then tokenize and check (run in a worker thread)."""
    _ensure_ready(client)
    _check_constraint(constraint, client.config.structured_outputs_backend)
    params = _with_bad_words(client, params, req)
    return [_process_prompt(client, render_chat(client.tokenizer, req), params, req)], params


PoolingInputs = list[tuple[str | None, list[int], PoolingParams]]  # (text or None, token ids, params) per request


async def _process_inputs(client: EngineClient, settings: ServerSettings,
                          req: EmbeddingRequest | EmbeddingChatRequest | ClassifyRequest | ClassifyChatRequest,
                          params: PoolingParams) -> PoolingInputs:
    """The requests an ``input`` (or a conversation in ``messages``) makes, each checked: in place
    when that is cheaper than a thread hop (token ids only, few of them), else in a worker thread."""
    if isinstance(req, (EmbeddingChatRequest, ClassifyChatRequest)):  # one conversation, one input: fits any server
        return await asyncio.to_thread(_process_chat_input, client, req, params)
    inputs = req.inputs()
    _check_batch_fits(client, settings, len(inputs), pooled="input")
    if all(isinstance(x, list) for x in inputs) and sum(len(x) for x in inputs) <= INLINE_PROMPT_TOKENS:
        return _process_pooling_inputs(client, inputs, req, params)
    return await asyncio.to_thread(_process_pooling_inputs, client, inputs, req, params)


def _process_pooling_inputs(client: EngineClient, inputs: list, req, params: PoolingParams,
                            param: str = "input", add_special_tokens: bool | None = None) -> PoolingInputs:
    """Tokenize and check every input of a pooling request (400 naming ``input``, or ``param``);
    ``add_special_tokens`` None: as the request says."""
    _ensure_ready(client)
    truncate = req.truncation(client.input_processor.max_model_len) if client.input_processor else None
    sampling = dataclasses.replace(NOTHING_SAMPLED, priority=req.priority)  # nothing sampled; its priority
    specials = req.add_special_tokens if add_special_tokens is None else add_special_tokens
    processed = []
    for i, item in enumerate(inputs):
        where = param if len(inputs) == 1 else f"{param}.{i}"
        try:
            processed.append((*client.validate(item, sampling, add_special_tokens=specials,
                                               truncate_prompt_tokens=truncate, pooling=True), params))
        except InvalidInput as e:
            raise bad_request(f"{where}: {e}", param=where if e.param == "prompt" else e.param, code=e.code) from e
        except ValueError as e:
            raise bad_request(f"{where}: {e}", param=where) from e
    return processed


def _process_chat_input(client: EngineClient, req: EmbeddingChatRequest | ClassifyChatRequest,
                        params: PoolingParams) -> PoolingInputs:
    """The conversation through the chat template, then tokenized and checked as one input."""
    _ensure_ready(client)
    return _process_pooling_inputs(client, [render_chat(client.tokenizer, req)], req, params, param="messages")


def _process_pairs(client: EngineClient, req: ScoreRequest | RerankRequest, pooling: EnginePooling,
                   firsts: list[str], seconds: list[str], pairs: list[tuple[int, int]]) -> PoolingInputs:
    """Each pair as one cross-encoder prompt, checked (a 400 naming the side and index at fault)."""
    _ensure_ready(client)
    processor = client.input_processor
    assert processor is not None
    truncate = req.truncation(processor.max_model_len)
    sampling = dataclasses.replace(NOTHING_SAMPLED, priority=req.priority)
    _check_token_limits(req, processor.max_model_len)
    try:
        encoded = processor.process_pairs([(firsts[i], seconds[j]) for i, j in pairs], sampling,
                                          truncate_prompt_tokens=truncate, max_first_tokens=req.max_tokens_per_query,
                                          max_second_tokens=req.max_tokens_per_doc,
                                          template_variables=req.template_variables())
    except InvalidInput as e:
        if e.index is None:
            raise bad_request(str(e), param=e.param, code=e.code) from e
        i, j = pairs[e.index]
        # a pair too long: its document at fault, the part that usually is
        side, index, many = (0, i, len(firsts) > 1) if e.param == "query" else (1, j, len(seconds) > 1)
        param = f"{req.names[side]}.{index}" if many else req.names[side]
        raise bad_request(f"pair {e.index} ({req.names[0]} {i}, {req.names[1]} {j}): {e}", param=param,
                          code=e.code) from e
    except ValueError as e:  # token types that are not two segments: the model's tokenizer, not the request
        raise bad_request(str(e), param=req.names[1]) from e
    return [(None, ids, pooling.classify_params(req.use_activation, start)) for ids, start in encoded]


def _process_sides(client: EngineClient, req: ScoreRequest | RerankRequest, params: PoolingParams,
                   firsts: list[str], seconds: list[str]) -> PoolingInputs:
    """Each text of both sides as one embedding request (the first side's first), checked."""
    _ensure_ready(client)
    processor = client.input_processor
    assert processor is not None
    _check_token_limits(req, processor.max_model_len)
    processed: PoolingInputs = []
    for name, texts, limit in ((req.names[0], firsts, req.max_tokens_per_query),
                               (req.names[1], seconds, req.max_tokens_per_doc)):
        texts = [processor.first_tokens(t, limit) for t in texts] if limit else texts
        processed += _process_pooling_inputs(client, texts, req, params, param=name, add_special_tokens=True)
    return processed


def _check_token_limits(req: ScoreRequest | RerankRequest, max_model_len: int) -> None:
    """max_tokens_per_query and max_tokens_per_doc below the context (vLLM's bound)."""
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(req, name) >= max_model_len:
            raise bad_request(f"{name} ({getattr(req, name)}) must be less than the model's context "
                              f"({max_model_len} tokens)", param=name)


def _prompt_tokens(processed: PoolingInputs) -> int:
    return sum(len(ids) for _, ids, _ in processed)


def _reply_id(prefix: str, req, raw: Request) -> str:
    return f"{prefix}-" + (req.request_id or raw.scope.get("state", {}).get("request_id") or uuid.uuid4().hex)


async def _serve_pooling(raw: Request, client: EngineClient, settings: ServerSettings, req, inputs: PoolingInputs,
                         prefix: str, operation: str, tracer, attributes: dict | None = None) -> list[bytes] | None:
    """Submit one pooling request per input; their vectors (a classifier's: its label scores) in
    input order, or None when the client went away (every request of it aborted)."""
    if client.num_in_flight + len(inputs) > _capacity(client, settings):
        raise unavailable(f"the server is at capacity ({client.num_in_flight} requests in flight); retry later")
    base_id = _reply_id(prefix, req, raw)
    engine_id = f"{base_id}-{uuid.uuid4().hex[:8]}"
    arrival = time.monotonic()
    sampling = dataclasses.replace(NOTHING_SAMPLED, priority=req.priority)
    try:
        prepared = [client.prepare(f"{engine_id}-{i}", text, ids, sampling, None, arrival, None, None, params)
                    for i, (text, ids, params) in enumerate(inputs)]
    except ValueError as e:
        raise bad_request(str(e)) from e
    _ensure_ready(client)  # no await from here to the last submit
    streams = [(i, client.submit(p, RequestOutputKind.FINAL_ONLY)) for i, p in enumerate(prepared)]
    arrived = raw.scope.get("state", {}).get("arrived")  # set by the RequestGuard
    if client.metrics is not None and arrived is not None:
        client.metrics.observe_admission(arrival - arrived)
    span = None
    if tracer is not None:
        span = tracer.start_request_span(dict(raw.headers), base_id, {
            "gen_ai.request.model": req.model or settings.served_model_name, "gen_ai.operation.name": operation,
            **(attributes or {})})
        span.event("queued")
    finals = await _gather_finals(raw, streams, span)
    if finals is None:
        return None
    prompt_tokens = _prompt_tokens(inputs)
    failed = next((i for i in range(len(inputs)) if finals[i].pooled is None), None)
    if failed is not None:
        out = finals[failed].outputs[0]
        if span is not None:
            span.end(out.finish_reason, prompt_tokens, 0, error=str(out.stop_reason))
        raise APIError(f"the engine could not compute input {failed}: {out.stop_reason or out.finish_reason}", 500)
    raw.state.usage = (prompt_tokens, 0)  # the access line
    if span is not None:
        span.end("stop", prompt_tokens, 0)
    return [finals[i].pooled for i in range(len(inputs))]  # type: ignore[misc]


def _model_card(settings: ServerSettings, client: EngineClient) -> dict:
    info = client.ready_info
    return {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "pagoda",
            "root": settings.served_model_name, "parent": None,
            "max_model_len": info.max_model_len if info is not None else None}


def _adapter_card(settings: ServerSettings, client: EngineClient, name: str) -> dict:
    """An adapter as vLLM lists one: its parent is the base model (its path on the server is not shown)."""
    return {**_model_card(settings, client), "id": name, "root": name, "parent": settings.served_model_name}


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """n > 1 becomes n requests; a seeded request gives each child its own seed (seed + index,
    wrapping within the signed 64-bit range)."""
    from dataclasses import replace

    seed = None if params.seed is None else SEED_MIN + (params.seed + index - SEED_MIN) % 2**64
    return replace(params, n=1, seed=seed)


def _prepare(client: EngineClient, base_id: str, prompts, params: SamplingParams, cache_salt: str | None,
             arrival: float, kv_source: str | None = None,
             lora: LoRARequest | None = None) -> list[tuple[int, PreparedRequest]]:
    """Every generation of the request (by choice index) encoded, before any is registered: all or nothing."""
    prepared = []
    for p_index, (text, ids) in enumerate(prompts):
        for i in range(params.n):
            index = p_index * params.n + i
            try:
                prepared.append((index, client.prepare(f"{base_id}-{index}", text, ids, _child_params(params, i),
                                                       cache_salt, arrival, kv_source, lora)))
            except ValueError as e:
                raise bad_request(str(e)) from e
    return prepared


async def _serve(raw: Request, client: EngineClient, settings: ServerSettings, req, prompts: Processed,
                 params: SamplingParams, chat: bool, tracer=None, reply: ReplyShape | None = None,
                 reply_format: ReplyFormat | None = None):
    """Submit every generation of the request and answer: whole, or streamed as it comes (in
    `reply_format`'s shape when the chat request `req` was made from another API's request)."""
    limit = _capacity(client, settings)
    n_new = len(prompts) * params.n
    if client.num_in_flight + n_new > limit:
        raise unavailable(f"the server is at capacity ({client.num_in_flight} requests in flight); retry later")
    # The response id is the caller's (request_id field, else X-Request-Id); the engine's ids add
    # a random part, so a caller reusing an id never collides with a request in flight.
    name = req.request_id or raw.scope.get("state", {}).get("request_id") or uuid.uuid4().hex
    prefix = reply_format.id_prefix if reply_format is not None else "chatcmpl-" if chat else "cmpl-"
    base_id = prefix + name
    engine_id = f"{base_id}-{uuid.uuid4().hex[:8]}"
    created = int(time.time())
    arrival = time.monotonic()
    kv_headers = settings.kv_source_headers
    try:
        kv_source = None if kv_headers is None else kv_headers.source_of(raw.headers.get(SOURCE_HEADER))
    except ValueError as e:
        raise bad_request(str(e), param=SOURCE_HEADER) from e
    lora = _check_model(req.model, settings)  # (checked by the route already; an adapter unloaded since is a 400)
    prepared = _prepare(client, engine_id, prompts, params, getattr(req, "cache_salt", None), arrival, kv_source,
                        lora)
    # No await from here to the last submit: the engine cannot be found dead half way through.
    _ensure_ready(client)
    # streamed: each output carries only what is new; otherwise one complete output at the end
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    streams = [(index, client.submit(p, kind)) for index, p in prepared]
    if client.metrics is not None:
        client.metrics.observe_request_params(params.n, req.max_tokens)
        arrived = raw.scope.get("state", {}).get("arrived")  # set by the RequestGuard
        if arrived is not None:
            client.metrics.observe_admission(arrival - arrived)
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
    options = ResponseOptions(
        response_id=base_id, created=created, model=req.model, n=params.n, num_top_logprobs=params.logprobs,
        prompt_logprobs=req.prompt_logprobs is not None, echo=req.echo and not chat,
        echo_only=getattr(req, "echo_only", False), echo_text=req.echo_text() if chat else "",
        token_ids_as_tokens=req.return_tokens_as_token_ids, continuous_usage=req.continuous_usage,
        reply=reply or ReplyShape())
    builder = (ChatBuilder if chat else CompletionBuilder)(options, client.tokenizer, prompts)
    answer_header = None if kv_headers is None else kv_headers.answer_header()
    headers = {SOURCE_HEADER: answer_header} if answer_header else None  # where this prompt's KV can be fetched
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _chunks(streams, builder, include_usage, span, raw.state)
        body = (_chat_sse(chunks) if reply_format is None else
                _event_sse(chunks, reply_format.events(base_id, created, sum(len(ids) for _, ids in prompts))))
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    response = await _collect(raw, streams, builder, span, reply_format, base_id, created)
    if headers:
        response.headers.update(headers)
    return response


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several generations as they arrive (one generation, the
    common case, is read directly: no task and queue hop per output)."""
    if len(streams) == 1:
        index, gen = streams[0]
        try:
            async for out in gen:
                yield index, out
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, gen):
        try:
            async for out in gen:
                await queue.put((index, out))
        except Exception as e:
            await queue.put((index, e))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in streams]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        # a cancelled pump may still be inside its generator: wait for it before closing that
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, g in streams:
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


async def _gather_finals(raw: Request, streams, span) -> dict[int, RequestOutput] | None:
    """Every request's final output, by index; None when the client went away meanwhile (every
    request of it is then aborted, and the span ended)."""
    finals: dict[int, RequestOutput] = {}

    async def gather():
        async for index, out in _merge(streams):
            if out.finished:
                finals[index] = out
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
                return None
        task.result()
    except EngineDeadError as e:
        if span is not None:
            span.end(None, 0, 0, error=str(e))
        raise e.api_error() from e
    return finals


async def _collect(raw: Request, streams, builder: CompletionBuilder, span, reply_format: ReplyFormat | None = None,
                   reply_id: str = "", created: int = 0) -> JSONResponse:
    finals = await _gather_finals(raw, streams, span)
    if finals is None:
        return JSONResponse({}, status_code=499)
    body = builder.full(finals)
    u = body["usage"]
    raw.state.usage = (u["prompt_tokens"], u["completion_tokens"])  # the access line
    if span is not None:
        span.end(builder.finish_reasons(finals), u["prompt_tokens"], u["completion_tokens"])
    return JSONResponse(body if reply_format is None else reply_format.body(reply_id, created, body))


async def _chunks(streams, builder: CompletionBuilder, include_usage: bool, span,
                  state) -> AsyncGenerator[list[dict], None]:
    """The chunks of DELTA outputs, those of one output together: each output carries only the
    text, tokens and logprobs new since the last (all of them since the previous one when this
    handler fell behind: output_collector.py). Then the usage chunk, if asked for; an error body
    if the engine dies."""
    reasons = []
    try:
        async for index, out in _merge(streams):
            chunks = builder.first_chunks(index, out) if index not in builder.choices else []
            chunks += builder.deltas(index, out)
            if chunks:
                yield chunks
            c = out.outputs[0]
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
                if span is not None and index == 0:
                    _span_events(span, out)
        final = builder.usage_chunk()
        state.usage = (final["usage"]["prompt_tokens"], final["usage"]["completion_tokens"])  # the access line
        if include_usage:
            yield [final]
        if span is not None:
            span.end(",".join(reasons), final["usage"]["prompt_tokens"], final["usage"]["completion_tokens"])
    except EngineDeadError as e:
        if span is not None:
            span.end(None, 0, 0, error=str(e))
        yield [e.api_error().body()]


async def _chat_sse(chunks: AsyncGenerator[list[dict], None]) -> AsyncIterator[str]:
    """Chat and completion streams: the chunks of one output in one write, then [DONE]. Closed
    early (the client left), it closes `chunks` at once, which aborts the generations."""
    async with contextlib.aclosing(chunks):
        async for group in chunks:
            yield "".join(_sse(chunk) for chunk in group)
    yield "data: [DONE]\n\n"


async def _event_sse(chunks: AsyncGenerator[list[dict], None], events: EventWriter) -> AsyncIterator[str]:
    """Another API's stream (`reply_format.py`): its opening events, those of each output in one
    write, its closing events."""
    yield "".join(map(sse_event, events.start()))
    async with contextlib.aclosing(chunks):
        async for group in chunks:
            sent = [event for chunk in group for event in events.chunk(chunk)]
            if sent:
                yield "".join(map(sse_event, sent))
    yield "".join(map(sse_event, events.finish()))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
