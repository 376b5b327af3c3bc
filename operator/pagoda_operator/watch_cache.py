"""What a reconcile pass reads, kept by the operator's watches instead of read from the API
server on every pass.

A pass reads the InferenceService and six or seven of its objects; read from the API server,
that was about 75 requests per created InferenceService at 200 objects and 0.4 requests/s per
object while idle (issue #23's measurements on a real API server). Here each kind is, per
namespace (cluster-wide for NodeTopology):

- primed by one list the first time a pass asks for it (children by the operator's
  ``managed-by`` label, so the list holds only what it made);
- moved by the watch events kopf hands the operator's handlers, and by the operator's own
  writes, which it keeps as the API server answered them (write-through): the next pass sees
  what this one wrote without reading it back;
- listed again every ``RELIST_AFTER_S`` seconds: a watch that restarts from a fresh list
  reports the objects that exist, not the ones deleted meanwhile.

A list runs without the cache's lock (watch events arrive on kopf's event loop, which must not
wait for a request): events for that kind and namespace seen while its list is in flight are
kept and applied to the list's result before it is installed.

A newer resourceVersion always wins, so an event that arrives late never rolls an entry back.
A pass that acts on an entry the API server has moved past is refused (409, the write carries
the resourceVersion it read) and retried, as before. ``CachedKube`` is the ``Kube`` a pass
gets: reads of the kinds in ``CACHED`` come from here, everything else goes to the API
server. A named registry shared by the kopf handlers and the ticker threads: guarded by a lock.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagoda_operator.builders import MANAGED_BY
from pagoda_operator.kube import Kube
from pagoda_operator.telemetry import CACHED_BYTES, CACHED_OBJECTS

RELIST_AFTER_S = 300.0
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
# kind -> the label selector of its priming list (None: every object of the kind)
CACHED: dict[str, str | None] = {
    "InferenceService": None,
    "Deployment": MANAGED_SELECTOR,
    "StatefulSet": MANAGED_SELECTOR,
    "Pod": MANAGED_SELECTOR,
    "Service": MANAGED_SELECTOR,
    "ConfigMap": MANAGED_SELECTOR,
    "NetworkPolicy": MANAGED_SELECTOR,
    "NodeTopology": None,
}
CLUSTER_SCOPED = {"NodeTopology"}

Lister = Callable[[str, "str | None", "str | None"], list[dict[str, Any]]]


def _plain(value: Any) -> dict[str, Any]:
    """A mapping json cannot write as it is (kopf's Body on a handler's event) as a dict."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@dataclass(frozen=True)
class _Entry:
    """One object as JSON text: every read parses a fresh copy, which a pass may change freely
    (4.9 MiB of text at 200 InferenceServices, docs/benchmarks/2026-11-25-operator-scale.md)."""

    version: int | None
    labels: dict[str, str]
    text: bytes

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> _Entry:
        """Kept without ``metadata.managedFields`` (server-side apply's record of who set each
        field), which no pass reads and which is a large part of a pod's or Deployment's JSON; a
        write of the object without it leaves the API server's copy as it was."""
        meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
        return cls(_version(obj), dict(meta.get("labels") or {}),
                   json.dumps({**obj, "metadata": meta}, separators=(",", ":"), default=_plain).encode())

    def load(self) -> dict[str, Any]:
        return json.loads(self.text)


@dataclass
class _Store:
    listed_at: float
    objects: dict[str, _Entry] = field(default_factory=dict)


def _version(obj: Mapping[str, Any]) -> int | None:
    version = (obj.get("metadata") or {}).get("resourceVersion")
    return int(version) if isinstance(version, str) and version.isdigit() else None


def _newer(new: _Entry, old: _Entry | None) -> bool:
    """Whether ``new`` is at least as recent as ``old`` (resourceVersions are etcd revisions;
    one that is not a number is taken as newer)."""
    if old is None:
        return True
    a, b = new.version, old.version
    return a is None or b is None or a >= b


def _apply(objects: dict[str, _Entry], name: str, entry: _Entry, deleted: bool) -> tuple[bool, _Entry | None]:
    """One watch event into a store's objects: whether it moved them (not when it is older than
    what they hold), and the entry it replaced."""
    old = objects.get(name)
    if not _newer(entry, old):
        return False, old
    if deleted:
        objects.pop(name, None)
    else:
        objects[name] = entry
    return True, old


def matches(labels: Mapping[str, str], selector: str | None) -> bool:
    """An equality-based label selector (``k=v,k2=v2``, ``k`` for presence) against labels."""
    for term in (selector or "").split(","):
        term = term.strip()
        if not term:
            continue
        key, sep, value = term.partition("=")
        if sep and labels.get(key.strip()) != value.strip().lstrip("="):
            return False
        if not sep and key not in labels:
            return False
    return True


