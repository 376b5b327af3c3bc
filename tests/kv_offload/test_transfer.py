"""Prefill/decode between hosts (kv_offload/transfer.py): a prefill engine serves its disk
tier's block files on a TCP port, a decode engine fetches the blocks its tiers lack while the
request waits. Real ZMQ sockets on loopback, real engines on CPU: greedy output equal to one
engine's, the decode engine's prompts loaded rather than computed; a wrong key, a dead or
hostile server, a corrupt file and malformed asks each cost a recompute or a refusal, never the
engine or a wrong token."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pagoda_daemon import LLM
from pagoda_daemon.kv_offload import disk as disk_tier
from pagoda_daemon.kv_offload import tiered, transfer, transfer_auth
from tests.kv_offload.test_offload import ENGINE, assert_idle_and_consistent, corrupt, gib, run, workload
from tests.server.conftest import free_port

KEY = "k" * 24


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv(transfer_auth.KEY_ENV, KEY)


def write_files(root: Path, hashes: list[bytes], ranks: int = 1, size: int = 64) -> None:
    for r in range(ranks):
        d = disk_tier.rank_dir(root, r)
        d.mkdir(parents=True, exist_ok=True)
        for h in hashes:
            (d / disk_tier.file_name(h)).write_bytes(h + bytes([r]) * size)


def ask(hashes: list[bytes], key: str = KEY, ranks: int = 1, now_s: float | None = None) -> list[bytes]:
    return transfer.signed_ask(key.encode(), b"".join(hashes), ranks, now_s)


def hashes_(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


# ---- the server's answers ----------------------------------------------------------------


@pytest.fixture
def server(tmp_path):
    srv = transfer.BlockServer(str(tmp_path / "served"), 0, KEY.encode(), host="127.0.0.1")
    yield srv
    srv.close()


def test_the_server_answers_the_leading_blocks_it_holds_on_every_rank(server, tmp_path):
    root = tmp_path / "served"
    have = hashes_(5)
    write_files(root, have[:3], ranks=2)
    write_files(root, have[3:4], ranks=1)  # rank 1's file missing: a miss
    reply = server.answer(ask(have, ranks=2))
    assert reply[:2] == [transfer.MAGIC, b"ok"]
    assert struct.unpack("<IB", reply[2]) == (3, 1)
    assert reply[3:] == [h + bytes([r]) * 64 for h in have[:3] for r in range(2)]
    assert struct.unpack("<IB", server.answer(ask(hashes_(2, salt=9)))[2]) == (0, 1)  # nothing held


def test_a_reply_is_bounded_and_the_rest_comes_in_the_next_ask(server, tmp_path, monkeypatch):
    have = hashes_(4)
    write_files(tmp_path / "served", have, size=1000)
    monkeypatch.setattr(transfer, "MAX_REPLY_BYTES", 2500)
    reply = server.answer(ask(have))
    assert struct.unpack("<IB", reply[2]) == (2, 0) and len(reply) == 5
    monkeypatch.setattr(transfer, "MAX_REPLY_BYTES", 10)
    assert struct.unpack("<IB", server.answer(ask(have))[2]) == (1, 0)  # always at least one block


def test_a_file_evicted_between_its_size_and_its_read_ends_the_reply_there(server, tmp_path, monkeypatch):
    """The server reads a reply's files in several threads after sizing them: one gone by then
    (evicted, dropped) is a miss at its block, and the blocks before it still go."""
    have = hashes_(6)
    write_files(tmp_path / "served", have, ranks=2)
    gone = disk_tier.file_name(have[3])
    read = transfer._read_or_none
    monkeypatch.setattr(transfer, "_read_or_none", lambda p: None if p.name == gone and "rank1" in str(p) else read(p))
    reply = server.answer(ask(have, ranks=2))
    assert struct.unpack("<IB", reply[2]) == (3, 1)
    assert reply[3:] == [h + bytes([r]) * 64 for h in have[:3] for r in range(2)]


@pytest.mark.parametrize("writers", [0, 3], ids=["fetching-thread", "writer-threads"])
def test_fetch_writes_each_file_to_its_name_with_or_without_writer_threads(server, tmp_path, writers):
    from concurrent.futures import ThreadPoolExecutor

    have = hashes_(40)
    write_files(tmp_path / "served", have, ranks=3, size=300)
    pool = ThreadPoolExecutor(writers) if writers else None
    remote = transfer.RemoteBlocks(f"tcp://127.0.0.1:{server.port}", KEY.encode(), 3, block_bytes=300 + 32 + 1,
                                   writers=pool)
    try:
        assert remote.fetch(have, tmp_path / "in") == have
    finally:
        remote.close()
        if pool is not None:
            pool.shutdown()
    for h in have:
        for r in range(3):
            assert (disk_tier.rank_dir(tmp_path / "in", r) / disk_tier.file_name(h)).read_bytes() == h + bytes([r]) * 300


def signed_raw(hashes: bytes, ranks: bytes, when: bytes = struct.pack("<Q", 0)) -> list[bytes]:
    """An ask signed with the right key over frames that do not parse (the time now unless given)."""
    when = struct.pack("<Q", int(time.time() * 1000)) if when == struct.pack("<Q", 0) else when
    return [transfer.MAGIC, when, transfer.sign(KEY.encode(), when, hashes, ranks), hashes, ranks]


ASKS = {
    "wrong-key": lambda: (ask(hashes_(1), key="wrong-key-of-some-length"), b"denied"),
    "empty-key": lambda: (ask(hashes_(1), key=""), b"denied"),
    "stale": lambda: (ask(hashes_(1), now_s=time.time() - 2 * transfer_auth.MAX_CLOCK_SKEW_S), b"denied"),
    "future": lambda: (ask(hashes_(1), now_s=time.time() + 2 * transfer_auth.MAX_CLOCK_SKEW_S), b"denied"),
    "key-in-clear": lambda: ([transfer.MAGIC, struct.pack("<Q", int(time.time() * 1000)), KEY.encode().ljust(32),
                              hashes_(1)[0], struct.pack("<I", 1)], b"denied"),
    "other-hashes": lambda: ([*ask(hashes_(1))[:3], hashes_(1, salt=3)[0], struct.pack("<I", 1)], b"denied"),
    "partial-hash": lambda: (signed_raw(b"x" * 31, struct.pack("<I", 1)), b"bad"),
    "no-hash": lambda: (signed_raw(b"", struct.pack("<I", 1)), b"bad"),
    "too-many": lambda: (ask(hashes_(transfer.MAX_BLOCKS_PER_ASK + 1)), b"bad"),
    "zero-ranks": lambda: (ask(hashes_(1), ranks=0), b"bad"),
    "too-many-ranks": lambda: (ask(hashes_(1), ranks=transfer.MAX_RANKS + 1), b"bad"),
    "u32-max-ranks": lambda: (ask(hashes_(1), ranks=2**32 - 1), b"bad"),
    "short-ranks": lambda: (signed_raw(hashes_(1)[0], b"\x01"), b"bad"),
    "short-time": lambda: ([transfer.MAGIC, b"\x01", b"s" * 32, hashes_(1)[0], struct.pack("<I", 1)], b"bad"),
    "other-magic": lambda: ([b"PAGODA-KVX0", *ask(hashes_(1))[1:]], b"bad"),
    "four-frames": lambda: (ask(hashes_(1))[:4], b"bad"),
    "nothing": lambda: ([], b"bad"),
}


@pytest.mark.parametrize("case", list(ASKS))
def test_asks_that_are_not_allowed_or_do_not_parse_read_no_file(server, tmp_path, case, monkeypatch):
    frames, answer = ASKS[case]()
    write_files(tmp_path / "served", hashes_(1) + hashes_(1, salt=3))
    read = []
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or b"")
    assert server.answer(frames) == [transfer.MAGIC, answer]
    assert not read


def test_a_hash_names_a_file_in_the_tier_and_nothing_else(server, tmp_path):
    """The file name is the hash in hex: ``..`` and ``/`` cannot appear in it."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a block")
    evil = b"../../secret".ljust(32, b"\0")
    assert struct.unpack("<IB", server.answer(ask([evil]))[2]) == (0, 1)


