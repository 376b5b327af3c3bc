"""CPU and NUMA discovery from Linux sysfs, read under a configurable root.

Everything goes through `SysfsReader`, which never raises on a missing or
malformed file: it records a warning and returns None, so a container with a
half-mounted /sys still gets a partial report instead of a crash. Tests point
the root at fake trees.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pagoda_daemon.topology.cpulist import format_cpulist, parse_cpulist
from pagoda_daemon.topology.model import CpuSummary, NumaNode

log = logging.getLogger(__name__)

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
_CGROUP_CPUSETS = (
    "sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
    "sys/fs/cgroup/cpuset/cpuset.effective_cpus",  # cgroup v1
)


class SysfsReader:
    """Reads files below `root`; problems become `warnings`, never exceptions."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)
        self.warnings: list[str] = []

    @property
    def is_live(self) -> bool:
        """True when reading the machine we run on (so NVML and sched_getaffinity apply)."""
        return self.root.resolve() == Path("/")

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            log.warning("topology: %s", message)
            self.warnings.append(message)

    def read(self, rel: str, *, required: bool = True) -> str | None:
        """The stripped text of a file, or None (with a warning if `required`)."""
        try:
            return self.path(rel).read_text().strip()
        except FileNotFoundError:
            if required:
                self.warn(f"/{rel.lstrip('/')} is missing")
        except (OSError, UnicodeDecodeError) as exc:
            # Some attributes (a down NIC's speed) fail to read by design.
            if required:
                self.warn(f"/{rel.lstrip('/')} is unreadable: {exc}")
        return None

    def read_int(self, rel: str, *, required: bool = True) -> int | None:
        """An integer file; hex ("0x10de") and decimal both accepted."""
        text = self.read(rel, required=required)
        if text is None:
            return None
        try:
            return int(text, 0)
        except ValueError:
            self.warn(f"/{rel.lstrip('/')} is malformed: {text[:40]!r}")
            return None

    def read_cpulist(self, rel: str, *, required: bool = True) -> frozenset[int] | None:
        text = self.read(rel, required=required)
        if text is None:
            return None
        try:
            return parse_cpulist(text)
        except ValueError:
            self.warn(f"/{rel.lstrip('/')} is malformed: {text[:40]!r}")
            return None

    def listdir(self, rel: str, pattern: str = r".*") -> list[str]:
        """Entries of a directory matching `pattern`, sorted; [] when it is absent."""
        try:
            names = os.listdir(self.path(rel))
        except OSError:
            return []
        regex = re.compile(pattern)
        return sorted((n for n in names if regex.fullmatch(n)), key=_natural_key)

    def resolve(self, rel: str) -> Path | None:
        """Follow a sysfs symlink; the answer is relative to the root."""
        try:
            real = self.path(rel).resolve(strict=True)
            return real.relative_to(self.root.resolve())
        except (OSError, ValueError):
            return None


def _natural_key(name: str) -> tuple[str, int]:
    match = re.search(r"(\d+)$", name)
    return (name[: match.start()], int(match.group(1))) if match else (name, -1)


def read_numa_nodes(reader: SysfsReader, online: frozenset[int]) -> tuple[NumaNode, ...]:
    """NUMA nodes with their online CPUs grouped into physical cores, and their memory."""
    names = reader.listdir(NODE_DIR, r"node\d+")
    if not names:
        reader.warn(f"no NUMA nodes under /{NODE_DIR}; assuming one node holding every CPU")
        memory = _meminfo_total(reader, "proc/meminfo", r"MemTotal:\s+(\d+)\s+kB")
        return (NumaNode(0, online, _cores(reader, online, online), memory),)

    nodes = []
    for name in names:
        node_id = int(name[4:])
        cpus = reader.read_cpulist(f"{NODE_DIR}/{name}/cpulist")
        cpus = (cpus or frozenset()) & online
        memory = _meminfo_total(reader, f"{NODE_DIR}/{name}/meminfo", r"Node \d+ MemTotal:\s+(\d+)\s+kB")
        nodes.append(NumaNode(node_id, cpus, _cores(reader, cpus, online), memory, _distances(reader, name)))

    homeless = online - frozenset().union(*(n.cpus for n in nodes))
    if homeless:
        reader.warn(f"CPUs {format_cpulist(homeless)} belong to no NUMA node; pinning never uses them")
    return tuple(nodes)


def read_online_cpus(reader: SysfsReader) -> frozenset[int]:
    online = reader.read_cpulist(f"{CPU_DIR}/online")
    if online is not None:
        return online
    return frozenset(int(n[3:]) for n in reader.listdir(CPU_DIR, r"cpu\d+"))


def read_cpu_summary(reader: SysfsReader, nodes: tuple[NumaNode, ...]) -> CpuSummary:
    cpus = frozenset().union(*(n.cpus for n in nodes))
    packages = {
        reader.read_int(f"{CPU_DIR}/cpu{c}/topology/physical_package_id", required=False) for c in cpus
    }
    packages.discard(None)
    return CpuSummary(
        model=_cpu_model(reader),
        sockets=len(packages) or (1 if cpus else 0),
        logical_cpus=len(cpus),
        physical_cores=sum(len(n.cores) for n in nodes),
    )


def read_allowed_cpus(reader: SysfsReader, online: frozenset[int]) -> frozenset[int]:
    """The CPUs this process may run on: its affinity on a live root, else the tree's cpuset."""
    if reader.is_live and hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    for rel in _CGROUP_CPUSETS:
        cpus = reader.read_cpulist(rel, required=False)
        if cpus:
            return cpus & online if online else cpus
    return online


def _cores(reader: SysfsReader, cpus: frozenset[int], online: frozenset[int]) -> tuple[frozenset[int], ...]:
    """Hyper-thread sibling groups; a CPU whose siblings nobody names is a core of its own."""
    groups: set[frozenset[int]] = set()
    for cpu in cpus:
        siblings = reader.read_cpulist(f"{CPU_DIR}/cpu{cpu}/topology/thread_siblings_list", required=False)
        if siblings and cpu in siblings:
            groups.add(siblings & online)
    unknown = cpus - frozenset().union(*groups)
    if unknown:
        reader.warn(
            f"no hyper-thread siblings known for CPUs {format_cpulist(unknown)}; each counted as a core"
        )
        groups.update(frozenset({cpu}) for cpu in unknown)
    return tuple(sorted(groups, key=min))


def _distances(reader: SysfsReader, name: str) -> tuple[int, ...]:
    text = reader.read(f"{NODE_DIR}/{name}/distance", required=False)
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split())
    except ValueError:
        reader.warn(f"/{NODE_DIR}/{name}/distance is malformed: {text[:40]!r}")
        return ()


def _meminfo_total(reader: SysfsReader, rel: str, pattern: str) -> int | None:
    text = reader.read(rel)
    if text is None:
        return None
    match = re.search(pattern, text)
    if not match:
        reader.warn(f"/{rel} has no MemTotal line")
        return None
    return int(match.group(1)) * 1024


def _cpu_model(reader: SysfsReader) -> str | None:
    text = reader.read("proc/cpuinfo", required=False) or ""
    match = re.search(r"^(?:model name|Model|cpu model)\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None
