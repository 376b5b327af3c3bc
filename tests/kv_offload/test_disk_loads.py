"""The worker's disk loads: files read straight into the staging slots, a window of slots at a
time, then copied to the GPU blocks (here the CPU stand-in for them). More loads than slots, a
file corrupted in the middle of a window, and loads beside host-memory copies: every good block
lands where the plan says, the bad one alone is zeroed and reported failed."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
import torch

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.scheduler_output import KVTransfer
from pagoda_daemon.kv_offload import disk as disk_tier
from pagoda_daemon.kv_offload import tiered
from tests.kv_offload.test_offload import corrupt

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 32, 4, 2, 8


def worker(tmp_path, cpu_gib: float = 0.0) -> tuple[tiered.TieredWorker, torch.Tensor]:
    kv = torch.zeros(LAYERS, 2, BLOCKS, BS, HEADS, DIM)
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    config = EngineConfig(model=str(tmp_path / "model"), device="cpu", kv_offload_disk_path=str(tmp_path / "kv"),
                          kv_offload_disk_gib=64 * block_bytes / 2**30, kv_offload_cpu_gib=cpu_gib)
    return tiered.TieredWorker(config, 0, kv, block_bytes), kv


@pytest.mark.parametrize("window", [1, 3, 64])
def test_loads_more_than_the_window_land_in_their_blocks_and_a_bad_file_fails_alone(tmp_path, monkeypatch, window):
    w, kv = worker(tmp_path)
    assert w.disk is not None
    slot_bytes = math.prod(kv[:, :, 0].shape) * kv.element_size()
    monkeypatch.setattr(tiered, "DISK_STAGING_BYTES", window * slot_bytes)
    rng = random.Random(window)
    blocks = {bytes([i]) * 32: torch.randn(LAYERS, 2, BS, HEADS, DIM) for i in range(10)}
    for h, block in blocks.items():
        w.disk.write(h, block)
    hashes = list(blocks)
    bad = hashes[4]
    data = (w.disk.dir / disk_tier.file_name(bad)).read_bytes()
    (w.disk.dir / disk_tier.file_name(bad)).write_bytes(data[:-4] + bytes(b ^ 0xFF for b in data[-4:]))
    targets = rng.sample(range(BLOCKS), len(hashes))
    kv.normal_()  # whatever the blocks held before: every one loaded is overwritten
    plan = [KVTransfer("load_disk", h, g) for h, g in zip(hashes, targets, strict=True)]
    failed = w.run(plan, kv)
    assert failed == [h == bad for h in hashes]
    for h, g in zip(hashes, targets, strict=True):
        want = torch.zeros_like(blocks[h]) if h == bad else blocks[h]
        assert torch.equal(kv[:, :, g], want), (h, g)
    assert w._staging is not None and w._staging.num_slots == window
    # the slots serve the next step's loads again
    kv.zero_()
    again = [KVTransfer("load_disk", h, g) for h, g in zip(hashes[:4], targets[:4], strict=True)]
    assert w.run(again, kv) == [False] * 4
    assert all(torch.equal(kv[:, :, g], blocks[h]) for h, g in zip(hashes[:4], targets[:4], strict=True))


def test_disk_loads_beside_host_memory_loads_and_saves(tmp_path, monkeypatch):
    """A plan mixing host-memory saves and loads with disk loads: the disk loads are batched after
    the host copies (they fill fresh blocks), and every block ends up as planned."""
    w, kv = worker(tmp_path, cpu_gib=8 * LAYERS * 2 * BS * HEADS * DIM * 4 / 2**30)
    assert w.disk is not None and w.cpu is not None
    monkeypatch.setattr(tiered, "DISK_STAGING_BYTES", 2 * kv[:, :, 0].numel() * kv.element_size())
    kv.normal_()
    on_disk = {bytes([100 + i]) * 32: torch.randn(LAYERS, 2, BS, HEADS, DIM) for i in range(5)}
    for h, block in on_disk.items():
        w.disk.write(h, block)
    saved = kv[:, :, 0].clone()
    plan = [KVTransfer("save_cpu", b"s" * 32, 0, 3)]
    plan += [KVTransfer("load_disk", h, 10 + i) for i, h in enumerate(on_disk)]
    plan += [KVTransfer("load_cpu", b"s" * 32, 20, 3)]
    assert w.run(plan, kv) == [False] * len(plan)
    assert torch.equal(kv[:, :, 20], saved)
    for i, block in enumerate(on_disk.values()):
        assert torch.equal(kv[:, :, 10 + i], block)


def test_a_block_file_of_another_size_is_not_read_into_a_slot(tmp_path):
    w, _ = worker(tmp_path)
    assert w.disk is not None
    h = b"x" * 32
    w.disk.write(h, torch.randn(LAYERS, 2, BS + 1, HEADS, DIM))  # a block of another engine's size
    slot = torch.full((LAYERS, 2, BS, HEADS, DIM), 7.0)
    with pytest.raises(RuntimeError, match="changed under the engine"):
        w.disk.read(h, slot)
    assert torch.equal(slot, torch.full_like(slot, 7.0))  # nothing written into it


def test_stages_land_in_their_host_slots_and_a_failed_thread_fails_the_engine(tmp_path, monkeypatch):
    """Disk blocks read into host slots in the background (``stage``): each good block lands in
    the slot the plan names, a corrupt file is reported failed alone; an error of the staging
    thread itself is raised by ``take_staged``, not left as blocks that never arrive."""
    w, kv = worker(tmp_path, cpu_gib=16 * LAYERS * 2 * BS * HEADS * DIM * 4 / 2**30)  # 16 float32 blocks
    assert w.disk is not None and w.cpu is not None
    blocks = {bytes([i]) * 32: torch.randn(LAYERS, 2, BS, HEADS, DIM) for i in range(6)}
    for h, block in blocks.items():
        w.disk.write(h, block)
    bad = list(blocks)[2]
    corrupt(w.disk.dir / disk_tier.file_name(bad))
    slots = random.Random(4).sample(range(16), len(blocks))
    w.stage([KVTransfer("stage_disk", h, -1, s) for h, s in zip(blocks, slots, strict=True)], kv)
    done: list[tuple[bytes, bool]] = []
    deadline = time.monotonic() + 30
    while len(done) < len(blocks):
        assert time.monotonic() < deadline, done
        done += w.take_staged()
        time.sleep(0.01)
    assert dict(done) == {h: h != bad for h in blocks}
    for (h, block), s in zip(blocks.items(), slots, strict=True):
        if h != bad:
            assert torch.equal(w.cpu.block(s), block), h
    def no_memory(*_args, **_kwargs):
        raise MemoryError("no pinned memory")

    monkeypatch.setattr(w.disk, "read", no_memory)
    w.stage([KVTransfer("stage_disk", next(iter(blocks)), -1, slots[0])], kv)
    deadline = time.monotonic() + 30
    with pytest.raises(RuntimeError, match="into host memory failed: no pinned memory"):
        while time.monotonic() < deadline:
            w.take_staged()
            time.sleep(0.01)


def hold_writes(w: tiered.TieredWorker, monkeypatch) -> threading.Event:
    """The worker's disk writes wait until the returned event is set."""
    assert w.disk is not None
    release = threading.Event()
    write = w.disk.write

    def held_write(block_hash, block):
        assert release.wait(60), "the writes were never released"
        write(block_hash, block)

    monkeypatch.setattr(w.disk, "write", held_write)
    return release


