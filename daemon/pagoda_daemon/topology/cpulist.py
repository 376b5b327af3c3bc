"""The kernel's CPU list syntax ("0-3,8,10-11"), parsed and written back.

sysfs, cgroups and `taskset -c` all speak it, and it keeps a 224-CPU set
readable in a report, so the report and the CRD use it too.
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse "0-3,8,10-11" (an empty string is the empty set).

    Raises ValueError on anything else, so a malformed sysfs file or a bad
    `cpus=` policy is reported instead of silently pinning to the wrong CPUs.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list entry {part!r} in {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Write a set of CPU ids as compact ranges, sorted: {0,1,2,5} -> "0-2,5"."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
