"""Which data-parallel engine a request goes to.

Each engine keeps its own prefix cache, so a conversation's next turn is cheapest on the engine
that computed the turns before it. The router remembers, per engine, the hashes of the prompt
blocks it sent there (chained as the engine's prefix cache chains them, the cache salt in the
first), at most as many as the engine's KV cache holds, the oldest forgotten first: an
approximation of what each engine still caches, as SGLang's router keeps. A request goes to the
engine that was sent the longest run of its leading blocks, unless that engine already has more
requests in flight than the least loaded one plus a slack; otherwise, and when no engine was
sent any of its blocks, to the least loaded (ties: the one sent the fewest so far).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# How far above the least loaded engine the engine holding a request's prefix may be and still
# take it: at least this many requests, or this fraction of the least loaded one's.
MIN_SLACK = 4
SLACK_FRACTION = 0.25


def block_hashes(prompt_ids: Sequence[int], block_size: int, salt: tuple = ()) -> list[int]:
    """The chained hashes of the prompt's full blocks (the salt in the first one's)."""
    hashes, parent = [], hash(salt)
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class EngineRouter:
    def __init__(self, engines: int) -> None:
        self._sent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
        self._capacity = [1 << 62] * engines  # blocks: each engine's KV cache, once it is known

    def set_capacity(self, engine: int, blocks: int) -> None:
        self._capacity[engine] = max(blocks, 1)
        self._forget_beyond(engine)

    def choose(self, hashes: list[int], in_flight: Sequence[int], routed: Sequence[int]) -> int:
        """The engine for a request with these block hashes, given each engine's requests in
        flight and requests so far; the hashes are remembered as sent there."""
        least = min(range(len(in_flight)), key=lambda e: (in_flight[e], routed[e]))
        best, matched = least, 0
        for engine, sent in enumerate(self._sent):
            n = 0
            while n < len(hashes) and hashes[n] in sent:
                n += 1
            if n > matched or (n == matched and n and in_flight[engine] < in_flight[best]):
                best, matched = engine, n
        slack = max(MIN_SLACK, int(in_flight[least] * SLACK_FRACTION))
        engine = best if matched and in_flight[best] <= in_flight[least] + slack else least
        sent = self._sent[engine]
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        self._forget_beyond(engine)
        return engine

    def _forget_beyond(self, engine: int) -> None:
        sent = self._sent[engine]
        while len(sent) > self._capacity[engine]:
            sent.popitem(last=False)