def in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_the_disk_tier_alones_saves_are_written_beside_the_steps_and_the_steps_outputs_wait_for_them(
        tmp_path, monkeypatch):
    """The disk tier alone (every computed block saved): a step's saves come off the device at
    once and their files are written beside the following steps, which may overwrite the
    blocks meanwhile; the step's writes go to its outputs (``take_step_writes``, awaited by
    ``LaunchedStep.wait``: a prefill instance's answer promises its files); a load of a block
    still being written waits for it; ``flush`` waits for all."""
    from concurrent import futures

    from pagoda_daemon.worker.model_runner import LaunchedStep

    w, kv = worker(tmp_path)
    assert w.disk is not None
    release = hold_writes(w, monkeypatch)
    kv.normal_()
    saved = [kv[:, :, g].clone() for g in range(3)]
    hashes = [bytes([70 + i]) * 32 for i in range(3)]
    step = in_thread(w.run, [KVTransfer("save_disk", h, g) for g, h in enumerate(hashes)], kv)
    step.join(10)
    assert not step.is_alive(), "the step waited for its saves' files"
    writes = w.take_step_writes()
    assert len(writes) == 3 and not any(f.done() for f in writes) and w.take_step_writes() == []
    launched = LaunchedStep.empty()
    launched.kv_writes = writes
    answered = in_thread(launched.wait)
    kv[:, :, :3].normal_()  # the next steps reuse the blocks while the files are written
    load = in_thread(w.run, [KVTransfer("load_disk", hashes[0], 20)], kv)
    time.sleep(0.3)
    assert answered.is_alive() and load.is_alive(), "the outputs or a read did not wait for the files"
    release.set()
    for t in (answered, load):
        t.join(30)
        assert not t.is_alive()
    assert all(f.done() and f.exception() is None for f in futures.wait(writes, timeout=30).done)
    assert torch.equal(kv[:, :, 20], saved[0])  # the block as it was saved
    w.flush()
    for h, block in zip(hashes, saved, strict=True):
        assert torch.equal(w.disk.read(h), block)


