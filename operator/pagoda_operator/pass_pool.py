"""The threads that run the reconcile passes kopf's handlers ask for.

A child's handler (a Deployment's or pod's watch event) runs on kopf's event loop: it keeps the
object in the watch cache (compact JSON) and asks this pool for its owner's pass, so the parsed
event is garbage at once. The InferenceService's own handlers await their passes here too, so at
most ``workers`` passes run at once. Why not run the pass inside the child's handler: while the
passes were busy, kopf kept every later event of every child queued as a parsed body for its
handler. With 1,000 InferenceServices created at once that queue reached 3,245 events and the
operator 295 MiB resident, and it stayed near that peak once idle (12.2-12.7 MiB per 100
objects, against 6.2-6.4 with this pool; docs/benchmarks/2026-11-30-operator-pass-pool.md).

A pass asked for while another of the same InferenceService waits to start is not queued twice:
the one waiting reads the cache when it starts, after the event that asked. That halved the
passes after child events (about 7,000 to 2,700 at 1,000 objects).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger("pagoda.operator")

T = TypeVar("T")
Key = tuple[str, str]  # (namespace, name) of an InferenceService


class PassPool:
    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pass")
        self._guard = threading.Lock()
        self._waiting: set[Key] = set()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of the pool's threads; its result or its exception."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def request(self, key: Key, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` (a pass of ``key``) unless a pass of ``key`` already waits to start.
        Never blocks: called on kopf's event loop. True when queued."""
        with self._guard:
            if key in self._waiting:
                return False
            self._waiting.add(key)
        try:
            self._pool.submit(self._start, key, fn)
        except RuntimeError:  # shut down: the operator is stopping
            with self._guard:
                self._waiting.discard(key)
            return False
        return True

    def _start(self, key: Key, fn: Callable[[], None]) -> None:
        with self._guard:
            self._waiting.discard(key)  # an event from now on needs a pass after this one
        try:
            fn()
        except Exception:  # the periodic pass repairs what a failed one leaves
            log.exception("pass of %s/%s failed", *key)

    def waiting(self) -> int:
        with self._guard:
            return len(self._waiting)

    def shutdown(self) -> None:
        """Drop the passes not started; wait for those running."""
        self._pool.shutdown(wait=True, cancel_futures=True)
