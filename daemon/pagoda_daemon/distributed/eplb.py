"""Expert-parallel load balancing (EPLB): count the tokens each expert gets, and every
``eplb_step_interval`` steps re-place the experts so that every rank gets about the same number
of tokens, giving the busiest experts the redundant slots (a copy on a second rank, each copy
taking a share of the expert's tokens), and move the weights between ranks while serving.

Every rank of a replica runs the same steps, so every rank decides to rebalance at the same
step with no message; the loads are summed over the ranks first so that every rank computes
the same placement from the same numbers. Weights move with point-to-point sends between the
ranks (``batch_isend_irecv``, NCCL or gloo) and in-place copies, so CUDA graphs captured over
the expert tensors stay valid.

A physical slot is one expert-sized place in a rank's stacked weights: rank ``r`` holds slots
``r·S .. r·S + S − 1`` with ``S = (experts + redundant) / ranks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EplbConfig:
    num_redundant_experts: int
    step_interval: int


def initial_placement(num_experts: int, num_ranks: int, slots_per_rank: int) -> list[int]:
    """Experts in order over the ranks, the redundant slots holding copies of the first
    experts (no load is known yet): the logical expert of every physical slot."""
    total = num_ranks * slots_per_rank
    return [slot % num_experts for slot in range(total)]


# A new placement must lower the busiest rank's load by this fraction to be worth moving weights.
MIN_GAIN = 0.01


def rank_loads(placement: list[int], load: list[float], num_ranks: int, slots_per_rank: int) -> list[float]:
    """Each rank's share of the tokens: an expert's load split evenly over its copies."""
    copies = [placement.count(e) for e in range(len(load))]
    return [sum(load[e] / copies[e] for e in placement[r * slots_per_rank:(r + 1) * slots_per_rank])
            for r in range(num_ranks)]


def pack(load: list[float], num_ranks: int, slots_per_rank: int) -> list[list[int]]:
    """The experts each rank should hold for per-expert `load`, over `num_ranks` ranks of
    `slots_per_rank` slots.

    1. Copies: every expert one; each redundant slot goes to the expert with the largest load
       per copy (at most one copy per rank).
    2. Packing: copies, heaviest first, each to the least-loaded rank with a free slot and no
       copy of that expert yet (greedy, as in vLLM's and DeepSeek's EPLB); when only ranks
       holding the expert have room, a copy of another expert is moved there to make room.
    """
    num_experts = len(load)
    replicas = [1] * num_experts
    for _ in range(num_ranks * slots_per_rank - num_experts):
        e = max((i for i in range(num_experts) if replicas[i] < num_ranks),
                key=lambda i: (load[i] / replicas[i], -i))
        replicas[e] += 1
    items = sorted(((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
                   key=lambda t: (-t[0], t[1]))
    rank_load = [0.0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for share, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots_per_rank]
        fresh = [r for r in free if e not in held[r]]
        if not fresh:  # room only where e already is: move some f from a rank without e to there
            r_free = free[0]
            q, f = next((q, f) for q in range(num_ranks) if e not in held[q] for f in held[q]
                        if f not in held[r_free])
            held[q].remove(f)
            held[r_free].append(f)
            rank_load[q] -= load[f] / replicas[f]
            rank_load[r_free] += load[f] / replicas[f]
            fresh = [q]
        r = min(fresh, key=lambda i: (rank_load[i], i))
        held[r].append(e)
        rank_load[r] += share
    return held


def assign_slots(held: list[list[int]], old: list[int], old_slots_per_rank: int, slots_per_rank: int) -> list[int]:
    """A placement (the expert of every physical slot) from what each rank should hold: an
    expert a rank already held keeps its slot where the slot still exists, so only the changes
    move. `old` may be a placement over another number of ranks or slots (a resize)."""
    new: list[int] = []
    for r, wanted in enumerate(held):
        wanted = list(wanted)
        mine = old[r * old_slots_per_rank:(r + 1) * old_slots_per_rank]
        slots: list[int | None] = [None] * slots_per_rank
        for i, e in enumerate(mine[:slots_per_rank]):
            if e in wanted:
                wanted.remove(e)
                slots[i] = e
        new += [e if e is not None else wanted.pop(0) for e in slots]
    return new


def rebalance(load: list[float], old: list[int], num_ranks: int, slots_per_rank: int) -> list[int]:
    """A new logical expert per physical slot for per-expert `load` (``pack``, then
    ``assign_slots``: a rank keeps an expert where it already had it).

    The old placement stays when the new one would not lower the busiest rank's load by
    MIN_GAIN: moving weights for nothing costs a step's time.
    """
    new = assign_slots(pack(load, num_ranks, slots_per_rank), old, slots_per_rank, slots_per_rank)
    if max(rank_loads(new, load, num_ranks, slots_per_rank)) > (1 - MIN_GAIN) * max(
            rank_loads(old, load, num_ranks, slots_per_rank)):
        return list(old)
    return new


def replica_table(placement: list[int], num_experts: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [E, width]: the physical slots of each expert, padded by repeating the first;
    counts [E]). A fixed width keeps the tables' shapes, and the CUDA graphs over them, valid."""
    slots: list[list[int]] = [[] for _ in range(num_experts)]
    for physical, e in enumerate(placement):
        slots[e].append(physical)
    if min(map(len, slots)) == 0 or max(map(len, slots)) > width:
        raise ValueError(f"a placement must hold every expert 1..{width} times")
    table = torch.tensor([s + [s[0]] * (width - len(s)) for s in slots], dtype=torch.int64)
    return table, torch.tensor([len(s) for s in slots], dtype=torch.int64)


