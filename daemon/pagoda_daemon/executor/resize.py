"""Resizing the expert-parallel group of a running replica (elastic EP): the protocol every
rank follows between two steps of the engine core. docs/elastic-ep.md tells it with figures.

1. preparing: rank 0 hands the joining ranks their arguments (growth: spare processes started
   ahead of need, ``multiproc.py``) and sends the others ``Resize``.
   Growing, every rank leaves the world and all meet in one of new_size ranks at a rendezvous
   of its own: torch.distributed's point-to-point calls need the world's groups, so each
   configuration is a world of its own rather than a stateless group beside the old one.
2. transferring: rank 0 sends every layer's old and new placement (balanced for the load
   counted so far); experts move point to point (``distributed/elastic.reshard``) into new
   tensors, the old ones untouched; joiners take the dense weights, the KV blocks with content
   and rank 0's request and random state by broadcast.
3. every rank votes (an all-reduce of "ok"); rank 0 writes the decision to a file in the
   replica's private folder, which outlives any rank, and every rank reads it there.
4. commit: the new experts replace the old. Shrinking, the leaving ranks exit and the others
   meet in a world of new_size. Rollback: joiners are stopped, the old ranks meet in a world of
   old_size again and serve on with the experts they never released.
5. capturing: every rank captures its CUDA graphs again (the experts' shapes changed).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pagoda_daemon.distributed.elastic import (
    Layout,
    layout_for,
    moved_bytes,
    reshard,
    resized_placement,
    transfer_plan,
)
from pagoda_daemon.distributed.parallel_state import TensorParallel
from pagoda_daemon.executor import step_plan
from pagoda_daemon.executor.world import (
    Rendezvous,
    abandon_world,
    abort_groups,
    all_gather_infos,
    broadcast,
    join_world,
    leave_world,
)
from pagoda_daemon.worker.worker import Worker, WorkerInfo

log = logging.getLogger(__name__)

# How long the ranks wait for each other to meet in a transition's world, and for rank 0's decision.
TRANSITION_TIMEOUT = datetime.timedelta(seconds=60)
# Test hook (tests/distributed/test_elastic_ep.py): a joining rank told "exit-in-transfer" dies
# after its first layer of experts arrives, as a crashed joiner would.
FAULT_ENV = "PAGODA_ELASTIC_FAULT"
# KV blocks per broadcast to joining ranks: bounds the staging copy (Qwen3-30B-A3B, bf16: 1.5 MiB a block).
KV_BLOCKS_PER_BROADCAST = 512


@dataclass(frozen=True)
class Transition:
    """One resize as every rank sees it."""

    epoch: int
    old_size: int
    new_size: int
    folder: str  # the replica's private folder (mode 0700): rendezvous and decision files

    @property
    def grows(self) -> bool:
        return self.new_size > self.old_size

    @property
    def joiners(self) -> range:
        return range(self.old_size, self.new_size)

    def rendezvous(self, stage: str) -> Rendezvous:
        return Rendezvous(file=os.path.join(self.folder, f"rendezvous-{self.epoch}-{stage}"))

    def _decision_file(self) -> Path:
        return Path(self.folder, f"decision-{self.epoch}")

    def abort_file(self) -> Path:
        """Written by rank 0 when a joining process exits mid-transition: every rank aborts its
        process groups on seeing it (``TransferWatch``)."""
        return Path(self.folder, f"abort-{self.epoch}")

    def decide(self, commit: bool) -> None:
        """Rank 0: write the decision atomically (a reader sees all of it or nothing)."""
        tmp = self._decision_file().with_suffix(".tmp")
        tmp.write_text("commit" if commit else "rollback")
        tmp.rename(self._decision_file())

    def decision(self) -> bool:
        """Every other rank: wait for rank 0's decision (True: commit)."""
        deadline = time.monotonic() + TRANSITION_TIMEOUT.total_seconds() * 2
        path = self._decision_file()
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no decision from rank 0 on resize {self.epoch}")
            time.sleep(0.01)
        return path.read_text() == "commit"


