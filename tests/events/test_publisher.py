"""BatchPublisher and KvEventPublisher on real sockets: frames, sequence numbers, the replay
protocol byte for byte (raw DEALER), threading, bind/connect rules and closing."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from kvmesh.errors import ConfigError
from kvmesh.events.publisher import BatchPublisher, KvEventPublisher, should_bind
from kvmesh.events.wire import (
    MAX_REPLAY_REQUEST_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    pack_seq,
)
from tests.events.eventkit import free_tcp_port, make_batch

END = [b"", b"", b"\xff" * 8, b""]


@contextmanager
def raw_socket(kind: int, endpoint: str, *, bind: bool = False) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


@contextmanager
def subscribed(publisher: BatchPublisher) -> Iterator[zmq.Socket[bytes]]:
    """A raw SUB that is known to be connected: probe until the PUB's traffic reaches it."""
    with raw_socket(zmq.SUB, publisher.endpoint) as sub:
        time.sleep(0.2)  # subscription propagation; the tests below only need the later frames
        yield sub


def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask a replay socket for everything from ``start``, as a raw DEALER; return every answer."""
    answers = []
    with raw_socket(zmq.DEALER, endpoint) as dealer:
        dealer.send_multipart([b"", pack_seq(start)])
        while True:
            frames = dealer.recv_multipart()
            answers.append(frames)
            if frames == END:
                return answers


@pytest.fixture
def publisher(endpoint_factory: Callable[[str], str]) -> Iterator[BatchPublisher]:
    pub = BatchPublisher(
        endpoint_factory("pub"),
        replay_endpoint=endpoint_factory("replay"),
        topic="kv",
        buffer_batches=5,
        bind=True,
    )
    yield pub
    pub.close()


def test_sequence_numbers_and_pub_frames(publisher: BatchPublisher) -> None:
    assert publisher.last_seq is None
    with subscribed(publisher) as sub:
        seqs = [publisher.publish(make_batch(i)) for i in range(3)]
        assert seqs == [0, 1, 2] and publisher.last_seq == 2
        for i in range(3):
            assert sub.recv_multipart() == [b"kv", pack_seq(i), encode_batch(make_batch(i))]


def test_replay_answers_byte_exactly(publisher: BatchPublisher) -> None:
    for i in range(8):  # the buffer holds the last 5: seqs 3..7
        publisher.publish(make_batch(i))
    time.sleep(0.05)
    batch = lambda i: [b"", b"kv", pack_seq(i), encode_batch(make_batch(i))]  # noqa: E731
    assert publisher.replay_endpoint is not None
    assert replay(publisher.replay_endpoint, 5) == [batch(5), batch(6), batch(7), END]
    assert replay(publisher.replay_endpoint, 0) == [batch(3), batch(4), batch(5), batch(6), batch(7), END]
    assert replay(publisher.replay_endpoint, 8) == [END]
    assert replay(publisher.replay_endpoint, 2**64 - 2) == [END]


def test_replay_ignores_a_malformed_request_and_answers_the_next(publisher: BatchPublisher) -> None:
    publisher.publish(make_batch(0))
    assert publisher.replay_endpoint is not None
    with raw_socket(zmq.DEALER, publisher.replay_endpoint) as dealer:
        dealer.send_multipart([b"", b"not a seq"])
        dealer.send_multipart([b"", pack_seq(0), b"extra"])
        dealer.send_multipart([b"", pack_seq(0)])
        assert dealer.recv_multipart() == [b"", b"kv", pack_seq(0), encode_batch(make_batch(0))]
        assert dealer.recv_multipart() == END


def test_a_replay_request_past_its_limit_is_dropped_before_the_engine_holds_it(
    publisher: BatchPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who could reach the replay port made the engine hold what it sent: a 512 MiB
    request took a publisher's process to 4.1 GB before it was found malformed. ZMQ now drops such
    a peer's connection first; the request is never read, and other subscribers are served."""
    publisher.publish(make_batch(0))
    assert publisher.replay_endpoint is not None
    with caplog.at_level(logging.WARNING, logger="kvmesh.events"):
        with raw_socket(zmq.DEALER, publisher.replay_endpoint) as hostile:
            hostile.send_multipart([b"", b"\x00" * (MAX_REPLAY_REQUEST_BYTES + 1)])
            time.sleep(0.2)
            assert hostile.poll(300) == 0  # no answer of any kind
        assert replay(publisher.replay_endpoint, 0) == [
            [b"", b"kv", pack_seq(0), encode_batch(make_batch(0))],
            END,
        ]
    # (A request the publisher reads and finds malformed is logged: this one never reached it.)
    assert "malformed replay request" not in caplog.text


