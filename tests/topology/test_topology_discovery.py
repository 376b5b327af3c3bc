"""Discovery on fake sysfs trees: CPUs, NUMA, GPUs, PCIe paths, NICs, broken files."""

from __future__ import annotations

import itertools

from pagoda_daemon.topology import discover
from pagoda_daemon.topology.model import UNKNOWN_NUMA


def test_laptop_has_one_node_and_no_gpu(laptop):
    report = discover(laptop.root)
    assert [n.id for n in report.numa_nodes] == [0]
    node = report.numa_nodes[0]
    assert node.cpus == frozenset(range(8))
    assert node.cores == tuple(frozenset({c, c + 4}) for c in range(4))
    assert node.memory_bytes == 64 * 2**30
    assert (report.cpu.sockets, report.cpu.logical_cpus, report.cpu.physical_cores) == (1, 8, 4)
    assert report.cpu.model == "Fake CPU @ 2.00GHz"
    assert report.gpus == () and report.links == ()  # the Intel iGPU is not a compute GPU
    assert report.software.gpu_backend == "none"
    assert [(n.name, n.kind, n.pci_bus_id) for n in report.nics] == [("wlp1s0", "net", "0000:01:00.0")]
    assert report.allowed_cpus == frozenset(range(8))  # fake root: the tree's CPUs, not ours
    assert report.warnings == ()


