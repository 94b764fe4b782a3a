"""The ``kvmesh`` publisher built by vLLM's own EventPublisherFactory, fed by a real vLLM
KVCacheManager caching and evicting real requests' blocks (vLLM 0.33.0 code on CPU)."""

from __future__ import annotations

import asyncio
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import msgspec
    import zmq
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory

    from kvmesh.adapters.vllm.plugin import register
    from kvmesh.adapters.vllm.publisher import KvMeshPublisher
    from kvmesh.events.subscriber import EventSubscriber
    from kvmesh.events.wire import BlockStored, EventBatch, decode_batch
    from kvmesh.hashing import block_hashes
    from kvmesh.router.core.event_index import PrefixIndex
    from tests.engines.vllm_helpers import (
        BLOCK_SIZE,
        LoopbackEngineCore,
        PromptRunner,
        make_hasher,
        make_manager,
        pool_hashes,
        prompts,
    )
    from tests.events.eventkit import free_tcp6_port, ipv6_loopback

pytestmark = pytest.mark.engine_vllm

WORKER = ("vllm-0", 0)


def _config(tmp_path: Path, **kw: Any) -> KVEventsConfig:
    register()
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="kvmesh",
        endpoint=f"ipc://{tmp_path}/events",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        **kw,
    )


@pytest.fixture
def publisher(tmp_path: Path) -> Any:
    pub = EventPublisherFactory.create(_config(tmp_path, buffer_steps=10_000), data_parallel_rank=0)
    yield pub
    pub.shutdown()


def test_factory_builds_the_kvmesh_publisher_with_vllms_per_rank_endpoints() -> None:
    register()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="kvmesh",
        endpoint="inproc://kvmesh-test-events",
        replay_endpoint="inproc://kvmesh-test-replay",
    )
    pub = EventPublisherFactory.create(config, data_parallel_rank=2)
    try:
        assert isinstance(pub, KvMeshPublisher)
        # vLLM's own rule for a data-parallel rank's endpoints (here: an inproc suffix) is reused.
        reported = pub.get_publisher_config()
        assert reported.endpoint == "inproc://kvmesh-test-events_dp2"
        assert reported.replay_endpoint == "inproc://kvmesh-test-replay_dp2"
        assert reported.publisher == "zmq"  # the wire protocol a consumer speaks: vLLM's own
    finally:
        pub.shutdown()


@pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback")
async def test_on_an_ipv6_address_the_kvmesh_publisher_binds_and_a_router_follows() -> None:
    """vLLM's config on an IPv6 node names an IPv6 address: ZMQ sockets speak IPv4 alone unless
    told, so the publisher's bind failed ("No such device") and the engine did not start, and a
    router's connect to such an address was never made."""
    register()
    port, replay = free_tcp6_port(), free_tcp6_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="kvmesh",
        endpoint=f"tcp://[::1]:{port}",
        replay_endpoint=f"tcp://[::1]:{replay}",
    )
    publisher = EventPublisherFactory.create(config, data_parallel_rank=0)
    delivered: list[EventBatch] = []
    subscriber = EventSubscriber(
        publisher.endpoint,
        lambda seq, batch: delivered.append(batch),
        replay_endpoint=publisher.replay_endpoint,
    )
    try:
        assert publisher.endpoint == f"tcp://[::1]:{port}"
        subscriber.resume_from(-1)  # from seq 0, through the replay socket if the live one is late
        task = subscriber.start()
        PromptRunner(make_manager(num_blocks=24), make_hasher(), publisher).run(
            next(prompts(seed=5, count=1))
        )
        deadline = time.monotonic() + 10
        while not delivered and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert delivered and isinstance(delivered[0].events[0], BlockStored)
    finally:
        await subscriber.stop()
        task.cancel()
        publisher.shutdown()


def _workload(runner: PromptRunner) -> list[list[int]]:
    """Shared-prefix prompts through a small pool: caching, prefix hits, LRU evictions, and
    fully cached prompts re-run (vLLM then caches their last block a second time)."""
    seen: list[list[int]] = []
    for i, tokens in enumerate(prompts(seed=3, count=40)):
        runner.run(tokens)
        seen.append(tokens)
        if i % 7 == 6:
            runner.run(seen[-2])  # a repeat: prefix hit plus a duplicate last block
    return seen


