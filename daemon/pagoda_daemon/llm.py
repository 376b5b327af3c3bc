"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import fields

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.input_processor import PromptType
from pagoda_daemon.engine.llm_engine import LLMEngine
from pagoda_daemon.engine.messages import EngineStats
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.outputs import RequestOutput, RequestOutputKind
from pagoda_daemon.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known - {'model'})}")
        from pagoda_daemon.models.fetch import resolve_model

        model = resolve_model(model, engine_args.get("model_cache_dir"))  # hf:// and s3:// are fetched first
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
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
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
        processed = [self.engine.input_processor.process(prompt, p) for prompt, p in zip(prompts, params)]

        ids = [self.engine.add_processed_request(text, token_ids, p, output_kind=RequestOutputKind.FINAL_ONLY,
                                                 lora=lora)
               for (text, token_ids), p, lora in zip(processed, params, loras)]
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
