"""KVEventPublisher over real ZMQ sockets on loopback: the wire format (vLLM's tagged arrays),
sequence numbers a subscriber can check for gaps, and replay of missed batches."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from pagoda_daemon.engine.block_hash import hash_block_tokens
from pagoda_daemon.telemetry.kv_events import (
    END_SEQ,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    block_hash_to_int,
    decode_batch,
)

TOPIC = "kv-events"
DEADLINE_S = 5.0


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def subscribe(ctx, pub: KVEventPublisher, topic: str = TOPIC) -> zmq.Socket:
    """A SUB socket that is known to receive: beat the slow-joiner problem by publishing
    AllCleared probes until one arrives (bounded), then drain the probes."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert time.monotonic() < deadline, "subscriber never received a probe"
        pub.publish([AllCleared()])
        if sub.poll(20):
            break
    last_probe = pub.next_seq - 1
    while True:  # drain every probe still in flight
        assert sub.poll(int(DEADLINE_S * 1000)), "probe lost"
        seq, _, events = decode_batch(sub.recv_multipart())
        assert events == [AllCleared()]
        if seq == last_probe:
            return sub


def recv(sub: zmq.Socket) -> list[bytes]:
    assert sub.poll(int(DEADLINE_S * 1000)), "no message within the deadline"
    return sub.recv_multipart()


def chain(tokens: list[int], block_size: int, extra=()) -> list[bytes]:
    hashes, parent = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[i : i + block_size], extra)
        hashes.append(parent)
    return hashes


def test_block_hash_to_int_matches_vllm_conversion():
    (h,) = chain(list(range(16)), 16)
    assert len(h) == 32
    n = block_hash_to_int(h)
    assert 0 <= n < 2**64
    assert n == int.from_bytes(h, "big") & (2**64 - 1) == int.from_bytes(h[-8:], "big")
    assert block_hash_to_int(b"\xff" * 32) == 2**64 - 1


def test_publish_subscribe_wire_format_and_sequence(ctx):
    with KVEventPublisher("tcp://127.0.0.1:*", topic=TOPIC) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        sub = subscribe(ctx, pub)

        tokens = list(range(100, 148))  # three blocks of 16
        hashes = [block_hash_to_int(h) for h in chain(tokens, 16)]
        stored = BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=16,
            extra_keys=[("salt-1",), None, None],
        )
        more = BlockStored(hashes[2:], hashes[1], tokens[32:], 16, None)
        batches = [
            [stored],
            [BlockRemoved(hashes[1:]), more],
            [AllCleared()],
        ]
        first_seq = pub.next_seq
        before = time.time()
        pub.publish([])  # nothing sent, no sequence number used
        assert pub.next_seq == first_seq
        for batch in batches:
            pub.publish(batch)

        received = [recv(sub) for _ in batches]
        assert not sub.poll(50), "the empty publish must send nothing"

        # Raw frames: topic, 8-byte big-endian seq, msgpack [ts, events, dp_rank].
        topic, seq_bytes, payload = received[0]
        assert topic == TOPIC.encode()
        assert len(seq_bytes) == 8 and int.from_bytes(seq_bytes, "big") == first_seq
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert before <= ts <= time.time() and dp_rank == 0
        assert events == [
            ["BlockStored", hashes, None, tokens, 16, None, "GPU", None, [["salt-1"], None, None]]
        ]
        assert msgpack.unpackb(received[1][2])[1][0] == ["BlockRemoved", hashes[1:], "GPU"]
        assert msgpack.unpackb(received[2][2])[1] == [["AllBlocksCleared"]]

        # Decoded: consecutive sequence numbers and the same events back.
        decoded = [decode_batch(frames) for frames in received]
        assert [seq for seq, _, _ in decoded] == [first_seq, first_seq + 1, first_seq + 2]
        stored_back = decoded[0][2][0]
        assert stored_back.block_hashes == hashes and stored_back.extra_keys == [["salt-1"], None, None]
        assert decoded[1][2] == [BlockRemoved(hashes[1:]), more]
        assert decoded[2][2] == [AllCleared()]
        sub.close()