def test_concurrent_publishers_get_unique_ordered_sequences(publisher: BatchPublisher) -> None:
    with subscribed(publisher) as sub:
        results: list[list[int]] = [[] for _ in range(4)]

        def worker(k: int) -> None:
            for i in range(250):
                results[k].append(publisher.publish(make_batch(k * 1000 + i)))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(s for r in results for s in r) == list(range(1000))
        assert all(r == sorted(r) for r in results)
        received = [sub.recv_multipart() for _ in range(1000)]
    # On the wire in sequence order, and each sequence carries the batch that publish() returned it for.
    assert [int.from_bytes(f[1], "big") for f in received] == list(range(1000))
    by_seq = {s: k * 1000 + i for k, r in enumerate(results) for i, s in enumerate(r)}
    for frames in received:
        seq = int.from_bytes(frames[1], "big")
        assert decode_batch(frames[2]) == make_batch(by_seq[seq])


def test_publish_never_waits_for_the_network() -> None:
    # Nobody is listening on this address: a connecting PUB queues nothing and never blocks.
    with BatchPublisher(f"tcp://127.0.0.1:{free_tcp_port()}", bind=False) as pub:
        start = time.perf_counter()
        for i in range(20_000):
            pub.publish(make_batch(i))
        assert time.perf_counter() - start < 10  # generous: ~20k encodes; a blocking send would hang
        assert pub.last_seq == 19_999


def test_close_sends_what_is_queued_then_frees_the_address() -> None:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    pub = BatchPublisher(endpoint, bind=True)
    with raw_socket(zmq.SUB, endpoint) as sub:
        time.sleep(0.2)
        for i in range(2000):
            pub.publish(make_batch(i))
        pub.close()
        got = [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(2000)]
    assert got == list(range(2000))
    with pytest.raises(RuntimeError, match=r"^publisher is closed$"):
        pub.publish(make_batch(0))
    pub.close()  # idempotent
    deadline = time.monotonic() + 2
    while True:  # ZMQ's I/O thread releases the address shortly after the lingering close
        try:
            BatchPublisher(endpoint, bind=True).close()
            break
        except ConfigError:
            assert time.monotonic() < deadline, "the address was never released"
            time.sleep(0.02)


@pytest.mark.parametrize(
    ("endpoint", "bind"),
    [
        ("tcp://*:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv.sock", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://engine-3.local:5557", False),
    ],
)
def test_bind_rule_matches_the_engines(endpoint: str, bind: bool) -> None:
    assert should_bind(endpoint) is bind


def test_concrete_tcp_endpoint_connects_unless_told_to_bind() -> None:
    port = free_tcp_port()
    # A connecting publisher needs someone bound there; a raw SUB binds and receives.
    with (
        raw_socket(zmq.SUB, f"tcp://127.0.0.1:{port}", bind=True) as sub,
        BatchPublisher(f"tcp://127.0.0.1:{port}") as pub,
    ):
        deadline = time.monotonic() + 5
        while True:  # the first messages of a connecting PUB are lost (slow joiner): keep going
            pub.publish(make_batch(0))
            if sub.poll(20):
                break
            assert time.monotonic() < deadline
        assert len(sub.recv_multipart()) == 3
    with BatchPublisher("tcp://127.0.0.1:0", bind=True) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")


def test_inproc_endpoint() -> None:
    with BatchPublisher(
        "inproc://kvmesh-test-inproc", replay_endpoint="inproc://kvmesh-test-inproc-replay"
    ) as pub:
        pub.publish(make_batch(0))
        time.sleep(0.05)
        assert replay("inproc://kvmesh-test-inproc-replay", 0)[0][2] == pack_seq(0)


def test_bad_endpoints_raise_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"^KV-event endpoint 'tcp://nonsense' must look like tcp://host:port$"
    ):
        BatchPublisher("tcp://nonsense")
    with pytest.raises(
        ConfigError,
        match=r"^KV-event endpoint 'bogus://x' is not a ZMQ endpoint: tcp://host:port, ipc://path or inproc://name$",
    ):
        BatchPublisher("bogus://x")
    with pytest.raises(
        ConfigError, match=r"^cannot bind KV-event socket to 'bogus://x': Protocol not supported"
    ):
        BatchPublisher("tcp://127.0.0.1:0", bind=True, replay_endpoint="bogus://x")
    with pytest.raises(ConfigError, match=r"^buffer_batches must be at least 1, got 0$"):
        BatchPublisher("tcp://127.0.0.1:0", buffer_batches=0)


