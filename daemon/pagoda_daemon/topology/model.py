"""The topology report: what one node has, as plain frozen dataclasses.

Discovery fills these, pinning reads them, and the CLI and the publisher turn
them into JSON. The JSON form (camelCase keys, CPU sets as kernel CPU lists,
unknown values and empty CPU sets left out) round-trips through `to_dict` / `from_dict`, so a
report captured on a GPU machine can be kept as a test fixture and replayed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from pagoda_daemon.topology.cpulist import format_cpulist, parse_cpulist

# How two GPUs reach each other, best first. The PCIe names are nvidia-smi's
# (`nvidia-smi topo -m`), which operators already know:
#   PIX  one PCIe switch between them       PXB  several PCIe switches
#   PHB  through one PCIe host bridge       NODE across host bridges in one NUMA node
#   SYS  across the socket interconnect     UNKNOWN  nothing told us
LINK_TYPES = ("NVLINK", "XGMI", "PIX", "PXB", "PHB", "NODE", "SYS", "UNKNOWN")
FABRIC_LINKS = frozenset({"NVLINK", "XGMI"})

UNKNOWN_NUMA = -1  # the kernel's own value for "firmware did not say"


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its online CPUs, grouped into physical cores, and its memory."""

    id: int
    cpus: frozenset[int] = frozenset()
    cores: tuple[frozenset[int], ...] = ()  # hyper-thread sibling groups, one per physical core
    memory_bytes: int | None = None
    distances: tuple[int, ...] = ()  # SLIT distances to node 0, 1, ... (10 = local)


@dataclass(frozen=True)
class CpuSummary:
    model: str | None
    sockets: int
    logical_cpus: int
    physical_cores: int


@dataclass(frozen=True)
class Gpu:
    """One GPU. `index` is the driver's (NVML / PCI bus order), not a CUDA ordinal."""

    index: int
    vendor: str  # "nvidia" | "amd"
    model: str
    pci_bus_id: str  # sysfs form: 0000:18:00.0
    numa_node: int = UNKNOWN_NUMA
    local_cpus: frozenset[int] = frozenset()
    memory_bytes: int | None = None
    uuid: str | None = None
    compute_capability: str | None = None  # NVIDIA, e.g. "9.0"
    arch: str | None = None  # AMD gfx target, e.g. "gfx942"
    source: str = "sysfs"  # "nvml" | "amdsmi" | "sysfs": who told us


@dataclass(frozen=True)
class GpuLink:
    """The path between GPUs `a` < `b`; `count` is the NVLink/xGMI link count (0 for PCIe or unknown)."""

    a: int
    b: int
    type: str
    count: int = 0


@dataclass(frozen=True)
class Nic:
    name: str
    kind: str  # "rdma" (under /sys/class/infiniband) or "net"
    pci_bus_id: str | None = None
    numa_node: int = UNKNOWN_NUMA
    net_devices: tuple[str, ...] = ()  # for an RDMA device: its net interfaces
    link_layer: str | None = None  # "InfiniBand" | "Ethernet"
    speed_mbps: int | None = None


@dataclass(frozen=True)
class Software:
    gpu_backend: str = "none"  # "nvml" | "amdsmi" | "sysfs" | "none"
    kernel: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # the newest CUDA the driver supports, e.g. "12.4"
    rocm_version: str | None = None


@dataclass(frozen=True)
class Visibility:
    """What CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES leave this process (None = all GPUs)."""

    cuda_visible_devices: str | None = None
    hip_visible_devices: str | None = None
    visible_gpus: tuple[int, ...] | None = None  # physical indices, in device-ordinal order


@dataclass(frozen=True)
class NodeTopology:
    """The whole report. `warnings` says what could not be read: the report is then partial."""

    cpu: CpuSummary
    numa_nodes: tuple[NumaNode, ...]
    gpus: tuple[Gpu, ...] = ()
    links: tuple[GpuLink, ...] = ()
    nics: tuple[Nic, ...] = ()
    software: Software = field(default_factory=Software)
    hostname: str | None = None
    allowed_cpus: frozenset[int] = frozenset()  # this process's cpuset, not the node's
    visibility: Visibility = field(default_factory=Visibility)
    warnings: tuple[str, ...] = ()

    def gpu(self, index: int) -> Gpu:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise KeyError(f"no GPU with index {index}")

    def link(self, a: int, b: int) -> GpuLink | None:
        lo, hi = min(a, b), max(a, b)
        for link in self.links:
            if (link.a, link.b) == (lo, hi):
                return link
        return None

    def fabric_peers(self, index: int) -> frozenset[int]:
        """GPUs reachable from `index` over NVLink or xGMI (directly or through NVSwitch)."""
        peers = set()
        for link in self.links:
            if link.type in FABRIC_LINKS:
                if link.a == index:
                    peers.add(link.b)
                elif link.b == index:
                    peers.add(link.a)
        return frozenset(peers)

    def fabric_all_to_all(self, indices: typing.Iterable[int] | None = None) -> bool:
        """True when every pair of the given GPUs (default: all) has an NVLink/xGMI path."""
        chosen = sorted({g.index for g in self.gpus} if indices is None else set(indices))
        return all(b in self.fabric_peers(a) for i, a in enumerate(chosen) for b in chosen[i + 1 :])

    def to_dict(self) -> dict[str, Any]:
        return _encode(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeTopology:
        return _decode(cls, data)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            # Unknown values and empty CPU sets are left out rather than written as
            # null or "": absent is what Kubernetes clients expect of an optional field.
            if item is not None and item != frozenset() and item != "":
                out[_camel(f.name)] = _encode(item)
        return out
    if isinstance(value, frozenset):
        return format_cpulist(value)
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


def _decode(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _decode(inner, value)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        kwargs = {}
        for f in dataclasses.fields(hint):
            key = _camel(f.name)
            if key in value:
                kwargs[f.name] = _decode(hints[f.name], value[key])
        return hint(**kwargs)
    if origin is frozenset:
        return parse_cpulist(value)
    if origin is tuple:
        inner = typing.get_args(hint)[0]
        return tuple(_decode(inner, item) for item in value)
    return value