# ---- fetching over real sockets ----------------------------------------------------------


def test_fetch_writes_the_leading_blocks_whole_over_loopback(server, tmp_path):
    have = hashes_(70)  # more than one ask
    write_files(tmp_path / "served", have[:68], ranks=2)
    remote = transfer.RemoteBlocks(f"tcp://127.0.0.1:{server.port}", KEY.encode(), 2, block_bytes=64 + 32 + 1)
    try:
        got = remote.fetch(have, tmp_path / "in")
    finally:
        remote.close()
    assert got == have[:68]
    for r in range(2):
        files = sorted(p.name for p in disk_tier.rank_dir(tmp_path / "in", r).iterdir())
        assert files == sorted(disk_tier.file_name(h) for h in have[:68])
    assert (disk_tier.rank_dir(tmp_path / "in", 1) / disk_tier.file_name(have[5])).read_bytes() == have[5] + b"\1" * 64


def test_a_wrong_key_fetches_nothing_and_says_so(server, tmp_path, caplog):
    write_files(tmp_path / "served", hashes_(2))
    remote = transfer.RemoteBlocks(f"tcp://127.0.0.1:{server.port}", b"another-key-entirely", 1, 1 << 20)
    with caplog.at_level("WARNING", logger="pagoda_daemon.kv_offload.transfer"):
        assert remote.fetch(hashes_(2), tmp_path / "in") == []
    remote.close()
    assert "denied the ask" in caplog.text and transfer_auth.KEY_ENV in caplog.text
    assert not list((tmp_path / "in" / "rank0").iterdir())


