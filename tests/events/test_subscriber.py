"""EventSubscriber against real publishers on loopback tcp and ipc: every batch exactly once and
in order through late starts, disconnects, lossy links, slow joiners, restarts and bad input."""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
import zmq

from kvmesh.errors import ConfigError
from kvmesh.events import readiness
from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import encode_batch, pack_seq
from tests.events.eventkit import Collector, LossyRelay, drop_5_percent, free_tcp_port, make_batch

N = 10_000
Endpoints = Callable[[str], str]


@asynccontextmanager
async def running(subscriber: EventSubscriber) -> AsyncIterator[EventSubscriber]:
    subscriber.start()
    try:
        yield subscriber
    finally:
        await subscriber.stop()


@contextmanager
def publisher(endpoint: str, replay: str | None = None, **kwargs: object) -> Iterator[BatchPublisher]:
    kwargs.setdefault("bind", True)
    pub = BatchPublisher(endpoint, replay_endpoint=replay, **kwargs)  # type: ignore[arg-type]
    try:
        yield pub
    finally:
        pub.close()


async def _publish_from_zero(pub: BatchPublisher, got: Collector, n: int) -> None:
    """Batches 0..n-1, once the subscriber is connected, and wait until it has them."""
    await asyncio.sleep(0.1)
    for i in range(n):
        pub.publish(make_batch(i))
    await got.wait_for(n)


@contextmanager
def restarted_publisher(endpoint: str, replay: str) -> Iterator[BatchPublisher]:
    """A new publisher on the addresses of one just closed. ZMQ releases a closed socket's
    listening address a moment later, in its I/O thread, so binding is retried briefly."""
    for _ in range(100):
        try:
            pub = BatchPublisher(endpoint, replay_endpoint=replay, bind=True)
            break
        except ConfigError:
            time.sleep(0.02)
    else:
        raise AssertionError(f"{endpoint} was not released")
    try:
        yield pub
    finally:
        pub.close()


def expected(seqs: range | list[int], salt: int = 0) -> list[tuple[int, object]]:
    return [(i, make_batch(i, salt=salt)) for i in seqs]


async def wait_sent(pub: BatchPublisher, seq: int) -> None:
    """Wait until the sender thread has put ``seq`` on the wire: publish() only queues it, and a
    test that means "before the subscriber connected" must know it has left. The replay socket
    answers from the same thread, after sending, so it is the witness."""
    assert pub.replay_endpoint is not None
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        for _ in range(500):
            dealer.send_multipart([b"", pack_seq(seq)])
            while True:
                assert dealer.poll(5000)
                frames = dealer.recv_multipart()
                if frames[2] == pack_seq(seq):
                    return
                if frames[2] == b"\xff" * 8:
                    break
            await asyncio.sleep(0.01)
        raise AssertionError(f"seq {seq} was never sent")
    finally:
        dealer.close(linger=0)


async def publish_paced(pub: BatchPublisher, seqs: range, *, every: int = 500, salt: int = 0) -> None:
    """Publish, yielding to the event loop now and then so the subscriber runs concurrently."""
    for i in seqs:
        assert pub.publish(make_batch(i, salt=salt)) == i
        if i % every == 0:
            await asyncio.sleep(0.001)


# --- 10,000 batches, exactly once and in order ----------------------------------------------