def test_dgx_sysfs_only_sees_gpus_numa_and_pcie_paths(dgx):
    report = discover(dgx.root)
    assert [g.pci_bus_id for g in report.gpus] == dgx.gpus
    assert [g.numa_node for g in report.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert report.gpus[5].local_cpus == frozenset(range(28, 56)) | frozenset(range(84, 112))
    assert {g.source for g in report.gpus} == {"sysfs"}
    assert report.gpus[0].model == "NVIDIA [10de:2330]"
    assert report.software.gpu_backend == "sysfs"
    assert report.software.driver_version == "550.54.15"
    # Without NVML there is no NVLink: PCIe switch pairs, host bridges in a socket, sockets.
    assert len(report.links) == 28
    assert report.link(0, 1).type == "PIX"
    assert report.link(0, 2).type == "NODE"
    assert report.link(2, 3).type == "PIX"
    assert report.link(0, 4).type == "SYS"
    assert report.link(4, 7).type == "NODE"
    assert not report.fabric_all_to_all()
    assert report.warnings == ()


def test_dgx_with_nvml_is_nvlink_all_to_all(dgx, dgx_nvml):
    report = discover(dgx.root, nvml=dgx_nvml)
    assert report.software.gpu_backend == "nvml"
    assert report.software.cuda_driver_version == "12.4"
    gpu = report.gpus[6]
    assert (gpu.model, gpu.numa_node, gpu.compute_capability, gpu.source) == (
        "NVIDIA H100 80GB HBM3",
        1,
        "9.0",
        "nvml",
    )
    assert gpu.uuid.startswith("GPU-00000006")
    for a, b in itertools.combinations(range(8), 2):
        link = report.link(a, b)
        assert (link.type, link.count) == ("NVLINK", 18)
    assert report.fabric_all_to_all()
    assert report.fabric_peers(3) == frozenset({0, 1, 2, 4, 5, 6, 7})


def test_partitioned_nvswitch_fabric_falls_back_to_pcie_paths(dgx, dgx_nvml):
    # Fabric manager partitions may forbid NVLink P2P between some switch-attached GPUs.
    dgx_nvml.p2p_blocked = {frozenset((a, b)) for a in range(4) for b in range(4, 8)}
    report = discover(dgx.root, nvml=dgx_nvml)
    assert report.link(0, 5).type == "SYS"  # from NVML's common-ancestor answer
    assert report.link(0, 1).type == "NVLINK"
    assert report.fabric_all_to_all([0, 1, 2, 3])
    assert not report.fabric_all_to_all([0, 4])


def test_direct_nvlink_bridge_counts_links(no_numa, fake_nvml):
    a, b = no_numa.gpus
    nvml = fake_nvml(no_numa.gpus, [[b] * 4, [a] * 4], {(0, 1): 30})
    report = discover(no_numa.root, nvml=nvml)
    link = report.link(0, 1)
    assert (link.type, link.count) == ("NVLINK", 4)


def test_pcie_switch_box_classifies_pix_pxb_phb_sys(pcie_box):
    report = discover(pcie_box.root)
    assert len(report.gpus) == 8
    assert [g.numa_node for g in report.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    types = {(link.a, link.b): link.type for link in report.links}
    assert types[(0, 1)] == "PIX"  # same switch
    assert types[(0, 2)] == "PHB"  # switches on two root ports of one host bridge
    assert types[(4, 5)] == "PIX"  # same leaf switch
    assert types[(4, 6)] == "PXB"  # leaf switches under one parent switch
    assert types[(1, 7)] == "SYS"  # across sockets
    assert {link.count for link in report.links} == {0}
    assert report.fabric_peers(0) == frozenset()


def test_unknown_numa_node_on_single_node_vm_is_harmless(no_numa):
    report = discover(no_numa.root)
    assert [g.numa_node for g in report.gpus] == [UNKNOWN_NUMA, UNKNOWN_NUMA]
    assert report.link(0, 1).type == "PHB"
    assert report.warnings == ()  # one node: nothing is ambiguous


def test_unknown_numa_node_on_two_sockets_is_warned(dgx):
    (dgx.root / "sys/bus/pci/devices" / dgx.gpus[4] / "numa_node").write_text("-1\n")
    report = discover(dgx.root)
    assert report.gpus[4].numa_node == UNKNOWN_NUMA
    assert report.link(0, 4).type == "UNKNOWN"  # different host bridges, socket unknown
    assert report.link(4, 5).type == "PIX"  # the PCIe tree still tells
    assert any("GPU 4" in w and "numa_node = -1" in w for w in report.warnings)


def test_rdma_nics_report_numa_rate_and_netdevs(dgx):
    report = discover(dgx.root)
    rdma = [n for n in report.nics if n.kind == "rdma"]
    assert [n.name for n in rdma] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert [n.numa_node for n in rdma] == [0, 0, 1, 1]
    assert rdma[2].speed_mbps == 400_000
    assert rdma[2].link_layer == "InfiniBand"
    assert rdma[2].net_devices == ("ibp2",)
    net = {n.name: n for n in report.nics if n.kind == "net"}
    assert net["ibp3"].numa_node == 1 and net["ibp3"].speed_mbps == 200_000


def test_malformed_and_missing_files_give_partial_report_with_warnings(dgx):
    root = dgx.root
    (root / "sys/devices/system/node/node1/cpulist").write_text("28-x\n")
    (root / "sys/devices/system/node/node0/meminfo").unlink()
    (root / "sys/devices/system/cpu/cpu3/topology/thread_siblings_list").unlink()
    (root / "sys/devices/system/cpu/cpu59/topology/thread_siblings_list").unlink()
    (root / "sys/devices/system/cpu/cpu4/topology/thread_siblings_list").unlink()  # cpu60 still names it
    (root / "sys/bus/pci/devices" / dgx.gpus[1] / "numa_node").write_text("zero\n")
    (root / "sys/bus/pci/devices" / dgx.gpus[2] / "class").unlink()
    (root / "sys/class/infiniband/mlx5_1/ports/1/rate").write_text("fast\n")

    report = discover(root)

    node0, node1 = report.numa_nodes
    assert node0.memory_bytes is None and node1.memory_bytes == 64 * 2**30
    assert node1.cpus == frozenset()  # its CPU list was unreadable
    assert frozenset({3}) in node0.cores and frozenset({59}) in node0.cores
    assert frozenset({4, 60}) in node0.cores
    assert sorted(c for core in node0.cores for c in core) == sorted(node0.cpus)  # each CPU in one core
    assert report.gpus[1].numa_node == UNKNOWN_NUMA
    assert dgx.gpus[2] not in [g.pci_bus_id for g in report.gpus]  # no class: not recognisably a GPU
    assert next(n for n in report.nics if n.name == "mlx5_1").speed_mbps is None
    text = "\n".join(report.warnings)
    assert "node1/cpulist is malformed" in text
    assert "node0/meminfo is missing" in text
    assert "no hyper-thread siblings known for CPUs 3,59;" in text
    assert f"{dgx.gpus[1]}/numa_node is malformed" in text
    assert "CPUs 28-55,84-111 belong to no NUMA node" in text


def test_empty_root_does_not_crash(tmp_path):
    report = discover(tmp_path)
    assert report.gpus == () and report.nics == ()
    assert report.numa_nodes[0].cpus == frozenset()
    assert any("no NUMA nodes" in w for w in report.warnings)


def test_nvml_errors_become_warnings_not_crashes(dgx, dgx_nvml):
    def broken(h):
        raise dgx_nvml.NVMLError("Unknown Error")

    dgx_nvml.nvmlDeviceGetMemoryInfo = broken
    dgx_nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: (_ for _ in ()).throw(dgx_nvml.NVMLError("x"))
    dgx_nvml.p2p_blocked = {frozenset((0, 7))}
    report = discover(dgx.root, nvml=dgx_nvml)
    assert len(report.gpus) == 8 and report.gpus[0].memory_bytes is None
    assert report.link(0, 7).type == "SYS"  # NVML failed, sysfs answered
    assert any("NVML could not tell GPU memory" in w for w in report.warnings)


def test_gpus_nvml_does_not_report_are_warned(dgx, fake_nvml):
    nvml = fake_nvml(dgx.gpus[:7], [[] for _ in range(7)], {(a, b): 50 for a in range(7) for b in range(7)})
    report = discover(dgx.root, nvml=nvml)
    assert len(report.gpus) == 7
    assert any(dgx.gpus[7] in w and "not reported by nvml" in w for w in report.warnings)


def test_amdsmi_backend_reads_xgmi(no_numa):
    class Kind:
        name = "AMDSMI_LINK_TYPE_XGMI"

    class FakeAmdsmi:
        def amdsmi_get_processor_handles(self):
            return ["h0", "h1"]

        def amdsmi_get_gpu_device_bdf(self, h):
            return no_numa.gpus[int(h[1])]

        def amdsmi_get_gpu_asic_info(self, h):
            return {"market_name": "AMD Instinct MI300X", "target_graphics_version": "gfx942"}

        def amdsmi_get_gpu_memory_total(self, h, kind):
            return 192 * 2**30

        def amdsmi_get_gpu_device_uuid(self, h):
            return f"uuid-{h}"

        def amdsmi_topo_get_link_type(self, a, b):
            return {"hops": 1, "type": Kind()}

        def amdsmi_get_gpu_driver_info(self, h):
            return {"driver_version": "6.8.5"}

    report = discover(no_numa.root, gpu_backend="amdsmi", amdsmi=FakeAmdsmi())
    assert [(g.vendor, g.arch, g.model) for g in report.gpus] == [
        ("amd", "gfx942", "AMD Instinct MI300X")
    ] * 2
    assert report.link(0, 1).type == "XGMI"
    assert report.software.driver_version == "6.8.5"
    assert report.fabric_all_to_all()


def test_vendor_libraries_are_not_asked_about_a_fake_root(dgx, monkeypatch):
    from pagoda_daemon.topology import libs

    monkeypatch.setattr(libs.NVML, "get", lambda: (_ for _ in ()).throw(AssertionError("NVML used")))
    assert discover(dgx.root).software.gpu_backend == "sysfs"


def test_live_root_never_crashes():
    report = discover("/")
    assert report.cpu.logical_cpus >= 1
    assert report.allowed_cpus


def test_nvlink_found_when_the_driver_hides_the_remote_end(dgx, dgx_nvml):
    def hidden(h, link):
        raise dgx_nvml.NVMLError("Not Supported")

    dgx_nvml.nvmlDeviceGetNvLinkRemotePciInfo = hidden
    dgx_nvml.p2p_blocked = {frozenset((0, 7))}
    report = discover(dgx.root, nvml=dgx_nvml)
    assert (report.link(0, 1).type, report.link(0, 1).count) == ("NVLINK", 18)  # P2P status decides
    assert report.link(0, 7).type == "SYS"