def test_no_server_is_a_miss_after_the_timeout(tmp_path):
    remote = transfer.RemoteBlocks(f"tcp://127.0.0.1:{free_port()}", KEY.encode(), 1, 1 << 20, timeout_s=0.3)
    started = time.monotonic()
    assert remote.fetch(hashes_(3), tmp_path / "in") == []
    assert time.monotonic() - started < 5
    remote.close()


def hostile_server(reply: list[bytes] | None) -> tuple[int, threading.Event]:
    """A ROUTER that answers every ask with ``reply`` (None: reads asks, never answers)."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                frames = sock.recv_multipart()
                if reply is not None:
                    sock.send_multipart(frames[:2] + reply)
        sock.close(0)

    threading.Thread(target=serve, daemon=True).start()
    return port, stop


@pytest.mark.parametrize("reply", [
    [b"garbage"],
    [transfer.MAGIC, b"ok", struct.pack("<IB", 5, 0)],  # five blocks announced, none sent
    [transfer.MAGIC, b"ok", struct.pack("<IB", 99, 0)] + [b"x"] * 99,  # more than asked
    [transfer.MAGIC, b"ok", b"\x01"],
    [transfer.MAGIC, b"ok", struct.pack("<IB", 1, 0), b"x" * (3 << 20)],  # a file bigger than a block
], ids=["garbage", "missing-files", "more-than-asked", "short-count", "oversized-file"])
def test_a_server_that_lies_costs_a_miss_and_writes_nothing(tmp_path, reply):
    port, stop = hostile_server(reply)
    remote = transfer.RemoteBlocks(f"tcp://127.0.0.1:{port}", KEY.encode(), 1, block_bytes=1 << 20, timeout_s=1)
    try:
        assert remote.fetch(hashes_(3), tmp_path / "in") == []
    finally:
        stop.set()
        remote.close()
    assert not list((tmp_path / "in" / "rank0").iterdir())


def test_an_oversized_ask_is_dropped_and_the_server_serves_on(server, tmp_path):
    write_files(tmp_path / "served", hashes_(1))
    context = zmq.Context()
    big = context.socket(zmq.REQ)
    big.connect(f"tcp://127.0.0.1:{server.port}")
    big.send_multipart([*ask(hashes_(1))[:3], b"x" * (transfer.MAX_ASK_BYTES + 1), b"\x01\x00\x00\x00"])
    assert big.poll(500) == 0  # dropped with its connection, no reply
    big.close(0)
    context.term()
    remote = transfer.RemoteBlocks(f"tcp://127.0.0.1:{server.port}", KEY.encode(), 1, 1 << 20)
    assert remote.fetch(hashes_(1), tmp_path / "in") == hashes_(1)
    remote.close()


@pytest.mark.parametrize("url", ["tcp://host", "tcp://:80", "tcp://h:0", "tcp://h:70000", "tcp://h:80/x",
                                 "tcp://u:p@h:80", "tcp://h:80?q", "tcp://h:port"])
def test_a_remote_source_must_be_tcp_host_port(model, tmp_path, url):
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=0.01,
            kv_offload_disk_source=url)


def test_both_ends_need_the_key_and_a_disk_tier(model, tmp_path, monkeypatch):
    disk = dict(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=0.01)
    with pytest.raises(ValueError, match="kv_transfer_port needs kv_offload_disk_path"):
        LLM(model, **ENGINE, kv_transfer_port=free_port())
    monkeypatch.setenv(transfer_auth.KEY_ENV, "short")
    with pytest.raises(ValueError, match=transfer_auth.KEY_ENV):
        LLM(model, **ENGINE, **disk, kv_transfer_port=free_port())
    monkeypatch.delenv(transfer_auth.KEY_ENV)
    with pytest.raises(ValueError, match=transfer_auth.KEY_ENV):
        LLM(model, **ENGINE, **disk, kv_offload_disk_source="tcp://127.0.0.1:9")
    for port in (-1, 65536):
        with pytest.raises(ValueError, match="kv_transfer_port"):
            LLM(model, **ENGINE, **disk, kv_transfer_port=port)


# ---- two engines -------------------------------------------------------------------------


@contextlib.contextmanager
def engines(model, block_bytes, tmp_path, source: str | None = None) -> Iterator[tuple[LLM, LLM, int]]:
    """A prefill engine serving its disk tier on a transfer port, and a decode engine whose
    kv_offload_disk_source is ``source`` (that port by default); (prefill, decode, port), both shut
    down after."""
    disk = dict(kv_offload_disk_gib=gib(64, block_bytes))
    port = free_port()
    prefill = LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "prefill"), kv_transfer_port=port, **disk)
    decode = LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "decode"),
                 kv_offload_disk_source=source or f"tcp://127.0.0.1:{port}", **disk)
    try:
        yield prefill, decode, port
    finally:
        prefill.engine.core.shutdown()
        decode.engine.core.shutdown()


def test_a_decode_engine_loads_the_prompts_a_prefill_engine_computed(model, block_bytes, tmp_path):
    prompts = workload(num_prefixes=3, repeats=1)
    reference = run(LLM(model, **ENGINE), prompts)
    with engines(model, block_bytes, tmp_path) as (prefill, decode, _):
        run(prefill, prompts)
        assert run(decode, prompts) == reference
        stats = decode.get_stats().kv_offload
        assert stats.hits == 3 * 6 * 16, stats  # every full block but the last token's, from the other engine
        assert stats.fetched_bytes == 3 * 6 * block_bytes
        assert stats.failed_loads == 0
        assert_idle_and_consistent(decode)
        assert not list((tmp_path / "decode" / tiered.INCOMING).iterdir())  # every fetch's folder went
        # asked again: from its own tier now, nothing more fetched (the stats are totals)
        assert run(decode, prompts) == reference
        assert decode.get_stats().kv_offload.fetched_bytes == 3 * 6 * block_bytes


def test_a_corrupt_file_fails_its_load_and_is_recomputed_and_a_wrong_key_computes_everything(
        model, block_bytes, tmp_path, monkeypatch):
    prompts = workload(num_prefixes=2, repeats=1)
    reference = run(LLM(model, **ENGINE), prompts)
    with engines(model, block_bytes, tmp_path) as (prefill, decode, port):
        run(prefill, prompts)
        for path in sorted((tmp_path / "prefill" / "rank0").glob(f"*{disk_tier.SUFFIX}"))[::3]:
            corrupt(path)
        assert run(decode, prompts) == reference
        stats = decode.get_stats().kv_offload
        assert stats.fetched_bytes > 0 and stats.failed_loads > 0, stats
        assert_idle_and_consistent(decode)
        monkeypatch.setenv(transfer_auth.KEY_ENV, "a-different-key-of-24ch")
        stranger = LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "stranger"),
                       kv_offload_disk_gib=gib(64, block_bytes), kv_offload_disk_source=f"tcp://127.0.0.1:{port}")
        try:
            assert run(stranger, prompts) == reference
            assert stranger.get_stats().kv_offload.hits == 0
        finally:
            stranger.engine.core.shutdown()


def test_requests_behind_a_slow_fetch_go_first_and_nothing_leaks(model, block_bytes, tmp_path, monkeypatch):
    """A fetch that takes a while holds back only its own request; an abort while it runs
    leaves no folder, block or request behind."""
    prompts = workload(num_prefixes=2, repeats=1)
    reference = run(LLM(model, **ENGINE), prompts)
    slow = threading.Event()
    fetch = transfer.RemoteBlocks.fetch

    def slow_fetch(self, hashes, into):
        slow.wait(10)
        return fetch(self, hashes, into)

    monkeypatch.setattr(transfer.RemoteBlocks, "fetch", slow_fetch)
    with engines(model, block_bytes, tmp_path) as (prefill, decode, _):
        try:
            run(prefill, prompts[:1])  # only the first prompt's blocks are there to fetch
            from pagoda_daemon import SamplingParams
            from pagoda_daemon.engine.request import Request

            core = decode.engine.core
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            core.add_request(Request("waits", prompts[0], params, None, ENGINE["block_size"]))
            # no full block to fetch: scheduled at once
            core.add_request(Request("goes", list(range(5, 15)), params, None, ENGINE["block_size"]))
            finished = set()
            for _ in range(50):
                finished |= {o.request_id for o in core.step() if o.finish_reason}
                if "goes" in finished:
                    break
            assert "goes" in finished and "waits" not in finished  # went first, while the other waited
            core.abort_requests(["waits"])
            slow.set()
            deadline = time.monotonic() + 10
            while core.connector._fetches and time.monotonic() < deadline:
                core.step() if core.has_unfinished_requests() else core.connector.take_saves()
                time.sleep(0.01)
            assert not core.connector._fetches
            assert not list((tmp_path / "decode" / tiered.INCOMING).iterdir())
            assert_idle_and_consistent(decode)
            assert run(decode, prompts) == reference  # the fetch's blocks were adopted for the next asker
        finally:
            slow.set()  # a test that fails early must not leave the fetch waiting through shutdown


def test_shutdown_ends_a_fetch_without_waiting_for_its_timeout(model, block_bytes, tmp_path):
    """A prefill instance that never answers: the decode engine's shutdown does not wait the
    ask's 10 s out."""
    port, stop = hostile_server(None)
    decode = LLM(model, **ENGINE, kv_offload_disk_path=str(tmp_path / "decode"), kv_offload_disk_gib=gib(64, block_bytes),
                 kv_offload_disk_source=f"tcp://127.0.0.1:{port}")
    from pagoda_daemon import SamplingParams
    from pagoda_daemon.engine.request import Request

    core = decode.engine.core
    core.add_request(Request("waits", workload(num_prefixes=1, repeats=1)[0],
                             SamplingParams(temperature=0.0, max_tokens=2), None, ENGINE["block_size"]))
    core.step()
    assert core.connector._fetches
    time.sleep(0.3)  # the ask is out, waiting for its answer
    assert not next(iter(core.connector._fetches.values()))[1].done()
    started = time.monotonic()
    core.shutdown()
    stop.set()
    assert time.monotonic() - started < 3


