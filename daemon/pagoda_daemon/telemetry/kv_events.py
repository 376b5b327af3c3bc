"""KV-cache events on a ZMQ PUB socket, in vLLM's wire format, for KV-aware routers.

Off by default; the daemon creates a `KVEventPublisher` only with `--kv-events-endpoint`.
The events carry prompt token ids and `cache_salt` values in clear, so an endpoint without
a host (`5557`, `tcp://:5557`) binds loopback; all interfaces (`tcp://*:5557`) must be asked for.
Each `publish()` call sends one batch as a three-frame message

    [topic, seq (8 bytes, big-endian unsigned), msgpack([timestamp, [event, ...], data_parallel_rank])]

where each event is a msgpack array whose first item names its type (vLLM's msgspec
"tagged array_like" structs):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

`seq` starts at 0 and grows by one per batch, so a subscriber that sees a jump knows it
lost batches (PUB drops messages for slow subscribers) and can ask the optional replay
socket (ROUTER) for them. docs/kv-events.md is the full description.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import zmq

from pagoda_daemon.engine.block_pool import GPU

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_ENDPOINT = f"tcp://{DEFAULT_HOST}:5557"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # replay: "no more batches"
_U64 = (1 << 64) - 1


def block_hash_to_int(h: bytes) -> int:
    """A 32-byte SHA-256 block hash as an unsigned 64-bit int: its last 8 bytes, big-endian.

    This is vLLM's own conversion (`int.from_bytes(h, "big") & (2**64 - 1)`, used when
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is on), so routers that index vLLM's int hashes
    index ours the same way.
    """
    return int.from_bytes(h, "big") & _U64


def resolve_endpoint(endpoint: str) -> str:
    """The address to bind: a bare port (`5557`) or a TCP endpoint without a host
    (`tcp://:5557`) means loopback; anything else is bound as given."""
    if endpoint.isdigit():
        return f"tcp://{DEFAULT_HOST}:{endpoint}"
    if endpoint.startswith("tcp://:"):
        return f"tcp://{DEFAULT_HOST}{endpoint.removeprefix('tcp://')}"
    return endpoint


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Where data-parallel engine `data_parallel_rank` publishes (vLLM's rule): a TCP port
    plus the rank, an IPC path with `_dp<rank>` appended; engine 0 at the endpoint as given.
    A port of `*` (pick a free one) stays as it is."""
    endpoint = resolve_endpoint(endpoint)
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    address, _, port = endpoint.rpartition(":")
    if port.isdigit():
        if int(port) + data_parallel_rank > 65535:
            raise ValueError(f"KV events endpoint {endpoint}: port {port} + data-parallel rank "
                             f"{data_parallel_rank} is above 65535")
        return f"{address}:{int(port) + data_parallel_rank}"
    return endpoint


def binds_all_interfaces(endpoint: str) -> bool:
    return endpoint.startswith(("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"))


