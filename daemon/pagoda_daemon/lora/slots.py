"""Which adapter sits in which GPU slot: decided by the scheduler, once, for every rank.

A step may use at most ``max_loras`` adapters (the scheduler admits a request only while the
running requests' adapters leave room for its own), so each step's adapters always fit: those
already in a slot stay, the others take free slots or the least recently used ones that this
step does not need. A load is a host-to-device copy of a few MB per adapter, paid when an
adapter comes back after eviction.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from pagoda_daemon.lora.request import LoRARequest


class SlotLoad(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Put ``lora`` in ``slot`` before this step's forward pass."""

    slot: int
    lora: LoRARequest


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recently used first

    def assign(self, loras: list[LoRARequest]) -> tuple[dict[str, int], list[SlotLoad]]:
        """(digest -> slot for every adapter of the step, the loads that put them there)."""
        wanted = {lora.digest: lora for lora in loras}
        if len(wanted) > self.num_slots:
            raise ValueError(f"a step uses {len(wanted)} adapters, more than the {self.num_slots} slots")
        for digest in wanted:
            if digest in self._slot_of:
                self._slot_of.move_to_end(digest)
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        loads = []
        for digest, lora in wanted.items():
            if digest in self._slot_of:
                continue
            if free:
                slot = free.pop(0)
            else:
                victim = next(d for d in self._slot_of if d not in wanted)  # least recently used
                slot = self._slot_of.pop(victim)
            self._slot_of[digest] = slot
            loads.append(SlotLoad(slot, lora))
        return {digest: self._slot_of[digest] for digest in wanted}, loads

    def forget(self, digest: str) -> None:
        """An adapter unloaded: its slot is free for the next that needs one."""
        self._slot_of.pop(digest, None)
