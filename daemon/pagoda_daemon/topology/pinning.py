"""Which CPUs each engine worker runs on, and applying that to the current process.

`plan_pinning` is a pure function of (topology, visible GPUs, allowed CPUs,
policy), so every placement rule is unit-tested on fake trees. With `auto`,
the worker for GPU g gets one hardware thread per physical core of g's NUMA
node (within the cpuset), minus one core per node kept for KV-transfer threads
when the node has enough cores. A worker pinned before it allocates its host
buffers gets them on local memory: Linux places a page on the node of the CPU
that first touches it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda_daemon.topology.cpulist import format_cpulist, parse_cpulist
from pagoda_daemon.topology.gpus import effective_numa
from pagoda_daemon.topology.model import UNKNOWN_NUMA, NodeTopology

log = logging.getLogger(__name__)

# A node needs at least this many allowed physical cores before one is kept
# aside for KV-transfer threads; below it the workers need every core.
MIN_CORES_TO_RESERVE = 4


@dataclass(frozen=True)
class PinningPolicy:
    mode: str  # "auto" | "none" | "cpus"
    cpus: frozenset[int] = frozenset()

    def __str__(self) -> str:
        return f"cpus={format_cpulist(self.cpus)}" if self.mode == "cpus" else self.mode


def parse_policy(text: str) -> PinningPolicy:
    """`auto`, `none` or `cpus=<list>` (e.g. `cpus=0-15,32-47`); ValueError otherwise."""
    value = text.strip()
    if value in ("auto", "none"):
        return PinningPolicy(value)
    if value.startswith("cpus="):
        cpus = parse_cpulist(value[len("cpus=") :])
        if not cpus:
            raise ValueError(f"pinning policy {text!r} lists no CPUs")
        return PinningPolicy("cpus", cpus)
    raise ValueError(f"unknown pinning policy {text!r}: use auto, none or cpus=<list>")


@dataclass(frozen=True)
class WorkerPin:
    """The CPU set for one worker; `cpus` None means leave the affinity as it is."""

    rank: int  # local rank, which is also the device ordinal the worker uses
    gpu: int | None  # physical GPU index, None for a CPU-only worker
    numa_node: int | None
    cpus: frozenset[int] | None
    reason: str
    kv_transfer_cpu: int | None = None  # the core kept on its NUMA node for KV-transfer threads


@dataclass(frozen=True)
class PinningPlan:
    policy: PinningPolicy
    workers: tuple[WorkerPin, ...]
    kv_transfer_cpus: Mapping[int, int] = field(default_factory=dict)  # NUMA node -> kept core
    warnings: tuple[str, ...] = ()

    def for_rank(self, rank: int) -> WorkerPin:
        for pin in self.workers:
            if pin.rank == rank:
                return pin
        raise KeyError(f"the pinning plan has no worker for local rank {rank}")

    def describe(self) -> list[str]:
        """One log line per worker and per kept core, for the engine's start-up log."""
        lines = [f"pinning policy {self.policy}"]
        for pin in self.workers:
            where = "CPU only" if pin.gpu is None else f"GPU {pin.gpu}"
            cpus = "unchanged" if pin.cpus is None else format_cpulist(pin.cpus)
            lines.append(
                f"rank {pin.rank} ({where}, NUMA {_node(pin.numa_node)}): CPUs {cpus} — {pin.reason}"
            )
        for node, cpu in sorted(self.kv_transfer_cpus.items()):
            lines.append(f"NUMA {node}: CPU {cpu} kept for KV-transfer threads")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": str(self.policy),
            "workers": [
                {
                    "rank": p.rank,
                    "gpu": p.gpu,
                    "numaNode": p.numa_node,
                    "cpus": None if p.cpus is None else format_cpulist(p.cpus),
                    "reason": p.reason,
                }
                for p in self.workers
            ],
            "kvTransferCpus": {str(n): c for n, c in sorted(self.kv_transfer_cpus.items())},
            "warnings": list(self.warnings),
        }


def plan_pinning(
    topology: NodeTopology,
    visible_gpus: Sequence[int] | None = None,
    allowed_cpus: Iterable[int] | None = None,
    policy: PinningPolicy | str = "auto",
) -> PinningPlan:
    """Per-worker CPU sets. `visible_gpus` lists physical GPU indices in device-ordinal
    order (None: every GPU of the topology; empty: one CPU-only worker)."""
    policy = parse_policy(policy) if isinstance(policy, str) else policy
    gpus = [g.index for g in topology.gpus] if visible_gpus is None else list(visible_gpus)
    known = {g.index for g in topology.gpus}
    unknown = [g for g in gpus if g not in known]
    if unknown:
        raise ValueError(f"GPUs {unknown} are not in the topology (it has {sorted(known)})")
    node_cpus = frozenset().union(*(n.cpus for n in topology.numa_nodes))
    allowed = frozenset(allowed_cpus) if allowed_cpus is not None else topology.allowed_cpus or node_cpus
    ranks: list[int | None] = list(gpus) if gpus else [None]

    if policy.mode == "none":
        return PinningPlan(
            policy, tuple(WorkerPin(r, g, None, None, "policy none") for r, g in enumerate(ranks))
        )
    if policy.mode == "cpus":
        return _plan_explicit(policy, ranks, allowed)
    return _plan_auto(topology, policy, ranks, allowed)


