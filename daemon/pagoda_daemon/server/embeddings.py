"""OpenAI's embeddings API, ``POST /v1/embeddings``: the request body and the reply.

The fields are OpenAI's (``input``, ``model``, ``encoding_format``, ``dimensions``, ``user``) and
vLLM's extras (``truncate_prompt_tokens``, ``add_special_tokens``, ``normalize``, ``priority``,
``request_id``). ``input`` is a string, a list of token ids, or up to 2,048 of either (OpenAI's
bound); each becomes one pooling request (pooling.py) and one vector of the reply, in order.
vLLM's chat form takes ``messages`` instead of ``input``: one conversation through the model's
chat template (no generation prompt unless asked), one vector.
``encoding_format`` ``base64`` sends each vector as the base64 of its float32 little-endian
bytes, the layout the openai client decodes (and asks for by default).
"""

from __future__ import annotations

import base64
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagoda_daemon.sampling_params import INT64_MAX, INT64_MIN
from pagoda_daemon.server.errors import bad_request
from pagoda_daemon.server.protocol import (
    MAX_ID_CHARS,
    ChatTemplateFields,
    Identifier,
    TokenId,
    check_extra_fields,
)

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request
MAX_DIMENSIONS = 1 << 20  # past any model's width: the model's own bound is checked after parsing
# vLLM's embeddings fields Pagoda does not serve: a 400 names them rather than answering otherwise
UNSUPPORTED = ("embed_dtype", "endianness", "mm_processor_kwargs", "chat_template", "use_activation")

TokenList = Annotated[list[TokenId], Field(min_length=1)]
# One input or up to MAX_INPUTS of them: texts, or token ids
Inputs = (Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                        Field(min_length=1, max_length=MAX_INPUTS)]
          | TokenList | Annotated[list[TokenList], Field(min_length=1, max_length=MAX_INPUTS)])


class PoolingFields(BaseModel):
    """What the bodies of every pooling route share (embeddings, classify, score, rerank): who
    asks, and vLLM's extras. ``unsupported``: the route's fields that are a 400 when sent."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    unsupported: ClassVar[tuple[str, ...]] = ()
    route: ClassVar[str] = ""

    user: Identifier | None = None
    # vLLM's extra fields
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[\x21-\x7e]+$")] | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self):
        check_extra_fields(self.model_extra, self.unsupported, f" of {self.route}")
        return self

    def truncation(self, max_model_len: int) -> int | None:
        """truncate_prompt_tokens as a token count (-1: the model's context, as in vLLM)."""
        if self.truncate_prompt_tokens is None:
            return None
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
        return max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens


class InputFields(BaseModel):
    """The ``input`` form of a pooling body (/v1/embeddings, /classify): the inputs and whether
    the tokenizer adds its special tokens to the texts."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    input: Inputs
    add_special_tokens: bool = True

    def inputs(self) -> list[str | list[int]]:
        """Each input on its own: a text or a list of token ids."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]


class _EmbeddingFields(PoolingFields):
    """What both forms of the body share: the model, the reply's shape, and vLLM's extras."""

    unsupported = UNSUPPORTED
    route = "/v1/embeddings"

    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = None
    normalize: bool | None = None  # None: as the model's sentence-transformers modules say


class EmbeddingRequest(_EmbeddingFields, InputFields):
    pass


class EmbeddingChatRequest(_EmbeddingFields, ChatTemplateFields):
    """vLLM's chat form: the conversation as the chat template renders it, embedded whole.
    Without a generation prompt by default (vLLM's default here): the vector is the
    conversation's, not that of the assistant turn it would open."""

    add_generation_prompt: bool = False


class InputOrChat:
    """The body of a pooling route in either form: ``messages`` chooses the chat form."""

    def __init__(self, plain: type[BaseModel], chat: type[BaseModel]) -> None:
        self.plain, self.chat = plain, chat

    def model_validate(self, body: dict):
        if "messages" not in body:
            return self.plain.model_validate(body)
        if "input" in body:
            raise bad_request("give either input or messages, not both", param="messages")
        return self.chat.model_validate(body)


EmbeddingBody = InputOrChat(EmbeddingRequest, EmbeddingChatRequest)  # /v1/embeddings


def embedding_body(model: str, vectors: list[bytes], encoding_format: str, prompt_tokens: int) -> dict:
    """The reply: one ``embedding`` object per input, in order (``vectors``: float32 little-endian)."""
    import numpy as np

    def encoded(vector: bytes) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(vector).decode("ascii")
        return np.frombuffer(vector, dtype="<f4").tolist()

    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