# --- KvEventPublisher -----------------------------------------------------------------------


@pytest.fixture
def kv_publisher(endpoint_factory: Callable[[str], str]) -> Iterator[KvEventPublisher]:
    with KvEventPublisher(
        endpoint_factory("pub"),
        replay_endpoint=endpoint_factory("replay"),
        block_size=4,
        data_parallel_rank=2,
        bind=True,
    ) as pub:
        yield pub


def replayed_batches(pub: KvEventPublisher) -> list[tuple[int, bytes]]:
    assert pub.replay_endpoint is not None
    time.sleep(0.05)
    return [(int.from_bytes(f[2], "big"), f[3]) for f in replay(pub.replay_endpoint, 0)[:-1]]


def test_one_batch_per_flush(kv_publisher: KvEventPublisher) -> None:
    assert kv_publisher.flush() is None  # nothing recorded, nothing sent
    kv_publisher.stored([11, 12], list(range(8)), parent_block_hash=10, lora_name="a")
    kv_publisher.removed([9], medium="CPU_PINNED")
    assert kv_publisher.flush() == 0
    kv_publisher.cleared()
    assert kv_publisher.flush() == 1 and kv_publisher.last_seq == 1
    (seq0, first), (seq1, second) = replayed_batches(kv_publisher)
    batch = decode_batch(first)
    assert (seq0, seq1) == (0, 1)
    assert batch.data_parallel_rank == 2 and abs(batch.ts - time.time()) < 60
    assert batch.events == [
        BlockStored(
            block_hashes=[11, 12],
            parent_block_hash=10,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name="a",
        ),
        BlockRemoved(block_hashes=[9], medium="CPU_PINNED"),
    ]
    assert decode_batch(second).events == [AllBlocksCleared()]


def test_events_carry_every_key_vllm_requires(kv_publisher: KvEventPublisher) -> None:
    # vLLM's decoder has no defaults for lora_id, medium and lora_name (BlockRemoved: medium).
    kv_publisher.stored([1], [0, 1, 2, 3])
    kv_publisher.removed([1])
    kv_publisher.flush()
    (_, payload) = replayed_batches(kv_publisher)[0]
    stored, removed = msgspec.msgpack.decode(payload)[1]
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert stored["lora_id"] is None and stored["medium"] == "GPU" and stored["lora_name"] is None
    assert removed == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}


def test_bytes_and_unsigned_hashes(kv_publisher: KvEventPublisher) -> None:
    kv_publisher.stored([2**64 - 1, b"\x07" * 32], list(range(8)), parent_block_hash=-(2**63))
    kv_publisher.flush()
    event = decode_batch(replayed_batches(kv_publisher)[0][1]).events[0]
    assert event.block_hashes == [2**64 - 1, b"\x07" * 32] and event.parent_block_hash == -(2**63)


def test_invalid_calls_raise_before_anything_is_published(kv_publisher: KvEventPublisher) -> None:
    with pytest.raises(ValueError, match=r"^stored\(\): 2 blocks of 4 tokens need 8 token ids, got 7$"):
        kv_publisher.stored([1, 2], list(range(7)))
    with pytest.raises(ValueError, match=r"^block hash 18446744073709551616 does not fit in 64 bits"):
        kv_publisher.stored([2**64], list(range(4)))
    with pytest.raises(TypeError, match=r"^a block hash must be an int or bytes, got str$"):
        kv_publisher.removed(["abc"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^a block hash must be an int or bytes, got bool$"):
        kv_publisher.stored([1], list(range(4)), parent_block_hash=True)
    with pytest.raises(ValueError, match=r"^at least one block hash is required$"):
        kv_publisher.removed([])
    assert kv_publisher.flush() is None and kv_publisher.last_seq is None
    with pytest.raises(ConfigError, match=r"^block_size must be at least 1, got 0$"):
        KvEventPublisher("tcp://127.0.0.1:0", block_size=0)


def test_close_flushes_pending_events(endpoint_factory: Callable[[str], str]) -> None:
    endpoint = endpoint_factory("pub")
    with raw_socket(zmq.SUB, endpoint) as sub:
        pub = KvEventPublisher(endpoint, block_size=4, bind=True)
        time.sleep(0.2)
        pub.removed([5])
        pub.close()
        frames = sub.recv_multipart()
    assert frames[1] == pack_seq(0) and decode_batch(frames[2]).events == [
        BlockRemoved(block_hashes=[5], medium="GPU")
    ]
