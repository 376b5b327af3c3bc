"""PCI devices from sysfs, and the PCIe path between two of them.

`/sys/bus/pci/devices/<bdf>` is a symlink into `/sys/devices/pci<domain>:<bus>/…`,
whose components are the root complex followed by every bridge down to the
device. Comparing two such chains tells PIX / PXB / PHB / NODE / SYS without
any vendor library, which is what the sysfs fallback and the NIC report need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagoda_daemon.topology.model import UNKNOWN_NUMA
from pagoda_daemon.topology.sysfs import SysfsReader

PCI_DEVICES = "sys/bus/pci/devices"
GPU_VENDORS = {0x10DE: "nvidia", 0x1002: "amd"}
_DISPLAY_CLASS = 0x03  # PCI base class "display controller" (VGA 0x0300, 3D 0x0302, other 0x0380)
BDF = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


@dataclass(frozen=True)
class PciDevice:
    bdf: str
    vendor_id: int | None
    device_id: int | None
    class_code: int | None
    numa_node: int
    local_cpus: frozenset[int]
    root: str | None  # the root complex ("pci0000:17"), None when the link could not be followed
    bridges: tuple[str, ...]  # BDFs from the root port down to (not including) the device


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's "00000000:18:00.0" or a bare "18:00.0" in sysfs form: "0000:18:00.0"."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts.insert(0, "0000")
    if len(parts) != 3:
        return text
    domain = parts[0][-4:].rjust(4, "0")
    return f"{domain}:{parts[1]}:{parts[2]}"


def read_pci_device(reader: SysfsReader, bdf: str) -> PciDevice | None:
    """One device's identity, NUMA node and bridge chain; None (with a warning) if absent."""
    base = f"{PCI_DEVICES}/{bdf}"
    if not reader.path(base).exists():
        reader.warn(f"PCI device {bdf} is not in /{PCI_DEVICES}")
        return None
    numa = reader.read_int(f"{base}/numa_node", required=False)
    real = reader.resolve(base)
    root, bridges = (None, ()) if real is None else _chain(real.parts, bdf)
    return PciDevice(
        bdf=bdf,
        vendor_id=reader.read_int(f"{base}/vendor"),
        device_id=reader.read_int(f"{base}/device", required=False),
        class_code=reader.read_int(f"{base}/class"),
        numa_node=UNKNOWN_NUMA if numa is None or numa < 0 else numa,
        local_cpus=reader.read_cpulist(f"{base}/local_cpulist", required=False) or frozenset(),
        root=root,
        bridges=bridges,
    )


def list_gpu_devices(reader: SysfsReader) -> list[PciDevice]:
    """NVIDIA and AMD display-class functions, in PCI bus order (NVML's index order)."""
    found = []
    for bdf in sorted(reader.listdir(PCI_DEVICES, BDF.pattern)):
        base = f"{PCI_DEVICES}/{bdf}"
        vendor = reader.read_int(f"{base}/vendor", required=False)
        klass = reader.read_int(f"{base}/class", required=False)
        if vendor in GPU_VENDORS and klass is not None and klass >> 16 == _DISPLAY_CLASS:
            device = read_pci_device(reader, bdf)
            if device is not None:
                found.append(device)
    return found


def pcie_link_type(a: PciDevice, numa_a: int, b: PciDevice, numa_b: int) -> str:
    """nvidia-smi's name for the PCIe path between a and b (NUMA nodes as the caller resolved them)."""
    if a.root is None or b.root is None:
        return "UNKNOWN"
    if a.root != b.root:
        if numa_a == UNKNOWN_NUMA or numa_b == UNKNOWN_NUMA:
            return "UNKNOWN"
        return "NODE" if numa_a == numa_b else "SYS"
    shared = 0
    for x, y in zip(a.bridges, b.bridges):
        if x != y:
            break
        shared += 1
    if shared == 0:
        return "PHB"  # different root ports of one host bridge
    # Below the deepest shared bridge (a switch's upstream port), one downstream
    # port then the device means both hang off the same switch.
    return "PIX" if len(a.bridges) - shared == 1 and len(b.bridges) - shared == 1 else "PXB"


def _chain(parts: tuple[str, ...], bdf: str) -> tuple[str | None, tuple[str, ...]]:
    roots = [i for i, part in enumerate(parts) if part.startswith("pci")]
    if not roots:
        return None, ()
    start = roots[-1]
    chain = [part for part in parts[start + 1 :] if BDF.fullmatch(part)]
    if chain and chain[-1] == bdf:
        chain.pop()
    return parts[start], tuple(chain)
