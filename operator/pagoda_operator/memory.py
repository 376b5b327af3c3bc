"""The operator process's heap: few malloc arenas, and freed memory handed back.

A burst of creates makes kopf parse every watch event of every child into dicts; once the
objects are Ready almost all of it is garbage (traced live heap 35 s after 100 objects turned
Ready: 41.7 MiB, 20 of it imported code, 2.5 the watch cache), yet the process stayed 41 MiB
larger than before the burst: freed memory the allocators kept. Three things hand it back
(the test cluster, 2 cores, 100 objects at once, resident growth once idle; the figures are in
docs/benchmarks/2026-11-26-operator-scale.md):

- at most two glibc malloc arenas (every allocating thread could otherwise get its own, up to 8
  per core): 40.9 -> 32.2 MiB;
- after each periodic pass, a collection and ``malloc_trim``: -> 29.8 MiB;
- Python objects from malloc rather than pymalloc's 1 MiB arenas, which one live object keeps
  whole (``ENVIRONMENT``, set by the chart for the operator's container only: the daemon keeps
  pymalloc): -> 23.5 MiB, create-to-Ready unchanged.

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
# The operator container's environment for the heap (charts/pagoda/templates/operator.yaml sets
# it; benchmarks/operator_scale.py runs the operator with it; a test checks both).
ENVIRONMENT = {"PYTHONMALLOC": "malloc"}


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