class WatchCache:
    def __init__(self, lister: Lister, relist_after: float = RELIST_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lister = lister
        self._relist_after = relist_after
        self._clock = clock
        self._lock = threading.Lock()
        self._stores: dict[tuple[str, str | None], _Store] = {}
        # one list at a time per kind and namespace; the events seen while it is in flight
        self._listing: dict[tuple[str, str | None], threading.Lock] = {}
        self._seen_while_listing: dict[tuple[str, str | None], list[tuple[str, _Entry, bool]]] = {}

    @staticmethod
    def _scope(kind: str, namespace: str | None) -> tuple[str, str | None]:
        return kind, None if kind in CLUSTER_SCOPED else namespace

    def _current(self, key: tuple[str, str | None]) -> _Store | None:
        """The key's store unless it was never listed or listed too long ago. Lock held."""
        store = self._stores.get(key)
        return store if store is not None and self._clock() - store.listed_at < self._relist_after else None

    def _store(self, kind: str, namespace: str | None) -> _Store:
        """The kind's objects in the namespace, listed when never listed or listed too long ago.
        Passes that need the same list wait for the one in flight; nothing else does."""
        key = self._scope(kind, namespace)
        with self._lock:
            store = self._current(key)
            listing = self._listing.setdefault(key, threading.Lock())
        if store is not None:
            return store
        with listing:
            with self._lock:
                store = self._current(key)
                if store is not None:  # listed by another pass meanwhile
                    return store
                self._seen_while_listing[key] = []
                listed_at = self._clock()
            try:
                items = self._lister(kind, key[1], CACHED[kind])
                fresh = _Store(listed_at, {o["metadata"]["name"]: _Entry.of(o) for o in items})
            except BaseException:
                with self._lock:
                    self._seen_while_listing.pop(key)
                raise
            with self._lock:
                for name, entry, deleted in self._seen_while_listing.pop(key):
                    _apply(fresh.objects, name, entry, deleted)
                old = self._stores.get(key)
                self._stores[key] = fresh
                self._account(kind, old.objects.values() if old else (), fresh.objects.values())
            return fresh

    @staticmethod
    def _account(kind: str, gone: Any, added: Any) -> None:
        """Keep the gauges of what the cache holds."""
        gone, added = list(gone), list(added)
        CACHED_OBJECTS.labels(kind).inc(len(added) - len(gone))
        CACHED_BYTES.labels(kind).inc(sum(len(e.text) for e in added) - sum(len(e.text) for e in gone))

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        store = self._store(kind, namespace)
        with self._lock:
            found = store.objects.get(name)
        return found.load() if found is not None else None

    def list(self, kind: str, namespace: str | None, selector: str | None = None) -> list[dict[str, Any]]:
        store = self._store(kind, namespace)
        with self._lock:
            entries = list(store.objects.values())
        return [e.load() for e in entries if matches(e.labels, selector)]

    def observe(self, kind: str, body: Mapping[str, Any], deleted: bool = False) -> None:
        """A watch event, or an object as a write returned it. Ignored for a namespace whose kind
        was never listed: its first list will hold it."""
        meta = body.get("metadata") or {}
        name = meta.get("name")
        if kind not in CACHED or not name:
            return
        if CACHED[kind] is not None and not matches(meta.get("labels") or {}, CACHED[kind]):
            return  # not one of the operator's: its lists leave such objects out too
        key = self._scope(kind, meta.get("namespace"))
        if key not in self._stores and key not in self._seen_while_listing:
            return  # a read without the lock: at worst the event is taken, and then kept or dropped below
        entry = _Entry.of(body)  # the JSON text made outside the lock
        with self._lock:
            if key in self._seen_while_listing:
                self._seen_while_listing[key].append((name, entry, deleted))
            store = self._stores.get(key)
            if store is None:
                return
            moved, old = _apply(store.objects, name, entry, deleted)
            if moved:
                self._account(kind, [old] if old else [], [] if deleted else [entry])

    def forget(self, kind: str, namespace: str | None, name: str) -> None:
        """The operator deleted it."""
        with self._lock:
            store = self._stores.get(self._scope(kind, namespace))
            old = store.objects.pop(name, None) if store is not None else None
            if old is not None:
                self._account(kind, [old], [])


class CachedKube(Kube):
    """The operator's ``Kube`` with the reads of ``CACHED`` kinds served by a WatchCache and its
    writes kept there. ``get_live`` always asks the API server (after a 409 on create: the
    object in the way may be one the operator's lists leave out)."""

    def __init__(self, inner: Kube, relist_after: float = RELIST_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # no super().__init__: inner holds the pool
        self.inner = inner
        def lister(kind: str, namespace: str | None, selector: str | None) -> list[dict[str, Any]]:
            # NodeTopology through topologies(): none (not an error) while its CRD is not installed
            return inner.topologies() if kind == "NodeTopology" else inner.list(kind, namespace, selector)

        self.cache = WatchCache(lister, relist_after, clock)

    def request(self, method: str, url_path: str, body: Any = None, query: Mapping[str, Any] | None = None,
                content_type: str = "application/json") -> Any:
        return self.inner.request(method, url_path, body, query, content_type)

    def watch(self, kind: str, namespace: str | None, selector: str | None, resource_version: str | None,
              timeout_s: int) -> Iterator[dict[str, Any]]:
        return self.inner.watch(kind, namespace, selector, resource_version, timeout_s)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        if kind in CACHED:
            return self.cache.get(kind, namespace, name)
        return self.inner.get(kind, namespace, name)

    def get_live(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.inner.get(kind, namespace, name)

    def list(self, kind: str, namespace: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        if kind in CACHED and (namespace is not None or kind in CLUSTER_SCOPED):
            return self.cache.list(kind, namespace, selector)
        return self.inner.list(kind, namespace, selector)

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        out = self.inner.create(obj)
        self.cache.observe(obj["kind"], out)
        return out

    def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        out = self.inner.replace(obj)
        self.cache.observe(obj["kind"], out)
        return out

    def merge_patch(self, kind: str, namespace: str | None, name: str, patch: Any, sub: str | None = None) -> Any:
        out = self.inner.merge_patch(kind, namespace, name, patch, sub)
        if isinstance(out, Mapping):
            self.cache.observe(kind, out)
        return out

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        self.inner.delete(kind, namespace, name)
        self.cache.forget(kind, namespace, name)