@dataclass
class BlockStored:
    """Full blocks that entered the prefix cache, in chain order; `parent_block_hash` is the
    hash of the block before `block_hashes[0]` (None for a prompt's first block).
    `token_ids` holds `block_size` tokens per block, concatenated. `extra_keys`, if given,
    has one entry per block (None where the block hashed no extra keys)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    extra_keys: list | None = None
    medium: str = GPU  # GPU: the device cache, whatever the device; CPU, DISK: offload tiers


@dataclass
class BlockRemoved:
    """Blocks evicted from the prefix cache or an offload tier (their hash dropped there)."""

    block_hashes: list[int]
    medium: str = GPU


@dataclass
class AllCleared:
    """Every cached block is gone (cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllCleared


def _encode_event(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        extra = event.extra_keys
        if extra is not None and len(extra) != len(event.block_hashes):
            raise ValueError(
                f"extra_keys has {len(extra)} entries for {len(event.block_hashes)} blocks; "
                "it must have one per block"
            )
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,  # lora_id (deprecated in vLLM; Pagoda has no LoRA)
            event.medium,
            None,  # lora_name
            None if extra is None else list(extra),  # one entry (array or nil) per block
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    if isinstance(event, AllCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def _decode_event(item: list) -> KVEvent:
    tag = item[0]
    if tag == "BlockStored":
        extra = item[8] if len(item) > 8 else None
        return BlockStored(
            block_hashes=list(item[1]),
            parent_block_hash=item[2],
            token_ids=list(item[3]),
            block_size=item[4],
            extra_keys=None if extra is None else list(extra),
            medium=item[6] if len(item) > 6 and item[6] is not None else GPU,
        )
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(item[1]), medium=item[2] if len(item) > 2 and item[2] else GPU)
    if tag == "AllBlocksCleared":
        return AllCleared()
    raise ValueError(f"unknown KV event type {tag!r}")


def encode_payload(events: Sequence[KVEvent], timestamp: float, data_parallel_rank: int = 0) -> bytes:
    return msgpack.packb(
        [timestamp, [_encode_event(e) for e in events], data_parallel_rank], use_bin_type=True
    )


def decode_batch(frames: Sequence[bytes]) -> tuple[int, float, list[KVEvent]]:
    """(seq, timestamp, events) from a received message.

    Takes the three PUB frames [topic, seq, payload], or the two-frame [seq, payload] (what a
    replay reply holds after its empty delimiter). Events come back as the dataclasses above.
    """
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2:
        raise ValueError(f"expected [topic,] seq, payload frames, got {len(frames)} frames")
    seq_frame, payload = (bytes(f) for f in frames)
    seq = int.from_bytes(seq_frame, "big", signed=True)
    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    timestamp, events = body[0], body[1]
    return seq, float(timestamp), [_decode_event(e) for e in events]


class KVEventPublisher:
    """Binds a PUB socket and publishes batches of KV events; optionally serves replays.

    `publish` never blocks: messages beyond the socket's high-water mark are dropped by ZMQ
    (the subscriber sees the gap in `seq` and can replay). It may be called from any thread.
    `endpoint` goes through `resolve_endpoint` (no host: loopback); `tcp://127.0.0.1:*`
    picks a free port, and `self.endpoint` is then the address actually bound.

    Replay (with `replay_endpoint`): a DEALER (or REQ) client sends [b"", seq (8 bytes,
    big-endian)]; the publisher answers, for every buffered batch with seq >= the asked one,
    [b"", seq, payload], then [b"", -1 (8 bytes, signed), b""]. The last `buffer_steps`
    batches are kept.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "kv-events",
        replay_endpoint: str | None = None,
        *,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.topic = topic
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 200)
        endpoint = resolve_endpoint(endpoint)
        if binds_all_interfaces(endpoint):
            logger.warning("KV events on %s reach every network interface; they carry prompt token ids "
                           "(restrict who may connect, e.g. with a NetworkPolicy)", endpoint)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            self._ctx.term()
            raise OSError(f"cannot bind the KV events socket to {endpoint}: {e}") from e
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.dropped = 0  # batches ZMQ refused at the high-water mark
        self._closed = False

        self.replay_endpoint: str | None = None
        self._replay_thread: threading.Thread | None = None
        self._stop = threading.Event()
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            replay_endpoint = resolve_endpoint(replay_endpoint)
            try:
                router.bind(replay_endpoint)
            except zmq.ZMQError as e:
                router.close(linger=0)
                self.close()
                raise OSError(f"cannot bind the KV events replay socket to {replay_endpoint}: {e}") from e
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            # The ROUTER socket lives in the replay thread only (ZMQ sockets are not thread-safe).
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[BlockStored | BlockRemoved | AllCleared]) -> None:
        """Send `events` as one batch with the next sequence number. An empty list sends nothing."""
        if not events or self._closed:
            return
        payload = encode_payload(events, time.time(), self._dp_rank)
        with self._lock:
            if self._closed:  # closed while we encoded
                return
            seq = self._seq
            self._seq += 1
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1
            self._buffer.append((seq, payload))

    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    logger.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
                    continue
                client, _, start_bytes = frames
                start = int.from_bytes(start_bytes, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for seq, payload in batches:
                    router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                router.send_multipart((client, b"", END_SEQ, b""))
        except zmq.ZMQError as e:  # pragma: no cover - context torn down under us
            if not self._stop.is_set():
                logger.warning("KV events replay thread stopped: %s", e)
        finally:
            router.close(linger=0)

    def close(self) -> None:
        """Stop the replay thread, close the sockets (queued batches get 200 ms to leave)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pub.close()
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2.0)
        self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