def test_subscriber_filters_by_topic(ctx):
    with KVEventPublisher("tcp://127.0.0.1:*", topic="pod-a") as pub:
        wanted = subscribe(ctx, pub, topic="pod-a")
        other = ctx.socket(zmq.SUB)
        other.setsockopt(zmq.LINGER, 0)
        other.setsockopt_string(zmq.SUBSCRIBE, "pod-b")
        other.connect(pub.endpoint)
        time.sleep(0.1)
        pub.publish([BlockRemoved([1, 2])])
        assert decode_batch(recv(wanted))[2] == [BlockRemoved([1, 2])]
        assert not other.poll(100)
        wanted.close()
        other.close()


def test_replay_returns_missed_batches(ctx):
    with KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        assert pub.replay_endpoint is not None
        for i in range(5):  # nobody listening: these are "missed"
            pub.publish([BlockRemoved([i])])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        got = []
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert time.monotonic() < deadline
            assert dealer.poll(int(DEADLINE_S * 1000)), "replay did not answer"
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                assert payload == b""
                break
            got.append(decode_batch([seq_bytes, payload]))
        assert [seq for seq, _, _ in got] == [2, 3, 4]
        assert [events for _, _, events in got] == [
            [BlockRemoved([2])],
            [BlockRemoved([3])],
            [BlockRemoved([4])],
        ]
        dealer.close()


# vLLM's subscriber types (vllm/distributed/kv_events.py, msgspec structs: tagged, array_like),
# written out here so the test needs msgspec only, not vLLM.
try:
    import msgspec
except ImportError:  # optional: the compatibility test skips
    msgspec = None

if msgspec is not None:

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStoredV(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None
        extra_keys: list[tuple | None] | None = None

    class BlockRemovedV(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStoredV | BlockRemovedV | AllBlocksCleared]

    # An older vLLM subscriber (before lora_name/extra_keys) must still read BlockStored.
    class BlockStoredOld(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class OldBatch(EventBatch):
        events: list[BlockStoredOld | BlockRemovedV | AllBlocksCleared]


def test_vllm_msgspec_decoder_reads_our_payload(ctx):
    """vLLM's subscribers decode with msgspec structs (array_like, tagged); ours must decode."""
    if msgspec is None:
        pytest.skip("msgspec is not installed")
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        sub = subscribe(ctx, pub)
        h = 2**64 - 5  # uint64 range survives
        pub.publish(
            [BlockStored([h], 7, list(range(16)), 16, [("salt", 3)]), BlockRemoved([h]), AllCleared()]
        )
        _, _, payload = recv(sub)
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
        assert batch.data_parallel_rank == 0
        stored, removed, cleared = batch.events
        assert stored.block_hashes == [h] and stored.parent_block_hash == 7 and stored.block_size == 16
        assert stored.medium == "GPU" and stored.lora_id is None and stored.extra_keys == [("salt", 3)]
        assert removed.block_hashes == [h] and removed.medium == "GPU"
        assert isinstance(cleared, AllBlocksCleared)
        old = msgspec.msgpack.Decoder(OldBatch).decode(payload)
        assert old.events[0].token_ids == list(range(16))
        sub.close()


def test_misaligned_extra_keys_rejected():
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        with pytest.raises(ValueError, match="one per block"):
            pub.publish([BlockStored([1, 2], None, list(range(32)), 16, [None])])
        assert pub.next_seq == 0


def test_bind_failure_is_clear():
    with KVEventPublisher("tcp://127.0.0.1:*") as pub, pytest.raises(OSError, match="cannot bind"):
        KVEventPublisher(pub.endpoint)


def test_close_is_idempotent_and_publish_after_close_is_dropped():
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    pub.close()
    pub.close()
    pub.publish([AllCleared()])
    assert pub.next_seq == 0


def test_concurrent_publishers_keep_sequence_in_order(ctx):
    """publish() from several threads: every batch arrives, numbered consecutively in send order."""
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        sub = subscribe(ctx, pub)
        first = pub.next_seq
        threads = [
            threading.Thread(target=lambda t=t: [pub.publish([BlockRemoved([t, i])]) for i in range(50)])
            for t in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=DEADLINE_S)
        got = [decode_batch(recv(sub)) for _ in range(200)]
        assert [seq for seq, _, _ in got] == list(range(first, first + 200))
        by_thread = {}
        for _, _, (event,) in got:
            by_thread.setdefault(event.block_hashes[0], []).append(event.block_hashes[1])
        assert by_thread == {t: list(range(50)) for t in range(4)}
        sub.close()