async def test_late_subscriber_replays_what_it_missed(endpoint_factory: Endpoints) -> None:
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        for i in range(N // 2):
            pub.publish(make_batch(i))
        await wait_sent(pub, N // 2 - 1)
        sub = EventSubscriber(
            pub.endpoint, got.on_batch, replay_endpoint=pub.replay_endpoint, on_reset=got.on_reset
        )
        async with running(sub):
            await asyncio.sleep(0.1)  # connected, but the first half is long gone from the PUB socket
            await publish_paced(pub, range(N // 2, N))
            await got.wait_for(N)
            await asyncio.sleep(0.05)  # nothing more, nothing twice
    assert got.batches == expected(range(N))
    assert got.resets == []
    assert sub.stats.gaps >= 1 and sub.stats.replayed >= N // 2
    assert sub.stats.delivered == N and sub.stats.malformed == 0 and sub.stats.unrecoverable == 0


async def test_disconnect_mid_stream_then_reconnect(endpoint_factory: Endpoints) -> None:
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        sub = EventSubscriber(
            pub.endpoint, got.on_batch, replay_endpoint=pub.replay_endpoint, on_reset=got.on_reset
        )
        async with running(sub):
            await asyncio.sleep(0.1)
            await publish_paced(pub, range(3000))
            await got.wait_for(3000)
        # Disconnected: these go nowhere.
        await publish_paced(pub, range(3000, 7000))
        async with running(sub):
            # Catches up through the replay socket at once, before any new live batch.
            await got.wait_for(7000)
            await publish_paced(pub, range(7000, N))
            await got.wait_for(N)
            await asyncio.sleep(0.05)
    assert got.batches == expected(range(N))
    assert got.resets == [] and sub.stats.replayed >= 4000


async def test_lossy_link_is_repaired_through_replay(endpoint_factory: Endpoints) -> None:
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        relay = LossyRelay(pub.endpoint, endpoint_factory("relay"), drop=drop_5_percent(N - 1))
        try:
            sub = EventSubscriber(
                relay.endpoint, got.on_batch, replay_endpoint=pub.replay_endpoint, on_reset=got.on_reset
            )
            async with running(sub):
                await asyncio.sleep(0.2)  # relay and subscriber both connected
                await publish_paced(pub, range(N), every=50)
                await got.wait_for(N, timeout=30)
                while relay.highest_seen < N - 1:  # replays may outrun the relay itself
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)
        finally:
            relay.close()
    assert relay.dropped == [s for s in range(N - 1) if s % 20 == 7]
    assert got.batches == expected(range(N))
    assert got.resets == []
    assert sub.stats.replayed >= len(relay.dropped) and sub.stats.gaps >= 1


# --- joining, restarting, resuming ----------------------------------------------------------


async def test_slow_joiner_publisher_connecting_to_a_bound_subscriber(endpoint_factory: Endpoints) -> None:
    got = Collector()
    endpoint, replay = endpoint_factory("sub"), endpoint_factory("replay")
    sub = EventSubscriber(endpoint, got.on_batch, replay_endpoint=replay, bind=True, on_reset=got.on_reset)
    # The engine connects and publishes before the router has bound its address: ZMQ drops those.
    with publisher(endpoint, replay, bind=False) as pub:
        for i in range(100):
            pub.publish(make_batch(i))
        await asyncio.sleep(0.05)  # sent into the void
        async with running(sub):
            for i in range(100, 300):  # over ~1 s: ZMQ reconnects every 100 ms
                pub.publish(make_batch(i))
                await asyncio.sleep(0.005)
            await got.wait_for(300)
            await asyncio.sleep(0.05)
    assert got.batches == expected(range(300))
    assert got.resets == [] and sub.stats.replayed >= 100


async def test_publisher_restart_resets_then_follows_the_new_stream(endpoint_factory: Endpoints) -> None:
    got = Collector()
    endpoint, replay = endpoint_factory("pub"), endpoint_factory("replay")
    with publisher(endpoint, replay) as first:
        sub = EventSubscriber(endpoint, got.on_batch, replay_endpoint=replay, on_reset=got.on_reset)
        sub.start()
        await asyncio.sleep(0.1)
        await publish_paced(first, range(50), salt=1)
        await got.wait_for(50)
    try:
        with restarted_publisher(endpoint, replay) as second:  # same addresses, seq from 0 again
            for i in range(30):
                second.publish(make_batch(i, salt=2))
                await asyncio.sleep(0.02)
            await got.wait_for(80)
            await asyncio.sleep(0.05)
    finally:
        await sub.stop()
    assert got.batches == expected(range(50), salt=1) + expected(range(30), salt=2)
    assert len(got.resets) == 1
    assert got.resets[0].startswith("publisher restarted: sequence went back from 49 to ")
    assert sub.stats.restarts == 1


async def test_gap_beyond_the_replay_buffer_is_reported_unrecoverable(endpoint_factory: Endpoints) -> None:
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay"), buffer_batches=10) as pub:
        for i in range(100):
            pub.publish(make_batch(i))
        await wait_sent(pub, 99)
        sub = EventSubscriber(
            pub.endpoint, got.on_batch, replay_endpoint=pub.replay_endpoint, on_reset=got.on_reset
        )
        async with running(sub):
            await asyncio.sleep(0.1)
            pub.publish(make_batch(100))  # reveals the gap; the buffer now holds 91..100
            await got.wait_for(10)
            await asyncio.sleep(0.05)
    assert got.resets == ["gap: seqs 0..90 are no longer in the publisher's replay buffer; unrecoverable"]
    assert got.batches == expected(range(91, 101))
    assert sub.stats.unrecoverable == 1


async def test_gap_without_a_replay_endpoint(endpoint_factory: Endpoints) -> None:
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        for i in range(5):
            pub.publish(make_batch(i))
        await wait_sent(pub, 4)
        sub = EventSubscriber(
            pub.endpoint, got.on_batch, on_reset=got.on_reset
        )  # not told of the replay socket
        async with running(sub):
            await asyncio.sleep(0.1)
            pub.publish(make_batch(5))
            pub.publish(make_batch(6))
            await got.wait_for(2)
    assert got.resets == ["gap: expected seq 0, got 5; unrecoverable without a replay endpoint"]
    assert got.batches == expected([5, 6])


async def test_live_only_subscriber_starts_with_the_first_batch_it_sees(endpoint_factory: Endpoints) -> None:
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        for i in range(5):
            pub.publish(make_batch(i))
        await wait_sent(pub, 4)
        sub = EventSubscriber(
            pub.endpoint, got.on_batch, replay_endpoint=pub.replay_endpoint, from_beginning=False
        )
        async with running(sub):
            await asyncio.sleep(0.1)
            pub.publish(make_batch(5))
            pub.publish(make_batch(6))
            await got.wait_for(2)
            await asyncio.sleep(0.05)
    assert got.batches == expected([5, 6]) and sub.stats.replayed == 0


async def test_resume_from_catches_up_at_once_even_when_idle(endpoint_factory: Endpoints) -> None:
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        for i in range(20):
            pub.publish(make_batch(i))
        sub = EventSubscriber(
            pub.endpoint, got.on_batch, replay_endpoint=pub.replay_endpoint, on_reset=got.on_reset
        )
        sub.resume_from(9)  # e.g. the last_seq of a kv_state snapshot
        async with running(sub):
            await got.wait_for(10)  # no new batch was published: the replay came unasked
            await asyncio.sleep(0.1)
            pub.publish(make_batch(20))
            await got.wait_for(11)
    assert got.batches == expected(range(10, 21)) and got.resets == []


async def test_quiet_stream_probes_ask_through_one_replay_connection(
    endpoint_factory: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A router probes each quiet stream at every health check: a replay from the next sequence,
    # which the publisher answers with its end marker alone when nothing was missed.
    dealers = 0
    real_socket = zmq.Context.socket

    def counting_socket(self: zmq.Context[zmq.Socket[bytes]], kind: int, **kw: object) -> object:
        nonlocal dealers
        dealers += kind == zmq.DEALER
        return real_socket(self, kind, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(zmq.Context, "socket", counting_socket)
    got = Collector()
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        sub = EventSubscriber(pub.endpoint, got.on_batch, replay_endpoint=pub.replay_endpoint)
        async with running(sub):
            await _publish_from_zero(pub, got, 3)
            for probe in range(1, 6):
                assert sub.expected_seq is not None
                sub.resume_from(sub.expected_seq - 1)  # what the health check's probe does
                deadline = time.monotonic() + 5
                while sub.stats.replays < probe:
                    assert time.monotonic() < deadline, "the probe's replay never ended"
                    await asyncio.sleep(0.005)
            pub.publish(make_batch(3))  # and the stream goes on
            await got.wait_for(4)
    assert dealers == 1
    assert got.batches == expected(range(4)) and sub.stats.replayed == 0


async def test_resume_from_an_older_snapshot_redelivers_from_history_without_a_replay_endpoint(
    endpoint_factory: Endpoints,
) -> None:
    # After a reset the owner loads a kv_state snapshot taken at seq 2 while the stream had already
    # delivered up to 5, and resumes from 2: batches 3..5 must be applied again on top of the
    # snapshot. Without a replay socket (vLLM's default), only the subscriber still has them;
    # without them the next live batch is a gap, and the owner resets and re-syncs again.
    got = Collector()
    with publisher(endpoint_factory("pub")) as pub:
        sub = EventSubscriber(pub.endpoint, got.on_batch, on_reset=got.on_reset)
        async with running(sub):
            await _publish_from_zero(pub, got, 6)
            sub.resume_from(2)
            await got.wait_for(9)
            pub.publish(make_batch(6))
            await got.wait_for(10)
            await asyncio.sleep(0.05)
    assert got.batches == expected([0, 1, 2, 3, 4, 5, 3, 4, 5, 6])
    assert got.resets == [] and sub.stats.gaps == 0


async def test_replay_endpoint_that_never_answers(endpoint_factory: Endpoints) -> None:
    got = Collector()
    silent_replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        for i in range(5):
            pub.publish(make_batch(i))
        await wait_sent(pub, 4)
        sub = EventSubscriber(
            pub.endpoint,
            got.on_batch,
            replay_endpoint=silent_replay,
            on_reset=got.on_reset,
            replay_timeout=0.1,
            replay_attempts=3,
        )
        async with running(sub):
            await asyncio.sleep(0.1)
            for i in range(5, 10):
                pub.publish(make_batch(i))
            await got.wait_for(5)
    assert got.resets == ["gap: replay from seq 0 got no answer after 3 attempts; unrecoverable"]
    assert got.batches == expected(range(5, 10))  # held during the replay attempts, then applied
    assert sub.stats.replay_timeouts == 3


# --- bad input, errors ----------------------------------------------------------------------


@contextmanager
def raw_publisher(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    """An XPUB, so the test can wait until the subscription has arrived before sending."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


async def wait_subscribed(xpub: zmq.Socket[bytes]) -> None:
    for _ in range(500):
        if xpub.poll(0):
            assert xpub.recv()[:1] == b"\x01"
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no subscription arrived")


async def test_malformed_messages_are_counted_and_the_next_good_batch_applies(
    endpoint_factory: Endpoints, caplog: pytest.LogCaptureFixture
) -> None:
    got = Collector()
    endpoint = endpoint_factory("pub")
    with raw_publisher(endpoint) as xpub:
        sub = EventSubscriber(endpoint, got.on_batch, on_reset=got.on_reset, name="worker-1")
        async with running(sub):
            await wait_subscribed(xpub)
            good = lambda i: [b"", pack_seq(i), encode_batch(make_batch(i))]  # noqa: E731
            for frames in [
                good(0),
                [b"", pack_seq(1)],  # two frames
                [b"", b"\x00" * 7, encode_batch(make_batch(1))],  # short sequence frame
                [b"", pack_seq(1), b"\xc1 not msgpack"],  # garbage payload, readable seq
                [
                    b"",
                    pack_seq(2),
                    encode_batch(make_batch(2)).replace(b"block_size\x04", b"block_size\xa14"),
                ],
                [b"", b"\xff" * 8, b""],  # a replay end marker has no business on the live socket
                good(3),
                good(4),
            ]:
                xpub.send_multipart(frames)
            await got.wait_for(3)
            await asyncio.sleep(0.05)
    assert got.batches == expected([0, 3, 4])
    assert got.resets == [] and sub.stats.gaps == 0
    assert sub.stats.malformed == 5 and sub.stats.received == 8
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "kvmesh.events" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 5
    assert all(w.startswith("worker-1: dropping malformed KV-event batch") for w in warnings)
    assert "KV-event message must have 3 frames, got 2" in warnings[0]
    assert "sequence frame must be 8 bytes, got 7" in warnings[1]
    assert "(seq 1): malformed KV-event payload" in warnings[2]
    assert "(seq 2): malformed KV event #0: Expected `int`, got `str` - at `$.block_size`" in warnings[3]


async def test_a_duplicated_live_message_is_dropped_not_taken_for_a_restart(
    endpoint_factory: Endpoints,
) -> None:
    got = Collector()
    endpoint = endpoint_factory("pub")
    with raw_publisher(endpoint) as xpub:
        sub = EventSubscriber(endpoint, got.on_batch, on_reset=got.on_reset)
        async with running(sub):
            await wait_subscribed(xpub)
            good = lambda i, salt=0: [b"", pack_seq(i), encode_batch(make_batch(i, salt=salt))]  # noqa: E731
            # seq 1 twice byte for byte is a duplicate; a new seq 0 after seq 2 is a restart
            for frames in [good(0), good(1), good(1), good(2), good(0, salt=9)]:
                xpub.send_multipart(frames)
            await got.wait_for(4)
            await asyncio.sleep(0.05)
    assert sub.stats.duplicates == 1
    assert sub.stats.restarts == 1 and len(got.resets) == 1
    assert got.batches == expected([0, 1, 2]) + expected([0], salt=9)


async def test_on_batch_errors_are_logged_and_the_stream_goes_on(endpoint_factory: Endpoints) -> None:
    got = Collector()

    def on_batch(seq: int, batch: object) -> None:
        got.on_batch(seq, batch)  # type: ignore[arg-type]
        if seq == 2:
            raise RuntimeError("index exploded")

    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        sub = EventSubscriber(pub.endpoint, on_batch, replay_endpoint=pub.replay_endpoint)
        async with running(sub):
            await asyncio.sleep(0.1)
            for i in range(5):
                pub.publish(make_batch(i))
            await got.wait_for(5)
    assert got.seqs == [0, 1, 2, 3, 4] and sub.stats.callback_errors == 1


async def test_socket_error_reconnects_with_back_off(
    endpoint_factory: Endpoints, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    got = Collector()
    real_readable = readiness.readable
    failures = iter([False] * 3 + [True, True])  # fail the 4th and 5th questions, then behave

    def flaky_readable(sock: zmq.Socket[bytes]) -> bool:
        if next(failures, False):
            raise zmq.ZMQError(errno.EIO, "injected failure")
        return real_readable(sock)

    monkeypatch.setattr(readiness, "readable", flaky_readable)  # where the pump asks the SUB socket
    with publisher(endpoint_factory("pub"), endpoint_factory("replay")) as pub:
        sub = EventSubscriber(
            pub.endpoint,
            got.on_batch,
            replay_endpoint=pub.replay_endpoint,
            on_reset=got.on_reset,
            backoff_initial=0.05,
        )
        async with running(sub):
            await asyncio.sleep(0.1)
            for i in range(20):
                pub.publish(make_batch(i))
                await asyncio.sleep(0.01)
            await got.wait_for(20)
    assert got.batches == expected(range(20))
    assert sub.stats.reconnects == 2 and got.resets == []
    waits = [
        r.getMessage().rpartition("reconnecting in ")[2]
        for r in caplog.records
        if "reconnecting in" in r.getMessage()
    ]
    assert waits == ["0.05 s", "0.10 s"]  # two failures in a row: the back-off doubles


async def test_topic_filter(endpoint_factory: Endpoints) -> None:
    mine, other = Collector(), Collector()
    with publisher(endpoint_factory("pub"), topic="kv-rank0") as pub:
        subs = [
            EventSubscriber(pub.endpoint, mine.on_batch, topic=b"kv-rank0"),
            EventSubscriber(pub.endpoint, other.on_batch, topic=b"kv-rank1"),
        ]
        for s in subs:
            s.start()
        try:
            await asyncio.sleep(0.1)
            pub.publish(make_batch(0))
            await mine.wait_for(1)
            await asyncio.sleep(0.05)
        finally:
            for s in subs:
                await s.stop()
    assert mine.seqs == [0] and other.seqs == []


async def test_inproc_between_publisher_thread_and_subscriber_loop() -> None:
    got = Collector()
    # A name of its own each run: the test runs on two event loops in one process, and an inproc
    # name the run before bound can still be held while its sockets close (a CI run failed so).
    name = f"inproc://kvmesh-sub-test-{uuid.uuid4().hex}"
    with publisher(name, f"{name}-replay") as pub:
        pub.publish(make_batch(0))
        sub = EventSubscriber(name, got.on_batch, replay_endpoint=f"{name}-replay")
        async with running(sub):
            await asyncio.sleep(0.05)
            pub.publish(make_batch(1))
            await got.wait_for(2)
    assert got.batches == expected(range(2))


async def test_bad_endpoint_fails_run_with_config_error() -> None:
    sub = EventSubscriber("ipc:///nonexistent-kvmesh-dir/x", Collector().on_batch, bind=True)
    with pytest.raises(
        ConfigError,
        match=r"^cannot bind to KV-event endpoint 'ipc:///nonexistent-kvmesh-dir/x': No such file",
    ):
        await sub.run()


@pytest.mark.parametrize(
    ("endpoint", "replay", "said"),
    [
        ("bogus://x", None, "KV-event endpoint 'bogus://x' is not a ZMQ endpoint"),
        ("tcp:/127.0.0.1:5557", None, "KV-event endpoint 'tcp:/127.0.0.1:5557' is not a ZMQ endpoint"),
        ("tcp://a b:5557", None, "KV-event endpoint 'tcp://a b:5557' has host 'a b', which ZMQ cannot"),
        ("ipc://", None, "KV-event endpoint 'ipc://' names no path"),
        ("ipc://" + "p" * 108, None, "has a path of 108 bytes; a Unix socket path holds at most 107"),
        ("tcp://127.0.0.1:5557", "junk", "KV-event replay endpoint 'junk' is not a ZMQ endpoint"),
    ],
)
def test_an_endpoint_zmq_cannot_connect_is_refused_when_made(
    endpoint: str, replay: str | None, said: str
) -> None:
    """ZMQ refused these only when the socket connected: inside a router's background task, which
    nobody awaited (the worker's events showed as live and none came), or, for a replay endpoint,
    at the first gap, after which the live stream was cut at every retry."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        EventSubscriber(endpoint, Collector().on_batch, replay_endpoint=replay)


def test_resume_from_refuses_a_point_the_wire_cannot_carry() -> None:
    """Sequence numbers are 8 unsigned bytes: resuming past them failed in the background loop at
    every reconnection, when the replay request was written."""
    sub = EventSubscriber("tcp://127.0.0.1:5557", Collector().on_batch)
    for last_seq in (2**64 - 1, 2**70, -2):
        with pytest.raises(ValueError, match="last_seq must be from -1 to 18446744073709551614"):
            sub.resume_from(last_seq)
    sub.resume_from(2**64 - 2)
    assert sub.expected_seq == 2**64 - 1
