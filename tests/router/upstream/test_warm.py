"""kvmesh/router/upstream/warm.py: connections kept ready for each worker's recent bursts, against a
raw loopback server that counts the connections it accepts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.router.upstream.connection import Origin
from kvmesh.router.upstream.forwarder import Forwarder
from kvmesh.router.upstream.warm import keep_warm, stop
from tests.router.servers import wait_until
from tests.router.upstream.test_forwarder import Peer, body_of, ok, raw_server

BURST = 5


async def answer_slowly(peer: Peer) -> None:
    """Answer every request with its own body after 0.1 s, so a burst's requests overlap."""
    while (request := await peer.request()) is not None:
        await asyncio.sleep(0.1)
        await peer.send(ok(request[2], b"connection: keep-alive"))


async def burst(forwarder: Forwarder, url: str) -> None:
    bodies = await asyncio.gather(*(body_of(forwarder, url, b"%d" % i, []) for i in range(BURST)))
    assert bodies == [b"%d" % i for i in range(BURST)]


def idle_count(forwarder: Forwarder, url: str) -> int:
    return len(forwarder._pool._idle.get(Origin.parse(url), []))


@pytest.fixture
async def forwarder() -> AsyncIterator[Forwarder]:
    f = Forwarder(connect_timeout=2.0)
    f._pool._max_idle_secs = 0.8  # (an idle connection ages out within the test)
    yield f
    await f.close()


async def test_a_burst_after_a_quiet_moment_finds_its_connections_ready() -> None:
    forwarder = Forwarder(connect_timeout=2.0, warm=False)  # (warmed by hand, to stop it below)
    pool = forwarder._pool
    pool._max_idle_secs = 0.8  # (an idle connection ages out within the test)
    task = asyncio.get_running_loop().create_task(keep_warm(pool, tick_secs=0.05))
    try:
        async with raw_server(answer_slowly) as raw:
            await burst(forwarder, raw.url)
            assert raw.connections == BURST
            # Quiet for longer than an idle connection is kept: the ones the burst opened are
            # gone, and others, opened since, are ready for the next burst.
            await asyncio.sleep(1.2)
            assert raw.connections > BURST
            assert idle_count(forwarder, raw.url) >= BURST
            # Warming stops here, so every connection opened from now on is a request's own.
            await stop(task)
            await asyncio.sleep(0.05)  # (the server's accepts of the last warm ones)
            before = raw.connections
            await burst(forwarder, raw.url)
            assert raw.connections == before  # no request waited for a connection to open
    finally:
        await stop(task)
        await forwarder.close()


async def test_without_warm_connections_the_same_burst_opens_its_own() -> None:
    forwarder = Forwarder(connect_timeout=2.0, warm=False)
    forwarder._pool._max_idle_secs = 0.8
    try:
        async with raw_server(answer_slowly) as raw:
            await burst(forwarder, raw.url)
            await asyncio.sleep(1.2)
            before = raw.connections
            await burst(forwarder, raw.url)
            assert raw.connections == before + BURST
    finally:
        await forwarder.close()


async def test_a_worker_quiet_for_the_remembered_time_gets_none() -> None:
    forwarder = Forwarder(connect_timeout=2.0, warm=False)
    pool = forwarder._pool
    pool._max_idle_secs = 0.5
    task = asyncio.get_running_loop().create_task(keep_warm(pool, tick_secs=0.05, remember_secs=1.5))
    try:
        async with raw_server(answer_slowly) as raw:
            await burst(forwarder, raw.url)
            await asyncio.sleep(0.8)
            assert raw.connections > BURST  # warm ones replace the aging, while the burst is remembered
            await wait_until(lambda: Origin.parse(raw.url) not in pool._peaks)
            settled = raw.connections
            await asyncio.sleep(1.0)  # (longer than an idle connection is kept)
            assert raw.connections == settled  # nothing is opened for a worker with no traffic
    finally:
        await stop(task)
        await forwarder.close()


async def test_a_worker_that_refuses_stops_being_warmed() -> None:
    forwarder = Forwarder(connect_timeout=2.0, warm=False)
    pool = forwarder._pool
    task = asyncio.get_running_loop().create_task(keep_warm(pool, tick_secs=0.05, remember_secs=30.0))
    try:
        async with raw_server(answer_slowly) as raw:
            await burst(forwarder, raw.url)
            origin = Origin.parse(raw.url)
        pool.close()  # (the server is gone, and with it every connection it had)
        await wait_until(lambda: origin not in pool._peaks)
        await asyncio.sleep(0.2)
        assert not task.done()  # the failures did not end the task that warms every worker
    finally:
        await stop(task)
        await forwarder.close()


async def test_worker_rpcs_and_probes_keep_no_connection_ready(forwarder: Forwarder) -> None:
    async with raw_server(answer_slowly) as raw:
        for _ in range(3):
            assert (await forwarder.get(raw.url))[0] == 200
        await asyncio.sleep(1.2)  # (longer than an idle connection is kept)
        assert raw.connections == 1


async def test_close_stops_warming(forwarder: Forwarder) -> None:
    async with raw_server(answer_slowly) as raw:
        await burst(forwarder, raw.url)
        task = forwarder._warm
        assert task is not None and not task.done()
        await forwarder.close()
        assert task.done()
