"""A request as the engine core sees it: token ids in, token ids out, and where it stands."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pagoda_daemon.engine.block_hash import BlockHash, hash_block_tokens
from pagoda_daemon.lora.request import lora_cache_keys
from pagoda_daemon.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda_daemon.engine.grammar import RequestGrammar
    from pagoda_daemon.lora.request import LoRARequest
    from pagoda_daemon.pooling import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """Token-level state of one sequence.

    Holds no callables and no back-references, so a finished request is freed by
    reference counting alone.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        block_size: int,
        extra_keys: tuple = (),
        arrival_time: float | None = None,
        kv_source: str | None = None,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        # Part of every block hash, so a different adapter or salt never shares cache.
        self.extra_keys = extra_keys + lora_cache_keys(lora)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # the prefill instance holding this prompt's KV (tcp://HOST:PORT, verified by the API:
        # kv_offload/transfer.py), when the decode instance fetches from the one each request names
        self.kv_source = kv_source
        self.lora = lora  # the adapter it runs with (its digest is among extra_keys), or None: the base model
        # an embedding request (pooling.py): its prompt is computed once and one vector comes back,
        # no token is sampled
        self.pooling = pooling

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # advanced when a step is scheduled
        self.num_pending_tokens = 0  # sampled by a step whose result has not reached the host yet
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()
        self.first_scheduled_time: float | None = None
        # prompt logprobs scored so far (sampling_params.prompt_logprobs), until sent with the first output
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        # the constraint's compile and matcher (sampling_params.structured_outputs), set by the scheduler
        self.grammar: RequestGrammar | None = None

    @property
    def computes_every_position(self) -> bool:
        """Whether each prompt position's output is needed (prompt logprobs, mean or first-token
        pooling): the prompt is computed whole, none of it taken from a prefix cache or offload tier."""
        return self.sampling_params.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.every_position)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend the hash chain over every block the token list has filled."""
        bs = self.block_size
        for start in range(len(self.block_hashes) * bs, self.num_tokens - bs + 1, bs):
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.all_token_ids[start : start + bs]
            self.block_hashes.append(hash_block_tokens(parent, tokens, self.extra_keys))

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