def _plan_explicit(policy: PinningPolicy, ranks: list[int | None], allowed: frozenset[int]) -> PinningPlan:
    cpus = policy.cpus & allowed
    if not cpus:
        raise ValueError(
            f"pinning policy {policy} names no CPU this process may use (allowed: {format_cpulist(allowed)})"
        )
    warnings = []
    if cpus != policy.cpus:
        dropped = format_cpulist(policy.cpus - allowed)
        warnings.append(f"CPUs {dropped} of policy {policy} are outside this process's cpuset; left out")
    pins = tuple(WorkerPin(r, g, None, cpus, f"policy {policy}") for r, g in enumerate(ranks))
    return PinningPlan(policy, pins, warnings=tuple(warnings))


def _plan_auto(
    topology: NodeTopology, policy: PinningPolicy, ranks: list[int | None], allowed: frozenset[int]
) -> PinningPlan:
    numa_ids = [n.id for n in topology.numa_nodes]
    # One hardware thread (the lowest allowed sibling) per physical core, per node.
    cores = {
        n.id: sorted(min(core & allowed) for core in n.cores if core & allowed) for n in topology.numa_nodes
    }
    homes: list[int | None] = []
    for gpu in ranks:
        if gpu is None:
            homes.append(None)
        else:
            node = effective_numa(topology.gpu(gpu).numa_node, numa_ids)
            homes.append(node if node != UNKNOWN_NUMA else None)

    # Keep one core per node that hosts a worker (every node for a CPU-only worker).
    hosting = set(numa_ids) if ranks == [None] else {h for h in homes if h is not None}
    kept = {n: cores[n][-1] for n in sorted(hosting) if len(cores[n]) >= MIN_CORES_TO_RESERVE}
    usable = {n: frozenset(c for c in cores[n] if c != kept.get(n)) for n in cores}
    everywhere = frozenset().union(*usable.values()) if usable else frozenset()

    warnings: list[str] = []
    small = sorted(n for n in hosting if n not in kept)
    if small:
        warnings.append(
            f"NUMA nodes {small} have fewer than {MIN_CORES_TO_RESERVE} allowed physical cores: "
            "no core kept for KV-transfer threads there"
        )
    pins = []
    for rank, (gpu, home) in enumerate(zip(ranks, homes)):
        if gpu is None:
            pins.append(
                WorkerPin(rank, None, None, everywhere or None, "CPU-only worker: every allowed core",
                          next(iter(kept.values()), None))
            )
        elif home is None:
            pins.append(WorkerPin(rank, gpu, None, None, "GPU's NUMA node is unknown: affinity left alone"))
            warnings.append(f"GPU {gpu} has no known NUMA node; its worker is not pinned")
        elif usable.get(home):
            pins.append(WorkerPin(rank, gpu, home, usable[home], f"physical cores of NUMA node {home}",
                                  kept.get(home)))
        else:
            pins.append(WorkerPin(rank, gpu, home, None, f"no allowed CPU on NUMA node {home}: left alone"))
            warnings.append(
                f"GPU {gpu} sits on NUMA node {home} but this process may use none of its CPUs; "
                "its worker is not pinned (host memory will be remote)"
            )
    return PinningPlan(policy, tuple(pins), kept, tuple(warnings))


def apply_pinning(pin: WorkerPin) -> frozenset[int] | None:
    """Pin the calling thread (and the threads it starts later) to `pin.cpus`; log it.

    Call it first thing in a worker, before starting threads or allocating
    pinned host memory, so both follow. Returns the affinity now in force,
    or None when nothing was changed; failures are logged, never raised.
    """
    if pin.cpus is None:
        log.info("pinning: rank %d left unpinned: %s", pin.rank, pin.reason)
        return None
    if not hasattr(os, "sched_setaffinity"):
        log.warning("pinning: this platform cannot set CPU affinity; rank %d left unpinned", pin.rank)
        return None
    try:
        os.sched_setaffinity(0, pin.cpus)
    except OSError as exc:
        log.warning("pinning: could not pin rank %d to CPUs %s: %s", pin.rank, format_cpulist(pin.cpus), exc)
        return None
    now = frozenset(os.sched_getaffinity(0))
    log.info(
        "pinning: rank %d (GPU %s, NUMA %s) pinned to CPUs %s: %s",
        pin.rank,
        "none" if pin.gpu is None else pin.gpu,
        _node(pin.numa_node),
        format_cpulist(now),
        pin.reason,
    )
    return now


def pin_thread(cpu: int | None) -> None:
    """Run the calling thread on this one core (the one the plan keeps for KV-transfer threads:
    a thread pool's initializer); None leaves it as it is. A failure costs a warning."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, {cpu})  # on Linux, 0 is the calling thread
    except OSError as exc:
        log.warning("pinning: could not run a KV-transfer thread on CPU %d: %s", cpu, exc)


def pin_this_process(
    local_rank: int,
    policy: PinningPolicy | str = "auto",
    *,
    sysfs_root: str = "/",
    env: Mapping[str, str] | None = None,
) -> WorkerPin:
    """What an engine worker calls at start: discover, plan, log the plan, apply its own line."""
    from pagoda_daemon.topology.discover import discover

    topology = discover(sysfs_root, env=env)
    visible = topology.visibility.visible_gpus
    plan = plan_pinning(topology, visible, topology.allowed_cpus, policy)
    for line in plan.describe():
        log.info("pinning: %s", line)
    pin = plan.for_rank(local_rank)
    apply_pinning(pin)
    return pin


def _node(node: int | None) -> str:
    return "?" if node is None else str(node)