async def test_vllm_events_reach_a_kvmesh_subscriber_unchanged_and_its_index_matches_the_pool(
    tmp_path: Path, publisher: KvMeshPublisher
) -> None:
    manager = make_manager(num_blocks=24)
    runner = PromptRunner(manager, make_hasher(), publisher)

    index = PrefixIndex(block_size=BLOCK_SIZE)
    delivered: list[int] = []

    def on_batch(seq: int, batch: EventBatch) -> None:
        index.apply(WORKER, batch.events)
        delivered.append(seq)

    subscriber = EventSubscriber(publisher.endpoint, on_batch, replay_endpoint=publisher.replay_endpoint)
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(publisher.endpoint)
    task = subscriber.start()
    try:
        await asyncio.sleep(0.2)  # let both subscribers join (a late one recovers through replay)
        sent: list[bytes] = []
        original = publisher.publish

        def publish_and_record(batch: Any) -> None:
            original(batch)
            sent.append(msgspec.msgpack.encode(batch))  # what vLLM's own zmq publisher would send

        publisher.publish = publish_and_record  # type: ignore[method-assign]
        seen = _workload(runner)
        last = len(sent) - 1
        deadline = time.monotonic() + 10
        while (not delivered or delivered[-1] < last) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert delivered == list(range(len(sent)))

        # Unchanged wire format: every payload on the wire is vLLM's own msgpack, byte for byte.
        received = 0
        while raw.poll(100):
            _, seq, payload = raw.recv_multipart()
            assert payload == sent[int.from_bytes(seq, "big")]
            received += 1
        assert received > 0
    finally:
        await subscriber.stop()
        task.cancel()
        raw.close(linger=0)

    # The workload evicted (so removals were exercised) and re-cached hashes twice.
    removed = sum(
        1 for payload in sent for e in decode_batch(payload).events if type(e).__name__ == "BlockRemoved"
    )
    assert removed > 0
    # The router's index sees what vLLM's pool really holds: same block count, and for every
    # prompt the same prefix depth as vLLM's own prefix-cache lookup.
    cached = pool_hashes(manager)
    assert index.block_count(WORKER) == len(cached)
    assert sum(1 for tokens in seen if runner.cached_hit(tokens)) >= 3  # the comparison has teeth
    for tokens in seen:
        depth = index.find_matches(block_hashes(tokens, BLOCK_SIZE)).get(WORKER, 0)
        assert depth * BLOCK_SIZE == runner.cached_hit(tokens), tokens


def test_kv_state_is_the_pools_cached_set_with_the_last_published_seq(publisher: KvMeshPublisher) -> None:
    manager = make_manager(num_blocks=24)
    hasher = make_hasher()
    runner = PromptRunner(manager, hasher, publisher)
    seen = _workload(runner)

    # Through vLLM's utility-call dispatch and codec, as the API server asks the engine core.
    core = LoopbackEngineCore(manager, hasher, publisher)
    state = core.call("kvmesh_rpc", "kv_state", {})
    assert state["dp_rank"] == 0
    assert state["last_seq"] == runner.steps_published - 1
    stored = [msgspec.convert(e, BlockStored) for e in state["events"]]
    # Parents come first: every parent of an event was listed before it (or is not cached).
    cached = pool_hashes(manager)
    listed: set[int] = set()
    for event in stored:
        assert (
            event.parent_block_hash is None
            or event.parent_block_hash in listed
            or event.parent_block_hash not in cached
        )
        listed.update(event.block_hashes)  # type: ignore[arg-type]
    assert listed == cached
    # A router cold-starting from it matches vLLM's prefix-cache lookups.
    index = PrefixIndex(block_size=BLOCK_SIZE)
    index.load_stored(WORKER, stored)
    for tokens in seen:
        depth = index.find_matches(block_hashes(tokens, BLOCK_SIZE)).get(WORKER, 0)
        assert depth * BLOCK_SIZE == runner.cached_hit(tokens)


def test_kv_state_without_the_kvmesh_publisher_says_what_to_change() -> None:
    manager = make_manager(num_blocks=8)
    core = LoopbackEngineCore(manager, make_hasher(), publisher=None)
    register()
    assert "kvmesh's publisher" in core.call("kvmesh_rpc", "kv_state", {})["error"]
