"""The scheduler with an offload connector, without a model: what it asks the tiers for, what
it plans to load and save, and how loads count as computed tokens; the plan's copies reach
every rank through the multiproc executor's step plan."""

from __future__ import annotations

from pagoda_daemon.engine.block_hash import BlockHash
from pagoda_daemon.engine.kv_cache_manager import KVCacheManager
from pagoda_daemon.engine.request import Request
from pagoda_daemon.engine.scheduler import Scheduler
from pagoda_daemon.engine.scheduler_output import KVTransfer
from pagoda_daemon.executor import step_plan
from pagoda_daemon.kv_offload.connector import OffloadConnector, capacity_blocks
from pagoda_daemon.kv_offload.cpu import CpuIndex
from pagoda_daemon.sampling_params import SamplingParams

BS = 16


class FakeConnector(OffloadConnector):
    """Holds whatever is saved; loads what it holds."""

    def __init__(self, held: set[BlockHash] | None = None, load_kind: str = "load_cpu",
                 prefetch: bool = False) -> None:
        super().__init__()
        self.prefetch = prefetch  # its loads may run beside a step, for the next (host memory's can)
        self.held = set(held or ())
        self.saves: list[KVTransfer] = []
        self.lookups: list[int] = []
        self.load_kind = load_kind
        self.forgotten: list[KVTransfer] = []

    def lookup(self, block_hashes):
        self.lookups.append(len(block_hashes))
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.held:
            n += 1
        return n

    def can_prefetch(self, block_hashes):
        return self.prefetch

    def plan_loads(self, block_hashes, gpu_block_ids):
        return [KVTransfer(self.load_kind, h, b, 0) for h, b in zip(block_hashes, gpu_block_ids, strict=True)]

    def plan_save(self, block_hash, gpu_block_id):
        if block_hash not in self.held:
            self.held.add(block_hash)
            self.saves.append(KVTransfer("save_cpu", block_hash, gpu_block_id, 0))

    def take_saves(self):
        saves, self.saves = self.saves, []
        return saves

    def forget(self, transfers):
        self.forgotten += transfers
        self.held -= {t.block_hash for t in transfers}

    def check(self):
        pass


def make(num_blocks=32, connector=None, budget=256, chunked=True, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(kv, 8, budget, 512, chunked, connector=connector)


def request(rid, n, first=100, **params):
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=4, **params), None, BS)


def step(sched, token=7):
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: token for s in out.scheduled if s.samples})
    return out


def test_full_blocks_are_saved_once_and_loaded_back_leaving_the_last_token_to_compute():
    conn = FakeConnector()
    sched = make(connector=conn)
    sched.add_request(request("a", 64))  # exactly 4 full blocks
    out = step(sched)
    assert [t.kind for t in out.kv_saves] == ["save_cpu"] * 4 and not out.kv_loads
    a_blocks = sched.kv_cache.block_ids("a")
    assert [t.gpu_block for t in out.kv_saves] == a_blocks
    sched.abort_requests(["a"])
    sched.kv_cache.reset_prefix_cache()  # the GPU forgets: only the connector can help
    sched.add_request(request("b", 64))
    out = step(sched)
    # 3 blocks come back; the 4th holds the last token, whose logits are needed
    assert len(out.kv_loads) == 3 and out.scheduled[0].num_new_tokens == 16 and out.scheduled[0].start == 48
    assert [t.gpu_block for t in out.kv_loads] == sched.kv_cache.block_ids("b")[:3]
    assert out.num_scheduled_tokens == 16  # loads spend no token budget
    assert sched.requests["b"].num_cached_tokens == 48
    assert not out.kv_saves  # the connector has block 4 already
    assert (conn.stats.queries, conn.stats.hits) == (6 * BS, 3 * BS)  # "a" asked for 3 blocks too, and missed


