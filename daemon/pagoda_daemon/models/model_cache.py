"""The node's model cache as a whole: which entries it holds, which are in use, and eviction.

:mod:`fetch` fills one entry (``<cache>/<scheme>/<quoted location>/<revision>/``) under an
exclusive ``flock`` on ``<revision>.lock`` beside it. A daemon that serves an entry keeps a
*shared* lock on that file for its lifetime (:func:`hold`); the kernel drops it when the process
dies, so a crashed daemon never pins an entry. The node agent (``pagoda topology --model-cache``)
lists the entries (:func:`entries`), reports them in the node's NodeTopology status, and evicts
(:func:`evict`) the least recently used ones nobody holds once the cache is over its size.

The chart's node cache is one directory per namespace (``<root>/<namespace>/<scheme>/...``, a
pod mounts only its own namespace's): :func:`entries` with ``namespaced=True`` walks that layout.
Every directory level is read without following symbolic links: a namespace's directory is
written by that namespace's pods, and a link planted there must not lead the agent elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import urllib.parse
from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from pagoda_daemon.models.fetch import COMPLETE_MARKER, lock_path

log = logging.getLogger("pagoda.model_cache")

MARKER_MAX_BYTES = 1 << 20  # a marker lists one line per file; anything larger is not ours


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One revision of one model in the cache (complete, or a download in progress or abandoned)."""

    path: Path
    namespace: str  # "" for a cache that is not split by namespace
    source: str  # the URI it was fetched from (the complete marker's; else rebuilt from the path)
    revision: str
    bytes: int
    last_used: float  # the marker's mtime (touched by every fetch that finds it), else the directory's
    complete: bool
    in_use: bool  # a daemon holds it (shared lock) or a fetch is writing it (exclusive lock)

    @property
    def lock(self) -> Path:
        return lock_path(self.path)


def hold(entry: str | Path) -> IO[str] | None:
    """Keep a shared lock on a fetched entry while the returned file stays open (the daemon keeps
    it for its lifetime): eviction passes over it. None when ``entry`` is not a complete cache
    entry any more (evicted between the fetch and this call: fetch again)."""
    entry = Path(entry)
    handle = _open_lock(lock_path(entry))  # open for the process's lifetime
    fcntl.flock(handle, fcntl.LOCK_SH)
    if not (entry / COMPLETE_MARKER).is_file():
        handle.close()
        return None
    return handle


def entries(cache_dir: str | Path, *, namespaced: bool = False) -> list[CacheEntry]:
    """Every entry under ``cache_dir``, oldest use first."""
    root = Path(cache_dir)
    found: list[CacheEntry] = []
    namespaces = [(d.name, d) for d in _subdirs(root)] if namespaced else [("", root)]
    for namespace, ns_dir in namespaces:
        for scheme_dir in _subdirs(ns_dir):
            for base in _subdirs(scheme_dir):
                for entry in _subdirs(base):
                    if entry.name != "refs":
                        found.append(_entry(entry, namespace, scheme_dir.name, base.name))
    return sorted(found, key=lambda e: e.last_used)


def evict(cache_dir: str | Path, max_bytes: int, *, namespaced: bool = False,
          keep: Collection[tuple[str, str]] = ()) -> list[CacheEntry]:
    """Delete the least recently used entries until the cache holds at most ``max_bytes``.

    Kept: entries in use (a daemon's shared lock, a fetch's exclusive one) and, for each
    ``(namespace, source)`` in ``keep`` (the models InferenceServices name), its most recently used
    complete revision, so that a model scaled to zero starts again without a download. Incomplete
    entries nobody is writing (a download abandoned half-way) count and go like complete ones.
    Returns the entries deleted."""
    return _evict(entries(cache_dir, namespaced=namespaced), max_bytes, keep)


def _evict(found: list[CacheEntry], max_bytes: int, keep: Collection[tuple[str, str]]) -> list[CacheEntry]:
    """:func:`evict` over a listing already made (oldest use first)."""
    newest: dict[tuple[str, str], CacheEntry] = {}
    for e in found:
        if e.complete:
            newest[(e.namespace, e.source)] = e  # sorted oldest first: the last one wins
    kept = {newest[k].path for k in keep if k in newest}
    total = sum(e.bytes for e in found)
    deleted = []
    for e in found:
        if total <= max_bytes:
            break
        if e.in_use or e.path in kept:
            continue
        with _exclusive(e.lock) as got:
            if not got:  # taken since it was listed
                continue
            (e.path / COMPLETE_MARKER).unlink(missing_ok=True)  # never a marked entry with missing files
            shutil.rmtree(e.path, ignore_errors=True)
        total -= e.bytes
        deleted.append(e)
        log.info("model cache: evicted %s@%s (%s, %d bytes)", e.source, e.revision, e.namespace or "-", e.bytes)
    return deleted


def tend(cache_dir: str | Path, max_bytes: int, keep: Collection[tuple[str, str]] | None) -> dict[str, Any]:
    """One pass of the node agent over a namespaced cache: evict down to ``max_bytes`` (only when
    ``keep`` is known: without the list of models InferenceServices name, nothing is deleted),
    then what the NodeTopology status shows (``status.modelCache``)."""
    started = time.monotonic()
    listed = entries(cache_dir, namespaced=True)  # one walk of the cache serves both
    evicted = _evict(listed, max_bytes, keep) if keep is not None else []
    gone = {e.path for e in evicted}
    found = [e for e in listed if e.path not in gone]
    return {
        "path": str(cache_dir),
        "maxBytes": max_bytes,
        "usedBytes": sum(e.bytes for e in found),
        "models": [
            {"namespace": e.namespace, "source": e.source, "revision": e.revision, "bytes": e.bytes,
             "lastUsedTime": _iso(e.last_used), "complete": e.complete, "inUse": e.in_use}
            for e in reversed(found)  # most recently used first
        ],
        "evicted": [{"namespace": e.namespace, "source": e.source, "revision": e.revision, "bytes": e.bytes}
                    for e in evicted],
        "scanSeconds": round(time.monotonic() - started, 3),
    }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _entry(path: Path, namespace: str, scheme: str, quoted_location: str) -> CacheEntry:
    marker = _marker(path / COMPLETE_MARKER)
    source = marker.get("source")
    try:
        last_used = (path / COMPLETE_MARKER if marker else path).lstat().st_mtime
    except OSError:
        last_used = 0.0
    return CacheEntry(
        path=path,
        namespace=namespace,
        source=source if isinstance(source, str) else f"{scheme}://{urllib.parse.unquote(quoted_location)}",
        revision=path.name,
        bytes=_size(path),
        last_used=last_used,
        complete=bool(marker),
        in_use=_locked_by_someone(lock_path(path)),
    )


def _marker(path: Path) -> dict[str, object]:
    """The complete marker's content; {} when absent, a link, oversized or not ours."""
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > MARKER_MAX_BYTES:
            return {}
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _subdirs(path: Path) -> list[Path]:
    """Real subdirectories (no links), sorted."""
    try:
        with os.scandir(path) as it:
            return sorted(Path(d.path) for d in it if d.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):  # os.walk follows no links by default
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _locked_by_someone(lock: Path) -> bool:
    if not lock.exists():
        return False
    with _exclusive(lock) as got:
        return not got


def _open_lock(lock: Path) -> IO[str]:
    """The entry's lock file, created if missing, never through a link (the lock's directory is
    written by the namespace's pods)."""
    fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "a")


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[bool]:
    """Try the entry's exclusive lock without waiting; yields whether it was had."""
    try:
        handle = _open_lock(lock)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        handle.close()
