"""A watch the operator holds itself, for a kind whose CRD may come and go (LeaderWorkerSets).

Why not a kopf handler: kopf stops the whole operator when one of its watch requests answers 404,
and a watch of a custom resource answers 404 once its CRD is deleted. kopf's own CRD watch stops
the resource's watcher on that deletion, but the watcher's reconnect can reach the API server
first: a landing CI run (2026-11-30) lost its operator that way after a test deleted the
LeaderWorkerSet CRD, and every later test of that operator failed. Here a 404 means "not served
now": the watch waits for ``served`` (API discovery, ``leader_worker_set.Discovery``) to say yes
again.

One watch request asks for the current objects too: without a ``resourceVersion`` the API
server sends each as ADDED before the changes (its "list and watch" in one). Reconnects resume
from the last version seen; a 410 (that version is compacted away) starts over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from pagoda_operator.kube import ApiError

log = logging.getLogger("pagoda_operator")

# seconds the API server keeps one watch request open (kopf's server_timeout for its watches)
SERVER_TIMEOUT_S = 300
# seconds before a watch that failed otherwise (connection lost, 5xx) is asked again
RETRY_S = 2.0


class Watches(Protocol):
    def watch(self, kind: str, namespace: str | None, selector: str | None, resource_version: str | None,
              timeout_s: int) -> Iterator[dict[str, Any]]: ...


class OptionalWatch:
    """Calls ``on_event(event)`` for each ADDED, MODIFIED or DELETED ``kind`` matching ``selector``
    in ``namespace`` (None: all), on a thread of its own, while ``served()`` says the kind is
    served; ``recheck_s``: how long to wait before asking ``served()`` again after a no."""

    def __init__(self, kube: Watches, kind: str, namespace: str | None, selector: str | None,
                 served: Callable[[], bool], on_event: Callable[[Mapping[str, Any]], None],
                 recheck_s: float, server_timeout_s: int = SERVER_TIMEOUT_S, retry_s: float = RETRY_S) -> None:
        self.kube, self.kind, self.namespace, self.selector = kube, kind, namespace, selector
        self.served, self.on_event = served, on_event
        self.recheck_s, self.server_timeout_s, self.retry_s = recheck_s, server_timeout_s, retry_s
        self.stop_flag = threading.Event()
        self.thread: threading.Thread | None = None
        self.resource_version: str | None = None

    def run(self) -> None:
        while not self.stop_flag.is_set():
            if not self.served():
                self.resource_version = None  # a CRD installed again starts from its current objects
                self.stop_flag.wait(self.recheck_s)
                continue
            try:
                self.follow()
            except Exception as e:
                if isinstance(e, ApiError) and e.status == 404:  # the CRD went away after discovery's answer
                    log.info("%s: no longer served, not watched until API discovery finds it again", self.kind)
                    self.resource_version = None
                    self.stop_flag.wait(self.recheck_s)
                else:  # connection lost, read timeout, 5xx: ask again from where it was
                    log.warning("watch of %s failed: %s", self.kind, e)
                    self.stop_flag.wait(self.retry_s)

    def follow(self) -> None:
        """One watch request, to its end (the server's timeout, or a stop)."""
        for event in self.kube.watch(self.kind, self.namespace, self.selector, self.resource_version,
                                     self.server_timeout_s):
            if self.stop_flag.is_set():
                return
            kind, obj = event.get("type"), event.get("object")
            if not isinstance(obj, Mapping):
                continue
            if kind == "ERROR":
                if obj.get("code") == 410:  # our version is gone from the server's history: start over
                    self.resource_version = None
                    return
                raise ApiError(int(obj.get("code") or 500), str(obj.get("reason") or ""), dict(obj))
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.resource_version = str(version)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                try:
                    self.on_event(event)
                except Exception as e:
                    log.warning("handling a %s event of %s failed: %s", kind, self.kind, e)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"watch-{self.kind}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stops after the request in flight, which may be waiting on the server (a daemon thread:
        it does not hold up the process's exit)."""
        self.stop_flag.set()