def test_gpu_hits_first_then_the_connector_for_the_rest():
    conn = FakeConnector()
    sched = make(connector=conn)
    sched.add_request(request("a", 80))
    step(sched)
    conn.held = set(sched.requests["a"].block_hashes)
    sched.abort_requests(["a"])
    sched.add_request(request("b", 81))
    out = step(sched)
    # every block still on the GPU: the connector is asked for none of them
    assert not out.kv_loads and out.scheduled[0].num_new_tokens == 1 and conn.lookups == [4]  # "a"'s only


def test_prompt_logprobs_skip_the_connector_and_chunked_prefill_saves_as_blocks_fill():
    conn = FakeConnector()
    sched = make(connector=conn, budget=40)
    sched.add_request(request("a", 100))
    saved = [len(step(sched).kv_saves) for _ in range(3)]
    assert saved == [2, 3, 1]  # 40, 80, 100 tokens: blocks full at 2, 5, 6
    sched.abort_requests(["a"])
    sched.kv_cache.reset_prefix_cache()
    sched.add_request(request("p", 100, prompt_logprobs=0))
    out = step(sched)
    assert not out.kv_loads and out.scheduled[0].start == 0


def test_preempted_requests_come_back_through_the_connector():
    conn = FakeConnector()
    sched = make(num_blocks=8, connector=conn, budget=512)
    sched.add_request(request("a", 63, first=100))  # 5 blocks each once decoding: 10 > 8
    sched.add_request(request("b", 63, first=1000))
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert sched.stats.num_preemptions >= 1 and conn.stats.hits > 0
    assert not sched.has_unfinished_requests() and sched.kv_cache.num_free_blocks == 8


def test_step_plan_carries_the_copies_to_every_rank():
    conn = FakeConnector()
    sched = make(connector=conn)
    sched.add_request(request("a", 40))
    out = sched.schedule()
    out.kv_loads = [KVTransfer("load_disk", b"\x01" * 32, 3)]
    out.kv_prefetch = [KVTransfer("load_cpu", b"\x02" * 32, 4, 9)]
    out.kv_stages = [KVTransfer("stage_disk", b"\x03" * 32, -1, 7)]
    frame = step_plan.encode(step_plan.PlanWriter().plan(out))
    mirrored = step_plan.RequestMirrors(BS).apply(step_plan.decode(frame))
    assert mirrored.kv_loads == out.kv_loads and mirrored.kv_saves == out.kv_saves and len(out.kv_saves) == 2
    assert mirrored.kv_prefetch == out.kv_prefetch and mirrored.kv_stages == out.kv_stages


def _offloaded(conn: FakeConnector, firsts: tuple[int, ...] = (100,), **kwargs) -> Scheduler:
    """A scheduler whose connector holds the 4 full blocks of request(..., 64, first) for each of
    ``firsts``, which the GPU cache has forgotten."""
    sched = make(connector=conn, **kwargs)
    names = [f"a{first}" for first in firsts]
    for name, first in zip(names, firsts, strict=True):
        sched.add_request(request(name, 64, first=first))
    step(sched)
    sched.abort_requests(names)
    sched.kv_cache.reset_prefix_cache()
    return sched


def test_host_memory_loads_run_beside_a_step_and_the_request_computes_from_the_next():
    """A request whose hits are all in host memory is admitted with its loads in the step's
    ``kv_prefetch`` (beside the forward pass) and is not in the step: the running request
    decodes without waiting for them. The next step computes it, new to the runner with its
    whole block list, from the first token the loads do not cover."""
    conn = FakeConnector(prefetch=True)
    sched = _offloaded(conn)
    sched.add_request(request("x", 20, first=1000))
    step(sched)  # x's prompt
    sched.add_request(request("b", 64))
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["x"] and out.num_scheduled_tokens == 1
    assert not out.kv_loads and [t.kind for t in out.kv_prefetch] == ["load_cpu"] * 3
    assert [t.gpu_block for t in out.kv_prefetch] == sched.kv_cache.block_ids("b")
    b = sched.requests["b"]
    assert b in sched.running and b.num_computed_tokens == 48 and b.num_cached_tokens == 48
    out = step(sched)
    first = next(s for s in out.scheduled if s.request is b)
    assert first.is_new and first.start == 48 and first.num_new_tokens == 16 and first.samples
    assert first.new_block_ids == sched.kv_cache.block_ids("b") and len(first.new_block_ids) == 4
    assert not out.kv_prefetch
    out = step(sched)
    again = next(s for s in out.scheduled if s.request is b)
    assert not again.is_new and again.num_new_tokens == 1  # a decode like any other
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache.num_free_blocks == 32 and not sched._prefetching
    assert (conn.stats.hits, conn.stats.queries) == (3 * BS, (3 + 1 + 3) * BS)  # a, x and b asked


