"""Expert-parallel load balancing (EPLB): count the tokens each expert gets, and every
``eplb_step_interval`` steps re-place the experts so that every rank gets about the same number
of tokens, giving the busiest experts the redundant slots (a copy on a second rank, each copy
taking a share of the expert's tokens), and move the weights between ranks while serving.

Every rank of a replica runs the same steps, so every rank decides to rebalance at the same
step with no message; the loads are summed over the ranks first so that every rank computes
the same placement from the same numbers. With the experts spread over data-parallel engines
(``--data-parallel-experts``) the ranks are the engines: each runs every agreed forward pass
(distributed/lockstep.py), so their step counts match too, and each counts its own tokens.
Weights move with point-to-point sends between the
ranks (``batch_isend_irecv``, NCCL or gloo) and in-place copies, so CUDA graphs captured over
the expert tensors stay valid.

Synchronously (the default) every layer's weights move at the rebalance and serving waits for
them. Asynchronously (``eplb_async_steps`` > 0, vLLM's ``use_async``) a thread moves them while
the replica serves on the old placement: it reads the slots this rank sends from the GPU on a
stream of its own and exchanges them over a gloo group of their own through host memory, so
nothing it does runs on the GPUs beside the steps' collectives (the NCCL kernels of two
communicators on concurrent streams can wait on each other across ranks: vLLM forces
synchronous EPLB where its all-to-all is NCCL's for that reason). Layer ``i`` takes its new
experts and placement at the first step at least ``eplb_async_steps + i`` steps after the
rebalance at which every rank holds them: each rank's thread passes a barrier of the gloo group
after each layer, and rank 0's step plans say how many layers it has seen pass, so every rank
switches a layer at the same step and none waits for the move (on 2 × H200 a rebalance moving
13.6 GB took ~5 s through host memory; with the switch at a fixed step the steps had waited for
it); data-parallel engines, which have no common plans, agree on that count with each step.
Ranks started by a launcher have no plans: they switch at the fixed step, counted alike on
every rank, and a rank whose thread is late waits for it. The next rebalance is due only after
the last layer has switched.

A physical slot is one expert-sized place in a rank's stacked weights: rank ``r`` holds slots
``r·S .. r·S + S − 1`` with ``S = (experts + redundant) / ranks``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EplbConfig:
    num_redundant_experts: int
    step_interval: int
    async_steps: int = 0  # > 0: weights moved in the background, layer i switching async_steps + i steps later


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


@dataclass(frozen=True)
class RankMoves:
    """This rank's part of a move plan, each list in the plan's order (the same on every rank, so
    each send meets its receive): ``receives`` (local slot, sending rank), ``sends`` (local slot,
    receiving rank), ``copies`` (local slot, local slot it is copied from)."""

    receives: list[tuple[int, int]]
    sends: list[tuple[int, int]]
    copies: list[tuple[int, int]]

    @classmethod
    def of(cls, plan: list[tuple[int, int]], expert_group: int, slots_per_rank: int,
           peer: Callable[[int], int]) -> RankMoves:
        """`peer(g)`: the rank of expert group g that holds the same slice of each expert as this one."""
        first = expert_group * slots_per_rank
        mine = range(first, first + slots_per_rank)
        moves = cls([], [], [])
        for dest, src in plan:
            if dest in mine and src in mine:
                moves.copies.append((dest - first, src - first))
            elif dest in mine:
                moves.receives.append((dest - first, peer(src // slots_per_rank)))
            elif src in mine:
                moves.sends.append((src - first, peer(dest // slots_per_rank)))
        return moves

    def exchange(self, outgoing: list[list[torch.Tensor]], tensors: list[torch.Tensor], device: torch.device | str,
                 group) -> list[tuple[int, list[torch.Tensor]]]:
        """Point-to-point, all at once: ``outgoing`` (the tensors of each of ``sends``, in order)
        sent, each of ``receives`` filled into new buffers on ``device``, one slot of each of
        ``tensors`` (the stacked expert tensors); the received (local slot, buffers)."""
        received = [(slot, [torch.empty(t.shape[1:], dtype=t.dtype, device=device) for t in tensors])
                    for slot, _ in self.receives]
        ops = ([dist.P2POp(dist.irecv, b, rank, group) for (_, bufs), (_, rank) in zip(received, self.receives, strict=True)
                for b in bufs]
               + [dist.P2POp(dist.isend, t, rank, group)
                  for ts, (_, rank) in zip(outgoing, self.sends, strict=True) for t in ts])
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received


def place(tensors: list[torch.Tensor], copies: list[tuple[int, int]],
          received: list[tuple[int, list[torch.Tensor]]]) -> None:
    """Write a rank's new slots into its stacked expert tensors in place: its own slots copied
    from the weights as they were, then the ones received."""
    kept = [(dest, [t[src].clone() for t in tensors]) for dest, src in copies]
    for slot, weights in [*kept, *received]:
        for t, w in zip(tensors, weights, strict=True):
            t[slot].copy_(w)


def move_weights(tensors: list[torch.Tensor], plan: list[tuple[int, int]], expert_group: int,
                 slots_per_rank: int, peer: Callable[[int], int], group) -> None:
    """Carry out `plan` on this rank's stacked expert tensors (each [S, ...]), serving paused:
    receive what other ranks send, send what they need, then copy, all from the weights as they were."""
    moves = RankMoves.of(plan, expert_group, slots_per_rank, peer)
    received = moves.exchange([[t[slot].contiguous() for t in tensors] for slot, _ in moves.sends], tensors,
                              tensors[0].device, group)
    place(tensors, moves.copies, received)


@dataclass
class _LayerMove:
    """One MoE layer's share of an asynchronous rebalance: what the thread fetched for it."""

    placement: list[int] | None  # the layer's new placement; None once the layer has switched
    plan: list[tuple[int, int]]
    mine: RankMoves  # this rank's part of the plan
    received: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)  # (local slot, host copies)
    done: threading.Event = field(default_factory=threading.Event)


