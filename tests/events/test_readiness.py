"""kvmesh.events.readiness: waiting for ZMQ sockets on the event loop, over real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import zmq

from kvmesh.events.readiness import SocketWatch, drain, readable, recv_frames


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    tx, rx = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (tx, rx):
        s.setsockopt(zmq.LINGER, 0)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    yield tx, rx
    tx.close(linger=0)
    rx.close(linger=0)


async def _collect(rx: zmq.Socket[bytes], watch: SocketWatch, want: int, limit: int) -> list[bytes]:
    got: list[bytes] = []
    while True:
        watch.clear()
        more = drain(rx, recv_frames, lambda frames: got.append(frames[0]), limit)
        if len(got) >= want:
            return got
        if more:
            await asyncio.sleep(0)
        else:  # emptied: a message that comes now must wake this wait
            await asyncio.wait_for(watch.wait(), 5.0)


async def test_every_message_is_seen_whether_it_comes_alone_or_in_a_burst(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    await _alone_and_in_bursts(*pair)


async def _alone_and_in_bursts(tx: zmq.Socket[bytes], rx: zmq.Socket[bytes]) -> None:
    watch = SocketWatch()
    watch.watch(rx)

    async def send() -> None:
        for i in range(300):
            tx.send(b"%d" % i)
            if i % 50 == 0:
                await asyncio.sleep(0.005)  # a pause: the reader has emptied the socket and waits
            elif i % 7 == 0:
                await asyncio.sleep(0)

    sender = asyncio.create_task(send())
    got = await _collect(rx, watch, 300, limit=16)  # a small limit: bursts span several turns
    await sender
    watch.unwatch(rx)
    assert got == [b"%d" % i for i in range(300)]


async def test_a_message_sent_before_the_socket_is_watched_is_not_missed(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    tx, rx = pair
    tx.send(b"early")
    deadline = time.monotonic() + 5
    while not readable(rx):  # (its arrival consumes the descriptor's signal before anyone waits)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    watch = SocketWatch()
    watch.watch(rx)
    await asyncio.wait_for(watch.wait(), 1.0)  # watching starts awake: the caller asks the socket
    assert await _collect(rx, watch, 1, limit=4) == [b"early"]
    watch.close()


async def test_wake_ends_a_wait_and_a_timeout_ends_it_too() -> None:
    watch = SocketWatch()
    waiter = asyncio.create_task(watch.wait())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    watch.wake()
    await asyncio.wait_for(waiter, 1.0)
    watch.clear()
    t0 = time.monotonic()
    await watch.wait(0.05)
    assert time.monotonic() - t0 >= 0.04


async def test_drain_stops_at_its_limit_and_says_more_is_there(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    tx, rx = pair
    for i in range(5):
        tx.send(b"%d" % i)
    deadline = time.monotonic() + 5
    got: list[list[bytes]] = []
    while len(got) < 3:  # (the messages reach the socket over a few milliseconds)
        assert time.monotonic() < deadline
        drain(rx, recv_frames, got.append, 3 - len(got))
        await asyncio.sleep(0.001)
    while not readable(rx):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    assert drain(rx, recv_frames, got.append, 1) is True  # stopped at the limit, more there
    assert drain(rx, recv_frames, got.append, 10) is False  # emptied
    assert [f[0] for f in got] == [b"0", b"1", b"2", b"3", b"4"]


async def test_an_unwatched_socket_no_longer_wakes_the_wait(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    tx, rx = pair
    watch = SocketWatch()
    watch.watch(rx)
    watch.unwatch(rx)  # (before closing a socket: its descriptor must be off the loop by then)
    watch.clear()
    tx.send(b"unheard")
    t0 = time.monotonic()
    await watch.wait(0.3)
    assert time.monotonic() - t0 >= 0.25  # the message came and woke nothing
    deadline = time.monotonic() + 5
    while not readable(rx):  # it is there all the same
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
