"""Host memory, then disk: the offload connector the engine builds from its options.

Lookups try host memory first, then disk. A disk hit is loaded straight into its GPU block and
promoted: saved to host memory after the step (it is read again soon, or it would not have
been asked for). Saves go to host memory; what host memory evicts is written to disk (unless
the disk already has it) and what the disk evicts is deleted. With only one tier configured,
saves go to it directly. The tiers are not exclusive: a block may be in both.

``TieredConnector`` is the scheduler half and ``TieredWorker`` the worker half (one per rank);
``build_connector`` / ``build_worker`` make them from the engine options.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.distributed.parallel_state import any_over_group
from pagoda_daemon.engine.block_hash import BlockHash
from pagoda_daemon.engine.block_pool import CPU as CPU_MEDIUM
from pagoda_daemon.engine.block_pool import DISK as DISK_MEDIUM
from pagoda_daemon.engine.scheduler_output import KVTransfer
from pagoda_daemon.kv_offload.connector import OffloadConnector, OffloadWorker, capacity_blocks
from pagoda_daemon.kv_offload.cpu import SAVE_STAGING_BYTES, CpuIndex, CpuStore, gather
from pagoda_daemon.kv_offload.disk import DiskIndex, DiskStore, identity
from pagoda_daemon.kv_offload.transfer_auth import FROM_REQUEST, check_url, is_remote, transfer_key
from pagoda_daemon.topology.pinning import pin_thread

if TYPE_CHECKING:
    from pagoda_daemon.kv_offload.transfer import BlockServer, RemoteBlocks

log = logging.getLogger(__name__)

DISK_IO_THREADS = 8
# A step may load host-memory blocks for its own requests beside its forward pass (each layer's
# attention waits for its layers' copies), up to STEP_LOAD_BYTES a rank; past that, a request is
# prefetched beside the step and computes from the next. The host tier can keep each slot's
# layers in LOAD_LAYER_GROUPS tensors, so that such a load crosses a group at a time and the
# step waits for its first group only. Measured on an H200 (Llama-3-8B shape, multi-turn,
# docs/benchmarks/2026-11-29-kv-offload-layer-groups-h200.md): with 256 MiB a step and 2 groups
# the median TTFT fell 8-12% against prefetching everything, but p90 and p99 rose (by up to 21%
# and 46%) and the copies' issuing time grew with the groups (1.4 s a run with 1, 2.2-2.5 with
# 2, 3.8 with 4, 7.2 with 8); so every host-memory hit is prefetched, a slot in one piece.
LOAD_LAYER_GROUPS = 1
STEP_LOAD_BYTES = 0
# Disk loads are read into pinned host slots (this many bytes of them, at least one block) and
# cross PCIe a window at a time in a few copies. Read into a new tensor each and copied one block
# at a time, 128 files of 1.84 MB took about 250 ms on an H200 host (2026-11-28): page faults on
# every fresh buffer, copies under the GIL, and synchronous copies from pageable memory.
DISK_STAGING_BYTES = 64 * 2**20
SAVE_COPY_BLOCKS = 64  # blocks a disk save stages on the device at a time (64 Llama-3-8B blocks: 128 MiB)
CPU, DISK = "cpu", "disk"  # the tiers' names in the stats (the metrics' `medium` label upper-cases them)
# Prefill/decode between hosts (transfer.py): fetches from the prefill instance at once, each in a
# thread; requests beyond them wait for a thread. Their files land in a folder of their own under
# INCOMING, then are adopted into the disk tier by the scheduler's thread.
FETCH_THREADS = 4
INCOMING = ".incoming"
MAX_ANSWERED = 4096  # requests whose fetch (or disk staging) is done, remembered so that they do not ask again
# Disk hits are read into host memory in the background while the requests that need them wait
# (TieredConnector.staging), with at most this share of the host tier's slots reserved for reads
# under way; past it, or for a request whose blocks were staged once already (evicted again
# meanwhile), a disk hit is read before the forward pass of the step that needs it.
MAX_STAGING_SHARE = 0.5
MAX_SOURCES = 64  # prefill instances whose sockets' settings are kept (a request may name any)
# Disk writes run beside the steps, each from a host copy of its block: demotes (blocks host
# memory evicts, from a copy of the slot) and the saves of a disk tier alone (from a copy off the
# GPU). At most this many bytes of copies wait for the I/O threads, beyond which the engine's
# thread waits for the oldest write (a disk slower than the evictions holds the steps back rather
# than the host's memory growing without bound).
MAX_WRITE_BYTES = 256 * 2**20


def enabled(config: EngineConfig) -> bool:
    return config.kv_offload_cpu_gib > 0 or config.kv_offload_disk_path is not None


def device_staging_bytes(config: EngineConfig, block_bytes: int) -> int:
    """What the copies may hold on the device beside the KV cache: the saves crossing to host
    memory and a disk save's staging buffer (the worker sizes the cache without it). Loads hold
    nothing there: a kernel reads the pinned slots straight into the cache (CpuStore)."""
    if not enabled(config):
        return 0
    return (SAVE_STAGING_BYTES if config.kv_offload_host_gib > 0 else 0) + SAVE_COPY_BLOCKS * block_bytes


def check_options(config: EngineConfig) -> None:
    """Refuse offload options that cannot work, before the engine starts anything: a clear
    message beats an engine that half works."""
    path, disk_gib = config.kv_offload_disk_path, config.kv_offload_disk_gib
    _check_source(config)
    if config.kv_transfer_port:
        if path is None:
            raise ValueError("kv_transfer_port needs kv_offload_disk_path (the disk tier's blocks are what it serves)")
        transfer_key()
    if disk_gib > 0 and path is None:
        raise ValueError("kv_offload_disk_gib needs kv_offload_disk_path (the directory for the blocks)")
    if path is None:
        return
    if disk_gib <= 0:
        raise ValueError("kv_offload_disk_path needs kv_offload_disk_gib (the disk space the blocks may take)")
    if config.nnodes > 1 or (config.world_size > 1 and torch.distributed.is_initialized()):
        # the engine core checks and indexes every rank's files: they must be on its node, and
        # only one engine core (not one per rank, as under an external launcher) may manage them
        raise ValueError("kv_offload_disk_path: the disk tier needs every rank on one node, started by the engine "
                         "(nnodes 1, no external launcher)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"kv_offload_disk_path {path!r} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        raise ValueError(f"kv_offload_disk_path {path!r} is not a writable directory: {e}") from e


def _check_source(config: EngineConfig) -> None:
    """A transfer source is another engine's disk tier on this engine's filesystem, or another
    host's transfer port."""
    source, path = config.kv_offload_disk_source, config.kv_offload_disk_path
    if source is None:
        return
    if path is None:
        raise ValueError("kv_offload_disk_source needs kv_offload_disk_path (the blocks are linked into it)")
    if is_remote(source):
        if source != FROM_REQUEST:
            check_url(source)
        transfer_key()
        return
    if not os.path.isdir(source):
        raise ValueError(f"kv_offload_disk_source {source!r} is not a directory")
    if os.path.realpath(source) == os.path.realpath(path):
        raise ValueError("kv_offload_disk_source must be another engine's directory, not kv_offload_disk_path")
    os.makedirs(path, exist_ok=True)
    if os.stat(source).st_dev != os.stat(path).st_dev:
        raise ValueError(f"kv_offload_disk_source {source!r} and kv_offload_disk_path {path!r} are on different "
                         "filesystems: blocks are hard-linked from one to the other")