def test_a_request_on_a_prefix_still_coming_back_waits_one_step():
    """"c" shares the 3 blocks "b" prefetches: in the step that prefetches them it would read them
    before they are back, so it keeps its place (those behind it go on); the next step, when
    that step's stream has waited for them, it takes them as GPU prefix hits beside "b"."""
    conn = FakeConnector(prefetch=True)
    sched = _offloaded(conn)
    for rid, first in (("b", 100), ("c", 100), ("d", 1000)):
        sched.add_request(request(rid, 64, first=first))
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["d"] and len(out.kv_prefetch) == 3
    assert [r.request_id for r in sched.waiting] == ["c"]
    out = step(sched)
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert by_id["b"].is_new and by_id["c"].is_new and by_id["c"].start == 48
    assert sched.kv_cache.block_ids("c")[:3] == sched.kv_cache.block_ids("b")[:3] and not out.kv_prefetch
    assert sched.requests["c"].num_cached_tokens == 48
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache.num_free_blocks == 32


def test_disk_loads_are_read_by_the_step_that_makes_them():
    """A load that can fail (a file) is never prefetched: its step must be the one that reads it,
    to be undone when it fails."""
    conn = FakeConnector(load_kind="load_disk")
    sched = _offloaded(conn)
    sched.add_request(request("b", 64))
    out = step(sched)
    assert len(out.kv_loads) == 3 and not out.kv_prefetch and out.scheduled[0].start == 48


def test_a_prefetching_request_aborted_or_preempted_leaks_nothing():
    """Aborted before its first step, a prefetching request gives its blocks back (their loads are
    stream-ordered before any step that reuses them) and never reaches the runner; preempted (the
    latest arrival when blocks run out), it goes back to the queue and is served later."""
    conn = FakeConnector(prefetch=True)
    sched = _offloaded(conn)
    sched.add_request(request("b", 64))
    out = step(sched)
    assert out.kv_prefetch and not out.scheduled
    sched.abort_requests(["b"])
    out = step(sched)
    assert "b" in out.finished_request_ids and not out.scheduled and sched.kv_cache.num_free_blocks == 32
    assert not sched._prefetching

    sched = _offloaded(conn, num_blocks=8)
    sched.add_request(request("x", 63, first=1000))  # 4 blocks, a 5th at its second decode
    step(sched)
    sched.add_request(request("b", 64))  # 3 blocks prefetched
    out = step(sched)
    assert len(out.kv_prefetch) == 3 and sched.kv_cache.num_free_blocks == 1
    sched.add_request(request("y", 17, first=3000))  # waits behind the preemption below
    out = step(sched)  # x needs its 5th block, b's first chunk its 4th: b, the latest, is preempted
    assert out.preempted_request_ids == ["b"] and "b" not in {s.request.request_id for s in out.scheduled}
    assert not sched._prefetching and sched.requests["b"] in sched.waiting
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests() and sched.kv_cache.num_free_blocks == 8


