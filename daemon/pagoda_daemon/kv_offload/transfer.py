"""Prefill/decode disaggregation between hosts: a prefill instance serves its disk tier's block
files over TCP, and a decode instance fetches the blocks its tiers lack into its own disk tier.

The prefill instance (``kv_transfer_port``) runs a :class:`BlockServer`: a ZMQ ROUTER socket in a
thread of the engine core, reading files from ``kv_offload_disk_path`` as they are. The decode
instance (``kv_offload_disk_source tcp://HOST:PORT``) asks with :class:`RemoteBlocks` from a few
threads while the request waits and the batch runs on (``TieredConnector.arriving``); the files
it receives are written under its tier and adopted exactly as hard-linked ones are (disk.py:
header and identity checked before a lookup counts them, the payload's CRC when loaded; a load
that fails is recomputed). Both sides hold the same key (``PAGODA_KV_TRANSFER_KEY``), which never
crosses the wire: each ask is signed with it (HMAC-SHA256 over the ask and its time), so a server
that is not the prefill instance learns nothing it could ask with, and an ask more than
``MAX_CLOCK_SKEW_S`` old or unsigned is answered ``denied`` and reads no file.

Wire (ZMQ multipart, REQ to ROUTER; integers little-endian):

- ask:   ``[MAGIC, time, signature, hashes, ranks]``: the time in ms since the epoch (u64), the
  signature, up to ``MAX_BLOCKS_PER_ASK`` 32-byte block hashes concatenated, and the asking
  engine's number of ranks (u32).
- reply: ``[MAGIC, b"ok", count (u32) + stopped_at_a_miss (u8), files...]``: the leading
  ``count`` blocks the tier holds on every rank, each as ``ranks`` files (rank 0 first), up to
  ``MAX_REPLY_BYTES``; ``[MAGIC, b"denied"]`` for a wrong signature or time, ``[MAGIC, b"bad"]`` for anything
  else that does not parse.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq

from pagoda_daemon.engine.block_hash import BlockHash
from pagoda_daemon.kv_offload.disk import file_name, rank_dir, write_whole
from pagoda_daemon.kv_offload.transfer_auth import KEY_ENV, MAX_CLOCK_SKEW_S, check_url, is_fresh, now_ms
from pagoda_daemon.topology.pinning import pin_thread

log = logging.getLogger(__name__)

MAGIC = b"PAGODA-KVX1"
HASH_BYTES = 32  # engine/block_hash.py: SHA-256
MAX_BLOCKS_PER_ASK = 64
MAX_RANKS = 64  # config.py: at most 64 ranks
MAX_REPLY_BYTES = 64 << 20  # what one reply may carry (at least one block): a bounded buffer on both sides
MAX_ASK_BYTES = 8192  # an ask's largest frame, its 64 hashes, is 2 KiB: a bigger frame drops its connection
HEADER_SLACK_BYTES = 64 << 10  # a block file's header beside its payload, at most
ASK_TIMEOUT_S = 10.0  # one ask's round trip; a prefill instance that does not answer costs the request a recompute
# A whole fetch: a source that answers each ask just in time cannot hold a request much longer
# (a 32k-token prompt is 32 asks of 64 blocks of 16 tokens).
FETCH_DEADLINE_S = 60.0
# Block files read (server) and written (fetching side) a reply at a time by this many threads:
# one by one, a prompt's 235 MB crossed loopback at about 360 MB/s on an H100 host (2026-11-28,
# docs/benchmarks/2026-11-28-pd-between-hosts-h100.md), the files' I/O taking most of it.
FILE_THREADS = 4
_COUNT = struct.Struct("<IB")
_RANKS = struct.Struct("<I")
_TIME = struct.Struct("<Q")
DENIED_LOG_EVERY_S = 60.0


def sign(key: bytes, when: bytes, hashes: bytes, ranks: bytes) -> bytes:
    return hmac.new(key, MAGIC + when + hashes + ranks, hashlib.sha256).digest()


def signed_ask(key: bytes, hashes: bytes, ranks: int, now_s: float | None = None) -> list[bytes]:
    when = _TIME.pack(now_ms(now_s))
    ranks_frame = _RANKS.pack(ranks)
    return [MAGIC, when, sign(key, when, hashes, ranks_frame), hashes, ranks_frame]


class BlockServer:
    """Serves one engine's disk-tier block files to the engines that fetch them (a thread)."""

    def __init__(self, root: str, port: int, key: bytes, host: str = "*", cpu: int | None = None) -> None:
        """``cpu``: the core its thread runs on (the one kept for KV-transfer threads), if any."""
        self.root = root
        self._cpu = cpu
        self._key = key
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_ASK_BYTES)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a peer gone, or not reading: its reply is dropped
        self._socket.setsockopt(zmq.SNDHWM, 4 * (MAX_BLOCKS_PER_ASK * MAX_RANKS + 8))
        self._socket.bind(f"tcp://{host}:{port}")
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._closed = threading.Event()
        self._last_denied = 0.0
        self._readers = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="pagoda-kv-serve", initializer=pin_thread,
                                           initargs=(cpu,))
        self._thread = threading.Thread(target=self._serve, name="pagoda-kv-transfer", daemon=True)
        self._thread.start()
        log.info("KV transfer: serving the disk tier's blocks on port %d", self.port)

    def _serve(self) -> None:
        pin_thread(self._cpu)
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(200):
                continue
            frames = self._socket.recv_multipart()
            try:
                split = frames.index(b"")  # REQ's envelope: the peer's identity, then an empty frame
            except ValueError:
                continue  # not a REQ socket's message: nothing to answer to
            reply = self.answer(frames[split + 1 :])
            # a peer that left, or does not read its replies, loses this one: it asks again or recomputes
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send_multipart(frames[: split + 1] + reply, flags=zmq.NOBLOCK, copy=False)
        self._socket.close()
        self._context.term()

    def answer(self, ask: list[bytes]) -> list[bytes]:
        """The reply to one ask (see the module's docstring)."""
        if len(ask) != 5 or ask[0] != MAGIC or len(ask[1]) != _TIME.size:
            return [MAGIC, b"bad"]
        when, signature, hashes, ranks_frame = ask[1:]
        (sent_ms,) = _TIME.unpack(when)
        if not hmac.compare_digest(signature, sign(self._key, when, hashes, ranks_frame)) or not is_fresh(sent_ms):
            now = time.monotonic()
            if now - self._last_denied >= DENIED_LOG_EVERY_S:
                self._last_denied = now
                log.warning("KV transfer: an ask not signed with this instance's key, or older than %g s, was denied",
                            MAX_CLOCK_SKEW_S)
            return [MAGIC, b"denied"]
        if (not hashes or len(hashes) % HASH_BYTES or len(hashes) // HASH_BYTES > MAX_BLOCKS_PER_ASK
                or len(ranks_frame) != _RANKS.size):
            return [MAGIC, b"bad"]
        (ranks,) = _RANKS.unpack(ranks_frame)
        if not 1 <= ranks <= MAX_RANKS:
            return [MAGIC, b"bad"]
        chosen: list[list[Path]] = []  # the leading blocks that fit the reply, each rank's file
        size = 0
        miss = False
        for i in range(0, len(hashes), HASH_BYTES):
            name = file_name(hashes[i : i + HASH_BYTES])
            paths = [rank_dir(self.root, r).joinpath(name) for r in range(ranks)]
            try:
                block_size = sum(p.stat().st_size for p in paths)
            except OSError:  # not there (evicted, never saved, another layout): the fetch stops here
                miss = True
                break
            if chosen and size + block_size > MAX_REPLY_BYTES:
                break  # the rest in the next ask
            chosen.append(paths)
            size += block_size
        read = list(self._readers.map(_read_or_none, [p for block in chosen for p in block]))
        files: list[bytes] = []
        count = 0
        for b in range(len(chosen)):
            block = read[b * ranks : (b + 1) * ranks]
            if any(f is None for f in block):  # evicted since its size was read: the fetch stops here
                miss = True
                break
            files += [f for f in block if f is not None]
            count += 1
        return [MAGIC, b"ok", _COUNT.pack(count, miss), *files]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._readers.shutdown(wait=False, cancel_futures=True)


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