class _Transfer:
    """The background half of an asynchronous rebalance: for each layer in turn, this rank's
    outgoing slots copied to the host (from a stream of their own on a GPU) and exchanged with
    the other ranks over ``group`` (gloo) into host buffers."""

    def __init__(self, layers: list, moves: list[_LayerMove], group, first_switch_step: int) -> None:
        self.moves = moves
        self.first_switch_step = first_switch_step
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(layers, group), name="pagoda-eplb-transfer",
                                        daemon=True)
        self._thread.start()

    def _run(self, layers: list, group) -> None:
        try:
            device = layers[0].w13.device if layers else torch.device("cpu")
            # its own stream: the steps go on meanwhile. Reading the weights there is safe: the
            # rebalance read the loads on the host, so every earlier write to them has finished,
            # and none comes until this layer switches, after this thread is done with it.
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            for layer, move in zip(layers, self.moves, strict=True):
                tensors = [layer.w13.data, layer.w2.data]
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    outgoing = [[t[slot].to("cpu") for t in tensors] for slot, _ in move.mine.sends]
                move.received = move.mine.exchange(outgoing, tensors, "cpu", group)
                # past this barrier every rank holds the layer: rank 0's step plans may switch it
                dist.barrier(group=group)
                move.done.set()
        except BaseException as e:  # raised on the serving thread when the layer is due
            self.error = e
            for move in self.moves:
                move.done.set()

    def held_everywhere(self) -> int:
        """How many layers, from the first, every rank has received (their barrier passed here)."""
        held = 0
        while held < len(self.moves) and self.moves[held].done.is_set() and self.error is None:
            held += 1
        return held

    def wait(self, index: int) -> None:
        """Until layer ``index``'s weights are here; the thread's error, if it failed."""
        self.moves[index].done.wait()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """The thread's error, if it failed: the move cannot finish on any rank."""
        if self.error is not None:
            raise RuntimeError(f"EPLB: moving the experts in the background failed: {self.error}") from self.error

    def join(self) -> None:
        self._thread.join()