# ---- the source each request names (pd-proxy passes the prefill instance's signed header on) ----


def test_a_source_header_verifies_only_as_its_prefill_instance_signed_it():
    key = KEY.encode()
    source = "tcp://10.1.2.3:8300"
    header = transfer_auth.advertisement(key, source)
    assert transfer_auth.verified_source(header, key) == source
    _, issued, signature = header.split(" ")
    now = int(issued) / 1000
    bad = {
        "another key": transfer_auth.advertisement(b"x" * 24, source, now),
        "another source": f"tcp://10.9.9.9:8300 {issued} {signature}",
        "another time": f"{source} {int(issued) + 1} {signature}",
        "stale": transfer_auth.advertisement(key, source, now - 2 * transfer_auth.MAX_CLOCK_SKEW_S),
        "ahead": transfer_auth.advertisement(key, source, now + 2 * transfer_auth.MAX_CLOCK_SKEW_S),
        "two parts": f"{source} {signature}",
        "four parts": f"{header} x",
        "negative time": f"{source} -{issued} {signature}",
        "huge time": f"{source} {'9' * 40} {signature}",
        "too long": header + " " * 600,
        "empty": "",
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=transfer_auth.SOURCE_HEADER):
            transfer_auth.verified_source(value, key)
        assert name
    # signed, but not a source the engine may connect to
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        transfer_auth.verified_source(transfer_auth.advertisement(key, "http://10.1.2.3:80"), key)


