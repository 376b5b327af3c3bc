"""The operator process's heap: few malloc arenas, and freed memory handed back.

Every thread that allocates (kopf's handler executor, the periodic pass's pool, the watches,
the lease and webhook threads) may get a glibc malloc arena of its own, up to 8 per core, and
what a burst of events allocated there stays resident after Python frees it. With two arenas
the operator grew 31.8 MiB per 100 InferenceServices created at once instead of 40.5 (the test
cluster, 2 cores, 2026-11-26: docs/benchmarks/2026-11-26-operator-scale.md). After each
periodic pass, a collection and ``malloc_trim`` return what the pass and the events since freed.

Only glibc has these calls; elsewhere (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Any

M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h
ARENAS = 2


@functools.cache
def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc arenas from now on; call before threads start. True if set."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, arenas) == 1)


def give_back() -> bool:
    """Collect garbage, then hand free heap pages back to the system. True if any went back."""
    gc.collect()
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0) == 1)
