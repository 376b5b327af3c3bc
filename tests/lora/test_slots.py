"""The scheduler's slot table: which adapter sits in which GPU slot, and what each step loads."""

from __future__ import annotations

import random

import msgspec
import pytest

from pagoda_daemon.lora.request import LoRARequest, lora_cache_keys
from pagoda_daemon.lora.slots import SlotLoad, SlotTable


def lora(i: int | str) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", f"/adapters/{i}", f"digest-{i}")


def loaded(loads: list[SlotLoad]) -> dict[str, int]:
    return {load.lora.digest: load.slot for load in loads}


def test_adapters_get_distinct_slots():
    table = SlotTable(4)
    slots, loads = table.assign([lora(0), lora(1), lora(2)])
    assert sorted(slots) == ["digest-0", "digest-1", "digest-2"]
    assert len(set(slots.values())) == 3 and set(slots.values()) <= set(range(4))
    assert loaded(loads) == slots
    assert [load.lora for load in loads] == [lora(0), lora(1), lora(2)]


def test_no_adapters_no_loads():
    assert SlotTable(2).assign([]) == ({}, [])
    assert SlotTable(0).assign([]) == ({}, [])


def test_resident_adapter_is_not_reloaded():
    table = SlotTable(2)
    first, _ = table.assign([lora(0)])
    slots, loads = table.assign([lora(0)])
    assert slots == first and loads == []
    slots, loads = table.assign([lora(1), lora(0)])
    assert slots["digest-0"] == first["digest-0"]
    assert loaded(loads) == {"digest-1": slots["digest-1"]}


def test_same_adapter_twice_in_a_step_takes_one_slot():
    table = SlotTable(1)
    slots, loads = table.assign([lora(0), lora(0), lora(0)])
    assert slots == {"digest-0": 0} and len(loads) == 1


def test_slots_are_by_digest_not_name():
    """An adapter replaced on disk under the same name has a new digest: a new slot and a load."""
    table = SlotTable(2)
    old, new = LoRARequest("a", "/a", "d1"), LoRARequest("a", "/a", "d2")
    table.assign([old])
    slots, loads = table.assign([new, old])
    assert slots["d1"] != slots["d2"]
    assert [load.lora for load in loads] == [new]


def test_full_table_evicts_least_recently_used_not_in_step():
    table = SlotTable(3)
    table.assign([lora(0), lora(1), lora(2)])
    table.assign([lora(0)])  # 0 is now the most recent; 1 the least
    table.assign([lora(2)])  # order, oldest first: 1, 0, 2
    table.assign([lora(1)])  # order: 0, 2, 1
    slots, loads = table.assign([lora(3)])
    assert loaded(loads) == {"digest-3": slots["digest-3"]}
    # 0 was least recently used: its slot went to 3; 1 and 2 stay
    again, reloads = table.assign([lora(1), lora(2)])
    assert reloads == [] and slots["digest-3"] not in again.values()
    slots, loads = table.assign([lora(0)])
    assert len(loads) == 1  # 0 had been evicted


def test_eviction_spares_the_step_adapters_even_if_older():
    table = SlotTable(2)
    table.assign([lora(0)])
    table.assign([lora(1)])  # 0 is the least recently used...
    slots, loads = table.assign([lora(0), lora(2)])  # ...but this step needs it: 1 goes
    assert loaded(loads) == {"digest-2": slots["digest-2"]}
    assert set(slots.values()) == {0, 1}
    _, loads = table.assign([lora(1)])
    assert [load.lora for load in loads] == [lora(1)]


def test_evicted_slot_is_reused():
    table = SlotTable(2)
    slots, _ = table.assign([lora(0), lora(1)])
    new, loads = table.assign([lora(2), lora(1)])
    assert new["digest-2"] == slots["digest-0"] and new["digest-1"] == slots["digest-1"]
    assert loads == [SlotLoad(slots["digest-0"], lora(2))]


def test_more_adapters_than_slots_is_refused():
    table = SlotTable(2)
    with pytest.raises(ValueError, match="3 adapters"):
        table.assign([lora(0), lora(1), lora(2)])
    with pytest.raises(ValueError):
        SlotTable(0).assign([lora(0)])
    # the refusal changed nothing: a fitting step still works
    slots, loads = table.assign([lora(0), lora(1)])
    assert sorted(slots.values()) == [0, 1] and len(loads) == 2


