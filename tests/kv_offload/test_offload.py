"""KV offload end to end on CPU: with the GPU cache forced tiny, prefixes come back from host
memory, from disk and from both, and greedy output stays token-identical to the engine without
offload; the disk tier survives a restart, a corrupt or foreign file is a miss; nothing leaks."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.kv_offload import cpu as cpu_tier
from pagoda_daemon.kv_offload import disk as disk_tier

BS = 16
ENGINE = dict(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=16, max_model_len=256)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GIB = 1 << 30


# Prefixes 0-3 twice round (the 16-block GPU cache, about two requests, has lost each by its
# second turn: the host tier of 30 blocks serves it), then 4-7 push 0-3 out of host memory to
# disk, and 0-3 come back from there.
ORDER = [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]


def workload(seed: int = 0, num_prefixes: int = 8, repeats: int = 2, prefix_len: int = 100,
             order: list[int] | None = None) -> list[list[int]]:
    """Long shared prefixes (6 full blocks each), each asked for several times, spaced out so
    that the GPU cache has evicted a prefix before it is asked for again."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 400) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    order = order if order is not None else [i % num_prefixes for i in range(num_prefixes * repeats)]
    return [prefixes[k] + [rng.randrange(5, 400) for _ in range(3 + i % 5)] for i, k in enumerate(order)]


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for p in prompts:  # one at a time: the GPU cache holds little more than one request
        outs += [o.outputs[0].token_ids for o in llm.generate([p], PARAMS)]
    return outs


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    llm = LLM(model, **ENGINE)
    out = run(llm, workload(order=ORDER))
    assert llm.get_stats().kv_offload is None
    return out


def gib(blocks: int, block_bytes: int) -> float:
    return blocks * block_bytes / GIB


def assert_idle_and_consistent(llm: LLM) -> None:
    core = llm.engine.core
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks
    # Disk reads for a request aborted while it waited for them may still be under way: their
    # slots are reserved until the engine hears of them before its next schedule (none comes
    # when it is idle), then hold the blocks.
    deadline = time.monotonic() + 30
    while core.connector.cpu is not None and core.connector.cpu.reserved:
        assert time.monotonic() < deadline, "disk reads into host memory never finished"
        core.connector.staged(core.executor.take_staged_kv())
        time.sleep(0.01)
    core.connector.check()
    worker = core.executor.worker.offload
    worker.flush()  # the demotes still being written beside the steps
    if core.connector.disk is not None:
        files = sorted(p.name for p in worker.disk.dir.glob(f"*{disk_tier.SUFFIX}"))
        assert files == sorted(disk_tier.file_name(h) for h in core.connector.disk.files)
        assert not list(worker.disk.dir.glob("*.tmp"))


