"""Content hashes of full KV blocks, chained from the parent block.

The hash is SHA-256 over (parent hash, the block's tokens, extra keys): stable across
processes and restarts, so KV events and KV-aware routers can index it.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
_ROOT = b"pagoda-root"


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extra_keys: tuple = ()) -> BlockHash:
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()