class RemoteBlocks:
    """Fetches blocks from a prefill instance's :class:`BlockServer`."""

    def __init__(self, url: str, key: bytes, ranks: int, block_bytes: int, timeout_s: float | None = None,
                 context: zmq.Context | None = None, writers: ThreadPoolExecutor | None = None) -> None:
        """``context``: shared with other sources (closed by its owner), else one of its own;
        ``writers``: the threads that write a reply's files (shared too), else the fetching one."""
        self.url = check_url(url)
        self._key = key
        self.ranks = ranks
        self.max_file_bytes = block_bytes + HEADER_SLACK_BYTES  # one rank's file: a bigger frame drops the reply
        self.timeout_ms = int((ASK_TIMEOUT_S if timeout_s is None else timeout_s) * 1000)
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._writers = writers
        self._warned = 0.0

    def fetch(self, hashes: list[BlockHash], into: Path) -> list[BlockHash]:
        """The leading blocks of ``hashes`` the source holds, written as files under
        ``into/rank<r>/`` (each whole or absent). Stops at the first block the source lacks, and
        on a timeout, a refusal or a reply that does not parse (what came before stays). Never
        raises: a fetch that fails is a miss, and the request computes its prompt."""
        got: list[BlockHash] = []
        socket = None
        try:
            socket = self._context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)  # RCVTIMEO per ask, within the fetch's deadline
            socket.setsockopt(zmq.MAXMSGSIZE, self.max_file_bytes)
            socket.connect(self.url)
            for r in range(self.ranks):
                rank_dir(into, r).mkdir(parents=True, exist_ok=True)
            deadline = time.monotonic() + FETCH_DEADLINE_S
            while len(got) < len(hashes):
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    self._warn(f"the fetch took more than {FETCH_DEADLINE_S:g} s; the rest is computed here")
                    break
                socket.setsockopt(zmq.RCVTIMEO, min(self.timeout_ms, left_ms))
                ask = hashes[len(got) : len(got) + MAX_BLOCKS_PER_ASK]
                socket.send_multipart(signed_ask(self._key, b"".join(ask), self.ranks))
                count, miss, files = self._parse(socket.recv_multipart(copy=False), len(ask))
                targets = [rank_dir(into, r) / file_name(ask[i]) for i in range(count) for r in range(self.ranks)]
                buffers = [f.buffer for f in files]
                if self._writers is not None:
                    list(self._writers.map(write_whole, targets, buffers))  # raises the first write's error
                else:
                    for target, buffer in zip(targets, buffers, strict=True):
                        write_whole(target, buffer)
                got += ask[:count]
                if miss or count == 0:
                    break
        except zmq.Again:
            self._warn(f"no answer within {self.timeout_ms / 1000:g} s")
        except zmq.ContextTerminated:
            pass  # the engine is shutting down
        except (zmq.ZMQError, OSError, ValueError) as e:
            self._warn(str(e))
        finally:
            if socket is not None:
                socket.close()
        return got

    def _parse(self, reply: list, asked: int) -> tuple[int, bool, list]:
        if len(reply) >= 2 and reply[0].bytes == MAGIC and reply[1].bytes == b"denied":
            raise ValueError(f"{self.url} denied the ask ({KEY_ENV} differs between the instances, or their clocks "
                             f"by more than {MAX_CLOCK_SKEW_S:g} s)")
        if len(reply) < 3 or reply[0].bytes != MAGIC or reply[1].bytes != b"ok" or len(reply[2]) != _COUNT.size:
            raise ValueError(f"{self.url} sent a reply that does not parse")
        count, miss = _COUNT.unpack(reply[2].bytes)
        if count > asked or len(reply) != 3 + count * self.ranks:
            raise ValueError(f"{self.url} sent {len(reply) - 3} files for {count} of {asked} blocks")
        return count, bool(miss), reply[3:]

    def _warn(self, why: str) -> None:
        now = time.monotonic()
        if now - self._warned >= DENIED_LOG_EVERY_S:
            self._warned = now
            log.warning("KV transfer from %s failed (%s): the prompts it was for are computed here", self.url, why)

    def close(self) -> None:
        """End every fetch at once: an ask waiting for its answer returns (ETERM), its socket closes."""
        if self._own_context:
            self._context.term()