def test_without_chunked_prefill_a_prefetched_prompt_waits_for_a_step_with_room_for_all_of_it():
    """Two prompts prefetched in one step (16 tokens each to compute, 17 a step, x decoding): the
    next step computes the first whole; the one after has 15 tokens left beside the decodes, so
    the second waits (its prompt is never cut) until x finishes."""
    conn = FakeConnector(prefetch=True)
    sched = _offloaded(conn, firsts=(100, 5000))
    sched.max_num_batched_tokens, sched.enable_chunked_prefill = 17, False
    sched.add_request(request("x", 4, first=1000))
    step(sched)
    sched.add_request(request("b1", 64, first=100))
    sched.add_request(request("b2", 64, first=5000))
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["x"] and len(out.kv_prefetch) == 6
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("x", 1), ("b1", 16)]
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("x", 1), ("b1", 1)]
    while not any(s.request.request_id == "b2" for s in out.scheduled):
        assert sched.requests["b2"] in sched.running
        out = step(sched)
    first = next(s for s in out.scheduled if s.request.request_id == "b2")
    assert first.is_new and first.num_new_tokens == 16 and first.start == 48
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache.num_free_blocks == 32


def test_host_index_evicts_least_recently_used_and_capacity_covers_every_rank():
    idx = CpuIndex(2)
    assert idx.insert(b"a") == (0, None) and idx.insert(b"b") == (1, None)
    idx.touch(b"a")
    assert idx.insert(b"c") == (1, (b"b", 1))
    idx.check()
    assert capacity_blocks(1.0, 1 << 20, 2) == 512 and capacity_blocks(0.0, 1, 1) == 0


