"""Disk hits come back through host memory in the background (issue #19: a request whose KV is
still loading waits without holding up the batch): with both tiers, a request whose prefix is on
disk waits, keeping its place, while its blocks are read into host memory; the steps run on for
the other requests meanwhile, and no step reads a file."""

from __future__ import annotations

import threading

import pytest

from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.engine.scheduler_output import SchedulerOutput
from pagoda_daemon.kv_offload import disk as disk_tier
from pagoda_daemon.kv_offload.cpu import CpuIndex
from tests.kv_offload.test_offload import ENGINE, assert_idle_and_consistent, corrupt, gib, workload

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("host_tier", [True, False], ids=["host-then-disk", "disk-alone"])
def test_a_request_waits_for_its_disk_blocks_while_the_batch_runs_on(model, block_bytes, tmp_path, monkeypatch,
                                                                     host_tier):
    """The disk reads are held until a request that was running alongside has finished all its
    tokens: had a step waited for a file, it could not have finished. Then the waiting request
    takes its blocks from host memory (no step loads from disk) and answers as the engine
    without offload does; every slot and block comes back. With the disk tier alone the reads
    land in host slots of their own (DISK_READ_AHEAD_GIB), which no save fills."""
    prompts = workload(seed=11, num_prefixes=6, repeats=1)
    fresh = workload(seed=13, num_prefixes=1, repeats=1, prefix_len=40)[0]  # in no tier
    reference = LLM(model, **ENGINE)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, SHORT)]
    other_want = reference.generate([fresh], LONG)[0].outputs[0].token_ids
    host = {"kv_offload_cpu_gib": gib(12, block_bytes)} if host_tier else {}
    llm = LLM(model, **ENGINE, **host, kv_offload_disk_path=str(tmp_path / "kv"),
              kv_offload_disk_gib=gib(64, block_bytes))
    for p in prompts:  # six prefixes of six blocks: the first ones leave host memory for disk
        llm.generate([p], SHORT)
    connector = llm.engine.core.connector
    assert [h for h in connector.disk.files if h not in connector.cpu]
    assert connector.cpu is not None and (len(connector.cpu) > 0) == host_tier  # disk alone: no save went there

    release = threading.Event()
    reads_started = threading.Event()
    read = disk_tier.DiskStore.read

    def held_read(self, block_hash, into=None):
        reads_started.set()
        assert release.wait(60), "the stage reads were never released"
        return read(self, block_hash, into)

    monkeypatch.setattr(disk_tier.DiskStore, "read", held_read)
    steps: list[SchedulerOutput] = []
    schedule = llm.engine.core.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        steps.append(out)
        return out

    monkeypatch.setattr(llm.engine.core.scheduler, "schedule", recorded)
    engine = llm.engine
    other = engine.add_request(fresh, LONG)
    while not engine.core.scheduler.running:
        engine.step()
    waiting = engine.add_request(prompts[0], SHORT)  # its prefix is on disk only
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)

    while other not in tokens:
        step()
    assert reads_started.is_set() and waiting not in tokens  # it waited for its reads all along
    release.set()
    while engine.has_unfinished_requests():
        step()
    assert tokens[other] == other_want and tokens[waiting] == want[0]
    stages = [t for s in steps for t in s.kv_stages]
    assert stages and all(t.kind == "stage_disk" for t in stages)
    assert not [t for s in steps for t in s.kv_loads + s.kv_prefetch if t.kind == "load_disk"]  # no step read a file
    assert any(t.kind == "load_cpu" for s in steps for t in s.kv_prefetch + s.kv_loads)
    stats = llm.get_stats().kv_offload
    assert stats.loaded_bytes.get("disk", 0) >= len(stages) * block_bytes and stats.failed_loads == 0
    assert_idle_and_consistent(llm)
    assert not connector.cpu.reserved


def test_a_file_that_fails_its_background_read_frees_its_slot_and_is_computed(model, block_bytes, tmp_path):
    """A block file corrupted after the lookup that found it: its read into host memory fails,
    the reserved slot is free again, the file is forgotten and the request computes those tokens
    (greedy output unchanged)."""
    prompts = workload(seed=12, num_prefixes=6, repeats=1)
    want = [o.outputs[0].token_ids for o in LLM(model, **ENGINE).generate(prompts[:1], SHORT)]
    llm = LLM(model, **ENGINE, kv_offload_cpu_gib=gib(12, block_bytes),
              kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(64, block_bytes))
    for p in prompts:
        llm.generate([p], SHORT)
    connector = llm.engine.core.connector
    on_disk_only = [h for h in connector.disk.files if h not in connector.cpu]
    assert len(on_disk_only) >= 6
    for h in on_disk_only:  # after their lookups' header checks: the CRC fails on the read
        corrupt(llm.engine.core.executor.worker.offload.disk.dir / disk_tier.file_name(h))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], SHORT)] == want
    stats = llm.get_stats().kv_offload
    assert stats.failed_loads >= 1
    assert_idle_and_consistent(llm)
    assert not connector.cpu.reserved


def test_the_host_index_reserves_fills_and_releases_slots():
    index = CpuIndex(3)
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    index.insert(a)
    index.insert(b)
    slot, evicted = index.reserve()
    assert evicted is None and c not in index and slot in index.reserved
    index.check()
    assert index.next_evicted_n(2) == [a, b]  # no slot free: least recently used first
    slot2, evicted = index.reserve()  # full: the least recently used goes
    assert evicted == (a, evicted[1]) and a not in index
    index.fill(c, slot)
    index.release(slot2)
    assert c in index and index.free == [slot2] and not index.reserved
    index.check()
    index.insert(d)
    assert len(index) == 3
    index.check()


def test_a_block_still_being_demoted_is_a_hit_whose_read_waits_for_its_write(model, block_bytes, tmp_path,
                                                                              monkeypatch, caplog):
    """Host memory's evictions are written to disk beside the steps: a lookup that comes before
    the file is written finds the block all the same (its read into host memory waits for the
    write), instead of taking the missing file for a failed write, forgetting the block and
    leaving the file, once written, outside the index."""
    prompts = workload(seed=14, num_prefixes=6, repeats=1)
    want = [o.outputs[0].token_ids for o in LLM(model, **ENGINE).generate(prompts[:1], SHORT)]
    llm = LLM(model, **ENGINE, kv_offload_cpu_gib=gib(12, block_bytes),
              kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(64, block_bytes))
    worker = llm.engine.core.executor.worker.offload
    release = threading.Event()
    write = worker.disk.write
    held: list[bytes] = []

    def held_write(block_hash, block):
        held.append(block_hash)
        assert release.wait(60), "the demote writes were never released"
        write(block_hash, block)

    monkeypatch.setattr(worker.disk, "write", held_write)
    for p in prompts:  # the first prefixes leave host memory; none of their files is written yet
        llm.generate([p], SHORT)
    connector = llm.engine.core.connector
    assert held and not list(worker.disk.dir.glob(f"*{disk_tier.SUFFIX}"))
    threading.Timer(1.0, release.set).start()
    with caplog.at_level("WARNING", logger=disk_tier.__name__):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], SHORT)] == want
    assert not [r for r in caplog.records if "missing" in r.getMessage()]
    stats = llm.get_stats().kv_offload
    assert stats.loaded_bytes.get("disk", 0) >= 6 * block_bytes and stats.failed_loads == 0
    assert_idle_and_consistent(llm)  # every file written is indexed
    assert not connector.disk.pending - set(connector.disk.files)