def move_plan(old: list[int], new: list[int], slots_per_rank: int) -> list[tuple[int, int]]:
    """(destination slot, source slot) for every slot whose expert changes: the source holds
    the expert before the move, on the destination's own rank where possible."""
    plan = []
    for dest, expert in enumerate(new):
        if old[dest] == expert:
            continue
        sources = [s for s, e in enumerate(old) if e == expert]
        same_rank = [s for s in sources if s // slots_per_rank == dest // slots_per_rank]
        plan.append((dest, (same_rank or sources)[0]))
    return plan


def move_weights(tensors: list[torch.Tensor], plan: list[tuple[int, int]], expert_group: int,
                 slots_per_rank: int, peer: Callable[[int], int], group) -> None:
    """Carry out `plan` on this rank's stacked expert tensors (each [S, ...]): receive what
    other ranks send, send what they need, then copy, all from the weights as they were.
    `peer(g)` is the rank of expert group g that holds the same slice of each expert as this one."""
    first = expert_group * slots_per_rank
    mine = range(first, first + slots_per_rank)
    before = [t.clone() for t in tensors] if any(d in mine and s in mine for d, s in plan) else tensors
    ops, received = [], []
    for dest, src in plan:  # the same order on every rank: each pair's sends and receives match
        if dest in mine and src not in mine:
            bufs = [torch.empty_like(t[0]) for t in tensors]
            received.append((dest - first, bufs))
            ops += [dist.P2POp(dist.irecv, b, peer(src // slots_per_rank), group) for b in bufs]
        elif src in mine and dest not in mine:
            ops += [dist.P2POp(dist.isend, t[src - first].contiguous(), peer(dest // slots_per_rank), group)
                    for t in tensors]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for dest, src in plan:
        if dest in mine and src in mine:
            for t, old in zip(tensors, before):
                t[dest - first].copy_(old[src - first])
    for local, bufs in received:
        for t, b in zip(tensors, bufs):
            t[local].copy_(b)


class ExpertBalancer:
    """Counts steps on one rank and rebalances every MoE layer every `step_interval` steps."""

    def __init__(self, layers: list, config: EplbConfig, tp) -> None:
        self.layers = layers
        self.config = config
        self.tp = tp
        self.steps = 0
        self.rebalances = 0
        self.slots_moved = 0
        self.imbalance = (0.0, 0.0)  # the busiest rank's load / the mean, before and after the last rebalance
        # The busiest rank's routed (token, expert) pairs per MoE layer per step over the last
        # window, with the new placement: the expert load an elastic replica's size divides.
        self.rank_load_per_step = 0.0
        self._window_start = 0  # self.steps at the last rebalance or reset
        self._reported = (0, 0)

    def _peer(self, expert_group: int) -> int:
        slice_rank, slices = self.tp.expert_slicing
        return expert_group * slices + slice_rank

    def reset(self) -> None:
        """Forget the load counted so far (warm-up and graph capture run the model too)."""
        for layer in self.layers:
            layer.expert_load.zero_()
        self.steps = self._window_start = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.config.step_interval == 0:
            self.rebalance()

    def take_stats(self) -> tuple[int, int, float, float, float]:
        """(rebalances, slots moved) since the previous call, the last rebalance's imbalance and
        the busiest rank's load per layer and step."""
        rebalances, moved = self.rebalances - self._reported[0], self.slots_moved - self._reported[1]
        self._reported = (self.rebalances, self.slots_moved)
        return rebalances, moved, *self.imbalance, self.rank_load_per_step

    @torch.no_grad()
    def rebalance(self) -> None:
        moved = 0
        before = [0.0] * self.tp.expert_groups
        after = [0.0] * self.tp.expert_groups
        for layer in self.layers:
            load = layer.expert_load.clone()
            if self.tp.enabled:  # every rank counted the same tokens; the sum makes them agree exactly
                dist.all_reduce(load, group=self.tp.group)
            old = layer.placement
            loads = [float(x) for x in load.tolist()]
            new = rebalance(loads, old, self.tp.expert_groups, layer.slots_per_rank)
            for r, (b, a) in enumerate(zip(rank_loads(old, loads, self.tp.expert_groups, layer.slots_per_rank),
                                           rank_loads(new, loads, self.tp.expert_groups, layer.slots_per_rank))):
                before[r] += b
                after[r] += a
            plan = move_plan(old, new, layer.slots_per_rank)
            if plan:
                move_weights([layer.w13.data, layer.w2.data], plan, self.tp.expert_group, layer.slots_per_rank,
                             self._peer, self.tp.group)
                layer.set_placement(new)
                moved += len(plan)
            layer.expert_load.zero_()
        self.rebalances += 1
        self.slots_moved += moved
        mean = sum(before) / len(before)
        if mean > 0:
            self.imbalance = (max(before) / mean, max(after) / mean)
        window = self.steps - self._window_start
        if window > 0 and self.layers:
            self.rank_load_per_step = max(after) / len(self.layers) / window
        self._window_start = self.steps
        log.info("EPLB: rebalance %d after %d steps moved %d expert slots over %d layers", self.rebalances,
                 self.steps, moved, len(self.layers))