def test_offload_metrics_are_exported_and_documented():
    from pathlib import Path

    from pagoda_daemon.engine.messages import EngineStats, KVOffloadStats
    from pagoda_daemon.telemetry.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    stats = KVOffloadStats(10, 5, {"cpu": 100}, {"disk": 7}, 0.5)
    metrics.record_engine_stats(EngineStats(0, 0, 0.0, 1, 1, kv_offload=stats.add(KVOffloadStats(1, 1, {"cpu": 1}))))
    body = metrics.render()[0].decode()
    for line in ('vllm:external_prefix_cache_queries_total{model_name="m"} 11.0',
                 'vllm:external_prefix_cache_hits_total{model_name="m"} 6.0',
                 'pagoda:kv_offload_loaded_bytes_total{medium="CPU",model_name="m"} 101.0',
                 'pagoda:kv_offload_saved_bytes_total{medium="DISK",model_name="m"} 7.0',
                 'pagoda:kv_offload_transfer_seconds_total{model_name="m"} 0.5'):
        assert line in body
        assert f"`{line.split('{')[0]}`" in (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()


def test_the_tiers_report_stores_and_removals_as_kv_events(tmp_path):
    """With KV events on, each tier announces what it stores and drops, with its medium: a save
    into a full host tier evicts its oldest block (removed from CPU, demoted: stored on DISK);
    a disk eviction is a removal from DISK; the events reach the wire with their medium (vLLM's
    offloading connector's shape: no parent, no tokens)."""
    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.engine.block_pool import RemovedBlock, StoredBlock
    from pagoda_daemon.kv_offload.tiered import TieredConnector
    from pagoda_daemon.server.core_process import kv_events_for_publishing
    from pagoda_daemon.telemetry.kv_events import _decode_event, _encode_event

    block_bytes = 4096
    config = EngineConfig(model=str(tmp_path), enable_kv_events=True, kv_offload_cpu_gib=2 * block_bytes / 2**30,
                          kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=2 * block_bytes / 2**30)
    tiers = TieredConnector(config, "float32", block_bytes)
    h = [bytes([i]) * 32 for i in range(4)]
    for i, block_hash in enumerate(h):
        tiers.plan_save(block_hash, i)
    tiers.take_saves()
    assert tiers.take_events() == [
        StoredBlock(h[0], None, [], (), "CPU"), StoredBlock(h[1], None, [], (), "CPU"),
        RemovedBlock(h[0], "CPU"), StoredBlock(h[0], None, [], (), "DISK"), StoredBlock(h[2], None, [], (), "CPU"),
        RemovedBlock(h[1], "CPU"), StoredBlock(h[1], None, [], (), "DISK"), StoredBlock(h[3], None, [], (), "CPU"),
    ]
    tiers.plan_save(bytes([9]) * 32, 5)  # host tier full again: h2 demoted, the disk drops h0
    events = tiers.take_events()
    assert RemovedBlock(h[0], "DISK") in events and StoredBlock(h[2], None, [], (), "DISK") in events
    assert tiers.take_events() == []
    wire = [_decode_event(_encode_event(e)) for e in kv_events_for_publishing(events, 16)]
    assert [e.medium for e in wire] == [e.medium for e in events]

    quiet = TieredConnector(EngineConfig(model=str(tmp_path), kv_offload_cpu_gib=2 * block_bytes / 2**30),
                            "float32", block_bytes)
    quiet.plan_save(h[0], 0)
    assert quiet.take_events() == []  # events off: nothing kept


def test_a_failed_load_sends_the_requests_that_read_it_back_to_be_computed():
    """"b" loads 4 blocks from disk and "c" shares them as GPU prefix hits in the same step;
    the second load fails. Both go back to the front of the queue with nothing kept from the
    step past the first block; the blocks from the failed one on leave the prefix cache; the
    connector forgets the failed load's source and the saves of blocks built on it; "d",
    unrelated, keeps its token. Then all three finish and no block is left held."""
    conn = FakeConnector(load_kind="load_disk")
    sched = make(connector=conn)
    sched.add_request(request("a", 64))
    step(sched)
    sched.abort_requests(["a"])
    sched.kv_cache.reset_prefix_cache()
    for rid, first in (("b", 100), ("c", 100), ("d", 1000)):
        sched.add_request(request(rid, 90, first=first))  # 5 full blocks, 4 on the tier
    out = sched.schedule()
    assert out.loads_may_fail and [t.kind for t in out.kv_loads] == ["load_disk"] * 4
    b_blocks, c_blocks = sched.kv_cache.block_ids("b"), sched.kv_cache.block_ids("c")
    assert c_blocks[:5] == b_blocks[:5]  # prefix hits on the blocks being loaded (and computed)
    failed = b_blocks[1]
    built_on = out.blocks_built_on({failed})
    assert built_on == set(b_blocks[1:]) | set(c_blocks[1:])
    saved = [t for t in out.kv_saves if t.gpu_block in built_on]
    assert [t.gpu_block for t in saved] == [b_blocks[4]]  # computed on top of the failed block: not kept
    assert len(out.kv_saves) == 1 + 5  # and d's
    b_hashes = list(sched.requests["b"].block_hashes)

    finished, accepted = sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled
                                                        if s.samples}, [failed])
    assert not finished and list(accepted) == ["d"]
    assert [r.request_id for r in list(sched.waiting)[:2]] == ["b", "c"]
    for rid in ("b", "c"):
        req = sched.requests[rid]
        assert req.num_computed_tokens == 0 and req.num_output_tokens == 0 and req.num_pending_tokens == 0
        assert sched.kv_cache.block_ids(rid) == []
    pool = sched.kv_cache.pool
    assert pool.get_cached_block(b_hashes[0]).block_id == b_blocks[0]  # loaded fine: kept
    assert all(pool.get_cached_block(h) is None for h in b_hashes[1:])
    assert conn.forgotten == [out.kv_loads[1], *saved] and conn.stats.failed_loads == 1

    out = sched.schedule()
    b = next(s for s in out.scheduled if s.request.request_id == "b")
    assert b.start == BS and not out.kv_loads  # block 0 from the GPU cache; block 1 is gone from the tier
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests() and sched.kv_cache.num_free_blocks == 32
    assert sched.requests == {}