def test_a_decode_engine_fetches_from_the_source_each_request_names(model, block_bytes, tmp_path):
    from pagoda_daemon import SamplingParams
    from pagoda_daemon.engine.request import Request

    prompts = workload(num_prefixes=2, repeats=1)
    reference = run(LLM(model, **ENGINE), prompts)
    with engines(model, block_bytes, tmp_path, source=transfer_auth.FROM_REQUEST) as (prefill, decode, port):
        run(prefill, prompts)
        core = decode.engine.core
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = []
        for i, (prompt, source) in enumerate(zip(prompts, [f"tcp://127.0.0.1:{port}", None], strict=True)):
            core.add_request(Request(f"r{i}", prompt, params, None, ENGINE["block_size"], kv_source=source))
            tokens: list[int] = []
            while core.has_unfinished_requests():
                for out in core.step():
                    tokens += out.new_token_ids
            got.append(tokens)
        assert got == reference
        stats = decode.get_stats().kv_offload
        # the first request named the prefill instance: its 6 blocks came from there; the second named none
        assert stats.fetched_bytes == 6 * block_bytes and stats.hits == 6 * 16, stats
        assert_idle_and_consistent(decode)


@pytest.mark.parametrize(("flags", "env_key", "message"), [
    (["--kv-transfer-port", "8300"], None, transfer_auth.KEY_ENV),
    (["--kv-offload-disk-source", "request"], "short", transfer_auth.KEY_ENV),
    (["--kv-transfer-port", "8300", "--kv-transfer-host", "bad host"], KEY, "kv_transfer_host 'bad host'"),
    (["--kv-transfer-port", "8300", "--kv-transfer-host", "h:1"], KEY, "kv_transfer_host 'h:1'"),
    (["--kv-transfer-host", "10.0.0.1"], KEY, "kv_transfer_host needs kv_transfer_port"),
    (["--kv-offload-disk-source", "tcp://h"], KEY, "tcp://HOST:PORT"),
    (["--kv-transfer-port", "70000"], KEY, "kv_transfer_port must be at most 65535"),
], ids=["port-without-key", "short-key", "host-with-space", "host-with-port", "host-without-port", "bad-url",
        "port-too-big"])
