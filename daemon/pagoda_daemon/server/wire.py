"""What crosses the ZMQ sockets between the API server and the EngineCore process.

msgpack frames of plain lists and dicts; both ends are this code, so the shapes live here
and nowhere else.
"""

from __future__ import annotations

import dataclasses

import msgpack

from pagoda_daemon.engine.engine_core import EngineCoreOutput
from pagoda_daemon.engine.request import Request
from pagoda_daemon.sampling_params import SamplingParams, is_strict_int

# API server -> engine core
ADD, ABORT, FINISH, SHUTDOWN = "add", "abort", "finish", "shutdown"
# engine core -> API server
READY, OUTPUTS, FAILED = "ready", "outputs", "failed"


def pack(kind: str, payload) -> bytes:
    return msgpack.packb([kind, payload], use_bin_type=True)


def unpack(frame: bytes) -> tuple[str, object]:
    kind, payload = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    return kind, payload


def encode_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int | None,
                   extra_keys: tuple, arrival_time: float) -> dict:
    return {
        "id": request_id,
        "prompt": prompt_token_ids,
        "params": dataclasses.asdict(params),
        "eos": eos_token_id,
        "extra": [list(k) for k in extra_keys],
        "arrival": arrival_time,
    }


def pack_add(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int | None,
             extra_keys: tuple, arrival_time: float) -> bytes:
    """The ADD frame of one request. Built before the request is registered anywhere, so a
    request that cannot be encoded fails alone: ValueError, and nothing to undo."""
    try:
        return pack(ADD, encode_request(request_id, prompt_token_ids, params, eos_token_id, extra_keys,
                                        arrival_time))
    except (TypeError, ValueError, OverflowError) as e:  # UnicodeEncodeError is a ValueError
        raise ValueError(f"the request cannot be encoded: {e}") from e


def decode_request(d: dict, block_size: int, vocab_size: int) -> Request:
    """The engine core's side of ADD: checked again (SamplingParams validates on construction),
    so a request the core cannot serve is refused alone instead of failing a step."""
    prompt = d["prompt"]
    if not isinstance(prompt, list) or not prompt or \
            any(not is_strict_int(t) or not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be a non-empty list of integers in [0, {vocab_size})")
    return Request(
        d["id"], d["prompt"], SamplingParams(**d["params"]), d["eos"], block_size,
        extra_keys=tuple(tuple(k) for k in d["extra"]), arrival_time=d["arrival"],
    )


def encode_outputs(outputs: list[EngineCoreOutput]) -> list:
    return [
        [o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason,
         [list(lp.items()) for lp in o.new_logprobs], o.num_cached_tokens, o.queue_time]
        for o in outputs
    ]


def decode_outputs(rows: list) -> list[EngineCoreOutput]:
    return [
        EngineCoreOutput(rid, tokens, finish, stop, [dict((int(k), v) for k, v in lp) for lp in lps], cached, queue)
        for rid, tokens, finish, stop, lps, cached, queue in rows
    ]
