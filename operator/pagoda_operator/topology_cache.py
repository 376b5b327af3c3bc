"""The NodeTopologies the operator knows, kept up to date by its watch instead of listed on
every reconcile pass (a cluster-wide list per pass was the largest read of a pass).

Primed by one list the first time a pass asks, then moved by the watch's events (the handlers'
``on_topology``). A named registry shared by the kopf handlers and the ticker thread: guarded
by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any


class TopologyCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, dict[str, Any]] = {}
        self._primed = False

    def get(self, list_all: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Every known NodeTopology; ``list_all`` (an API list) runs once, the first time."""
        with self._lock:
            if not self._primed:
                for body in list_all():
                    self._by_name.setdefault(body["metadata"]["name"], body)
                self._primed = True
            return list(self._by_name.values())

    def observe(self, name: str, body: Mapping[str, Any] | None) -> None:
        """A watch event: the NodeTopology as it is now, or None when it was deleted."""
        with self._lock:
            if body is None:
                self._by_name.pop(name, None)
            else:
                self._by_name[name] = dict(body)
