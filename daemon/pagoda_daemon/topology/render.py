"""The human-readable report printed by `pagoda topology` without --json."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda_daemon.topology.cpulist import format_cpulist
from pagoda_daemon.topology.model import UNKNOWN_NUMA, NodeTopology


def render(report: NodeTopology) -> str:
    cpu, sw = report.cpu, report.software
    lines = [
        f"node {report.hostname or '?'}  kernel {sw.kernel or '?'}",
        f"CPU  {cpu.model or 'unknown model'}: {cpu.sockets} socket(s), "
        f"{cpu.physical_cores} cores, {cpu.logical_cpus} CPUs; this process may use "
        f"{format_cpulist(report.allowed_cpus) or 'none'}",
        "",
        _table(
            ["NUMA", "CPUS", "CORES", "MEMORY"],
            [
                [str(n.id), format_cpulist(n.cpus) or "-", str(len(n.cores)), _gib(n.memory_bytes)]
                for n in report.numa_nodes
            ],
        ),
        "",
    ]
    if report.gpus:
        versions = ", ".join(
            f"{label} {value}"
            for label, value in (
                ("driver", sw.driver_version),
                ("CUDA", sw.cuda_driver_version),
                ("ROCm", sw.rocm_version),
            )
            if value
        )
        lines.append(f"GPUs (from {sw.gpu_backend}{', ' + versions if versions else ''})")
        lines.append(
            _table(
                ["GPU", "MODEL", "MEMORY", "PCI", "NUMA", "CC/ARCH", "UUID"],
                [
                    [
                        str(g.index),
                        g.model,
                        _gib(g.memory_bytes),
                        g.pci_bus_id,
                        _numa(g.numa_node),
                        g.compute_capability or g.arch or "-",
                        g.uuid or "-",
                    ]
                    for g in report.gpus
                ],
            )
        )
        lines += ["", _matrix(report), ""]
        visible = report.visibility.visible_gpus
        lines.append(f"visible GPUs: {'all' if visible is None else list(visible)}")
    else:
        lines.append("GPUs: none found")
    if report.nics:
        lines += [
            "",
            _table(
                ["NIC", "KIND", "PCI", "NUMA", "SPEED", "NET"],
                [
                    [
                        n.name,
                        n.kind,
                        n.pci_bus_id or "-",
                        _numa(n.numa_node),
                        f"{n.speed_mbps // 1000} Gb/s" if n.speed_mbps else "-",
                        ",".join(n.net_devices) or "-",
                    ]
                    for n in report.nics
                ],
            ),
        ]
    if report.warnings:
        lines += ["", "warnings (the report is partial):"] + [f"  - {w}" for w in report.warnings]
    return "\n".join(lines)


def _matrix(report: NodeTopology) -> str:
    """GPU-to-GPU paths as `nvidia-smi topo -m` prints them (NV18, XGMI, PIX, ..., SYS)."""
    names = [f"GPU{g.index}" for g in report.gpus]
    rows = []
    for a in report.gpus:
        row = [f"GPU{a.index}"]
        for b in report.gpus:
            link = report.link(a.index, b.index)
            if a.index == b.index:
                row.append("X")
            elif link is None:
                row.append("?")
            elif link.type == "NVLINK":
                row.append(f"NV{link.count}")
            else:
                row.append(link.type)
        rows.append(row)
    return _table(["", *names], rows)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:.1f} GiB"


def _numa(node: int) -> str:
    return "?" if node == UNKNOWN_NUMA else str(node)
