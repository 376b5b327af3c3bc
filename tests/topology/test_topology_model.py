"""CPU lists, the JSON form of the report, GPU visibility and the vendor-library guard."""

from __future__ import annotations

import json
import sys
import threading
import types

import pytest

from pagoda_daemon.topology import NodeTopology, discover
from pagoda_daemon.topology.cpulist import format_cpulist, parse_cpulist
from pagoda_daemon.topology.libs import ManagedLibrary
from pagoda_daemon.topology.model import Gpu
from pagoda_daemon.topology.pci import normalize_bus_id
from pagoda_daemon.topology.visibility import resolve_visibility


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", set()), ("0", {0}), ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}), (" 5-6 ,\n", {5, 6})],
)
def test_cpulist_parses(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "1,,x", "0x3"])
def test_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_cpulist_formats_compact_sorted_ranges():
    assert format_cpulist({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"
    assert format_cpulist([]) == ""
    assert parse_cpulist(format_cpulist(range(0, 224, 3))) == frozenset(range(0, 224, 3))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        (b"00000000:AB:00.0", "0000:ab:00.0"),
        ("18:00.0", "0000:18:00.0"),
    ],
)
def test_bus_ids_are_normalised_to_sysfs_form(raw, expected):
    assert normalize_bus_id(raw) == expected


@pytest.mark.parametrize("machine", ["laptop", "dgx", "pcie_box", "no_numa"])
def test_report_round_trips_through_json(machine, request):
    report = discover(request.getfixturevalue(machine).root, env={"CUDA_VISIBLE_DEVICES": "1,0"})
    data = json.loads(json.dumps(report.to_dict()))
    assert NodeTopology.from_dict(data) == report


def test_report_json_uses_camel_case_and_cpu_lists(dgx, dgx_nvml):
    data = discover(dgx.root, nvml=dgx_nvml).to_dict()
    assert data["numaNodes"][1]["cpus"] == "28-55,84-111"
    assert data["numaNodes"][1]["cores"][0] == "28,84"
    gpu = data["gpus"][0]
    assert gpu["pciBusId"] == dgx.gpus[0] and gpu["computeCapability"] == "9.0"
    assert "arch" not in gpu  # absent values are left out
    assert data["links"][0] == {"a": 0, "b": 1, "type": "NVLINK", "count": 18}


def _gpus(n, model="H100", vendor="nvidia"):
    return [Gpu(i, vendor, model, f"0000:{i:02x}:00.0", uuid=f"GPU-{i}abc-{i}") for i in range(n)]


@pytest.mark.parametrize(
    ("value", "visible"),
    [
        ("", ()),
        ("2,0", (2, 0)),
        ("GPU-3abc", (3,)),  # a UUID prefix
        ("1,7,2", (1,)),  # parsing stops at the first device that does not exist
        ("1,1", (1,)),
        ("-1", ()),
    ],
)
def test_cuda_visible_devices(value, visible):
    vis, _ = resolve_visibility(_gpus(4), {"CUDA_VISIBLE_DEVICES": value})
    assert vis.visible_gpus == visible
    assert vis.cuda_visible_devices == value


def test_hiding_every_gpu_is_quiet_but_a_typo_is_not():
    assert resolve_visibility(_gpus(2), {"CUDA_VISIBLE_DEVICES": "-1"})[1] == []
    _, warnings = resolve_visibility(_gpus(2), {"CUDA_VISIBLE_DEVICES": "0,5"})
    assert warnings == ["CUDA_VISIBLE_DEVICES='0,5': '5' names no GPU here; later entries are ignored"]


def test_unset_means_every_gpu():
    vis, warnings = resolve_visibility(_gpus(2), {})
    assert vis.visible_gpus is None and warnings == []


def test_disagreeing_cuda_and_hip_variables_are_warned():
    vis, warnings = resolve_visibility(_gpus(4), {"CUDA_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "2"})
    assert vis.visible_gpus == (0, 1)  # the NVIDIA runtime reads CUDA_VISIBLE_DEVICES
    assert any("disagree" in w and "CUDA_VISIBLE_DEVICES" in w for w in warnings)
    vis, warnings = resolve_visibility(
        _gpus(4, vendor="amd"), {"CUDA_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "2"}
    )
    assert vis.visible_gpus == (2,)  # HIP prefers HIP_VISIBLE_DEVICES
    assert any("uses HIP_VISIBLE_DEVICES" in w for w in warnings)


def test_agreeing_variables_are_quiet():
    _, warnings = resolve_visibility(_gpus(4), {"CUDA_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"})
    assert warnings == []


def test_mig_and_mixed_models_are_warned():
    _, warnings = resolve_visibility(_gpus(2), {"CUDA_VISIBLE_DEVICES": "MIG-abc"})
    assert any("MIG" in w for w in warnings)
    mixed = [*_gpus(1, "A100"), *_gpus(2, "H100")[1:]]
    _, warnings = resolve_visibility(mixed, {"CUDA_VISIBLE_DEVICES": "0"})
    assert any("CUDA_DEVICE_ORDER" in w for w in warnings)
    _, warnings = resolve_visibility(mixed, {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert warnings == []


def test_managed_library_initialises_once_and_shuts_down_at_exit(monkeypatch):
    calls = {"init": 0, "shutdown": 0}
    fake = types.ModuleType("fake_nvml_for_test")
    fake.nvmlInit = lambda: calls.__setitem__("init", calls["init"] + 1)
    fake.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    monkeypatch.setitem(sys.modules, "fake_nvml_for_test", fake)
    registered = []
    monkeypatch.setattr("atexit.register", lambda fn, *args: registered.append((fn, args)))

    lib = ManagedLibrary("fake_nvml_for_test", lambda m: m.nvmlInit(), lambda m: m.nvmlShutdown())
    threads = [threading.Thread(target=lib.get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lib.get() is fake
    assert calls["init"] == 1 and len(registered) == 1
    fn, args = registered[0]
    fn(*args)
    assert calls["shutdown"] == 1


def test_managed_library_remembers_failure(monkeypatch):
    attempts = []

    def fail(module):
        attempts.append(1)
        raise RuntimeError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "fake_broken_lib", types.ModuleType("fake_broken_lib"))
    lib = ManagedLibrary("fake_broken_lib", fail, lambda m: None)
    assert lib.get() is None and lib.get() is None
    assert attempts == [1]
    assert "Driver Not Loaded" in lib.error
    missing = ManagedLibrary("surely_not_installed_xyz", fail, lambda m: None)
    assert missing.get() is None and missing.error == "surely_not_installed_xyz is not installed"
