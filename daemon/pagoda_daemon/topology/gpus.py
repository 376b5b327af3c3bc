"""GPU discovery without creating a CUDA/HIP context: NVML, then amdsmi, then sysfs PCI.

Vendor libraries know what sysfs cannot (model names, UUIDs, NVLink/xGMI);
sysfs knows the NUMA node and the PCIe tree on any machine. Each backend
yields the same `Gpu` records and a link for every pair of GPUs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, TypeVar

from pagoda_daemon.topology.libs import AMDSMI, NVML
from pagoda_daemon.topology.model import UNKNOWN_NUMA, Gpu, GpuLink, Software
from pagoda_daemon.topology.pci import (
    GPU_VENDORS,
    PciDevice,
    list_gpu_devices,
    normalize_bus_id,
    pcie_link_type,
    read_pci_device,
)
from pagoda_daemon.topology.sysfs import SysfsReader

BACKENDS = ("auto", "nvml", "amdsmi", "sysfs", "none")

# nvmlDeviceGetTopologyCommonAncestor levels, in nvidia-smi's words.
_NVML_ANCESTOR = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

T = TypeVar("T")


@dataclass(frozen=True)
class GpuReport:
    gpus: tuple[Gpu, ...]
    links: tuple[GpuLink, ...]
    software: Software


def read_gpus(
    reader: SysfsReader,
    numa_ids: Sequence[int],
    backend: str = "auto",
    *,
    nvml: ModuleType | None = None,
    amdsmi: ModuleType | None = None,
) -> GpuReport:
    """Discover GPUs with the best backend available.

    Vendor libraries describe the machine we run on, so under a fake sysfs root
    they are used only when passed in explicitly (as the tests do).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown GPU backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "none":
        return GpuReport((), (), Software())
    if backend in ("auto", "nvml"):
        module = nvml or (NVML.get() if reader.is_live else None)
        if module is not None:
            report = _read_nvml(module, reader, numa_ids)
            if report.gpus or backend == "nvml":
                return _check_coverage(reader, report)
        elif backend == "nvml":
            reader.warn(f"NVML unavailable ({NVML.error or 'not on a live root'}); using sysfs")
    if backend in ("auto", "amdsmi"):
        module = amdsmi or (AMDSMI.get() if reader.is_live else None)
        if module is not None:
            report = _read_amdsmi(module, reader, numa_ids)
            if report.gpus or backend == "amdsmi":
                return _check_coverage(reader, report)
        elif backend == "amdsmi":
            reader.warn(f"amdsmi unavailable ({AMDSMI.error or 'not on a live root'}); using sysfs")
    return _read_sysfs(reader, numa_ids)


def _read_nvml(nv: ModuleType, reader: SysfsReader, numa_ids: Sequence[int]) -> GpuReport:
    ask = _asker(reader, "NVML")
    handles, gpus, pci = [], [], {}
    for index in range(ask(nv.nvmlDeviceGetCount, "the GPU count") or 0):
        handle = ask(lambda i=index: nv.nvmlDeviceGetHandleByIndex(i), f"GPU {index}'s handle")
        info = (
            ask(lambda h=handle: nv.nvmlDeviceGetPciInfo(h), f"GPU {index}'s PCI bus id")
            if handle is not None
            else None
        )
        if info is None:
            continue
        bus = normalize_bus_id(info.busId)
        capability = ask(lambda h=handle: nv.nvmlDeviceGetCudaComputeCapability(h), "compute capability")
        memory = ask(lambda h=handle: nv.nvmlDeviceGetMemoryInfo(h).total, "GPU memory")
        gpu = Gpu(
            index=index,
            vendor="nvidia",
            model=_text(ask(lambda h=handle: nv.nvmlDeviceGetName(h), "GPU name")) or "NVIDIA GPU",
            pci_bus_id=bus,
            memory_bytes=int(memory) if memory is not None else None,
            uuid=_text(ask(lambda h=handle: nv.nvmlDeviceGetUUID(h), "GPU UUID")),
            compute_capability="{}.{}".format(*capability) if capability else None,
            source="nvml",
        )
        pci[len(gpus)] = read_pci_device(reader, bus)
        gpus.append(_with_pci(gpu, pci[len(gpus)], reader, numa_ids))
        handles.append(handle)

    endpoints = [_nvlink_endpoints(nv, h) for h in handles]
    buses = {g.pci_bus_id for g in gpus}

    def fabric(i: int, j: int) -> tuple[str, int] | None:
        direct = endpoints[i].count(gpus[j].pci_bus_id)
        if direct:
            return "NVLINK", direct
        via_switch = [sum(1 for e in endpoints[k] if e not in buses) for k in (i, j)]
        if min(via_switch) and _nvlink_p2p(nv, handles[i], handles[j]):
            return "NVLINK", min(via_switch)
        return None

    def pcie(i: int, j: int) -> str | None:
        level = ask(lambda: nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]), "the PCIe path")
        return _NVML_ANCESTOR.get(level) if level is not None else None

    driver = _text(ask(nv.nvmlSystemGetDriverVersion, "the driver version"))
    cuda = ask(nv.nvmlSystemGetCudaDriverVersion, "the CUDA version")
    software = Software(
        gpu_backend="nvml",
        driver_version=driver,
        cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
    )
    return GpuReport(tuple(gpus), _links(gpus, pci, numa_ids, fabric, pcie), software)