def test_pagoda_serve_refuses_a_transfer_it_cannot_run_in_one_line(model, tmp_path, flags, env_key, message):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != transfer_auth.KEY_ENV}
    if env_key is not None:
        env[transfer_auth.KEY_ENV] = env_key
    proc = subprocess.run([sys.executable, "-m", "pagoda_daemon", "serve", model, "--device", "cpu",
                           "--kv-offload-disk-path", str(tmp_path / "kv"), "--kv-offload-disk-gib", "0.01", *flags],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("url", ["tcp://bad host:80", "tcp://-h:80", "tcp://h_1:80", "tcp://%0a:80", "tcp://[zz::1]:80"])
def test_a_source_host_is_a_name_or_an_address(url):
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        transfer_auth.check_url(url)
    assert transfer_auth.check_url("tcp://[fd00::1]:80") == "tcp://[fd00::1]:80"
    assert transfer_auth.check_url("tcp://prefill-0.pd.ns.svc:8300") == "tcp://prefill-0.pd.ns.svc:8300"


def test_a_source_that_answers_slowly_cannot_hold_a_request_past_the_fetch_deadline(server, tmp_path, monkeypatch):
    """Each ask answered, but slowly: the fetch stops at its deadline with what arrived."""
    have = hashes_(transfer.MAX_BLOCKS_PER_ASK * 4)
    write_files(tmp_path / "served", have)
    answer = server.answer

    def slow(ask):
        time.sleep(0.4)
        return answer(ask)

    monkeypatch.setattr(server, "answer", slow)
    monkeypatch.setattr(transfer, "FETCH_DEADLINE_S", 0.6)
    remote = transfer.RemoteBlocks(f"tcp://127.0.0.1:{server.port}", KEY.encode(), 1, 1 << 20)
    started = time.monotonic()
    got = remote.fetch(have, tmp_path / "in")
    remote.close()
    assert time.monotonic() - started < 2.0
    assert 0 < len(got) < len(have) and got == have[: len(got)]


def test_a_prompt_asked_again_after_the_tier_lost_it_is_fetched_again(model, block_bytes, tmp_path):
    """A request waits for one fetch at most; a later request for the same prompt is another request."""
    prompts = workload(num_prefixes=1, repeats=1)
    reference = run(LLM(model, **ENGINE), prompts)
    with engines(model, block_bytes, tmp_path) as (prefill, decode, _):
        run(prefill, prompts)
        assert run(decode, prompts) == reference
        core = decode.engine.core
        for block_hash in list(core.connector.disk.files):
            core.connector.disk.forget(block_hash)
        for block_hash in list(core.connector.cpu.slots):  # and the host slots its reads landed in
            core.connector.cpu.remove(block_hash)
        core.kv_cache.reset_prefix_cache()
        assert run(decode, prompts) == reference
        assert decode.get_stats().kv_offload.fetched_bytes == 2 * 6 * block_bytes