def test_forget_frees_a_slot():
    table = SlotTable(2)
    slots, _ = table.assign([lora(0), lora(1)])
    table.forget("digest-0")
    new, loads = table.assign([lora(2)])
    assert new["digest-2"] == slots["digest-0"]  # the freed slot, not 1's
    _, loads = table.assign([lora(1)])
    assert loads == []  # 1 was not evicted
    _, loads = table.assign([lora(0)])
    assert len(loads) == 1  # 0 must be loaded again


def test_forget_unknown_digest_is_harmless():
    table = SlotTable(1)
    table.forget("nothing")
    slots, _ = table.assign([lora(0)])
    table.forget("nothing")
    assert table.assign([lora(0)]) == (slots, [])


def test_slot_load_travels_as_msgspec():
    load = SlotLoad(1, lora(7))
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(load), type=SlotLoad) == load
    assert lora_cache_keys(lora(7)) == (("lora", "digest-7"),)
    assert lora_cache_keys(None) == ()


class ReferenceLRU:
    """What the table must do, written plainly: residents by recency, oldest first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.order: list[str] = []

    def step(self, wanted: list[str]) -> tuple[set[str], set[str]]:
        """(the digests to load, the digests evicted) for a step wanting ``wanted``."""
        wanted_set = set(wanted)
        for d in dict.fromkeys(wanted):
            if d in self.order:
                self.order.remove(d)
                self.order.append(d)
        new = [d for d in dict.fromkeys(wanted) if d not in self.order]
        evict_count = max(0, len(self.order) + len(new) - self.num_slots)
        evicted = [d for d in self.order if d not in wanted_set][:evict_count]
        self.order = [d for d in self.order if d not in evicted] + new
        return set(new), set(evicted)

    def forget(self, digest: str) -> None:
        if digest in self.order:
            self.order.remove(digest)


@pytest.mark.parametrize("seed", range(8))
def test_random_steps_keep_the_table_consistent(seed):
    rng = random.Random(seed)
    num_slots = rng.randint(1, 6)
    pool = [lora(i) for i in range(rng.randint(num_slots + 1, 3 * num_slots + 2))]
    table, reference = SlotTable(num_slots), ReferenceLRU(num_slots)
    slot_of: dict[str, int] = {}  # what the GPU holds, as the loads put it there
    for _ in range(300):
        if rng.random() < 0.1:
            digest = rng.choice(pool).digest
            table.forget(digest)
            reference.forget(digest)
            slot_of.pop(digest, None)
            continue
        if rng.random() < 0.05:  # a step that does not fit
            with pytest.raises(ValueError):
                table.assign(rng.sample(pool, num_slots + 1))
            continue
        step = rng.choices(pool, k=rng.randint(0, num_slots))  # repeats: several requests, one adapter
        wanted = list(dict.fromkeys(lo.digest for lo in step))
        resident_before = dict(slot_of)
        slots, loads = table.assign(step)
        expected_loads, evicted = reference.step(wanted)

        assert sorted(slots) == sorted(wanted)
        assert all(0 <= s < num_slots for s in slots.values())
        assert len(set(slots.values())) == len(slots)
        assert [load.lora.digest for load in loads] == [d for d in wanted if d not in resident_before]
        assert set(loaded(loads)) == expected_loads
        assert len(loads) == len(loaded(loads))  # each adapter loaded at most once
        for d in wanted:  # a resident adapter keeps its slot
            if d in resident_before:
                assert slots[d] == resident_before[d]
        for load in loads:
            assert load.lora == next(lo for lo in step if lo.digest == load.lora.digest)
            assert slots[load.lora.digest] == load.slot
            # a load only overwrites a free slot or the slot of an adapter the step does not use
            displaced = [d for d, s in slot_of.items() if s == load.slot]
            assert all(d not in wanted for d in displaced)
            assert set(displaced) <= evicted
            for d in displaced:
                del slot_of[d]
            slot_of[load.lora.digest] = load.slot
        assert set(slot_of) == set(reference.order)
        assert len(set(slot_of.values())) == len(slot_of) <= num_slots