def _identities(config: EngineConfig, dtype: str, block_bytes: int) -> list[str]:
    return [identity(config.model, config.load_format, config.seed, dtype, config.block_size, block_bytes, r,
                     config.world_size) for r in range(config.world_size)]


def _capacities(config: EngineConfig, block_bytes: int) -> tuple[int, int]:
    """Host slots (the host tier's, or with the disk alone those its reads land in) and disk files."""
    cpu = capacity_blocks(config.kv_offload_host_gib, block_bytes, config.world_size)
    disk = (capacity_blocks(config.kv_offload_disk_gib, block_bytes, config.world_size)
            if config.kv_offload_disk_path is not None else 0)
    for name, gib, blocks in (("kv_offload_cpu_gib", config.kv_offload_cpu_gib, cpu),
                              ("kv_offload_disk_gib", config.kv_offload_disk_gib, disk)):
        if gib > 0 and blocks == 0:
            raise ValueError(f"{name} {gib} holds no KV block ({block_bytes * config.world_size} bytes a block "
                             f"over {config.world_size} rank(s))")
    return cpu, disk


class TieredConnector(OffloadConnector):
    def __init__(self, config: EngineConfig, dtype: str, block_bytes: int, transfer_cpu: int | None = None) -> None:
        """``dtype`` and ``block_bytes``: one rank's KV cache (every rank's is the same).
        ``transfer_cpu``: the core the pinning plan keeps for KV-transfer threads, where the
        transfer server's and the fetches' threads run."""
        super().__init__(record_events=config.enable_kv_events)
        cpu_blocks, disk_blocks = _capacities(config, block_bytes)
        self.bytes_per_block = block_bytes * config.world_size  # over every rank
        # Host slots: the host tier, or with the disk tier alone slots that only its reads fill
        # (staging): those are found by lookups as the host tier's are, but no save goes there.
        self.cpu = CpuIndex(cpu_blocks) if cpu_blocks else None
        self.host_tier = config.kv_offload_cpu_gib > 0
        source = config.kv_offload_disk_source
        self.disk = (DiskIndex(config.kv_offload_disk_path, disk_blocks, _identities(config, dtype, block_bytes),
                               source=None if is_remote(source) else source)
                     if disk_blocks and config.kv_offload_disk_path is not None else None)
        self.server: BlockServer | None = None
        if config.kv_transfer_port and config.kv_offload_disk_path is not None:
            from pagoda_daemon.kv_offload.transfer import BlockServer  # ZMQ only where blocks cross hosts

            self.server = BlockServer(config.kv_offload_disk_path, config.kv_transfer_port, transfer_key(),
                                      cpu=transfer_cpu)
        # Fetching from other hosts: from one source, or from the one each request names
        self.fetches = is_remote(source) and self.disk is not None
        self._default_source = None if source == FROM_REQUEST or not self.fetches else source
        self._remotes: OrderedDict[str, RemoteBlocks] = OrderedDict()
        self._ranks, self._block_bytes = config.world_size, block_bytes
        if self.fetches:
            assert self.disk is not None
            import zmq

            self._key = transfer_key()
            self._context = zmq.Context()  # every source's sockets; terminated by close()
            self._incoming = Path(self.disk.root, INCOMING)
            shutil.rmtree(self._incoming, ignore_errors=True)  # what a run that crashed was still fetching
            self._fetch_threads = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="pagoda-kv-fetch",
                                                     initializer=pin_thread, initargs=(transfer_cpu,))
            from pagoda_daemon.kv_offload.transfer import FILE_THREADS

            self._fetch_writers = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="pagoda-kv-fetch-write",
                                                     initializer=pin_thread, initargs=(transfer_cpu,))
        # fetches under way, by source and the last hash each asks for (it names the whole chain
        # before it), with the requests waiting for each
        self._fetches: dict[tuple[str, BlockHash], tuple[Path, Future[list[BlockHash]], set[str]]] = {}
        self._answered: OrderedDict[str, None] = OrderedDict()  # request ids
        self._fetch_numbers = itertools.count()
        self._saves: list[KVTransfer] = []
        self._promotions: list[tuple[BlockHash, int]] = []
        # Disk blocks on their way into host memory: hash -> the host slot reserved for it
        self._staging: dict[BlockHash, int] = {}
        self._stages: list[KVTransfer] = []  # planned this step
        self._staged_for: OrderedDict[str, None] = OrderedDict()  # requests that waited for staging once
        # Write-back applies to host memory: a disk tier alone is written as blocks are computed
        # (its files are what other instances and a restarted engine read).
        self.write_back = config.kv_offload_write_policy == "write-back" and self.host_tier
        self._step_reads: set[BlockHash] = set()  # what this step's loads read (write-back spares it)
        self.step_load_blocks = STEP_LOAD_BYTES // block_bytes if self.cpu is not None else 0
        if self.disk is not None:
            for block_hash in self.disk.files:  # what an earlier run left on disk is there to be found
                self.stored(block_hash, DISK_MEDIUM)
        log.info("KV offload: %s", ", ".join(
            f"{name} {n} blocks ({n * self.bytes_per_block / 2**30:.2f} GiB)"
            for name, n in ((CPU if self.host_tier else "disk reads in host memory", cpu_blocks), (DISK, disk_blocks))
            if n))

    def _where(self, block_hash: BlockHash) -> str | None:
        if self.cpu is not None and block_hash in self.cpu:
            return CPU
        if self.disk is not None:
            indexed = block_hash in self.disk.files
            if self.disk.has(block_hash):
                return DISK
            if self.disk.adopt(block_hash):  # another engine's block (prefill/decode disaggregation)
                self.stored(block_hash, DISK_MEDIUM)
                return DISK
            if indexed:  # a file from an earlier run failed its check: deleted
                self.removed(block_hash, DISK_MEDIUM)
        return None

    def _found(self, block_hash: BlockHash) -> str | None:
        """Where a block this step's lookup found is: looked for, checked or adopted then, so
        without touching the disk again."""
        if self.cpu is not None and block_hash in self.cpu:
            return CPU
        if self.disk is not None and self.disk.contains(block_hash):
            return DISK
        return None

    def lookup(self, block_hashes: list[BlockHash]) -> int:
        self._collect()
        n = 0
        for block_hash in block_hashes:
            if self._where(block_hash) is None:
                break
            n += 1
        return n

    def arriving(self, block_hashes: list[BlockHash], source: str | None = None, request_id: str = "") -> bool:
        """With a remote source (the request's, else the configured one): start fetching these
        blocks (those after the local hits) unless a fetch for them is under way; True while it
        runs. A request waits for at most one fetch: once it is done, whatever arrived is found by
        the lookup and the rest is computed (a later request for the same prompt fetches again)."""
        source = source or self._default_source
        if not self.fetches or source is None or not block_hashes or request_id in self._answered:
            return False
        key = (source, block_hashes[-1])
        under_way = self._fetches.get(key)
        if under_way is not None:
            under_way[2].add(request_id)
            return True
        if len(self._fetches) < FETCH_THREADS:
            folder = self._incoming / str(next(self._fetch_numbers))
            fetch = self._remote(source).fetch
            self._fetches[key] = (folder, self._fetch_threads.submit(fetch, list(block_hashes), folder), {request_id})
        return True  # fetching, or waiting for a thread to fetch with

    def _remote(self, source: str) -> RemoteBlocks:
        remote = self._remotes.get(source)
        if remote is None:
            from pagoda_daemon.kv_offload.transfer import RemoteBlocks

            remote = self._remotes[source] = RemoteBlocks(source, self._key, self._ranks, self._block_bytes,
                                                          context=self._context, writers=self._fetch_writers)
            if len(self._remotes) > MAX_SOURCES:
                self._remotes.popitem(last=False)  # a fetch still using it keeps its own reference
        self._remotes.move_to_end(source)
        return remote

    def _collect(self) -> None:
        """Adopt the blocks of every fetch that has finished into the disk tier (in order, up to
        the first that fails its header check), then delete its folder."""
        for key, (folder, fetch, waiting) in list(self._fetches.items()):
            if not fetch.done():
                continue
            del self._fetches[key]
            assert self.disk is not None
            for block_hash in fetch.result():  # RemoteBlocks.fetch never raises
                if block_hash in self.disk.files:
                    continue
                if not self.disk.adopt(block_hash, source=str(folder)):
                    break
                self.stored(block_hash, DISK_MEDIUM)
                self.stats.fetched_bytes += self.bytes_per_block
            shutil.rmtree(folder, ignore_errors=True)
            for request_id in waiting:
                self._answered[request_id] = None
            while len(self._answered) > MAX_ANSWERED:
                self._answered.popitem(last=False)

    def staging(self, block_hashes: list[BlockHash], request_id: str = "") -> bool:
        """Disk hits come back through host memory: each is read into a reserved host slot in
        the background (``stage_disk``, run by the workers after the step's saves) and the request
        waits until every rank has read them; its next lookup finds them in host memory, loaded
        beside a step. So a step never waits for a file (nor for a read that may fail: a bad file
        only frees its slot and the request computes those tokens). The request's host-memory
        hits are touched first, so that the reservations evict other blocks."""
        if self.cpu is None or self.disk is None:
            return False
        need = [h for h in block_hashes if h not in self.cpu and h not in self._staging]
        if not need:
            return any(h in self._staging for h in block_hashes)
        if request_id in self._staged_for or len(self._staging) + len(need) > MAX_STAGING_SHARE * self.cpu.num_slots:
            return False  # staged once already and evicted again since, or too much under way
        hits = {h for h in block_hashes if h in self.cpu}
        for block_hash in hits:
            self.cpu.touch(block_hash)
        evicts = self.cpu.next_evicted_n(len(need))
        if (any(h in self._step_reads or h in hits for h in evicts) or 2 * len(need) > self.disk.num_files):
            # it would evict what this step loads or this request's own hits, or the blocks it
            # demotes could push the files it reads off the disk
            return False
        for block_hash in need:  # the newest on disk: the demotes below evict older files first
            self.disk.touch(block_hash)
        for block_hash in need:
            slot, evicted = self.cpu.reserve()
            if evicted is not None:
                self._evict_host_block(evicted, frozenset(need))
            self._staging[block_hash] = slot
            self._stages.append(KVTransfer("stage_disk", block_hash, -1, slot))
        self._staged_for[request_id] = None
        while len(self._staged_for) > MAX_ANSWERED:
            self._staged_for.popitem(last=False)
        return True

    def take_stages(self) -> list[KVTransfer]:
        stages, self._stages = self._stages, []
        return stages

    def staged(self, results: list[tuple[BlockHash, bool]]) -> None:
        for block_hash, ok in results:
            slot = self._staging.pop(block_hash)
            assert self.cpu is not None and self.disk is not None
            if ok and block_hash not in self.cpu:  # (a save may have put it there meanwhile)
                self.cpu.fill(block_hash, slot)
                self.stored(block_hash, CPU_MEDIUM)
                self._count(self.stats.loaded_bytes, DISK)
                continue
            self.cpu.release(slot)
            if not ok:  # the file changed since its lookup
                self.stats.failed_loads += 1
                if self.disk.forget(block_hash):
                    self.removed(block_hash, DISK_MEDIUM)

    def can_prefetch(self, block_hashes: list[BlockHash]) -> bool:
        return self.cpu is not None and all(block_hash in self.cpu for block_hash in block_hashes)

    def plan_loads(self, block_hashes: list[BlockHash], gpu_block_ids: list[int]) -> list[KVTransfer]:
        loads = []
        for block_hash, gpu_block in zip(block_hashes, gpu_block_ids, strict=True):
            where = self._found(block_hash)
            self._step_reads.add(block_hash)
            if where == CPU:
                assert self.cpu is not None
                loads.append(KVTransfer("load_cpu", block_hash, gpu_block, self.cpu.touch(block_hash)))
            elif where == DISK:
                assert self.disk is not None
                self.disk.touch(block_hash)
                loads.append(KVTransfer("load_disk", block_hash, gpu_block))
                # promoted to host memory after the step; planned with the saves, once every
                # lookup of the step is done (its evictions must not change what they found).
                # Written back, it reaches host memory when the GPU cache evicts it.
                if not self.write_back:
                    self._promotions.append((block_hash, gpu_block))
            else:
                raise RuntimeError("plan_loads for a block no tier holds (lookup first)")
            self._count(self.stats.loaded_bytes, where)
        return loads

    def plan_save(self, block_hash: BlockHash, gpu_block_id: int) -> None:
        self._save(block_hash, gpu_block_id, frozenset())

    def plan_evicted(self, evicted: list[tuple[BlockHash, int]]) -> list[KVTransfer]:
        """Host memory gets the blocks the GPU cache hands out again, before this step's loads
        run, so their copies must not take a host slot or a disk file those loads read: a save
        that would is skipped (the block is lost to the tiers). The step's loads touched what
        they read, so only a tier smaller than one step's traffic gets there."""
        assert self.write_back  # (self._saves may hold the demotes of this step's staging: run first)
        for block_hash, gpu_block in evicted:
            self._save(block_hash, gpu_block, self._step_reads)
        saves, self._saves = self._saves, []
        return saves

    def _save(self, block_hash: BlockHash, gpu_block_id: int, spare: set[BlockHash] | frozenset[BlockHash]) -> None:
        """Plan the copies that keep a GPU block, evicting no tier entry in ``spare``."""
        if self.cpu is not None and self.host_tier:
            if block_hash in self.cpu or self.cpu.next_evicted() in spare:
                return
            slot, evicted = self.cpu.insert(block_hash)
            if evicted is not None:
                self._evict_host_block(evicted, spare)
            self._saves.append(KVTransfer("save_cpu", block_hash, gpu_block_id, slot))
            self.stored(block_hash, CPU_MEDIUM)
            self._count(self.stats.saved_bytes, CPU)
        elif self.disk is not None and not self.disk.contains(block_hash):
            self._disk_insert(block_hash, pending=True)  # (the worker writes it beside the steps)
            self._saves.append(KVTransfer("save_disk", block_hash, gpu_block_id))

    def _evict_host_block(self, evicted: tuple[BlockHash, int], spare: set[BlockHash] | frozenset[BlockHash]) -> None:
        """A block host memory let go of goes to disk (a ``demote``, before its slot is written
        again) unless the disk has it, or writing it would evict a block in ``spare``."""
        self.removed(evicted[0], CPU_MEDIUM)
        if self.disk is not None and not self.disk.contains(evicted[0]) and self.disk.next_evicted() not in spare:
            self._disk_insert(evicted[0], pending=True)  # (the worker writes it beside the steps)
            self._saves.append(KVTransfer("demote", evicted[0], -1, evicted[1]))

    def _disk_insert(self, block_hash: BlockHash, pending: bool = False) -> None:
        assert self.disk is not None
        rewritten = block_hash in self.disk.files  # over an unchecked file of an earlier run: announced
        for old in self.disk.insert(block_hash, pending):
            self._saves.append(KVTransfer("drop", old))
            self.removed(old, DISK_MEDIUM)
        if not rewritten:
            self.stored(block_hash, DISK_MEDIUM)
        self._count(self.stats.saved_bytes, DISK)

    def forget(self, transfers: list[KVTransfer]) -> None:
        for t in transfers:
            if t.kind in ("load_cpu", "save_cpu") and self.cpu is not None and self.cpu.remove(t.block_hash):
                self.removed(t.block_hash, CPU_MEDIUM)
            elif t.kind in ("load_disk", "save_disk") and self.disk is not None and self.disk.forget(t.block_hash):
                self.removed(t.block_hash, DISK_MEDIUM)

    def _count(self, counter: dict[str, int], tier: str) -> None:
        counter[tier] = counter.get(tier, 0) + self.bytes_per_block

    def take_saves(self) -> list[KVTransfer]:
        self._collect()  # also the fetches of requests aborted meanwhile: their folders go
        promotions, self._promotions = self._promotions, []
        for block_hash, gpu_block in promotions:
            self.plan_save(block_hash, gpu_block)
        if self.disk is not None:  # blocks adopted by this step's lookups may have overfilled it
            for old in self.disk.shrink():
                self._saves.append(KVTransfer("drop", old))
                self.removed(old, DISK_MEDIUM)
        saves, self._saves = self._saves, []
        self._step_reads.clear()
        return saves

    def check(self) -> None:
        if self.cpu is not None:
            self.cpu.check()
            assert set(self._staging.values()) == self.cpu.reserved, "a host slot reserved for no read under way"
        if self.disk is not None:
            self.disk.check()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.fetches:
            self._fetch_threads.shutdown(wait=False, cancel_futures=True)
            self._context.term()  # the fetches running end now, not after their timeout
            self._fetch_threads.shutdown(wait=True)
            self._fetch_writers.shutdown(wait=True)
            shutil.rmtree(self._incoming, ignore_errors=True)


