"""The NATS event plane against a real nats-server: the ZMQ subscriber's scenarios (late start,
gap, restart, cold start), a rebuild from 10,000 stored batches, and a node lost from a cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from kvmesh.events.nats_link import NatsLink, NatsOptions, import_nats
from kvmesh.events.nats_publisher import NatsBatchPublisher
from kvmesh.events.nats_subscriber import NatsEventSubscriber
from kvmesh.events.wire import encode_batch
from tests.events.eventkit import Collector, make_batch
from tests.events.natskit import NatsNode, nats_cluster, nats_server


@pytest.fixture
def node() -> Iterator[NatsNode]:
    with nats_server() as n:
        yield n


@pytest.fixture
async def link(node: NatsNode) -> AsyncIterator[NatsLink]:
    lk = NatsLink(NatsOptions((node.url,)), name="test-router")
    lk.start()
    assert await lk.wait_connected(10)
    yield lk
    await lk.close()


async def _drain(pub: NatsBatchPublisher) -> None:
    for _ in range(3000):
        if pub.backlog == 0:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{pub.backlog} batches never reached the stream")


def _follow(link: NatsLink, subject: str, c: Collector) -> NatsEventSubscriber:
    sub = NatsEventSubscriber(link, subject, c.on_batch, on_reset=c.on_reset, name="t")
    sub.start()
    return sub


async def test_live_batches_arrive_in_order_with_the_publishers_bytes(link: NatsLink) -> None:
    pub = NatsBatchPublisher(link.options, "w1")
    c = Collector()
    sub = _follow(link, pub.subject, c)
    try:
        batches = [make_batch(i) for i in range(50)]
        for b in batches:
            pub.publish(b)
        await c.wait_for(50)
        assert c.seqs == list(range(50))
        assert [encode_batch(b) for _, b in c.batches] == [encode_batch(b) for b in batches]
        assert c.resets == []
    finally:
        await sub.stop()
        pub.close()


@pytest.mark.slow
async def test_a_late_router_rebuilds_10000_batches_from_the_stream(link: NatsLink) -> None:
    pub = NatsBatchPublisher(link.options, "busy")
    try:
        for i in range(10_000):
            pub.publish(make_batch(i))
        await _drain(pub)
        c = Collector()
        sub = _follow(link, pub.subject, c)
        await c.wait_for(10_000, timeout=60)
        assert c.seqs == list(range(10_000))
        assert c.batches[1234][1] == make_batch(1234)
        assert c.resets == [] and sub.stats.duplicates == 0
        await sub.stop()
    finally:
        pub.close()


async def test_resume_from_a_snapshot_skips_what_it_holds(link: NatsLink) -> None:
    """Cold start: kv_state said seq 29 is in the snapshot; the stream supplies the rest."""
    pub = NatsBatchPublisher(link.options, "w2")
    try:
        for i in range(40):
            pub.publish(make_batch(i))
        await _drain(pub)
        c = Collector()
        sub = NatsEventSubscriber(link, pub.subject, c.on_batch, on_reset=c.on_reset)
        sub.resume_from(29)
        sub.start()
        await c.wait_for(10)
        await asyncio.sleep(0.1)
        assert c.seqs == list(range(30, 40)) and c.resets == []
        # An older snapshot later: the history hands the batches out again at once.
        sub.resume_from(32)
        assert c.seqs[10:] == list(range(33, 40))
        # Older than the history: the stream is read again for that subject.
        sub.resume_from(5)
        await c.wait_for(17 + 34)
        assert c.seqs[17:] == list(range(6, 40)) and c.resets == []
        await sub.stop()
    finally:
        pub.close()


async def test_a_range_the_stream_no_longer_holds_is_reported_then_resumed(link: NatsLink) -> None:
    pub = NatsBatchPublisher(link.options, "gappy")
    c = Collector()
    sub = _follow(link, pub.subject, c)
    try:
        payloads = [encode_batch(make_batch(i)) for i in range(30)]
        for i in range(10):
            pub.publish_payload(i, payloads[i])
        await c.wait_for(10)
        for i in range(20, 30):  # 10..19 never reached the stream (dropped while NATS was away)
            pub.publish_payload(i, payloads[i])
        await c.wait_for(20)
        assert c.seqs == [*range(10), *range(20, 30)]
        assert len(c.resets) == 1 and "10..19" in c.resets[0]
        assert sub.stats.unrecoverable == 1
    finally:
        await sub.stop()
        pub.close()


async def test_a_stream_purged_under_a_late_router_asks_for_a_cold_start(link: NatsLink) -> None:
    pub = NatsBatchPublisher(link.options, "aged")
    try:
        for i in range(20):
            pub.publish(make_batch(i))
        await _drain(pub)
        # The stream's age limit took seqs 0..14: keep only the last 5 messages of the subject.
        await link.js.purge_stream(link.options.stream, subject=pub.subject, keep=5)
        c = Collector()
        resumed: list[int] = []
        sub: NatsEventSubscriber

        def on_reset(reason: str) -> None:
            c.on_reset(reason)
            sub.resume_from(16)  # what a kv_state cold start would report
            resumed.append(16)

        sub = NatsEventSubscriber(link, pub.subject, c.on_batch, on_reset=on_reset)
        sub.start()
        await c.wait_for(3)
        await asyncio.sleep(0.1)
        assert resumed == [16] and "0..14" in c.resets[0]
        assert c.seqs == [17, 18, 19]
        await sub.stop()
    finally:
        pub.close()


async def test_a_publisher_restart_resets_live_and_is_invisible_to_a_late_router(link: NatsLink) -> None:
    first = NatsBatchPublisher(link.options, "engine")
    c = Collector()
    live = _follow(link, first.subject, c)
    for i in range(5):
        first.publish(make_batch(i))
    await c.wait_for(5)
    first.close()
    second = NatsBatchPublisher(link.options, "engine")  # the engine restarted: counts from 0
    try:
        for i in range(3):
            second.publish(make_batch(100 + i))
        await c.wait_for(8)
        assert c.seqs == [0, 1, 2, 3, 4, 0, 1, 2]
        assert len(c.resets) == 1 and "restarted" in c.resets[0]
        await _drain(second)
        late = Collector()
        sub = _follow(link, second.subject, late)
        await late.wait_for(3)
        await asyncio.sleep(0.1)
        assert late.seqs == [0, 1, 2] and late.batches[0][1] == make_batch(100)
        assert late.resets == []
        await sub.stop()
    finally:
        await live.stop()
        second.close()


async def test_a_router_cut_off_from_nats_catches_up_when_it_returns(node: NatsNode, link: NatsLink) -> None:
    pub = NatsBatchPublisher(link.options, "w3")
    c = Collector()
    sub = _follow(link, pub.subject, c)
    try:
        for i in range(10):
            pub.publish(make_batch(i))
        await c.wait_for(10)
        node.stop()
        for _ in range(200):
            if not link.connected:
                break
            await asyncio.sleep(0.02)
        assert not link.connected and link.describe()["connected"] is False
        for i in range(10, 30):  # the engine goes on; its publisher holds the batches
            pub.publish(make_batch(i))
        node.start()  # same port, same store
        await c.wait_for(30, timeout=30)
        assert c.seqs == list(range(30)) and c.resets == []
        assert link.connected and link.disconnects >= 1
    finally:
        await sub.stop()
        pub.close()


@pytest.mark.slow
async def test_killing_one_node_of_three_loses_nothing() -> None:
    import_nats()
    with nats_cluster(3) as nodes:
        options = NatsOptions(tuple(n.url for n in nodes), stream_replicas=3)
        link = NatsLink(options, name="test-router")
        link.start()
        assert await link.wait_connected(20)
        pub = NatsBatchPublisher(NatsOptions(tuple(n.url for n in reversed(nodes)), stream_replicas=3), "ha")
        c = Collector()
        sub = _follow(link, pub.subject, c)
        try:
            for i in range(100):
                pub.publish(make_batch(i))
            await c.wait_for(100, timeout=30)
            info = await link.js.stream_info(options.stream)
            leader = info.cluster.leader
            victim = next(n for n in nodes if n.name == leader)
            victim.stop()  # the stream's leader: the remaining two elect a new one
            for i in range(100, 300):
                pub.publish(make_batch(i))
                if i % 20 == 0:
                    await asyncio.sleep(0.01)
            await c.wait_for(300, timeout=60)
            assert c.seqs == list(range(300))
            assert c.resets == [] and sub.stats.unrecoverable == 0
        finally:
            await sub.stop()
            pub.close()
            await link.close()