@dataclass
class Exchanged:
    """What a rank holds once the transfer is done: the new layout, not yet in use."""

    placements: list[list[int]]  # every MoE layer's, for the new size
    experts: list[list[torch.Tensor]] | None  # per layer (w13, w2); None for a leaving rank
    rank_state: step_plan.RankState | None  # a joining rank's take of rank 0's requests
    bytes_moved: int


@dataclass
class RankSeat:
    """Where this process sits: the worker, its rank and the world it is in."""

    worker: Worker
    rank: int
    control: Any
    device_type: str
    local_rank: int
    stopped: threading.Event


def _moe_layers(worker: Worker) -> list:
    if worker.balancer is None or not worker.balancer.layers:
        raise RuntimeError("elastic expert parallelism needs EPLB's MoE layers")
    return worker.balancer.layers


def _layouts(worker: Worker, t: Transition) -> tuple[Layout, Layout]:
    experts = _moe_layers(worker)[0].num_experts
    configured = worker.config.num_redundant_experts
    return layout_for(experts, t.old_size, configured), layout_for(experts, t.new_size, configured)


def _tp_of(worker: Worker, rank: int, layout: Layout) -> TensorParallel:
    """The MoE layers' group for `layout`, in the world this process is in now."""
    redundant = layout.total - _moe_layers(worker)[0].num_experts
    return TensorParallel(rank, layout.ranks, dist.group.WORLD if layout.ranks > 1 else None, layout.ranks,
                          eplb=True, redundant_experts=redundant, replicated_dense=True)


def _rejoin(seat: RankSeat, t: Transition, stage: str, size: int, laps: Laps) -> None:
    (abandon_world if stage == "rollback" else leave_world)(seat.worker)
    laps.lap("leave")
    seat.control = join_world(seat.rank, size, t.rendezvous(stage), seat.device_type, seat.local_rank, seat.stopped,
                              TRANSITION_TIMEOUT)


def exchange(seat: RankSeat, t: Transition, laps: Laps, rank_state: step_plan.RankState | None = None) -> Exchanged:
    """Step 2, in a world of max(old, new) ranks: move the experts, and bring the joiners up
    to date (rank 0 passes its ``rank_state``). Laps: "plan" (placements, groups), "transfer"
    (the experts), "joiners" (dense weights, KV, request state)."""
    worker, rank = seat.worker, seat.rank
    before, after = _layouts(worker, t)
    layers = _moe_layers(worker)
    frame = None
    if rank == 0:
        old = [list(layer.placement) for layer in layers]
        new = [resized_placement([float(x) for x in layer.expert_load.tolist()], placement, before, after)
               for layer, placement in zip(layers, old)]
        frame = json.dumps([old, new]).encode()
    old_placements, placements = json.loads(broadcast(frame, seat.control))
    # Made before anything can fail: creating a group waits for every rank of the world.
    groups = _joiner_groups(seat, t) if t.grows else None
    if seat.device_type == "cuda":  # NCCL wants every rank in a group's first call, not only a pair's
        dist.all_reduce(torch.zeros(1, device=worker.device))
    experts: list[list[torch.Tensor]] | None = [] if rank < t.new_size else None
    moved = 0
    laps.lap("plan")
    fault = os.environ.get(FAULT_ENV) if rank in t.joiners else None
    for layer, old_p, new_p in zip(layers, old_placements, placements):
        plan = transfer_plan(old_p, new_p, before, after)
        current = [layer.w13.data, layer.w2.data] if rank < t.old_size else None
        tails = [(layer.w13.shape[1:], layer.w13.dtype), (layer.w2.shape[1:], layer.w2.dtype)]
        got = reshard(current, tails, plan, rank, before, after, dist.group.WORLD, worker.device)
        if experts is not None and got is not None:
            experts.append(got)
        slot_bytes = sum(shape.numel() * dtype.itemsize for shape, dtype in tails)
        moved += moved_bytes(plan, before, after, slot_bytes)
        if fault == "exit-in-transfer":
            log.error("%s=%s: rank %d exits in the middle of the transfer", FAULT_ENV, fault, rank)
            logging.shutdown()
            os._exit(1)
    laps.lap("transfer")
    state = _bring_joiners_up(seat, t, groups, rank_state) if groups is not None else None
    laps.lap("joiners")
    return Exchanged(placements, experts, state, moved)