def test_demotes_are_written_beside_the_steps_and_what_reads_their_files_waits_for_them(tmp_path, monkeypatch):
    """Host memory's evicted blocks (``demote``) are written to disk beside the steps: the step's
    copies return while the writes are held, from a copy of the slot (a later save may reuse
    it). A disk load, a background stage or a drop of a block whose write is under way waits for
    it; past MAX_WRITE_BYTES of copies waiting, the step waits for the oldest; ``flush`` waits
    for all."""
    w, kv = worker(tmp_path, cpu_gib=8 * LAYERS * 2 * BS * HEADS * DIM * 4 / 2**30)  # 8 float32 blocks
    assert w.disk is not None and w.cpu is not None
    release = hold_writes(w, monkeypatch)
    kv.normal_()
    first = [kv[:, :, g].clone() for g in range(3)]
    hashes = [bytes([50 + i]) * 32 for i in range(3)]
    assert w.run([KVTransfer("save_cpu", h, g, g) for g, h in enumerate(hashes)], kv) == [False] * 3

    step = in_thread(w.run, [KVTransfer("demote", h, -1, g) for g, h in enumerate(hashes)], kv)
    step.join(10)
    assert not step.is_alive(), "the step waited for its demotes' files"
    kv[:, :, 0].normal_()  # slot 0 taken by another block while its demote still waits to be written
    assert w.run([KVTransfer("save_cpu", b"n" * 32, 0, 0)], kv) == [False]

    load = in_thread(w.run, [KVTransfer("load_disk", hashes[0], 20)], kv)
    w.stage([KVTransfer("stage_disk", hashes[1], -1, 5)], kv)  # returns at once: its thread waits
    drop = in_thread(w.run, [KVTransfer("drop", hashes[2])], kv)
    time.sleep(0.5)
    assert load.is_alive() and drop.is_alive(), "a read or drop of a file being written did not wait for it"
    assert w.take_staged() == []
    release.set()
    for t in (load, drop):
        t.join(30)
        assert not t.is_alive()
    assert torch.equal(kv[:, :, 20], first[0])  # the slot's block as it was when demoted
    assert not (w.disk.dir / disk_tier.file_name(hashes[2])).exists()
    deadline = time.monotonic() + 30
    while not (staged := w.take_staged()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert staged == [(hashes[1], True)] and torch.equal(w.cpu.block(5), first[1])

    release.clear()  # past the bound the step waits for the oldest write; flush waits for all
    monkeypatch.setattr(w, "_max_writes", 1)
    step = in_thread(w.run, [KVTransfer("demote", b"a" * 32, -1, 5), KVTransfer("demote", b"b" * 32, -1, 1)], kv)
    time.sleep(0.5)
    assert step.is_alive(), "two demotes waiting with room for one, and the step did not wait"
    closing = in_thread(w.flush)
    time.sleep(0.2)
    assert closing.is_alive()
    release.set()
    for t in (step, closing):
        t.join(30)
        assert not t.is_alive()
    assert all((w.disk.dir / disk_tier.file_name(h)).exists() for h in (b"a" * 32, b"b" * 32))


def test_a_demote_that_fails_is_logged_and_its_block_is_a_failed_load(tmp_path, monkeypatch, caplog):
    """A write that fails beside the steps fails no step: it is logged, leaves no file, and a
    load of the block is a failed load (the request computes it), not a wrong one."""
    w, kv = worker(tmp_path, cpu_gib=4 * LAYERS * 2 * BS * HEADS * DIM * 4 / 2**30)
    assert w.disk is not None and w.cpu is not None

    def broken(block_hash, block):
        raise RuntimeError("device lost")

    monkeypatch.setattr(w.disk, "write", broken)
    kv.normal_()
    h = b"f" * 32
    assert w.run([KVTransfer("save_cpu", h, 0, 0)], kv) == [False]
    with caplog.at_level("ERROR", logger=tiered.__name__):
        assert w.run([KVTransfer("demote", h, -1, 0)], kv) == [False]
        w.flush()
    assert any("device lost" in r.getMessage() for r in caplog.records)
    assert not (w.disk.dir / disk_tier.file_name(h)).exists()
    assert w.run([KVTransfer("load_disk", h, 7)], kv) == [True]
    assert torch.equal(kv[:, :, 7], torch.zeros_like(kv[:, :, 7]))