def _nvlink_endpoints(nv: ModuleType, handle: Any) -> list[str]:
    """For each active NVLink, the PCI bus id at its far end: a GPU, an NVSwitch, or ""
    when the driver will not say (then NVML's P2P status decides, see `_nvlink_p2p`)."""
    remote = []
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                continue
        except Exception:  # NVMLError_NotSupported / InvalidArgument past the last link
            continue
        try:
            remote.append(normalize_bus_id(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        except Exception:
            remote.append("")
    return remote


def _nvlink_p2p(nv: ModuleType, a: Any, b: Any) -> bool:
    """Whether two NVSwitch-attached GPUs can talk over NVLink (a partitioned fabric may say no)."""
    status = getattr(nv, "nvmlDeviceGetP2PStatus", None)
    if status is None:
        return True
    try:
        return status(a, b, nv.NVML_P2P_CAPS_INDEX_NVLINK) == nv.NVML_P2P_STATUS_OK
    except Exception:
        return False


def _read_amdsmi(amd: ModuleType, reader: SysfsReader, numa_ids: Sequence[int]) -> GpuReport:
    ask = _asker(reader, "amdsmi")
    handles = ask(amd.amdsmi_get_processor_handles, "the GPU list") or []
    vram = getattr(getattr(amd, "AmdSmiMemoryType", None), "VRAM", 0)
    gpus, pci, found = [], {}, []
    for index, handle in enumerate(handles):
        bdf = ask(lambda h=handle: amd.amdsmi_get_gpu_device_bdf(h), f"GPU {index}'s PCI bus id")
        if bdf is None:
            continue
        bus = normalize_bus_id(bdf)
        asic = ask(lambda h=handle: amd.amdsmi_get_gpu_asic_info(h), "ASIC info")
        asic = asic if isinstance(asic, dict) else {}
        memory = ask(lambda h=handle: amd.amdsmi_get_gpu_memory_total(h, vram), "GPU memory")
        gpu = Gpu(
            index=index,
            vendor="amd",
            model=str(asic.get("market_name") or "AMD GPU"),
            pci_bus_id=bus,
            memory_bytes=int(memory) if memory is not None else None,
            uuid=_text(ask(lambda h=handle: amd.amdsmi_get_gpu_device_uuid(h), "GPU UUID")),
            arch=_text(asic.get("target_graphics_version")),
            source="amdsmi",
        )
        pci[len(gpus)] = read_pci_device(reader, bus)
        gpus.append(_with_pci(gpu, pci[len(gpus)], reader, numa_ids))
        found.append(handle)
    handles = found

    def fabric(i: int, j: int) -> tuple[str, int] | None:
        info = ask(lambda: amd.amdsmi_topo_get_link_type(handles[i], handles[j]), "the GPU link type")
        kind = info.get("type") if isinstance(info, dict) else None
        if "XGMI" in str(getattr(kind, "name", kind)).upper():
            return "XGMI", 0  # amdsmi reports hops and weight, not a link count
        return None

    driver = (
        ask(lambda: amd.amdsmi_get_gpu_driver_info(handles[0]), "the driver version") if handles else None
    )
    software = Software(
        gpu_backend="amdsmi",
        driver_version=_text(driver.get("driver_version")) if isinstance(driver, dict) else None,
        rocm_version=reader.read("opt/rocm/.info/version", required=False),
    )
    return GpuReport(tuple(gpus), _links(gpus, pci, numa_ids, fabric, _unknown), software)


def _read_sysfs(reader: SysfsReader, numa_ids: Sequence[int]) -> GpuReport:
    devices = list_gpu_devices(reader)
    gpus, pci = [], {}
    for index, device in enumerate(devices):
        vendor = GPU_VENDORS[device.vendor_id or 0]
        base = f"sys/bus/pci/devices/{device.bdf}"
        name = reader.read(f"{base}/product_name", required=False)  # amdgpu on Instinct parts
        vram = reader.read_int(f"{base}/mem_info_vram_total", required=False)  # amdgpu
        pci[index] = device
        model = name or f"{vendor.upper()} [{device.vendor_id or 0:04x}:{device.device_id or 0:04x}]"
        gpus.append(
            _with_pci(
                Gpu(index=index, vendor=vendor, model=model, pci_bus_id=device.bdf, memory_bytes=vram),
                device,
                reader,
                numa_ids,
            )
        )
    driver = None
    if any(g.vendor == "nvidia" for g in gpus):
        driver = reader.read("sys/module/nvidia/version", required=False)
    software = Software(
        gpu_backend="sysfs" if gpus else "none",
        driver_version=driver,
        rocm_version=reader.read("opt/rocm/.info/version", required=False),
    )
    return GpuReport(tuple(gpus), _links(gpus, pci, numa_ids, _unknown, _unknown), software)


def _unknown(i: int, j: int) -> None:
    """A link source with nothing to say (sysfs cannot see NVLink or xGMI)."""
    return None


def _with_pci(gpu: Gpu, device: PciDevice | None, reader: SysfsReader, numa_ids: Sequence[int]) -> Gpu:
    """Fill the NUMA node and local CPUs from sysfs, and say when the firmware left them out."""
    if device is None:
        return gpu
    if device.numa_node == UNKNOWN_NUMA and len(numa_ids) > 1:
        reader.warn(
            f"GPU {gpu.index} ({gpu.pci_bus_id}) has no NUMA node (numa_node = -1) on a "
            f"{len(numa_ids)}-node machine: it is not pinned to a node"
        )
    return replace(gpu, numa_node=device.numa_node, local_cpus=device.local_cpus)


def effective_numa(numa_node: int, numa_ids: Sequence[int]) -> int:
    """A known node as is; an unknown one is the only node when there is just one."""
    if numa_node != UNKNOWN_NUMA:
        return numa_node
    return numa_ids[0] if len(numa_ids) == 1 else UNKNOWN_NUMA


def _links(
    gpus: Sequence[Gpu],
    pci: dict[int, PciDevice | None],
    numa_ids: Sequence[int],
    fabric: Callable[[int, int], tuple[str, int] | None],
    pcie: Callable[[int, int], str | None],
) -> tuple[GpuLink, ...]:
    links = []
    for i, j in itertools.combinations(range(len(gpus)), 2):
        found = fabric(i, j)
        if found:
            links.append(GpuLink(gpus[i].index, gpus[j].index, found[0], found[1]))
            continue
        kind = pcie(i, j)
        a, b = pci.get(i), pci.get(j)
        if kind is None and a is not None and b is not None:
            kind = pcie_link_type(
                a, effective_numa(a.numa_node, numa_ids), b, effective_numa(b.numa_node, numa_ids)
            )
        links.append(GpuLink(gpus[i].index, gpus[j].index, kind or "UNKNOWN"))
    return tuple(links)


def _check_coverage(reader: SysfsReader, report: GpuReport) -> GpuReport:
    seen = {g.pci_bus_id for g in report.gpus}
    missed = [d.bdf for d in list_gpu_devices(reader) if d.bdf not in seen]
    if missed:
        reader.warn(f"GPUs on PCI not reported by {report.software.gpu_backend}: {', '.join(missed)}")
    return report


def _asker(reader: SysfsReader, library: str) -> Callable[..., Any]:
    def ask(call: Callable[[], T], what: str) -> T | None:
        try:
            return call()
        except Exception as exc:  # vendor libraries raise their own error types
            reader.warn(f"{library} could not tell {what}: {exc}")
            return None

    return ask


def _text(value: object) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