def _joiner_groups(seat: RankSeat, t: Transition) -> tuple[Any, Any]:
    """(tensors, frames): groups of rank 0 and the joiners (every rank of the world creates them)."""
    members = [0, *t.joiners]
    tensors = dist.new_group(members)
    return tensors, dist.new_group(members, backend="gloo") if seat.device_type == "cuda" else tensors


def _bring_joiners_up(seat: RankSeat, t: Transition, groups: tuple[Any, Any],
                      rank_state: step_plan.RankState | None) -> step_plan.RankState | None:
    """Rank 0's dense weights, request state and KV blocks with content to the joining ranks."""
    if seat.rank != 0 and seat.rank not in t.joiners:
        return None
    tensors_group, frames_group = groups
    worker = seat.worker
    frame = broadcast(step_plan.encode(rank_state) if rank_state is not None else None, frames_group)
    state = step_plan.decode(frame)
    if not isinstance(state, step_plan.RankState):
        raise RuntimeError(f"rank 0 sent {type(state).__name__} where its request state belongs")
    with torch.no_grad():
        for tensor in worker.dense_tensors():
            dist.broadcast(tensor.data, src=0, group=tensors_group)
        assert worker.runner.kv_cache is not None
        worker.await_kv_prefetches()
        _broadcast_blocks(worker.runner.kv_cache, state.kv_block_ids, seat.rank, tensors_group)
    return state if seat.rank != 0 else None


def _broadcast_blocks(kv_cache: torch.Tensor, block_ids: list[int], rank: int, group: Any) -> None:
    """Rank 0's KV blocks `block_ids` into the joiners' caches, a chunk at a time: only blocks a
    request may read (an idle replica sends none; the whole cache was 70 GiB a rank on H200)."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    for start in range(0, len(block_ids), KV_BLOCKS_PER_BROADCAST):
        chunk = ids[start:start + KV_BLOCKS_PER_BROADCAST]
        staged = kv_cache.index_select(2, chunk)  # [layers, K/V, blocks, ...]: any rank's cache has the shape
        dist.broadcast(staged, src=0, group=group)
        if rank != 0:
            kv_cache.index_copy_(2, chunk, staged)


def vote(seat: RankSeat, ok: bool) -> bool:
    """Step 3: every rank's ok, all-reduced; False where a peer is gone or said no."""
    try:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=seat.control)
        return bool(flag.item())
    except Exception as e:
        log.error("rank %d: the resize vote failed: %s", seat.rank, e)
        return False


@dataclass
class Outcome:
    committed: bool
    size: int
    bytes_moved: int
    error: str = ""
    infos: list[WorkerInfo] = dataclasses.field(default_factory=list)
    rank_state: step_plan.RankState | None = None  # a joining rank's take of rank 0's requests
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # each part's, on this rank (Laps)


