"""The scoring routes of pooling models, as vLLM 0.26 serves them: the request bodies and replies.

- ``POST /score`` (also ``/v1/score``): scores of text pairs, one text against many (1:N) or side
  by side (N:N). The two sides go by any one of vLLM's names for them: ``queries``/``documents``,
  ``queries``/``items``, ``data_1``/``data_2`` or ``text_1``/``text_2``.
- ``POST /rerank`` (also ``/v1/rerank``, ``/v2/rerank``): Jina's and Cohere's rerank, one
  ``query`` against ``documents``, the results sorted by relevance, the first ``top_n`` kept.
- ``POST /classify``: a sequence classifier's label scores per input (``input`` as the
  embeddings route takes it, or a conversation in ``messages``).

A cross-encoder (``...ForSequenceClassification`` with one label) scores a pair as one prompt; an
embedding model scores it as the cosine of the two texts' vectors (pooling.py).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar

from pydantic import Field, PrivateAttr, model_validator

from pagoda_daemon.pooling import as_texts
from pagoda_daemon.sampling_params import INT64_MAX
from pagoda_daemon.server.embeddings import MAX_INPUTS, InputFields, InputOrChat, PoolingFields
from pagoda_daemon.server.errors import bad_request
from pagoda_daemon.server.protocol import ChatTemplateFields, check_template_kwargs

# vLLM's fields Pagoda does not serve: a 400 names them rather than answering otherwise
UNSUPPORTED = ("mm_processor_kwargs", "chat_template", "truncation_side")
MAX_INSTRUCTION_CHARS = 65536  # the prompt's token count bounds it too; this is before tokenizing
# vLLM's names for the two sides of a score request, in the order they are looked for
SIDE_NAMES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))

Side = str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
TokenLimit = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _ScoringFields(PoolingFields):
    unsupported = UNSUPPORTED
    model: str | None = None  # None: the served model (vLLM's pooling routes make it optional)
    use_activation: bool | None = None  # None: the classifier's activation (a cross-encoder's sigmoid)
    max_tokens_per_query: TokenLimit = 0  # 0: no limit of the query's own
    max_tokens_per_doc: TokenLimit = 0
    # the score template's variables (templates.py): a 400 where the server has no score template
    instruction: Annotated[str, Field(min_length=1, max_length=MAX_INSTRUCTION_CHARS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_template_variables(self):
        check_template_kwargs(self.chat_template_kwargs)
        return self

    def template_variables(self) -> dict[str, Any] | None:
        """The score template's variables: ``chat_template_kwargs``, with ``instruction`` where they
        do not set one (vLLM's order)."""
        if self.instruction is None:
            return self.chat_template_kwargs
        return {"instruction": self.instruction, **(self.chat_template_kwargs or {})}

    @property
    def template_variable_field(self) -> str | None:
        """The field that sets template variables, if any (a 400 names it without a template)."""
        return "instruction" if self.instruction is not None else (
            "chat_template_kwargs" if self.chat_template_kwargs else None)


class ScoreRequest(_ScoringFields):
    route = "/score"
    text_1: Side
    text_2: Side
    _names: tuple[str, str] = PrivateAttr(("text_1", "text_2"))  # the body's own names for the sides

    @property
    def names(self) -> tuple[str, str]:
        return self._names

    def sides(self) -> tuple[list[str], list[str]]:
        return as_texts(self.text_1), as_texts(self.text_2)


class ScoreBody:
    """The body of ``/score`` under whichever of vLLM's names it gives its two sides."""

    @staticmethod
    def model_validate(body: dict) -> ScoreRequest:
        found = [pair for pair in SIDE_NAMES if pair[0] in body and pair[1] in body]
        if not found:
            raise bad_request("give the two sides of the pairs as queries and documents (or queries/items, "
                              "data_1/data_2, text_1/text_2)", param="queries")
        first, second = found[0]
        others = {name for pair in SIDE_NAMES for name in pair} - {first, second}
        extra = sorted(others & set(body))
        if extra:
            raise bad_request(f"give the sides once: {first}/{second} came with {extra[0]}", param=extra[0])
        fields = {k: v for k, v in body.items() if k not in (first, second)}
        request = ScoreRequest.model_validate({**fields, "text_1": body[first], "text_2": body[second]})
        request._names = (first, second)
        return request


class RerankRequest(_ScoringFields):
    route = "/rerank"
    query: str
    documents: Side
    top_n: TokenLimit = 0  # 0: every document
    return_documents: bool = True  # Jina's and Cohere's: each result carries its document's text

    names: ClassVar[tuple[str, str]] = ("query", "documents")

    def sides(self) -> tuple[list[str], list[str]]:
        return [self.query], as_texts(self.documents)


class _ClassifyFields(PoolingFields):
    unsupported = ("mm_processor_kwargs", "chat_template", "truncation_side")
    route = "/classify"
    model: str | None = None
    use_activation: bool | None = None


class ClassifyRequest(_ClassifyFields, InputFields):
    pass


class ClassifyChatRequest(_ClassifyFields, ChatTemplateFields):
    """vLLM's chat form of /classify: the conversation as the chat template renders it, one input."""

    add_generation_prompt: bool = False


ClassifyBody = InputOrChat(ClassifyRequest, ClassifyChatRequest)  # /classify


def _usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}


def score_body(request_id: str, model: str, scores: list[float], prompt_tokens: int) -> dict:
    """``/score``'s reply: one score per pair, in pair order."""
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(prompt_tokens)}


def rerank_body(request_id: str, model: str, documents: list[str], scores: list[float], top_n: int,
                return_documents: bool, prompt_tokens: int) -> dict:
    """``/rerank``'s reply: the documents by relevance, highest first (ties in input order), the
    first ``top_n`` (0: all), each with its index in the request."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    kept = order[:top_n] if top_n else order
    results = []
    for i in kept:
        result: dict = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": request_id, "model": model, "results": results,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def classify_body(request_id: str, model: str, probs: list[list[float]], labels: tuple[str, ...],
                  prompt_tokens: int) -> dict:
    """``/classify``'s reply: each input's label scores and the name of its highest."""
    data = []
    for i, row in enumerate(probs):
        best = max(range(len(row)), key=row.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels) else None, "probs": row,
                     "num_classes": len(row)})
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": _usage(prompt_tokens)}
