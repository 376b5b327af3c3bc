"""Network adapters and their NUMA node, from /sys/class/infiniband and /sys/class/net.

Only interfaces backed by a PCI function are reported: loopback, bridges and
veths say nothing about where traffic enters the machine.
"""

from __future__ import annotations

import re

from pagoda_daemon.topology.model import UNKNOWN_NUMA, Nic
from pagoda_daemon.topology.pci import BDF, read_pci_device
from pagoda_daemon.topology.sysfs import SysfsReader

RDMA_DIR = "sys/class/infiniband"
NET_DIR = "sys/class/net"


def read_nics(reader: SysfsReader) -> tuple[Nic, ...]:
    nics = []
    for name in reader.listdir(RDMA_DIR):
        base = f"{RDMA_DIR}/{name}"
        bdf, numa = _pci_of(reader, base)
        ports = reader.listdir(f"{base}/ports", r"\d+")
        port = f"{base}/ports/{ports[0]}" if ports else None
        nics.append(
            Nic(
                name=name,
                kind="rdma",
                pci_bus_id=bdf,
                numa_node=numa,
                net_devices=tuple(reader.listdir(f"{base}/device/net")),
                link_layer=reader.read(f"{port}/link_layer", required=False) if port else None,
                speed_mbps=_rdma_rate(reader.read(f"{port}/rate", required=False)) if port else None,
            )
        )
    for name in reader.listdir(NET_DIR):
        base = f"{NET_DIR}/{name}"
        if not reader.path(f"{base}/device").exists():
            continue  # virtual interface
        bdf, numa = _pci_of(reader, base)
        if bdf is None:
            continue  # not PCI (e.g. a platform or USB device)
        speed = reader.read_int(f"{base}/speed", required=False)
        nics.append(
            Nic(
                name=name,
                kind="net",
                pci_bus_id=bdf,
                numa_node=numa,
                speed_mbps=speed if speed and speed > 0 else None,  # -1 while the link is down
            )
        )
    return tuple(nics)


def _pci_of(reader: SysfsReader, base: str) -> tuple[str | None, int]:
    real = reader.resolve(f"{base}/device")
    if real is not None and not BDF.fullmatch(real.name):
        real = real.parent  # a virtio device sits one level below its PCI function
    if real is None or not BDF.fullmatch(real.name):
        return None, UNKNOWN_NUMA
    device = read_pci_device(reader, real.name)
    return real.name, device.numa_node if device else UNKNOWN_NUMA


def _rdma_rate(text: str | None) -> int | None:
    """'400 Gb/sec (4X NDR)' -> 400000."""
    match = re.match(r"\s*(\d+(?:\.\d+)?)\s*Gb/sec", text or "")
    return round(float(match.group(1)) * 1000) if match else None
