"""Put the report together: CPUs and NUMA, GPUs and links, NICs, software, visibility.

Each part is read independently and guarded, so one surprise (a vendor
library raising something new, an odd sysfs tree) costs that part of the
report and adds a warning; the rest still arrives.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import ModuleType
from typing import TypeVar

from pagoda_daemon.topology.gpus import BACKENDS, GpuReport, read_gpus
from pagoda_daemon.topology.model import CpuSummary, NodeTopology, Software
from pagoda_daemon.topology.nics import read_nics
from pagoda_daemon.topology.sysfs import (
    SysfsReader,
    read_allowed_cpus,
    read_cpu_summary,
    read_numa_nodes,
    read_online_cpus,
)
from pagoda_daemon.topology.visibility import resolve_visibility

T = TypeVar("T")


def discover(
    sysfs_root: str | os.PathLike[str] = "/",
    *,
    gpu_backend: str = "auto",
    env: Mapping[str, str] | None = None,
    nvml: ModuleType | None = None,
    amdsmi: ModuleType | None = None,
) -> NodeTopology:
    """Read the node's topology below `sysfs_root`. Never raises for a broken tree."""
    if gpu_backend not in BACKENDS:
        raise ValueError(f"unknown GPU backend {gpu_backend!r}; choose one of {', '.join(BACKENDS)}")
    reader = SysfsReader(sysfs_root)

    def guard(what: str, read: Callable[[], T], fallback: T) -> T:
        try:
            return read()
        except Exception as exc:
            reader.warn(f"{what} discovery failed: {type(exc).__name__}: {exc}")
            return fallback

    online = guard("CPU", lambda: read_online_cpus(reader), frozenset())
    nodes = guard("NUMA", lambda: read_numa_nodes(reader, online), ())
    cpu = guard("CPU", lambda: read_cpu_summary(reader, nodes), CpuSummary(None, 0, len(online), 0))
    numa_ids = [n.id for n in nodes]
    gpus = guard(
        "GPU",
        lambda: read_gpus(reader, numa_ids, gpu_backend, nvml=nvml, amdsmi=amdsmi),
        GpuReport((), (), Software()),
    )
    nics = guard("NIC", lambda: read_nics(reader), ())
    visibility, notes = resolve_visibility(gpus.gpus, env)
    for note in notes:
        reader.warn(note)
    return NodeTopology(
        cpu=cpu,
        numa_nodes=nodes,
        gpus=gpus.gpus,
        links=gpus.links,
        nics=nics,
        software=replace(gpus.software, kernel=reader.read("proc/sys/kernel/osrelease", required=False)),
        hostname=reader.read("proc/sys/kernel/hostname", required=False),
        allowed_cpus=guard("cpuset", lambda: read_allowed_cpus(reader, online), online),
        visibility=visibility,
        warnings=tuple(reader.warnings),
    )