@pytest.mark.parametrize(("tiers", "policy", "step_load_blocks"), [
    ("cpu", "write-through", 6), ("cpu", "write-through", 0), ("disk", "write-through", 6),
    ("cpu+disk", "write-through", 6), ("cpu", "write-back", 6), ("cpu", "write-back", 0), ("cpu+disk", "write-back", 0),
])
def test_outputs_identical_with_offload(model, block_bytes, reference, tmp_path, tiers, policy, step_load_blocks):
    """Host memory alone, disk alone, and a host tier too small for the working set (30 blocks
    for 8 prefixes of 6) that spills to disk: hits in every configured tier, whether host memory
    gets each block once computed or once the GPU cache evicts it, and whether a step loads a
    prefix (6 blocks) from host memory for itself or prefetches every one for the next step."""
    opts: dict = {"kv_offload_write_policy": policy}
    if "cpu" in tiers:
        opts["kv_offload_cpu_gib"] = gib(64 if tiers == "cpu" else 30, block_bytes)
    if "disk" in tiers:
        opts.update(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(64, block_bytes))
    llm = LLM(model, **ENGINE, **opts)
    llm.engine.core.connector.step_load_blocks = step_load_blocks
    worker = llm.engine.core.executor.worker.offload
    prefetched: list[int] = []
    prefetch = worker.prefetch
    worker.prefetch = lambda transfers, kv_cache: (prefetched.append(len(transfers)), prefetch(transfers, kv_cache))
    in_step: list[int] = []
    files_in_step: list[int] = []
    run_copies = worker.run
    worker.run = lambda transfers, kv_cache: (in_step.append(sum(t.kind == "load_cpu" for t in transfers)),
                                              files_in_step.append(sum(t.kind == "load_disk" for t in transfers)),
                                              run_copies(transfers, kv_cache))[2]
    waited: list[int] = []
    wait_for_layer = worker.wait_for_layer
    worker.wait_for_layer = lambda layer: (waited.append(layer), wait_for_layer(layer))
    assert run(llm, workload(order=ORDER)) == reference
    # host-memory hits come back in the step that computes their request (up to the step's
    # share) or beside a step, for the next to read; files are read into host memory in the
    # background first (test_disk_staging.py: the host tier's slots, or with the disk alone
    # slots of their own), never by a step
    assert (sum(prefetched) > 0) == (step_load_blocks == 0), prefetched
    assert (sum(in_step) > 0) == (step_load_blocks > 0), in_step
    assert max(in_step) <= step_load_blocks, in_step
    assert sum(files_in_step) == 0, files_in_step
    # every step with loads waits for each layer before its attention, in order
    layers = llm.engine.core.executor.worker.runner.num_layers
    assert bool(waited) == (step_load_blocks > 0), waited
    assert waited == list(range(layers)) * (len(waited) // layers), waited
    stats = llm.get_stats().kv_offload
    assert stats is not None and stats.hits > 0 and stats.queries >= stats.hits
    for tier in tiers.split("+"):
        assert stats.loaded_bytes.get(tier, 0) > 0, (tier, stats)
        assert stats.saved_bytes.get(tier, 0) > 0, (tier, stats)
    assert stats.transfer_seconds > 0
    # the offload tiers served the repeats the GPU cache had lost: 8 repeats of 6 blocks, less
    # the few the GPU cache still held
    assert stats.hits >= 6 * 6 * BS, stats
    assert_idle_and_consistent(llm)


def test_a_wrong_load_is_caught(model, block_bytes, reference, monkeypatch):
    """The parity test above can fail: a load that leaves the GPU block as it was changes the output."""
    monkeypatch.setattr(cpu_tier.CpuStore, "load", lambda self, slot, kv_cache, gpu_block: None)
    llm = LLM(model, **ENGINE, kv_offload_cpu_gib=gib(64, block_bytes))
    assert run(llm, workload(order=ORDER)) != reference


def test_failed_disk_writes_cost_a_recompute_not_the_engine(model, block_bytes, reference, tmp_path, monkeypatch,
                                                            caplog):
    """A disk that refuses every third write (ENOSPC): the engine serves on, outputs equal the
    reference, the blocks that were written are still loaded, and no file or temporary file is
    left for a failed write."""
    import errno

    calls = [0]

    class FullDisk(io.FileIO):
        """A block file whose payload does not fit: the header lands, then ENOSPC."""

        fails, writes = False, 0

        def write(self, data):
            self.writes += 1
            if self.fails and self.writes == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    def flaky_open(path, mode="r", *args, **kwargs):
        calls[0] += 1
        f = FullDisk(path, mode.replace("b", ""))
        f.fails = calls[0] % 3 == 0
        return f

    monkeypatch.setattr(disk_tier, "open", flaky_open, raising=False)  # write_block's, the real one
    llm = LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(64, block_bytes))
    with caplog.at_level("WARNING", logger="pagoda_daemon.kv_offload.disk"):
        assert run(llm, workload(order=ORDER)) == reference
    stats = llm.get_stats().kv_offload
    assert calls[0] >= 6 and stats is not None and stats.loaded_bytes.get("disk", 0) > 0, stats
    assert any("No space left" in r.getMessage() for r in caplog.records)
    core = llm.engine.core
    core.executor.worker.offload.flush()
    files = {p.name for p in core.executor.worker.offload.disk.dir.glob(f"*{disk_tier.SUFFIX}")}
    assert files <= {disk_tier.file_name(h) for h in core.connector.disk.files}
    assert not list(core.executor.worker.offload.disk.dir.glob("*.tmp"))
    core.connector.check()


def corrupt(path: Path) -> None:
    """Flip the payload's last bytes: the file is still there, its CRC no longer matches."""
    data = path.read_bytes()
    path.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))


def run_pairs(llm: LLM, prompts: list[list[int]], hook: Callable[[], None] = lambda: None) -> list[list[int]]:
    """Two requests at a time (the GPU cache holds about two), ``hook`` after each pair."""
    outs = []
    for i in range(0, len(prompts), 2):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts[i : i + 2], PARAMS)]
        hook()
    return outs


