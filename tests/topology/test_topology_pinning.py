"""The pinning plan on fake trees, its invariants, and applying it to this process."""

from __future__ import annotations

import logging
import os
import random

import pytest

from pagoda_daemon.topology import apply_pinning, discover, parse_policy, pin_this_process, plan_pinning
from pagoda_daemon.topology.cpulist import parse_cpulist
from pagoda_daemon.topology.pinning import PinningPolicy, WorkerPin

NODE0_CORES = frozenset(range(0, 27))  # DGX fake: physical cores 0-27 on node 0, core 27 kept
NODE1_CORES = frozenset(range(28, 55))


def test_auto_pins_each_gpu_worker_to_its_nodes_physical_cores(dgx):
    plan = plan_pinning(discover(dgx.root), policy="auto")
    assert [p.gpu for p in plan.workers] == list(range(8))
    assert [p.numa_node for p in plan.workers] == [0, 0, 0, 0, 1, 1, 1, 1]
    for pin in plan.workers:
        assert pin.cpus == (NODE0_CORES if pin.numa_node == 0 else NODE1_CORES)
        assert pin.kv_transfer_cpu == (27 if pin.numa_node == 0 else 55)  # its node's kept core
    assert dict(plan.kv_transfer_cpus) == {0: 27, 1: 55}
    assert plan.warnings == ()


def test_visible_gpu_order_defines_ranks(dgx):
    plan = plan_pinning(discover(dgx.root), visible_gpus=[5, 1])
    assert [(p.rank, p.gpu, p.numa_node) for p in plan.workers] == [(0, 5, 1), (1, 1, 0)]
    assert plan.for_rank(0).cpus == NODE1_CORES
    with pytest.raises(KeyError):
        plan.for_rank(2)


def test_only_nodes_hosting_workers_keep_a_kv_core(dgx):
    plan = plan_pinning(discover(dgx.root), visible_gpus=[0, 1])
    assert dict(plan.kv_transfer_cpus) == {0: 27}


def test_cpuset_limits_the_plan(dgx):
    allowed = parse_cpulist("0-13,56-69")  # half of socket 0, both threads
    plan = plan_pinning(discover(dgx.root), visible_gpus=[0, 4], allowed_cpus=allowed)
    assert plan.for_rank(0).cpus == frozenset(range(13))
    assert plan.kv_transfer_cpus == {0: 13}
    far = plan.for_rank(1)
    assert far.cpus is None and far.numa_node == 1
    assert any("GPU 4" in w and "none of its CPUs" in w for w in plan.warnings)


def test_second_hyperthread_is_used_when_the_first_is_not_allowed(dgx):
    plan = plan_pinning(discover(dgx.root), visible_gpus=[0], allowed_cpus=range(56, 84))
    assert plan.for_rank(0).cpus == frozenset(range(56, 83))
    assert plan.kv_transfer_cpus == {0: 83}


def test_small_nodes_keep_every_core_for_workers(dgx):
    plan = plan_pinning(discover(dgx.root), visible_gpus=[0], allowed_cpus={0, 1, 2, 56})
    assert plan.for_rank(0).cpus == {0, 1, 2}
    assert plan.kv_transfer_cpus == {}
    assert any("fewer than 4" in w for w in plan.warnings)


def test_laptop_gets_one_cpu_only_worker(laptop):
    plan = plan_pinning(discover(laptop.root))
    (pin,) = plan.workers
    assert (pin.rank, pin.gpu, pin.numa_node) == (0, None, None)
    assert pin.cpus == {0, 1, 2}  # one thread per core, core 3 kept for KV transfer
    assert plan.kv_transfer_cpus == {0: 3} and pin.kv_transfer_cpu == 3


def test_unknown_numa_single_node_pins_to_that_node(no_numa):
    plan = plan_pinning(discover(no_numa.root))
    assert [p.numa_node for p in plan.workers] == [0, 0]
    assert plan.for_rank(1).cpus == frozenset(range(7))


def test_unknown_numa_on_two_sockets_leaves_the_worker_alone(dgx):
    (dgx.root / "sys/bus/pci/devices" / dgx.gpus[4] / "numa_node").write_text("-1\n")
    plan = plan_pinning(discover(dgx.root), visible_gpus=[4, 0])
    assert plan.for_rank(0).cpus is None
    assert plan.for_rank(1).cpus == NODE0_CORES
    assert any("GPU 4 has no known NUMA node" in w for w in plan.warnings)


