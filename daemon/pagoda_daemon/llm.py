"""Offline batches: `LLM(model=...).generate(prompts, SamplingParams(...))`, and for pooling models
`embed`, `classify` and `score`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import fields

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.input_processor import PromptType
from pagoda_daemon.engine.llm_engine import LLMEngine
from pagoda_daemon.engine.messages import EngineStats
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    RequestOutputKind,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda_daemon.pooling import (
    NOTHING_SAMPLED,
    EnginePooling,
    PoolingParams,
    as_texts,
    check_one_label,
    cosine,
    pair_up,
)
from pagoda_daemon.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known - {'model'})}")
        from pagoda_daemon.models.fetch import resolve_model

        model = resolve_model(model, engine_args.get("model_cache_dir"))  # hf:// and s3:// are fetched first
        if isinstance(engine_args.get("hf_overrides"), dict):  # vLLM's LLM takes the dict itself
            engine_args["hf_overrides"] = json.dumps(engine_args["hf_overrides"])
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def lora(self, name: str, path: str) -> LoRARequest:
        """A PEFT adapter directory, read and checked against this model (ValueError naming what
        is wrong), for ``generate(..., lora_request=...)``; needs ``enable_lora=True``."""
        from pagoda_daemon.lora.adapter import read_adapter
        from pagoda_daemon.lora.names import check_name

        config = self.engine.config
        if not config.enable_lora:
            raise ValueError("serving adapters needs enable_lora=True")
        return read_adapter(check_name(name), path, self.engine.model_config, config.max_lora_rank).request()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        `priority` (one per prompt, as vLLM's LLM takes it) sets each request's
        SamplingParams.priority; it needs scheduling_policy="priority". `lora_request` (one for
        all, or one per prompt; from `lora()`) runs prompts under an adapter. All prompts are
        validated before any is queued, so a bad one raises ValueError and nothing is left
        half-submitted.
        """
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(
            sampling_params
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
            params = [dataclasses.replace(p, priority=level) for p, level in zip(params, priority)]
        if any(p.n != 1 for p in params):
            raise ValueError("LLM.generate supports n=1 per prompt; repeat the prompt for more samples")
        loras = (list(lora_request) if isinstance(lora_request, Sequence) and not isinstance(lora_request, LoRARequest)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests")
        if any(lora is not None for lora in loras) and not self.engine.config.enable_lora:
            raise ValueError("lora_request needs enable_lora=True")
        if self.engine.pooling is not None:
            raise ValueError("this model is served for pooling (runner pooling): use LLM.embed, LLM.classify or "
                             "LLM.score")
        processed = [self.engine.input_processor.process(prompt, p) for prompt, p in zip(prompts, params)]

        ids = [self.engine.add_processed_request(text, token_ids, p, output_kind=RequestOutputKind.FINAL_ONLY,
                                                 lora=lora)
               for (text, token_ids), p, lora in zip(processed, params, loras)]
        return self._run(ids)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, normalize: bool | None = None,
              dimensions: int | None = None, truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in prompt order, from an engine with ``runner="pooling"`` (or a
        model that pools by default: docs/embeddings.md). ``normalize`` (None: the model's
        default) and ``dimensions`` (Matryoshka models) as the API's fields; every prompt is
        checked before any is queued."""
        pooling = self._pooling("embed")
        if lora_request is not None and not self.engine.config.enable_lora:
            raise ValueError("lora_request needs enable_lora=True")
        params = pooling.params(normalize, dimensions)
        outputs = self._pool([(*self._process(p, truncate_prompt_tokens), params) for p in _as_list(prompts)],
                             lora_request)
        return [EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(_floats(vector)))
                for out, vector in outputs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_activation: bool | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's label scores, in prompt order, from a sequence classifier
        (``...ForSequenceClassification``), through its activation unless ``use_activation=False``."""
        params = self._pooling("classify").classify_params(use_activation)
        outputs = self._pool([(*self._process(p, truncate_prompt_tokens), params) for p in _as_list(prompts)])
        return [ClassificationRequestOutput(out.request_id, out.prompt_token_ids, ClassificationOutput(_floats(v)))
                for out, v in outputs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *, use_activation: bool | None = None,
              truncate_prompt_tokens: int | None = None,
              chat_template_kwargs: dict | None = None) -> list[ScoringRequestOutput]:
        """A score per pair, 1:N (one text against each of ``data_2``) or N:N (side by side): a
        cross-encoder's on each pair as one prompt (its one label, through its activation unless
        ``use_activation=False``; ``chat_template_kwargs``: the score template's variables), or an
        embedding model's cosine of the two texts' vectors."""
        firsts, seconds = as_texts(data_1), as_texts(data_2)
        pairs = pair_up(firsts, seconds)
        pooling = self._pooling("score")
        if pooling.classifies:
            check_one_label(pooling)
            encoded = self.engine.input_processor.process_pairs([(firsts[i], seconds[j]) for i, j in pairs],
                                                                NOTHING_SAMPLED,
                                                                truncate_prompt_tokens=truncate_prompt_tokens,
                                                                template_variables=chat_template_kwargs)
            outputs = self._pool([(None, ids, pooling.classify_params(use_activation, start))
                                  for ids, start in encoded])
            return [ScoringRequestOutput(out.request_id, out.prompt_token_ids, ScoringOutput(_floats(v)[0]))
                    for out, v in outputs]
        params = pooling.params()
        texts = firsts + seconds
        vectors = self._pool([(*self._process(t, truncate_prompt_tokens), params) for t in texts])
        return [ScoringRequestOutput(f"{vectors[i][0].request_id}_{vectors[len(firsts) + j][0].request_id}",
                                     vectors[i][0].prompt_token_ids + vectors[len(firsts) + j][0].prompt_token_ids,
                                     ScoringOutput(cosine(vectors[i][1], vectors[len(firsts) + j][1])))
                for i, j in pairs]

    def _pooling(self, what: str) -> EnginePooling:
        """The engine's pooling settings, checked to serve ``what`` (embed, classify, score)."""
        pooling = self.engine.pooling
        if pooling is None:
            raise ValueError(f"this engine generates text: LLM.{what} needs a pooling model (runner='pooling')")
        if what == "embed" and pooling.classifies:
            raise ValueError("this model is a sequence classifier: use LLM.classify or LLM.score")
        if what == "classify" and not pooling.classifies:
            raise ValueError("this model serves embeddings, not classes: use LLM.embed (or LLM.score)")
        return pooling

    def _process(self, prompt: PromptType, truncate_prompt_tokens: int | None) -> tuple[str | None, list[int]]:
        return self.engine.input_processor.process(prompt, NOTHING_SAMPLED, pooling=True,
                                                   truncate_prompt_tokens=truncate_prompt_tokens)

    def _pool(self, requests: list[tuple[str | None, list[int], PoolingParams]],
              lora_request: LoRARequest | None = None) -> list[tuple[RequestOutput, bytes]]:
        """Run pooling requests (each checked already) to their ends: each output with its vector."""
        ids = [self.engine.add_processed_request(text, token_ids, NOTHING_SAMPLED,
                                                 output_kind=RequestOutputKind.FINAL_ONLY, lora=lora_request,
                                                 pooling=params)
               for text, token_ids, params in requests]
        outputs = []
        for out in self._run(ids):
            if out.pooled is None:
                raise RuntimeError(f"request {out.request_id} ended without its vector "
                                   f"({out.outputs[0].finish_reason}: {out.outputs[0].stop_reason})")
            outputs.append((out, out.pooled))
        return outputs

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        """Step the engine until every request of ``ids`` has finished; their outputs in that order."""
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            if not self.engine.has_unfinished_requests():
                missing = [i for i in ids if i not in finished]
                raise RuntimeError(f"requests {missing} ended without a final output")
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def get_stats(self) -> EngineStats:
        return self.engine.stats()


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a text, or a list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)  # type: ignore[arg-type]


def _floats(pooled: bytes) -> list[float]:
    """A vector as the engine sends it (float32, little-endian) as Python floats."""
    import numpy as np

    return np.frombuffer(pooled, dtype="<f4").tolist()
