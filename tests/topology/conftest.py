"""Fake sysfs trees and a fake NVML for the topology tests.

Each tree is laid out the way the kernel lays it out: PCI devices live under
/sys/devices/pci<domain>:<bus>/<root port>/.../<bdf> and /sys/bus/pci/devices,
/sys/class/net and /sys/class/infiniband hold relative symlinks into it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

_DAEMON = Path(__file__).resolve().parents[2] / "daemon"
if str(_DAEMON) not in sys.path:
    sys.path.insert(0, str(_DAEMON))

NVIDIA, AMD, INTEL, MELLANOX = 0x10DE, 0x1002, 0x8086, 0x15B3
CLASS_3D, CLASS_VGA, CLASS_NET, CLASS_IB, CLASS_BRIDGE = 0x030200, 0x030000, 0x020000, 0x020700, 0x060400


class FakeSysfs:
    """Builds a sysfs tree below `root`, one kernel file at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._bus = 0x10

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        return path

    def link(self, rel: str, target_rel: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(self.root / target_rel, path.parent), path)

    def cpus(self, sockets: int, cores_per_socket: int, threads: int = 2) -> None:
        """Linux numbering: first threads of every core, then the second threads, socket by socket."""
        total_cores = sockets * cores_per_socket
        self.write("sys/devices/system/cpu/online", f"0-{total_cores * threads - 1}")
        for core in range(total_cores):
            siblings = [core + t * total_cores for t in range(threads)]
            for cpu in siblings:
                base = f"sys/devices/system/cpu/cpu{cpu}/topology"
                self.write(f"{base}/thread_siblings_list", ",".join(map(str, siblings)))
                self.write(f"{base}/physical_package_id", str(core // cores_per_socket))
                self.write(f"{base}/core_id", str(core % cores_per_socket))
        for node in range(sockets):
            cpus = [
                f"{node * cores_per_socket + t * total_cores}-{(node + 1) * cores_per_socket - 1 + t * total_cores}"
                for t in range(threads)
            ]
            self.numa_node(
                node, ",".join(cpus), 64 * 2**20, [10 if n == node else 21 for n in range(sockets)]
            )
        self.write("proc/cpuinfo", "processor\t: 0\nmodel name\t: Fake CPU @ 2.00GHz\n")
        self.write("proc/sys/kernel/osrelease", "6.1.0-fake")
        self.write("proc/sys/kernel/hostname", "fakehost")

    def numa_node(self, node: int, cpulist: str, mem_kb: int, distances: list[int]) -> None:
        base = f"sys/devices/system/node/node{node}"
        self.write(f"{base}/cpulist", cpulist)
        self.write(f"{base}/meminfo", f"Node {node} MemTotal:       {mem_kb} kB\nNode {node} MemFree: 1 kB")
        self.write(f"{base}/distance", " ".join(map(str, distances)))

    def pci(
        self,
        chain: list[str],
        vendor: int,
        klass: int,
        numa: int | str,
        local_cpus: str = "",
        device: int = 0x2330,
    ) -> str:
        """A device at the end of `chain` (root complex, bridges..., device BDF); returns its BDF."""
        rel = "sys/devices/" + "/".join(chain)
        bdf = chain[-1]
        self.write(f"{rel}/vendor", f"0x{vendor:04x}")
        self.write(f"{rel}/device", f"0x{device:04x}")
        self.write(f"{rel}/class", f"0x{klass:06x}")
        self.write(f"{rel}/numa_node", str(numa))
        self.write(f"{rel}/local_cpulist", local_cpus)
        self.link(f"sys/bus/pci/devices/{bdf}", rel)
        return bdf

    def bridge(self, chain: list[str], numa: int | str) -> None:
        self.pci(chain, INTEL, CLASS_BRIDGE, numa, device=0x1234)

    def net(self, name: str, chain: list[str]) -> None:
        self.link(f"sys/class/net/{name}/device", "sys/devices/" + "/".join(chain))
        self.write(f"sys/class/net/{name}/speed", "200000")

    def rdma(self, name: str, chain: list[str], netdev: str) -> None:
        rel = "sys/devices/" + "/".join(chain)
        self.link(f"sys/class/infiniband/{name}/device", rel)
        self.write(f"sys/class/infiniband/{name}/ports/1/rate", "400 Gb/sec (4X NDR)")
        self.write(f"sys/class/infiniband/{name}/ports/1/link_layer", "InfiniBand")
        self.write(f"{rel}/net/{netdev}/ifindex", "5")


def _bdf(bus: int, dev: int = 0, fn: int = 0) -> str:
    return f"0000:{bus:02x}:{dev:02x}.{fn}"


@dataclass
class Machine:
    root: Path
    gpus: list[str] = field(default_factory=list)  # BDFs in PCI order


@pytest.fixture
def fake_sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "root")


@pytest.fixture
def laptop(fake_sysfs: FakeSysfs) -> Machine:
    """One NUMA node, 4 cores / 8 threads, an Intel iGPU (not a compute GPU), Wi-Fi."""
    fs = fake_sysfs
    fs.cpus(sockets=1, cores_per_socket=4)
    fs.pci(["pci0000:00", "0000:00:02.0"], INTEL, CLASS_VGA, -1, "0-7", device=0x9A49)
    fs.bridge(["pci0000:00", "0000:00:1c.0"], -1)
    fs.pci(["pci0000:00", "0000:00:1c.0", "0000:01:00.0"], INTEL, 0x028000, -1, "0-7")
    fs.net("wlp1s0", ["pci0000:00", "0000:00:1c.0", "0000:01:00.0"])
    fs.link("sys/class/net/lo/subsystem", "sys/devices/virtual")  # virtual: no device link
    return Machine(fs.root)


@pytest.fixture
def dgx(fake_sysfs: FakeSysfs) -> Machine:
    """2 sockets x 28 cores x 2 threads; per socket two host bridges, each with a PCIe switch
    holding two GPUs and a ConnectX NIC (the HGX layout). NVLink is only visible to NVML."""
    fs = fake_sysfs
    fs.cpus(sockets=2, cores_per_socket=28)
    machine = Machine(fs.root)
    local = {0: "0-27,56-83", 1: "28-55,84-111"}
    for socket in range(2):
        for bridge in range(2):
            bus = 0x10 + 0x20 * (socket * 2 + bridge)
            base, up = [f"pci0000:{bus:02x}", _bdf(bus, 1)], _bdf(bus + 1)
            fs.bridge(base, socket)
            fs.bridge([*base, up], socket)
            for port in range(3):
                down = _bdf(bus + 2, port)
                fs.bridge([*base, up, down], socket)
                leaf = [*base, up, down, _bdf(bus + 3 + port)]
                if port < 2:
                    machine.gpus.append(fs.pci(leaf, NVIDIA, CLASS_3D, socket, local[socket]))
                else:
                    index = socket * 2 + bridge
                    fs.pci(leaf, MELLANOX, CLASS_IB, socket, local[socket], device=0x1021)
                    fs.rdma(f"mlx5_{index}", leaf, f"ibp{index}")
                    fs.net(f"ibp{index}", leaf)
    fs.write("sys/module/nvidia/version", "550.54.15")
    return machine


@pytest.fixture
def pcie_box(fake_sysfs: FakeSysfs) -> Machine:
    """2 sockets x 8 cores, 8 GPUs on PCIe only. Socket 0: two root ports, a switch with two
    GPUs under each (PIX inside, PHB across). Socket 1: one root port, a switch feeding two
    switches with two GPUs each (PIX inside a leaf, PXB across leaves)."""
    fs = fake_sysfs
    fs.cpus(sockets=2, cores_per_socket=8)
    machine = Machine(fs.root)
    for rp_dev, sw_bus in ((1, 0x01), (2, 0x11)):
        base = ["pci0000:00", _bdf(0, rp_dev), _bdf(sw_bus)]
        fs.bridge(base[:2], 0)
        fs.bridge(base, 0)
        for port in range(2):
            down = _bdf(sw_bus + 1, port)
            fs.bridge([*base, down], 0)
            machine.gpus.append(
                fs.pci([*base, down, _bdf(sw_bus + 2 + port)], NVIDIA, CLASS_3D, 0, "0-7,16-23")
            )
    top = ["pci0000:80", _bdf(0x80, 1), _bdf(0x81)]
    fs.bridge(top[:2], 1)
    fs.bridge(top, 1)
    for leaf, leaf_bus in enumerate((0x83, 0x93)):
        mid = [*top, _bdf(0x82, leaf), _bdf(leaf_bus)]
        fs.bridge(mid[:-1], 1)
        fs.bridge(mid, 1)
        for port in range(2):
            down = _bdf(leaf_bus + 1, port)
            fs.bridge([*mid, down], 1)
            gpu = [*mid, down, _bdf(leaf_bus + 2 + port)]
            machine.gpus.append(fs.pci(gpu, NVIDIA, CLASS_3D, 1, "8-15,24-31"))
    machine.gpus.sort()
    return machine


@pytest.fixture
def no_numa(fake_sysfs: FakeSysfs) -> Machine:
    """A cloud VM: one node, 8 vCPUs without SMT, two GPUs whose numa_node says -1."""
    fs = fake_sysfs
    fs.cpus(sockets=1, cores_per_socket=8, threads=1)
    machine = Machine(fs.root)
    for dev in (4, 5):
        machine.gpus.append(fs.pci(["pci0000:00", _bdf(0, dev)], NVIDIA, CLASS_3D, -1, "0-7"))
    return machine


# ---------------------------------------------------------------- fake NVML


class NVMLError(Exception):
    pass


class FakeNvml:
    """The slice of pynvml that discovery uses, describing GPUs at the given bus ids.

    `nvlinks[i]` lists the bus id at the far end of each active link of GPU i.
    """

    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVMLError = NVMLError

    def __init__(self, buses: list[str], nvlinks: list[list[str]], ancestor: dict[tuple[int, int], int]):
        self.buses = buses
        self.nvlinks = nvlinks
        self.ancestor = ancestor
        self.p2p_blocked: set[frozenset[int]] = set()
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.buses)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int):
        return type("PciInfo", (), {"busId": "0000" + self.buses[h]})()

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08d}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return type("Memory", (), {"total": 85520809984})()

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= len(self.nvlinks[h]):
            raise NVMLError("Not Supported")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int):
        return type("PciInfo", (), {"busId": "0000" + self.nvlinks[h][link]})()

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        return 4 if frozenset((a, b)) in self.p2p_blocked else self.NVML_P2P_STATUS_OK

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.ancestor[(min(a, b), max(a, b))]

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040


@pytest.fixture
def fake_nvml() -> type[FakeNvml]:
    """The FakeNvml class, for tests that describe their own GPUs and links."""
    return FakeNvml


@pytest.fixture
def dgx_nvml(dgx: Machine) -> FakeNvml:
    """Every DGX GPU has 18 links to NVSwitches (bus ids that are not GPUs)."""
    switches = [f"0000:{0xF0 + s:02x}:00.0" for s in range(4)]
    links = [[switches[link % 4] for link in range(18)] for _ in dgx.gpus]
    ancestor = {}
    for a in range(8):
        for b in range(a + 1, 8):
            same_switch, same_socket = a // 2 == b // 2, a // 4 == b // 4
            ancestor[(a, b)] = 10 if same_switch else 40 if same_socket else 50
    return FakeNvml(dgx.gpus, links, ancestor)
