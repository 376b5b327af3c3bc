"""One request's outputs on their way from the engine client's reader task to the request's
handler.

When the handler falls behind (one API process streaming to hundreds of clients while the
engine makes 11,000 tokens/s), the outputs waiting for it are folded into one, as vLLM's
RequestOutputCollector does: the handler then sends one chunk carrying several tokens instead
of one chunk per token, so its cost follows what it can send rather than the engine's token
rate. With a queue per request instead, the H100 serving sweep at saturation saw a client TTFT
~1.7 s above the server's own, and tokens reaching clients in bursts
(docs/benchmarks/2026-11-27-piecewise-graphs-h100.md).
"""

from __future__ import annotations

import asyncio

from pagoda_daemon.outputs import RequestOutput, RequestOutputKind


class OutputCollector:
    """Holds at most one item: outputs arriving before the handler took the last one are
    merged into it (DELTA) or replace it (the other kinds carry everything so far); an error
    replaces whatever was waiting and stays until taken."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._waiting: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        waiting = self._waiting
        if isinstance(waiting, RequestOutput) and isinstance(item, RequestOutput) and self.kind is RequestOutputKind.DELTA:
            waiting.absorb(item)
        elif not isinstance(waiting, Exception):
            self._waiting = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output (all that arrived since the last call), or raise the error that ended
        the request. Returns without yielding to the event loop when something is waiting."""
        while self._waiting is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._waiting = self._waiting, None
        if isinstance(item, Exception):
            raise item
        return item