# Prefixes asked for twice in one batch too, so that a request shares a failing load's block
# as a GPU prefix hit in the step that loads it.
PAIRS_ORDER = [0, 1, 2, 3, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tiers", ["disk", "cpu+disk"])
def test_block_files_corrupted_after_their_lookup_cost_a_recompute(model, block_bytes, tmp_path, tiers,
                                                                   async_scheduling, caplog):
    """A file this run wrote is stat-ed, not read, by a lookup: one whose bytes change after
    that fails its load on the worker (CRC). A third of the files are corrupted after every
    batch of two. The requests that read a failed block are computed again and the others of
    the step keep their tokens: outputs equal the engine without offload, every failure is
    counted, no block is left held and the tiers' accounting matches their contents."""
    prompts = workload(order=PAIRS_ORDER)
    engine = dict(ENGINE, async_scheduling=async_scheduling)
    reference = run_pairs(LLM(model, **engine), prompts)
    opts: dict = dict(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(64, block_bytes))
    if tiers == "cpu+disk":
        opts["kv_offload_cpu_gib"] = gib(8, block_bytes)  # most repeats come back from disk, promoted
    llm = LLM(model, **engine, **opts)
    rng = random.Random(5)
    rank0 = tmp_path / "kv" / "rank0"
    corrupted: set[str] = set()

    def corrupt_a_third() -> None:
        files = sorted(rank0.glob(f"*{disk_tier.SUFFIX}"))
        for path in rng.sample(files, len(files) // 3):
            corrupt(path)
            corrupted.add(path.name)

    with caplog.at_level("WARNING", logger="pagoda_daemon.kv_offload.tiered"):
        assert run_pairs(llm, prompts, corrupt_a_third) == reference
    stats = llm.get_stats().kv_offload
    assert stats.failed_loads >= 3 and stats.loaded_bytes.get("disk", 0) > 0, stats
    assert_idle_and_consistent(llm)
    failed = [Path(m[1]) for r in caplog.records if (m := re.search(r"block file (\S+) changed under", r.getMessage()))]
    assert len(failed) == stats.failed_loads and {p.name for p in failed} <= corrupted
    # once more without corruption: files still corrupt (never looked up since) fail and are
    # recomputed the same way; the rest load
    assert run_pairs(llm, prompts) == reference
    assert_idle_and_consistent(llm)


def test_disk_tier_survives_a_restart_and_a_corrupt_file_is_a_miss(model, block_bytes, tmp_path):
    disk = dict(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(256, block_bytes))
    prompts = workload(num_prefixes=4, order=[0, 1, 2, 3] * 3)
    reference = run(LLM(model, **ENGINE), prompts)
    first = LLM(model, **ENGINE, **disk)
    assert run(first, prompts[:4]) == reference[:4]  # one request per prefix: saved, never loaded
    assert first.get_stats().kv_offload.hits == 0
    first.engine.core.shutdown()
    saved = sorted((tmp_path / "kv" / "rank0").glob(f"*{disk_tier.SUFFIX}"))
    assert len(saved) == 4 * 6

    second = LLM(model, **ENGINE, **disk)
    assert len(second.engine.core.connector.disk) == len(saved)
    assert run(second, prompts[4:8]) == reference[4:8]
    stats = second.get_stats().kv_offload
    assert stats.hits == 4 * 6 * BS and stats.loaded_bytes["disk"] == 4 * 6 * block_bytes
    second.engine.core.shutdown()

    # corrupt one file of each kind: flipped payload bytes, a cut-off file, garbage
    data = saved[0].read_bytes()
    saved[0].write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    saved[7].write_bytes(saved[7].read_bytes()[:100])
    saved[13].write_bytes(b"not a block")
    third = LLM(model, **ENGINE, **disk)
    assert run(third, prompts[8:12]) == reference[8:12]
    stats = third.get_stats().kv_offload
    assert 0 < stats.hits < 4 * 6 * BS
    for bad in (saved[0], saved[7], saved[13]):
        # deleted, then (recomputed) saved anew, whole
        assert bad.is_file() and disk_tier.read_block(bad, third.engine.core.executor.worker.offload.disk.ident,
                                                      bytes.fromhex(bad.name[: -len(disk_tier.SUFFIX)]))
    assert_idle_and_consistent(third)


def test_another_models_files_are_never_loaded(tiny_models, model, block_bytes, tmp_path):
    disk = dict(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(256, block_bytes))
    prompts = workload(num_prefixes=2, repeats=1)
    assert len(prompts) == 2
    run(LLM(model, **ENGINE, **disk), prompts)
    other = tiny_models["qwen3"]
    plain = run(LLM(other, **ENGINE), prompts)
    llm = LLM(other, **ENGINE, **disk)
    assert run(llm, prompts) == plain
    assert llm.get_stats().kv_offload.hits == 0


@pytest.mark.slow  # about 40 s for 10,000 requests on 2 cores
@pytest.mark.parametrize("policy, requests", [("write-back", 10_000), ("write-through", 2_000)])
def test_no_leaks_after_many_requests_with_aborts(model, block_bytes, tmp_path, policy, requests):
    """10,000 requests over 8 prefixes with the default policy (2,000 written through: the same
    paths, a fifth of the CI time), one in seven aborted mid-flight, a host tier and a disk tier
    both smaller than the working set (issue #19's leak check): every request finishes or is
    aborted, and afterwards every GPU block is free and each tier's accounting matches its
    capacity and its contents."""
    llm = LLM(model, **ENGINE, max_num_seqs=4, max_num_batched_tokens=64, kv_offload_cpu_gib=gib(10, block_bytes),
              kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(30, block_bytes),
              kv_offload_write_policy=policy)
    engine = llm.engine
    rng = random.Random(1)
    prompts = workload(seed=3, num_prefixes=8, repeats=requests // 8, prefix_len=60)
    rng.shuffle(prompts)
    aborted, finished = 0, 0
    live: list[str] = []

    def step() -> None:
        nonlocal finished
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
                finished += 1

    for i, p in enumerate(prompts):
        live.append(engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
        if len(live) >= 4:
            step()
            if i % 7 == 0 and live:
                engine.abort_request(live.pop(0))
                aborted += 1
    while engine.has_unfinished_requests():
        step()
    assert len(prompts) == requests and finished + aborted == requests and not live
    stats = llm.get_stats().kv_offload
    assert aborted > requests // 10 and stats.hits > 0 and stats.loaded_bytes.get("disk", 0) > 0
    assert_idle_and_consistent(llm)
    connector = engine.core.connector
    # full but for a slot or so: a slot reserved for a background disk read is let go when a save
    # stored that block meanwhile (TieredConnector.staged), a hole until the next save (seen once
    # in five runs on 2 cores)
    assert connector.cpu.num_slots - 2 <= len(connector.cpu) <= connector.cpu.num_slots == 10
    assert len(connector.disk) == connector.disk.num_files == 30


def test_write_back_copies_nothing_while_every_prefix_fits(model, block_bytes):
    """The same requests on a GPU cache that holds them all: written through, every full block
    crosses to host memory; written back, none does, and the repeats are GPU prefix-cache hits."""
    prompts = workload(num_prefixes=4, order=[0, 1, 2, 3, 0, 1, 2, 3])
    saved = {}
    for policy in ("write-through", "write-back"):
        llm = LLM(model, **{**ENGINE, "num_kv_blocks": 64}, kv_offload_cpu_gib=gib(64, block_bytes),
                  kv_offload_write_policy=policy)
        run(llm, prompts)
        stats = llm.get_stats()
        saved[policy] = stats.kv_offload.saved_bytes.get("cpu", 0)
        assert stats.prefix_cache.hits >= 4 * 6 * BS
        assert_idle_and_consistent(llm)
    assert saved["write-through"] >= 4 * 6 * block_bytes and saved["write-back"] == 0


def test_write_back_spares_what_the_step_loads(model, block_bytes, reference):
    """A host tier of 7 blocks, fewer than a prefix and its neighbours evict in one step: the
    saves of a step that would reuse a slot its own loads read are skipped, never run over them
    (outputs still equal the engine without offload)."""
    llm = LLM(model, **ENGINE, kv_offload_cpu_gib=gib(7, block_bytes), kv_offload_write_policy="write-back")
    assert run(llm, workload(order=ORDER)) == reference
    stats = llm.get_stats().kv_offload
    assert stats.loaded_bytes.get("cpu", 0) > 0 and stats.saved_bytes.get("cpu", 0) > 0, stats
    assert_idle_and_consistent(llm)


@pytest.mark.parametrize(("opts", "message"), [
    (dict(kv_offload_write_policy="write-around"), "write-through"),
    (dict(kv_offload_cpu_gib=-1.0), "at least 0.0"),
    (dict(kv_offload_cpu_gib=float("nan")), "finite"),
    (dict(kv_offload_disk_gib=float("inf")), "finite"),
    (dict(kv_offload_disk_gib=-0.5), "at least 0.0"),
])
def test_hostile_sizes_are_refused(model, opts, message):
    with pytest.raises(ValueError, match=message):
        LLM(model, **ENGINE, **opts)


def test_unusable_disk_paths_fail_the_start(model, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(model, **ENGINE, kv_offload_disk_path=str(a_file), kv_offload_disk_gib=1.0)
    with pytest.raises(ValueError, match="not a writable directory"):
        LLM(model, **ENGINE, kv_offload_disk_path=str(a_file / "under"), kv_offload_disk_gib=1.0)
    with pytest.raises(ValueError, match="needs kv_offload_disk_gib"):
        LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "kv"))
    with pytest.raises(ValueError, match="needs kv_offload_disk_path"):
        LLM(model, **ENGINE, kv_offload_disk_gib=1.0)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(model, **ENGINE, kv_offload_cpu_gib=1e-9)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_disk_io_threads_run_on_the_core_kept_for_kv_transfer(model, block_bytes, tmp_path, monkeypatch):
    """The pinning plan keeps a core per NUMA node for KV-transfer threads (2 cores here are too
    few for the plan to keep one: the worker is told one): the disk tier's I/O threads run there."""
    from pagoda_daemon import topology

    kept = max(os.sched_getaffinity(0))
    real = topology.pin_this_process
    monkeypatch.setattr(topology, "pin_this_process", lambda *a, **k: dataclasses.replace(
        real(*a, **k), kv_transfer_cpu=kept))
    llm = LLM(model, **ENGINE, kv_offload_cpu_gib=gib(8, block_bytes), kv_offload_disk_path=str(tmp_path / "kv"),
              kv_offload_disk_gib=gib(8, block_bytes))
    assert llm.engine.core.worker_info.kv_transfer_cpu == kept
    io = llm.engine.core.executor.worker.offload._io
    assert {io.submit(os.sched_getaffinity, 0).result() == {kept} for _ in range(16)} == {True}
    assert run(llm, workload(num_prefixes=2, order=[0, 1, 0, 1]))  # and it serves


def test_warm_up_sends_no_offload_traffic(model, block_bytes, tmp_path):
    llm = LLM(model, **ENGINE, kv_offload_cpu_gib=gib(64, block_bytes),
              kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(64, block_bytes))
    connector = llm.engine.core.connector
    assert len(connector.cpu) == 0 and len(connector.disk) == 0
    assert not list(Path(tmp_path / "kv" / "rank0").iterdir())
    assert llm.engine.core.executor.worker.offload.transfer_seconds == 0.0


def test_blocks_taken_from_another_engines_tier_are_checked_by_header_then_by_load(model, block_bytes, tmp_path,
                                                                                   tiny_models):
    """A decode engine adopts a prefill engine's files by their headers (identity, block, size);
    a payload corrupted behind an intact header fails its load and the request is recomputed;
    another model's files are never adopted."""
    prompts = workload(num_prefixes=2, repeats=1)
    reference = run(LLM(model, **ENGINE), prompts)
    disk = dict(kv_offload_disk_gib=gib(64, block_bytes))
    prefill = LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "prefill"), **disk)
    run(prefill, prompts)
    saved = sorted((tmp_path / "prefill" / "rank0").glob(f"*{disk_tier.SUFFIX}"))
    assert len(saved) == 2 * 6
    for path in saved[::3]:
        corrupt(path)  # the payload's last bytes: the header still names the block
    decode = LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "decode"),
                 kv_offload_disk_source=str(tmp_path / "prefill"), **disk)
    assert run(decode, prompts) == reference
    stats = decode.get_stats().kv_offload
    # each corrupt source file failed once: not adopted again (without that, adopt, fail, recompute
    # and adopt again looped for ever)
    assert stats.hits > 0 and 0 < stats.failed_loads <= len(saved[::3]), stats
    assert_idle_and_consistent(decode)

    other = tiny_models["qwen3"]
    foreign = LLM(other, **ENGINE, kv_offload_disk_path=str(tmp_path / "foreign"),
                  kv_offload_disk_source=str(tmp_path / "prefill"), **disk)
    run(foreign, prompts)
    assert foreign.get_stats().kv_offload.hits == 0


@pytest.mark.parametrize("nbytes", ["8192", None, 1.5, True, -1])
def test_a_header_without_a_usable_size_is_not_adopted(tmp_path, nbytes):
    """check_header refuses (ValueError, which adoption turns into a miss) a header whose size is
    missing or not an integer, rather than raising something the engine does not catch."""
    import json
    import struct

    block_hash = b"\x07" * 32
    header = json.dumps({"identity": "me", "hash": block_hash.hex(), "nbytes": nbytes}).encode()
    path = tmp_path / disk_tier.file_name(block_hash)
    path.write_bytes(disk_tier.MAGIC + struct.pack("<I", len(header)) + header + b"\0" * 16)
    with pytest.raises(ValueError, match="truncated"):
        disk_tier.check_header(path, "me", block_hash)