class TieredWorker(OffloadWorker):
    def __init__(self, config: EngineConfig, rank: int, kv_cache: torch.Tensor, block_bytes: int,
                 transfer_cpu: int | None = None, group=None) -> None:
        """``block_bytes``: the rank's KV block size as the scheduler half was told it
        (Worker.kv_block_bytes), so both halves size the tiers and name the engine alike.
        ``transfer_cpu``: the core the pinning plan keeps for KV-transfer threads on this rank's
        NUMA node, where its disk I/O threads run (beside, not among, the cores its steps use).
        ``group``: a gloo group over the engine's ranks (None with one rank), over which the
        background reads into host memory agree that every rank has finished them."""
        super().__init__()
        layers, two, _, block_size, heads, head_dim = kv_cache.shape
        shape = (layers, two, block_size, heads, head_dim)
        cpu_blocks, disk_blocks = _capacities(config, block_bytes)
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        self.cpu = (CpuStore(cpu_blocks, shape, kv_cache.dtype, kv_cache.device, groups=LOAD_LAYER_GROUPS,
                             touch=config.kv_offload_cpu_gib > 0)
                    if cpu_blocks else None)
        self.disk = (DiskStore(config.kv_offload_disk_path, rank, _identities(config, dtype, block_bytes)[rank], shape,
                               kv_cache.dtype)
                     if disk_blocks and config.kv_offload_disk_path is not None else None)
        # Disk reads and writes run here, several at once (file I/O and the CRC release the GIL):
        # one at a time on the engine's thread, a step waited for each file in turn.
        self._io = (ThreadPoolExecutor(DISK_IO_THREADS, thread_name_prefix="pagoda-kv-disk", initializer=pin_thread,
                                       initargs=(transfer_cpu,)) if self.disk else None)
        # Disk blocks read into host memory in the background (stage): one thread takes each
        # step's batch in order, reads its files in threads of its own (the step's disk I/O does
        # not queue behind them) and, with several ranks, agrees with the others that every rank
        # has read them (the same batches in the same order on every rank); then take_staged
        # reports them.
        both = self.cpu is not None and self.disk is not None
        self._stager = (ThreadPoolExecutor(1, thread_name_prefix="pagoda-kv-stage", initializer=pin_thread,
                                           initargs=(transfer_cpu,)) if both else None)
        self._stage_io = (ThreadPoolExecutor(DISK_IO_THREADS, thread_name_prefix="pagoda-kv-stage-read",
                                             initializer=pin_thread, initargs=(transfer_cpu,)) if both else None)
        self._stage_group = group
        # Writes under way beside the steps (demotes, disk saves), oldest first (the staging thread
        # reads it: a lock): a read, rewrite or drop of one of these files waits for its write
        # (_await_write). The step's own saves are also listed for its outputs to wait for
        # (take_step_writes): a prefill instance's answer promises its files.
        self._writes: OrderedDict[BlockHash, Future[None]] = OrderedDict()
        self._writes_lock = threading.Lock()
        self._max_writes = max(1, MAX_WRITE_BYTES // block_bytes)
        self._step_writes: list[Future[None]] = []
        # the copies of disk saves off the GPU, beside the steps (none on a CPU: a gather is a copy)
        self._off_device = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda and self.disk else None
        self._staged: deque[tuple[bytes, bool]] = deque()
        self._stage_error: BaseException | None = None  # the staging thread's (take_staged raises it)
        self._staging: CpuStore | None = None  # made at the first disk load: engines that never load pay nothing
        self._staging_read: torch.cuda.Event | None = None  # recorded after the copies out of the slots
        # Host-memory loads run on a stream of their own, beside the step's forward pass: a step's
        # own loads a layer group at a time, each layer's attention waiting for its group's event;
        # prefetches (for the next step) whole, the next step's stream waiting for the last one's.
        on_gpu = self.cpu is not None and self.cpu.on_gpu
        self._loads = torch.cuda.Stream(kv_cache.device) if on_gpu else None
        self._prefetched: torch.cuda.Event | None = None
        self._layer_ready: dict[int, torch.cuda.Event] = {}  # layer -> its group's copies done

    def _disk_staging(self, kv_cache: torch.Tensor) -> CpuStore:
        if self._staging is None:
            block = kv_cache[:, :, 0]  # one block's slot: every layer, K and V
            slots = max(1, DISK_STAGING_BYTES // (block.numel() * block.element_size()))
            self._staging = CpuStore(slots, tuple(block.shape), kv_cache.dtype, kv_cache.device)
        return self._staging

    def _load_from_disk(self, loads: list[tuple[int, KVTransfer]], kv_cache: torch.Tensor, failed: list[bool]) -> None:
        """The disk loads ``(index, transfer)``, a window of staging slots at a time: the files
        read in the I/O threads straight into the slots, then one batched copy to the GPU blocks
        (on the step's stream), which must have run before reads fill the slots again (the next
        window's, or the next step's)."""
        disk, io = self.disk, self._io
        assert disk is not None and io is not None
        staging = self._disk_staging(kv_cache)
        window = staging.num_slots
        for first in range(0, len(loads), window):
            chunk = loads[first : first + window]
            if self._staging_read is not None:
                self._staging_read.synchronize()
                self._staging_read = None
            for _, t in chunk:
                self._await_write(t.block_hash)
            reads = [io.submit(disk.read, t.block_hash, staging.slot(k)) for k, (_, t) in enumerate(chunk)]
            slots, blocks = [], []
            for k, ((i, t), read) in enumerate(zip(chunk, reads, strict=True)):
                try:
                    read.result()
                except RuntimeError as e:  # the file changed since the lookup: the block is recomputed
                    log.warning("%s: its requests are recomputed", e)
                    kv_cache[:, :, t.gpu_block].zero_()  # the step runs over it: finite values, never stale ones
                    failed[i] = True
                    continue
                slots.append(k)
                blocks.append(t.gpu_block)
            if slots:
                staging.load(slots, kv_cache, blocks)
                if staging.on_gpu:
                    self._staging_read = torch.cuda.Event()
                    self._staging_read.record()

    def stage(self, transfers: list[KVTransfer], kv_cache: torch.Tensor) -> None:
        """The files are read into their host slots once every copy issued so far that touches
        host memory has run (a load may still read a slot's previous block, a save still write
        it): the thread waits for the streams' events recorded here, never the engine's thread."""
        assert self.cpu is not None and self._stager is not None and all(t.kind == "stage_disk" for t in transfers)
        issued = []
        if self.cpu.on_gpu:
            for stream in (torch.cuda.current_stream(), self._loads, self.cpu.saves):
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                    issued.append(event)
        issued += [e for e in map(self.cpu.take_save_event, [t.slot for t in transfers]) if e is not None]
        self._stager.submit(self._stage_batch, list(transfers), issued).add_done_callback(self._stage_done)

    def _stage_done(self, batch: Future[None]) -> None:
        if batch.exception() is not None and self._stage_error is None:
            self._stage_error = batch.exception()

    def _stage_batch(self, transfers: list[KVTransfer], issued: list[torch.cuda.Event]) -> None:
        assert self.cpu is not None and self.disk is not None and self._stage_io is not None
        for event in issued:
            event.synchronize()
        cpu, disk = self.cpu, self.disk

        def read(t: KVTransfer) -> bool:
            self._await_write(t.block_hash)
            try:
                if len(cpu.data) == 1:
                    disk.read(t.block_hash, cpu.slot(t.slot))
                else:
                    cpu.write(t.slot, disk.read(t.block_hash))
                return False
            except RuntimeError as e:  # the file changed since the lookup: those tokens are computed
                log.warning("%s: its requests compute those tokens", e)
                return True

        failed = list(self._stage_io.map(read, transfers))
        if self._stage_group is not None:  # done everywhere once every rank is here; failed if on any
            failed = any_over_group(failed, self._stage_group)
        self._staged.extend((t.block_hash, not bad) for t, bad in zip(transfers, failed, strict=True))

    def take_staged(self) -> list[tuple[bytes, bool]]:
        """Raises what failed the staging thread (another rank gone, a device error): its blocks
        would never be reported, and their requests would wait for ever."""
        if self._stage_error is not None:
            raise RuntimeError(f"KV offload: reading disk blocks into host memory failed: {self._stage_error}") \
                from self._stage_error
        done = []
        while self._staged:
            done.append(self._staged.popleft())
        return done

    def _demote(self, block_hash: BlockHash, slot: int) -> None:
        """Write a host slot's block to disk beside the steps, from a copy of the slot (a later
        save may reuse it while the write runs)."""
        assert self.cpu is not None
        self._write_beside(block_hash, self.cpu.block(slot))

    def _write_beside(self, block_hash: BlockHash, block: torch.Tensor,
                      copied: torch.cuda.Event | None = None) -> Future[None]:
        """Write a block's file in the I/O threads, from ``block`` (a host copy, complete once
        ``copied`` has happened); the step waits only when more than ``MAX_WRITE_BYTES`` of
        copies are waiting to be written."""
        assert self.disk is not None and self._io is not None
        self._await_write(block_hash)  # the same file being written still (its temp file is one)
        future = self._io.submit(self._write_copied, block_hash, block, copied)
        with self._writes_lock:
            self._writes[block_hash] = future
        future.add_done_callback(lambda done: self._written(block_hash, done))
        while True:  # the oldest stays listed while waited for: a read of it still waits too
            with self._writes_lock:
                if len(self._writes) <= self._max_writes:
                    return future
                oldest_hash, oldest = next(iter(self._writes.items()))
            wait([oldest])
            self._written(oldest_hash, oldest)

    def _write_copied(self, block_hash: BlockHash, block: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        assert self.disk is not None
        if copied is not None:
            copied.synchronize()
        self.disk.write(block_hash, block)

    def _copy_off_device(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``blocks`` (gathered on the step's stream) copied to pinned host memory on a stream of
        the saves' own, and the event after the copy: the engine's thread does not wait for the
        step's forward pass (with the disk tier alone, most steps save a block)."""
        if self._off_device is None:
            return blocks, None
        host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        self._off_device.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._off_device):
            host.copy_(blocks, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        blocks.record_stream(self._off_device)  # the allocator keeps it until the copy has run
        return host, copied

    def take_step_writes(self) -> list[Future[None]]:
        writes, self._step_writes = self._step_writes, []
        return writes

    def _written(self, block_hash: BlockHash, done: Future[None]) -> None:
        with self._writes_lock:
            if self._writes.get(block_hash) is not done:
                return  # (removed by the thread that waited for it)
            del self._writes[block_hash]
        error = None if done.cancelled() else done.exception()
        if error is not None:  # DiskStore.write warns of I/O errors itself: this is anything else
            log.error("KV offload: writing block %s to disk failed (%r): it will be recomputed", block_hash.hex(),
                      error)

    def _await_write(self, block_hash: BlockHash) -> None:
        """Wait until the block's write beside the steps (a demote or a save), if one is under way,
        has written (or failed to write) its file."""
        with self._writes_lock:
            pending = self._writes.get(block_hash)
        if pending is not None:
            wait([pending])  # one that failed left no file: the read finds none (_written says why)

    def flush(self) -> None:
        """Every write beside the steps done: the next engine on this directory (a restart) finds the files."""
        with self._writes_lock:
            pending = list(self._writes.values())
        wait(pending)

    def prefetch(self, transfers: list[KVTransfer], kv_cache: torch.Tensor) -> None:
        """The copies start after everything the step's stream holds so far (earlier steps, which
        may still use these blocks' previous contents, and this step's write-back saves, which
        read blocks these loads overwrite) and run beside what follows: this step's forward pass
        reads none of these blocks."""
        assert self.cpu is not None and all(t.kind == "load_cpu" for t in transfers)
        started = time.perf_counter()
        slots, blocks = [t.slot for t in transfers], [t.gpu_block for t in transfers]
        if self._loads is None:  # on the CPU a copy is done when it returns
            self.cpu.load(slots, kv_cache, blocks)
        else:
            self._loads.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._loads):  # its staging buffers are this stream's too
                self.cpu.load(slots, kv_cache, blocks)
                self._prefetched = torch.cuda.Event()
                self._prefetched.record()
        self.transfer_seconds += time.perf_counter() - started

    def await_prefetches(self) -> None:
        if self._prefetched is not None:
            torch.cuda.current_stream().wait_event(self._prefetched)
            self._prefetched = None

    def _load_beside_forward(self, slots: list[int], kv_cache: torch.Tensor, blocks: list[int]) -> None:
        """A step's own host-memory loads: issued after everything the step's stream holds so far
        (earlier steps, this step's write-back saves) on the load stream, a layer group at a time,
        so that the forward pass's first layers compute while the later groups still cross."""
        assert self.cpu is not None and self._loads is not None
        self._loads.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._loads):
            for first, end in self.cpu.load_by_layer_group(slots, kv_cache, blocks):
                ready = torch.cuda.Event()
                ready.record()
                self._layer_ready.update(dict.fromkeys(range(first, end), ready))

    def wait_for_layer(self, layer: int) -> None:
        ready = self._layer_ready.pop(layer, None)
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)

    def await_layer_loads(self) -> None:
        for layer in list(self._layer_ready):
            self.wait_for_layer(layer)

    def run(self, transfers: list[KVTransfer], kv_cache: torch.Tensor) -> list[bool]:
        """Host-memory copies in list order (batched; on a GPU, loads a layer group at a time on
        the load stream, which the step's layers wait for, wait_for_layer, and saves beside the
        step: CpuStore); disk reads (into pinned slots, then batched to the GPU after the
        host-memory copies: loads fill distinct fresh blocks), finished before this returns; disk
        writes beside the following steps (_write_beside): host memory's evicted blocks (demotes)
        and the saves of a disk tier alone. The disk blocks a step saves come off the GPU in a few
        copies (not one per block) on a stream of their own once the step has run; the step's
        outputs wait for their files (take_step_writes: a prefill instance's answer promises them)."""
        started = time.perf_counter()
        failed = [False] * len(transfers)
        disk = self.disk
        from_gpu: dict[BlockHash, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        if disk is not None:
            saves = [t for t in transfers if t.kind == "save_disk"]
            for first in range(0, len(saves), SAVE_COPY_BLOCKS):  # a bounded staging buffer on the device
                chunk = saves[first : first + SAVE_COPY_BLOCKS]
                blocks, copied = self._copy_off_device(gather(kv_cache, [t.gpu_block for t in chunk]))
                from_gpu.update((t.block_hash, (blocks[j], copied)) for j, t in enumerate(chunk))
        # consecutive host-memory loads (or saves) go as one batch: a few copies, not one per block
        batch: list[KVTransfer] = []
        disk_loads: list[tuple[int, KVTransfer]] = []

        def flush() -> None:
            if batch:
                assert self.cpu is not None
                slots, blocks = [b.slot for b in batch], [b.gpu_block for b in batch]
                if batch[0].kind == "save_cpu":
                    self.cpu.save(slots, kv_cache, blocks)
                elif self._loads is not None:  # on a GPU, beside the forward pass that reads them
                    self._load_beside_forward(slots, kv_cache, blocks)
                else:
                    self.cpu.load(slots, kv_cache, blocks)
                batch.clear()

        for i, t in enumerate(transfers):
            if t.kind in ("load_cpu", "save_cpu"):
                if batch and batch[0].kind != t.kind:
                    flush()
                batch.append(t)
                continue
            flush()
            if t.kind == "load_disk":
                disk_loads.append((i, t))  # after the loop: loads fill distinct fresh blocks, in any order
            elif t.kind == "save_disk":
                self._step_writes.append(self._write_beside(t.block_hash, *from_gpu[t.block_hash]))
            elif t.kind == "demote":
                self._demote(t.block_hash, t.slot)
            elif t.kind == "drop":
                assert disk is not None
                self._await_write(t.block_hash)  # (written and evicted by the same step: the write first)
                disk.drop(t.block_hash)
            else:
                raise ValueError(f"unknown KV transfer {t.kind!r}")
        flush()
        if disk_loads:
            self._load_from_disk(disk_loads, kv_cache, failed)
        self.transfer_seconds += time.perf_counter() - started
        return failed


def build_connector(config: EngineConfig, dtype: str, block_bytes: int,
                    transfer_cpu: int | None = None) -> TieredConnector | None:
    """The scheduler half, or None with offload off."""
    return TieredConnector(config, dtype, block_bytes, transfer_cpu) if enabled(config) else None


def build_worker(config: EngineConfig, rank: int, kv_cache: torch.Tensor, block_bytes: int,
                 transfer_cpu: int | None = None, group=None) -> TieredWorker | None:
    """One rank's worker half, or None with offload off."""
    return TieredWorker(config, rank, kv_cache, block_bytes, transfer_cpu, group) if enabled(config) else None


def stages_in_background(config: EngineConfig) -> bool:
    """Whether disk hits come back through host memory in the background: with a disk tier,
    into the host tier's slots or, alone, into its own (EngineConfig.kv_offload_host_gib)."""
    return config.kv_offload_disk_path is not None and config.kv_offload_host_gib > 0