class ExpertBalancer:
    """Counts steps on one rank and rebalances every MoE layer every `step_interval` steps.
    ``transfer_group``: a gloo group over the same ranks, for asynchronous moves (``config.async_steps``)."""

    def __init__(self, layers: list, config: EplbConfig, tp, transfer_group=None) -> None:
        self.layers = layers
        self.config = config
        self.tp = tp
        self.transfer_group = transfer_group
        self._pending: _Transfer | None = None  # an asynchronous rebalance whose layers have not all switched
        self.steps = 0
        self.rebalances = 0
        self.slots_moved = 0
        self.imbalance = (0.0, 0.0)  # the busiest rank's load / the mean, before and after the last rebalance
        # The busiest rank's routed (token, expert) pairs per MoE layer per step over the last
        # window, with the new placement: the expert load an elastic replica's size divides.
        self.rank_load_per_step = 0.0
        self._window_start = 0  # self.steps at the last rebalance or reset
        self._reported = (0, 0)
        # The real token rows of this rank's step, read on the device by every layer as it counts
        # (SparseMoE.counted_rows): padding rows route too, and must not weigh in the placement
        self.counted_rows = torch.zeros((), dtype=torch.int64,
                                        device=layers[0].expert_load.device if layers else "cpu")
        for layer in layers:
            layer.counted_rows = self.counted_rows

    def _peer(self, expert_group: int) -> int:
        slice_rank, slices = self.tp.expert_slicing
        return expert_group * slices + slice_rank

    def count_rows(self, rows: int) -> None:
        """Before a step's forward pass (on its stream): its first ``rows`` token rows are real."""
        self.counted_rows.fill_(rows)

    def reset(self) -> None:
        """Forget the load counted so far (warm-up and graph capture run the model too)."""
        assert self._pending is None, "reset during an asynchronous rebalance"
        for layer in self.layers:
            layer.expert_load.zero_()
        self.steps = self._window_start = 0

    @property
    def is_async(self) -> bool:
        return self.config.async_steps > 0 and self.transfer_group is not None

    def layers_held_everywhere(self) -> int:
        """Rank 0, before a step: how many layers of the move under way every rank holds (what
        its step plan tells the ranks, so that they switch them at the same step)."""
        return 0 if self._pending is None else self._pending.held_everywhere()

    def step(self, layers_held: int | None = None) -> None:
        """One step done. ``layers_held`` (from rank 0's step plan): switch no layer beyond it,
        so no rank waits for a move; None (ranks started by a launcher, no plans): each layer
        switches at its step and a rank whose thread is late waits for it."""
        self.steps += 1
        if self._pending is not None:
            self._switch_due_layers(layers_held)
        if self.steps % self.config.step_interval == 0 and self._pending is None:
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
        moves: list[_LayerMove] = []
        before = [0.0] * self.tp.expert_groups
        after = [0.0] * self.tp.expert_groups
        for layer in self.layers:
            load = layer.expert_load.clone()
            if self.tp.enabled:  # the sum makes every rank agree exactly, from the same numbers
                dist.all_reduce(load, group=self.tp.group)
                if not self.tp.spread_tokens:  # every rank counted every token: once each
                    load //= self.tp.size
            old = layer.placement
            loads = [float(x) for x in load.tolist()]
            new = rebalance(loads, old, self.tp.expert_groups, layer.slots_per_rank)
            for r, (b, a) in enumerate(zip(rank_loads(old, loads, self.tp.expert_groups, layer.slots_per_rank),
                                           rank_loads(new, loads, self.tp.expert_groups, layer.slots_per_rank))):
                before[r] += b
                after[r] += a
            plan = move_plan(old, new, layer.slots_per_rank)
            if self.is_async:
                moves.append(_LayerMove(new, plan, RankMoves.of(plan, self.tp.expert_group, layer.slots_per_rank,
                                                                self._peer)))
            elif plan:
                move_weights([layer.w13.data, layer.w2.data], plan, self.tp.expert_group, layer.slots_per_rank,
                             self._peer, self.tp.group)
                layer.set_placement(new)
                moved += len(plan)
            layer.expert_load.zero_()
        if self.is_async and any(m.plan for m in moves):
            self._pending = _Transfer(self.layers, moves, self.transfer_group, self.steps + self.config.async_steps)
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
        if self._pending is not None:
            log.info("EPLB: the experts move in the background; layers switch from step %d, one a step",
                     self._pending.first_switch_step)

    @torch.no_grad()
    def _switch_due_layers(self, layers_held: int | None) -> None:
        """Layers whose turn has come (and, with ``layers_held``, that every rank holds) take
        their new experts (this rank's local moves from the weights as they were, the rest from
        the thread's host copies) and placement."""
        pending = self._pending
        assert pending is not None
        pending.raise_if_failed()  # with the plans' count, a failed move would otherwise never be due
        due = min(len(self.layers), self.steps - pending.first_switch_step + 1)
        if layers_held is not None:
            due = min(due, layers_held)
        for index in range(due):
            move = pending.moves[index]
            if move.placement is None:
                continue
            layer = self.layers[index]
            pending.wait(index)
            place([layer.w13.data, layer.w2.data], move.mine.copies, move.received)
            if move.plan:
                layer.set_placement(move.placement)
            self.slots_moved += len(move.plan)
            move.placement, move.received = None, []  # switched: its host copies freed
        if due == len(self.layers):
            pending.join()
            self._pending = None