class Laps:
    """The seconds of each part of a transition on one rank: rank 0's reach ``/elastic_ep``
    (``last_seconds_by_part``), every rank logs its own, so that a slow transition says where."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, part: str) -> None:
        now = time.monotonic()
        self.seconds[part] = round(self.seconds.get(part, 0.0) + now - self._last, 4)
        self._last = now


class TransferWatch:
    """Over NCCL a rank that dies mid-transfer raises nothing in its peers: their kernels, and
    any call that waits on them, wait for it until NCCL's timeout, and a destroy waits with them.
    While a transition is undecided a thread watches: rank 0's for a joining process that exited
    (it then writes the transition's abort file), every rank's for that file; seeing it, it
    aborts the rank's process groups, so that what waits on the dead peer fails now. gloo
    reports a dead peer itself: no thread there."""

    def __init__(self, t: Transition, device_type: str, joiners: Sequence[Any] = ()) -> None:
        self.t, self.joiners = t, list(joiners)
        self.done = threading.Event()
        self.thread = None
        if device_type == "cuda":
            self.thread = threading.Thread(target=self._watch, name="transfer-watch", daemon=True)
            self.thread.start()

    def _watch(self) -> None:
        marker = self.t.abort_file()
        while not self.done.wait(0.05):
            dead = [p.pid for p in self.joiners if p.poll() is not None]
            if dead:
                log.error("joining process(es) %s exited during resize %d: aborting the transfer", dead, self.t.epoch)
                marker.touch()
            if marker.exists():
                abort_groups()
                return

    def stop(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()


def follow(seat: RankSeat, t: Transition, *, rank_state: step_plan.RankState | None = None,
           on_phase: Callable[[str], None] = lambda _p: None,
           decide: Callable[[bool], None] | None = None, joined: bool = False,
           mirrors: step_plan.RequestMirrors | None = None, joiners: Sequence[Any] = ()) -> Outcome:
    """Steps 1 (the world part) to 5 on one rank. Rank 0 passes ``decide`` (it writes the
    decision), its ``rank_state`` and the ``joiners``' processes; a joining rank passes
    ``joined`` (it is in the new world already). Returns with ``seat.control`` the control
    group of the world this rank serves in (a leaving rank has left every world)."""
    watch = TransferWatch(t, seat.device_type, joiners)
    try:
        return _follow(seat, t, watch, rank_state, on_phase, decide, joined, mirrors)
    finally:
        watch.stop()


def _follow(seat: RankSeat, t: Transition, watch: TransferWatch, rank_state: step_plan.RankState | None,
            on_phase: Callable[[str], None], decide: Callable[[bool], None] | None, joined: bool,
            mirrors: step_plan.RequestMirrors | None) -> Outcome:
    error = ""
    worker = seat.worker
    exchanged: Exchanged | None = None
    laps = Laps()
    try:
        if t.grows and not joined:
            _rejoin(seat, t, "grow", t.new_size, laps)
            laps.lap("worlds")
        on_phase("transferring")
        exchanged = exchange(seat, t, laps, rank_state)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        log.error("rank %d: resize %d -> %d failed in the transfer: %s", seat.rank, t.old_size, t.new_size, error)
    if exchanged is not None:
        ok = vote(seat, True)
    else:  # no vote: leave at once, so that a peer waiting in its vote fails now rather than time out
        ok = False
        if decide is None:
            abandon_world(worker)
    if decide is not None:
        decide(ok)
        commit = ok
    else:
        commit = t.decision()
    watch.stop()  # decided: from here this rank's groups are its own business (a rollback abandons them)
    if not commit and not error:
        error = "another rank failed the transfer (a joining rank died, or a transfer timed out)"
    laps.lap("vote")
    if commit:
        assert exchanged is not None
        if seat.rank >= t.new_size:  # a leaving rank
            leave_world(worker)
            return Outcome(True, t.new_size, exchanged.bytes_moved)
        if not t.grows:
            _rejoin(seat, t, "shrink", t.new_size, laps)
            laps.lap("worlds")
        _, after = _layouts(worker, t)
        assert exchanged.experts is not None
        worker.take_layout(_tp_of(worker, seat.rank, after), exchanged.placements, exchanged.experts)
        size = t.new_size
    else:
        if joined:  # rolled back: this rank never served
            abandon_world(worker)
            return Outcome(False, t.old_size, 0, error)
        before, _ = _layouts(worker, t)
        _rejoin(seat, t, "rollback", t.old_size, laps)
        laps.lap("worlds")
        layers = _moe_layers(worker)
        worker.take_layout(_tp_of(worker, seat.rank, before), [list(layer.placement) for layer in layers],
                           [[layer.w13.data, layer.w2.data] for layer in layers])
        size = t.old_size
    if joined:
        if exchanged is None or exchanged.rank_state is None or mirrors is None:
            raise RuntimeError("a joining rank got no request state from rank 0")
        mirrors.adopt(exchanged.rank_state, worker.runner)
    laps.lap("layout")
    on_phase("capturing")
    worker.capture_cuda_graphs()
    laps.lap("capture")
    infos = all_gather_infos(worker.info(), size, seat.control)
    laps.lap("gather")
    log.info("rank %d: resize %d -> %d %s; seconds by part: %s", seat.rank, t.old_size, t.new_size,
             "committed" if commit else "rolled back", laps.seconds)
    return Outcome(commit, size, exchanged.bytes_moved if exchanged and commit else 0, error, infos,
                   exchanged.rank_state if exchanged else None, laps.seconds)
