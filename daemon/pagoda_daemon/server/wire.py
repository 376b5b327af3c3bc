"""The bytes on the ZMQ sockets between the API server and the EngineCore process: the
messages of ``engine/messages.py`` as msgpack, one typed decoder per direction."""

from __future__ import annotations

import dataclasses

import msgspec

from pagoda_daemon.engine.messages import AddRequest, FromCore, ToCore
from pagoda_daemon.engine.request import Request
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.pooling import PoolingParams
from pagoda_daemon.sampling_params import SamplingParams, is_strict_int

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


class BadFrame(ValueError):
    """A frame the engine core cannot read; ``request_id`` when it names the request to fail."""

    def __init__(self, message: str, request_id: str | None) -> None:
        super().__init__(message)
        self.request_id = request_id


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_from_core(frame: bytes) -> FromCore:
    return _from_core.decode(frame)


def decode_to_core(frame: bytes) -> ToCore:
    """A frontend message; BadFrame (naming the request when the frame does) if it is not one."""
    try:
        return _to_core.decode(frame)
    except msgspec.MsgspecError as e:
        raise BadFrame(str(e), _request_id_of(frame)) from e


def _request_id_of(frame: bytes) -> str | None:
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.MsgspecError:
        return None
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "add" and isinstance(raw[1], str):
        return raw[1]
    return None


def add_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int | None,
                extra_keys: tuple, arrival_time: float, kv_source: str | None = None,
                lora: LoRARequest | None = None, pooling: PoolingParams | None = None) -> AddRequest:
    return AddRequest(request_id, prompt_token_ids, dataclasses.asdict(params), eos_token_id,
                      [list(k) for k in extra_keys], arrival_time, kv_source, lora, pooling)


def encode_add(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int | None,
               extra_keys: tuple, arrival_time: float, kv_source: str | None = None,
               lora: LoRARequest | None = None, pooling: PoolingParams | None = None) -> bytes:
    """The ADD frame of one request. Built before the request is registered anywhere, so a
    request that cannot be encoded fails alone: ValueError, and nothing to undo."""
    try:
        return encode(add_request(request_id, prompt_token_ids, params, eos_token_id, extra_keys, arrival_time,
                                  kv_source, lora, pooling))
    except (TypeError, ValueError, OverflowError, msgspec.MsgspecError) as e:  # UnicodeEncodeError is a ValueError
        raise ValueError(f"the request cannot be encoded: {e}") from e


def to_request(add: AddRequest, block_size: int, vocab_size: int) -> Request:
    """The engine core's side of ADD: checked again (SamplingParams validates on construction),
    so a request the core cannot serve is refused alone instead of failing a step."""
    prompt = add.prompt_token_ids
    if not prompt or any(not is_strict_int(t) or not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be a non-empty list of integers in [0, {vocab_size})")
    params = SamplingParams(**add.sampling_params)
    # token ids that index the logits: out of range would fail the whole step, not this request
    masked = [*(params.allowed_token_ids or ()), *(t for word in params.bad_words_token_ids for t in word),
              *(params.logit_bias or ())]
    if any(t >= vocab_size for t in masked):
        raise ValueError(f"allowed_token_ids, bad_words and logit_bias must be token ids in [0, {vocab_size})")
    return Request(
        add.request_id, prompt, params, add.eos_token_id, block_size,
        extra_keys=tuple(tuple(k) for k in add.extra_keys), arrival_time=add.arrival_time, kv_source=add.kv_source,
        lora=add.lora, pooling=add.pooling,
    )
