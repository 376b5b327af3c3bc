"""Elastic expert parallelism: the arithmetic of spreading a running replica's experts over
another number of ranks, and the point-to-point moves that carry it out.

Under elastic EP every rank holds attention and the dense layers whole
(``TensorParallel.replicated_dense``) and only the MoE experts are spread, so any number of
ranks can serve the same requests: a resize moves experts and nothing else between the ranks
that stay, and gives a joining rank the dense weights, the KV cache and the request state
(``executor/resize.py`` runs the protocol; docs/elastic-ep.md explains it).

Slots are numbered as in ``eplb.py``: rank ``r`` of ``n`` holds physical slots
``r·S .. r·S + S − 1`` with ``S = (experts + redundant) / n``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda_daemon.distributed.eplb import assign_slots, pack


@dataclass(frozen=True)
class Layout:
    """How the experts are spread: over ``ranks`` ranks of ``slots`` slots each."""

    ranks: int
    slots: int

    @property
    def total(self) -> int:
        return self.ranks * self.slots

    def rank_of(self, slot: int) -> int:
        return slot // self.slots

    def local(self, slot: int) -> int:
        return slot % self.slots


def redundant_experts_for(num_experts: int, ranks: int, configured: int) -> int:
    """The redundant slots at `ranks` ranks: the configured number, raised to the next one that
    gives every rank the same number of slots (8 experts over 3 ranks take one: 3 slots each).
    One rank holds every expert once: a copy on the same rank would take no load off it."""
    if ranks == 1:
        return 0
    redundant = configured
    while (num_experts + redundant) % ranks:
        redundant += 1
    return redundant


def layout_for(num_experts: int, ranks: int, configured_redundant: int) -> Layout:
    return Layout(ranks, (num_experts + redundant_experts_for(num_experts, ranks, configured_redundant)) // ranks)


def resized_placement(load: list[float], old: list[int], before: Layout, after: Layout) -> list[int]:
    """The expert of every slot of `after`, balanced for `load` (``eplb.pack``), with the
    packed sets matched to the ranks that already hold most of them, so that few experts move."""
    held = pack(load, after.ranks, after.slots)
    ordered: list[list[int]] = []
    for r in range(after.ranks):
        had = set(old[r * before.slots:(r + 1) * before.slots]) if r < before.ranks else set()
        best = max(range(len(held)), key=lambda i: (len(had & set(held[i])), -i))
        ordered.append(held.pop(best))
    return assign_slots(ordered, old, before.slots, after.slots)


def transfer_plan(old: list[int], new: list[int], before: Layout, after: Layout) -> list[tuple[int, int]]:
    """(new slot, old slot) for every slot of the new placement: an old slot holding the
    expert, on the new slot's own rank where there is one (a copy in place), else one of the
    holders, taken in turn so that the sends spread over them."""
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old):
        holders.setdefault(expert, []).append(slot)
    plan = []
    for dest, expert in enumerate(new):
        sources = holders[expert]
        here = [s for s in sources if before.rank_of(s) == after.rank_of(dest)]
        plan.append((dest, here[0] if here else sources[dest % len(sources)]))
    return plan


def reshard(old: list[torch.Tensor] | None, tails: list[tuple[torch.Size, torch.dtype]], plan: list[tuple[int, int]],
            rank: int, before: Layout, after: Layout, group, device: torch.device) -> list[torch.Tensor] | None:
    """This rank's new stacked expert tensors (None for a rank outside `after`), filled from
    the ranks that hold each expert now (`old`: this rank's current tensors, None for a rank
    outside `before`). The old tensors are only read: a transition that fails keeps them.
    Every rank walks the plan in the same order, so each pair's sends and receives match."""
    new = ([torch.empty((after.slots, *shape), dtype=dtype, device=device) for shape, dtype in tails]
           if rank < after.ranks else None)
    ops, local = [], []
    for dest, src in plan:
        to, frm = after.rank_of(dest), before.rank_of(src)
        if to == rank and frm == rank:
            local.append((after.local(dest), before.local(src)))
        elif to == rank:
            assert new is not None
            ops += [dist.P2POp(dist.irecv, t[after.local(dest)], frm, group) for t in new]
        elif frm == rank:
            assert old is not None
            ops += [dist.P2POp(dist.isend, t[before.local(src)].contiguous(), to, group) for t in old]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for d, s in local:
        assert new is not None and old is not None
        for t_new, t_old in zip(new, old):
            t_new[d].copy_(t_old[s])
    return new


def moved_bytes(plan: list[tuple[int, int]], before: Layout, after: Layout, slot_bytes: int) -> int:
    """Bytes that cross between ranks for `plan` (copies in place cost nothing on the wire)."""
    return slot_bytes * sum(after.rank_of(d) != before.rank_of(s) for d, s in plan)