def test_explicit_cpus_policy(dgx):
    plan = plan_pinning(discover(dgx.root), visible_gpus=[0, 4], policy="cpus=0-3,500")
    assert [p.cpus for p in plan.workers] == [frozenset(range(4))] * 2
    assert plan.kv_transfer_cpus == {}
    assert any("500" in w for w in plan.warnings)
    with pytest.raises(ValueError, match="names no CPU"):
        plan_pinning(discover(dgx.root), policy="cpus=500-501")


def test_none_policy_changes_nothing(dgx):
    plan = plan_pinning(discover(dgx.root), policy="none")
    assert {p.cpus for p in plan.workers} == {None}


def test_unknown_gpu_is_rejected(dgx):
    with pytest.raises(ValueError, match="not in the topology"):
        plan_pinning(discover(dgx.root), visible_gpus=[8])


@pytest.mark.parametrize("text", ["", "fast", "cpus=", "cpus=3-1", "cpus=a", "CPUS=1"])
def test_bad_policies_are_rejected(text):
    with pytest.raises(ValueError):
        parse_policy(text)


def test_policy_round_trips_through_text():
    assert parse_policy("cpus=8-11,0-3") == PinningPolicy("cpus", frozenset({0, 1, 2, 3, 8, 9, 10, 11}))
    assert str(parse_policy("cpus=8-11,0-3")) == "cpus=0-3,8-11"
    assert str(parse_policy(" auto ")) == "auto"


@pytest.mark.parametrize("machine", ["laptop", "dgx", "pcie_box", "no_numa"])
def test_plan_invariants_hold_for_random_cpusets(machine, request):
    topology = discover(request.getfixturevalue(machine).root)
    all_cpus = sorted(frozenset().union(*(n.cpus for n in topology.numa_nodes)))
    siblings = {cpu: core for node in topology.numa_nodes for core in node.cores for cpu in core}
    rng = random.Random(machine)
    for _ in range(40):
        allowed = frozenset(rng.sample(all_cpus, rng.randint(1, len(all_cpus))))
        gpus = [g.index for g in topology.gpus]
        visible = rng.sample(gpus, rng.randint(0, len(gpus))) if gpus else []
        plan = plan_pinning(topology, visible, allowed)
        kept = set(plan.kv_transfer_cpus.values())
        assert kept <= allowed
        for pin in plan.workers:
            assert pin.kv_transfer_cpu is None or pin.kv_transfer_cpu in kept
            if pin.cpus is None:
                continue
            assert pin.cpus and pin.cpus <= allowed
            assert not pin.cpus & kept
            assert len({siblings[c] for c in pin.cpus}) == len(pin.cpus)  # one thread per core
            if pin.numa_node is not None:
                assert pin.cpus <= topology.numa_nodes[pin.numa_node].cpus


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_apply_pinning_sets_and_reports_affinity(caplog):
    before = os.sched_getaffinity(0)
    target = frozenset({min(before)})
    try:
        with caplog.at_level(logging.INFO, logger="pagoda_daemon.topology.pinning"):
            got = apply_pinning(WorkerPin(0, 3, 1, target, "test"))
        assert got == target == os.sched_getaffinity(0)
        assert f"pinned to CPUs {min(before)}" in caplog.text
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_a_kv_transfer_thread_runs_on_the_kept_core_alone(caplog):
    from concurrent.futures import ThreadPoolExecutor

    from pagoda_daemon.topology.pinning import pin_thread

    before = os.sched_getaffinity(0)
    kept = max(before)
    with ThreadPoolExecutor(1, initializer=pin_thread, initargs=(kept,)) as pool:
        assert pool.submit(os.sched_getaffinity, 0).result() == {kept}
    assert os.sched_getaffinity(0) == before  # the calling thread is not moved
    with ThreadPoolExecutor(1, initializer=pin_thread, initargs=(None,)) as pool:
        assert pool.submit(os.sched_getaffinity, 0).result() == before
    pin_thread(100_000)  # a core this process may not use: a warning, the thread as it was
    assert os.sched_getaffinity(0) == before and "could not run a KV-transfer thread" in caplog.text


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_apply_pinning_failure_is_logged_not_raised(caplog):
    before = os.sched_getaffinity(0)
    assert apply_pinning(WorkerPin(0, None, None, frozenset({100_000}), "test")) is None
    assert os.sched_getaffinity(0) == before
    assert "could not pin rank 0" in caplog.text
    assert apply_pinning(WorkerPin(0, None, None, None, "policy none")) is None


def test_pin_this_process_plans_from_env_and_applies_its_rank(dgx, monkeypatch):
    applied = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: applied.append(frozenset(cpus)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: applied[-1])
    pin = pin_this_process(1, sysfs_root=str(dgx.root), env={"CUDA_VISIBLE_DEVICES": "6,2"})
    assert (pin.gpu, pin.numa_node) == (2, 0)
    assert applied == [NODE0_CORES]
