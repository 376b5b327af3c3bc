"""vLLM's tokenizer routes: /tokenize (a prompt, or a conversation through the chat template),
/detokenize, /tokenizer_info. Clients count tokens and build prompts with them (inference-perf,
llm-d's router); they run no model and cost one tokenizer call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from pagoda_daemon.server.chat_template import render_chat
from pagoda_daemon.server.engine_client import EngineClient
from pagoda_daemon.server.errors import bad_request
from pagoda_daemon.server.protocol import (
    ChatTemplateFields,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
)


def prompt_ids(tokenizer, req: TokenizeCompletionRequest | ChatTemplateFields) -> list[int]:
    """A prompt's token ids, a conversation's through the chat template (/tokenize, Anthropic's count_tokens)."""
    text = req.prompt if isinstance(req, TokenizeCompletionRequest) else render_chat(tokenizer, req)
    return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)


def tokenize(client: EngineClient, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    tokenizer = client.tokenizer
    ids = prompt_ids(tokenizer, req)
    info = client.ready_info
    return {"count": len(ids), "max_model_len": info.max_model_len if info is not None else None, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize(client: EngineClient, req: DetokenizeRequest) -> dict[str, Any]:
    vocab = client.model_config.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
    return {"prompt": client.tokenizer.decode(req.tokens)}


def tokenizer_info(client: EngineClient) -> dict[str, Any]:
    t = client.tokenizer
    return {
        "tokenizer_class": type(t).__name__,
        "vocab_size": client.model_config.vocab_size,
        "model_max_length": client.ready_info.max_model_len if client.ready_info is not None else None,
        "bos_token": t.bos_token, "eos_token": t.eos_token, "pad_token": t.pad_token, "unk_token": t.unk_token,
        "add_bos_token": getattr(t, "add_bos_token", None),
        "chat_template": getattr(t, "chat_template", None),
    }


def add_routes(app: FastAPI, client: EngineClient, check_model: Callable[[str], object], parse) -> None:
    """parse(model, raw request): the app's bounded, off-loop body parser; check_model(name): an
    APIError unless the server serves that model (the base or an adapter, which share the tokenizer)."""

    @app.post("/tokenize")
    async def tokenize_route(raw: Request):
        req = await parse(TokenizeRequest, raw)
        if req.model is not None:
            check_model(req.model)
        return await asyncio.to_thread(tokenize, client, req)

    @app.post("/detokenize")
    async def detokenize_route(raw: Request):
        req = await parse(DetokenizeRequest, raw)
        if req.model is not None:
            check_model(req.model)
        return await asyncio.to_thread(detokenize, client, req)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenizer_info(client)
