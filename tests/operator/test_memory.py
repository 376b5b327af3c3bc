"""memory.py on this machine's glibc: the arena limit is accepted, and freed heap memory goes
back to the system after give_back()."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda_operator import memory

pytestmark = pytest.mark.skipif(memory._glibc() is None, reason="glibc only")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_freed_heap_goes_back_after_give_back():
    """A burst of 2 KiB objects (malloc's heap, not pymalloc's arenas) freed below one that
    lives on stays resident (the heap cannot shrink past the survivor) until give_back()."""
    burst = [bytes(2048) for _ in range(60_000)]  # ~120 MiB
    survivor = bytes(2048)
    del burst
    before = _rss_mib()
    assert memory.give_back()
    after = _rss_mib()
    assert before - after > 60, (before, after)
    assert len(survivor) == 2048


def test_arena_limit_is_accepted():
    assert memory.limit_arenas(memory.ARENAS)

