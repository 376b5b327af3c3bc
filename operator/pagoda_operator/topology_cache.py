"""The NodeTopologies the operator knows, kept up to date by its watch instead of listed on
every reconcile pass (a cluster-wide list per pass was the largest read of a pass).

Primed by one list the first time a pass asks, then moved by the watch's events (the handlers'
``on_topology``). Listed again every ``relist_after`` seconds: a watch that had to restart from
a fresh list reports the objects that exist, not the ones deleted meanwhile, and a deleted node
must not stay a placement candidate forever. A named registry shared by the kopf handlers and
the ticker thread: guarded by a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

RELIST_AFTER_S = 300.0


class TopologyCache:
    def __init__(self, relist_after: float = RELIST_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, dict[str, Any]] = {}
        self._listed_at: float | None = None
        self._relist_after = relist_after
        self._clock = clock

    def get(self, list_all: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Every known NodeTopology; ``list_all`` (an API list) runs the first time and then
        once per ``relist_after`` seconds."""
        with self._lock:
            now = self._clock()
            if self._listed_at is None or now - self._listed_at >= self._relist_after:
                self._by_name = {body["metadata"]["name"]: body for body in list_all()}
                self._listed_at = now
            return list(self._by_name.values())

    def observe(self, name: str, body: Mapping[str, Any] | None) -> None:
        """A watch event: the NodeTopology as it is now, or None when it was deleted."""
        with self._lock:
            if body is None:
                self._by_name.pop(name, None)
            else:
                self._by_name[name] = dict(body)
