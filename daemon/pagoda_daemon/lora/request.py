"""Which adapter a request runs with: what travels from the API to the engine core and its
workers (msgspec only: no torch on this path, as in engine/messages.py)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An adapter a request names. ``digest`` (sha256 of the adapter's files) is its identity in
    the GPU slots, the workers' caches and the KV block hashes: two adapters never share
    cached KV, and an adapter replaced on disk under the same name is a different one."""

    name: str
    path: str
    digest: str


def lora_cache_keys(lora: LoRARequest | None) -> tuple:
    """Extra block-hash keys: the KV of a prompt under an adapter differs from the base model's."""
    return (("lora", lora.digest),) if lora is not None else ()
